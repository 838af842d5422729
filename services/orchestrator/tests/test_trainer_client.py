"""TrainerFeed and the tracking WatchSteps follower against a trainer with runs (every call names
the run, peers.run_id) and against a trainer of one run, which refuses a run id; and a served
orchestrator of a run: it feeds that run and generates with the run's adapter."""

from __future__ import annotations

import asyncio
import functools
import pathlib

import grpc
import pytest

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.errors import ErrorInterceptor, FailedPrecondition, InvalidArgument, NotFound
from primerl_common.testing import bare_server, eventually, in_process_service
from primerl_launcher.tiny_model import save_tokenizer
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.packing import TrainingSample, pack
from primerl_orchestrator.samples import Sample
from primerl_orchestrator.server import build
from primerl_orchestrator.tracking import watch_trainer_steps
from primerl_orchestrator.trainer_client import TrainerError, TrainerFeed

from .stand_ins import StandInRouter, play_group


class RunsTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """A trainer with runs, as trainer.v1 describes one: each run trains the adapter named by its
    id and counts its own steps; a call without a run id, or naming an unknown run, is refused.
    Every request it gets is kept in `requests`."""

    def __init__(self, *run_ids: str) -> None:
        self.completed = dict.fromkeys(run_ids, 0)
        self.pushed: dict[str, list[int]] = {run_id: [] for run_id in run_ids}
        self.requests: list[object] = []

    def _run(self, run_id: str) -> str:
        if not run_id:
            raise InvalidArgument("this trainer trains many runs: name one", field="run_id")
        if run_id not in self.completed:
            raise NotFound(f"no run {run_id!r}")
        return run_id

    async def GetBatchSpec(self, request, context):
        self.requests.append(request)
        run_id = self._run(request.run_id)
        return trainer_pb2.GetBatchSpecResponse(
            seq_len=256,
            vocab_size=320,
            next_step=self.completed[run_id] + len(self.pushed[run_id]) + 1,
            mode=trainer_pb2.TRAINING_MODE_RL,
            lora_adapter=run_id,
        )

    async def GetStatus(self, request, context):
        self.requests.append(request)
        run_id = self._run(request.run_id)
        return trainer_pb2.GetStatusResponse(mode=trainer_pb2.TRAINING_MODE_RL, step=self.completed[run_id])

    async def PushBatch(self, request_iterator, context):
        begins = [request.begin async for request in request_iterator if request.HasField("begin")]
        self.requests += begins
        run_id = self._run(begins[0].run_id)
        self.pushed[run_id].append(begins[0].step)
        return trainer_pb2.PushBatchResponse(step=begins[0].step)

    async def WatchSteps(self, request, context):
        self.requests.append(request)
        run_id = self._run(request.run_id)
        for step in range(request.after_step + 1, self.completed[run_id] + 1):
            yield trainer_pb2.WatchStepsResponse(step=trainer_pb2.StepMetrics(step=step, metrics={"loss": step / 10}))
        await asyncio.Event().wait()


class OneRunTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """A trainer without runs: a run id is refused with RUNS_DISABLED."""

    def _refuse(self, run_id: str) -> None:
        if run_id:
            raise FailedPrecondition("this trainer trains one run", reason="RUNS_DISABLED", subject=run_id)

    async def GetBatchSpec(self, request, context):
        self._refuse(request.run_id)
        return trainer_pb2.GetBatchSpecResponse(seq_len=256, next_step=1, mode=trainer_pb2.TRAINING_MODE_RL)

    async def GetStatus(self, request, context):
        self._refuse(request.run_id)
        return trainer_pb2.GetStatusResponse(mode=trainer_pb2.TRAINING_MODE_RL)

    async def PushBatch(self, request_iterator, context):
        begins = [request.begin async for request in request_iterator if request.HasField("begin")]
        self._refuse(begins[0].run_id)
        return trainer_pb2.PushBatchResponse(step=begins[0].step)


def serve(trainer: trainer_pb2_grpc.TrainerServiceServicer):
    return bare_server(
        functools.partial(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, trainer),
        interceptors=[ErrorInterceptor()],
    )


def one_sample_batch():
    sample = Sample([1, 2, 3], [False, True, True], [0.0, -0.1, -0.2], [0, 0, 0], [1.0, 1.0, 1.0])
    return pack([TrainingSample(sample, 1.0)], seq_len=8, with_routed_experts=False)


async def test_every_call_of_a_feed_names_its_run():
    trainer = RunsTrainer("run-a", "run-b")
    trainer.completed["run-a"] = 2
    async with serve(trainer) as address:
        feed = TrainerFeed(address, lora_adapter="run-a", run_id="run-a")
        try:
            spec = await feed.batch_spec()
            assert spec.next_step == 3
            assert await feed.completed_step() == 2
            await feed.push(3, one_sample_batch())
        finally:
            await feed.close()
    assert trainer.pushed == {"run-a": [3], "run-b": []}
    assert [type(r).__name__ for r in trainer.requests] == ["GetBatchSpecRequest", "GetStatusRequest", "BatchBegin"]
    assert {r.run_id for r in trainer.requests} == {"run-a"}


