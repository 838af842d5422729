"""The real services the end-to-end tests drive, started once per session (conftest.py):
primerl-inference (vLLM on CPU, a tiny Qwen3-MoE) behind primerl-router, on the pooled KV
cache of primerl-kvstore (it saves the prefix blocks it computes and loads those the pool has),
primerl-trainer replaying the routed experts and checkpointing on a graceful stop, and
primerl-weight-broadcaster pushing each version the trainer publishes to the replica (which
the router follows). Each service can be restarted on its own config and port.

The model is the tiny MoE after a few SFT steps on the guessing game (cached), so that its
answers are text that the chat template renders back to the same tokens; a random model
samples bytes that do not survive decoding, which rightly starts a new sample each turn.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import pathlib
import random
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file

from primerl.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.local_vllm import local_cache_dir
from primerl_common.processes import ServiceProcess, free_port
from primerl_launcher.tiny_model import make_tiny_model

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "custom_env" / "guessing_game.py"
CACHE = local_cache_dir()
MAX_MODEL_LEN = 512
SEQ_LEN = 1024
REPLICA_ID = "inference-0"
# Bump to remake the cached model.
_RECIPE = "guess-sft-v1"
# vLLM and the trainer take a while to start on a shared 2-core box.
_START_TIMEOUT_S = 240


def binary(name: str) -> str:
    return str(pathlib.Path(sys.executable).parent / name)


def service_args(name: str, port: int, *flags: str) -> list[str]:
    common = [f"--server.port={port}", "--server.host=127.0.0.1", "--server.drain_delay_s=0"]
    return [binary(name), *common, "--observability.log_json=false", *flags]


# ---------------------------------------------------------------------------- the model


def guessing_model(root: pathlib.Path) -> pathlib.Path:
    """The tiny MoE taught to answer the guessing game with one digit and the end of turn."""
    sys.path.insert(0, str(EXAMPLE.parent))
    import guessing_game

    digest = hashlib.sha256((_RECIPE + guessing_game.SYSTEM_PROMPT).encode()).hexdigest()[:12]
    root.mkdir(parents=True, exist_ok=True)
    out = root / f"tiny-moe-{digest}"
    if (out / "model.safetensors").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = make_tiny_model(root / "tiny-moe-float32", kind="moe", dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(base)
    rng = random.Random(0)

    def conversation() -> tuple[list[int], list[bool]]:
        secret = rng.randint(1, 9)
        messages = [
            {"role": "system", "content": guessing_game.SYSTEM_PROMPT.format(low=1, high=9)},
            {"role": "user", "content": "Your first guess?"},
        ]
        ids: list[int] = []
        mask: list[bool] = []
        for _ in range(rng.randint(1, 3)):
            prompt = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
            appended = prompt["input_ids"][len(ids) :]
            guess = rng.randint(1, 9)
            answer = [*tokenizer.encode(str(guess), add_special_tokens=False), tokenizer.eos_token_id]
            ids += appended + answer
            mask += [False] * len(appended) + [True] * len(answer)
            messages += [
                {"role": "assistant", "content": str(guess)},
                {"role": "user", "content": guessing_game.feedback(guess, secret)},
            ]
        return ids, mask

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # several threads spin against each other on a shared 2-core box
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
            for _ in range(14):
                batch = [conversation() for _ in range(8)]
                width = max(len(ids) for ids, _ in batch)
                ids = torch.tensor([ids + [0] * (width - len(ids)) for ids, _ in batch])
                mask = torch.tensor([mask + [False] * (width - len(mask)) for _, mask in batch])
                logits = model(input_ids=ids).logits[:, :-1]
                loss = torch.nn.functional.cross_entropy(logits[mask[:, 1:]], ids[:, 1:][mask[:, 1:]])
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        staging = pathlib.Path(tempfile.mkdtemp(dir=root, prefix=".guess-"))
        shutil.copytree(base, staging, dirs_exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root) as saved:
            model.save_pretrained(saved)
            assert set(load_file(f"{saved}/model.safetensors")) == set(load_file(base / "model.safetensors"))
            shutil.copy(f"{saved}/model.safetensors", staging / "model.safetensors")
        os.replace(staging, out)
    finally:
        torch.set_num_threads(threads)
    return out


# ---------------------------------------------------------------------------- the stack


@dataclass
class Stack:
    model: pathlib.Path
    # By service name: kvstore, inference, weight_broadcaster, router, trainer.
    processes: dict[str, ServiceProcess]
    # Where the output of each stopped process is kept (<name>-<n>.log).
    log_dir: pathlib.Path

    @property
    def router(self) -> str:
        return self.processes["router"].address

    @property
    def trainer(self) -> str:
        return self.processes["trainer"].address

    @property
    def weight_broadcaster(self) -> str:
        return self.processes["weight_broadcaster"].address

    @property
    def inference(self) -> str:
        return self.processes["inference"].address

    @property
    def kvstore(self) -> str:
        return self.processes["kvstore"].address

    @property
    def trainer_process(self) -> ServiceProcess:
        return self.processes["trainer"]

    async def restart(self, name: str, *, kill: bool = False, env: dict[str, str] | None = None) -> ServiceProcess:
        """Service `name` restarted (see `restart`)."""
        log = self.log_dir / f"{name}-{len(list(self.log_dir.glob(f'{name}-*.log')))}.log"
        self.processes[name] = await restart(self.processes[name], kill=kill, env=env, log=log)
        return self.processes[name]

    async def stop(self) -> None:
        await asyncio.gather(*(process.stop() for process in self.processes.values()))
        for name, process in self.processes.items():
            await asyncio.to_thread((self.log_dir / f"{name}-last.log").write_text, process.output())
            await process.__aexit__(None, None, None)


async def restart(
    process: ServiceProcess,
    *,
    kill: bool = False,
    env: dict[str, str] | None = None,
    log: pathlib.Path | None = None,
) -> ServiceProcess:
    """`process` stopped (SIGTERM, which must exit 0; or SIGKILL) and started again on the same
    arguments and port, with `env` added to its environment; its output is kept in `log`."""
    if kill:
        process.kill()
        await process.wait()
    else:
        code = await process.stop()
        assert code == 0, f"{process.args[0]} exited with {code} on SIGTERM:\n{process.output()}"
    if log is not None:
        await asyncio.to_thread(log.write_text, process.output())
    await process.__aexit__(None, None, None)
    again = ServiceProcess(process.args, port=process.port, env=env)
    await again.start(timeout_s=_START_TIMEOUT_S)
    return again


@asynccontextmanager
async def running_stack(root: pathlib.Path) -> AsyncIterator[Stack]:
    model = guessing_model(CACHE)
    ports = {name: free_port() for name in ("kvstore", "inference", "weight_broadcaster", "router", "trainer")}
    kvstore, inference, broadcaster = (
        f"127.0.0.1:{ports[name]}" for name in ("kvstore", "inference", "weight_broadcaster")
    )
    router_config = root / "router.toml"
    router_config.write_text(
        f'[[replicas]]\nreplica_id = "{REPLICA_ID}"\naddress = "{inference}"\n'
        f'[versions]\nweight_broadcaster_address = "{broadcaster}"\n'
        "[health]\ninterval_s = 0.5\n[load]\nreport_interval_ms = 100\n[routing]\nno_replica_wait_s = 60.0\n"
    )
    broadcaster_config = root / "weight_broadcaster.toml"
    broadcaster_config.write_text(
        f'[push]\nprobe_interval_s = 0.5\n[[replicas]]\nreplica_id = "{REPLICA_ID}"\naddress = "{inference}"\n'
    )
    args = {
        # Metadata and storage in one process, blocks in DRAM.
        "kvstore": service_args("primerl-kvstore", ports["kvstore"]),
        "inference": service_args(
            "primerl-inference",
            ports["inference"],
            f"--engine.model={model}",
            "--engine.dtype=float32",
            "--engine.enforce_eager=true",
            f"--engine.max_model_len={MAX_MODEL_LEN}",
            "--engine.max_num_seqs=16",
            f"--replica.id={REPLICA_ID}",
            "--kv_cache_pool.enabled=true",
            f"--kv_cache_pool.metadata_address={kvstore}",
            "--kv_cache_pool.timeout_s=5",  # a restarting kvstore costs a turn seconds, not a minute
        ),
        "weight_broadcaster": service_args(
            "primerl-weight-broadcaster", ports["weight_broadcaster"], "-c", str(broadcaster_config)
        ),
        "router": service_args("primerl-router", ports["router"], "-c", str(router_config)),
        "trainer": service_args(
            "primerl-trainer",
            ports["trainer"],
            f"--model.path={model}",
            "--model.dtype=float32",
            "--model.compute_dtype=float32",
            f"--seq_len={SEQ_LEN}",
            "--router_replay=true",
            "--max_queued_batches=2",
            f"--publish.weight_broadcaster={broadcaster}",
            # Saved on a graceful stop only (checkpoint.save_on_stop), resumed from on start.
            f"--checkpoint.dir={root / 'trainer-checkpoints'}",
        ),
    }
    processes = {name: ServiceProcess(service, port=ports[name]) for name, service in args.items()}
    stack = Stack(model=model, processes=processes, log_dir=root / "logs")
    stack.log_dir.mkdir()
    try:
        await asyncio.gather(*(process.start(timeout_s=_START_TIMEOUT_S) for process in processes.values()))
        yield stack
    finally:
        await stack.stop()


# ---------------------------------------------------------------------------- the orchestrator


def orchestrator_config(
    stack: Stack,
    path: pathlib.Path,
    *,
    environments: str,
    run: dict[str, Any],
    versions_from_broadcaster: bool = True,
    **output: Any,
) -> pathlib.Path:
    """Without versions_from_broadcaster the orchestrator takes the trainer's completed steps."""
    lines = [
        "[peers]",
        f'router = "{stack.router}"',
        f'trainer = "{stack.trainer}"',
        "poll_interval_s = 0.2",
        *([f'weight_broadcaster = "{stack.weight_broadcaster}"'] if versions_from_broadcaster else []),
        "[model]",
        f'path = "{stack.model}"',
        f"max_model_len = {MAX_MODEL_LEN}",
        "[run]",
        *(f"{key} = {value}" for key, value in run.items()),
        "[output]",
        *(f'{key} = "{value}"' for key, value in output.items()),
        environments,
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def orchestrator_process(config: pathlib.Path, port: int | None = None) -> ServiceProcess:
    port = port or free_port()
    return ServiceProcess(service_args("primerl-orchestrator", port, "-c", str(config)), port=port)


@asynccontextmanager
async def orchestrator(
    config: pathlib.Path,
) -> AsyncIterator[tuple[ServiceProcess, orchestrator_pb2_grpc.OrchestratorServiceStub]]:
    process = orchestrator_process(config)
    async with process, make_channel(process.address, max_attempts=1) as channel:
        yield process, orchestrator_pb2_grpc.OrchestratorServiceStub(channel)


async def wait_for_status(
    stub: orchestrator_pb2_grpc.OrchestratorServiceStub,
    predicate: Callable[[orchestrator_pb2.GetRunStatusResponse], bool],
    *,
    timeout_s: float,
) -> orchestrator_pb2.GetRunStatusResponse:
    loop = asyncio.get_running_loop()
    give_up_at = loop.time() + timeout_s
    while True:
        status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
        if predicate(status):
            return status
        assert loop.time() < give_up_at, f"gave up waiting; last status:\n{status}"
        await asyncio.sleep(0.2)


# ---------------------------------------------------------------------------- the kvstore


async def kvstore_blocks(stack: Stack) -> int:
    """KV blocks the pool holds now (the replica saves the whole blocks of what it computes)."""
    async with make_channel(stack.kvstore) as channel:
        stats = await kvstore_pb2_grpc.KvStoreServiceStub(channel).GetStats(kvstore_pb2.GetStatsRequest())
    return stats.num_blocks


# ---------------------------------------------------------------------------- the trainer


async def trainer_next_step(stack: Stack) -> int:
    async with make_channel(stack.trainer) as channel:
        spec = await trainer_pb2_grpc.TrainerServiceStub(channel).GetBatchSpec(trainer_pb2.GetBatchSpecRequest())
    return spec.next_step


async def trained_steps(
    stack: Stack, *, after_step: int, until_step: int, timeout_s: float
) -> list[trainer_pb2.StepMetrics]:
    steps = []
    async with make_channel(stack.trainer) as channel:
        call = trainer_pb2_grpc.TrainerServiceStub(channel).WatchSteps(
            trainer_pb2.WatchStepsRequest(after_step=after_step), timeout=timeout_s
        )
        async for response in call:
            steps.append(response.step)
            if response.step.step >= until_step:
                call.cancel()
                break
    return steps
