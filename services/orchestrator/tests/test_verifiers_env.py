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
from primerl_common.errors import ServiceError
from primerl_common.processes import free_port
from primerl_common.testing import bare_server, eventually, in_process_service
from primerl_launcher.tiny_model import EOS_TOKEN_ID, save_tokenizer
from primerl_orchestrator.config import EnvironmentConfig, OrchestratorConfig
from primerl_orchestrator.environments import environment_class
from primerl_orchestrator.environments.runtime import EnvironmentRuntime
from primerl_orchestrator.environments.verifiers_env import VerifiersEnvironment
from primerl_orchestrator.environments.verifiers_process.client import to_chat_messages, to_sampling, to_tools
from primerl_orchestrator.environments.verifiers_process.player import TaskRows
from primerl_orchestrator.rendering import Message, PromptRenderer
from primerl_orchestrator.server import build
from primerl_orchestrator.tool_calls import HERMES, ToolCall, ToolSpec

from .stand_ins import StandInTrainer

EXAMPLES = "primerl_orchestrator.environments.verifiers_examples"
LOOKUP_TOOL = {
    "type": "function",
    "function": {"name": "lookup", "description": "a value", "parameters": {"type": "object", "properties": {}}},
}


# ---------------------------------------------------------------- the pieces


def test_hermes_tool_calls_are_read_from_text_and_recognised_in_an_answer_that_holds_them():
    text = 'I look.<tool_call>{"name": "lookup", "arguments": {"key": "amber"}}</tool_call>'
    assert HERMES.parse(text) == [ToolCall("lookup", '{"key": "amber"}')]
    assert HERMES.parse('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>') == [
        ToolCall("f", '{"a": 1}')
    ]
    for broken in ["<tool_call>not json</tool_call>", '<tool_call>{"arguments": {}}</tool_call>', "plain answer"]:
        assert HERMES.parse(broken) == []
    # The model's own text holds its calls (whatever the spacing of their arguments).
    assert HERMES.holds(text, [ToolCall("lookup", '{"key":"amber"}', id="call_0_0")])
    assert not HERMES.holds("I look.", [ToolCall("lookup", "{}")])
    rendered = HERMES.render("", [ToolCall("lookup", '{"key": "amber"}')])
    assert HERMES.parse(rendered) == [ToolCall("lookup", '{"key": "amber"}')]


