"""Prompts as the model sees them: chat messages (with tools and tool calls, and images for a
vision-language model) rendered with the model's own chat template, tokenizer and image
processor (transformers), raw token ids checked, completions decoded to text and their tool
calls parsed.

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
from typing import TYPE_CHECKING

import jinja2
import jinja2.meta
from transformers import AutoTokenizer

from primerl_common.errors import FailedPrecondition, InvalidArgument
from primerl_common.images import CAPABILITY_IMAGES, decode_image
from primerl_orchestrator.prompt_images import (
    ImageInput,
    ImageProcessor,
    ImageUri,
    expand_image_tokens,
    read_image_uri,
)
from primerl_orchestrator.samples import PromptImage
from primerl_orchestrator.tool_calls import (
    FORMATS,
    HERMES,
    ToolCall,
    ToolCallFormat,
    ToolSpec,
    describe_tools,
    detect_format,
)

if TYPE_CHECKING:
    from primerl_orchestrator.config import ModelConfig

__all__ = ["ROLES", "Message", "PromptRenderer", "RenderedPrompt"]

ROLES = ("system", "user", "assistant", "tool")
AUTO = "auto"


@dataclass(frozen=True)
class Message:
    role: str
    content: str
    # Assistant messages: the calls it made; tool messages: the call answered.
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    # The content in order, text and images, when it holds images (`content` is then "").
    parts: tuple[str | ImageInput | ImageUri, ...] = ()

    @property
    def text(self) -> str:
        """The message's text, its images left out."""
        return self.content or "".join(part for part in self.parts if isinstance(part, str))


@dataclass(frozen=True)
class RenderedPrompt:
    """A turn's prompt. `token_ids`: as the model reads it, each image's token repeated to the
    image's size; `engine_token_ids`: as inference takes it, one image token per image."""

    token_ids: list[int]
    engine_token_ids: list[int]
    images: tuple[PromptImage, ...] = ()
    # The position in token_ids of each image's first token.
    image_starts: tuple[int, ...] = ()


class PromptRenderer:
    def __init__(
        self,
        model_path: pathlib.Path,
        *,
        max_model_len: int | None = None,
        tool_call_format: str = AUTO,
        image_uri_roots: Sequence[pathlib.Path] = (),
    ) -> None:
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        # None: a text model, whose prompts hold no images.
        self.images = ImageProcessor(model_path) if ImageProcessor.is_multimodal(model_path) else None
        self._image_uri_roots = tuple(image_uri_roots)
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

    @classmethod
    def from_config(cls, model: ModelConfig) -> PromptRenderer:
        return cls(
            model.path,
            max_model_len=model.max_model_len,
            tool_call_format=model.tool_call_format,
            image_uri_roots=model.image_uri_roots,
        )

    def render_messages(
        self,
        messages: Sequence[Message | tuple[str, str]],
        *,
        tools: Sequence[ToolSpec] = (),
        field: str = "messages",
    ) -> list[int]:
        """The prompt tokens of the next assistant turn after `messages` (text only), offered `tools`."""
        return self.render(messages, tools=tools, field=field).token_ids

    def render(
        self,
        messages: Sequence[Message | tuple[str, str]],
        *,
        tools: Sequence[ToolSpec] = (),
        field: str = "messages",
    ) -> RenderedPrompt:
        """The prompt of the next assistant turn after `messages`, offered `tools`."""
        if not messages:
            raise InvalidArgument("at least one message is needed", field=field)
        conversation = []
        images: list[PromptImage] = []
        for index, message in enumerate(messages):
            if not isinstance(message, Message):
                message = Message(*message)
            if message.role not in ROLES:
                raise InvalidArgument(
                    f"role {message.role!r} is not one of {', '.join(ROLES)}", field=f"{field}[{index}].role"
                )
            entry = self._entry(message)
            if any(not isinstance(part, str) for part in message.parts):
                entry["content"] = self._content(message.parts, images, field=f"{field}[{index}].parts")
            elif message.parts:  # text alone: the same prompt as that text in `content`
                entry["content"] = message.text
            conversation.append(entry)
        if tools and not self.takes_tools:
            description = describe_tools(tools)
            system = conversation[0]
            if system["role"] == "system" and isinstance(system["content"], list):
                system["content"] = [*system["content"], {"type": "text", "text": f"\n\n{description}"}]
            elif system["role"] == "system":
                system["content"] = f"{system['content']}\n\n{description}"
            else:
                conversation.insert(0, {"role": "system", "content": description})
        encoded = self._tokenizer.apply_chat_template(
            conversation,
            tools=[tool.openai() for tool in tools] if tools and self.takes_tools else None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
        )
        token_ids = list(encoded["input_ids"])
        if self.images is None:
            return RenderedPrompt(token_ids, token_ids)
        expanded, starts = expand_image_tokens(token_ids, images, self.images.image_token_id)
        return RenderedPrompt(expanded, token_ids, tuple(images), tuple(starts))

    def _content(
        self, parts: Sequence[str | ImageInput | ImageUri], images: list[PromptImage], *, field: str
    ) -> list[dict[str, str]]:
        """A message's parts as chat templates take them; its images processed onto `images`."""
        content = []
        for number, part in enumerate(parts):
            if isinstance(part, str):
                content.append({"type": "text", "text": part})
                continue
            part_field = f"{field}[{number}].image"
            if self.images is None:
                if isinstance(part, ImageInput):  # a malformed image is named as such first
                    decode_image(part.data, part.mime_type, field=part_field)
                raise FailedPrecondition(
                    f"{part_field} is an image, and the model takes none (no vision_config in its config.json)",
                    subject=CAPABILITY_IMAGES,
                    reason="CAPABILITY_MISSING",
                )
            if isinstance(part, ImageUri):
                part = read_image_uri(part.uri, part.mime_type, roots=self._image_uri_roots, field=f"{part_field}.uri")
            images.append(self.images.process(part, field=part_field))
            content.append({"type": "image"})
        return content

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
        """`token_ids` as a prompt of a model with `vocab_size` token ids (with no image tokens:
        images come only with chat messages)."""
        if not token_ids:
            raise InvalidArgument("the prompt is empty", field=field)
        for index, token in enumerate(token_ids):
            if token >= vocab_size:
                raise InvalidArgument(f"token {index} is {token}, outside the vocabulary ({vocab_size})", field=field)
            if self.images is not None and token == self.images.image_token_id:
                raise InvalidArgument(
                    f"token {index} is the image token {token}; send images as parts of chat messages", field=field
                )
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
        config = json.loads(config_path.read_text())
        # A vision-language model's language model has the context length.
        return int(config.get("text_config", config)["max_position_embeddings"])
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
