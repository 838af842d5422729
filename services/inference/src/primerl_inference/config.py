"""Configuration of the inference service (flags > PRIMERL_INFERENCE_* > TOML > defaults)."""

from __future__ import annotations

import json
import pathlib
from typing import Literal, get_args

from pydantic import Field, ValidationInfo, field_validator, model_validator

from primerl_common.config import Section, ServerConfig, ServiceConfig, service_settings

RoleName = Literal["both", "prefill", "decode"]
EngineDtype = Literal["auto", "float32", "bfloat16", "float16"]


# The max_lora_rank values vLLM accepts (vllm.config.lora.MaxLoRARanks).
_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class EngineConfig(Section):
    """The one vLLM engine of this process."""

    model: pathlib.Path = Field(description="local Hugging Face model folder (config.json + safetensors)")
    dtype: EngineDtype = Field(
        default="auto",
        validate_default=True,
        description="weights and activations; auto: the checkpoint's (config.json's dtype or torch_dtype, float32 "
        "when it names none; float32 too, where vLLM's own auto would take 16 bits), the dtype a trainer "
        "starting from the same checkpoint trains in",
    )
    max_model_len: int | None = Field(
        default=None, ge=2, description="prompt + completion tokens per request; unset: the model's maximum"
    )
    max_num_seqs: int = Field(default=64, ge=1, description="requests decoded together in one step")
    enable_prefix_caching: bool = True
    kv_cache_gib: float | None = Field(
        default=None,
        gt=0,
        description="KV cache size; unset: on GPU, gpu_memory_utilization; on CPU, what max_num_seqs sequences of "
        "max_model_len tokens need (the model's KV bytes per token from its config), at least 0.25 and at most "
        "cpu_kv_cache_max_gib. On CPU the environment variable VLLM_CPU_KVCACHE_SPACE (GiB), when set, "
        "takes precedence",
    )
    cpu_kv_cache_max_gib: float = Field(
        default=4.0,
        gt=0,
        description="CPU, kv_cache_gib and VLLM_CPU_KVCACHE_SPACE unset: the most the KV cache is given "
        "(vLLM's own default would be most of the machine's memory)",
    )
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description="GPU only, when kv_cache_gib is unset")
    enforce_eager: bool = Field(default=False, description="no torch.compile / CUDA graphs (faster start on CPU)")
    seed: int = Field(default=0, description="engine seed for requests without their own")
    capture_routed_experts: bool = Field(
        default=True,
        description="MoE models: capture the experts each token is routed to, for requests that ask for them",
    )
    max_images_per_prompt: int = Field(
        default=8,
        ge=0,
        description="vision-language models (a vision_config in config.json): the most images one prompt may "
        "hold (vLLM's limit_mm_per_prompt; videos are not taken); 0: images off",
    )
    enable_lora: bool = False
    max_lora_rank: int = Field(
        default=16,
        ge=1,
        le=_VLLM_LORA_RANKS[-1],
        description=f"adapters of rank up to this are taken; vLLM sizes its buffers by one of "
        f"{', '.join(map(str, _VLLM_LORA_RANKS))}: a rank between two is rounded up",
    )
    max_loras: int = Field(default=4, ge=1, description="adapters usable in one batch")

    @field_validator("max_lora_rank")
    @classmethod
    def _a_rank_vllm_takes(cls, rank: int) -> int:
        return next(allowed for allowed in _VLLM_LORA_RANKS if allowed >= rank)

    @field_validator("model")
    @classmethod
    def _model_is_a_local_checkpoint(cls, model: pathlib.Path) -> pathlib.Path:
        if not (model / "config.json").is_file():
            raise ValueError(f"{model} is not a model folder (no config.json)")
        if not any(model.glob("*.safetensors")):
            raise ValueError(f"{model} holds no *.safetensors file")
        return model

    @field_validator("dtype")
    @classmethod
    def _auto_is_the_checkpoints(cls, dtype: EngineDtype, info: ValidationInfo) -> EngineDtype:
        model = info.data.get("model")
        if dtype != "auto" or model is None:  # no model: its own error says why
            return dtype
        hf_config = json.loads((model / "config.json").read_text())
        name = hf_config.get("dtype") or hf_config.get("torch_dtype") or "float32"
        if name not in get_args(EngineDtype):
            raise ValueError(f"{model}/config.json names dtype {name!r}, which the engine does not serve: set it")
        return name


