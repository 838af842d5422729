"""Expert and context parallel on two GPUs (--gpus: 4 or 8) against one, side by side with the
capacity planner's predictions; and (--calibrate) the per-kernel rates the planner uses.

    python3 bench/parallel_throughput.py              # the comparison (~6 min on 2 H100 or, L = 196608, 2 H200)
    python3 bench/parallel_throughput.py --calibrate  # a rates file for this GPU (~1-3 min; parallel_calibrate.py)
    python3 bench/parallel_throughput.py --smoke      # tiny shapes, CPU, gloo: checks the script
    python3 bench/parallel_throughput.py --predict-from parallel_throughput.json --rates FILE
        # no runs: the planner's predictions and the table again for a saved run's measurements
    python3 bench/parallel_throughput.py --only 'moe 1 GPU' 'moe ep=2' --ep-variants unsharded packed+unsharded
        # the MoE runs, and variants of the ep=2 one timed in its processes (parallel_ep_variants.py)
    python3 bench/parallel_throughput.py --gpus 4   # (or 8) the same comparison at ep=N and cp=N: N times
        # the experts on N GPUs, N times the length at cp=N (issue 26's runs; RESULT's keys end in _N)

Launch it once, with plain python3 from the repository root: it starts its own workers (a
process per one-GPU run, torchrun over two ranks for the two-GPU runs) and collects their results.
Every run trains as the trainer does: `runtime.build_runtime` from a TrainerConfig (FSDP2 over
every rank, the `parallel` mesh, compiled blocks, AdamW) and `Trainer.train_step` on packed SFT
micro-batches (the logits loss path); times and peak memory are the step metrics' (medians of
the timed steps; peak: the largest over ranks).

(a) expert parallel: the MoE shape of bench/trainer_throughput.py with 256 experts at ep=2 on two
    GPUs against 128 experts on one (the same experts per GPU: the difference is the dispatch and
    combine), 8 micro-batches of 4096 tokens per GPU per step, bf16 weights and AdamW state; the
    ep=2 run with parallel.accumulate_unsharded (the dense part, FSDP-sharded over the 2 ranks,
    gathered and reduced once per step, as the one-GPU run's units of one rank are; --ep-reshard:
    without). ep_scaling = per-GPU tokens/s at ep=2 over one GPU's.
(b) context parallel: the dense shape of trainer_throughput.py with activation checkpointing and
    float32 master weights (the trainer's default; --dense-dtype), one sequence of L tokens on one
    GPU (L the longest that fits, at least 32,768: the planner's memory model picks the first
    length to try, then longer until one runs out of memory) against one of 2L tokens at cp=2.
    cp_memory_ratio = peak per GPU at 2L over L; cp_mfu_ratio = MFU at 2L over L (MFU as in
    trainer_throughput.py, peak from the rates file).
(c) the planner (primerl_trainer.planner, rates of this GPU kind or --rates) for every run, with
    its relative error.
Every run's processes get PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (--alloc-conf): near
full memory the caching allocator otherwise retries (frees its cached blocks with cudaFree, a wait
for the whole device) several times a step, and under ep=2 the other rank waits that stall out in
its next all-to-all. Each run line says how many retries its timed steps had.

Outputs: stdout, and under $OUT (when set) parallel_throughput.json (every run and prediction),
parallel_throughput.txt (this stdout) or, with --calibrate, rates-<gpu>.toml.
Last line: RESULT ep_scaling=<x> cp_memory_ratio=<y> cp_mfu_ratio=<z> (--gpus N > 2: ep_scaling_N=... and so on)

Needs torch, transformers and, besides, what the trainer package imports: pydantic,
pydantic-settings, protobuf, googleapis-common-protos, grpcio, grpcio-status, numpy, safetensors
(the device image lacks the first two, googleapis-common-protos and grpcio-status: install them
from wheels first). Run from the repository's source tree: services/trainer/src and
libs/common/src are put on sys.path, and the two distributions' metadata is supplied when they
are not installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import gzip
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from parallel_ep_variants import AllToAllTimers, median_breakdown, parse_variant, report_variants, run_variants

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT") else None
# The wheels the trainer package needs beyond torch and transformers (module -> distribution).
NEEDED = {
    "pydantic": "pydantic",
    "pydantic_settings": "pydantic-settings",
    "google.protobuf": "protobuf",
    "google.rpc": "googleapis-common-protos",
    "grpc": "grpcio",
    "grpc_status": "grpcio-status",
    "numpy": "numpy",
    "safetensors": "safetensors",
    "transformers": "transformers",
}
MOE_EXPERTS_PER_GPU = 128
SMOKE_EXPERTS = 8  # top-8, as trainer_throughput.SMOKE
DENSE_LENGTHS = (32768, 49152, 65536, 98304, 131072, 196608, 262144)


def use_source_tree() -> None:
    """Import the trainer and common packages from this checkout, installed or not."""
    for src in (ROOT / "libs/common/src", ROOT / "services/trainer/src", ROOT / "bench"):
        if str(src) not in sys.path:
            sys.path.insert(0, str(src))
    missing = []
    for name in ("primerl-trainer", "primerl-common"):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    if missing:  # their __init__ reads __version__ from the distribution's metadata
        folder = pathlib.Path(tempfile.mkdtemp(prefix="primerl-metadata-"))
        for name in missing:
            info = folder / f"{name.replace('-', '_')}-0+source.dist-info"
            info.mkdir()
            (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0+source\n")
        sys.path.append(str(folder))
        importlib.invalidate_caches()


def check_modules() -> None:
    absent = [wheel for module, wheel in NEEDED.items() if importlib.util.find_spec(module.split(".")[0]) is None]
    absent += [wheel for module, wheel in NEEDED.items() if "." in module and not _has_submodule(module)]
    if absent:
        sys.exit(f"missing Python packages: {' '.join(sorted(set(absent)))} (pip install them, then run again)")
    try:  # generated stubs refuse a protobuf runtime older than the protoc that made them
        importlib.import_module("primerl.trainer.v1.trainer_pb2")
    except Exception as exc:
        sys.exit(f"the trainer's protobuf stubs do not load: {exc} (pip install a newer protobuf)")


def _has_submodule(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


# --- the runs -------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    name: str
    kind: str  # "moe" | "dense"
    num_experts: int = 0
    nproc: int = 1
    ep: int = 1
    cp: int = 1
    seq_len: int = 4096
    micro_batches: int = 8  # in the whole batch (each dp rank takes its share)
    accumulate_unsharded: bool = False  # ParallelConfig.accumulate_unsharded
    activation_checkpointing: bool = False
    dtype: str = "bfloat16"
    warmup: int = 2  # steps left out of the timing (compiling included)
    steps: int = 3  # timed steps
    # The dense one-GPU run: the seq_len to try, in order (the planner's pick, longer ones, then shorter
    # ones); it keeps the longest that fits.
    lengths: tuple[int, ...] = ()
    # Expert parallel: variants timed after the run's own steps (parallel_ep_variants).
    variants: tuple[str, ...] = ()
    # measured
    ok: bool = False
    error: str = ""
    device: str = ""
    step_s: float = float("nan")
    peak_bytes: float = float("nan")
    tokens_per_s_per_gpu: float = float("nan")
    mfu: float = float("nan")
    tried: dict[str, str] = dataclasses.field(default_factory=dict)
    a2a_ms: float = float("nan")  # per step, rank 0 (see parallel_ep_variants)
    a2a_calls: int = 0
    wait_ms: float = float("nan")
    alloc_retries: int = 0  # over the timed steps, rank 0
    variant_results: list[dict] = dataclasses.field(default_factory=list)
    # predicted
    predicted_step_s: float = float("nan")
    predicted_peak_bytes: float = float("nan")

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.micro_batches


def model_config(kind: str, num_experts: int, smoke: bool) -> dict[str, Any]:
    from trainer_throughput import CONFIGS, SMOKE

    config = dict(CONFIGS[kind])
    if smoke:
        config |= {key: value for key, value in SMOKE.items() if key in config}
    if kind == "moe":
        config["num_experts"] = num_experts
    return config


def checkpoint_name(kind: str, num_experts: int) -> str:
    return f"{kind}-{num_experts}"


def write_checkpoints(root: pathlib.Path, smoke: bool, only: list[str] | None = None, gpus: int = 2) -> None:
    """The bench's random checkpoints (Hugging Face format), as trainer_throughput.py writes them."""
    from trainer_throughput import write_checkpoint

    experts = SMOKE_EXPERTS if smoke else MOE_EXPERTS_PER_GPU
    for kind, num_experts in (("moe", experts), ("moe", gpus * experts), ("dense", 0)):
        if only and not any(name.startswith(kind) for name in only):
            continue
        start = time.perf_counter()
        write_checkpoint(
            model_config(kind, num_experts, smoke),
            root / checkpoint_name(kind, num_experts),
            "cpu" if smoke else "cuda",
        )
        print(
            f"checkpoint {checkpoint_name(kind, num_experts)} written in {time.perf_counter() - start:.0f} s",
            flush=True,
        )


