"""Mamba-2 (Dao, Gu 2024), the state-space layer of Nemotron-H: one input projection gives the
gate z, the convolution's channels (x, B, C) and the step sizes dt; x, B and C go through a short
causal convolution (with bias) and silu; then per head h (state [P, N], head_dim P, state size N,
B and C shared by the heads of a group)

    dt_t = clamp(softplus(dt_t + dt_bias), dt_limit),    a_t = dt_t * A,    A = -exp(A_log)
    S_t = exp(a_t) S_{t-1} + dt_t x_t B_t^T,             y_t = S_t C_t + D x_t

then y times silu(z), RMSNorm per group of channels, and the output projection.

The scan in plain PyTorch, the CPU path and the reference, in two forms: `recurrent_ssd` (the
recurrence above) and `chunked_ssd` (the training form, state-space duality: inside a chunk the
outputs are a masked attention-like product, only the state crosses chunks). On CUDA the layer
runs mamba-ssm's and causal-conv1d's kernels when both import (they are compiled CUDA extensions
and optional), else the PyTorch path, saying so once.

Packed rows: `Segments` (gated_delta_net.py) names where each sample starts; the convolution and
the scan start from zero state at every sample, so nothing flows from one sample into the next.
The PyTorch path scans the rows as they are: a sample's first token has log decay -inf (the
state before it is dropped) and the convolution's taps read only their own sample's tokens.

Context parallel (`ContextParallelRow`, gated_delta_net.py: a row split zig-zag into 2 * cp
chunks, two per rank): the PyTorch path passes the state between ranks. The scan is linear in its
state, with a known dependence: each rank scans its chunks from zero state, giving per chunk the
state leaving it B_c and, where the chunk is one piece of one sample, its total decay A_c (else
0); the ranks all-gather every chunk's (A_c, B_c) and the convolution's last inputs, chain
S_c = A_c S_{c-1} + B_c in row order, and add exp(l_i) S_in C_i to the outputs of a chunk's first
piece where it continues a sample from the chunk before. The kernels instead gather the row's
inputs (one all-gather per layer), scan it on every rank and keep their tokens.
"""

from __future__ import annotations

import functools
import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from primerl_trainer.distributed.cp_collectives import gather_sequence
from primerl_trainer.models.common.gated_delta_net import ContextParallelRow, Segments
from primerl_trainer.models.common.gated_delta_rule import causal_conv1d, compute_dtype

logger = logging.getLogger(__name__)

Mamba2Impl = Literal["auto", "torch", "kernels"]
MAMBA2_IMPLS: tuple[Mamba2Impl, ...] = ("auto", "torch", "kernels")
DEFAULT_CHUNK_SIZE = 128


