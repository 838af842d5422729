"""Start-up of one trainer rank: process group, model (LoRA, FSDP2), optimizer, schedule,
Trainer, latest checkpoint. Every rank runs it, in the same order (it is collective)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from primerl_common.images import vision_placeholder_token_ids
from primerl_trainer.batch import BatchSpec
from primerl_trainer.checkpoint import Checkpointer
from primerl_trainer.commands import CommandChannel
from primerl_trainer.config import TrainerConfig
from primerl_trainer.distributed.context_parallel import apply_context_parallel
from primerl_trainer.distributed.expert_parallel import check_ep_comm_backend
from primerl_trainer.distributed.parallel_dims import ParallelDims
from primerl_trainer.export import PublishKind, plan_export
from primerl_trainer.hf_export import export_dtype
from primerl_trainer.kernels.fp8_weight_cache import WEIGHT_CACHE
from primerl_trainer.lora import apply_lora
from primerl_trainer.models import HFCausalLM, load_model, model_spec_of, read_hf_config
from primerl_trainer.optim import build_lr_scheduler, build_optimizer
from primerl_trainer.process_group import init_distributed
from primerl_trainer.train import Trainer

__all__ = ["TrainingRuntime", "build_runtime", "shutdown_runtime"]

logger = logging.getLogger(__name__)


@dataclass
class TrainingRuntime:
    config: TrainerConfig
    device: torch.device
    trainer: Trainer
    spec: BatchSpec
    channel: CommandChannel
    # The device mesh and its named sub-meshes (dp_shard, cp, dp_shard_cp, ep, efsdp).
    parallel_dims: ParallelDims
    checkpointer: Checkpointer | None
    # Step of the checkpoint the run resumed from (None: a fresh start).
    restored_step: int | None
    publish_kind: PublishKind
    publish_dtype: torch.dtype
    lora_scale: float | None
    # What one publish sends (PublishBegin's counts).
    num_published_tensors: int
    num_published_bytes: int

    @property
    def rank(self) -> int:
        return self.channel.rank

    @property
    def world_size(self) -> int:
        return self.channel.world_size


def build_runtime(config: TrainerConfig) -> TrainingRuntime:
    """Everything a rank trains with. Without torchrun the process is a group of one."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group exists already: one trainer per process")
    device = init_distributed(config.device)
    try:
        return _build(config, device)
    except BaseException:
        dist.destroy_process_group()
        raise


def shutdown_runtime(runtime: TrainingRuntime) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _build(config: TrainerConfig, device: torch.device) -> TrainingRuntime:
    channel = CommandChannel()
    model_config = config.model
    hf_config = read_hf_config(model_config.path)
    dims = ParallelDims(world_size=dist.get_world_size(), cp=config.parallel.cp, ep=config.parallel.ep)
    check_ep_comm_backend(model_config.ep_comm_backend)
    if dims.ep_enabled and hf_config.get("num_experts"):  # before loading: a dense model is refused by its parallelize
        dims.check_num_experts(hf_config["num_experts"])
    dtype = getattr(torch, model_config.dtype)
    # Loaded on the CPU: fully_shard moves each block to the device as it shards it, so a GPU
    # never holds more than its shards plus one block.
    model = load_model(
        model_config.path,
        impl=model_config.impl,
        dtype=dtype,
        device="cpu",
        attn_backend=model_config.attn_backend,
        experts_impl=model_config.experts_impl,
    )
    _set_vision_encoder_trainable(model, config)
    lora_scale = None
    if config.lora.enabled:
        apply_lora(model, config.lora)
        lora_scale = config.lora.alpha / config.lora.rank
    dims.build_mesh(device.type)
    _parallelize(model, dims, config)
    if dims.cp_enabled:
        apply_context_parallel(model, cp_mesh=dims.mesh("cp"))

    optimizer = build_optimizer(model, config.optimizer)
    spec = _batch_spec(model, hf_config, config)
    trainer = Trainer(
        model,
        optimizer,
        build_lr_scheduler(optimizer, config.schedule),
        spec=spec,
        device=device,
        mode=config.mode,
        loss_config=config.loss,
        max_grad_norm=config.optimizer.max_grad_norm,
        dp_group=dims.group("dp_shard"),
        cp_group=dims.group("cp") if dims.cp_enabled else None,
        accumulate_unsharded=config.parallel.accumulate_unsharded,
    )
    checkpointer = restored_step = None
    # With runs, each run checkpoints under checkpoint.dir/runs (run_service.py).
    if config.checkpoint.dir is not None and not config.runs.enabled:
        checkpointer = Checkpointer(
            config.checkpoint.dir, interval=config.checkpoint.interval, keep_last=config.checkpoint.keep_last
        )
        if config.checkpoint.resume:
            restored_step = checkpointer.load_latest(trainer)

    publish_dtype = export_dtype(config.publish.dtype, hf_config)
    num_tensors, num_bytes = plan_export(
        model,
        kind=config.publish.kind,
        dtype=publish_dtype,
        lora_scale=lora_scale,
        fp8_blocks=config.publish.fp8_blocks,
    )
    num_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    logger.info(
        "trainer rank %d/%d ready on %s at step %d",
        channel.rank,
        channel.world_size,
        device,
        trainer.step,
        extra={"model": model_config.path, "trainable_parameters": num_trainable, "mode": config.mode},
    )
    return TrainingRuntime(
        config=config,
        device=device,
        trainer=trainer,
        spec=spec,
        channel=channel,
        parallel_dims=dims,
        checkpointer=checkpointer,
        restored_step=restored_step,
        publish_kind=config.publish.kind,
        publish_dtype=publish_dtype,
        lora_scale=lora_scale,
        num_published_tensors=num_tensors,
        num_published_bytes=num_bytes,
    )