def train_run(run: Run, checkpoint: pathlib.Path, *, device: str, compile: bool) -> None:
    """Trains `run` in this process (a rank of a torchrun, or a group of one) and fills its
    measured fields on rank 0."""
    import torch
    import torch.distributed as dist

    from primerl_trainer.batch import MicroBatch
    from primerl_trainer.config import TrainerConfig
    from primerl_trainer.runtime import build_runtime, shutdown_runtime

    too_long = None  # the shortest length that ran out of memory
    for length in run.lengths or (run.seq_len,):
        if too_long is not None and length >= too_long:
            continue
        if run.ok and length < run.seq_len:
            break
        config = TrainerConfig(
            model={
                "path": str(checkpoint),
                "impl": "custom",
                "dtype": run.dtype,
                "compute_dtype": "bfloat16",
                "activation_checkpointing": run.activation_checkpointing,
                "compile": compile,
            },
            parallel={"ep": run.ep, "cp": run.cp, "accumulate_unsharded": run.accumulate_unsharded},
            mode="sft",
            device=device,
            seq_len=length,
            optimizer={"lr": 1e-5, "weight_decay": 0.01},
        )
        vocab = json.loads((checkpoint / "config.json").read_text())["vocab_size"]
        generator = torch.Generator().manual_seed(0)
        batch = [
            MicroBatch(
                input_ids=torch.randint(0, vocab, (length,), generator=generator),
                position_ids=torch.arange(length),
                loss_mask=torch.arange(length) > 0,
                temperatures=torch.ones(length),
            )
            for _ in range(run.micro_batches)
        ]
        runtime = None
        try:
            runtime = build_runtime(config)
            dims = runtime.parallel_dims
            assert (dims.world_size, dims.ep, dims.cp) == (run.nproc, run.ep, run.cp), dims
            rank = runtime.rank
            timers = AllToAllTimers()
            if run.ep > 1:
                timers.install()
            times, peaks, breakdowns = [], [], []
            for step in range(run.warmup + run.steps):
                if step == run.warmup and PROFILE:
                    profile_step(runtime.trainer, batch, run.name, rank)
                timers.take()
                metrics = runtime.trainer.train_step(batch)
                breakdown = timers.take()
                if step >= run.warmup:
                    times.append(metrics["step_time_s"])
                    peaks.append(metrics["peak_memory_bytes"])
                    breakdowns.append(breakdown)
            breakdown = median_breakdown(breakdowns)
            run.alloc_retries = breakdown.alloc_retries
            if run.ep > 1:
                run.a2a_ms, run.a2a_calls, run.wait_ms = breakdown.a2a_ms, breakdown.a2a_calls, breakdown.wait_ms
            peak = torch.tensor([max(peaks)], dtype=torch.float64, device=runtime.device)
            if dist.get_world_size() > 1:
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            run.seq_len, run.step_s, run.peak_bytes = length, statistics.median(times), float(peak)
            run.tokens_per_s_per_gpu = run.tokens_per_step / run.step_s / run.nproc
            run.device = torch.cuda.get_device_name() if runtime.device.type == "cuda" else "cpu"
            run.ok, run.error = True, ""
            run.tried[str(length)] = "ok"
            if rank == 0:
                print(
                    f"  {run.name} seq {length}: {run.step_s * 1e3:.0f} ms/step, "
                    f"peak {run.peak_bytes / 2**30:.1f} GiB, allocator retries {run.alloc_retries} in {run.steps} steps"
                    + (
                        f", all-to-all {run.a2a_ms:.0f} ms in {run.a2a_calls} calls, host waits {run.wait_ms:.0f} ms"
                        if run.ep > 1
                        else ""
                    ),
                    flush=True,
                )
            if run.variants:
                run.variant_results = run_variants(
                    runtime.trainer, batch, list(run.variants), warmup=1, steps=run.steps, timers=timers
                )
                if rank == 0:
                    for variant in run.variant_results:
                        print(f"  {run.name} [{variant['name']}]: {variant['step_s'] * 1e3:.0f} ms/step", flush=True)
        except Exception as exc:
            if run.nproc > 1:  # the other rank waits in a collective: let torchrun stop both
                raise
            # Compiled code may wrap the allocator's error in its own.
            if not (isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()):
                run.tried[str(length)] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                run.error = "" if run.ok else run.tried[str(length)]
                break
            run.tried[str(length)] = "out of memory"
            print(f"  {run.name} seq {length}: out of memory", flush=True)
            too_long = length
            if run.ok:
                break
        finally:
            del batch
            if runtime is not None:
                shutdown_runtime(runtime)
            runtime = None
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()


