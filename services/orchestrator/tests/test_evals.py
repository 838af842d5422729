"""Evaluations: the pass@k estimator against counting every draw, eval episodes giving way to
training groups (a real Dispatcher), and a whole evaluation played through a gRPC router whose
answers are right for a known number of samples per task."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import math

import grpc
import pytest
from transformers import AutoTokenizer

from primerl.common.v1 import generation_pb2
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.errors import FailedPrecondition, ServiceError
from primerl_common.testing import bare_server
from primerl_launcher.tiny_model import save_tokenizer
from primerl_orchestrator.config import EnvironmentConfig, OrchestratorConfig
from primerl_orchestrator.environments import Task
from primerl_orchestrator.environments.sort_letters import SortLetters
from primerl_orchestrator.episodes import Episode, EpisodeBook
from primerl_orchestrator.eval_episodes import MAX_ATTEMPTS, EvalEpisode
from primerl_orchestrator.evals import EVAL_SEED_OFFSET, Evaluator, Immediately, TrainingFirst, pass_at_k
from primerl_orchestrator.generation import RouterGeneration
from primerl_orchestrator.rendering import Message, PromptRenderer
from primerl_orchestrator.run import Run
from primerl_orchestrator.scheduler import Dispatcher
from primerl_orchestrator.tool_calls import ToolSpec
from primerl_orchestrator.trainer_client import BatchSpec


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_is_the_share_of_k_draws_with_a_pass(n):
    for c in range(n + 1):
        outcomes = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            draws = list(itertools.combinations(outcomes, k))
            expected = sum(any(draw) for draw in draws) / len(draws)
            assert math.isclose(pass_at_k(n, c, k), expected, abs_tol=1e-12), (n, c, k)


def test_pass_at_k_refuses_impossible_counts():
    for args in [(4, 5, 1), (4, 1, 5), (4, 1, 0), (4, -1, 1)]:
        with pytest.raises(ValueError):
            pass_at_k(*args)
    assert pass_at_k(200, 1, 1) == pytest.approx(1 / 200)
    assert 0 < pass_at_k(1000, 1, 100) < 1  # no overflow from huge binomials


def _dispatcher() -> Dispatcher:
    dispatcher = Dispatcher(
        weights={"train": 1.0}, batch_size=4, max_async_level=1, max_concurrent_episodes=8, max_steps=10
    )
    dispatcher.update(policy_version=0, next_step=1, open=True)
    return dispatcher


async def test_eval_episodes_wait_while_training_can_start_a_group():
    dispatcher, book = _dispatcher(), EpisodeBook()
    admission = TrainingFirst(dispatcher, group_size=4)
    # Open, version 0, nothing in flight: a training group for step 1 may start.
    assert dispatcher.blocked_reason(4) is None and not admission.may_start()
    waiting = asyncio.ensure_future(admission.wait())
    await asyncio.sleep(0.05)
    assert not waiting.done()

    def make_group(step: int):
        return book.new_group("train", Task("t"), size=4, policy_version=0, target_step=step, now=0.0)

    # The step-1 batch is in flight: step 2 needs version 1, so training waits and evals may go.
    await dispatcher.start_group("train", 4, make_group)
    await asyncio.wait_for(waiting, timeout=1)
    assert admission.may_start()

    # A new version lets training start again: evals hold back.
    dispatcher.update(policy_version=1)
    assert not admission.may_start()
    # Paused or finished: no eval either.
    dispatcher.update(policy_version=0)
    assert admission.may_start()
    dispatcher.update(open=False)
    assert not admission.may_start()


class AnsweringRouter(router_pb2_grpc.RouterServiceServicer):
    """Answers sort_letters' eval tasks: right for the first `num_right[task]` samples of each
    task, wrong for the others (request ids say the task and the sample)."""

    def __init__(self, tokenizer, answers: dict[str, str], num_right: dict[str, int]) -> None:
        self.tokenizer, self.answers, self.num_right = tokenizer, answers, num_right
        self.min_versions: list[int] = []

    async def Generate(self, request, context):
        # eval-<name>-v<version>-<task_id>-<sample>-<turn>
        task_id, sample, _ = request.input.request_id.split("-v0-")[1].rsplit("-", 2)
        right = int(sample) < self.num_right[task_id]
        text = self.answers[task_id] if right else "zz"
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        self.min_versions.append(request.input.min_policy_version)
        yield router_pb2.GenerateResponse(
            output=generation_pb2.GenerationOutput(
                token_ids=tokens,
                logprobs=[-0.5] * len(tokens),
                policy_versions=[0] * len(tokens),
                finished=True,
                finish_reason=generation_pb2.FINISH_REASON_STOP,
            )
        )


async def test_an_evaluation_scores_each_sample_and_reports_pass_at_k(tmp_path):
    save_tokenizer(tmp_path)
    config = OrchestratorConfig(
        model={"path": tmp_path, "max_model_len": 128},
        environments=[{"name": "train", "kind": "reverse_text", "group_size": 2}],
        evals=[{"name": "sorting", "kind": "sort_letters", "num_tasks": 3, "num_samples": 4, "pass_at_k": [1, 2, 4]}],
    )
    environment = SortLetters(SortLetters.Options(), seed=config.run.seed + EVAL_SEED_OFFSET)
    tasks = [environment.task(index) for index in range(3)]
    num_right = {tasks[0].task_id: 0, tasks[1].task_id: 1, tasks[2].task_id: 4}
    router = AnsweringRouter(
        AutoTokenizer.from_pretrained(str(tmp_path)), {t.task_id: t.data["answer"] for t in tasks}, num_right
    )
    async with bare_server(functools.partial(router_pb2_grpc.add_RouterServiceServicer_to_server, router)) as address:
        generation = RouterGeneration(address, timeout_s=10)
        try:
            evaluator = Evaluator(config, PromptRenderer(tmp_path, max_model_len=128), generation, versions_served=True)
            result = await evaluator.evaluate(config.evals[0], policy_version=0, admission=Immediately())
        finally:
            await generation.close()

    assert (result.num_tasks, result.num_samples, result.num_errors) == (3, 4, 0)
    assert result.reward_mean == pytest.approx(5 / 12)  # 0 + 1 + 4 right answers of 12
    expected = {k: sum(pass_at_k(4, c, k) for c in num_right.values()) / 3 for k in (1, 2, 4)}
    assert result.pass_at == pytest.approx(expected)
    assert result.pass_at[4] == pytest.approx(2 / 3) and result.pass_at[1] == pytest.approx(5 / 12)
    assert (result.min_token_version, result.max_token_version) == (0, 0)
    assert router.min_versions == [0] * 12
    # The samples table: one sample per task, its text as decoded.
    assert [s.task_id for s in result.samples] == [t.task_id for t in tasks]
    assert result.samples[2].completion == tasks[2].data["answer"] and result.samples[2].reward == 1.0
    assert tasks[0].data["letters"] in result.samples[0].prompt
    metrics = result.metrics()
    assert metrics["pass@4"] == result.pass_at[4] and metrics["reward_mean"] == result.reward_mean


def test_eval_configs_name_their_problem(tmp_path):
    save_tokenizer(tmp_path)
    base = {"model": {"path": tmp_path}, "environments": [{"name": "train", "kind": "reverse_text"}]}
    bad = [
        ({"name": "e"}, "set one of environment"),
        ({"name": "e", "environment": "nope"}, "no environment 'nope'"),
        ({"name": "e", "kind": "external"}, "nobody to play"),
        (
            {"name": "e", "kind": "verifiers", "options": {"module": "x"}},
            "played by their process: name a configured one",
        ),
        ({"name": "e", "kind": "sort_letters", "num_samples": 2, "pass_at_k": [4]}, r"pass_at_k \[4\]"),
        ({"name": "e", "environment": "train", "options": {"min_length": 0}}, "eval 'e'"),
    ]
    for evaluation, message in bad:
        with pytest.raises(ValueError, match=message):
            OrchestratorConfig(**base, evals=[evaluation])
    config = OrchestratorConfig(
        **base, evals=[{"name": "e", "environment": "train", "options": {"max_length": 5}, "sampling": {"top_p": 0.5}}]
    )
    environment = config.eval_environment(config.evals[0])
    assert environment.options == {"max_length": 5} and environment.sampling.top_p == 0.5
    assert config.evals[0].ks == [1]


class FlakyRouter(router_pb2_grpc.RouterServiceServicer):
    """UNAVAILABLE for the first `num_failures` turns, then answers 'abc'."""

    def __init__(self, num_failures: int) -> None:
        self.num_failures = num_failures
        self.calls = 0

    async def Generate(self, request, context):
        self.calls += 1
        if self.calls <= self.num_failures:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica can take the request")
        yield router_pb2.GenerateResponse(
            output=generation_pb2.GenerationOutput(
                token_ids=list(b"abc"),
                logprobs=[-0.5] * 3,
                policy_versions=[3] * 3,
                finished=True,
                finish_reason=generation_pb2.FINISH_REASON_STOP,
            )
        )


# The channel tries a call 5 times on UNAVAILABLE (primerl_common.client); a sample is played 3 times.
@pytest.mark.parametrize(("num_failures", "num_errors", "calls"), [(7, 0, 8), (100, 1, 15)])
async def test_a_sample_inference_could_not_serve_is_played_again_then_counted_failed(
    tmp_path, num_failures, num_errors, calls
):
    save_tokenizer(tmp_path)
    config = OrchestratorConfig(
        model={"path": tmp_path, "max_model_len": 128},
        environments=[{"name": "train", "kind": "reverse_text"}],
        evals=[{"name": "e", "kind": "sort_letters", "num_tasks": 1}],
    )
    router = FlakyRouter(num_failures)
    async with bare_server(functools.partial(router_pb2_grpc.add_RouterServiceServicer_to_server, router)) as address:
        generation = RouterGeneration(address, timeout_s=10, retry_s=0)
        try:
            evaluator = Evaluator(
                config, PromptRenderer(tmp_path, max_model_len=128), generation, versions_served=False
            )
            result = await evaluator.evaluate(config.evals[0], policy_version=3, admission=Immediately())
        finally:
            await generation.close()
    assert (result.num_errors, router.calls) == (num_errors, calls)
    assert result.max_token_version == (None if num_errors else 3)
    if num_errors:
        assert "UNAVAILABLE" in result.samples[0].error and result.pass_at[1] == 0.0


# ---------------------------------------------------------------- evals a process plays (through the API)


class ToolRouter(router_pb2_grpc.RouterServiceServicer):
    """Calls the lookup tool when the prompt offers it and has no result yet, else answers 410;
    UNAVAILABLE while `failing`."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.prompts: list[str] = []
        self.failing = False

    async def Generate(self, request, context):
        if self.failing:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no replica")
        prompt = self.tokenizer.decode(list(request.input.prompt_token_ids))
        self.prompts.append(prompt)
        offered, answered = "lookup" in prompt, "<|im_start|>tool" in prompt
        text = (
            '<tool_call>{"name": "lookup", "arguments": {"key": "amber"}}</tool_call>'
            if offered and not answered
            else "410"
        )
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        yield router_pb2.GenerateResponse(
            output=generation_pb2.GenerationOutput(
                token_ids=tokens,
                logprobs=[-0.5] * len(tokens),
                policy_versions=[3] * len(tokens),
                finished=True,
                finish_reason=generation_pb2.FINISH_REASON_STOP,
            )
        )


