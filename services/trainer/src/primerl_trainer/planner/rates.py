"""Measured per-kernel rates of one GPU kind, read from a TOML rates file (rates/<gpu>.toml).

The file says where each number came from (`source` in each table); `bench/parallel_throughput.py
--calibrate` measures them on a GPU and prints a file in this format. Rates of kernels that
depend on the shape (matmuls, grouped matmuls, attention) are tables of measured shapes; the
planner takes the measured shape nearest to the one it needs (log distance).
"""

from __future__ import annotations

import math
import pathlib
import tomllib
from dataclasses import dataclass
from typing import Any

__all__ = ["GpuRates", "LinkRates", "StepFit", "load_rates", "rates_path"]

_RATES_DIR = pathlib.Path(__file__).parent / "rates"


@dataclass(frozen=True)
class LinkRates:
    """NCCL bus bandwidths (nccl-tests' busbw convention: time = bytes * (n-1)/n / busbw, bytes
    being the gathered size for all-gather, the input for reduce-scatter, the send buffer for
    all-to-all), GB/s."""

    all_gather_gbps: float
    reduce_scatter_gbps: float
    all_to_all_gbps: float
    # Seconds per all-to-all call beyond its bytes: the launch and, mostly, waiting for the slowest
    # rank (every exchange is a barrier of the ep group). Fitted to a measured run (see `fit`).
    all_to_all_call_s: float = 0.0
    source: str = ""


@dataclass(frozen=True)
class StepFit:
    """Terms fitted to measured steps rather than measured per kernel (`source` says which run).

    ep_layer_s: per MoE layer forward under expert parallel and per doubling of the ranks
    (log2(ep) times: the value at ep=2), what the dispatch costs beyond its bytes and its calls'
    fixed cost: the GPU running dry after
    the host sync on the split sizes while the host launches the layer's remaining work, and the
    dispatcher's index kernels (sort, scatters, masks) and row kernels where they run below the
    copy rate.
    fsdp_exposed_fraction: the part of the sharded FSDP units' all-gathers and reduce-scatters
    that compute does not hide (the first gather and the last reduction of a pass have nothing to
    overlap with, and NCCL's kernels slow the compute they run beside)."""

    ep_layer_s: float = 0.0
    fsdp_exposed_fraction: float = 0.0
    source: str = ""


@dataclass(frozen=True)
class GpuRates:
    gpu: str
    memory_gib: float  # what torch.cuda.mem_get_info reports as total
    reserved_gib: float  # CUDA context, NCCL buffers, allocator fragmentation: not for tensors
    gpus_per_node: int
    hbm_gbps: float  # device copy, read + write
    # (m, k, n, TFLOP/s) of bf16 [m, k] @ [k, n]
    matmul: tuple[tuple[int, int, int, float], ...]
    # (rows per expert, k, n, TFLOP/s) of torch._grouped_mm in bf16
    grouped_mm: tuple[tuple[int, int, int, float], ...]
    # (seq len, head dim, forward TFLOP/s, backward TFLOP/s) of causal attention; the forward is
    # counted as 2 * heads * (qk dim + v dim) * seq^2 / 2 FLOPs, the backward as 2.5x that.
    attention: tuple[tuple[int, int, float, float], ...]
    intra_node: LinkRates
    inter_node: LinkRates
    # Measured saved-activation bytes over the planner's count, for dense and MoE blocks.
    activation_factor_dense: float = 1.0
    activation_factor_moe: float = 1.0
    fit: StepFit = StepFit()
    source: str = ""

    @property
    def usable_bytes(self) -> float:
        return (self.memory_gib - self.reserved_gib) * 2**30

    @property
    def peak_tflops(self) -> float:
        """The best measured bf16 matmul rate: the denominator of MFU."""
        return max(tflops for *_, tflops in self.matmul)

    def matmul_tflops(self, m: int, k: int, n: int) -> float:
        return _nearest(self.matmul, (m, k, n))[3]

    def grouped_mm_tflops(self, rows_per_expert: float, k: int, n: int) -> float:
        return _nearest(self.grouped_mm, (max(rows_per_expert, 1.0), k, n))[3]

    def attention_tflops(self, seq_len: int, head_dim: int) -> tuple[float, float]:
        entry = _nearest(self.attention, (seq_len, head_dim))
        return entry[2], entry[3]

    def link(self, group_size: int, *, spans_nodes: bool) -> LinkRates:
        return self.inter_node if spans_nodes else self.intra_node


def _nearest(table: tuple[tuple[Any, ...], ...], key: tuple[float, ...]) -> tuple[Any, ...]:
    def distance(entry: tuple[Any, ...]) -> float:
        return sum(math.log(entry[i] / key[i]) ** 2 for i in range(len(key)))

    return min(table, key=distance)


def rates_path(gpu: str) -> pathlib.Path:
    return _RATES_DIR / f"{gpu.lower()}.toml"


def load_rates(gpu_or_path: str | pathlib.Path) -> GpuRates:
    """Rates of a GPU kind ("h100", "h200": the files shipped here) or of a rates file."""
    path = pathlib.Path(gpu_or_path)
    if not path.suffix:
        path = rates_path(str(gpu_or_path))
        if not path.is_file():
            known = sorted(p.stem for p in _RATES_DIR.glob("*.toml"))
            raise ValueError(f"--gpu {gpu_or_path!r}: no rates file; known: {known} (or pass --rates FILE)")
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"rates file {path}: {exc}") from None
    try:
        return GpuRates(
            gpu=data["gpu"],
            memory_gib=float(data["memory_gib"]),
            reserved_gib=float(data["reserved_gib"]),
            gpus_per_node=int(data["gpus_per_node"]),
            hbm_gbps=float(data["hbm"]["gbps"]),
            matmul=tuple((e["m"], e["k"], e["n"], float(e["tflops"])) for e in data["matmul"]["shapes"]),
            grouped_mm=tuple(
                (e["rows_per_expert"], e["k"], e["n"], float(e["tflops"])) for e in data["grouped_mm"]["shapes"]
            ),
            attention=tuple(
                (e["seq_len"], e["head_dim"], float(e["fwd_tflops"]), float(e["bwd_tflops"]))
                for e in data["attention"]["shapes"]
            ),
            intra_node=_link(data["intra_node"]),
            inter_node=_link(data["inter_node"]),
            activation_factor_dense=float(data.get("activations", {}).get("factor_dense", 1.0)),
            activation_factor_moe=float(data.get("activations", {}).get("factor_moe", 1.0)),
            fit=_fit(data.get("fit", {})),
            source=data.get("source", ""),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"rates file {path}: missing or bad entry {exc}") from None


def _link(table: dict[str, Any]) -> LinkRates:
    return LinkRates(
        all_gather_gbps=float(table["all_gather_gbps"]),
        reduce_scatter_gbps=float(table["reduce_scatter_gbps"]),
        all_to_all_gbps=float(table["all_to_all_gbps"]),
        all_to_all_call_s=float(table.get("all_to_all_call_s", 0.0)),
        source=table.get("source", ""),
    )


def _fit(table: dict[str, Any]) -> StepFit:
    return StepFit(
        ep_layer_s=float(table.get("ep_layer_s", 0.0)),
        fsdp_exposed_fraction=float(table.get("fsdp_exposed_fraction", 0.0)),
        source=table.get("source", ""),
    )
