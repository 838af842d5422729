"""Multi-tenant LoRA: several runs trained on one backbone in memory, each with its own adapter,
optimizer, learning-rate schedule and step count, and nothing of one run reaching another.

The model's LoRA modules are built once (`apply_lora`) at the largest rank any run may have. Each
run keeps its own copy of every LoRA tensor at that shape, zero beyond the run's own rank (A's
rows and B's columns past it), and its own scale alpha / rank. A step of one run:

    1. copies the run's tensors into the model's LoRA parameters (the local shards, for FSDP2's
       DTensors) and sets every LoRA module's scale and active rank to the run's: the modules
       compute with the first `rank` rows of A and columns of B only, the same products as a
       model built at the run's rank;
    2. runs `Trainer.train_step` (the single-run step: loss, accumulation, clipping, AdamW, schedule)
       with the run's optimizer, schedule, step count and loss settings;
    3. copies the updated parameters back into the run's tensors.

The padding stays zero: the rows and columns past the active rank take no part in the forward,
so their gradient is exactly zero, and AdamW turns a zero gradient on a zero entry into a zero
update (both moments stay zero, weight decay scales zero). (Even computing with the whole padded
tensors would give zero gradients there, dA = scale * B^T dW with B's extra columns zero and
dB = scale * dW A^T with A's extra rows zero, but matmuls over another inner size round
differently, which Adam amplifies in entries whose gradient nearly cancels.) A run's step is then
the one it takes alone, bit for bit on the CPU, but for gradient clipping: the norm it clips by is
reduced over the padded gradients, which can round the last bit differently.

Each run has its own optimizer instance over the same parameter objects: the moments are per
instance, never shared. Gradients are cleared at the start of every step (the trainer's
zero_grad) and after a failed one.

One switch copies the adapter in and out: on the tests' tiny dense model (rank 8 on the seven
linear targets of 4 layers, 131k parameters, 0.5 MB in float32) about 0.2 ms in and 1 ms for the
whole switch, against a 100 ms step on the CPU. A RunSet is not thread-safe: one step at a time.

Failures, per run:
    - a malformed batch (NaN advantages included) raises `InvalidArgument` before any work; the
      run is as before and takes the next batch;
    - a non-finite gradient (NaN or inf loss) skips the update, as a single run does: the run's
      adapter and moments stay, its step and schedule advance, the metrics say `update_skipped`;
    - any other error before the optimizer's update (in the forward or backward, out of memory)
      leaves the run as before the step and is raised again;
    - an error after the update began marks the run failed: its steps raise `FailedPrecondition`
      until `load_state_dict` restores it (from its checkpoint) or it is removed.
The other runs' state and the frozen backbone are never touched by a run's step.

Runs share the model's LoRA targets (the modules `apply_lora` adapted) and its batch spec.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from primerl_common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from primerl_trainer.batch import BatchSpec, MicroBatch
from primerl_trainer.config_types import LRScheduleConfig, OptimizerConfig, RLLossConfig, TrainingMode
from primerl_trainer.lora import ExpertsLoRA, LinearLoRA, initial_lora_tensors, lora_parametrizations
from primerl_trainer.optim import build_lr_scheduler, build_optimizer
from primerl_trainer.train import Trainer

__all__ = ["RunConfig", "RunSet"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunConfig:
    """What one run trains with: its LoRA rank and alpha (scale alpha / rank), the seed of its A
    init (as apply_lora's), optimizer, schedule, mode and RL loss."""

    rank: int
    alpha: float
    seed: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    mode: TrainingMode = "rl"
    loss: RLLossConfig = field(default_factory=RLLossConfig)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


@dataclass
class _Run:
    config: RunConfig
    # Parameter name -> this run's value, the model parameter's shape and type (a DTensor when
    # the model is sharded), zero past the run's rank.
    adapter: dict[str, torch.Tensor]
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int = 0
    # Why the run failed (None: healthy).
    failure: str | None = None
    # Set by the optimizer's step pre-hook: the update of the step under way has begun.
    updating: bool = False


class RunSet:
    """The runs trained on one LoRA model. `model` has LoRA applied at the largest rank a run may
    have (`max_rank`) and nothing else trainable; it may be sharded by FSDP2 (every rank then
    calls every method with the same arguments: they are collective). `trainer_options` go to
    the `Trainer` every run's step goes through (dp_group, cp_group, logprob_chunk_size, ...);
    or `trainer`, the model's Trainer already built, is that one (its optimizer, schedule, step
    and loss settings are then replaced by each run's as it steps)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        spec: BatchSpec,
        device: torch.device,
        trainer: Trainer | None = None,
        **trainer_options: Any,
    ) -> None:
        self.model = model
        self.spec = spec
        self.device = device
        self._loras: dict[str, LinearLoRA | ExpertsLoRA] = lora_parametrizations(model)
        if not self._loras:
            raise ValueError("the model has no LoRA modules: apply_lora first, at the largest rank a run may have")
        (self.max_rank,) = {lora.rank for lora in self._loras.values()}
        # Under the state-dict names (without the wrappers' prefixes), which the export reads.
        self._params = {
            _state_dict_name(f"{module}.{name}"): param
            for module, lora in self._loras.items()
            for name, param in lora.named_parameters()
        }
        trainable = {_state_dict_name(name) for name, param in model.named_parameters() if param.requires_grad}
        if trainable != set(self._params):
            # A trainable backbone weight would be shared, and so mixed, between the runs.
            extra = sorted(trainable - set(self._params))[:3]
            raise ValueError(f"only the LoRA tensors may be trainable with several runs; also trainable: {extra}")
        self._trainer_options = trainer_options
        self._trainer = trainer
        self._runs: dict[str, _Run] = {}

    @property
    def run_ids(self) -> list[str]:
        return list(self._runs)

    def config_of(self, run_id: str) -> RunConfig:
        return self._run(run_id).config

    def step_of(self, run_id: str) -> int:
        return self._run(run_id).step

    def failure_of(self, run_id: str) -> str | None:
        """Why the run failed, or None while it can train."""
        return self._run(run_id).failure

    def add_run(self, run_id: str, config: RunConfig) -> None:
        """A new run at step 0, its adapter as `apply_lora` at its rank and seed starts one."""
        if run_id in self._runs:
            raise AlreadyExists(f"run {run_id!r} exists already")
        if not 0 < config.rank <= self.max_rank:
            raise InvalidArgument(f"must be in [1, {self.max_rank}], got {config.rank}", field="rank")
        if config.alpha <= 0:
            raise InvalidArgument(f"must be positive, got {config.alpha}", field="alpha")
        if config.mode not in ("rl", "sft"):
            raise InvalidArgument(f"must be 'rl' or 'sft', got {config.mode!r}", field="mode")
        initial = {
            _state_dict_name(name): tensor
            for name, tensor in initial_lora_tensors(self.model, rank=config.rank, seed=config.seed).items()
        }
        adapter = {name: _like(param, initial[name]) for name, param in self._params.items()}
        # Each optimizer's state is its own: the moments of one run never meet another's.
        optimizer = build_optimizer(self.model, config.optimizer)
        run = _Run(config, adapter, optimizer, build_lr_scheduler(optimizer, config.schedule))

        def update_begins(*_: object) -> None:
            run.updating = True

        optimizer.register_step_pre_hook(update_begins)
        self._runs[run_id] = run
        logger.info("added run %s (rank %d, alpha %g)", run_id, config.rank, config.alpha, extra={"run_id": run_id})

    def remove_run(self, run_id: str) -> None:
        self._run(run_id)
        del self._runs[run_id]
        logger.info("removed run %s", run_id, extra={"run_id": run_id})

    def train_step(
        self, run_id: str, micro_batches: Sequence[MicroBatch], *, num_loss_tokens: int | None = None
    ) -> dict[str, float]:
        """One optimizer step of one run on its batch; return its metrics (`Trainer.train_step`'s,
        and `run_switch_s`: the time spent copying the adapter in and out)."""
        run = self._run(run_id)
        if run.failure is not None:
            raise FailedPrecondition(f"run {run_id!r} failed: {run.failure}", subject=run_id)
        start = time.perf_counter()
        self._activate(run)
        trainer = self._trainer_for(run)
        switch_s = time.perf_counter() - start
        run.updating = False
        epoch = run.lr_scheduler.last_epoch
        try:
            metrics = trainer.train_step(micro_batches, num_loss_tokens=num_loss_tokens)
        except BaseException as exc:
            # The run's tensors were never written: only the optimizer's update (and the
            # schedule after it) can have moved its state.
            if run.updating or run.lr_scheduler.last_epoch != epoch:
                run.failure = f"{type(exc).__name__}: {exc}"
                logger.exception("run %s failed during its update", run_id, extra={"run_id": run_id})
            raise
        finally:
            for param in self._params.values():
                param.grad = None
        run.step = trainer.step
        start = time.perf_counter()
        with torch.no_grad():
            for name, param in self._params.items():
                _local(run.adapter[name]).copy_(_local(param))
        return metrics | {"run_switch_s": switch_s + time.perf_counter() - start}

    def state_dict(self, run_id: str) -> dict[str, Any]:
        """What a run's checkpoint holds: its adapter (padded to max_rank, as the model's LoRA
        tensors are laid out, DTensors when sharded), optimizer and schedule state and step. Like
        nn.Module.state_dict, the tensors are the live ones: save or copy them before its next step."""
        run = self._run(run_id)
        return {
            "rank": run.config.rank,
            "alpha": run.config.alpha,
            "adapter": dict(run.adapter),
            "optimizer": run.optimizer.state_dict(),
            "lr_scheduler": run.lr_scheduler.state_dict(),
            "step": run.step,
        }

    def load_state_dict(self, run_id: str, state: dict[str, Any]) -> None:
        """Restore a run added with the same rank and alpha from its `state_dict` (its adapter as
        DTensors laid out as the model's, or whole tensors); a failed run can train again."""
        run = self._run(run_id)
        if (state["rank"], state["alpha"]) != (run.config.rank, run.config.alpha):
            raise InvalidArgument(
                f"the state is of a run with rank {state['rank']} and alpha {state['alpha']}, "
                f"not {run.config.rank} and {run.config.alpha}",
                field="state",
            )
        if state["adapter"].keys() != run.adapter.keys():
            raise InvalidArgument("the state's adapter is of other LoRA modules than the model's", field="state")
        with torch.no_grad():
            for name, tensor in state["adapter"].items():
                if tensor.shape != run.adapter[name].shape:
                    raise InvalidArgument(
                        f"{name}: shape {tuple(tensor.shape)}, not {tuple(run.adapter[name].shape)} "
                        f"(saved with another max_rank?)",
                        field="state",
                    )
            for name, tensor in state["adapter"].items():
                source = tensor if isinstance(tensor, DTensor) else _like(run.adapter[name], tensor)
                _local(run.adapter[name]).copy_(_local(source))
        run.optimizer.load_state_dict(state["optimizer"])
        run.lr_scheduler.load_state_dict(state["lr_scheduler"])
        run.step = state["step"]
        run.failure = None

    def adapter_tensors(self, run_id: str) -> dict[str, torch.Tensor]:
        """The run's LoRA tensors at its own rank (A [rank, in] or [E, rank, in], B [out, rank] or
        [E, out, rank]), whole, under the model's state-dict names in its order: what
        `export.exported_tensors(model, ..., kind="adapter")` publishes under PEFT's names, with
        the run's scale (`RunConfig.scale`). Collective for a sharded model."""
        run = self._run(run_id)
        rank = run.config.rank
        tensors = {}
        for name, tensor in run.adapter.items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            tensors[name] = (full[..., :rank, :] if name.endswith("lora_A") else full[..., :rank]).clone()
        return tensors

    def _run(self, run_id: str) -> _Run:
        run = self._runs.get(run_id)
        if run is None:
            raise NotFound(f"no run {run_id!r}")
        return run

    @torch.no_grad()
    def _activate(self, run: _Run) -> None:
        """The model computes with `run`'s adapter and scale."""
        for name, param in self._params.items():
            _local(param).copy_(_local(run.adapter[name]))
        for lora in self._loras.values():
            lora.scale, lora.active_rank = run.config.scale, run.config.rank

    def _trainer_for(self, run: _Run) -> Trainer:
        """The one trainer of the model (one, so that per-model hooks such as the MoE load
        metrics' are registered once), pointed at the run's optimizer, schedule, step and loss."""
        config = run.config
        if self._trainer is None:
            self._trainer = Trainer(
                self.model,
                run.optimizer,
                run.lr_scheduler,
                spec=self.spec,
                device=self.device,
                mode=config.mode,
                loss_config=config.loss,
                max_grad_norm=config.optimizer.max_grad_norm,
                **self._trainer_options,
            )
        trainer = self._trainer
        trainer.optimizer, trainer.lr_scheduler, trainer.step = run.optimizer, run.lr_scheduler, run.step
        trainer.mode, trainer.loss_config, trainer.max_grad_norm = (
            config.mode,
            config.loss,
            config.optimizer.max_grad_norm,
        )
        return trainer


def _state_dict_name(name: str) -> str:
    """A parameter's name as the model's state dict has it: without the prefixes that activation
    checkpointing and torch.compile wrappers add to named_parameters' names."""
    return name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", "")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The data this rank holds: a DTensor's local shard, a plain tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _like(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """`full` (every rank's same values) laid out as `param`: on its device, and for a DTensor
    sharded as it is, each rank keeping its own shard (no communication)."""
    if isinstance(param, DTensor):
        return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    return full.to(device=param.device, dtype=param.dtype).clone()