# PRIMERL_BENCH_PROFILE=1: one step after the warm-up of every run is profiled (not timed) and rank 0
# prints its kernels by GPU time and its operators by CPU time (to $OUT/profile-<run>.txt when OUT is set).
PROFILE = os.environ.get("PRIMERL_BENCH_PROFILE") == "1"


def profile_step(trainer, batch, name: str, rank: int) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        trainer.train_step(batch)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    if rank != 0:
        return
    averages = prof.key_averages()
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name)
    timeline = ""
    if OUT is not None and torch.cuda.is_available():
        trace = OUT / f"trace-{slug}.json"
        prof.export_chrome_trace(str(trace))
        timeline = timeline_summary(json.loads(trace.read_text()))
        with trace.open("rb") as raw, gzip.open(f"{trace}.gz", "wb", compresslevel=6) as packed:
            shutil.copyfileobj(raw, packed)
        trace.unlink()
    text = "\n".join(
        [
            f"== {name}: GPU timeline of the profiled step (rank 0)",
            timeline,
            f"== {name}: by device time",
            averages.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90),
            f"== {name}: by CPU time",
            averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=90),
        ]
    )
    if OUT is not None:
        (OUT / f"profile-{slug}.txt").write_text(text)
        print(f"== {name}: GPU timeline of the profiled step (rank 0)\n{timeline}", flush=True)
    else:
        print(text, flush=True)


