"""Token accounting of an episode: the training samples its turns make.

Each model turn brings a prompt (the conversation so far, as tokens) and a completion with,
per token, the logprob and policy version inference sampled it with, and, for router replay,
the experts each prompt and completion token was routed to ([P + C, layers, top_k]).

A turn whose prompt extends the current sample's tokens (the previous prompt, the previous
completion, then whatever the environment appended) continues that sample: the appended
tokens go in with the loss masked, the completion with the loss on. Otherwise (the
environment rewrote history, or the chat template renders the model's answer differently
from the tokens it sampled) a new sample starts with this turn's whole prompt.

A prompt with images (a vision-language model) holds each image's token repeated to the
image's size, as the model's processor expands it; the turn carries the images themselves, in
the order of their tokens. A turn continues a sample only when its images start with the
sample's (the same bytes): the tokens alone do not tell two images of one size apart.

Per token a sample holds: the id, whether it counts in the loss, the inference logprob (0
where masked), the policy version (for a prompt token: the version that sampled the turn's
first token, i.e. the weights that read it), the sampling temperature, and the routed-expert
row. Rows come from the turn that first forwarded the token, except the last completion
token of a turn: inference samples it but never forwards it (its row repeats the one
before), so when the next turn continues the sample its real row, from that turn's
forward, replaces the placeholder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["EpisodeTokens", "PromptImage", "Sample", "Turn"]


@dataclass(frozen=True, eq=False)
class PromptImage:
    """One image of a prompt: as the environment sent it, and as the model's processor made it."""

    data: bytes
    mime_type: str
    digest: str  # sha256 of `data`, hex
    pixel_values: torch.Tensor  # [patches, patch_dim], the processor's output
    grid_thw: tuple[int, int, int]  # temporal, height, width patches
    num_tokens: int  # its image tokens in the prompt


@dataclass(frozen=True)
class Turn:
    """One model turn as inference answered it."""

    prompt_token_ids: Sequence[int]
    completion_token_ids: Sequence[int]
    logprobs: Sequence[float]
    policy_versions: Sequence[int]
    temperature: float
    # [len(prompt) + len(completion), num_hidden_layers, top_k], or None without replay.
    routed_experts: torch.Tensor | None = None
    # The prompt's images, in the order of their tokens, and the position of each one's first token.
    images: tuple[PromptImage, ...] = ()
    image_starts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        num_completion = len(self.completion_token_ids)
        assert num_completion > 0, "a turn samples at least one token"
        assert len(self.logprobs) == num_completion and len(self.policy_versions) == num_completion
        if self.routed_experts is not None:
            assert self.routed_experts.shape[0] == len(self.prompt_token_ids) + num_completion
        assert len(self.images) == len(self.image_starts)


@dataclass
class Sample:
    """One training sequence, token-aligned lists."""

    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    # Consecutive row blocks of the routed experts; empty without replay.
    routed_segments: list[torch.Tensor] = field(default_factory=list)
    # The images of its tokens, in order (those of the last turn's prompt), and where each starts.
    images: list[PromptImage] = field(default_factory=list)
    image_starts: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_loss_tokens(self) -> int:
        return sum(self.loss_mask)

    @property
    def oldest_version(self) -> int:
        return min(v for v, m in zip(self.policy_versions, self.loss_mask, strict=True) if m)

    def routed_experts(self) -> torch.Tensor | None:
        """[len(self), layers, top_k], or None without replay."""
        return torch.cat(self.routed_segments) if self.routed_segments else None

    def is_extended_by(self, prompt: Sequence[int], images: Sequence[PromptImage] = ()) -> bool:
        n = len(self.token_ids)
        held = [image.digest for image in self.images]
        return (
            len(prompt) > n
            and list(prompt[:n]) == self.token_ids
            and [image.digest for image in images[: len(held)]] == held
        )

    def append_turn(self, turn: Turn) -> None:
        """Appends the prompt tokens past this sample's end (masked) and the completion."""
        start = len(self.token_ids)
        new_prompt = turn.prompt_token_ids[start:]
        prompt_version = turn.policy_versions[0]
        self.token_ids += [*new_prompt, *turn.completion_token_ids]
        self.loss_mask += [False] * len(new_prompt) + [True] * len(turn.completion_token_ids)
        self.logprobs += [0.0] * len(new_prompt) + list(turn.logprobs)
        self.policy_versions += [prompt_version] * len(new_prompt) + list(turn.policy_versions)
        self.temperatures += [turn.temperature] * (len(new_prompt) + len(turn.completion_token_ids))
        self.images, self.image_starts = list(turn.images), list(turn.image_starts)
        if turn.routed_experts is not None:
            if start:
                # The placeholder row of the previous turn's last token gives way to its real one.
                self.routed_segments[-1] = self.routed_segments[-1][:-1]
                self.routed_segments.append(turn.routed_experts[start - 1 :])
            else:
                self.routed_segments.append(turn.routed_experts)
        assert not self.routed_segments or sum(s.shape[0] for s in self.routed_segments) == len(self.token_ids)


@dataclass
class EpisodeTokens:
    """The samples of one episode, in order."""

    samples: list[Sample] = field(default_factory=list)

    def add_turn(self, turn: Turn) -> bool:
        """Records `turn`; True when it continued the current sample."""
        continues = bool(self.samples) and self.samples[-1].is_extended_by(turn.prompt_token_ids, turn.images)
        if not continues:
            self.samples.append(Sample())
        self.samples[-1].append_turn(turn)
        return continues

    @property
    def oldest_version(self) -> int | None:
        """Version of the oldest sampled token, None before the first turn."""
        return min((sample.oldest_version for sample in self.samples), default=None)