class ReplicaConfig(Section):
    """How this replica presents itself to routers."""

    id: str = Field(default="", description="replica id in responses and load reports; empty: the host name")
    role: RoleName = Field(
        default="both",
        description="what routers send here: whole requests (both), or one half of a prefill/decode hand-off "
        "(prefill, decode; a replica serves those with kv_cache_pool enabled, saving or loading)",
    )
    initial_policy_version: int = Field(default=0, ge=0, description="policy version of the weights in engine.model")


def _default_shm_folder() -> pathlib.Path | None:
    shm = pathlib.Path("/dev/shm")
    return shm if shm.is_dir() else None


class WeightsConfig(Section):
    staging_dir: pathlib.Path | None = Field(
        default=None,
        description="where an incoming weight update is staged for the engine process to map; "
        "empty: /dev/shm when present (memory, no disk writes), else the temp folder",
    )
    shm_folder: pathlib.Path | None = Field(
        default_factory=_default_shm_folder,
        description="the host's shared-memory folder (tmpfs): a weight broadcaster on this host that sees the same "
        "one (GetServiceInfo attributes host.boot_id, weights.shm_id, weights.shm_folder) places each version in it "
        "once and this replica loads from there (capability weights.shm); default /dev/shm when present; empty: "
        "updates come over gRPC",
    )

    @field_validator("staging_dir", "shm_folder")
    @classmethod
    def _is_a_folder(cls, folder: pathlib.Path | None) -> pathlib.Path | None:
        if folder is not None and not folder.is_dir():
            raise ValueError(f"{folder} is not a folder")
        return folder if folder is None else folder.absolute()


class LoadReportConfig(Section):
    watch_interval_ms: int = Field(default=1000, ge=10, description="WatchLoad interval when the client sets none")


class KvCachePoolConfig(Section):
    """The pooled KV cache (primerl-kvstore): prefixes another replica computed are loaded
    instead of recomputed, through primerl_inference.kv_connector."""

    enabled: bool = False
    metadata_address: str | None = Field(default=None, description="host:port of the kvstore metadata role")
    storage_address: str | None = Field(
        default=None, description="host:port of the storage node blocks are written to; unset: the emptiest one"
    )
    mode: Literal["both", "save", "load"] = Field(
        default="both", description="save computed blocks, load hits, or both"
    )
    model: str = Field(default="", description="model name in the pool's keys; empty: the model folder's name")
    lease_ms: int = Field(default=30_000, ge=1, description="how long blocks being loaded are leased")
    timeout_s: float = Field(default=30.0, gt=0, description="per pool call")

    @model_validator(mode="after")
    def _enabled_needs_metadata_address(self) -> KvCachePoolConfig:
        if self.enabled and not self.metadata_address:
            raise ValueError("kv_cache_pool.metadata_address is required when kv_cache_pool.enabled is true")
        return self


class InferenceConfig(ServiceConfig):
    """primerl inference: one vLLM engine behind gRPC: token-in/token-out generation with per-token policy
    versions, in-place weight updates, routed-expert capture, LoRA adapters.
    """

    service_name = "inference"
    model_config = service_settings("inference")

    server: ServerConfig = ServerConfig(port=50053)
    engine: EngineConfig
    replica: ReplicaConfig = ReplicaConfig()
    weights: WeightsConfig = WeightsConfig()
    load_report: LoadReportConfig = LoadReportConfig()
    kv_cache_pool: KvCachePoolConfig = KvCachePoolConfig()
