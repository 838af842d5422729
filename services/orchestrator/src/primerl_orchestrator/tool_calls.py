"""Tool calls in a model's text, by the format its chat template defines.

A chat template that takes `tools` also defines how the model writes a call; the orchestrator
parses the calls out of the answer in that format (`ToolCallFormat`, detected from the
template). Known: `hermes`, a JSON object {"name": ..., "arguments": {...}} between <tool_call>
and </tool_call> (Hermes and Qwen templates). A template that takes no tools gets the text
fallback: the tools are described in the system message (`describe_tools`) and calls are asked
for, parsed and rendered back in the hermes layout.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["FORMATS", "HERMES", "ToolCall", "ToolCallFormat", "ToolSpec", "describe_tools", "detect_format"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    # A JSON object, as text (OpenAI's `function.arguments`).
    arguments: str
    id: str = ""

    def same_call(self, other: ToolCall) -> bool:
        """Same tool and the same arguments (as JSON values, whatever their spacing)."""
        return self.name == other.name and _json_or_text(self.arguments) == _json_or_text(other.arguments)


@dataclass(frozen=True)
class ToolSpec:
    """A tool the model may call (OpenAI's function tool)."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] | None = None

    def openai(self) -> dict[str, Any]:
        """As chat templates and OpenAI take it: {"type": "function", "function": {...}}."""
        function: dict[str, Any] = {"name": self.name, "description": self.description}
        if self.parameters is not None:
            function["parameters"] = dict(self.parameters)
        return {"type": "function", "function": function}


class ToolCallFormat:
    """How calls are written in a model's text."""

    name: str

    def parse(self, text: str) -> list[ToolCall]:
        raise NotImplementedError

    def render(self, content: str, calls: Sequence[ToolCall]) -> str:
        """An assistant message's text with its calls written in (text fallback)."""
        raise NotImplementedError

    def holds(self, content: str, calls: Sequence[ToolCall]) -> bool:
        """True when `content` already holds exactly `calls` (the model's own answer)."""
        found = self.parse(content)
        return len(found) == len(calls) and all(a.same_call(b) for a, b in zip(found, calls, strict=True))


class HermesFormat(ToolCallFormat):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        """The well-formed calls, in order (a block that is not a JSON object with a string
        `name` and an object `arguments` is no call)."""
        calls = []
        for match in self._CALL.finditer(text):
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

    def render(self, content: str, calls: Sequence[ToolCall]) -> str:
        blocks = [
            f"{self.OPEN}{json.dumps({'name': c.name, 'arguments': _json_or_text(c.arguments or '{}')})}{self.CLOSE}"
            for c in calls
        ]
        return "\n".join([content, *blocks]) if content else "\n".join(blocks)


HERMES = HermesFormat()
FORMATS: dict[str, ToolCallFormat] = {HERMES.name: HERMES}


def detect_format(template: str) -> ToolCallFormat | None:
    """The call format a tool-taking chat template writes (None: none primerl parses)."""
    if HermesFormat.OPEN in template:
        return HERMES
    return None


def describe_tools(tools: Sequence[ToolSpec]) -> str:
    """The text fallback: the system message's part that lists `tools` and says how to call one."""
    signatures = "\n".join(json.dumps(tool.openai()["function"], sort_keys=True) for tool in tools)
    return (
        "Tools you can call, one JSON signature per line:\n"
        f"<tools>\n{signatures}\n</tools>\n"
        f'To call one, answer with {HERMES.OPEN}{{"name": "<tool name>", "arguments": {{<arguments>}}}}{HERMES.CLOSE} '
        "(one block per call); each result comes back in a tool message. Answer without a call when you are done."
    )


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text
