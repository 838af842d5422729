"""Every service restarted in turn during one RL run, the run still completes every step once.

While the orchestrator plays its built-in environments through the stack (stack.py), each
service is stopped with SIGTERM (graceful: it drains) and started again on the same config
and port: the router as another package version of itself (its next patch version, installed aside and put
first on its PYTHONPATH), the kvstore (its pool of KV blocks lost: the replica's lookups miss
until it saves them again), the inference replica (back on its initial weights), the weight
broadcaster (losing every version it held in RAM), the trainer (resuming from the checkpoint
it saved on the way out). The orchestrator crashes instead (SIGKILL) and resumes from its
checkpoint. Then:

- the trainer trained each step first..last exactly once (WatchSteps of every trainer process),
- the orchestrator's metrics file has each step once, and no model turn failed,
- the replica, the broadcaster and the router agree that the replica serves the last version,
- the router serving is the new version (GetServiceInfo): the contracts hold across versions,
- the replica saves its KV blocks to the restarted kvstore.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Callable

import grpc
import pytest

from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2, weight_broadcaster_pb2_grpc
from primerl_common.client import call_with_retry, make_channel
from primerl_common.processes import ServiceProcess
from primerl_common.testing import eventually

from .stack import (
    REPLICA_ID,
    REPO,
    Stack,
    kvstore_blocks,
    orchestrator_config,
    orchestrator_process,
    restart,
    trainer_next_step,
)

pytestmark = pytest.mark.slow

ROUTER_VERSION = tomllib.loads((REPO / "services" / "router" / "pyproject.toml").read_text())["project"]["version"]
# The next patch release of the router.
NEW_ROUTER_VERSION = ".".join([*ROUTER_VERSION.split(".")[:2], str(int(ROUTER_VERSION.split(".")[2]) + 1)])
# Where the run would end without the orchestrator's restart: never reached.
MAX_STEPS = 1000


def install_router(version: str, root: pathlib.Path) -> pathlib.Path:
    """primerl-router at `version` (the working tree's code, its version bumped), installed into
    a folder of its own; returns that folder (for PYTHONPATH)."""
    source = root / "router-src"
    shutil.copytree(
        REPO / "services" / "router",
        source,
        ignore=shutil.ignore_patterns("tests", "build", "*.egg-info", "__pycache__"),
    )
    pyproject = source / "pyproject.toml"
    text = pyproject.read_text()
    assert f'version = "{ROUTER_VERSION}"' in text
    pyproject.write_text(text.replace(f'version = "{ROUTER_VERSION}"', f'version = "{version}"', 1))
    target = root / "router-site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-cache-dir"]
    subprocess.run(
        [*pip, "--target", str(target), str(source)],
        check=True,
        capture_output=True,
    )
    return target


class TrainedSteps:
    """Every step each trainer process reports through WatchSteps, followed across restarts:
    (instance id, step) once each."""

    def __init__(self, stack: Stack, *, after_step: int, orchestrator: Callable[[], ServiceProcess]) -> None:
        self._stack = stack
        self._after_step = after_step
        # The orchestrator process now (it is restarted): its log goes into a failure's message.
        self._orchestrator = orchestrator
        self.seen: list[tuple[str, int]] = []
        self._changed = asyncio.Event()

    @property
    def steps(self) -> list[int]:
        return [step for _, step in self.seen]

    async def follow(self) -> None:
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                async with make_channel(self._stack.trainer, max_attempts=1) as channel:
                    stub = trainer_pb2_grpc.TrainerServiceStub(channel)
                    info = await stub.GetServiceInfo(trainer_pb2.GetServiceInfoRequest(), timeout=5)
                    instance = info.info.instance_id
                    request = trainer_pb2.WatchStepsRequest(after_step=self._after_step)
                    async for response in stub.WatchSteps(request):
                        if (instance, response.step.step) not in self.seen:
                            self.seen.append((instance, response.step.step))
                            self._changed.set()
            await asyncio.sleep(0.2)

    async def wait_for(self, step: int, *, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):
                while not self.steps or max(self.steps) < step:
                    self._changed.clear()
                    await self._changed.wait()
        except TimeoutError:
            processes = {"orchestrator": self._orchestrator(), "trainer": self._stack.processes["trainer"]}
            logs = "\n".join(f"--- {name}, last lines:\n{p.log_tail(40)}" for name, p in processes.items())
            raise AssertionError(
                f"step {step} not trained within {timeout_s:.0f}s; trained: {self.seen}\n{logs}"
            ) from None


async def service_version(address: str, stub_class: type, request: object) -> str:
    async with make_channel(address) as channel:
        reply = await call_with_retry(lambda: stub_class(channel).GetServiceInfo(request, timeout=5))
    return reply.info.package_version


async def test_each_service_restarted_mid_run_and_every_step_is_trained_once(stack: Stack, tmp_path: pathlib.Path):
    first = await trainer_next_step(stack)
    environments = "\n".join(
        f'[[environments]]\nname = "{kind}"\nkind = "{kind}"\ngroup_size = 2\n[environments.sampling]\nmax_tokens = 8'
        for kind in ("reverse_text", "sort_letters")
    )
    config = orchestrator_config(
        stack,
        tmp_path / "orchestrator.toml",
        environments=environments,
        # Open-ended until the last restart (the orchestrator's), which sets where the run ends:
        # on a quiet machine a step takes about a second, faster than the restarts come.
        run={"batch_size": 4, "max_steps": first + MAX_STEPS, "max_concurrent_episodes": 8},
        checkpoint_dir=tmp_path / "checkpoint",
        metrics_jsonl=tmp_path / "metrics.jsonl",
    )
    config.write_text(config.read_text() + "[advantage]\nfilter_zero_advantage = false\n")
    installing = asyncio.create_task(asyncio.to_thread(install_router, NEW_ROUTER_VERSION, tmp_path))
    orchestrator = orchestrator_process(config)
    trained = TrainedSteps(stack, after_step=first - 1, orchestrator=lambda: orchestrator)
    following = asyncio.create_task(trained.follow())
    await orchestrator.start()
    try:
        await trained.wait_for(first, timeout_s=120)

        # Another package version of the router, on the same config and port.
        router_site = await installing
        await stack.restart("router", env={"PYTHONPATH": str(router_site)})
        router_version = await service_version(
            stack.router, router_pb2_grpc.RouterServiceStub, router_pb2.GetServiceInfoRequest()
        )
        assert router_version == NEW_ROUTER_VERSION
        await trained.wait_for(max(trained.steps) + 1, timeout_s=120)

        # The KV pool, emptied: the replica's pool calls fail or miss meanwhile, and its turns go on.
        await stack.restart("kvstore")
        await trained.wait_for(max(trained.steps) + 1, timeout_s=120)
        # The replica fills the new one with the blocks of the prompts it computes.
        await eventually(
            lambda: kvstore_blocks(stack), timeout_s=60, interval_s=0.5, what="blocks in the restarted kvstore"
        )

        # The only replica: it comes back on its initial weights (version 0) and must get the
        # latest version before the router gives it the turns that need it.
        await stack.restart("inference")
        await trained.wait_for(max(trained.steps) + 1, timeout_s=120)

        # The broadcaster loses every version it held.
        await stack.restart("weight_broadcaster")
        await trained.wait_for(max(trained.steps) + 1, timeout_s=120)

        # The trainer stops gracefully (saving its last step) and resumes from that checkpoint.
        await stack.restart("trainer")
        await trained.wait_for(max(trained.steps) + 1, timeout_s=120)

        # A crash of the orchestrator: it resumes from its checkpoint, told (as a user would,
        # through the environment) to end the run a few steps on. The orchestrator runs at
        # most max_async_level + 1 steps ahead of the trainer, so these steps are still to come.
        last = max(trained.steps) + 6
        orchestrator = await restart(
            orchestrator,
            kill=True,
            env={"PRIMERL_ORCHESTRATOR_RUN__MAX_STEPS": str(last)},
            log=stack.log_dir / "orchestrator-0.log",
        )
        await trained.wait_for(last, timeout_s=180)
        status = await finished(orchestrator, timeout_s=60)
        assert status.step == last and not status.error
    finally:
        following.cancel()
        await orchestrator.stop()
        await asyncio.to_thread((stack.log_dir / "orchestrator-last.log").write_text, orchestrator.output())
        await orchestrator.__aexit__(None, None, None)
        if not installing.done():
            installing.cancel()

    # Each step trained once, by whichever trainer process was up.
    assert sorted(trained.steps) == list(range(first, last + 1)), trained.seen
    # And recorded once; no model turn failed on the way (a turn the router could not take
    # waited for it, or for a replica at the version it needs).
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in records] == list(range(first, last + 1))
    assert sum(record["num_errors"] for record in records) == 0
    await replica_serves(stack, last)
    assert (
        await service_version(stack.router, router_pb2_grpc.RouterServiceStub, router_pb2.GetServiceInfoRequest())
        == NEW_ROUTER_VERSION
    )


async def finished(process: ServiceProcess, *, timeout_s: float) -> orchestrator_pb2.GetRunStatusResponse:
    async with make_channel(process.address) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)

        async def status() -> orchestrator_pb2.GetRunStatusResponse:
            return await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())

        async def done() -> bool:
            return (await status()).state in (orchestrator_pb2.RUN_STATE_FINISHED, orchestrator_pb2.RUN_STATE_FAILED)

        await eventually(done, timeout_s=timeout_s, what="the run is over")
        return await status()


async def replica_serves(stack: Stack, version: int) -> None:
    """The replica serves `version`, and the broadcaster and the router say so."""
    async with (
        make_channel(stack.inference) as inference,
        make_channel(stack.weight_broadcaster) as broadcaster,
        make_channel(stack.router) as router,
    ):

        async def served() -> bool:
            load = await inference_pb2_grpc.InferenceServiceStub(inference).GetLoad(inference_pb2.GetLoadRequest())
            return load.load.policy_version == version

        await eventually(served, timeout_s=60, what=f"the replica serves version {version}")
        status = await weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(broadcaster).GetStatus(
            weight_broadcaster_pb2.GetStatusRequest()
        )
        assert status.latest_policy_version == version
        assert [(r.replica_id, r.policy_version) for r in status.replicas] == [(REPLICA_ID, version)]

        async def routed() -> bool:
            replicas = await router_pb2_grpc.RouterServiceStub(router).ListReplicas(router_pb2.ListReplicasRequest())
            return [(r.replica_id, r.load.policy_version) for r in replicas.replicas] == [(REPLICA_ID, version)]

        await eventually(routed, timeout_s=10, what=f"the router sees the replica at version {version}")