def timeline_summary(trace: dict) -> str:
    """From a chrome trace: the GPU's busy time (kernels, copies and sets, their union over
    streams), the NCCL kernels' share, the gaps where no GPU work runs (the largest with the
    work around them), and the host's blocking waits."""

    def union(spans: list[tuple[float, float]]) -> tuple[float, list[tuple[float, float]]]:
        total, merged = 0.0, []
        for start, end in sorted(spans):
            if merged and start <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], end))
            else:
                merged.append((start, end))
        for start, end in merged:
            total += end - start
        return total, merged

    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return "  (no GPU events)"
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in gpu]
    first, last = min(s for s, _ in spans), max(e for _, e in spans)
    busy, merged = union(spans)
    nccl, _ = union([(e["ts"], e["ts"] + e["dur"]) for e in gpu if "nccl" in e["name"].lower()])
    compute, _ = union([(e["ts"], e["ts"] + e["dur"]) for e in gpu if "nccl" not in e["name"].lower()])
    lines = [
        f"  span {(last - first) / 1e3:.1f} ms: GPU busy {busy / 1e3:.1f} ms (non-NCCL {compute / 1e3:.1f} ms, "
        f"NCCL kernels {nccl / 1e3:.1f} ms), idle {(last - first - busy) / 1e3:.1f} ms"
    ]
    by_stream: dict[Any, float] = {}
    for e in gpu:
        by_stream[e.get("tid")] = by_stream.get(e.get("tid"), 0.0) + e["dur"]
    lines.append(
        "  kernel time by stream: "
        + ", ".join(f"{k}: {v / 1e3:.1f} ms" for k, v in sorted(by_stream.items(), key=lambda kv: -kv[1]))
    )
    gaps = [(merged[i + 1][0] - merged[i][1], merged[i][1], merged[i + 1][0]) for i in range(len(merged) - 1)]
    for threshold in (10, 50, 200, 1000):
        big = [g for g in gaps if g[0] >= threshold]
        lines.append(f"  gaps >= {threshold} us: {len(big)}, {sum(g[0] for g in big) / 1e3:.1f} ms")
    ends = sorted(gpu, key=lambda e: e["ts"] + e["dur"])
    starts = sorted(gpu, key=lambda e: e["ts"])
    import bisect

    end_times = [e["ts"] + e["dur"] for e in ends]
    start_times = [e["ts"] for e in starts]
    lines.append("  largest gaps (us, at ms from the first GPU event: last work before -> first after):")
    for length, gap_start, gap_end in sorted(gaps, reverse=True)[:15]:
        before = ends[max(0, bisect.bisect_right(end_times, gap_start) - 1)]["name"][:60]
        after = starts[min(len(starts) - 1, bisect.bisect_left(start_times, gap_end))]["name"][:60]
        lines.append(f"    {length:8.0f} at {(gap_start - first) / 1e3:8.1f}: {before} -> {after}")
    # Host waits: runtime calls that block the host.
    waits: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and any(
            w in e["name"] for w in ("Synchronize", "cudaMemcpy", "cudaStreamWait")
        ):
            waits.setdefault(e["name"], []).append(e["dur"])
    for wait_name, durations in sorted(waits.items(), key=lambda kv: -sum(kv[1]))[:6]:
        total, largest = sum(durations) / 1e3, max(durations) / 1e3
        lines.append(f"  host {wait_name}: {len(durations)} calls, {total:.1f} ms, largest {largest:.2f} ms")
    return "\n".join(lines)


