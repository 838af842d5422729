"""`kind = "verifiers"` environments: the tool-call text format, the chat client's translation of
OpenAI requests, the task rows, the options; then both shipped examples played by their own
processes through a real orchestrator served in this process (a stand-in trainer, and a
stand-in router that answers as a model that knows the answers: a spelled-backward word, a tool
call then the looked-up value), rewards from the rubrics, and an environment process killed
mid-run restarted while the run goes on."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import pathlib
import re
import signal
from collections.abc import AsyncIterator
from typing import Any

import psutil
import pytest
from transformers import AutoTokenizer

from primerl.common.v1 import generation_pb2
from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.processes import free_port
from primerl_common.testing import bare_server, eventually, in_process_service
from primerl_launcher.tiny_model import EOS_TOKEN_ID, save_tokenizer
from primerl_orchestrator.config import EnvironmentConfig, OrchestratorConfig
from primerl_orchestrator.environments import environment_class
from primerl_orchestrator.environments.runtime import EnvironmentRuntime
from primerl_orchestrator.environments.verifiers_env import VerifiersEnvironment
from primerl_orchestrator.environments.verifiers_process.client import to_chat_messages, to_sampling
from primerl_orchestrator.environments.verifiers_process.player import TaskRows
from primerl_orchestrator.environments.verifiers_process.tool_calls import (
    ToolCall,
    parse_tool_calls,
    render_tool_calls,
)
from primerl_orchestrator.server import build

from .stand_ins import StandInTrainer

EXAMPLES = "primerl_orchestrator.environments.verifiers_examples"
LOOKUP_TOOL = {
    "type": "function",
    "function": {"name": "lookup", "description": "a value", "parameters": {"type": "object", "properties": {}}},
}


# ---------------------------------------------------------------- the pieces


def test_tool_calls_are_read_from_text_and_an_answer_is_rendered_back_token_for_token():
    text = 'I look.<tool_call>{"name": "lookup", "arguments": {"key": "amber"}}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("lookup", '{"key": "amber"}')]
    assert parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == [
        ToolCall("f", '{"a": 1}')
    ]
    for broken in ["<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "plain answer"]:
        assert parse_tool_calls(broken) == []
    # The model's own text holds its calls: kept as it is, so the next prompt extends the sample.
    assert render_tool_calls(text, parse_tool_calls(text)) == text
    rendered = render_tool_calls("", [ToolCall("lookup", '{"key": "amber"}')])
    assert parse_tool_calls(rendered) == [ToolCall("lookup", '{"key": "amber"}')]


def test_openai_messages_become_generate_messages_with_the_tools_in_the_system_message():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is under "}, {"type": "text", "text": "amber?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "410"},
    ]
    pairs = to_chat_messages(messages, [LOOKUP_TOOL])
    assert [role for role, _ in pairs] == ["system", "user", "assistant", "tool"]
    assert pairs[0][1].startswith("Be brief.\n\n") and '"name": "lookup"' in pairs[0][1]
    assert pairs[1][1] == "What is under amber?"
    assert parse_tool_calls(pairs[2][1]) == [ToolCall("lookup", "{}")]
    assert to_chat_messages([{"role": "user", "content": "hi"}], [LOOKUP_TOOL])[0][0] == "system"
    assert to_chat_messages([{"role": "user", "content": "hi"}]) == [("user", "hi")]


def test_openai_sampling_arguments_become_the_turns_overrides():
    params = to_sampling({"n": 1, "max_completion_tokens": 32, "temperature": 0.7, "extra_body": {"top_k": 5}})
    assert (params.max_tokens, round(params.temperature, 3), params.top_k) == (32, 0.7, 5)
    assert not params.HasField("top_p")  # unset: the environment's default applies
    assert to_sampling({"max_tokens": 8, "stop": ["\n"]}).max_tokens == 8
    with pytest.raises(ValueError, match="n must be 1"):
        to_sampling({"n": 2})


def test_task_rows_visit_every_row_once_per_pass_in_a_seeded_order():
    rows = [{"i": i} for i in range(5)]
    first_pass = [TaskRows(rows, seed=3, shuffle=True).row(i)["i"] for i in range(5)]
    assert sorted(first_pass) == list(range(5)) and first_pass != list(range(5))
    again = TaskRows(rows, seed=3, shuffle=True)
    assert [again.row(i)["i"] for i in range(10)][:5] == first_pass
    assert [TaskRows(rows, seed=3, shuffle=False).row(i)["i"] for i in range(7)] == [0, 1, 2, 3, 4, 0, 1]


def test_the_verifiers_kind_validates_its_options_and_names_its_process(tmp_path):
    assert environment_class("verifiers") is VerifiersEnvironment
    with pytest.raises(ValueError, match="no module 'no_such_environment' is installed"):
        VerifiersEnvironment.Options(module="no_such_environment")
    config = {"name": "kv", "kind": "verifiers", "options": {"module": f"{EXAMPLES}.key_value_store"}}
    runtime = EnvironmentRuntime(EnvironmentConfig(**config), seed=7)
    assert runtime.builtin is None and runtime.process is not None
    assert runtime.next_task().data == {"index": 0} and runtime.next_task().data == {"index": 1}
    command = runtime.process.command(name="kv", orchestrator="127.0.0.1:1")
    assert command[1:3] == ["-m", "primerl_orchestrator.environments.verifiers_process"]
    assert "--seed=7" in command and "--environment=kv" in command


# ---------------------------------------------------------------- a run


class TrainingTrainer(StandInTrainer):
    """Completes each step it is pushed at once (so the policy version follows the steps); rows
    long enough for the tools' description (the tiny tokenizer spends a token per byte)."""

    async def GetBatchSpec(self, request, context):
        spec = await super().GetBatchSpec(request, context)
        spec.seq_len = 2048
        return spec

    async def GetStatus(self, request, context):
        step = len(self.pushed)
        return trainer_pb2.GetStatusResponse(
            mode=trainer_pb2.TRAINING_MODE_RL, step=step, published_policy_version=step
        )


