"""AdamW, the learning-rate schedule and gradient clipping (plain and FSDP2-sharded parameters alike).

On CUDA the AdamW step of plain (unsharded) parameters runs as one Triton kernel per parameter
(`TritonAdamW`): the update is memory-bound (a bf16 parameter moves 14 bytes: parameter,
gradient and both moments read, parameter and moments written), and torch's fused
multi-tensor kernel reaches about half of an H200's memory bandwidth on it. Everywhere else
(the CPU, FSDP2's DTensor shards, options the kernel lacks) the step is torch.optim.AdamW's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from primerl_trainer.config_types import LRScheduleConfig, OptimizerConfig

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: torch.optim.AdamW's own step
    triton = None

__all__ = [
    "LRScheduleConfig",
    "OptimizerConfig",
    "TritonAdamW",
    "build_lr_scheduler",
    "build_optimizer",
    "clip_grad_norm_",
    "lr_factor",
]


def build_optimizer(model: torch.nn.Module, config: OptimizerConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters; weight decay on matrices (ndim >= 2) only. A
    `TritonAdamW` where the parameters are on CUDA and Triton is installed."""
    params = [p for p in model.parameters() if p.requires_grad]
    decayed = [p for p in params if p.ndim >= 2]
    others = [p for p in params if p.ndim < 2]
    groups = [{"params": decayed, "weight_decay": config.weight_decay}, {"params": others, "weight_decay": 0.0}]
    optimizer_class = TritonAdamW if triton is not None and all(p.is_cuda for p in params) else torch.optim.AdamW
    return optimizer_class(
        [group for group in groups if group["params"]], lr=config.lr, betas=config.betas, eps=config.eps
    )


class TritonAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same arguments, state and state dict) whose step runs a Triton kernel
    per parameter when every parameter with a gradient is a plain contiguous CUDA tensor with a
    dense gradient, and the group asks for nothing the kernel lacks (amsgrad, maximize,
    capturable, differentiable, a tensor learning rate). Otherwise the whole step is
    torch.optim.AdamW's.

    The arithmetic is torch's fused AdamW's, in float32 whatever the storage dtype: decoupled
    weight decay p *= 1 - lr * wd; m = b1 * m + (1 - b1) * g; v = b2 * v + (1 - b2) * g^2;
    p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps), with the moments stored in
    the parameter's dtype and the step count t a CPU scalar (as torch's default step keeps it).
    """

    _BLOCK = 2048

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        if not self._kernel_applies():
            return super().step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, weight_decay, eps = float(group["lr"]), group["weight_decay"], group["eps"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                elif state["step"].device.type != "cpu":  # loaded from a fused optimizer's state
                    state["step"] = state["step"].cpu()
                state["step"] += 1
                step = state["step"].item()
                numel = param.numel()
                _adamw_kernel[(triton.cdiv(numel, self._BLOCK),)](
                    param,
                    param.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    numel,
                    1.0 - lr * weight_decay,
                    beta1,
                    beta2,
                    lr / (1.0 - beta1**step),
                    1.0 / math.sqrt(1.0 - beta2**step),
                    eps,
                    BLOCK=self._BLOCK,
                    num_warps=4,
                )
        return loss

    def _kernel_applies(self) -> bool:
        if triton is None:
            return False
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group["capturable"] or group["differentiable"]:
                return False
            if isinstance(group["lr"], torch.Tensor):
                return False
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if isinstance(param, DTensor) or not param.is_cuda or grad.is_sparse:
                    return False
                if not (param.is_contiguous() and grad.is_contiguous() and grad.dtype == param.dtype):
                    return False
                state = self.state.get(param)
                if state and not (state["exp_avg"].is_contiguous() and state["exp_avg_sq"].is_contiguous()):
                    return False
        return True


if triton is not None:

    @triton.jit
    def _adamw_kernel(
        param_ptr,
        grad_ptr,
        exp_avg_ptr,
        exp_avg_sq_ptr,
        numel,
        decay_factor,
        beta1,
        beta2,
        step_size,
        inv_bias_correction2_sqrt,
        eps,
        BLOCK: tl.constexpr,
    ):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        param = tl.load(param_ptr + offsets, mask=mask).to(tl.float32)
        grad = tl.load(grad_ptr + offsets, mask=mask).to(tl.float32)
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=mask).to(tl.float32)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + offsets, mask=mask).to(tl.float32)
        param = param * decay_factor
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        denom = tl.sqrt(exp_avg_sq) * inv_bias_correction2_sqrt + eps
        param = param - step_size * exp_avg / denom
        tl.store(param_ptr + offsets, param.to(param_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_ptr + offsets, exp_avg.to(exp_avg_ptr.dtype.element_ty), mask=mask)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq.to(exp_avg_sq_ptr.dtype.element_ty), mask=mask)


def lr_factor(step: int, config: LRScheduleConfig) -> float:
    """Multiplier of the base learning rate at optimizer step `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.decay == "constant":
        return 1.0
    assert config.total_steps is not None
    progress = min(1.0, (step - config.warmup_steps) / (config.total_steps - config.warmup_steps))
    shape = 1.0 - progress if config.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: LRScheduleConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepped once per optimizer step.

    The schedule is a closure, not an object: LambdaLR's state dict then saves only the step
    count, so a resumed run follows the schedule of its (possibly edited) config.
    """

    def factor(step: int) -> float:
        return lr_factor(step, config)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def clip_grad_norm_(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip gradients to a global L2 norm; return the norm before clipping (a plain 0-d tensor).

    With FSDP2 the gradients are shards (DTensors) and their norm is a DTensor: `full_tensor()`
    reduces it across ranks so every rank clips by the same global norm. Under expert parallel
    the expert gradients live on another mesh than the rest: each mesh's norm is reduced over
    its own ranks and the norms are combined. A non-finite norm is returned as is (the caller
    skips the update) and the gradients are left untouched.
    """
    params = [p for p in parameters if p.grad is not None]
    groups: dict[object, list[torch.nn.Parameter]] = {}
    for param in params:
        groups.setdefault(param.device_mesh if isinstance(param, DTensor) else None, []).append(param)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    total_norm = norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
    # A device-to-host sync, needed anyway: the norm is a metric of every step.
    if torch.isfinite(total_norm):
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)
    return total_norm