# A chat template that takes tools and writes calls the Hermes/Qwen way (written for this test).
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if not (tools and loop.first and message['role'] == 'system') %}"
    "<|im_start|>{{ 'user' if message['role'] == 'tool' else message['role'] }}\n"
    "{% if message['role'] == 'tool' %}<tool_response>{{ message['content'] }}</tool_response>"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% for call in message.get('tool_calls') or [] %}\n<tool_call>{{ {'name': call['function']['name'], "
    "'arguments': call['function']['arguments']} | tojson }}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _renderer(path: pathlib.Path, template: str | None = None) -> PromptRenderer:
    save_tokenizer(path)
    if template is not None:
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = template
        config_path.write_text(json.dumps(config))
    return PromptRenderer(path, max_model_len=1024)


def test_tools_go_through_a_template_that_takes_them_and_its_calls_are_parsed(tmp_path):
    renderer = _renderer(tmp_path, TOOL_TEMPLATE)
    assert renderer.takes_tools and renderer.call_format is HERMES
    lookup = ToolSpec("lookup", "a value", {"type": "object", "properties": {"key": {"type": "string"}}})
    call = ToolCall("lookup", '{"key": "amber"}', id="call_0_0")
    messages = [
        Message("system", "Be brief."),
        Message("user", "What is under amber?"),
        # Written by the environment, not the model: the template renders the call.
        Message("assistant", "", tool_calls=(call,)),
        Message("tool", "410", tool_call_id="call_0_0"),
    ]
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    prompt = tokenizer.decode(renderer.render_messages(messages, tools=[lookup]))
    assert prompt.startswith("<|im_start|>system\nBe brief.\n<tools>{") and '"name": "lookup"' in prompt
    assert "Tools you can call" not in prompt
    assert (
        '<|im_start|>assistant\n<tool_call>{"name": "lookup", "arguments": {"key": "amber"}}</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>410</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in prompt
    # The model's own answer holds its call: kept as written, not rendered twice.
    answer = 'Looking.<tool_call>{"name": "lookup", "arguments": {"key": "amber"}}</tool_call>'
    own = tokenizer.decode(
        renderer.render_messages([messages[1], Message("assistant", answer, (call,))], tools=[lookup])
    )
    assert own.count("<tool_call>") == 1 and f"<|im_start|>assistant\n{answer}<|im_end|>" in own
    assert renderer.parse_tool_calls(answer, id_prefix="call_3") == [ToolCall("lookup", '{"key": "amber"}', "call_3_0")]


def test_a_template_without_tools_gets_them_described_in_the_system_message(tmp_path):
    renderer = _renderer(tmp_path)
    assert not renderer.takes_tools and renderer.call_format is HERMES
    lookup = ToolSpec("lookup", "a value")
    prompt = renderer.decode(
        renderer.render_messages(
            [Message("user", "hi"), Message("assistant", "", (ToolCall("lookup", "{}", id="c"),))], tools=[lookup]
        )
    )
    assert prompt.startswith("system\nTools you can call") and '{"description": "a value", "name": "lookup"}' in prompt
    assert 'assistant\n<tool_call>{"name": "lookup", "arguments": {}}</tool_call>' in prompt


def test_a_template_that_takes_tools_in_an_unknown_call_format_asks_for_the_format(tmp_path):
    renderer = _renderer(tmp_path, "{{ tools | tojson }}{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert renderer.takes_tools and renderer.call_format is None
    with pytest.raises(ServiceError, match=r"set model\.tool_call_format"):
        renderer.parse_tool_calls("x", id_prefix="c")


def test_openai_messages_and_tools_become_generate_fields():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is under "}, {"type": "text", "text": "amber?"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}],
        },
        {"role": "tool", "tool_call_id": "1", "content": "410"},
    ]
    converted = to_chat_messages(messages)
    assert [m.role for m in converted] == ["system", "user", "assistant", "tool"]
    assert converted[1].content == "What is under amber?"
    assert [(c.id, c.name, c.arguments) for c in converted[2].tool_calls] == [("1", "lookup", "{}")]
    assert converted[3].tool_call_id == "1"
    [tool] = to_tools([LOOKUP_TOOL])
    assert (tool.name, tool.description, json.loads(tool.parameters_json)) == (
        "lookup",
        "a value",
        {"type": "object", "properties": {}},
    )


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
    assert runtime.next_task().data == {"index": 0, "split": "train", "seed": 7, "shuffle": True}
    assert runtime.next_task().data["index"] == 1
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
                        "args": {"num_examples": 50, "num_eval_examples": 10},
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
            # Played by the environments' processes as evaluation episodes.
            evals=[
                {
                    "name": "spell_eval",
                    "environment": "spell",
                    "options": {"split": "eval"},
                    "num_tasks": 3,
                    "num_samples": 2,
                    "interval_steps": 4,
                },
                {"name": "kv_eval", "environment": "kv", "num_tasks": 2, "num_samples": 2, "interval_steps": 4},
            ],
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
    # The evaluations, played by the same processes and never trained on: right every time.
    evals = [json.loads(line) for line in (tmp_path / "evals.jsonl").read_text().splitlines()]
    for name in ("spell_eval", "kv_eval"):
        versions = [e["policy_version"] for e in evals if e["name"] == name]
        assert versions[:2] == [0, 4], evals
    for result in evals:
        assert (result["reward_mean"], result["pass@1"], result["num_errors"]) == (1.0, 1.0, 0), result
    # Tool turns continue one training sample: the answer's tokens were rendered back as they were.
    assert sum(e["turns"] for e in kv_steps) >= 4 and sum(e["new_samples_after_first"] for e in kv_steps) == 0
    assert any('"name": "lookup"' in system for system in router.system_messages)


async def status_is_finished(stub: orchestrator_pb2_grpc.OrchestratorServiceStub) -> bool:
    status = await stub.GetRunStatus(orchestrator_pb2.GetRunStatusRequest())
    assert status.state != orchestrator_pb2.RUN_STATE_FAILED, status.error
    return status.state == orchestrator_pb2.RUN_STATE_FINISHED
