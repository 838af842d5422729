"""One optimizer step per batch: gradient accumulation over micro-batches, RL or SFT loss,
clipping, AdamW, learning-rate schedule and step metrics.

The model is one of the registry's (`primerl_trainer.models.load_model`), plain or sharded by its
parallelize function: called as `model(input_ids, position_ids, routed_experts=..., row_layout=...)`
with one packed sequence (or this cp rank's share of it) as a [1, T] row (and, with router replay,
[T, moe layers, top_k] expert indices), it returns an output whose `logits` are [1, T, vocab]. Own
implementations get the row's `RowLayout`; a transformers model only whole rows, without it.

Normalisation: each micro-batch's loss is divided by the loss-token count of the whole batch, so
the gradient is the same however the batch is cut into micro-batches or spread over ranks.

Context parallel: the ranks of a cp group take the same micro-batches and each trains on its
share of every row (distributed/context_parallel.py); the model is then an own implementation
given each row's `RowLayout`, and FSDP shards over the dp_shard x cp ranks.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from primerl_trainer.batch import BatchSpec, MicroBatch, TrainingMode, shard_micro_batches, validate_batch
from primerl_trainer.distributed.context_parallel import RowShard, shard_micro_batch
from primerl_trainer.distributed.fsdp import defer_local_gradient_reduction
from primerl_trainer.expert_load import ExpertLoad
from primerl_trainer.kernels.fp8_weight_cache import WEIGHT_CACHE
from primerl_trainer.losses import RLLossConfig, rl_loss, sft_loss, target_logprobs
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
    share (see `shard_micro_batches` over `dp_group`, the "dp_shard" ranks; None: all ranks);
    with context parallel (`cp_group`, the "cp" ranks) each row of that share is split over the
    cp group. The metrics it returns are the batch's, on every rank.
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
        cp_group: dist.ProcessGroup | None = None,
        step: int = 0,
        logprob_chunk_size: int | None = None,
        accumulate_unsharded: bool = False,
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
        # Tokens the sampler never draws (a vision-language model's placeholders): scored over the
        # vocabulary without them, as inference's logprobs are.
        self._excluded = (
            torch.tensor(spec.unsampled_token_ids, dtype=torch.int64, device=device)
            if spec.unsampled_token_ids
            else None
        )
        # ParallelConfig.accumulate_unsharded (distributed.fsdp.defer_local_gradient_reduction).
        self.accumulate_unsharded = accumulate_unsharded
        self._dp_group = dp_group
        self._cp_group = cp_group
        distributed = dist.is_available() and dist.is_initialized()
        self._dp_rank = dist.get_rank(dp_group) if distributed else 0
        self._dp_size = dist.get_world_size(dp_group) if distributed else 1
        # Routed-token counts of MoE models, reported as load-balance metrics (None: dense).
        self._expert_load = ExpertLoad.of(model)
        self._cp_rank = dist.get_rank(cp_group) if cp_group is not None else 0
        self._cp_size = dist.get_world_size(cp_group) if cp_group is not None else 1
        if self._cp_size > 1 and dp_group is None:
            raise ValueError("a cp_group needs its dp_group (the ranks that train different micro-batches)")
        # Own implementations take each row's layout (and with it the one-sample fast paths); a
        # transformers model only whole rows.
        self._takes_row_layout = hasattr(model, "cp_group")
        if self._cp_size > 1 and not self._takes_row_layout:
            raise ValueError(f"context parallel needs the own model implementation, not {type(model).__name__}")

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
        shards = shard_micro_batches(micro_batches, rank=self._dp_rank, world_size=self._dp_size)
        for index, micro_batch in enumerate(shards):
            defer_local_gradient_reduction(
                self.model, defer=index < len(shards) - 1, sharded_units=self.accumulate_unsharded
            )
            sums += self._forward_backward(micro_batch, num_loss_tokens=total_loss_tokens)

        grad_norm = clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        lr = self.lr_scheduler.get_last_lr()[0]
        # A NaN or inf gradient would poison the weights and every rollout after them: keep the
        # weights, still count the step (its batch is consumed) and report it.
        update_skipped = not bool(torch.isfinite(grad_norm))
        WEIGHT_CACHE.clear()  # model.fp8_weight_cache: the step's quantized weights, stale after it
        if not update_skipped:
            self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

        # Each (dp, cp) rank summed its own tokens: adding over both groups counts each once.
        if self._dp_size > 1:
            dist.all_reduce(sums, group=self._dp_group)
        if self._cp_size > 1:
            dist.all_reduce(sums, group=self._cp_group)
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

    @torch.no_grad()
    def token_logprobs(self, micro_batch: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's per-token logprobs and entropies of one micro-batch, aligned with its
        tokens as losses.token_logprobs' (0 at index 0), in row order on every rank; no
        gradient. Collective: every rank of the model's mesh calls it with the same micro-batch."""
        shard = self._shard(micro_batch)
        logprobs, entropy = self._logprobs(shard)
        return shard.gather_tokens(logprobs, self._cp_group), shard.gather_tokens(entropy, self._cp_group)

    def _shard(self, micro_batch: MicroBatch) -> RowShard:
        return shard_micro_batch(micro_batch, cp_rank=self._cp_rank, cp_size=self._cp_size)

    def _logprobs(self, shard: RowShard) -> tuple[torch.Tensor, torch.Tensor]:
        """Prediction-aligned logprobs of this rank's share of a row and their entropies."""
        extra = {"row_layout": shard.layout} if self._takes_row_layout else {}
        if shard.pixel_values is not None:
            extra |= {"pixel_values": self._to_device(shard.pixel_values), "image_grid_thw": shard.image_grid_thw}
        output = self.model(
            shard.input_ids.to(self.device, non_blocking=True)[None],
            shard.position_ids.to(self.device, non_blocking=True)[None],
            routed_experts=self._to_device(shard.routed_experts),
            **extra,
        )
        # squeeze, not [0]: the backward of an index allocates a zero gradient the logits' size.
        return target_logprobs(
            output.logits.squeeze(0),
            shard.targets.to(self.device, non_blocking=True),
            shard.target_temperatures.to(self.device, non_blocking=True),
            chunk_size=self._logprob_chunk_size,
            excluded=self._excluded,
        )

    def _forward_backward(self, micro_batch: MicroBatch, *, num_loss_tokens: int) -> torch.Tensor:
        """Accumulate one micro-batch's gradient (this rank's share of its row); return its sums
        in `_SUM_KEYS` order."""
        shard = self._shard(micro_batch)
        loss_mask = shard.loss_mask.to(self.device, non_blocking=True)
        logprobs, entropy = self._logprobs(shard)
        if self.mode == "rl":
            loss_output = rl_loss(
                logprobs,
                self._to_device(shard.inference_logprobs),
                self._to_device(shard.advantages),
                loss_mask,
                num_loss_tokens=num_loss_tokens,
                config=self.loss_config,
            )
        else:
            loss_output = sft_loss(logprobs, loss_mask, num_loss_tokens=num_loss_tokens)
        # FSDP averages gradients over the ranks it shards over, dp_shard x cp; the loss is already
        # normalised by the whole batch's token count, so the ranks' gradients must add up instead.
        (loss_output.loss * (self._dp_size * self._cp_size)).backward()
        sums = {
            "loss": loss_output.loss.detach(),
            "entropy": torch.where(loss_mask, entropy, 0.0).sum(),
            **loss_output.sums,
        }
        return torch.stack([sums[key].to(torch.float64) for key in _SUM_KEYS[self.mode]])

    def _to_device(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else tensor.to(self.device, non_blocking=True)

    def _peak_memory_bytes(self) -> int:
        """Peak GPU memory allocated by tensors during this step; on the CPU the process's peak RSS."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        # ru_maxrss is in KiB on Linux, and covers the process's whole life.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
