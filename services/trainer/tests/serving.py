"""Helpers of the service tests: a trainer config around the tiny model, the service run
in-process on port 0 behind its real stub, and batches as PushBatch streams."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
import torch

from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.tensors import tensor_to_proto
from primerl_common.testing import in_process_service
from primerl_trainer.batch import MicroBatch
from primerl_trainer.config import TrainerConfig
from primerl_trainer.optim import build_lr_scheduler, build_optimizer
from primerl_trainer.server import build
from primerl_trainer.train import Trainer

from .tiny_training import SEQ_LEN, batch_spec, load_tiny_model

CPU = torch.device("cpu")
METRICS = ("loss", "grad_norm", "lr", "entropy", "mismatch_kl", "num_loss_tokens")


def trainer_config(model_dir: pathlib.Path, **overrides: Any) -> TrainerConfig:
    """float32 everywhere (exact comparisons), the tiny tests' optimizer; `overrides` are
    TrainerConfig fields (sections as dicts)."""
    fields: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "port": 0, "drain_delay_s": 0.0, "grace_s": 5.0},
        "observability": {"log_json": False, "log_level": "WARNING"},
        "model": {"path": str(model_dir), "dtype": "float32", "compute_dtype": "float32"},
        "seq_len": SEQ_LEN,
        "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
        "schedule": {"decay": "cosine", "warmup_steps": 1, "total_steps": 8, "min_lr_ratio": 0.1},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(fields.get(key), dict):
            fields[key] = fields[key] | value
        else:
            fields[key] = value
    return TrainerConfig(**fields)


def config_toml(config: TrainerConfig) -> str:
    """The config as a TOML file for `primerl-trainer -c`."""
    top, sections = [], []
    for key, value in config.model_dump(mode="json", exclude_none=True).items():
        if isinstance(value, dict):
            sections += [f"[{key}]", *(f"{k} = {_toml(v)}" for k, v in value.items())]
        else:
            top.append(f"{key} = {_toml(value)}")
    return "\n".join(top + sections) + "\n"


def _toml(value: object) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | list):
        return json.dumps(value)
    return repr(value)


@contextlib.asynccontextmanager
async def serving(config: TrainerConfig) -> AsyncIterator[trainer_pb2_grpc.TrainerServiceStub]:
    """The trainer service in this process (port 0) and a stub talking to it."""
    async with in_process_service(await build(config), config, grace_s=5.0) as served:
        yield trainer_pb2_grpc.TrainerServiceStub(served.channel)


async def start_on_two_ranks(config: TrainerConfig, tmp_path: pathlib.Path) -> ServiceProcess:
    """The trainer service on two CPU ranks (torchrun, gloo), serving on config.server.port once
    started; the caller stops and closes it."""
    config_path = tmp_path / "trainer.toml"
    config_path.write_text(config_toml(config))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    process = ServiceProcess(
        [*command, "-m", "primerl_trainer", "-c", str(config_path)], port=config.server.port, env=env
    )
    await process.start(timeout_s=120)
    return process


def reference_trainer(model_dir: pathlib.Path) -> Trainer:
    """A plain Trainer (no service, no FSDP) with the test config."""
    config = trainer_config(model_dir)
    model = load_tiny_model(model_dir)
    optimizer = build_optimizer(model, config.optimizer)
    return Trainer(
        model,
        optimizer,
        build_lr_scheduler(optimizer, config.schedule),
        spec=batch_spec(model),
        device=CPU,
        max_grad_norm=config.optimizer.max_grad_norm,
    )


def reference_metrics(model_dir: pathlib.Path, batches: list[list[MicroBatch]]) -> list[dict[str, float]]:
    """What a plain Trainer reports for the batches, with the test config."""
    trainer = reference_trainer(model_dir)
    return [trainer.train_step(batch) for batch in batches]


def assert_metrics_equal(got: trainer_pb2.StepMetrics, wanted: dict[str, float]) -> None:
    for key in METRICS:
        assert got.metrics[key] == pytest.approx(wanted[key], rel=1e-5, abs=1e-6), key


def micro_batch_to_proto(micro_batch: MicroBatch) -> trainer_pb2.MicroBatch:
    return trainer_pb2.MicroBatch(
        **{
            field.name: tensor_to_proto(value, name=field.name)
            for field in dataclasses.fields(micro_batch)
            if (value := getattr(micro_batch, field.name)) is not None
        }
    )


def push_requests(
    step: int,
    micro_batches: Sequence[MicroBatch | trainer_pb2.MicroBatch],
    *,
    num_micro_batches: int | None = None,
    **begin: Any,
) -> Iterator[trainer_pb2.PushBatchRequest]:
    num_loss_tokens = sum(mb.num_loss_tokens for mb in micro_batches if isinstance(mb, MicroBatch))
    yield trainer_pb2.PushBatchRequest(
        begin=trainer_pb2.BatchBegin(
            step=step,
            num_micro_batches=len(micro_batches) if num_micro_batches is None else num_micro_batches,
            **({"num_loss_tokens": num_loss_tokens} | begin),
        )
    )
    for micro_batch in micro_batches:
        msg = micro_batch if isinstance(micro_batch, trainer_pb2.MicroBatch) else micro_batch_to_proto(micro_batch)
        yield trainer_pb2.PushBatchRequest(micro_batch=msg)


async def push(
    stub: trainer_pb2_grpc.TrainerServiceStub,
    step: int,
    micro_batches: Sequence[MicroBatch | trainer_pb2.MicroBatch],
    **begin: Any,
) -> trainer_pb2.PushBatchResponse:
    return await stub.PushBatch(push_requests(step, micro_batches, **begin), timeout=30)


async def watch(
    stub: trainer_pb2_grpc.TrainerServiceStub, *, after_step: int, count: int, timeout_s: float = 60, run_id: str = ""
) -> list[trainer_pb2.StepMetrics]:
    """The next `count` finished steps after `after_step` (of the run `run_id`, on a trainer with runs)."""
    steps = []
    request = trainer_pb2.WatchStepsRequest(after_step=after_step, run_id=run_id)
    call = stub.WatchSteps(request, timeout=timeout_s)
    async for response in call:
        steps.append(response.step)
        if len(steps) == count:
            call.cancel()
            break
    return steps


def broadcaster_process() -> ServiceProcess:
    """A real weight broadcaster (its binary, on a free port; no replicas): `async with` it. The
    trainer's tests may not import its package, so it runs as the process it is deployed as."""
    port = free_port()
    flags = [f"--server.port={port}", "--server.host=127.0.0.1", "--server.drain_delay_s=0"]
    return ServiceProcess(
        [sys.executable, "-m", "primerl_weight_broadcaster", *flags, "--observability.log_json=false"], port=port
    )
