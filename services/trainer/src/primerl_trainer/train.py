"""One optimizer step per batch: gradient accumulation over micro-batches, RL or SFT loss,
clipping, AdamW, learning-rate schedule and step metrics.

The model is one of the registry's (`primerl_trainer.models.load_model`), plain or sharded by its
parallelize function: called as `model(input_ids, position_ids, routed_experts=...)` with one
packed sequence as a [1, T] row (and, with router replay, [T, moe layers, top_k] expert indices),
it returns an output whose `logits` are [1, T, vocab].

Normalisation: each micro-batch's loss is divided by the loss-token count of the whole batch, so
the gradient is the same however the batch is cut into micro-batches or spread over ranks.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from primerl_trainer.batch import BatchSpec, MicroBatch, TrainingMode, shard_micro_batches, validate_batch
from primerl_trainer.expert_load import ExpertLoad
from primerl_trainer.losses import RLLossConfig, rl_loss, sft_loss, token_logprobs
from primerl_trainer.optim import clip_grad_norm_

__all__ = ["Trainer"]

# Per-micro-batch sums reduced over ranks once per step, in this order.
_SUM_KEYS: dict[TrainingMode, tuple[str, ...]] = {
    "rl": ("loss", "entropy", "mismatch_kl", "masked_high", "masked_low"),
    "sft": ("loss", "entropy"),
}


class Trainer:
    """Takes optimizer steps on batches of micro-batches; `step` counts the steps taken.

    With data parallelism every rank calls `train_step` with the whole batch and trains on its
    share (see `shard_micro_batches`); the metrics it returns are the batch's, on every rank.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler,
        *,
        spec: BatchSpec,
        device: torch.device,
        mode: TrainingMode = "rl",
        loss_config: RLLossConfig | None = None,
        max_grad_norm: float = 1.0,
        dp_group: dist.ProcessGroup | None = None,
        step: int = 0,
        logprob_chunk_size: int | None = None,
    ) -> None:
        if mode not in _SUM_KEYS:
            raise ValueError(f"mode must be one of {sorted(_SUM_KEYS)}, got {mode!r}")
        if max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.spec = spec
        self.device = device
        self.mode: TrainingMode = mode
        self.loss_config = loss_config or RLLossConfig()
        self.max_grad_norm = max_grad_norm
        self.step = step
        self._logprob_chunk_size = logprob_chunk_size
        self._dp_group = dp_group
        distributed = dist.is_available() and dist.is_initialized()
        self._dp_rank = dist.get_rank(dp_group) if distributed else 0
        self._dp_size = dist.get_world_size(dp_group) if distributed else 1
        # Routed-token counts of MoE models, reported as load-balance metrics (None: dense).
        self._expert_load = ExpertLoad.of(model)

    def train_step(
        self, micro_batches: Sequence[MicroBatch], *, num_loss_tokens: int | None = None
    ) -> dict[str, float]:
        """Validate the whole batch, then take one optimizer step on it; return the step's metrics.

        Raises `InvalidArgument` (before touching the model) for a malformed batch, or when
        `num_loss_tokens`, the count the sender announced, differs from the loss masks'.
        """
        start = time.perf_counter()
        total_loss_tokens = validate_batch(micro_batches, self.spec, mode=self.mode, num_loss_tokens=num_loss_tokens)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        keys = _SUM_KEYS[self.mode]
        sums = torch.zeros(len(keys), dtype=torch.float64, device=self.device)
        if self._expert_load is not None:
            self._expert_load.start()
        for micro_batch in shard_micro_batches(micro_batches, rank=self._dp_rank, world_size=self._dp_size):
            sums += self._forward_backward(micro_batch, num_loss_tokens=total_loss_tokens)

        grad_norm = clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        lr = self.lr_scheduler.get_last_lr()[0]
        # A NaN or inf gradient would poison the weights and every rollout after them: keep the
        # weights, still count the step (its batch is consumed) and report it.
        update_skipped = not bool(torch.isfinite(grad_norm))
        if not update_skipped:
            self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

        if self._dp_size > 1:
            dist.all_reduce(sums, group=self._dp_group)
        totals = dict(zip(keys, sums.tolist(), strict=True))
        elapsed = time.perf_counter() - start
        num_tokens = sum(micro_batch.num_tokens for micro_batch in micro_batches)
        metrics = {
            "loss": totals["loss"],
            "entropy": totals["entropy"] / total_loss_tokens,
            "grad_norm": float(grad_norm),
            "lr": lr,
            "update_skipped": float(update_skipped),
            "num_micro_batches": float(len(micro_batches)),
            "num_tokens": float(num_tokens),
            "num_loss_tokens": float(total_loss_tokens),
            "step_time_s": elapsed,
            "tokens_per_s": num_tokens / elapsed,
            "peak_memory_bytes": float(self._peak_memory_bytes()),
        }
        if self.mode == "rl":
            metrics |= {
                "mismatch_kl": totals["mismatch_kl"] / total_loss_tokens,
                "masked_fraction": (totals["masked_high"] + totals["masked_low"]) / total_loss_tokens,
                "masked_high_fraction": totals["masked_high"] / total_loss_tokens,
                "masked_low_fraction": totals["masked_low"] / total_loss_tokens,
            }
        if self._expert_load is not None:
            # This rank's own micro-batches come first; the fillers after them repeat one.
            metrics |= self._expert_load.metrics(len(micro_batches[self._dp_rank :: self._dp_size]))
        return metrics

    def _forward_backward(self, micro_batch: MicroBatch, *, num_loss_tokens: int) -> torch.Tensor:
        """Accumulate one micro-batch's gradient; return its sums in `_SUM_KEYS` order."""

        def to_device(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(self.device, non_blocking=True)

        input_ids = micro_batch.input_ids.to(self.device, non_blocking=True)
        loss_mask = micro_batch.loss_mask.to(self.device, non_blocking=True)
        output = self.model(
            input_ids[None],
            micro_batch.position_ids.to(self.device, non_blocking=True)[None],
            routed_experts=to_device(micro_batch.routed_experts),
        )
        # squeeze, not [0]: the backward of an index allocates a zero gradient the logits' size.
        logits = output.logits.squeeze(0)
        logprobs, entropy = token_logprobs(
            logits,
            input_ids,
            micro_batch.temperatures.to(self.device, non_blocking=True),
            chunk_size=self._logprob_chunk_size,
        )
        if self.mode == "rl":
            loss_output = rl_loss(
                logprobs,
                to_device(micro_batch.inference_logprobs),
                to_device(micro_batch.advantages),
                loss_mask,
                num_loss_tokens=num_loss_tokens,
                config=self.loss_config,
            )
        else:
            loss_output = sft_loss(logprobs, loss_mask, num_loss_tokens=num_loss_tokens)
        # FSDP averages gradients over the data-parallel ranks; the loss is already normalised by
        # the whole batch's token count, so the ranks' gradients must add up instead.
        (loss_output.loss * self._dp_size).backward()
        sums = {
            "loss": loss_output.loss.detach(),
            "entropy": torch.where(loss_mask, entropy, 0.0).sum(),
            **loss_output.sums,
        }
        return torch.stack([sums[key].to(torch.float64) for key in _SUM_KEYS[self.mode]])

    def _peak_memory_bytes(self) -> int:
        """Peak GPU memory allocated by tensors during this step; on the CPU the process's peak RSS."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        # ru_maxrss is in KiB on Linux, and covers the process's whole life.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