def launch(run: Run, checkpoint: pathlib.Path, args: argparse.Namespace) -> Run:
    """Runs `run` in a fresh process group (torchrun over run.nproc ranks, or one process)."""
    result = pathlib.Path(tempfile.mkstemp(prefix=f"{run.name}-", suffix=".json")[1])
    worker = [
        __file__,
        "--worker",
        json.dumps(dataclasses.asdict(run)),
        "--checkpoint",
        str(checkpoint),
        "--result",
        str(result),
    ]
    worker += ["--smoke"] if args.smoke else []
    worker += ["--no-compile"] if args.no_compile else []
    if run.nproc > 1:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={run.nproc}"]
        command += worker
    else:
        command = [sys.executable, *worker]
    env = os.environ | ({"PYTORCH_CUDA_ALLOC_CONF": args.alloc_conf} if args.alloc_conf else {})
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)
        assert process.stdout is not None
        for line in process.stdout:  # through this process's stdout (and $OUT's copy)
            print(line, end="", flush=True)
        returncode = process.wait()
        stderr.seek(0)
        errors = stderr.read()
    text = result.read_text()
    result.unlink()
    if returncode != 0 or not text:
        lines = [line.strip() for line in errors.splitlines() if line.strip()]
        raised = [line for line in lines if re.match(r"(\[rank\d+\]: )?\w+(Error|Exception)\b", line)]
        run.error = f"worker exited {returncode}: {(raised or lines or ['no output'])[-1][:300]}"
        print(errors[-4000:], file=sys.stderr)
        return run
    return Run(**json.loads(text))


def worker_main(args: argparse.Namespace) -> None:
    data = json.loads(args.worker)
    data["lengths"] = tuple(data["lengths"])
    data["variants"] = tuple(data["variants"])
    run = Run(**data)
    train_run(
        run,
        pathlib.Path(args.checkpoint),
        device="cpu" if args.smoke else "cuda",
        compile=not (args.no_compile or args.smoke),
    )
    if int(os.environ.get("RANK", "0")) == 0:
        pathlib.Path(args.result).write_text(json.dumps(dataclasses.asdict(run)))


# --- the planner's side ---------------------------------------------------------------------------


def load_planner_rates(args: argparse.Namespace, device_name: str):
    from primerl_trainer.planner.rates import load_rates

    if args.rates:
        return load_rates(args.rates)
    return load_rates("h100" if "H100" in device_name else "h200")


def predict(run: Run, rates, smoke: bool) -> None:
    if not run.ok:
        return
    from primerl_trainer.planner import estimate_memory, estimate_step_time, model_flops_per_token

    shape, mesh, workload = planner_inputs(run, smoke)
    run.predicted_step_s = estimate_step_time(shape, mesh, workload, rates).total
    run.predicted_peak_bytes = estimate_memory(shape, mesh, workload, rates).total
    run.mfu = model_flops_per_token(shape, run.seq_len) * run.tokens_per_s_per_gpu / (rates.peak_tflops * 1e12)


def planner_inputs(run: Run, smoke: bool):
    from primerl_trainer.planner import Mesh, Workload, shape_from_hf_config

    shape = shape_from_hf_config(model_config(run.kind, run.num_experts, smoke), name=run.name)
    mesh = Mesh(world=run.nproc, ep=run.ep, cp=run.cp)
    workload = Workload(
        seq_len=run.seq_len,
        tokens_per_step=run.tokens_per_step,
        master_bytes=4 if run.dtype == "float32" else 2,
        activation_checkpointing=run.activation_checkpointing,
        accumulate_unsharded=run.accumulate_unsharded,
    )
    return shape, mesh, workload


