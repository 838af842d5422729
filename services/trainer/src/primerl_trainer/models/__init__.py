"""The trainer's model implementations (torchtitan's layout: one folder per architecture
with model.py, state_dict_adapter.py and parallelize.py) and the registry that loads them
from, and exports them to, Hugging Face checkpoints."""

from primerl_trainer.models.common.attention import ATTENTION_BACKENDS, AttentionBackend
from primerl_trainer.models.common.outputs import CausalLMOutput
from primerl_trainer.models.hf import HFCausalLM
from primerl_trainer.models.moe import EXPERTS_IMPLS, ExpertsImpl
from primerl_trainer.models.registry import (
    IMPLS,
    MODEL_SPECS,
    Impl,
    ModelSpec,
    export_hf_state_dict,
    load_model,
    model_spec_of,
    read_hf_config,
    read_hf_state_dict,
)

__all__ = [
    "ATTENTION_BACKENDS",
    "EXPERTS_IMPLS",
    "IMPLS",
    "MODEL_SPECS",
    "AttentionBackend",
    "CausalLMOutput",
    "ExpertsImpl",
    "HFCausalLM",
    "Impl",
    "ModelSpec",
    "export_hf_state_dict",
    "load_model",
    "model_spec_of",
    "read_hf_config",
    "read_hf_state_dict",
]
