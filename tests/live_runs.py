"""What the live `primerl up` runs share: the common parts of their launch files (each test
composes them with its own sections) and the launcher process they start and watch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pathlib
import subprocess
import sys
import time
from collections.abc import Iterator

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common.local_vllm import local_cache_dir

CACHE = local_cache_dir()


def launcher_section(model: str, *, inference_replicas: int | None = None) -> str:
    """[launcher]'s common head; the test adds its own keys (check_config, tls, ...) after it."""
    replicas = "" if inference_replicas is None else f"inference_replicas = {inference_replicas}\n"
    return f"""[launcher]
model = "{model}"
{replicas}cache_dir = "{CACHE / "launcher"}"
poll_interval_s = 0.5
start_timeout_s = 240
"""


def orchestrator_head(*, max_model_len: int, max_steps: int, batch_size: int) -> str:
    """The orchestrator's model, peers and the head of [orchestrator.run]; the test adds the
    rest of the run's keys."""
    return f"""[orchestrator.model]
max_model_len = {max_model_len}
[orchestrator.peers]
poll_interval_s = 0.2
[orchestrator.run]
max_steps = {max_steps}
batch_size = {batch_size}
"""


NO_ZERO_ADVANTAGE_FILTER = """[orchestrator.advantage]
filter_zero_advantage = false
"""


def reverse_text_environment(*, group_size: int, max_tokens: int) -> str:
    return f"""[[orchestrator.environments]]
name = "reverse_text"
kind = "reverse_text"
group_size = {group_size}
[orchestrator.environments.sampling]
max_tokens = {max_tokens}
"""


def trainer_section(*, seq_len: int, router_replay: bool = False, optimizer: bool = True) -> str:
    """The trainer on CPU in float32 (with a learning rate of 1e-4 unless `optimizer` is off)."""
    replay = "router_replay = true\n" if router_replay else ""
    optimizer_table = "[trainer.optimizer]\nlr = 1e-4\n" if optimizer else ""
    return f"""[trainer]
device = "cpu"
seq_len = {seq_len}
{replay}[trainer.model]
dtype = "float32"
compute_dtype = "float32"
{optimizer_table}"""


def inference_engine(*, max_model_len: int, max_num_seqs: int, kv_cache_gib: float) -> str:
    """vLLM on CPU in float32, eager."""
    return f"""[inference.engine]
dtype = "float32"
enforce_eager = true
max_model_len = {max_model_len}
max_num_seqs = {max_num_seqs}
kv_cache_gib = {kv_cache_gib}
"""


def router_and_broadcaster(*, no_replica_wait_s: float, router_load: str = "") -> str:
    """Quick health probes and pushes; `router_load` is an optional [router.load] table."""
    return f"""[router.health]
interval_s = 0.5
{router_load}[router.routing]
no_replica_wait_s = {no_replica_wait_s}
[weight_broadcaster.push]
probe_interval_s = 0.5
"""


@contextlib.contextmanager
def primerl_up(
    config: pathlib.Path, run_dir: pathlib.Path, out: pathlib.Path, *, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[str]]:
    """`primerl up -c config` with its output in `out`; killed on the way out if still running."""
    with out.open("w") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "primerl_launcher", "up", "-c", str(config), "--run-dir", str(run_dir)],
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
    try:
        yield launcher
    finally:
        launcher.kill()


def environ_without(*names: str, suffix: str | None = None) -> dict[str, str]:
    """This process's environment less `names` (and any variable ending in `suffix`)."""
    return {
        name: value
        for name, value in os.environ.items()
        if name not in names and not (suffix is not None and name.endswith(suffix))
    }


def read_services(run_dir: pathlib.Path) -> dict | None:
    """services.json, written once every service is SERVING; None before."""
    path = run_dir / "services.json"
    return json.loads(path.read_text()) if path.is_file() else None


def read_records(run_dir: pathlib.Path) -> list[dict]:
    """The run's metrics.jsonl, one record per step."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def printed(out: pathlib.Path) -> str:
    return out.read_text() if out.is_file() else ""


async def until_while_running(
    check, *, launcher: subprocess.Popen[str], out: pathlib.Path, timeout_s: float, what: str
):
    """Polls `check` until it returns something true; fails with the launcher's output if the
    launcher exits or `timeout_s` passes first."""
    give_up_at = time.monotonic() + timeout_s
    while not (value := await check()):
        assert launcher.poll() is None, f"the launcher exited while waiting for {what}:\n{printed(out)}"
        assert time.monotonic() < give_up_at, f"gave up waiting for {what}:\n{printed(out)}"
        await asyncio.sleep(0.2)
    return value


def services_of(launcher: subprocess.Popen[str], run_dir: pathlib.Path, out: pathlib.Path, *, timeout_s: float) -> dict:
    """What the launcher started, once every service is SERVING (services.json)."""

    async def services() -> dict | None:
        return read_services(run_dir)

    return asyncio.run(
        until_while_running(services, launcher=launcher, out=out, timeout_s=timeout_s, what="the services")
    )


async def greedy(replica: inference_pb2_grpc.InferenceServiceStub, adapter: str) -> generation_pb2.GenerationOutput:
    """Eight greedy tokens of one fixed prompt from `replica`, with `adapter` ('': the base model)."""
    request = inference_pb2.GenerateRequest(
        input=generation_pb2.GenerationInput(
            prompt_token_ids=list(range(40, 60)),
            sampling=generation_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            stream=generation_pb2.StreamOptions(final_only=True),
            lora_adapter=adapter,
        )
    )
    [response] = [response async for response in replica.Generate(request)]
    return response.output