def _process_eval_config(tmp_path) -> OrchestratorConfig:
    return OrchestratorConfig(
        model={"path": tmp_path, "max_model_len": 1024},
        environments=[
            {
                "name": "kv",
                "kind": "verifiers",
                "group_size": 2,
                "options": {"module": "primerl_orchestrator.environments.verifiers_examples.key_value_store"},
            }
        ],
        evals=[
            {
                "name": "kv_eval",
                "environment": "kv",
                "num_tasks": 2,
                "num_samples": 2,
                "options": {"split": "eval"},
                "sampling": {"temperature": 0.5},
            }
        ],
        run={"max_concurrent_episodes": 4},
    )


@contextlib.asynccontextmanager
async def _run(tmp_path, router):
    """A run of the process-played `kv` environment (dispatch stays closed unless a test begins
    it, as `primerl eval` has it), its evaluator, and a stand-in router."""
    config = _process_eval_config(tmp_path)
    async with bare_server(functools.partial(router_pb2_grpc.add_RouterServiceServicer_to_server, router)) as address:
        generation = RouterGeneration(address, timeout_s=10, retry_s=0)
        try:
            renderer = PromptRenderer(tmp_path, max_model_len=1024)
            run = Run(config, renderer, generation)
            yield config, run, Evaluator(config, renderer, generation, versions_served=False, episodes=run.evals)
        finally:
            await generation.close()


