"""Prompts as the model sees them: chat messages (with tools and tool calls) rendered with the
model's own chat template and tokenizer (transformers), raw token ids checked, completions
decoded to text and their tool calls parsed.

Tools go through the template's `tools` argument when the template takes one, and the calls
in an answer are parsed in the format that template writes (tool_calls.py). A template that
takes no tools gets the text fallback: the tools described in the system message, calls asked
for and rendered back in the hermes layout.
"""

from __future__ import annotations

import json
import pathlib
import re
from collections.abc import Sequence
from dataclasses import dataclass

import jinja2
import jinja2.meta
from transformers import AutoTokenizer

from primerl_common.errors import FailedPrecondition, InvalidArgument
from primerl_orchestrator.tool_calls import (
    FORMATS,
    HERMES,
    ToolCall,
    ToolCallFormat,
    ToolSpec,
    describe_tools,
    detect_format,
)

__all__ = ["ROLES", "Message", "PromptRenderer"]

ROLES = ("system", "user", "assistant", "tool")
AUTO = "auto"


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    # Assistant messages: the calls it made; tool messages: the call answered.
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


class PromptRenderer:
    def __init__(
        self, model_path: pathlib.Path, *, max_model_len: int | None = None, tool_call_format: str = AUTO
    ) -> None:
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        if self._tokenizer.chat_template is None:
            raise ValueError(f"the tokenizer of {model_path} has no chat template")
        self.max_model_len = max_model_len or _max_position_embeddings(model_path)
        template = self._tokenizer.get_chat_template(None, tools=[{}])
        self.takes_tools = _takes_tools(template)
        # The format calls are parsed in (None: a tool-taking template whose format is unknown).
        self.call_format: ToolCallFormat | None
        if tool_call_format != AUTO:
            self.call_format = FORMATS[tool_call_format]
        else:
            self.call_format = detect_format(template) if self.takes_tools else HERMES

    def render_messages(
        self,
        messages: Sequence[Message | tuple[str, str]],
        *,
        tools: Sequence[ToolSpec] = (),
        field: str = "messages",
    ) -> list[int]:
        """The prompt of the next assistant turn after `messages`, offered `tools`."""
        if not messages:
            raise InvalidArgument("at least one message is needed", field=field)
        conversation = []
        for index, message in enumerate(messages):
            if not isinstance(message, Message):
                message = Message(*message)
            if message.role not in ROLES:
                raise InvalidArgument(
                    f"role {message.role!r} is not one of {', '.join(ROLES)}", field=f"{field}[{index}].role"
                )
            conversation.append(self._entry(message))
        if tools and not self.takes_tools:
            description = describe_tools(tools)
            if conversation[0]["role"] == "system":
                conversation[0]["content"] = f"{conversation[0]['content']}\n\n{description}"
            else:
                conversation.insert(0, {"role": "system", "content": description})
        encoded = self._tokenizer.apply_chat_template(
            conversation,
            tools=[tool.openai() for tool in tools] if tools and self.takes_tools else None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )
        return list(encoded["input_ids"])

    def _entry(self, message: Message) -> dict[str, object]:
        entry: dict[str, object] = {"role": message.role, "content": message.content}
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        calls = message.tool_calls
        # The model's own answer holds its calls already: rendered as it is, token for token.
        if not calls or (self.call_format is not None and self.call_format.holds(message.content, calls)):
            return entry
        if not self.takes_tools:
            entry["content"] = HERMES.render(message.content, calls)
            return entry
        entry["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": _arguments(c.arguments)}}
            for c in calls
        ]
        return entry

    def check_tool_format(self) -> None:
        """Raises unless calls in an answer can be parsed (a turn offering tools)."""
        if self.call_format is None:
            raise FailedPrecondition(
                "the model's chat template takes tools in a call format primerl does not parse "
                f"(known: {', '.join(FORMATS)}): set model.tool_call_format",
                reason="UNKNOWN_TOOL_CALL_FORMAT",
            )

    def parse_tool_calls(self, text: str, *, id_prefix: str) -> list[ToolCall]:
        """The calls in an answer, each with an id `<id_prefix>_<index>`."""
        self.check_tool_format()
        assert self.call_format is not None
        return [
            ToolCall(call.name, call.arguments, id=f"{id_prefix}_{index}")
            for index, call in enumerate(self.call_format.parse(text))
        ]

    def check_tokens(self, token_ids: Sequence[int], *, vocab_size: int, field: str = "tokens.token_ids") -> list[int]:
        """`token_ids` as a prompt of a model with `vocab_size` token ids."""
        if not token_ids:
            raise InvalidArgument("the prompt is empty", field=field)
        for index, token in enumerate(token_ids):
            if token >= vocab_size:
                raise InvalidArgument(f"token {index} is {token}, outside the vocabulary ({vocab_size})", field=field)
        return list(token_ids)

    def check_fits(self, num_prompt_tokens: int, *, field: str) -> int:
        """Room left for the completion; refuses a prompt that leaves none."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise InvalidArgument(
                f"the prompt has {num_prompt_tokens} tokens; the context holds {self.max_model_len} "
                "(prompt and at least one new token)",
                field=field,
                reason="PROMPT_TOO_LONG",
            )
        return room

    @property
    def vocab_size(self) -> int:
        return len(self._tokenizer)

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of a completion, special tokens (the end of turn) left out."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)


def _max_position_embeddings(model_path: pathlib.Path) -> int:
    config_path = model_path / "config.json"
    try:
        return int(json.loads(config_path.read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model.max_model_len is unset and {config_path} gives no max_position_embeddings") from exc


def _takes_tools(template: str) -> bool:
    """True when the chat template reads the `tools` it is given."""
    try:
        parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except jinja2.TemplateError:  # a tag of transformers' own ({% generation %}): read the text
        return re.search(r"\btools\b", template) is not None
    return "tools" in jinja2.meta.find_undeclared_variables(parsed)


def _arguments(text: str) -> object:
    """A call's arguments as templates take them: the JSON object (its text if it is none)."""
    try:
        return json.loads(text or "{}")
    except ValueError:
        return text