def ep_fit(ep_run: Run, one_gpu: Run, rates, smoke: bool) -> str:
    """The planner's fitted expert-parallel terms as this run implies them (planner.rates StepFit,
    LinkRates.all_to_all_call_s): the per-call cost from the measured all-to-all time less its
    bytes, then the per-layer term (per doubling of the ranks) that makes the predicted ep=N / 1 GPU step ratio
    the measured one."""
    from primerl_trainer.planner import estimate_step_time

    shape, mesh, workload = planner_inputs(ep_run, smoke)
    unfitted = dataclasses.replace(
        rates,
        intra_node=dataclasses.replace(rates.intra_node, all_to_all_call_s=0.0),
        fit=dataclasses.replace(rates.fit, ep_layer_s=0.0),
    )
    bytes_s = estimate_step_time(shape, mesh, workload, unfitted).ep
    if not ep_run.a2a_calls:
        return "planner fit: no all-to-all calls timed"
    call_s = max(0.0, ep_run.a2a_ms / 1e3 - bytes_s) / ep_run.a2a_calls
    with_calls = dataclasses.replace(
        unfitted, intra_node=dataclasses.replace(rates.intra_node, all_to_all_call_s=call_s)
    )
    target = one_gpu.predicted_step_s * ep_run.step_s / one_gpu.step_s
    layer_forwards = (
        shape.num_moe_layers
        * workload.micro_batches_per_rank(mesh)
        * (2 if workload.activation_checkpointing else 1)
        * math.log2(mesh.ep)  # the term is per doubling of the ranks
    )
    layer_s = (target - estimate_step_time(shape, mesh, workload, with_calls).total) / layer_forwards
    return (
        f"planner fit from this run: all_to_all_call_s = {call_s:.3g} "
        f"(rates: {rates.intra_node.all_to_all_call_s:.3g}), ep_layer_s = {layer_s:.3g} "
        f"(rates: {rates.fit.ep_layer_s:.3g}); all-to-all bytes {bytes_s * 1e3:.0f} ms a step"
    )


def dense_lengths_to_try(rates, smoke: bool, dtype: str) -> tuple[int, ...]:
    """From the longest length the planner expects to fit one GPU (with a 10% margin) upwards,
    then downwards."""
    if smoke:
        return (256,)
    from primerl_trainer.planner import Mesh, Workload, estimate_memory, shape_from_hf_config

    shape = shape_from_hf_config(model_config("dense", 0, smoke))
    master = 4 if dtype == "float32" else 2
    fitting = [
        length
        for length in DENSE_LENGTHS
        if estimate_memory(
            shape,
            Mesh(world=1),
            Workload(seq_len=length, tokens_per_step=length, master_bytes=master, activation_checkpointing=True),
            rates,
        ).total
        <= 0.9 * rates.usable_bytes
    ]
    start = DENSE_LENGTHS.index(fitting[-1]) if fitting else 0
    return DENSE_LENGTHS[start:] + DENSE_LENGTHS[:start][::-1]


def relative_error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def run_names(gpus: int) -> tuple[str, str]:
    """The names of the expert-parallel and the context-parallel run over `gpus` GPUs."""
    return f"moe ep={gpus}", f"dense {gpus}L cp={gpus}"