LOOKUP = ToolSpec("lookup", "a value", {"type": "object", "properties": {"key": {"type": "string"}}})


async def _play(run: Run, episode_id: str, reward: float) -> None:
    """An environment's moves: a turn offering the tool, the tool's answer, a final turn."""
    messages = [Message("user", "What is stored under amber?")]
    first = await run.generate(episode_id, messages=messages, tools=[LOOKUP])
    assert [(c.name, json.loads(c.arguments)) for c in first.tool_calls] == [("lookup", {"key": "amber"})]
    messages += [
        Message("assistant", first.text, tool_calls=tuple(first.tool_calls)),
        Message("tool", "410", tool_call_id=first.tool_calls[0].id),
    ]
    second = await run.generate(episode_id, messages=messages, tools=[LOOKUP])
    assert second.text == "410" and second.tool_calls == []
    run.finish_episode(episode_id, reward=reward, metrics={}, discard=False)


async def test_an_evaluation_of_a_process_environment_is_played_through_the_api_and_never_trained_on(tmp_path):
    save_tokenizer(tmp_path)
    router = ToolRouter(AutoTokenizer.from_pretrained(str(tmp_path)))
    async with _run(tmp_path, router) as (config, run, evaluator):
        evaluating = asyncio.ensure_future(
            evaluator.evaluate(config.evals[0], policy_version=3, admission=Immediately())
        )
        # Task by task, a group of num_samples episodes each, marked with the evaluation.
        episodes = [await asyncio.wait_for(run.next_episode("kv"), timeout=5) for _ in range(4)]
        assert [(e.play.evaluation, e.index_in_group, e.group_size) for e in episodes] == [
            ("kv_eval", i % 2, 2) for i in range(4)
        ]
        assert episodes[0].group_id == episodes[1].group_id != episodes[2].group_id
        data = episodes[0].task.data
        assert (data["split"], data["seed"]) == ("eval", config.run.seed + EVAL_SEED_OFFSET)
        # The process died while playing them: each is played again under a new id.
        assert run.abandon_episodes("kv", "its environment process was killed by SIGKILL") == 4
        again = [await asyncio.wait_for(run.next_episode("kv"), timeout=5) for _ in range(4)]
        assert {e.episode_id for e in again}.isdisjoint(e.episode_id for e in episodes)
        assert [e.attempt for e in again] == [2] * 4
        # A late call on a dropped one is told so (the process's player takes that as the end).
        with pytest.raises(FailedPrecondition, match="is over"):
            run.finish_episode(episodes[0].episode_id, reward=1.0, metrics={}, discard=False)
        for episode, reward in zip(again, [1.0, 0.0, 0.0, 0.0], strict=True):
            await _play(run, episode.episode_id, reward)
        result = await asyncio.wait_for(evaluating, timeout=5)
        # Training saw none of it.
        assert run.counters.totals["kv"].episodes_started == 0 and run.counters.totals["kv"].turns == 0
    assert (result.num_tasks, result.num_samples, result.num_errors) == (2, 2, 0)
    assert result.reward_mean == pytest.approx(0.25)
    assert (result.min_token_version, result.max_token_version) == (3, 3)
    # Played again in task order: the first task got the one right answer.
    assert result.pass_at == pytest.approx({1: 0.25, 2: 0.5})
    # The tiny template takes no tools: they were described in the system message (the text
    # fallback), the model's call went back as it wrote it, the tool's answer as a tool message.
    assert router.prompts[0].startswith("<|im_start|>system\nTools you can call")
    assert '"name": "lookup"' in router.prompts[0]
    call = '<tool_call>{"name": "lookup", "arguments": {"key": "amber"}}</tool_call>'
    assert f"<|im_start|>assistant\n{call}<|im_end|>\n<|im_start|>tool\n410<|im_end|>" in router.prompts[1]