async def test_the_tracking_follower_watches_the_runs_steps():
    trainer = RunsTrainer("run-a", "run-b")
    trainer.completed.update({"run-a": 3, "run-b": 7})
    logged: list[tuple[int, dict[str, float]]] = []

    class Tracker:
        def log_trainer_step(self, step: int, metrics: dict[str, float]) -> None:
            logged.append((step, metrics))

    async with serve(trainer) as address:
        watching = asyncio.ensure_future(watch_trainer_steps(address, Tracker(), after_step=1, run_id="run-a"))
        try:
            await eventually(lambda: len(logged) == 2, timeout_s=10, what="run-a's steps 2 and 3 were logged")
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
    assert logged == [(2, {"loss": 0.2}), (3, {"loss": 0.3})]
    [request] = trainer.requests
    assert (request.run_id, request.after_step) == ("run-a", 1)


async def test_a_trainer_of_one_run_refusing_the_run_id_is_a_trainer_error_naming_the_field():
    async with serve(OneRunTrainer()) as address:
        feed = TrainerFeed(address, lora_adapter="run-a", run_id="run-a")
        try:
            with pytest.raises(TrainerError, match=r"trains one run .*unset peers\.run_id"):
                await feed.batch_spec()
            with pytest.raises(TrainerError, match=r"unset peers\.run_id"):
                await feed.completed_step()
            with pytest.raises(TrainerError, match=r"unset peers\.run_id"):
                await feed.push(1, one_sample_batch())
        finally:
            await feed.close()


async def test_a_missing_run_id_is_a_trainer_error_and_a_run_not_created_yet_is_waited_for():
    trainer = RunsTrainer("run-a")
    async with serve(trainer) as address:
        without = TrainerFeed(address)
        unknown = TrainerFeed(address, lora_adapter="run-z", run_id="run-z")
        try:
            with pytest.raises(TrainerError, match=r"trains many runs: set peers\.run_id"):
                await without.batch_spec()
            # The run's orchestrator may start before the run is created: it waits for it.
            waiting = asyncio.create_task(unknown.batch_spec())
            await asyncio.sleep(0.5)
            assert not waiting.done()
            trainer.completed["run-z"], trainer.pushed["run-z"] = 0, []
            spec = await asyncio.wait_for(waiting, timeout=15)
            assert spec.next_step == 1
            # A run gone mid-run (deleted) is an error, not waited for.
            del trainer.completed["run-z"]
            with pytest.raises(TrainerError, match=r"\(run 'run-z'\).*no run 'run-z'.*deleted"):
                await unknown.completed_step()
        finally:
            await without.close()
            await unknown.close()


async def test_a_call_cancelled_by_a_stopping_trainer_is_asked_again_not_a_failed_run():
    """A trainer going down mid-call can end the call CANCELLED (its stream reset as it stops; CI
    saw it fail a run's GetBatchSpec on a trainer restart): the feed asks again, as for a trainer
    away, and goes on with the answer."""

    class Stopping(OneRunTrainer):
        def __init__(self) -> None:
            self.calls = 0

        async def GetBatchSpec(self, request, context):
            self.calls += 1
            if self.calls == 1:
                await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
            return await super().GetBatchSpec(request, context)

    trainer = Stopping()
    async with serve(trainer) as address:
        feed = TrainerFeed(address)
        try:
            assert (await asyncio.wait_for(feed.batch_spec(), 30)).next_step == 1
        finally:
            await feed.close()
    assert trainer.calls == 2


async def test_a_feed_whose_adapter_is_not_the_runs_names_the_run():
    async with serve(RunsTrainer("run-a")) as address:
        feed = TrainerFeed(address, lora_adapter="", run_id="run-a")
        try:
            with pytest.raises(
                TrainerError, match=r"\(run 'run-a'\) trains and publishes LoRA adapter 'run-a'.*named by its run id"
            ):
                await feed.batch_spec()
        finally:
            await feed.close()


class RecordingRouter(StandInRouter):
    def __init__(self) -> None:
        self.adapters: list[str] = []

    async def Generate(self, request, context):
        self.adapters.append(request.input.lora_adapter)
        yield router_pb2.GenerateResponse(output=self.output(request))


async def test_a_served_orchestrator_of_a_run_feeds_it_and_generates_with_its_adapter(tmp_path: pathlib.Path):
    save_tokenizer(tmp_path)
    trainer, router = RunsTrainer("run-a", "run-b"), RecordingRouter()
    async with (
        serve(trainer) as trainer_at,
        bare_server(functools.partial(router_pb2_grpc.add_RouterServiceServicer_to_server, router)) as router_at,
    ):
        config = OrchestratorConfig(
            server={"host": "127.0.0.1", "port": 0},
            peers={"router": router_at, "trainer": trainer_at, "run_id": "run-a", "poll_interval_s": 0.05},
            model={"path": tmp_path, "max_model_len": 64},
            environments=[{"name": "guess", "group_size": 2}],
            run={"batch_size": 2, "max_steps": 3},
        )
        async with in_process_service(await build(config), config) as served:
            stub = orchestrator_pb2_grpc.OrchestratorServiceStub(served.channel)

            async def running() -> bool:
                status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
                return status.state == orchestrator_pb2.RUN_STATE_RUNNING and status.policy_version == 0

            await eventually(running, timeout_s=30, what="the run is running at policy version 0")
            await play_group(stub, "informative", [1.0, 0.0])
            await eventually(lambda: trainer.pushed["run-a"] == [1], timeout_s=30, what="run-a got step 1")
    assert router.adapters == ["run-a", "run-a"]
    assert trainer.pushed["run-b"] == []
    assert {r.run_id for r in trainer.requests} == {"run-a"}