def _heads_of_groups(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """[..., G, N] -> [..., H, N]: head h reads group h // (H / G)."""
    return t.repeat_interleave(num_heads // t.shape[-2], dim=-2)


def recurrent_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    *,
    initial_state: torch.Tensor | None = None,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan token by token. x [N, L, H, P], dt [N, L, H] (after softplus and clamp), A and D
    [H], B and C [N, L, G, S]; `initial_state` [N, H, P, S] (None: zeros); `reset` [N, L] bool:
    the tokens that start a sample (the state before them is dropped). In float32 (or the inputs'
    wider dtype); returns (y [N, L, H, P] in x's dtype, final state in that dtype)."""
    out_dtype, dtype = x.dtype, compute_dtype(x, dt, B, C)
    num_heads = x.shape[2]
    x, dt, A, D = (t.to(dtype) for t in (x, dt, A, D))
    B, C = (_heads_of_groups(t.to(dtype), num_heads) for t in (B, C))
    state = x.new_zeros(*x.shape[:1], num_heads, x.shape[-1], B.shape[-1])
    if initial_state is not None:
        state = initial_state.to(dtype)
    outs = []
    for t in range(x.shape[1]):
        decay = (dt[:, t] * A).exp()[..., None, None]
        if reset is not None:
            decay = decay * ~reset[:, t, None, None, None]
        state = state * decay + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        outs.append(torch.einsum("nhps,nhs->nhp", state, C[:, t]) + D[:, None] * x[:, t])
    y = torch.stack(outs, dim=1) if outs else x.new_zeros(x.shape)
    return y.to(out_dtype), state


def _segment_sums(a: torch.Tensor) -> torch.Tensor:
    """[..., C] -> [..., C, C]: entry (i, j) the sum of a over j < k <= i, -inf above the
    diagonal. Summed directly rather than as a difference of cumulative sums, which loses the
    small sums of long chunks to rounding."""
    size = a.shape[-1]
    causal = torch.ones(size, size, dtype=torch.bool, device=a.device).tril()
    # Entry (k, j) of the expanded matrix is a_k, kept for k > j; summed over k up to i.
    sums = a[..., :, None].expand(*a.shape, size).masked_fill(~causal.tril(-1), 0).cumsum(dim=-2)
    return sums.masked_fill(~causal, float("-inf"))


def chunked_ssd(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: torch.Tensor | None = None,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan of `recurrent_ssd` (same arguments and results), chunk by chunk.

    Inside a chunk, with l_i the cumulative sum of a up to i and S_0 the state entering it,
    y_i = sum_{j<=i} exp(l_i - l_j) (C_i.B_j) dt_j x_j + exp(l_i) S_0 C_i + D x_i, and the state
    leaving it is exp(l_C) S_0 + sum_j exp(l_C - l_j) dt_j x_j B_j^T. A sample start has
    a = -inf: every decay across it is zero, so samples packed in one row stay apart."""
    out_dtype, dtype = x.dtype, compute_dtype(x, dt, B, C)
    num_seqs, seq_len, num_heads, head_dim = x.shape
    state_size = B.shape[-1]
    pad = -seq_len % chunk_size
    num_chunks = (seq_len + pad) // chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:
        # [N, L, H, ...] -> [N, H, n, C, ...], zero padded (a padded token has dt = 0: it neither
        # decays nor writes the state, and its output is dropped).
        t = t.to(dtype).transpose(1, 2)
        t = F.pad(t, (0, 0, 0, pad)) if t.ndim == 4 else F.pad(t, (0, pad))
        return t.reshape(num_seqs, num_heads, num_chunks, chunk_size, *t.shape[3:])

    A32, D32 = A.to(dtype), D.to(dtype)
    B, C = (_heads_of_groups(t, num_heads) for t in (B, C))
    x_c, dt_c, B_c, C_c = chunks(x), chunks(dt), chunks(B), chunks(C)
    a = dt_c * A32[:, None, None]  # [N, H, n, C]
    if reset is not None:
        a = a.masked_fill(chunks(reset.to(dtype)[..., None].expand(-1, -1, num_heads)).bool(), float("-inf"))
    log_decay = a.cumsum(dim=-1)
    pair_log_decay = _segment_sums(a)
    scores = (C_c @ B_c.transpose(-1, -2)) * pair_log_decay.exp()  # [N, H, n, C, C]
    x_dt = x_c * dt_c[..., None]
    intra = scores @ x_dt  # [N, H, n, C, P]
    C_decayed = C_c * log_decay.exp()[..., None]
    x_to_end = x_dt * pair_log_decay[..., -1, :].exp()[..., None]
    chunk_decay = log_decay[..., -1].exp()[..., None, None]

    state = x.new_zeros(num_seqs, num_heads, head_dim, state_size, dtype=dtype)
    if initial_state is not None:
        state = initial_state.to(dtype)
    outs = []
    for i in range(num_chunks):
        outs.append(intra[:, :, i] + C_decayed[:, :, i] @ state.transpose(-1, -2))
        state = state * chunk_decay[:, :, i] + x_to_end[:, :, i].transpose(-1, -2) @ B_c[:, :, i]
    y = torch.stack(outs, dim=2).reshape(num_seqs, num_heads, -1, head_dim)[:, :, :seq_len].transpose(1, 2)
    y = y + D32[:, None] * x.to(dtype)
    return y.to(out_dtype), state


def conv_within_samples(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, column: torch.Tensor
) -> torch.Tensor:
    """causal_conv1d (no entering state) of rows holding several samples: x [N, L, C], weight
    [C, W], `column` [N, L] each token's place in its sample; a tap reads a token only inside the
    same sample. Summed tap by tap in the weight's dtype, returned in x's."""
    width, seq_len = weight.shape[-1], x.shape[1]
    x_w = x.to(weight.dtype)
    out = x_w * weight[:, -1] if bias is None else torch.addcmul(bias, x_w, weight[:, -1])
    for k in range(1, width):
        before = F.pad(x_w, (0, 0, k, 0))[:, :seq_len] * (column >= k)[..., None]
        out = torch.addcmul(out, before, weight[:, width - 1 - k])
    return F.silu(out).to(x.dtype)


class GroupedGatedRMSNorm(nn.Module):
    """Mamba-2's output norm: y * silu(z) in float32, RMSNorm over each of `num_groups` equal
    groups of channels, cast to y's dtype, then scaled (transformers' rounding)."""

    def __init__(self, dim: int, *, num_groups: int, eps: float) -> None:
        super().__init__()
        self.num_groups, self.eps = num_groups, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = compute_dtype(y, z)
        h = y.to(dtype) * F.silu(z.to(dtype))
        h = h.view(*h.shape[:-1], self.num_groups, -1)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.flatten(-2).to(y.dtype)


@functools.cache
def _kernel_ops():
    """mamba-ssm's chunked scan and causal-conv1d's convolution (CUDA extensions), or None."""
    try:
        from causal_conv1d import causal_conv1d_fn
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError as error:
        logger.warning(
            "Mamba-2 on CUDA runs its PyTorch path (slow): mamba-ssm / causal-conv1d are not importable (%s)", error
        )
        return None
    return causal_conv1d_fn, mamba_chunk_scan_combined


class Mamba2(nn.Module):
    """The layer (module docstring), with Hugging Face's parameter names: in_proj (z, then x B C,
    then dt), conv1d (depthwise, with bias), dt_bias, A_log, D, norm, out_proj.

    `impl`: "torch" the PyTorch path (chunked form), "kernels" mamba-ssm's and causal-conv1d's
    (CUDA; ValueError when absent), "auto" those on CUDA when importable, else torch."""

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        head_dim: int,
        num_groups: int,
        state_size: int,
        conv_width: int,
        norm_eps: float,
        dt_limit: tuple[float, float],
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        conv_bias: bool = True,
        proj_bias: bool = False,
        impl: Mamba2Impl = "auto",
    ) -> None:
        super().__init__()
        if num_heads % num_groups:
            raise ValueError(f"mamba_num_heads ({num_heads}) must be a multiple of n_groups ({num_groups})")
        if impl not in MAMBA2_IMPLS:
            raise ValueError(f"mamba2 impl must be one of {MAMBA2_IMPLS}, got {impl!r}")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.num_groups, self.state_size = num_groups, state_size
        self.dt_limit, self.chunk_size, self.impl = dt_limit, chunk_size, impl
        inner = num_heads * head_dim
        self.conv_channels = inner + 2 * num_groups * state_size
        self.in_proj = nn.Linear(dim, inner + self.conv_channels + num_heads, bias=proj_bias)
        self.conv1d = nn.Conv1d(
            self.conv_channels, self.conv_channels, conv_width, groups=self.conv_channels, bias=conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GroupedGatedRMSNorm(inner, num_groups=num_groups, eps=norm_eps)
        self.out_proj = nn.Linear(inner, dim, bias=proj_bias)

    def forward(
        self, x: torch.Tensor, segments: Segments | None = None, cp: ContextParallelRow | None = None
    ) -> torch.Tensor:
        """x [B, T, dim]; `segments` the samples of packed rows (None: one per row); `cp`: x is
        this rank's share of one row (B = 1) and `segments` the whole row's samples."""
        inner = self.num_heads * self.head_dim
        z, xBC, dt = self.in_proj(x).split([inner, self.conv_channels, self.num_heads], dim=-1)
        if cp is not None and not self._use_kernels(x):
            y = self.context_parallel_core(xBC, dt, cp)
        elif cp is not None:
            y = self.core(*cp.gather(xBC, dt), segments)[:, cp.local_positions]
        else:
            y = self.core(xBC, dt, segments)
        # The PyTorch path's y is float32 (or wider): normed and scaled there, rounded once for the
        # projection (transformers' rounding; rounding y first doubled the bf16 error).
        return self.out_proj(self.norm(y, z).to(x.dtype))

    # Left out of compiled graphs: the PyTorch scan is a Python loop over chunks.
    @torch.compiler.disable
    def core(self, xBC: torch.Tensor, dt: torch.Tensor, segments: Segments | None) -> torch.Tensor:
        """The convolution's inputs [B, T, channels] and raw step sizes [B, T, H] -> the scan's
        output y [B, T, H * P] (D skip included; float32 or wider on the PyTorch path)."""
        if self._use_kernels(xBC):
            return self._kernel_core(xBC, dt, segments)
        if segments is None:
            return self.torch_core(xBC, dt)[0]
        # The rows as they are (no padding to the longest sample), the samples kept apart.
        column = (segments.padded_index % segments.max_len).view(xBC.shape[:2])
        return self.torch_core(xBC, dt, column=column)[0]

    def step_sizes(self, dt: torch.Tensor) -> torch.Tensor:
        """softplus(dt + dt_bias) clamped to dt_limit, in float32 at least."""
        dtype = compute_dtype(dt)
        return F.softplus(dt.to(dtype) + self.dt_bias.to(dtype)).clamp(*self.dt_limit)

    def split_conv_output(self, xBC: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[..., channels] -> x [..., H, P], B and C [..., G, S]."""
        group_width = self.num_groups * self.state_size
        x, B, C = xBC.split([self.num_heads * self.head_dim, group_width, group_width], dim=-1)
        shape = xBC.shape[:-1]
        return (
            x.reshape(*shape, self.num_heads, self.head_dim),
            B.reshape(*shape, self.num_groups, self.state_size),
            C.reshape(*shape, self.num_groups, self.state_size),
        )

    def torch_core(
        self,
        xBC: torch.Tensor,
        dt: torch.Tensor,
        *,
        conv_state: torch.Tensor | None = None,
        initial_state: torch.Tensor | None = None,
        column: torch.Tensor | None = None,
        recurrent: bool = False,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """Rows [N, L, channels], [N, L, H] -> (y [N, L, H * P], (the convolution's final state
        [N, channels, W-1], the scan's [N, H, P, S])), from the given entering states (None:
        zeros). `column` [N, L]: rows of several samples, each token's place in its sample (the
        entering states are then zeros, the convolution's final state empty); `recurrent` runs
        the token-by-token form (the check)."""
        weight = self.conv1d.weight.squeeze(1)
        if column is None:
            conv_out, conv_final = causal_conv1d(xBC, weight, conv_state, bias=self.conv1d.bias)
        else:
            conv_out = conv_within_samples(xBC, weight, self.conv1d.bias, column)
            conv_final = xBC.new_zeros(0)
        x, B, C = self.split_conv_output(conv_out)
        A = -self.A_log.to(compute_dtype(self.A_log)).exp()
        scan_args = (x.to(compute_dtype(x)), self.step_sizes(dt), A, B, C, self.D)
        reset = None if column is None else column == 0
        if recurrent:
            y, final = recurrent_ssd(*scan_args, initial_state=initial_state, reset=reset)
        else:
            y, final = chunked_ssd(*scan_args, chunk_size=self.chunk_size, initial_state=initial_state, reset=reset)
        return y.flatten(-2), (conv_final, final)

    @torch.compiler.disable
    def context_parallel_core(self, xBC: torch.Tensor, dt: torch.Tensor, cp: ContextParallelRow) -> torch.Tensor:
        """`core` of this rank's share of a row [1, t, ...], the state passed between ranks
        (module docstring)."""
        pieces, chunk_len = cp.pieces, cp.chunk_len
        conv_state = cp.conv_states(xBC, self.conv1d.weight.shape[-1])
        conv_out, _ = causal_conv1d(pieces.pad(xBC), self.conv1d.weight.squeeze(1), conv_state, bias=self.conv1d.bias)
        x, B, C = self.split_conv_output(conv_out)
        # Step sizes 0 after each piece's end: the padding neither decays nor writes the state.
        real = pieces.pad(torch.ones_like(dt[..., :1]))
        step = self.step_sizes(pieces.pad(dt)) * real
        A = -self.A_log.to(compute_dtype(self.A_log)).exp()
        y, final = chunked_ssd(x.to(compute_dtype(x)), step, A, B, C, self.D, chunk_size=self.chunk_size)
        log_decay = (step * A).cumsum(dim=1)  # [pieces, L, H]
        # Each chunk's map S_end = A_c S_in + B_c: A_c the total decay where the chunk is one
        # piece continuing its sample (else the entering state is not its sample's), B_c its last
        # piece's final state.
        first, starts = cp.first_pieces(), cp.chunk_starts()
        last = [int(pieces.padded_index[(c + 1) * chunk_len - 1]) // pieces.max_len for c in range(2)]
        continues = [cp.continues(start) for start in starts]
        decays = torch.stack(
            [log_decay[first[c], -1].exp() * float(first[c] == last[c] and continues[c]) for c in range(2)]
        )
        maps = torch.cat([decays, final[last].flatten(1)], dim=-1).to(final.dtype)
        maps = gather_sequence(maps, cp.group_name, cp.cp_size)
        state, entering = torch.zeros_like(final[0]), []
        for chunk in range(2 * cp.cp_size):
            entering.append(state)
            decay, written = maps[chunk].split([self.num_heads, maps.shape[-1] - self.num_heads])
            state = decay[:, None, None] * state + written.view_as(state)
        # Corrected in both chunks even where the chunk starts a sample (by a zero state): every
        # rank's backward then takes part in the gather's.
        for c in range(2):
            S_in = entering[starts[c] // chunk_len] * float(continues[c])
            C_heads = C[first[c]].to(S_in.dtype).repeat_interleave(self.num_heads // self.num_groups, dim=-2)
            correction = torch.einsum("hps,lhs->lhp", S_in, C_heads) * log_decay[first[c]].exp()[..., None]
            y = y.index_add(0, torch.tensor([first[c]], device=y.device), correction[None].to(y.dtype))
        return pieces.unpad(y.flatten(-2), 1)

    def _kernel_core(self, xBC: torch.Tensor, dt: torch.Tensor, segments: Segments | None) -> torch.Tensor:
        causal_conv1d_fn, mamba_chunk_scan_combined = _kernel_ops()
        batch_size, seq_len, _ = xBC.shape
        seq_idx = None
        if segments is not None:
            # One row of all tokens; the kernels restart wherever the sample index changes.
            xBC, dt = (t.reshape(1, batch_size * seq_len, t.shape[-1]) for t in (xBC, dt))
            lengths = segments.cu_seqlens.diff()
            seq_idx = torch.repeat_interleave(
                torch.arange(segments.num_samples, device=xBC.device, dtype=torch.int32), lengths
            )[None]
        conv_out = causal_conv1d_fn(
            xBC.transpose(1, 2), self.conv1d.weight.squeeze(1), self.conv1d.bias, seq_idx=seq_idx, activation="silu"
        ).transpose(1, 2)
        x, B, C = self.split_conv_output(conv_out)
        y = mamba_chunk_scan_combined(
            x, dt, -self.A_log.float().exp(), B, C, chunk_size=self.chunk_size, D=self.D, dt_bias=self.dt_bias,
            dt_softplus=True, dt_limit=self.dt_limit, seq_idx=seq_idx,
        )  # fmt: skip
        return y.reshape(batch_size, seq_len, -1)

    def _use_kernels(self, x: torch.Tensor) -> bool:
        if self.impl == "torch":
            return False
        if self.impl == "kernels":
            if not x.is_cuda or _kernel_ops() is None:
                raise ValueError("mamba2 impl 'kernels' needs a CUDA tensor and mamba-ssm with causal-conv1d")
            return True
        return x.is_cuda and _kernel_ops() is not None

    def extra_repr(self) -> str:
        return (
            f"heads {self.num_heads} x {self.head_dim}, groups {self.num_groups}, state {self.state_size}, "
            f"chunk {self.chunk_size}"
        )
