"""An OpenAI-compatible chat client for one episode: each chat completion is one model turn of
the episode through the orchestrator's Generate, which renders the messages with the model's
chat template, samples through the router and records the tokens for training.

It is the part of `openai.AsyncOpenAI` that verifiers' chat-completions client calls
(`chat.completions.create`, `close`). Tools, the calls of assistant messages and the call a
tool message answers travel as Generate's fields: the orchestrator renders them with the
model's chat template and parses the calls in the answer in the template's format.
"""

from __future__ import annotations

import json
import logging
import math
import time
import types
from collections.abc import Iterable, Mapping
from typing import Any

import grpc
from google.rpc import error_details_pb2
from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionMessageFunctionToolCall
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_function_tool_call import Function
from openai.types.completion_usage import CompletionUsage
from verifiers.errors import OverlongPromptError

from primerl.common.v1 import generation_pb2
from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl_common.errors import error_details

__all__ = ["EpisodeChatClient", "TurnFailed", "to_chat_messages", "to_sampling", "to_tools"]

logger = logging.getLogger(__name__)

_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
_INTS = ("top_k", "seed", "min_tokens")
# Accepted and left to the orchestrator (logprobs are its to record) or meaningless here.
_IGNORED = {"logprobs", "top_logprobs", "stream", "user", "modalities", "parallel_tool_calls", "tool_choice"}


class TurnFailed(Exception):
    """The orchestrator refused the turn or could not serve it (as opposed to the model's answer)."""

    def __init__(self, code: grpc.StatusCode, message: str, reason: str) -> None:
        super().__init__(f"Generate failed: {code.name} {reason}: {message}")
        self.code, self.reason = code, reason


class EpisodeChatClient:
    """`chat.completions.create` as Generate calls of episode `episode_id`."""

    def __init__(
        self, stub: orchestrator_pb2_grpc.OrchestratorServiceStub, episode_id: str, *, timeout_s: float
    ) -> None:
        self.episode_id = episode_id
        self.num_turns = 0
        self._stub = stub
        self._timeout_s = timeout_s
        self.chat = types.SimpleNamespace(completions=types.SimpleNamespace(create=self._create))

    async def close(self) -> None:
        """Nothing to close: the channel is the process's."""

    async def _create(
        self,
        *,
        model: str,
        messages: Iterable[Mapping[str, Any]],
        tools: list[Mapping[str, Any]] | None = None,
        extra_headers: Mapping[str, str] | None = None,
        **sampling: Any,
    ) -> ChatCompletion:
        request = orchestrator_pb2.GenerateRequest(
            episode_id=self.episode_id,
            messages=orchestrator_pb2.ChatMessages(messages=to_chat_messages(messages), tools=to_tools(tools or [])),
            sampling=to_sampling(sampling),
        )
        try:
            response = await self._stub.Generate(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            reasons = [d.reason for d in error_details(error) if isinstance(d, error_details_pb2.ErrorInfo)]
            if "PROMPT_TOO_LONG" in reasons:
                raise OverlongPromptError(error.details()) from error
            raise TurnFailed(error.code(), error.details() or "", reasons[0] if reasons else "") from error
        self.num_turns += 1
        calls = list(response.tool_calls)
        if calls:
            finish_reason = "tool_calls"
        elif response.finish_reason == generation_pb2.FINISH_REASON_LENGTH:
            finish_reason = "length"
        else:
            finish_reason = "stop"
        message = ChatCompletionMessage(
            role="assistant",
            # The whole answer, calls included: the next turn's prompt then holds it token for token.
            content=response.text,
            tool_calls=[
                ChatCompletionMessageFunctionToolCall(
                    id=call.id, type="function", function=Function(name=call.name, arguments=call.arguments)
                )
                for call in calls
            ]
            or None,
        )
        num_completion_tokens = len(response.token_ids)
        return ChatCompletion(
            id=f"{self.episode_id}-{response.turn}",
            object="chat.completion",
            created=int(time.time()),
            model=model,
            choices=[Choice(index=0, finish_reason=finish_reason, message=message)],
            usage=CompletionUsage(
                prompt_tokens=response.num_prompt_tokens,
                completion_tokens=num_completion_tokens,
                total_tokens=response.num_prompt_tokens + num_completion_tokens,
            ),
        )


def to_chat_messages(messages: Iterable[Mapping[str, Any]]) -> list[orchestrator_pb2.ChatMessage]:
    """OpenAI chat messages as Generate's, with their tool calls and the call a tool message answers."""
    converted = []
    for message in messages:
        role = "system" if message["role"] == "developer" else message["role"]
        calls = [
            orchestrator_pb2.ToolCall(
                id=call.get("id") or "",
                name=call["function"]["name"],
                arguments=call["function"].get("arguments") or "{}",
            )
            for call in message.get("tool_calls") or []
        ]
        converted.append(
            orchestrator_pb2.ChatMessage(
                role=role,
                content=_text(message.get("content")),
                tool_calls=calls,
                tool_call_id=message.get("tool_call_id") or "",
            )
        )
    return converted


def to_tools(tools: Iterable[Mapping[str, Any]]) -> list[orchestrator_pb2.Tool]:
    """OpenAI tool definitions ({"type": "function", "function": {...}}) as Generate's."""
    converted = []
    for tool in tools:
        function = tool.get("function", tool)
        parameters = function.get("parameters")
        converted.append(
            orchestrator_pb2.Tool(
                name=function["name"],
                description=function.get("description") or "",
                parameters_json=json.dumps(parameters) if parameters is not None else "",
            )
        )
    return converted


def to_sampling(sampling: Mapping[str, Any]) -> generation_pb2.SamplingParams:
    """OpenAI sampling arguments (and vLLM's extra_body ones) as the fields of the turn that
    override the environment's sampling defaults."""
    flat = dict(sampling)
    flat.update(flat.pop("extra_body", None) or {})
    params = generation_pb2.SamplingParams()
    if flat.pop("n", 1) not in (None, 1):
        raise ValueError("one completion per turn: n must be 1")
    max_tokens = flat.pop("max_completion_tokens", None) or flat.pop("max_tokens", None)
    flat.pop("max_tokens", None)
    if max_tokens:
        params.max_tokens = int(max_tokens)
    for name in _FLOATS:
        value = flat.pop(name, None)
        if value is not None and math.isfinite(value):
            setattr(params, name, float(value))
    for name in _INTS:
        value = flat.pop(name, None)
        if value is not None:
            setattr(params, name, int(value))
    left = sorted(name for name, value in flat.items() if value is not None and name not in _IGNORED)
    if left:
        logger.debug("sampling arguments with no Generate field, not applied: %s", ", ".join(left))
    return params


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        text = part.get("text") if isinstance(part, Mapping) else getattr(part, "text", None)
        if isinstance(text, str):
            parts.append(text)
    return "".join(parts)
