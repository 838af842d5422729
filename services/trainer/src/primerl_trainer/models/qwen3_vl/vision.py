"""Qwen3-VL's vision tower, as transformers computes it: images cut into patches of
`temporal_patch_size` x `patch_size` x `patch_size` pixels (the processor's flattened rows of
`pixel_values`, one per patch, in spatial-merge-block order), embedded by one linear map (the
hub's Conv3d, whose kernel equals its stride), plus a learned square grid of position embeddings
resampled bilinearly to each image's grid; pre-norm ViT blocks (LayerNorm, 2-D rotary attention
within each image frame, GELU-tanh MLP); then the patch merger, which concatenates each block of
`spatial_merge_size`^2 patches and maps them to the language model's width: one image token per
block. Deepstack mergers do the same to the hidden states after the blocks named in
`deepstack_visual_indexes`; the language model adds their outputs into its first layers.

Module names are transformers' (state_dict_adapter.py maps `model.visual.` to `visual.`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from primerl_trainer.models.common.rope import apply_rope, axial_rope_cos_sin

_LAYER_NORM_EPS = 1e-6


@dataclass(frozen=True, kw_only=True)
class VisionArgs:
    depth: int
    dim: int
    hidden_dim: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_dim: int
    num_position_embeddings: int
    deepstack_layers: tuple[int, ...]
    rope_theta: float

    @classmethod
    def from_hf_config(cls, vision: dict[str, Any]) -> Self:
        """From config.json's `vision_config` (transformers' defaults where it is silent)."""
        unsupported = {
            f"hidden_act {vision.get('hidden_act')!r}": vision.get("hidden_act", "gelu_pytorch_tanh")
            != "gelu_pytorch_tanh",
            "non-square patch_size": not isinstance(vision.get("patch_size", 16), int),
            "non-integer temporal_patch_size": not isinstance(vision.get("temporal_patch_size", 2), int),
        }
        if any(unsupported.values()):
            names = [name for name, present in unsupported.items() if present]
            raise ValueError(f"vision_config uses features the own Qwen3-VL vision tower lacks: {names}; use impl='hf'")
        rope = vision.get("rope_parameters") or {}
        args = cls(
            depth=vision.get("depth", 27),
            dim=vision.get("hidden_size", 1152),
            hidden_dim=vision.get("intermediate_size", 4304),
            num_heads=vision.get("num_heads", 16),
            in_channels=vision.get("in_channels", 3),
            patch_size=vision.get("patch_size", 16),
            temporal_patch_size=vision.get("temporal_patch_size", 2),
            spatial_merge_size=vision.get("spatial_merge_size", 2),
            out_dim=vision.get("out_hidden_size", 3584),
            num_position_embeddings=vision.get("num_position_embeddings", 2304),
            deepstack_layers=tuple(vision.get("deepstack_visual_indexes", (8, 16, 24))),
            rope_theta=rope.get("rope_theta", 10_000.0),
        )
        if args.dim % args.num_heads or (args.dim // args.num_heads) % 4:
            raise ValueError(f"vision hidden_size {args.dim} must split into num_heads {args.num_heads} of 4k dims")
        if int(args.num_position_embeddings**0.5) ** 2 != args.num_position_embeddings:
            raise ValueError(f"num_position_embeddings {args.num_position_embeddings} must be a square")
        if not all(0 <= layer < args.depth for layer in args.deepstack_layers):
            raise ValueError(f"deepstack_visual_indexes {list(args.deepstack_layers)} must lie in [0, {args.depth})")
        return args

    @property
    def patch_dim(self) -> int:
        """The values of one patch: a row of pixel_values."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


class VisionAttention(nn.Module):
    """Bidirectional attention within each frame (`cu_seqlens` bounds), rotary on q and k in
    float32 (as transformers)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.num_heads = args.num_heads
        self.qkv = nn.Linear(args.dim, 3 * args.dim)
        self.proj = nn.Linear(args.dim, args.dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], frame_lens: list[int]) -> torch.Tensor:
        num_patches = x.shape[0]
        q, k, v = self.qkv(x).view(num_patches, 3, self.num_heads, -1).unbind(1)
        # apply_rope's [B, T, H, D] with the patches as one row.
        q, k = (apply_rope(t.float()[None], *rope).to(x.dtype) for t in (q, k))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v[None].transpose(1, 2)
        # One call per frame (transformers' SDPA path): no [N, N] mask, no padding.
        out = torch.cat(
            [
                F.scaled_dot_product_attention(*frame)
                for frame in zip(q.split(frame_lens, 2), k.split(frame_lens, 2), v.split(frame_lens, 2), strict=True)
            ],
            dim=2,
        )
        return self.proj(out.transpose(1, 2).reshape(num_patches, -1))


class VisionMLP(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(args.dim, args.hidden_dim)
        self.linear_fc2 = nn.Linear(args.hidden_dim, args.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(args.dim, eps=_LAYER_NORM_EPS)
        self.attn = VisionAttention(args)
        self.norm2 = nn.LayerNorm(args.dim, eps=_LAYER_NORM_EPS)
        self.mlp = VisionMLP(args)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], frame_lens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, frame_lens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each block of spatial_merge_size^2 patches -> one token of the language model's width:
    LayerNorm per patch (the final merger) or over the concatenated block (`postshuffle_norm`,
    the deepstack mergers), then a GELU MLP."""

    def __init__(self, args: VisionArgs, *, postshuffle_norm: bool) -> None:
        super().__init__()
        self.merged_dim = args.dim * args.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged_dim if postshuffle_norm else args.dim, eps=_LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.linear_fc2 = nn.Linear(self.merged_dim, args.out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Per patch, then merged; or merged, then normed.
        x = self.norm(x.view(-1, self.merged_dim)) if self.postshuffle_norm else self.norm(x).view(-1, self.merged_dim)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class PatchEmbed(nn.Module):
    """The hub's Conv3d (kernel = stride = one patch) as the linear map it is, on flattened
    patches; its weight keeps the Conv3d's values, flattened (the adapter reshapes)."""

    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.proj = nn.Linear(args.patch_dim, args.dim)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.proj(pixel_values.to(self.proj.weight.dtype))


@dataclass(frozen=True)
class VisionOutput:
    """embeds: [num_image_tokens, out_dim], the images' tokens in order; deepstack: one such
    tensor per deepstack layer, in order, for the language model's first layers."""

    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...]