def bench_main(args: argparse.Namespace) -> None:
    smoke, gpus = args.smoke, args.gpus
    ep_name, cp_name = run_names(gpus)
    experts = SMOKE_EXPERTS if smoke else MOE_EXPERTS_PER_GPU
    moe_seq = 128 if smoke else 4096
    rates = load_planner_rates(args, "" if smoke else _device_name())
    runs = [
        Run("moe 1 GPU", "moe", num_experts=experts, seq_len=moe_seq, micro_batches=8),
        Run(
            ep_name,
            "moe",
            num_experts=gpus * experts,
            nproc=gpus,
            ep=gpus,
            seq_len=moe_seq,
            micro_batches=8 * gpus,
            accumulate_unsharded=not args.ep_reshard,
            variants=tuple(args.ep_variants or ()),
        ),
        Run(
            "dense L",
            "dense",
            seq_len=0,
            micro_batches=1,
            activation_checkpointing=True,
            dtype=args.dense_dtype,
            lengths=dense_lengths_to_try(rates, smoke, args.dense_dtype),
            warmup=1,
            steps=2,
        ),
    ]
    for name in args.ep_variants or ():
        parse_variant(name)
    if args.dense_seq:  # tried in order; the longest that fits is kept
        runs[2].lengths = tuple(args.dense_seq)
    for run in runs:
        run.warmup = run.warmup if args.warmup is None else args.warmup
        run.steps = run.steps if args.steps is None else args.steps
    print(f"planner rates: {rates.gpu} ({rates.source})", flush=True)
    print(f"PYTORCH_CUDA_ALLOC_CONF of every run: {args.alloc_conf or os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}")
    shm = pathlib.Path("/dev/shm")
    tmp_root = shm if shm.is_dir() and shutil.disk_usage(shm).free > 60 * 2**30 else None
    with tempfile.TemporaryDirectory(prefix="parallel-throughput-", dir=tmp_root) as tmp:
        root = pathlib.Path(tmp)
        # In a child: this process keeps no CUDA context on the first GPU.
        subprocess.run(
            [sys.executable, __file__, "--write-checkpoints", str(root)]
            + (["--smoke"] if smoke else [])
            + (["--only", *args.only] if args.only else [])
            + ["--gpus", str(gpus)],
            check=True,
        )
        for index, run in enumerate(runs):
            if args.only and run.name not in args.only and not (index == 2 and cp_name in args.only):
                continue
            print(f"{run.name}: {run.nproc} process(es)", flush=True)
            runs[index] = launch(run, root / checkpoint_name(run.kind, run.num_experts), args)
        dense = runs[2]
        if dense.ok:
            cp_run = Run(
                cp_name,
                "dense",
                nproc=gpus,
                cp=gpus,
                seq_len=gpus * dense.seq_len,
                micro_batches=1,
                activation_checkpointing=True,
                dtype=args.dense_dtype,
                warmup=dense.warmup,
                steps=dense.steps,
            )
            print(f"{cp_run.name}: seq {cp_run.seq_len}", flush=True)
            runs.append(launch(cp_run, root / checkpoint_name("dense", 0), args))
    for run in runs:
        predict(run, rates, smoke)
    report(runs, rates, smoke, gpus)


def predict_main(args: argparse.Namespace) -> None:
    """--predict-from: the planner's predictions and the report again, for the runs a bench run saved
    ($OUT/parallel_throughput.json), with --rates or the rates of their GPU kind: no GPU needed."""
    data = json.loads(args.predict_from.read_text())
    runs = []
    for entry in data["runs"]:
        entry["lengths"], entry["variants"] = tuple(entry["lengths"]), tuple(entry["variants"])
        runs.append(Run(**entry))
    device = next((run.device for run in runs if run.device), "")
    rates = load_planner_rates(args, device)
    print(f"planner rates: {rates.gpu} ({rates.source})")
    print(f"runs: measured on {device or 'cpu'}, read from {args.predict_from}")
    for run in runs:
        predict(run, rates, args.smoke)
    report(runs, rates, args.smoke, max(run.nproc for run in runs))


def _device_name() -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"], capture_output=True, text=True
    )
    return out.stdout.strip()


