"""GLM-5: GLM-4.5's composition (Qwen3-MoE's: expert parallel first, then activation
checkpointing, compile and FSDP2). The indexers' frozen weights are sharded with their block.
Compile takes the blocks without fullgraph: the indexer's selection (a loop over query chunks)
and the flex BlockMask of the selection are built eagerly (common/sparse_attention.py)."""

from typing import Any

from primerl_trainer.models.glm_moe_dsa.model import GlmMoeDsaModel
from primerl_trainer.models.qwen3_moe.parallelize import parallelize_qwen3_moe


def parallelize_glm_moe_dsa(model: GlmMoeDsaModel, **kwargs: Any) -> GlmMoeDsaModel:
    """In place; returns the model. The arguments are parallelize_qwen3_moe's."""
    return parallelize_qwen3_moe(model, compile_fullgraph=False, **kwargs)