def _set_vision_encoder_trainable(model: nn.Module, config: TrainerConfig) -> None:
    """model.train_vision_encoder: whether the vision encoder (a vision-language model's `visual`:
    the ViT, its patch merger and deepstack mergers) takes gradients. Frozen, the optimizer never
    sees it (no AdamW state), while checkpoints, exports and publishes hold it as loaded."""
    train = config.model.train_vision_encoder
    vision_encoder = getattr(model, "visual", None)
    if vision_encoder is None:
        if train:
            raise ValueError(
                f"model.train_vision_encoder: {config.model.path} has no vision encoder (a text model); leave it false"
            )
        return
    vision_encoder.requires_grad_(train)


def _parallelize(model: nn.Module, dims: ParallelDims, config: TrainerConfig) -> None:
    """FSDP2 over every rank (one rank included: the same code path, and mixed precision); the
    experts split over the ep ranks with parallel.ep > 1."""
    compute_dtype = getattr(torch, config.model.compute_dtype)
    mesh = dims.mesh("dp_shard_cp")
    if isinstance(model, HFCausalLM):
        if config.model.activation_checkpointing or config.model.compile:
            raise ValueError("activation_checkpointing and compile need the own model implementation")
        if dims.ep_enabled:
            raise ValueError("parallel.ep > 1 needs the own model implementation (model.impl 'auto' or 'custom')")
        if config.model.fp8:
            raise ValueError(
                "model.fp8 needs the own model implementation; model.impl 'auto' found none for this model"
            )
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        for layer in getattr(getattr(model.hf_model, "model", None), "layers", []):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        return
    expert_parallel = {}
    if dims.ep_enabled:
        expert_parallel["ep_mesh"] = dims.mesh("ep")
        if getattr(model.args, "num_experts", 0):  # a dense model's parallelize refuses the ep mesh
            expert_parallel |= {"efsdp_mesh": dims.mesh("efsdp"), "ep_comm_backend": config.model.ep_comm_backend}
    WEIGHT_CACHE.enabled = config.model.fp8 and config.model.fp8_weight_cache
    model_spec_of(model).parallelize_fn(
        model,
        dp_mesh=mesh,
        param_dtype=compute_dtype,
        reduce_dtype=torch.float32,
        activation_checkpointing=config.model.activation_checkpointing,
        compile=config.model.compile,
        fp8_backend=config.model.fp8_backend if config.model.fp8 else None,
        fp8_weight_grad=config.model.fp8_weight_grad,
        **expert_parallel,
    )


def _batch_spec(model: nn.Module, hf_config: dict, config: TrainerConfig) -> BatchSpec:
    # A vision-language checkpoint keeps its language model's sizes in text_config.
    text_config = hf_config.get("text_config", hf_config)
    num_hidden_layers = text_config["num_hidden_layers"]
    vocab_size = text_config["vocab_size"]
    args = getattr(model, "args", None)
    image_token_id = getattr(args, "image_token_id", None)
    vision = getattr(args, "vision", None)
    moe_layers = tuple(getattr(args, "moe_layers", ()))
    if config.router_replay and not moe_layers:
        raise ValueError("router_replay needs a mixture-of-experts model with the own implementation")
    return BatchSpec(
        seq_len=config.seq_len,
        vocab_size=vocab_size,
        router_replay=config.router_replay,
        num_moe_layers=len(moe_layers),
        num_experts_per_token=getattr(args, "top_k", 0) if moe_layers else 0,
        num_experts=getattr(args, "num_experts", 0) if moe_layers else 0,
        num_hidden_layers=num_hidden_layers,
        moe_layers=moe_layers,
        image_token_id=image_token_id,
        patches_per_image_token=vision.spatial_merge_size**2 if vision is not None else 0,
        unsampled_token_ids=vision_placeholder_token_ids(hf_config),
        lora_adapter=config.publish.adapter_name if config.publish.kind == "adapter" else "",
    )
