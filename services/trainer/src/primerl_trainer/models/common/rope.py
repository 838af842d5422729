"""Rotary position embeddings, computed once per forward from the position ids and shared by every
layer: the default table (`rope_cos_sin`), YaRN as the Hugging Face configs define it
(`RopeParameters`, `rope_type` "yarn": inverse frequencies that blend interpolated (divided by
`factor`) and extrapolated ones over a ramp of dims set by `beta_fast`/`beta_slow` rotations
within `original_max_position_embeddings`, cos and sin times an attention factor, 0.1 ln(factor) + 1
unless the config gives one), and their application to all of each head's dims or its leading
ones (partial rotary).

Two multimodal variants (Qwen3-VL): the language model's interleaved MRoPE (`mrope_section`:
position ids in three rows t/h/w, each frequency taking its row in the pattern t h w t h w ...
until h's and w's sections are used up, t for the rest), and the vision tower's axial 2-D RoPE
(`axial_rope_cos_sin`: half the frequencies rotate by a patch's row, half by its column)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


def rope_cos_sin(
    position_ids: torch.Tensor, *, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [B, T, head_dim] for position ids of shape [B, T] (the default RoPE).

    The angles are taken in float32 and only the result is cast to `dtype`, as transformers
    does, so that large positions keep their precision. Nothing is cached on the module:
    the table is tiny next to one layer's work, and a buffer-free model loads from the meta
    device and shards under FSDP without special cases."""
    return RopeParameters(theta=theta).cos_sin(position_ids, head_dim=head_dim, dtype=dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x of shape [B, T, H, D] by the angles of cos/sin [B, T, D] (the rotate-half
    convention of Hugging Face checkpoints, not the interleaved one of Meta's)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of each head of x [B, T, H, D]; the rest unchanged
    (all of them when the table is as wide as the head)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


@dataclass(frozen=True, kw_only=True)
class RopeParameters:
    theta: float
    # YaRN; factor None: the default RoPE.
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    # Interleaved MRoPE (Qwen3-VL's `mrope_section`, t/h/w frequencies; they sum to head_dim / 2):
    # cos_sin then reads position ids [3, B, T] (or [B, T], every row alike: plain RoPE).
    mrope_section: tuple[int, int, int] | None = None

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], *, default_theta: float) -> RopeParameters:
        """From `rope_parameters` (transformers 5) or the hub's `rope_theta` + `rope_scaling`."""
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        theta = rope.get("rope_theta", config.get("rope_theta", default_theta))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise ValueError(
                f"rope_parameters: rope type {rope_type!r} is not supported (default, yarn); use impl='hf'"
            )
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"rope_parameters: partial_rotary_factor {rope['partial_rotary_factor']} is not supported")
        if rope_type == "default":
            return cls(theta=theta)
        original = rope.get("original_max_position_embeddings")
        factor = rope.get("factor")
        if factor is None and original:
            factor = config["max_position_embeddings"] / original
        if not original or not factor or factor <= 0:
            raise ValueError(
                "rope_parameters: yarn needs original_max_position_embeddings and a positive factor, got "
                f"{original!r} and {factor!r}"
            )
        return cls(
            theta=theta,
            factor=float(factor),
            original_max_position_embeddings=int(original),
            beta_fast=rope.get("beta_fast") or 32.0,
            beta_slow=rope.get("beta_slow") or 1.0,
            truncate=rope.get("truncate", True),
            attention_factor=rope.get("attention_factor"),
            mscale=rope.get("mscale"),
            mscale_all_dim=rope.get("mscale_all_dim"),
        )

    def inv_freq(self, head_dim: int, device: torch.device | None = None) -> torch.Tensor:
        """[head_dim / 2] float32."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
        base_freqs = self.theta**exponents
        if self.factor is None:
            return 1.0 / base_freqs
        low, high = self._ramp_bounds(head_dim)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        extrapolated = 1.0 - ramp
        return (1.0 / (self.factor * base_freqs)) * (1 - extrapolated) + (1.0 / base_freqs) * extrapolated

    def _ramp_bounds(self, head_dim: int) -> tuple[float, float]:
        def dim_of(rotations: float) -> float:
            wavelengths = self.original_max_position_embeddings / (rotations * 2 * math.pi)
            return head_dim * math.log(wavelengths) / (2 * math.log(self.theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        return max(low, 0), min(high, head_dim - 1)

    @property
    def cos_sin_scale(self) -> float:
        if self.factor is None:
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)

    def cos_sin(
        self, position_ids: torch.Tensor, *, head_dim: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, T, head_dim] (both halves alike, for apply_rope), taken in float32,
        scaled, then cast to `dtype`. With `mrope_section`, position_ids may be [3, B, T]."""
        if self.mrope_section is not None:
            position_ids = self._interleaved_positions(position_ids, head_dim)
        else:
            position_ids = position_ids[..., None]
        freqs = position_ids.float() * self.inv_freq(head_dim, position_ids.device)
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos(), angles.sin()
        scale = self.cos_sin_scale
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(dtype), sin.to(dtype)

    def _interleaved_positions(self, position_ids: torch.Tensor, head_dim: int) -> torch.Tensor:
        """[B, T, head_dim / 2]: the position each frequency rotates by. Frequency j takes the h row
        when j % 3 == 1 and j < 3 * sections[1], the w row when j % 3 == 2 and j < 3 * sections[2],
        the t row otherwise (transformers' Qwen3-VL layout)."""
        if sum(self.mrope_section) != head_dim // 2:
            raise ValueError(f"mrope_section {list(self.mrope_section)} must sum to head_dim / 2 = {head_dim // 2}")
        if position_ids.ndim == 2:
            position_ids = position_ids.expand(3, *position_ids.shape)
        rows = torch.zeros(head_dim // 2, dtype=torch.long, device=position_ids.device)
        for row in (1, 2):
            rows[row : 3 * self.mrope_section[row] : 3] = row
        return position_ids[rows].permute(1, 2, 0)


def axial_rope_cos_sin(position_ids: torch.Tensor, *, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 cos and sin [N, head_dim] for 2-D position ids [N, 2] (a patch's row and column):
    the default RoPE's head_dim / 4 frequencies of a head_dim / 2 table, by the row then by the
    column, both halves alike for apply_rope (Qwen3-VL's vision tower)."""
    inv_freq = RopeParameters(theta=theta).inv_freq(head_dim // 2, position_ids.device)
    freqs = (position_ids[..., None].float() * inv_freq).flatten(-2)
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()
