"""The orchestrator with the real services it drives (stack.py, the replica on the KV pool): an
external environment's episodes reach the trainer as aligned samples, a killed orchestrator resumes from its
checkpoint, rollouts too far off-policy are dropped, bad inputs are refused. Every test reads
the trainer's next expected step first, so the tests share one stack in any order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import pathlib
import signal
import sys
from collections.abc import Iterator

import grpc
import pytest
import torch
from google.rpc import error_details_pb2
from safetensors.torch import load_file

from primerl.common.v1 import generation_pb2
from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.errors import error_details
from primerl_common.processes import ServiceProcess
from primerl_common.tensors import tensor_from_proto

from .stack import (
    EXAMPLE,
    MAX_MODEL_LEN,
    kvstore_blocks,
    orchestrator,
    orchestrator_config,
    trained_steps,
    trainer_next_step,
    wait_for_status,
)

pytestmark = pytest.mark.slow


async def appears(path: pathlib.Path, *, timeout_s: float) -> None:
    for _ in range(int(timeout_s * 10)):
        if await asyncio.to_thread(path.exists):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{path} did not appear within {timeout_s}s")


@contextlib.contextmanager
def held_back(process: ServiceProcess) -> Iterator[None]:
    """The process stopped (SIGSTOP) for the duration, then continued."""
    process.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        process.signal(signal.SIGCONT)


async def failure(call) -> tuple[grpc.StatusCode, str]:
    """The status code and ErrorInfo reason a call fails with."""
    try:
        await call
    except grpc.aio.AioRpcError as error:
        reasons = [d.reason for d in error_details(error) if isinstance(d, error_details_pb2.ErrorInfo)]
        return error.code(), reasons[0] if reasons else ""
    raise AssertionError("the call succeeded")


async def status_code(call) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as error:
        return error.code()
    raise AssertionError("the call succeeded")


def samples_of(path: pathlib.Path) -> list[dict[str, torch.Tensor]]:
    """The samples of a dumped batch (the tensors pushed to the trainer), split at position 0."""
    tensors = load_file(path)
    samples = []
    index = 0
    while f"micro_batch_{index}.input_ids" in tensors:
        micro_batch = {
            name.split(".", 1)[1]: t for name, t in tensors.items() if name.startswith(f"micro_batch_{index}.")
        }
        starts = [*(micro_batch["position_ids"] == 0).nonzero().flatten().tolist(), len(micro_batch["position_ids"])]
        for start, end in itertools.pairwise(starts):
            samples.append({name: t[start:end] for name, t in micro_batch.items()})
        index += 1
    return samples


# ---------------------------------------------------------------------------- tests


async def test_example_environment_episode_reaches_the_trainer_as_one_aligned_sample(stack, tmp_path):
    step = await trainer_next_step(stack)
    environments = '[[environments]]\nname = "guess"\ngroup_size = 4\n[environments.sampling]\nmax_tokens = 8\n'
    config = orchestrator_config(
        stack,
        tmp_path / "orchestrator.toml",
        environments=environments,
        run={"batch_size": 4, "max_steps": step},
        batches_dir=tmp_path / "batches",
        metrics_jsonl=tmp_path / "metrics.jsonl",
    )
    batch_path = tmp_path / "batches" / f"step_{step:06d}.safetensors"
    transcript_path = tmp_path / "transcript.jsonl"
    async with orchestrator(config) as (process, stub):
        await refuse_bad_inputs(stub)
        # The trainer is held back while the episodes play, so that the replica still serves
        # the version that sampled them when the test scores them again; the batch is
        # written (batches_dir) before it is pushed.
        with held_back(stack.trainer_process):
            example = await asyncio.create_subprocess_exec(
                sys.executable,
                str(EXAMPLE),
                f"--orchestrator={process.address}",
                "--environment=guess",
                "--tasks=1",
                "--max-turns=3",
                f"--transcript={transcript_path}",
            )
            assert await asyncio.wait_for(example.wait(), 120) == 0
            await appears(batch_path, timeout_s=60)
            pooled_blocks = await kvstore_blocks(stack)  # the version that sampled them still served
            transcript = [json.loads(line) for line in transcript_path.read_text().splitlines()]
            samples = samples_of(batch_path)
            multi_turn = [entry for entry in transcript if len(entry["turns"]) >= 2]
            assert multi_turn, "no episode took more than one turn"
            async with make_channel(stack.router) as channel:
                router = router_pb2_grpc.RouterServiceStub(channel)
                for entry in multi_turn:
                    assert entry["num_samples"] == 1
                    model_tokens = [token for turn in entry["turns"] for token in turn["token_ids"]]
                    [sample] = [s for s in samples if s["input_ids"][s["loss_mask"]].tolist() == model_tokens]
                    await check_sample(router, sample, entry["turns"], version=step - 1)
        [trained] = await trained_steps(stack, after_step=step - 1, until_step=step, timeout_s=120)
        status = await wait_for_status(stub, lambda s: s.state == orchestrator_pb2.RUN_STATE_FINISHED, timeout_s=30)
        assert status.step == step

    assert len(samples) == sum(entry["num_samples"] for entry in transcript) == trained.metrics["num_samples"]
    assert sum(int(s["loss_mask"].sum()) for s in samples) == trained.metrics["num_loss_tokens"]
    # The trainer's own logprobs of the tokens match inference's (same weights, float32,
    # the experts inference chose replayed): the batch is aligned token by token, the replica
    # on the KV pool.
    assert trained.metrics["mismatch_kl"] < 1e-4
    assert pooled_blocks > 0, "the replica saved no KV block to the pool"

    [line] = (tmp_path / "metrics.jsonl").read_text().splitlines()
    record = json.loads(line)
    assert record["step"] == step and record["num_rollouts"] == 4
    assert record["environments"]["guess"]["new_samples_after_first"] == 0


async def refuse_bad_inputs(stub: orchestrator_pb2_grpc.OrchestratorServiceStub) -> None:
    """Each bad call is refused with its own status; the run goes on (the example runs after)."""
    unknown = orchestrator_pb2.GenerateRequest(
        episode_id="no-such-episode",
        messages=orchestrator_pb2.ChatMessages(messages=[{"role": "user", "content": "hi"}]),
    )
    assert await status_code(stub.Generate(unknown)) == grpc.StatusCode.NOT_FOUND
    assert await status_code(stub.NextEpisode(orchestrator_pb2.NextEpisodeRequest(environment="nope"))) == (
        grpc.StatusCode.NOT_FOUND
    )
    task = orchestrator_pb2.Task(task_id="bad-inputs")
    [episode] = (
        await stub.StartEpisode(orchestrator_pb2.StartEpisodeRequest(environment="guess", task=task, num_episodes=1))
    ).episodes
    too_long = orchestrator_pb2.GenerateRequest(
        episode_id=episode.episode_id,
        messages=orchestrator_pb2.ChatMessages(messages=[{"role": "user", "content": "x" * MAX_MODEL_LEN}]),
    )
    assert await status_code(stub.Generate(too_long)) == grpc.StatusCode.INVALID_ARGUMENT
    turn = orchestrator_pb2.GenerateRequest(
        episode_id=episode.episode_id,
        messages=orchestrator_pb2.ChatMessages(messages=[{"role": "user", "content": "Your first guess?"}]),
    )
    assert (await stub.Generate(turn)).token_ids
    finish = orchestrator_pb2.FinishEpisodeRequest(episode_id=episode.episode_id, reward=math.nan)
    assert await status_code(stub.FinishEpisode(finish)) == grpc.StatusCode.INVALID_ARGUMENT
    finish.reward = 1.0
    assert (await stub.FinishEpisode(finish)).group_complete
    assert await status_code(stub.FinishEpisode(finish)) == grpc.StatusCode.FAILED_PRECONDITION
    assert await status_code(stub.Generate(turn)) == grpc.StatusCode.FAILED_PRECONDITION
    status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
    assert status.state == orchestrator_pb2.RUN_STATE_RUNNING and not status.error

    # Control: a paused run starts no episode (the call waits until its deadline), then resumes.
    listed = await stub.ListEnvironments(orchestrator_pb2.ListEnvironmentsRequest())
    assert [(env.name, env.builtin, env.group_size) for env in listed.environments] == [("guess", False, 4)]
    assert (await stub.PauseRun(orchestrator_pb2.PauseRunRequest())).state == orchestrator_pb2.RUN_STATE_PAUSED
    start = orchestrator_pb2.StartEpisodeRequest(environment="guess", task=task)
    assert await status_code(stub.StartEpisode(start, timeout=0.5)) == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (await stub.ResumeRun(orchestrator_pb2.ResumeRunRequest())).state == orchestrator_pb2.RUN_STATE_RUNNING


async def check_sample(
    router: router_pb2_grpc.RouterServiceStub, sample: dict[str, torch.Tensor], turns: list[dict], *, version: int
) -> None:
    """The sample is the last turn's prompt plus its completion; its loss mask covers exactly
    the model's tokens; every token is from `version` (the batch of step n is sampled by
    version n - 1 at max_async_level 1, and version n cannot exist before it is trained);
    logprobs and routed experts are those inference computes for these tokens, scored again
    through the router."""
    tokens = sample["input_ids"].tolist()
    mask = sample["loss_mask"]
    assert len(tokens) == turns[-1]["num_prompt_tokens"] + len(turns[-1]["token_ids"])
    expected_mask = torch.zeros(len(tokens), dtype=torch.bool)
    for turn in turns:
        end = turn["num_prompt_tokens"] + len(turn["token_ids"])
        expected_mask[turn["num_prompt_tokens"] : end] = True
    assert torch.equal(mask, expected_mask)
    assert torch.all(sample["policy_versions"] == version)
    assert torch.all(sample["inference_logprobs"][~mask] == 0)

    scored = None
    request = router_pb2.GenerateRequest(
        input=generation_pb2.GenerationInput(
            prompt_token_ids=tokens,
            sampling=generation_pb2.SamplingParams(temperature=1.0, max_tokens=1),
            stream=generation_pb2.StreamOptions(final_only=True),
            return_prompt_logprobs=True,
            return_routed_experts=True,
        )
    )
    async for response in router.Generate(request):
        scored = response.output
    prompt_logprobs = torch.tensor(list(scored.prompt_logprobs))
    assert torch.allclose(sample["inference_logprobs"][mask], prompt_logprobs[mask], atol=2e-3)
    rows = tensor_from_proto(scored.routed_experts)[: len(tokens)]
    recorded = sample["routed_experts"]
    assert recorded.shape == rows.shape
    # Every row but the last, whose token was never forwarded (a copy of the row before).
    same = (recorded[:-1].sort(dim=-1).values == rows[:-1].sort(dim=-1).values).all(dim=-1)
    assert same.float().mean() >= 0.98, same


async def test_restart_resumes_from_the_checkpoint_without_duplicated_or_lost_steps(stack, tmp_path):
    """The orchestrator is killed after two steps and started again on the same config: the
    trainer gets every step once, the metrics file has no step twice."""
    first = await trainer_next_step(stack)
    # Room after the crash: on a quiet machine a step of this run takes about a second.
    last = first + 6
    environments = "\n".join(
        f'[[environments]]\nname = "{kind}"\nkind = "{kind}"\ngroup_size = 2\n[environments.sampling]\nmax_tokens = 8'
        for kind in ("reverse_text", "sort_letters")
    )
    config = orchestrator_config(
        stack,
        tmp_path / "orchestrator.toml",
        environments=environments,
        run={"batch_size": 4, "max_steps": last, "max_concurrent_episodes": 8},
        # The other path to the latest version: the trainer's completed steps.
        versions_from_broadcaster=False,
        checkpoint_dir=tmp_path / "checkpoint",
        metrics_jsonl=tmp_path / "metrics.jsonl",
    )
    # Rewards of a barely trained model are mostly equal within a group: keep those groups.
    config.write_text(config.read_text() + "[advantage]\nfilter_zero_advantage = false\n")
    async with orchestrator(config) as (process, stub):
        await wait_for_status(stub, lambda s: s.step >= first + 1, timeout_s=180)
        # A crash: no drain, no goodbye.
        process.kill()
        await process.wait()
    before = json.loads((tmp_path / "checkpoint" / "orchestrator_state.json").read_text())

    async with orchestrator(config) as (process, stub):
        status = await wait_for_status(stub, lambda s: s.state == orchestrator_pb2.RUN_STATE_FINISHED, timeout_s=180)
        assert status.step == last and not status.error

    steps = await trained_steps(stack, after_step=first - 1, until_step=last, timeout_s=60)
    assert [s.step for s in steps] == list(range(first, last + 1))
    assert all(s.metrics["num_samples"] >= 4 for s in steps)
    after = json.loads((tmp_path / "checkpoint" / "orchestrator_state.json").read_text())
    assert after["step"] == last
    # The task streams went on from where the checkpoint left them (an environment may have
    # started nothing after the restart: the other one can fill the last batches alone).
    positions = before["task_positions"]
    assert all(after["task_positions"][name] >= position for name, position in positions.items())
    if before["step"] < last:
        assert sum(after["task_positions"].values()) > sum(positions.values())
    lines = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines == sorted(set(lines)) and lines[-1] == last


async def test_rollouts_past_max_off_policy_steps_never_reach_the_trainer(stack, tmp_path):
    """External episodes take a turn and are then held open, while the test plays the groups
    that make the steps (no built-in environment: the test decides when each step can come).
    With the trainer held back (stopped), one group can start (max_async_level), no second;
    released, steps move on past the held episodes' policy version + max_off_policy_steps: the
    orchestrator drops exactly those episodes (counted, and said so to the environment) at the
    cut of the step after, drops nothing the playing groups sampled (the group sampled during
    the hold, the oldest any batch takes, still fits), and no batch the trainer trains holds a
    token too old.

    max_off_policy_steps must be at least max_async_level (the config refuses less: groups
    started at the allowed lag would all be dropped), so sampling ahead of a held-back trainer
    alone never makes a rollout too old; an episode that spans steps does."""
    first = await trainer_next_step(stack)
    max_async_level, max_off_policy_steps, num_held = 2, 2, 3
    # The held episodes sample version first - 1 (the trainer's latest); the cut of step
    # first + 1 drops them (first + 2 - (first - 1) > max_off_policy_steps); one step more after.
    last = first + 3
    environments = (
        '[[environments]]\nname = "fill"\ngroup_size = 2\n[environments.sampling]\nmax_tokens = 8\n'
        '[[environments]]\nname = "guess"\ngroup_size = 1\n'
    )
    config = orchestrator_config(
        stack,
        tmp_path / "orchestrator.toml",
        environments=environments,
        run={
            "batch_size": 2,
            "max_steps": last,
            "max_async_level": max_async_level,
            "max_off_policy_steps": max_off_policy_steps,
            "max_concurrent_episodes": 2 + num_held,
        },
        metrics_jsonl=tmp_path / "metrics.jsonl",
        batches_dir=tmp_path / "batches",
    )

    def turn(episode_id: str) -> orchestrator_pb2.GenerateRequest:
        messages = orchestrator_pb2.ChatMessages(messages=[{"role": "user", "content": "Your first guess?"}])
        return orchestrator_pb2.GenerateRequest(episode_id=episode_id, messages=messages)

    def fill_group(index: int, *, timeout_s: float = 180) -> grpc.aio.UnaryUnaryCall:
        task = orchestrator_pb2.Task(task_id=f"fill-{index}")
        return stub.StartEpisode(orchestrator_pb2.StartEpisodeRequest(environment="fill", task=task), timeout=timeout_s)

    async def play(index: int) -> None:
        """A group of "fill" whose two rewards differ (never filtered): one step's batch."""
        for episode, reward in zip((await fill_group(index)).episodes, (1.0, 0.0), strict=True):
            assert (await stub.Generate(turn(episode.episode_id))).token_ids
            finish = orchestrator_pb2.FinishEpisodeRequest(episode_id=episode.episode_id, reward=reward)
            await stub.FinishEpisode(finish)

    async with orchestrator(config) as (_, stub):
        # The trainer's latest version before it is held back (its publish of it may still be under way).
        await wait_for_status(stub, lambda s: s.policy_version == first - 1, timeout_s=120)
        task = orchestrator_pb2.Task(task_id="held")
        start = orchestrator_pb2.StartEpisodeRequest(environment="guess", task=task, num_episodes=num_held)
        held = (await stub.StartEpisode(start)).episodes
        for episode in held:
            assert (await stub.Generate(turn(episode.episode_id))).token_ids
        with held_back(stack.trainer_process):
            await play(0)
            # Sampling runs ahead of the stopped trainer no further than max_async_level: the
            # next group waits for a version the trainer has not made (until the call's deadline).
            assert await status_code(fill_group(1, timeout_s=3)) == grpc.StatusCode.DEADLINE_EXCEEDED
            status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
            assert status.policy_version == first - 1 and status.step <= status.policy_version + max_async_level
        for index in range(1, last - first + 1):
            await play(index)

        def guess_dropped(status: orchestrator_pb2.GetRunStatusResponse) -> bool:
            return {env.name: env.num_dropped_off_policy for env in status.environments}["guess"] == num_held

        await wait_for_status(stub, guess_dropped, timeout_s=180)
        assert await failure(stub.Generate(turn(held[0].episode_id))) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "EPISODE_DROPPED",
        )
        finish = orchestrator_pb2.FinishEpisodeRequest(episode_id=held[1].episode_id, reward=1.0)
        assert await failure(stub.FinishEpisode(finish)) == (grpc.StatusCode.FAILED_PRECONDITION, "EPISODE_DROPPED")
        status = await wait_for_status(stub, lambda s: s.state == orchestrator_pb2.RUN_STATE_FINISHED, timeout_s=180)
        assert status.step == last and status.off_policy_steps_max <= max_off_policy_steps
        assert {env.name: env.num_dropped_off_policy for env in status.environments} == {"fill": 0, "guess": num_held}
        assert status.num_dropped_off_policy_total == num_held
        # One "fill" group per step, none filtered; the held group never completes a rollout.
        groups = status.groups
        assert (groups.finished, groups.batched, groups.filtered_equal_rewards, groups.incomplete) == (
            last - first + 1,
            last - first + 1,
            0,
            1,
        )

    # What the trainer trained: its own record of each batch, and every token of every sample.
    steps = await trained_steps(stack, after_step=first - 1, until_step=last, timeout_s=60)
    assert [s.step for s in steps] == list(range(first, last + 1))
    for step in steps:
        assert step.step - step.metrics["min_policy_version"] <= max_off_policy_steps
        assert step.metrics["max_policy_version"] <= step.step - 1
        samples = samples_of(tmp_path / "batches" / f"step_{step.step:06d}.safetensors")
        assert len(samples) == step.metrics["num_samples"]
        for sample in samples:
            versions = sample["policy_versions"][sample["loss_mask"]]
            assert step.step - int(versions.min()) <= max_off_policy_steps
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(first, last + 1))
    assert sum(r["num_dropped_off_policy"] for r in records) == num_held
