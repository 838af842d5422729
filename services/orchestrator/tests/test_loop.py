"""The batch loop against a trainer that restarts and loses the batches it had queued: every
step is trained once, the metrics file has one line per step, and the run is finished only
once the trainer has trained the last step."""

from __future__ import annotations

import asyncio
import json

import pytest

from primerl_launcher.tiny_model import save_tokenizer
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.episodes import Rollout
from primerl_orchestrator.loop import BatchLoop
from primerl_orchestrator.packing import PackedBatch
from primerl_orchestrator.run import Run, RunState
from primerl_orchestrator.samples import Sample
from primerl_orchestrator.trainer_client import BatchSpec, StepMismatch
from primerl_orchestrator.versions import VersionSource


class RestartingTrainer:
    """Takes a push only when allowed to (`allow`), queues the batch and trains it when told
    (`train`); `restart` loses the queue."""

    def __init__(self) -> None:
        self._permits = asyncio.Semaphore(0)
        self.completed = 0
        self.queued: list[int] = []
        self.pushes: list[int] = []
        self.trained: list[int] = []

    @property
    def next_step(self) -> int:
        return self.completed + len(self.queued) + 1

    async def batch_spec(self) -> BatchSpec:
        return BatchSpec(
            seq_len=64,
            router_replay=False,
            num_hidden_layers=0,
            num_experts_per_token=0,
            vocab_size=320,
            next_step=self.next_step,
        )

    async def completed_step(self) -> int:
        return self.completed

    def allow(self, num_pushes: int) -> None:
        for _ in range(num_pushes):
            self._permits.release()

    async def push(self, step: int, batch: PackedBatch) -> None:
        await self._permits.acquire()
        self.pushes.append(step)
        if step != self.next_step:
            raise StepMismatch(step, self.next_step)
        self.queued.append(step)

    def train(self) -> None:
        for step in self.queued:
            self.trained.append(step)
            self.completed = step
        self.queued.clear()

    def restart(self) -> None:
        self.queued.clear()

    async def close(self) -> None:
        pass


class InitialVersion(VersionSource):
    served = False

    async def follow(self, on_version) -> None:
        on_version(0)
        await asyncio.Event().wait()


def rollout(index: int) -> Rollout:
    """The `index`th one-rollout batch: one sample of two loss tokens."""
    sample = Sample([1, 2, 3], [False, True, True], [0.0, -0.1, -0.2], [0, 0, 0], [1.0, 1.0, 1.0])
    return Rollout(f"episode-{index}", "env", f"group-{index}", 1.0, 0.5, [sample])


async def pushed(trainer: RestartingTrainer, count: int) -> None:
    """Waits until the loop (a task) has pushed `count` batches."""
    async with asyncio.timeout(10):
        while len(trainer.pushes) < count:  # noqa: ASYNC110 (the loop is a task here)
            await asyncio.sleep(0.01)


@pytest.fixture
def config(tmp_path) -> OrchestratorConfig:
    (tmp_path / "model").mkdir()
    save_tokenizer(tmp_path / "model")
    return OrchestratorConfig(
        model={"path": tmp_path / "model", "max_model_len": 64},
        environments=[{"name": "env", "group_size": 1}],
        run={"batch_size": 1, "max_steps": 4},
        peers={"poll_interval_s": 0.01},
        output={"metrics_jsonl": tmp_path / "metrics.jsonl"},
    )


