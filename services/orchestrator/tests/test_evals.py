"""Evaluations: the pass@k estimator against counting every draw, eval episodes giving way to
training groups (a real Dispatcher), and a whole evaluation played through a gRPC router whose
answers are right for a known number of samples per task."""

from __future__ import annotations

import asyncio
import functools
import itertools
import math

import grpc
import pytest
from transformers import AutoTokenizer

from primerl.common.v1 import generation_pb2
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.testing import bare_server
from primerl_launcher.tiny_model import save_tokenizer
from primerl_orchestrator.config import OrchestratorConfig
from primerl_orchestrator.environments import Task
from primerl_orchestrator.environments.sort_letters import SortLetters
from primerl_orchestrator.episodes import EpisodeBook
from primerl_orchestrator.evals import EVAL_SEED_OFFSET, Evaluator, Immediately, TrainingFirst, pass_at_k
from primerl_orchestrator.generation import RouterGeneration
from primerl_orchestrator.rendering import PromptRenderer
from primerl_orchestrator.scheduler import Dispatcher


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
        ({"name": "e", "kind": "verifiers", "options": {"module": "x"}}, "played by a process of their own"),
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