class KnowingRouter(router_pb2_grpc.RouterServiceServicer):
    """Answers like a model that knows: the word spelled backward (after `spell_delay_s`, so that
    the spell environment has turns in flight), or a lookup call and then the value the tool
    returned. Records the system messages it saw."""

    spell_delay_s = 0.5

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.system_messages: list[str] = []
        self.num_spelled = 0

    def answer(self, messages: list[tuple[str, str]]) -> str:
        role, content = messages[-1]
        self.system_messages.append(messages[0][1])
        if role == "tool":
            return content
        if word := re.search(r"backward \(example: sun -> nus\): (\S+)", content):
            self.num_spelled += 1
            return word.group(1)[::-1]
        if key := re.search(r"stored under (\w+)\?", content):
            return f'<tool_call>{{"name": "lookup", "arguments": {{"key": "{key.group(1)}"}}}}</tool_call>'
        return "?"

    async def Generate(self, request, context):
        text = self.tokenizer.decode(list(request.input.prompt_token_ids))
        messages = re.findall(r"<\|im_start\|>(\w+)\n(.*?)<\|im_end\|>", text, flags=re.DOTALL)
        num_spelled = self.num_spelled
        answer = self.answer(messages)
        if self.num_spelled > num_spelled:
            await asyncio.sleep(self.spell_delay_s)
        token_ids = [*self.tokenizer(answer, add_special_tokens=False)["input_ids"], EOS_TOKEN_ID]
        yield router_pb2.GenerateResponse(
            output=generation_pb2.GenerationOutput(
                token_ids=token_ids,
                logprobs=[-0.5] * len(token_ids),
                policy_versions=[0] * len(token_ids),
                finished=True,
                finish_reason=generation_pb2.FINISH_REASON_STOP,
            )
        )


def environment_processes(name: str) -> list[psutil.Process]:
    """This test's environment processes playing `name`."""
    found = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if f"--environment={name}" in child.cmdline():
                found.append(child)
    return found


@contextlib.asynccontextmanager
async def orchestrator(
    model_dir: pathlib.Path, router: KnowingRouter, metrics: pathlib.Path, **run: Any
) -> AsyncIterator[orchestrator_pb2_grpc.OrchestratorServiceStub]:
    async with (
        bare_server(
            functools.partial(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, TrainingTrainer())
        ) as trainer_at,
        bare_server(functools.partial(router_pb2_grpc.add_RouterServiceServicer_to_server, router)) as router_at,
    ):
        config = OrchestratorConfig(
            server={"host": "127.0.0.1", "port": free_port(), "drain_delay_s": 0},
            peers={"router": router_at, "trainer": trainer_at, "poll_interval_s": 0.05},
            model={"path": model_dir, "max_model_len": 1024},
            environments=[
                {
                    "name": "spell",
                    "kind": "verifiers",
                    "group_size": 2,
                    "options": {
                        "module": f"{EXAMPLES}.reasoning_gym_task",
                        "args": {"num_examples": 50, "num_eval_examples": 0},
                        "restart_backoff_s": 0.2,
                        "log_file": str(model_dir / "spell.log"),
                    },
                },
                {
                    "name": "kv",
                    "kind": "verifiers",
                    "group_size": 2,
                    "options": {
                        "module": f"{EXAMPLES}.key_value_store",
                        "args": {"num_keys": 4},
                        "log_file": str(model_dir / "kv.log"),
                    },
                },
            ],
            run={"batch_size": 4, "max_concurrent_episodes": 8, **run},
            advantage={"filter_zero_advantage": False},
            output={"metrics_jsonl": metrics},
        )
        async with in_process_service(await build(config), config) as served:
            yield orchestrator_pb2_grpc.OrchestratorServiceStub(served.channel)


