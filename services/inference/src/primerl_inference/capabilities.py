"""What a replica can be asked for (the capability names of its GetServiceInfo), and the
error for a request that needs one it lacks."""

from __future__ import annotations

from primerl_common.errors import FailedPrecondition
from primerl_common.lora import CAPABILITY_LORA

__all__ = [
    "CAPABILITY_KV_TRANSFER",
    "CAPABILITY_LORA",
    "CAPABILITY_PROMPT_LOGPROBS",
    "CAPABILITY_ROUTED_EXPERTS",
    "CAPABILITY_WEIGHTS_COLLECTIVE",
    "CAPABILITY_WEIGHTS_DELTA",
    "CAPABILITY_WEIGHTS_HF",
    "CAPABILITY_WEIGHTS_KERNEL",
    "CAPABILITY_WEIGHTS_SHARED_FS",
    "CAPABILITY_WEIGHTS_SHM",
    "CAPABILITY_WEIGHTS_STRIPED",
    "missing_capability",
]

CAPABILITY_PROMPT_LOGPROBS = "generate.prompt_logprobs"
CAPABILITY_ROUTED_EXPERTS = "generate.routed_experts"
CAPABILITY_KV_TRANSFER = "generate.kv_transfer"
CAPABILITY_WEIGHTS_HF = "weights.format.hf"
CAPABILITY_WEIGHTS_KERNEL = "weights.format.kernel"
CAPABILITY_WEIGHTS_DELTA = "weights.delta"
CAPABILITY_WEIGHTS_SHARED_FS = "weights.shared_fs"
# Loads an update from a folder in shared memory of this host (begin.shm_path); listed with
# the attributes that tell a writer whether it shares that memory (primerl_common.weights.shared_memory).
CAPABILITY_WEIGHTS_SHM = "weights.shm"
# Takes an update striped over several UpdateWeights streams (begin.stripe_session).
CAPABILITY_WEIGHTS_STRIPED = "weights.striped"
# Joins collective groups of this backend to receive updates (gloo everywhere, NCCL on GPUs).
CAPABILITY_WEIGHTS_COLLECTIVE = "weights.collective.{}"


def missing_capability(capability: str, feature: str) -> FailedPrecondition:
    return FailedPrecondition(
        f"{feature} is not available on this replica (capability {capability})",
        subject=capability,
        reason="CAPABILITY_MISSING",
    )
