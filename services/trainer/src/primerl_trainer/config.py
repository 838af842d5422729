"""Configuration of the trainer (flags > PRIMERL_TRAINER_* > TOML > defaults)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from primerl_common.config import Section, ServerConfig, ServiceConfig, service_settings
from primerl_common.lora import adapter_name_problem
from primerl_common.stripes import DEFAULT_STREAMS
from primerl_trainer.config_types import (
    AttentionBackend,
    DeviceType,
    ExpertsImpl,
    Impl,
    LRScheduleConfig,
    OptimizerConfig,
    RLLossConfig,
    TrainingMode,
)

__all__ = [
    "BatchLimitsConfig",
    "CheckpointConfig",
    "DTypeName",
    "ExportConfig",
    "LoRAConfig",
    "ModelConfig",
    "ParallelConfig",
    "PublishConfig",
    "RunQuota",
    "RunsConfig",
    "SFTConfig",
    "TrainerConfig",
]

DTypeName = Literal["float32", "bfloat16"]


class ModelConfig(Section):
    path: str = Field(description="Hugging Face model folder (config.json, safetensors, tokenizer)")
    impl: Impl = Field(default="auto", description="auto: own implementation where one exists, else transformers'")
    dtype: DTypeName = Field(default="float32", description="weights and optimizer state (the master copy)")
    compute_dtype: DTypeName = Field(default="bfloat16", description="dtype the layers compute in (FSDP's)")
    attn_backend: AttentionBackend = Field(default="sdpa", description="sdpa (everywhere) or flex (GPU, packed)")
    experts_impl: ExpertsImpl = "auto"
    ep_comm_backend: Literal["torch", "deepep"] = Field(
        default="torch",
        description="how expert parallel moves tokens: torch (all-to-all-v through torch.distributed, gloo or NCCL) "
        "or deepep (DeepEP's kernels; needs the deep_ep package)",
    )
    activation_checkpointing: bool = False
    compile: bool = False
    train_vision_encoder: bool = Field(
        default=False,
        description="vision-language models: train the vision encoder (the ViT and its patch and deepstack "
        "mergers) with the language model; false: it is frozen (no gradients, no optimizer state), yet "
        "loaded, checkpointed, exported and published with the rest; a text model refuses true",
    )
    fp8: bool = Field(
        default=False,
        description="the decoder blocks' linear layers and experts run their products forward and backward in "
        "float8 e4m3 with block scales (1x128 activation tiles, 128x128 weight blocks: DeepSeek-V3's recipe); "
        "weights and optimizer state keep model.dtype; the routers, embedding, vocabulary projection, norms, "
        "attention and loss as without; own implementations only, no LoRA yet",
    )
    fp8_backend: Literal["scaled_mm", "deep_gemm", "emulated"] = Field(
        default="scaled_mm",
        description="model.fp8's products: scaled_mm (cuBLAS's block-scaled FP8 kernels and the project's Triton "
        "kernels for the experts, Hopper GPUs: compute capability 9.x), deep_gemm (the same, with the experts' "
        "forward and input-gradient products on DeepGEMM's kernels, the same numbers; DeepGEMM built from "
        "source, services/trainer/README.md) or emulated (the same quantization with float32 products of the "
        "dequantized operands, on any device: slow, for checking the numerics and CPU tests)",
    )

    fp8_weight_cache: bool = Field(
        default=False,
        description="with model.fp8 on a GPU backend: quantize each expert weight once per optimizer step and keep "
        "its float8 blocks (W and W^T, 2 bytes a parameter) through the step's micro-batches, instead of again on "
        "every micro-batch; for experts that stay whole on the GPU (no FSDP sharding of them: a gathered weight "
        "changes at every all-gather, and its copy would hold the memory FSDP frees)",
    )

    fp8_weight_grad: Literal["fp8", "model_dtype"] = Field(
        default="fp8",
        description="with model.fp8: how the weight gradients dW = dy^T x are computed: fp8 (DeepSeek-V3's "
        "recipe: dy and x quantized in 1x128 tiles along the tokens) or model_dtype (from the unquantized dy and "
        "x in their dtype, as torchao's rowwise_with_gw_hp recipe does: more accurate, and faster where experts "
        "see few tokens each, which leaves the FP8 product a short contraction); the forward and input-gradient "
        "products stay in FP8",
    )

    @model_validator(mode="after")
    def _check_fp8(self) -> ModelConfig:
        if self.fp8 and self.impl == "hf":
            raise ValueError("model.fp8 needs the own model implementation (model.impl 'auto' or 'custom'), not 'hf'")
        if self.fp8_weight_cache and not self.fp8:
            raise ValueError("model.fp8_weight_cache keeps model.fp8's quantized weights: it needs model.fp8 true")
        if self.fp8_weight_grad != "fp8" and not self.fp8:
            raise ValueError(
                "model.fp8_weight_grad is how model.fp8 computes weight gradients: it needs model.fp8 true"
            )
        return self


class ParallelConfig(Section):
    """Degrees of the device mesh. FSDP2 shards over all ranks; the batch is split over world / cp of them."""

    ep: int = Field(
        default=1,
        gt=0,
        description="expert parallel: each MoE layer's experts are split over this many ranks, which exchange "
        "tokens all-to-all; must divide the world size and the number of experts (and be a multiple of cp)",
    )
    cp: int = Field(
        default=1,
        gt=0,
        description="context parallel: each sequence is split over this many ranks; must divide the world size",
    )
    accumulate_unsharded: bool = Field(
        default=False,
        description="FSDP units sharded over several ranks stay gathered through a step's micro-batches and "
        "accumulate their gradients unsharded (float32), reduced once per step: one all-gather and one "
        "reduce-scatter per step instead of per micro-batch, for those units' whole parameters and float32 "
        "gradients in memory on every rank (units on one rank, e.g. the experts at efsdp 1, always do)",
    )


class CheckpointConfig(Section):
    dir: str | None = Field(default=None, description="DCP checkpoint folder (shared by all ranks); unset: none")
    interval: int = Field(default=0, ge=0, description="save every N optimizer steps; 0: only on request and stop")
    keep_last: int | None = Field(default=None, gt=0, description="delete all but the newest N checkpoints")
    resume: bool = Field(default=True, description="start from the latest checkpoint in dir")
    save_on_stop: bool = Field(default=True, description="save the last step on a graceful stop")


class PublishConfig(Section):
    weight_broadcaster: str | None = Field(
        default=None, description="host:port of the weight broadcaster; unset: nothing is published"
    )
    kind: Literal["full", "adapter"] = Field(
        default="full", description="full: all weights (LoRA merged in); adapter: the LoRA adapter alone"
    )
    adapter_name: str = Field(
        default="primerl",
        description="with kind 'adapter': the name replicas serve the adapter under (the orchestrator's "
        "model.lora_adapter); its versions are this trainer's steps",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="dtype of the published tensors; auto: the checkpoint's (config.json)"
    )
    timeout_s: float = Field(default=600.0, gt=0, description="deadline of one publish")
    transport: Literal["grpc", "collective"] = Field(
        default="grpc",
        description="grpc: stream each version to the broadcaster; collective: announce it and broadcast it to the "
        "broadcaster's TRANSPORT_NCCL replicas in the group it names (NCCL or gloo), streaming it to the broadcaster "
        "too only when it asks (kind full only)",
    )
    chunk_bytes: int = Field(default=4 * 1024 * 1024, gt=0)
    fp8_blocks: bool = Field(
        default=False,
        description="publish the attention and MLP projections (and each expert's) in block FP8, float8_e4m3fn with "
        "a float32 <name>_scale_inv per 128x128 block, quantized on the trainer's device: for a broadcaster pushing "
        "kernel_fp8, which then fuses the blocks rather than quantizing (the same bits), and half the bytes of those "
        "weights on the way; replicas of other formats get them dequantized. Weights not of whole 128x128 blocks "
        "go as they are. grpc transport and kind full only",
    )
    streams: int = Field(
        default=DEFAULT_STREAMS,
        ge=1,
        le=64,
        description="parallel streams (each its own connection) one grpc publish is striped over, so that TLS "
        "runs on several cores; the broadcaster stores the version once all arrived (1: a single stream, "
        "for broadcasters without striping)",
    )
    initial_backoff_s: float = Field(default=1.0, gt=0, description="first retry delay after a failed publish")
    max_backoff_s: float = Field(default=60.0, gt=0)
    check_interval_s: float = Field(
        default=2.0, gt=0, description="how often the broadcaster is asked whether it lost the latest version"
    )

    @field_validator("adapter_name")
    @classmethod
    def _adapter_name(cls, name: str) -> str:
        if (problem := adapter_name_problem(name)) is not None:
            raise ValueError(problem)
        return name


class LoRAConfig(Section):
    enabled: bool = False
    rank: int = Field(default=16, gt=0)
    alpha: float = Field(default=32.0, gt=0, description="the update is scaled by alpha / rank")
    target_modules: list[str] = Field(
        default=["q", "k", "v", "o", "gate", "up", "down"],
        description="q, k, v, o (attention); g (the attention's output gate: AFMoE, Laguna); gate, up, down "
        "(the dense MLP and the shared experts); experts (every routed expert's gate and up, or its fused "
        "gate_up as GPT-OSS stores it, and down); in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj "
        "(Qwen3.5's Gated DeltaNet layers); HF names such as q_proj work too; the routers are never adapted; "
        "unknown names are ignored with a warning",
    )


class SFTConfig(Section):
    dataset: str | None = Field(
        default=None,
        description='JSONL file of {"messages": [...]} (chat template, loss on assistant turns) or '
        '{"prompt": str, "completion": str}; set: the trainer trains on it instead of PushBatch',
    )
    batch_size: int = Field(default=8, gt=0, description="samples per optimizer step")
    epochs: int = Field(default=1, gt=0)
    max_steps: int | None = Field(default=None, gt=0, description="stop after this many steps")
    stop_at_loss: float | None = Field(
        default=None,
        gt=0,
        description="stop once the mean loss of the last stop_loss_window steps is at or below this (the same "
        "model quality whatever the seed); epochs and max_steps are then a cap. A resumed job refills the window",
    )
    stop_loss_window: int = Field(default=5, gt=0, description="steps averaged for stop_at_loss")
    shuffle: bool = True
    seed: int = 0
    exit_when_done: bool = Field(
        default=False,
        description="stop the trainer (exit 0) once the last SFT step is trained, checkpointed and exported",
    )


class ExportConfig(Section):
    hf_dir: str | None = Field(
        default=None,
        description="on stop, write the final weights here as a Hugging Face model folder (config, safetensors, "
        "tokenizer copied from model.path), replaced whole; unset: no export",
    )
    adapter_dir: str | None = Field(
        default=None,
        description="on stop, write the LoRA adapter here as a PEFT adapter folder (adapter_config.json, "
        "adapter_model.safetensors) for the base model at model.path, replaced whole; beside or instead of "
        "hf_dir; needs lora.enabled; unset: no adapter export",
    )
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        default="auto", description="dtype of the exported weights (and adapter); auto: the checkpoint's (config.json)"
    )
    max_shard_bytes: int = Field(default=5 * 1024**3, gt=0, description="safetensors files are cut at this size")


class BatchLimitsConfig(Section):
    """Caps on one PushBatch, checked as it arrives (the count when `begin` announces it, tokens and
    bytes before each micro-batch is decoded): a batch past one is refused RESOURCE_EXHAUSTED naming
    the field, and what had arrived is dropped. Sized for large RL steps, not to refuse real use."""

    max_micro_batches: int = Field(default=65_536, gt=0, description="micro-batches one batch may announce")
    max_tokens: int = Field(default=2**28, gt=0, description="tokens of all micro-batches of one batch")
    max_bytes: int = Field(
        default=64 * 1024**3,
        gt=0,
        description="serialized micro-batches of one batch (what the trainer holds until the batch is queued)",
    )


class RunQuota(Section):
    """What one tenant may hold on a trainer with runs; past a limit CreateRun (or PushBatch) is
    refused RESOURCE_EXHAUSTED naming it."""

    max_runs: int = Field(default=4, gt=0, description="runs a tenant may have at once (paused and failed count)")
    max_tokens_per_step: int = Field(default=2**22, gt=0, description="tokens of one batch of one of its runs")
    max_lora_rank: int = Field(default=64, gt=0, description="LoRA rank a run may ask for")


class RunsConfig(Section):
    """Multi-tenant LoRA: many runs on one backbone (trainer.v1 CreateRun), each a LoRA adapter of
    its own with its own optimizer, schedule, steps, checkpoints (checkpoint.dir/runs/<run id>) and
    published adapter (named by the run id). Needs lora.enabled: the backbone's LoRA modules are
    built at lora.rank, the largest rank a run may have."""

    max_concurrent_runs: int = Field(
        default=0, ge=0, description="runs the trainer holds at once (0: a trainer of one run, no run API)"
    )
    quota: RunQuota = Field(default_factory=RunQuota, description="every tenant's quota unless tenant_quotas names it")
    tenant_quotas: dict[str, RunQuota] = Field(
        default_factory=dict, description="tenant identity name -> its quota, in place of quota"
    )

    @property
    def enabled(self) -> bool:
        return self.max_concurrent_runs > 0

    def quota_of(self, tenant: str) -> tuple[RunQuota, str]:
        """The tenant's quota and the config field it comes from (for refusals to name)."""
        if tenant in self.tenant_quotas:
            return self.tenant_quotas[tenant], f"runs.tenant_quotas.{tenant}"
        return self.quota, "runs.quota"


