"""Tool calls as text, for a model turn that Generate renders from plain (role, content)
messages: the tools are described in the system message, a call is a JSON object
{"name": ..., "arguments": {...}} between <tool_call> and </tool_call> in the model's answer
(the layout Hermes- and Qwen-style chat templates use), and a tool's result goes back as a
"tool" message."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ToolCall", "describe_tools", "parse_tool_calls", "render_tool_calls"]

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    # A JSON object, as text (OpenAI's `function.arguments`).
    arguments: str


def describe_tools(tools: Sequence[Mapping[str, Any]]) -> str:
    """The system message's part that lists `tools` (OpenAI tool definitions) and says how to call one."""
    signatures = "\n".join(json.dumps(tool.get("function", tool), sort_keys=True) for tool in tools)
    return (
        "Tools you can call, one JSON signature per line:\n"
        f"<tools>\n{signatures}\n</tools>\n"
        f'To call one, answer with {OPEN}{{"name": "<tool name>", "arguments": {{<arguments>}}}}{CLOSE} '
        "(one block per call); each result comes back in a tool message. Answer without a call when you are done."
    )


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The well-formed calls in a model's answer, in order (a block that is not a JSON object with
    a string `name` and an object `arguments` is no call)."""
    calls = []
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                continue
        if not isinstance(arguments, dict):
            continue
        calls.append(ToolCall(call["name"], json.dumps(arguments)))
    return calls


def render_tool_calls(content: str, calls: Sequence[ToolCall]) -> str:
    """An assistant message's text with its calls: `content` as it is when it holds them already
    (the model's own answer, token for token), else with a block per call appended."""
    if not calls or OPEN in content:
        return content
    blocks = [
        f"{OPEN}{json.dumps({'name': c.name, 'arguments': json.loads(c.arguments or '{}')})}{CLOSE}" for c in calls
    ]
    return "\n".join([content, *blocks]) if content else "\n".join(blocks)
