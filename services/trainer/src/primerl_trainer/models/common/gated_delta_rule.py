"""The gated delta rule (Gated DeltaNet's token mixing; Yang, Kautz, Hatamizadeh 2024) in plain
PyTorch, the CPU path and the reference: a per-head recurrent state S [Dk, Dv] updated token by
token as

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

(q and k L2-normalised, q scaled; g <= 0 the log decay, beta in (0, 1) the write strength), in
two forms: `recurrent_gated_delta_rule` (the recurrence above) and `chunked_gated_delta_rule`
(the training form: per chunk of C tokens the intra-chunk writes are one triangular solve, and
only the state crosses chunks); and the short causal convolution before it, with its state.
Both take and return the state entering and leaving, so a sequence can be run in parts.
"""

import functools

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_SIZE = 64
# Added to the squared norm under the square root when q and k are L2-normalised (fla's and
# transformers' value).
L2_NORM_EPS = 1e-6


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float32, or a wider dtype of the inputs (float64 runs stay float64)."""
    return functools.reduce(torch.promote_types, (t.dtype for t in tensors), torch.float32)


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(dim=-1, keepdim=True) + L2_NORM_EPS)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu of the depthwise causal convolution of x [N, L, C] with weight [C, W] (taps oldest
    first) plus `bias` [C] (Mamba-2's), computed in the weight's dtype and returned in x's.
    `initial_state` [N, C, W-1]: the inputs before x (None: zeros). Returns (output [N, L, C],
    final state [N, C, W-1])."""
    num_channels, width = weight.shape
    x_NCL = x.transpose(1, 2).to(weight.dtype)
    if initial_state is None:
        initial_state = x_NCL.new_zeros(x.shape[0], num_channels, width - 1)
    x_NCL = torch.cat([initial_state.to(weight.dtype), x_NCL], dim=-1)
    out = F.conv1d(x_NCL, weight.unsqueeze(1), bias, groups=num_channels)
    return F.silu(out).transpose(1, 2).to(x.dtype), x_NCL[..., x_NCL.shape[-1] - (width - 1) :]


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule token by token. q, k [N, L, H, Dk] (L2-normalised), v [N, L, H, Dv], g and beta
    [N, L, H]; `initial_state` [N, H, Dk, Dv] (None: zeros). In float32 (or wider inputs' dtype);
    returns (o [N, L, H, Dv] in v's dtype, final state [N, H, Dk, Dv] in that compute dtype)."""
    out_dtype, dtype = v.dtype, compute_dtype(q, k, v, g, beta)
    q, k, v, g, beta = (t.to(dtype) for t in (q, k, v, g, beta))
    num_seqs, seq_len, num_heads, k_dim = k.shape
    state = q.new_zeros(num_seqs, num_heads, k_dim, v.shape[-1]) if initial_state is None else initial_state.to(dtype)
    outs = []
    for t in range(seq_len):
        state = state * g[:, t, :, None, None].exp()
        predicted = torch.einsum("nhkv,nhk->nhv", state, k[:, t])
        delta = beta[:, t, :, None] * (v[:, t] - predicted)
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("nhkv,nhk->nhv", state, q[:, t] * scale))
    out = torch.stack(outs, dim=1) if outs else v.new_zeros(v.shape)
    return out.to(out_dtype), state


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule of `recurrent_gated_delta_rule` (same arguments and results), chunk by chunk.

    Inside a chunk, with G_i = exp(sum of g over the chunk up to i) and S_0 the state entering it,
    the written values d_i = beta_i (v_i - k_i^T (state before i, decayed)) solve the unit lower
    triangular system (I + A) D = beta V - (beta G K) S_0, A_ij = beta_i (G_i / G_j) k_i.k_j for
    j < i. Then o_i = G_i q_i S_0 + sum_{j<=i} (G_i / G_j) (q_i.k_j) d_j and the state leaving the
    chunk is G_C S_0 + sum_j (G_C / G_j) k_j d_j^T."""
    out_dtype, dtype = v.dtype, compute_dtype(q, k, v, g, beta)
    num_seqs, seq_len, num_heads, k_dim = k.shape
    v_dim = v.shape[-1]
    pad = -seq_len % chunk_size
    num_chunks = (seq_len + pad) // chunk_size

    def chunks(x: torch.Tensor) -> torch.Tensor:
        # [N, L, H, ...] -> [N, H, num_chunks, C, ...], zero padded (a padded token has g = 0 and
        # beta = 0: it neither decays nor writes the state, and its output is dropped).
        x = x.to(dtype).transpose(1, 2)
        x = F.pad(x, (0, 0, 0, pad)) if x.ndim == 4 else F.pad(x, (0, pad))
        return x.reshape(num_seqs, num_heads, num_chunks, chunk_size, *x.shape[3:])

    q, k, v, g, beta = chunks(q) * scale, chunks(k), chunks(v), chunks(g), chunks(beta)
    log_decay = g.cumsum(dim=-1)  # [N, H, n, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(log G_i - log G_j) for j <= i, 0 above the diagonal (masked before exp: no overflow).
    pair_decay = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    written_v = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    written_k = torch.linalg.solve_triangular(
        system, k_beta * log_decay.exp()[..., None], upper=False, unitriangular=True
    )
    scores = (q @ k.transpose(-1, -2)) * pair_decay
    q_decayed = q * log_decay.exp()[..., None]
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]
    chunk_decay = log_decay[..., -1].exp()[..., None, None]

    state = q.new_zeros(num_seqs, num_heads, k_dim, v_dim) if initial_state is None else initial_state.to(dtype)
    outs = []
    for i in range(num_chunks):
        written = written_v[:, :, i] - written_k[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + scores[:, :, i] @ written)
        state = state * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ written
    out = torch.stack(outs, dim=2).reshape(num_seqs, num_heads, -1, v_dim)[:, :, :seq_len]
    return out.transpose(1, 2).to(out_dtype), state