async def test_batches_a_restarted_trainer_lost_are_collected_again(config):
    trainer = RestartingTrainer()
    run = Run(config, renderer=None, generation=None)  # turns are never played here
    cut: list[int] = []
    next_batch_wanted = asyncio.Event()

    async def next_batch(step: int) -> list[Rollout]:
        cut.append(step)
        next_batch_wanted.set()
        return [rollout(len(cut))]

    run.next_batch = next_batch  # type: ignore[method-assign]
    loop = asyncio.create_task(BatchLoop(config, run, trainer, InitialVersion()).run())
    try:
        trainer.allow(2)
        await pushed(trainer, 2)
        trainer.train()  # steps 1 and 2
        trainer.allow(1)
        await pushed(trainer, 3)
        trainer.restart()  # step 3 was queued, not trained: lost
        trainer.allow(2)
        await pushed(trainer, 5)  # step 4 refused (the trainer expects 3), then that batch as step 3
        trainer.train()
        trainer.allow(1)
        await pushed(trainer, 6)  # step 4, the last
        trainer.restart()  # lost after the last push: the run must not finish
        await asyncio.sleep(0.2)
        assert run.state == RunState.RUNNING
        trainer.allow(1)
        await pushed(trainer, 7)  # step 4 again
        trainer.train()
        await asyncio.wait_for(loop, 10)
    finally:
        loop.cancel()
    assert run.state == RunState.FINISHED and not run.error
    assert trainer.pushes == [1, 2, 3, 4, 3, 4, 4]
    assert trainer.trained == [1, 2, 3, 4]
    records = [json.loads(line) for line in config.output.metrics_jsonl.read_text().splitlines()]
    assert [record["step"] for record in records] == [1, 2, 3, 4]


async def test_a_batch_lost_while_the_next_step_waits_for_its_policy_is_collected_again(config):
    """The next step's rollouts need the policy the lost batch would make (max_async_level 1):
    the loop must notice the trainer expects the lost step again, not wait for that policy."""
    trainer = RestartingTrainer()
    run = Run(config, renderer=None, generation=None)
    cut: list[int] = []

    async def next_batch(step: int) -> list[Rollout]:
        while trainer.completed < step - 1:  # noqa: ASYNC110 (stands for the dispatcher's wait)
            await asyncio.sleep(0.01)
        cut.append(step)
        return [rollout(len(cut))]

    run.next_batch = next_batch  # type: ignore[method-assign]
    loop = asyncio.create_task(BatchLoop(config, run, trainer, InitialVersion()).run())
    try:
        trainer.allow(10)
        await pushed(trainer, 1)
        trainer.train()  # step 1
        await pushed(trainer, 2)
        trainer.restart()  # step 2 was queued, not trained: lost while step 3 waits for policy 2
        await pushed(trainer, 3)  # step 2 again
        for count in (3, 4, 5):
            await pushed(trainer, count)
            trainer.train()
        await asyncio.wait_for(loop, 10)
    finally:
        loop.cancel()
    assert run.state == RunState.FINISHED and not run.error
    assert trainer.pushes == [1, 2, 2, 3, 4]
    assert trainer.trained == [1, 2, 3, 4]
    assert cut == [1, 2, 2, 3, 4]


async def test_a_seq_len_below_every_prompt_fails_the_run_naming_the_field(config, caplog):
    trainer = RestartingTrainer()  # seq_len 64
    run = Run(config, renderer=None, generation=None)  # turns are never played here
    num_cut = 0

    async def next_batch(step: int) -> list[Rollout]:
        nonlocal num_cut
        num_cut += 1
        # A 100-token prompt: cut at 64, no completion token is left to train on.
        sample = Sample(list(range(102)), [False] * 100 + [True] * 2, [0.0] * 102, [0] * 102, [1.0] * 102)
        return [Rollout(f"episode-{num_cut}", "env", f"group-{num_cut}", 1.0, 0.5, [sample])]

    run.next_batch = next_batch  # type: ignore[method-assign]
    await asyncio.wait_for(BatchLoop(config, run, trainer, InitialVersion()).run(), 10)
    assert run.state == RunState.FAILED and "trainer.seq_len" in run.error and "prompts of 100-100 tokens" in run.error
    assert num_cut == 20 and trainer.pushes == []
    # Logged once meanwhile (at most every 30 s), not once per batch.
    assert sum("no loss token left" in r.getMessage() for r in caplog.records if r.levelname == "ERROR") == 1