async def test_eval_samples_failed_in_inference_are_played_again_then_counted_as_errors(tmp_path):
    save_tokenizer(tmp_path)
    router = ToolRouter(AutoTokenizer.from_pretrained(str(tmp_path)))
    async with _run(tmp_path, router) as (config, run, evaluator):
        evaluation = config.evals[0].model_copy(update={"num_tasks": 1, "num_samples": 1})
        evaluating = asyncio.ensure_future(evaluator.evaluate(evaluation, policy_version=0, admission=Immediately()))
        router.failing = True
        for attempt in range(1, MAX_ATTEMPTS + 1):
            episode = await asyncio.wait_for(run.next_episode("kv"), timeout=5)
            assert episode.attempt == attempt
            with pytest.raises(ServiceError):
                await run.generate(episode.episode_id, messages=[("user", "hi")])
            run.finish_episode(episode.episode_id, reward=0.0, metrics={}, discard=True)
        result = await asyncio.wait_for(evaluating, timeout=5)
        # A discard for the environment's own reasons is a failed sample at once.
        evaluating = asyncio.ensure_future(evaluator.evaluate(evaluation, policy_version=0, admission=Immediately()))
        episode = await asyncio.wait_for(run.next_episode("kv"), timeout=5)
        run.finish_episode(episode.episode_id, reward=0.0, metrics={}, discard=True)
        discarded = await asyncio.wait_for(evaluating, timeout=5)
    assert result.num_errors == 1 and "3 times" in result.samples[0].error
    assert discarded.num_errors == 1 and discarded.samples[0].error == "discarded by its environment"


