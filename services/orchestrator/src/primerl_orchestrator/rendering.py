"""Prompts as the model sees them: chat messages rendered with the model's own chat template
and tokenizer (transformers), raw token ids checked, completions decoded to text."""

from __future__ import annotations

import json
import pathlib
from collections.abc import Sequence

from transformers import AutoTokenizer

from primerl_common.errors import InvalidArgument

__all__ = ["ROLES", "PromptRenderer"]

ROLES = ("system", "user", "assistant", "tool")


class PromptRenderer:
    def __init__(self, model_path: pathlib.Path, *, max_model_len: int | None = None) -> None:
        self._tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        if self._tokenizer.chat_template is None:
            raise ValueError(f"the tokenizer of {model_path} has no chat template")
        self.max_model_len = max_model_len or _max_position_embeddings(model_path)

    def render_messages(self, messages: Sequence[tuple[str, str]], *, field: str = "messages") -> list[int]:
        """The prompt of the next assistant turn after `messages`."""
        if not messages:
            raise InvalidArgument("at least one message is needed", field=field)
        for index, (role, _) in enumerate(messages):
            if role not in ROLES:
                raise InvalidArgument(f"role {role!r} is not one of {', '.join(ROLES)}", field=f"{field}[{index}].role")
        conversation = [{"role": role, "content": content} for role, content in messages]
        encoded = self._tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=True
        )
        return list(encoded["input_ids"])

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

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of a completion, special tokens (the end of turn) left out."""
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=True)


def _max_position_embeddings(model_path: pathlib.Path) -> int:
    config_path = model_path / "config.json"
    try:
        return int(json.loads(config_path.read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"model.max_model_len is unset and {config_path} gives no max_position_embeddings") from exc