def report(runs: list[Run], rates, smoke: bool, gpus: int) -> None:
    print()
    print(
        f"{'run':<15} {'GPUs':>4} {'seq':>7} {'tokens/step':>11} {'step ms':>8} {'tok/s/GPU':>9} {'MFU':>6} "
        f"{'peak GiB':>8} | {'pred ms':>8} {'err':>6} {'pred GiB':>8} {'err':>6}"
    )
    time_errors, memory_errors = [], []
    for run in runs:
        if not run.ok:
            print(f"{run.name:<15} ERROR {run.error} {run.tried or ''}")
            continue
        time_err = relative_error(run.predicted_step_s, run.step_s)
        memory_err = relative_error(run.predicted_peak_bytes, run.peak_bytes)
        time_errors.append(time_err)
        memory_errors.append(memory_err)
        print(
            f"{run.name:<15} {run.nproc:>4} {run.seq_len:>7} {run.tokens_per_step:>11} {run.step_s * 1e3:>8.0f} "
            f"{run.tokens_per_s_per_gpu:>9.0f} {run.mfu:>6.1%} {run.peak_bytes / 2**30:>8.1f} | "
            f"{run.predicted_step_s * 1e3:>8.0f} {time_err:>+6.1%} {run.predicted_peak_bytes / 2**30:>8.1f} "
            f"{memory_err:>+6.1%}"
        )
    by_name = {run.name: run for run in runs if run.ok}

    def ratio(name: str, other: str, field: str) -> float:
        if name not in by_name or other not in by_name:
            return float("nan")
        return getattr(by_name[name], field) / getattr(by_name[other], field)

    ep_name, cp_name = run_names(gpus)
    ep_scaling = ratio(ep_name, "moe 1 GPU", "tokens_per_s_per_gpu")
    if ep_name in by_name and "moe 1 GPU" in by_name:
        ep_run = by_name[ep_name]
        report_variants(
            ep_run.variant_results,
            tokens_per_step=ep_run.tokens_per_step,
            nproc=ep_run.nproc,
            baseline_tokens_per_s=by_name["moe 1 GPU"].tokens_per_s_per_gpu,
        )
        if ep_run.predicted_step_s == ep_run.predicted_step_s:  # predicted (not NaN)
            print(ep_fit(ep_run, by_name["moe 1 GPU"], rates, smoke))
    cp_memory = ratio(cp_name, "dense L", "peak_bytes")
    cp_mfu = ratio(cp_name, "dense L", "mfu")
    if OUT is not None:
        (OUT / "parallel_throughput.json").write_text(
            json.dumps({"rates": rates.gpu, "runs": [dataclasses.asdict(run) for run in runs]}, indent=1)
        )
    worst_time = max(time_errors, key=abs, default=float("nan"))
    worst_memory = max(memory_errors, key=abs, default=float("nan"))
    print(
        f"\nplanner ({rates.gpu} rates): largest step-time error {worst_time:+.1%}, largest peak-memory error "
        f"{worst_memory:+.1%} (goal: within 15%)"
    )
    print(f"planner_time_err={worst_time:.3f} planner_mem_err={worst_memory:.3f}")
    suffix = "" if gpus == 2 else f"_{gpus}"  # 2 GPUs: issue 16's keys; 4 and 8: issue 26's
    print(
        f"RESULT ep_scaling{suffix}={ep_scaling:.3f} cp_memory_ratio{suffix}={cp_memory:.3f} "
        f"cp_mfu_ratio{suffix}={cp_mfu:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calibrate", action="store_true", help="measure the planner's per-kernel rates instead")
    parser.add_argument("--calibrate-gpus", type=int, default=2, help="GPUs the collectives are measured over")
    parser.add_argument("--rates", type=pathlib.Path, help="the planner's rates file (default: the GPU kind's)")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU with gloo: checks the script")
    parser.add_argument("--no-compile", action="store_true", help="train uncompiled")
    parser.add_argument(
        "--dense-dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="master weights of the dense runs (the trainer's default: float32)",
    )
    parser.add_argument("--warmup", type=int, help="steps left out of the timing (default: MoE 2, dense 1)")
    parser.add_argument("--steps", type=int, help="timed steps, whose median counts (default: MoE 3, dense 2)")
    parser.add_argument(
        "--gpus", type=int, choices=(2, 4, 8), default=2, help="GPUs of the expert- and context-parallel runs"
    )
    parser.add_argument("--only", nargs="+", help="run only these runs (by name; 'dense NL cp=N' needs 'dense L')")
    parser.add_argument(
        "--dense-seq",
        type=int,
        nargs="+",
        help="L of the dense runs, or lengths to try in order, keeping the longest that fits (default: the "
        "planner's pick, then longer ones until one runs out of memory, then shorter ones)",
    )
    parser.add_argument(
        "--ep-variants",
        nargs="+",
        help="also time these variants of the ep=2 run in its processes (parallel_ep_variants.py), e.g. "
        "unsharded packed+unsharded",
    )
    parser.add_argument(
        "--ep-reshard",
        action="store_true",
        help="the ep=2 run without parallel.accumulate_unsharded (FSDP reshards and reduces every micro-batch)",
    )
    parser.add_argument(
        "--alloc-conf",
        default="expandable_segments:True",
        help="PYTORCH_CUDA_ALLOC_CONF of every run ('' keeps the environment's): expandable segments spare the "
        "caching allocator its retries (cudaFree of cached blocks, a device-wide wait) when memory runs near full",
    )
    parser.add_argument(
        "--predict-from",
        type=pathlib.Path,
        help="no runs: the planner's predictions and the report for the runs of a saved parallel_throughput.json",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--write-checkpoints", help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_source_tree()
    check_modules()
    if args.worker:
        worker_main(args)
    elif args.write_checkpoints:
        write_checkpoints(pathlib.Path(args.write_checkpoints), args.smoke, args.only, args.gpus)
    elif args.predict_from:
        predict_main(args)
    elif args.calibrate:
        from parallel_calibrate import calibrate_main

        calibrate_main(args)
    else:
        if OUT is not None:
            sys.stdout = _Tee(sys.stdout, (OUT / "parallel_throughput.txt").open("w"))
        bench_main(args)


class _Tee(io.TextIOBase):
    def __init__(self, *streams) -> None:
        self._streams = streams

    def write(self, text: str) -> int:
        for stream in self._streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self._streams:
            stream.flush()


if __name__ == "__main__":
    main()
