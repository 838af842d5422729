"""Rotary position embeddings (the default "rope_type"), computed once per forward from the
position ids and shared by every layer."""

import torch


def rope_cos_sin(
    position_ids: torch.Tensor, *, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [B, T, head_dim] for position ids of shape [B, T].

    The angles are taken in float32 and only the result is cast to `dtype`, as transformers
    does, so that large positions keep their precision. Nothing is cached on the module:
    the table is tiny next to one layer's work, and a buffer-free model loads from the meta
    device and shards under FSDP without special cases."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=position_ids.device) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    freqs = position_ids[..., None].float() * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotates x of shape [B, T, H, D] by the angles of cos/sin [B, T, D] (the rotate-half
    convention of Hugging Face checkpoints, not the interleaved one of Meta's)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin
