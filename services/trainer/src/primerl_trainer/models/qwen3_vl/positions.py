"""The language model's 3-D (t, h, w) position ids for text with images (transformers'
`get_rope_index`): text tokens count on in all three rows alike; an image's tokens (one per
merged block of its t x h x w grid) take the position where the image starts plus their frame,
block row and block column; the text after the image goes on from the start plus the image's
larger merged side, not plus its number of tokens."""

from __future__ import annotations

import torch

from primerl_trainer.models.common.attention import document_ids


def mrope_position_ids(
    input_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    *,
    image_token_id: int,
    spatial_merge_size: int,
) -> torch.Tensor:
    """[3, B, T] int64 for input_ids [B, T] with position ids [B, T] (None: 0..T-1 in every row;
    packed rows restart them at each sample, and each sample's images shift only its own later
    tokens). The images of image_grid_thw [num_images, 3] are taken in order, row by row, each by
    as many consecutive image tokens as it has merged blocks; a ValueError names a mismatch."""
    batch_size, seq_len = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(seq_len, device=input_ids.device).expand(batch_size, seq_len)
    positions = position_ids.long().expand(3, batch_size, seq_len).clone()
    is_image = input_ids == image_token_id
    grids = [] if image_grid_thw is None else image_grid_thw.tolist()
    if not is_image.any():
        if grids:
            raise ValueError(f"image_grid_thw names {len(grids)} images but input_ids holds no image tokens")
        return positions
    docs = document_ids(position_ids)
    num_images = 0
    for row in range(batch_size):
        image_tokens = is_image[row].nonzero().flatten().tolist()
        i = 0
        while i < len(image_tokens):
            if num_images == len(grids):
                raise ValueError(f"input_ids holds image tokens beyond the {len(grids)} images of image_grid_thw")
            t, h, w = grids[num_images]
            h, w = h // spatial_merge_size, w // spatial_merge_size
            start, num_tokens = image_tokens[i], t * h * w
            if image_tokens[i : i + num_tokens] != list(range(start, start + num_tokens)):
                raise ValueError(
                    f"image {num_images} (grid {grids[num_images]}) needs {num_tokens} consecutive image tokens "
                    f"from token {start} of row {row}"
                )
            axes = (torch.arange(n, device=input_ids.device) for n in (t, h, w))
            grid = torch.stack(torch.meshgrid(*axes, indexing="ij"))
            positions[:, row, start : start + num_tokens] = positions[:, row, start : start + 1] + grid.flatten(1)
            # The sample's later tokens: on from start + max(h, w) rather than start + num_tokens.
            later = (torch.arange(seq_len, device=input_ids.device) >= start + num_tokens) & (
                docs[row] == docs[row, start]
            )
            positions[:, row, later] += max(h, w) - num_tokens
            i += num_tokens
            num_images += 1
    if num_images != len(grids):
        raise ValueError(f"image_grid_thw names {len(grids)} images but input_ids holds the tokens of {num_images}")
    return positions
