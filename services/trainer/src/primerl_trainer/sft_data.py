"""SFT from a JSONL file: tokenized samples, packed into the same micro-batches PushBatch carries.

Each line is one sample, either
    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}
rendered with the model's chat template (transformers' AutoTokenizer), the loss on what each
assistant turn adds to the conversation (its content and end-of-turn tokens, not the
generation prompt before it), or
    {"prompt": "...", "completion": "..."}
plain text, the loss on the completion and the end-of-sequence token after it.

A turn's tokens are the tokens of the text it adds to the rendered conversation, tokenized on
their own, as an inference engine sees a prompt and then samples a completion. That needs a
template whose rendering of the first n messages is a prefix of the rendering of the first n+1;
a template that rewrites earlier turns (e.g. drops past reasoning) is refused, naming the line.

Batches are deterministic: epoch e visits the samples in a permutation drawn from seed + e, and
batch i of the run is the same whenever it is asked for, so a resumed run continues with the
batch after its checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Any

import torch

from primerl_trainer.batch import MicroBatch

__all__ = ["SFTBatch", "SFTDataset", "SFTSample", "load_sft_samples", "pack_samples", "tokenize_example"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class SFTSample:
    input_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # bool [T]


@dataclass(frozen=True)
class SFTBatch:
    micro_batches: list[MicroBatch]
    num_samples: int
    num_loss_tokens: int


def tokenize_example(example: dict[str, Any], tokenizer: Any) -> SFTSample:
    """One JSONL record -> token ids and loss mask; ValueError says what is wrong with it."""
    if "messages" in example:
        segments = _chat_segments(example["messages"], tokenizer)
    elif "prompt" in example and "completion" in example:
        prompt, completion = example["prompt"], example["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError("prompt and completion must be strings")
        segments = [(prompt, False), (completion, True)]
    else:
        raise ValueError('needs "messages", or "prompt" and "completion"')
    ids: list[int] = []
    mask: list[bool] = []
    for text, is_loss in segments:
        tokens = tokenizer.encode(text, add_special_tokens=False) if text else []
        ids += tokens
        mask += [is_loss] * len(tokens)
    if "messages" not in example and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
        mask.append(True)
    return SFTSample(torch.tensor(ids, dtype=torch.int64), torch.tensor(mask, dtype=torch.bool))


def _chat_segments(messages: Any, tokenizer: Any) -> list[tuple[str, bool]]:
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
    ):
        raise ValueError('"messages" must be a list of {"role": str, "content": str}')
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message: nothing to train on")

    def render(count: int, *, generation_prompt: bool) -> str:
        if count == 0:
            return ""
        return tokenizer.apply_chat_template(messages[:count], tokenize=False, add_generation_prompt=generation_prompt)

    segments: list[tuple[str, bool]] = []
    rendered = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        for text, is_loss in (
            (render(index, generation_prompt=True), False),
            (render(index + 1, generation_prompt=False), True),
        ):
            if not text.startswith(rendered):
                raise ValueError(
                    f"the chat template renders message {index} so that the conversation before it is not a prefix "
                    "(it rewrites earlier turns); such a template cannot mark assistant tokens"
                )
            segments.append((text[len(rendered) :], is_loss))
            rendered = text
    return segments


def load_sft_samples(path: str | os.PathLike[str], tokenizer: Any, *, seq_len: int) -> list[SFTSample]:
    """Every line of a JSONL file, tokenized; longer samples are cut at seq_len tokens.
    ValueError names the line of a bad record."""
    samples = []
    num_cut = num_empty = 0
    with pathlib.Path(path).open() as file:
        for number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                example = json.loads(line)
                if not isinstance(example, dict):
                    raise ValueError("is not a JSON object")
                sample = tokenize_example(example, tokenizer)
            except ValueError as exc:
                raise ValueError(f"{path}:{number}: {exc}") from None
            if sample.input_ids.numel() > seq_len:
                num_cut += 1
                sample = SFTSample(sample.input_ids[:seq_len], sample.loss_mask[:seq_len])
            # The first token has nothing before it to predict it.
            sample.loss_mask[0] = False
            if not sample.loss_mask.any():
                num_empty += 1
                continue
            samples.append(sample)
    if num_cut or num_empty:
        logger.warning(
            "SFT dataset %s: %d samples cut at seq_len %d, %d skipped with no loss token left",
            path,
            num_cut,
            seq_len,
            num_empty,
        )
    if not samples:
        raise ValueError(f"{path}: no sample to train on")
    return samples


def pack_samples(samples: list[SFTSample], *, seq_len: int) -> list[MicroBatch]:
    """Samples back to back, in order, in micro-batches of at most seq_len tokens."""
    groups: list[list[SFTSample]] = []
    length = seq_len
    for sample in samples:
        if length + sample.input_ids.numel() > seq_len:
            groups.append([])
            length = 0
        groups[-1].append(sample)
        length += sample.input_ids.numel()
    micro_batches = []
    for group in groups:
        input_ids = torch.cat([s.input_ids for s in group])
        micro_batches.append(
            MicroBatch(
                input_ids=input_ids,
                position_ids=torch.cat([torch.arange(s.input_ids.numel()) for s in group]),
                loss_mask=torch.cat([s.loss_mask for s in group]),
                temperatures=torch.ones(input_ids.shape, dtype=torch.float32),
            )
        )
    return micro_batches


class SFTDataset:
    """Samples served as batches of `batch_size` (the last of an epoch may be smaller)."""

    def __init__(
        self,
        samples: list[SFTSample],
        *,
        seq_len: int,
        batch_size: int,
        epochs: int = 1,
        max_steps: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
    ) -> None:
        self.samples = samples
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.batches_per_epoch = math.ceil(len(samples) / batch_size)
        total = self.batches_per_epoch * epochs
        self.num_steps = total if max_steps is None else min(total, max_steps)

    def batch(self, index: int) -> SFTBatch:
        """Batch `index` (0-based: the one optimizer step index + 1 trains on)."""
        if not 0 <= index < self.num_steps:
            raise IndexError(f"batch {index} outside [0, {self.num_steps})")
        epoch, position = divmod(index, self.batches_per_epoch)
        if self.shuffle:
            order = torch.randperm(len(self.samples), generator=torch.Generator().manual_seed(self.seed + epoch))
        else:
            order = torch.arange(len(self.samples))
        chosen = [
            self.samples[i] for i in order[position * self.batch_size : (position + 1) * self.batch_size].tolist()
        ]
        micro_batches = pack_samples(chosen, seq_len=self.seq_len)
        return SFTBatch(micro_batches, len(chosen), sum(mb.num_loss_tokens for mb in micro_batches))
