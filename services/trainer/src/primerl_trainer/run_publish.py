"""Publishing one run of a RunSet (runs.py) as its own LoRA adapter: named by the run id, its
version the run's step, at the run's rank and alpha.

The tensors are what a model built with `apply_lora` at the run's rank publishes
(`export.exported_tensors(kind="adapter")`): the same conversion to PEFT's names, fed the run's
A and B cut to its rank rather than the model's, which are padded to the largest rank of any run.
The broadcaster keeps versions per adapter name, so each run's versions count on their own.

Collective for a sharded model: every rank calls these with the same arguments (the run's
tensors are gathered whole when the call returns); only the destination sends the stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2
from primerl_common.tensors import DEFAULT_CHUNK_BYTES
from primerl_trainer.export import count_tensors, exported_adapter_tensors
from primerl_trainer.publish import AdapterInfo, publish_requests

if TYPE_CHECKING:
    from primerl_trainer.runs import RunSet

__all__ = ["run_adapter_tensors", "run_publish_requests"]


def run_adapter_tensors(run_set: RunSet, run_id: str, *, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The run's adapter under PEFT's names (`base_model.model.<HF module>.lora_A.weight` [rank,
    in], `.lora_B.weight` [out, rank]) in `dtype`, A and B of the run's rank; its scale is the
    run's alpha / rank. The gather happens in the call; the conversion as the tensors are read."""
    tensors = run_set.adapter_tensors(run_id)
    return exported_adapter_tensors(run_set.model, tensors.items(), dtype=dtype)


def run_publish_requests(
    run_set: RunSet,
    run_id: str,
    *,
    dtype: torch.dtype,
    model_type: str,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    owner: str = "",
) -> Iterator[weight_broadcaster_pb2.PublishWeightsRequest]:
    """The PublishWeights stream of the run's adapter (`publish.publish_requests`'): adapter name
    the run id, policy version the run's step, its rank and alpha, and the number of tensors and
    bytes its rank makes. `model_type`: the HF config's (the broadcaster's kernel layout).
    `owner`: the run's owner, whom replicas then serve the adapter to alone ("": anyone)."""
    config = run_set.config_of(run_id)
    tensors = run_set.adapter_tensors(run_id)
    planned = ((name, torch.empty(t.shape, dtype=t.dtype, device="meta")) for name, t in tensors.items())
    num_tensors, num_bytes = count_tensors(exported_adapter_tensors(run_set.model, planned, dtype=dtype))
    return publish_requests(
        exported_adapter_tensors(run_set.model, tensors.items(), dtype=dtype),
        policy_version=run_set.step_of(run_id),
        kind="adapter",
        num_tensors=num_tensors,
        num_bytes=num_bytes,
        adapter=AdapterInfo(run_id, config.rank, config.alpha, owner=owner),
        chunk_bytes=chunk_bytes,
        model_type=model_type,
    )