def processes_ready(log: pathlib.Path) -> int:
    """How many times an environment process logged that it loaded its environment."""
    return log.read_text().count("rows of its train dataset") if log.is_file() else 0


@pytest.mark.slow  # ~40 s: two processes import verifiers
async def test_both_examples_play_through_the_orchestrator_and_a_killed_process_is_restarted(tmp_path):
    save_tokenizer(tmp_path)
    router = KnowingRouter(AutoTokenizer.from_pretrained(str(tmp_path)))
    metrics = tmp_path / "metrics.jsonl"

    async def spell() -> orchestrator_pb2.EnvironmentStats:
        status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
        return {env.name: env for env in status.environments}["spell"]

    async def spell_running() -> bool:
        return (await spell()).num_episodes_running > 0

    async def spell_dropped() -> bool:
        return (await spell()).num_errors > 0

    async with orchestrator(tmp_path, router, metrics, max_steps=8) as stub:
        # Held until both processes have loaded their environments, so that both play from the start.
        await stub.PauseRun(orchestrator_pb2.PauseRunRequest())
        for log in (tmp_path / "spell.log", tmp_path / "kv.log"):
            await eventually(lambda log=log: processes_ready(log) == 1, timeout_s=120, what=f"{log.name}: loaded")
        await stub.ResumeRun(orchestrator_pb2.ResumeRunRequest())
        await eventually(lambda: metrics.is_file(), timeout_s=60, what="the first step's metrics")

        # Killed mid-turn: the episodes it was playing are dropped (their groups end, incomplete),
        # it comes back, and it plays again.
        [victim] = environment_processes("spell")
        await eventually(spell_running, timeout_s=60, what="spell episodes running")
        victim.send_signal(signal.SIGKILL)
        await stub.PauseRun(orchestrator_pb2.PauseRunRequest())
        await eventually(spell_dropped, timeout_s=30, what="the killed process's episodes dropped")
        await eventually(
            lambda: processes_ready(tmp_path / "spell.log") == 2, timeout_s=120, what="spell's process restarted"
        )
        assert [p.pid for p in environment_processes("spell")] not in ([], [victim.pid])
        played_before = (await spell()).num_episodes_finished
        await stub.ResumeRun(orchestrator_pb2.ResumeRunRequest())
        await eventually(lambda: status_is_finished(stub), timeout_s=120, what="the run finished after the restart")
        assert (await spell()).num_episodes_finished > played_before
        final = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
    assert final.error == ""
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 9))
    spell_steps = [r["environments"]["spell"] for r in records]
    kv_steps = [r["environments"]["kv"] for r in records]
    # The rubrics' rewards: the knowing model is right every time.
    for env in spell_steps + kv_steps:
        if env["num_rewards"]:
            assert env["reward_mean"] == 1.0, env
    spell_metrics = [e["episode_metrics"] for e in spell_steps if e["num_rewards"]]
    kv_metrics = [e["episode_metrics"] for e in kv_steps if e["num_rewards"]]
    assert spell_metrics and all(m["reasoning_gym_score"] == 1.0 and m["num_turns"] == 1 for m in spell_metrics)
    assert kv_metrics and all(
        m["correct_value"] == 1.0 and m["lookup_calls"] == 1 and m["num_turns"] == 2 for m in kv_metrics
    )
    # Tool turns continue one training sample: the answer's tokens were rendered back as they were.
    assert sum(e["turns"] for e in kv_steps) >= 4 and sum(e["new_samples_after_first"] for e in kv_steps) == 0
    assert any('"name": "lookup"' in system for system in router.system_messages)


async def status_is_finished(stub: orchestrator_pb2_grpc.OrchestratorServiceStub) -> bool:
    status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
    assert status.state != orchestrator_pb2.RUN_STATE_FAILED, status.error
    return status.state == orchestrator_pb2.RUN_STATE_FINISHED