class VisionModel(nn.Module):
    def __init__(self, args: VisionArgs) -> None:
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.pos_embed = nn.Embedding(args.num_position_embeddings, args.dim)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))
        self.merger = PatchMerger(args, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(args, postshuffle_norm=True) for _ in args.deepstack_layers
        )

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionOutput:
        """pixel_values [num_patches, patch_dim] (the processor's), grid_thw [num_images, 3]: each
        image's patches along time, height and width."""
        grid_thw = check_grid_thw(grid_thw, spatial_merge_size=self.args.spatial_merge_size)
        num_patches = int(grid_thw.prod(-1).sum())
        if pixel_values.ndim != 2 or tuple(pixel_values.shape) != (num_patches, self.args.patch_dim):
            raise ValueError(
                f"pixel_values must be [num_patches, patch_dim] = [{num_patches}, {self.args.patch_dim}] for "
                f"image_grid_thw {grid_thw.tolist()}, got {list(pixel_values.shape)}"
            )
        rows, cols = patch_coordinates(grid_thw, spatial_merge_size=self.args.spatial_merge_size)
        x = self.patch_embed(pixel_values)
        x = x + self.interpolated_position_embeddings(rows, cols, grid_thw).to(x.dtype)
        head_dim = self.args.dim // self.args.num_heads
        rope = axial_rope_cos_sin(torch.stack((rows, cols), dim=-1), head_dim=head_dim, theta=self.args.rope_theta)
        rope = rope[0][None], rope[1][None]
        frame_lens = [h * w for t, h, w in grid_thw.tolist() for _ in range(t)]
        deepstack = []
        for layer, block in enumerate(self.blocks):
            x = block(x, rope, frame_lens)
            if layer in self.args.deepstack_layers:
                deepstack.append(self.deepstack_merger_list[self.args.deepstack_layers.index(layer)](x))
        return VisionOutput(self.merger(x), tuple(deepstack))

    def interpolated_position_embeddings(
        self, rows: torch.Tensor, cols: torch.Tensor, grid_thw: torch.Tensor
    ) -> torch.Tensor:
        """[num_patches, dim]: the learned side x side grid resampled to each image's h x w grid
        (bilinear, corners aligned), read at each patch's row and column."""
        side = int(self.args.num_position_embeddings**0.5)
        counts = grid_thw.prod(-1)
        heights, widths = (grid_thw[:, i].repeat_interleave(counts) for i in (1, 2))
        row_taps, row_weights = _bilinear_taps(rows, heights, side)
        col_taps, col_weights = _bilinear_taps(cols, widths, side)
        index = (row_taps[:, :, None] * side + col_taps[:, None, :]).flatten(1)
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)
        return (self.pos_embed(index) * weights[..., None]).sum(1)


def check_grid_thw(grid_thw: torch.Tensor, *, spatial_merge_size: int) -> torch.Tensor:
    """grid_thw as int64 [num_images, 3], refused unless every height and width is a positive
    multiple of spatial_merge_size."""
    if grid_thw.ndim != 2 or grid_thw.shape[1] != 3 or grid_thw.is_floating_point():
        raise ValueError(f"image_grid_thw must be integer [num_images, 3], got {grid_thw.dtype} {list(grid_thw.shape)}")
    grid_thw = grid_thw.long()
    if (grid_thw <= 0).any() or (grid_thw[:, 1:] % spatial_merge_size).any():
        raise ValueError(
            f"image_grid_thw {grid_thw.tolist()}: every t, h, w must be positive and h, w multiples of "
            f"spatial_merge_size {spatial_merge_size}"
        )
    return grid_thw


def patch_coordinates(grid_thw: torch.Tensor, *, spatial_merge_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The row and column [num_patches] of each patch of pixel_values: per image and frame, the
    h x w grid in spatial-merge-block order (the blocks row by row, each block's patches row by
    row), as the processor lays the patches out."""
    merge, rows, cols = spatial_merge_size, [], []
    for t, h, w in grid_thw.tolist():
        row, col = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
        for coordinate, out in ((row, rows), (col, cols)):
            out.append(coordinate.reshape(h // merge, merge, w // merge, merge).transpose(1, 2).flatten().repeat(t))
    return torch.cat(rows).to(grid_thw.device), torch.cat(cols).to(grid_thw.device)


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two source rows (clamped to the grid) and weights of target `index` on an axis of
    `size` resampled from `side`, with corners aligned (transformers' arithmetic, in float32)."""
    source = index.float() * (side - 1) / (size - 1).clamp(min=1)
    floor = source.floor()
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)
    return taps, weights