async def test_a_process_environment_gets_training_episodes_first_and_eval_ones_while_training_waits(tmp_path):
    save_tokenizer(tmp_path)
    router = ToolRouter(AutoTokenizer.from_pretrained(str(tmp_path)))
    async with _run(tmp_path, router) as (config, run, evaluator):
        spec = BatchSpec(
            seq_len=1024, router_replay=False, num_hidden_layers=1, num_experts_per_token=0, vocab_size=320, next_step=1
        )
        run.begin(spec, next_step=1, versions_served=False)
        run.set_policy_version(0)
        admission = TrainingFirst(run.dispatcher, group_size=2)
        evaluating = asyncio.ensure_future(evaluator.evaluate(config.evals[0], policy_version=0, admission=admission))
        await asyncio.sleep(0.05)
        # Training may start groups (max_concurrent_episodes 4): training first.
        taken = [await asyncio.wait_for(run.next_episode("kv"), timeout=5) for _ in range(4)]
        assert all(isinstance(e, Episode) for e in taken)
        # Four training episodes in flight: training waits, the eval's episodes go.
        episode = await asyncio.wait_for(run.next_episode("kv"), timeout=5)
        assert isinstance(episode, EvalEpisode) and episode.play.evaluation == "kv_eval"
        # Paused: neither starts.
        run.pause()
        waiting = asyncio.ensure_future(run.next_episode("kv"))
        await asyncio.sleep(0.1)
        assert waiting.done() and isinstance(waiting.result(), EvalEpisode)  # the rest of a started group
        waiting = asyncio.ensure_future(run.next_episode("kv"))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        waiting.cancel()
        evaluating.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await evaluating


def test_an_eval_of_a_process_environment_may_override_only_its_task_options(tmp_path):
    save_tokenizer(tmp_path)
    config = _process_eval_config(tmp_path).model_dump()
    config["evals"][0]["options"] = {"split": "eval", "args": {"num_keys": 2}}
    with pytest.raises(ValueError, match="options args of environment 'kv' are its process's"):
        OrchestratorConfig.model_validate(config)
    kind = EnvironmentConfig.model_fields["kind"].description
    assert "verifiers" in kind and "reverse_text" in kind and "sort_letters" in kind