class TrainerConfig(ServiceConfig):
    """primerl trainer: PyTorch training of the policy: own Qwen3/Qwen3-MoE models, RL and SFT losses,
    router replay, FSDP2, checkpoints.
    """

    service_name = "trainer"
    model_config = service_settings("trainer")

    server: ServerConfig = ServerConfig(port=50052)
    model: ModelConfig
    mode: TrainingMode = Field(default="rl", description="rl: PushBatch with advantages; sft: cross-entropy")
    device: DeviceType = Field(default="auto", description="auto: CUDA when present, else the CPU")
    parallel: ParallelConfig = ParallelConfig()
    seq_len: int = Field(default=4096, gt=0, description="most tokens per micro-batch")
    router_replay: bool = Field(default=False, description="replay the experts inference routed to (MoE)")
    max_queued_batches: int = Field(default=4, gt=0, description="PushBatch answers RESOURCE_EXHAUSTED beyond")
    batch_limits: BatchLimitsConfig = BatchLimitsConfig()
    metrics_history: int = Field(default=1000, gt=0, description="finished steps WatchSteps can replay")
    loss: RLLossConfig = RLLossConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: LRScheduleConfig = LRScheduleConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    publish: PublishConfig = PublishConfig()
    lora: LoRAConfig = LoRAConfig()
    sft: SFTConfig = SFTConfig()
    export: ExportConfig = ExportConfig()
    runs: RunsConfig = RunsConfig()

    @model_validator(mode="after")
    def _check_combinations(self) -> TrainerConfig:
        if self.runs.enabled:
            self._check_runs()
        if self.publish.kind == "adapter" and not self.lora.enabled:
            raise ValueError("publish.kind 'adapter' needs lora.enabled")
        if self.export.adapter_dir is not None and not self.lora.enabled:
            raise ValueError("export.adapter_dir (a PEFT adapter export) needs lora.enabled")
        if self.publish.transport == "collective" and self.publish.kind != "full":
            raise ValueError("publish.transport 'collective' carries publish.kind 'full' only")
        if self.publish.fp8_blocks and (self.publish.transport != "grpc" or self.publish.kind != "full"):
            raise ValueError(
                "publish.fp8_blocks publishes a full model over publish.transport 'grpc': it needs publish.kind 'full' "
                f"and transport 'grpc', got kind {self.publish.kind!r} and transport {self.publish.transport!r}"
            )
        if self.sft.dataset is not None and self.mode != "sft":
            raise ValueError("sft.dataset needs mode 'sft'")
        if self.sft.exit_when_done and self.sft.dataset is None:
            raise ValueError("sft.exit_when_done needs sft.dataset")
        if self.sft.stop_at_loss is not None and self.sft.dataset is None:
            raise ValueError("sft.stop_at_loss needs sft.dataset")
        if self.model.fp8 and self.lora.enabled:
            raise ValueError("model.fp8 with lora.enabled is not supported yet")
        if self.model.train_vision_encoder and self.lora.enabled:
            raise ValueError(
                "model.train_vision_encoder with lora.enabled is not supported: the LoRA adapters cover the "
                "language model only; leave model.train_vision_encoder false or set lora.enabled false"
            )
        if self.model.fp8 and self.model.fp8_backend != "emulated" and self.device == "cpu":
            raise ValueError(
                f"model.fp8 with model.fp8_backend '{self.model.fp8_backend}' needs a Hopper GPU, not device 'cpu' "
                "(model.fp8_backend 'emulated' computes the same numbers on the CPU)"
            )
        return self

    def _check_runs(self) -> None:
        """runs.max_concurrent_runs > 0: every run is a LoRA adapter, trained on pushed batches
        and published alone."""
        if not self.lora.enabled:
            raise ValueError("runs.max_concurrent_runs > 0 needs lora.enabled (each run is a LoRA adapter)")
        if self.sft.dataset is not None:
            raise ValueError("runs.max_concurrent_runs > 0 trains pushed batches: unset sft.dataset")
        if self.publish.weight_broadcaster is not None and self.publish.kind != "adapter":
            raise ValueError("runs.max_concurrent_runs > 0 publishes each run's adapter: set publish.kind 'adapter'")
        if self.export.hf_dir is not None or self.export.adapter_dir is not None:
            raise ValueError("runs.max_concurrent_runs > 0: export.hf_dir and export.adapter_dir are for one run")
