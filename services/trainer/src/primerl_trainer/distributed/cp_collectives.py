"""The collectives of context parallel attention: every cp rank's slice of a sequence gathered
into the whole sequence in row order, with the gradient summed back onto each slice.

Each rank holds two chunks of the row (the zig-zag split of context_parallel.py: rank r holds
chunks r and 2cp-1-r of 2cp equal chunks, in that order). The all-gather concatenates the
ranks' slices; the result is put back in row order so that a key's index is its place in the
row. The backward is the reverse: row order to rank order, then a reduce-scatter (sum) of the
gradients, since every rank's queries read every rank's keys. Gloo has no reduce-scatter: there
an all-reduce and this rank's slice of it.

Both directions are custom ops, opaque to torch.compile, so a compiled block calls them as they
are (the process group travels by name).
"""

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group

__all__ = ["gather_sequence", "row_to_zigzag", "zigzag_to_row"]


def gather_sequence(x: torch.Tensor, group_name: str, cp_size: int) -> torch.Tensor:
    """x [t, ...], this rank's two zig-zag chunks -> [cp_size * t, ...], the whole row in order,
    over the process group named `group_name` (`ProcessGroup.group_name`, of `cp_size` ranks).
    Differentiable: the gradient of each rank's slice is the sum over ranks of theirs."""
    return _gather_sequence(x, group_name, cp_size)


def zigzag_to_row(x: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Rank-major zig-zag order (rank 0's chunks 0 and 2cp-1, rank 1's 1 and 2cp-2, ...) along
    dim 0 -> row order."""
    chunks = x.chunk(2 * cp_size)
    return torch.cat([chunks[2 * k if k < cp_size else 2 * (2 * cp_size - 1 - k) + 1] for k in range(2 * cp_size)])


def row_to_zigzag(x: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Row order along dim 0 -> rank-major zig-zag order (the inverse of `zigzag_to_row`)."""
    chunks = x.chunk(2 * cp_size)
    return torch.cat([chunks[k] for rank in range(cp_size) for k in (rank, 2 * cp_size - 1 - rank)])


@torch.library.custom_op("primerl::cp_gather_sequence", mutates_args=())
def _gather_sequence(x: torch.Tensor, group_name: str, cp_size: int) -> torch.Tensor:
    x = x.contiguous()
    gathered = x.new_empty((cp_size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(gathered, x, group=_resolve_process_group(group_name))
    return zigzag_to_row(gathered, cp_size)


@_gather_sequence.register_fake
def _(x: torch.Tensor, group_name: str, cp_size: int) -> torch.Tensor:
    return x.new_empty((cp_size * x.shape[0], *x.shape[1:]))


@torch.library.custom_op("primerl::cp_reduce_scatter_sequence", mutates_args=())
def _reduce_scatter_sequence(grad: torch.Tensor, group_name: str, cp_size: int) -> torch.Tensor:
    group = _resolve_process_group(group_name)
    grad = row_to_zigzag(grad, cp_size).contiguous()
    if dist.get_backend(group) == "gloo":
        dist.all_reduce(grad, group=group)
        return grad.chunk(cp_size)[dist.get_rank(group)].clone()
    out = grad.new_empty((grad.shape[0] // cp_size, *grad.shape[1:]))
    dist.reduce_scatter_tensor(out, grad, group=group)
    return out


@_reduce_scatter_sequence.register_fake
def _(grad: torch.Tensor, group_name: str, cp_size: int) -> torch.Tensor:
    return grad.new_empty((grad.shape[0] // cp_size, *grad.shape[1:]))


def _setup_context(ctx, inputs, output) -> None:
    _, ctx.group_name, ctx.cp_size = inputs


def _backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
    return _reduce_scatter_sequence(grad, ctx.group_name, ctx.cp_size), None, None


_gather_sequence.register_autograd(_backward, setup_context=_setup_context)
