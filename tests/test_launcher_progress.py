"""The launcher's progress line and warning driven by a real orchestrator (`primerl-orchestrator`,
its trainer and router stand-ins from the orchestrator's tests): a run whose groups are all
filtered for equal rewards shows the group counts and, once the stall lasts, says why no step
comes and what to change; the first informative group makes a step."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import io
import pathlib
import shutil
import sys

import pytest

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.router.v1 import router_pb2_grpc
from primerl.trainer.v1 import trainer_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.testing import bare_server, eventually
from primerl_launcher.progress import Display, RunMonitor, RunPeers
from primerl_launcher.tiny_model import save_tokenizer
from services.orchestrator.tests.stand_ins import StandInRouter, StandInTrainer, play_group

pytestmark = pytest.mark.slow

CONFIG = """\
[server]
host = "127.0.0.1"
port = {port}
drain_delay_s = 0
[peers]
router = "{router}"
trainer = "{trainer}"
poll_interval_s = 0.05
[model]
path = "{model}"
max_model_len = 64
[run]
batch_size = 2
max_steps = 3
[[environments]]
name = "guess"
group_size = 2
"""


async def test_a_run_whose_groups_are_all_filtered_says_so_on_the_progress_line(tmp_path: pathlib.Path):
    save_tokenizer(tmp_path)
    trainer = StandInTrainer()
    binary = shutil.which("primerl-orchestrator", path=str(pathlib.Path(sys.executable).parent))
    assert binary, "primerl-orchestrator is not installed"
    async with (
        bare_server(functools.partial(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, trainer)) as trainer_at,
        bare_server(functools.partial(router_pb2_grpc.add_RouterServiceServicer_to_server, StandInRouter())) as router,
    ):
        port = free_port()
        config = tmp_path / "orchestrator.toml"
        config.write_text(CONFIG.format(port=port, router=router, trainer=trainer_at, model=tmp_path))
        async with (
            ServiceProcess([binary, "-c", str(config)], port=port) as orchestrator,
            make_channel(orchestrator.address) as channel,
        ):
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
            monitor = RunMonitor(
                RunPeers(orchestrator=orchestrator.address, trainer=trainer_at, replicas={}),
                metrics_path=tmp_path / "metrics.jsonl",
                orchestrator_metrics=None,
                poll_interval_s=0.05,
                finish_timeout_s=10,
                # The stall counts from the monitor's first poll, before the groups are played: long
                # enough for all three to have ended when it warns, on a loaded machine too.
                stall_warning_s=6.0,
            )
            out = io.StringIO()
            following = asyncio.ensure_future(monitor.run(Display("RL", None, stream=out, heartbeat_s=0.1)))
            try:
                for index in range(3):
                    await play_group(stub, f"equal-{index}", [0.5, 0.5])
                await eventually(lambda: "warning: no batch for" in out.getvalue(), timeout_s=30, what="the warning")
                text = out.getvalue()
                assert "groups 3 finished, 3 filtered (equal rewards), 0 incomplete, 0 batched" in text, text
                [warning] = [line for line in text.splitlines() if line.startswith("warning:")]
                assert "while 3 groups ended (3 finished): 3 filtered for equal rewards" in warning
                assert "[orchestrator] advantage.filter_zero_advantage = false keeps them" in warning
                assert monitor.status.groups.filtered_equal_rewards == 3  # what the orchestrator said

                # One group whose rewards differ makes a batch: the step comes, the stall is over.
                await play_group(stub, "informative", [1.0, 0.0])
                await eventually(lambda: trainer.pushed == [1], timeout_s=30, what="the trainer got step 1")
                status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
                assert (status.step, status.groups.batched) == (1, 1)
                await eventually(lambda: monitor.status.step == 1, timeout_s=10, what="the monitor saw step 1")
                assert monitor.stall.stalled_s == 0.0 and "no batch for" not in monitor.postfix()
            finally:
                following.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await following
