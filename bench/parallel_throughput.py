"""Expert and context parallel on two GPUs against one, side by side with the capacity planner's
predictions; and (--calibrate) the per-kernel rates the planner uses.

    python3 bench/parallel_throughput.py              # the comparison (~6 min on 2 H100)
    python3 bench/parallel_throughput.py --calibrate  # a rates file for this GPU (~3 min)
    python3 bench/parallel_throughput.py --smoke      # tiny shapes, CPU, gloo: checks the script

Launch it once, with plain python3 from the repository root: it starts its own workers (a
process per one-GPU run, torchrun over two ranks for the two-GPU runs) and collects their results.
Every run trains as the trainer does: `runtime.build_runtime` from a TrainerConfig (FSDP2 over
every rank, the `parallel` mesh, compiled blocks, AdamW) and `Trainer.train_step` on packed SFT
micro-batches (the logits loss path); times and peak memory are the step metrics' (medians of
the timed steps; peak: the largest over ranks).

(a) expert parallel: the MoE shape of bench/trainer_throughput.py with 256 experts at ep=2 on two
    GPUs against 128 experts on one (the same experts per GPU: the difference is the dispatch and
    combine), 8 micro-batches of 4096 tokens per GPU per step, bf16 weights and AdamW state.
    ep_scaling = per-GPU tokens/s at ep=2 over one GPU's.
(b) context parallel: the dense shape of trainer_throughput.py with activation checkpointing and
    float32 master weights (the trainer's default; --dense-dtype), one sequence of L tokens on one
    GPU (L the longest that fits, at least 32,768: the planner's memory model picks the first
    length to try, then longer until one runs out of memory) against one of 2L tokens at cp=2.
    cp_memory_ratio = peak per GPU at 2L over L; cp_mfu_ratio = MFU at 2L over L (MFU as in
    trainer_throughput.py, peak from the rates file).
(c) the planner (primerl_trainer.planner, rates of this GPU kind or --rates) for every run, with
    its relative error.

Outputs: stdout, and under $OUT (when set) parallel_throughput.json (every run and prediction),
parallel_throughput.txt (this stdout) or, with --calibrate, rates-<gpu>.toml.
Last line: RESULT ep_scaling=<x> cp_memory_ratio=<y> cp_mfu_ratio=<z>

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
import datetime
import gc
import importlib.metadata
import importlib.util
import io
import json
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
    activation_checkpointing: bool = False
    dtype: str = "bfloat16"
    warmup: int = 2  # steps left out of the timing (compiling included)
    steps: int = 3  # timed steps
    # The dense one-GPU run: the seq_len to try, in order (the planner's pick, longer ones, then shorter
    # ones); it keeps the longest that fits.
    lengths: tuple[int, ...] = ()
    # measured
    ok: bool = False
    error: str = ""
    device: str = ""
    step_s: float = float("nan")
    peak_bytes: float = float("nan")
    tokens_per_s_per_gpu: float = float("nan")
    mfu: float = float("nan")
    tried: dict[str, str] = dataclasses.field(default_factory=dict)
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


def write_checkpoints(root: pathlib.Path, smoke: bool, only: list[str] | None = None) -> None:
    """The bench's random checkpoints (Hugging Face format), as trainer_throughput.py writes them."""
    from trainer_throughput import write_checkpoint

    experts = SMOKE_EXPERTS if smoke else MOE_EXPERTS_PER_GPU
    for kind, num_experts in (("moe", experts), ("moe", 2 * experts), ("dense", 0)):
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
            parallel={"ep": run.ep, "cp": run.cp},
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
            times, peaks = [], []
            for step in range(run.warmup + run.steps):
                if step == run.warmup and PROFILE:
                    profile_step(runtime.trainer, batch, run.name, rank)
                metrics = runtime.trainer.train_step(batch)
                if step >= run.warmup:
                    times.append(metrics["step_time_s"])
                    peaks.append(metrics["peak_memory_bytes"])
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
                    f"  {run.name} seq {length}: {run.step_s * 1e3:.0f} ms/step, peak {run.peak_bytes / 2**30:.1f} GiB",
                    flush=True,
                )
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
    text = "\n".join(
        [
            f"== {name}: by device time",
            averages.table(sort_by="self_device_time_total", row_limit=40, max_name_column_width=90),
            f"== {name}: by CPU time",
            averages.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=90),
        ]
    )
    if OUT is not None:
        (OUT / f"profile-{re.sub(r'[^A-Za-z0-9]+', '-', name)}.txt").write_text(text)
    else:
        print(text, flush=True)


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
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
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
    from primerl_trainer.planner import (
        Mesh,
        Workload,
        estimate_memory,
        estimate_step_time,
        model_flops_per_token,
        shape_from_hf_config,
    )

    shape = shape_from_hf_config(model_config(run.kind, run.num_experts, smoke), name=run.name)
    mesh = Mesh(world=run.nproc, ep=run.ep, cp=run.cp)
    workload = Workload(
        seq_len=run.seq_len,
        tokens_per_step=run.tokens_per_step,
        master_bytes=4 if run.dtype == "float32" else 2,
        activation_checkpointing=run.activation_checkpointing,
    )
    run.predicted_step_s = estimate_step_time(shape, mesh, workload, rates).total
    run.predicted_peak_bytes = estimate_memory(shape, mesh, workload, rates).total
    run.mfu = model_flops_per_token(shape, run.seq_len) * run.tokens_per_s_per_gpu / (rates.peak_tflops * 1e12)


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


def bench_main(args: argparse.Namespace) -> None:
    smoke = args.smoke
    experts = SMOKE_EXPERTS if smoke else MOE_EXPERTS_PER_GPU
    moe_seq = 128 if smoke else 4096
    rates = load_planner_rates(args, "" if smoke else _device_name())
    runs = [
        Run("moe 1 GPU", "moe", num_experts=experts, seq_len=moe_seq, micro_batches=8),
        Run("moe ep=2", "moe", num_experts=2 * experts, nproc=2, ep=2, seq_len=moe_seq, micro_batches=16),
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
    if args.dense_seq:
        runs[2].lengths = (args.dense_seq,)
    for run in runs:
        run.warmup = run.warmup if args.warmup is None else args.warmup
        run.steps = run.steps if args.steps is None else args.steps
    print(f"planner rates: {rates.gpu} ({rates.source})", flush=True)
    shm = pathlib.Path("/dev/shm")
    tmp_root = shm if shm.is_dir() and shutil.disk_usage(shm).free > 60 * 2**30 else None
    with tempfile.TemporaryDirectory(prefix="parallel-throughput-", dir=tmp_root) as tmp:
        root = pathlib.Path(tmp)
        # In a child: this process keeps no CUDA context on the first GPU.
        subprocess.run(
            [sys.executable, __file__, "--write-checkpoints", str(root)]
            + (["--smoke"] if smoke else [])
            + (["--only", *args.only] if args.only else []),
            check=True,
        )
        for index, run in enumerate(runs):
            if args.only and run.name not in args.only and not (index == 2 and "dense 2L cp=2" in args.only):
                continue
            print(f"{run.name}: {run.nproc} process(es)", flush=True)
            runs[index] = launch(run, root / checkpoint_name(run.kind, run.num_experts), args)
        dense = runs[2]
        if dense.ok:
            cp_run = Run(
                "dense 2L cp=2",
                "dense",
                nproc=2,
                cp=2,
                seq_len=2 * dense.seq_len,
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
    report(runs, rates)


def _device_name() -> str:
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name())"], capture_output=True, text=True
    )
    return out.stdout.strip()


def report(runs: list[Run], rates) -> None:
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

    ep_scaling = ratio("moe ep=2", "moe 1 GPU", "tokens_per_s_per_gpu")
    cp_memory = ratio("dense 2L cp=2", "dense L", "peak_bytes")
    cp_mfu = ratio("dense 2L cp=2", "dense L", "mfu")
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
    print(f"RESULT ep_scaling={ep_scaling:.3f} cp_memory_ratio={cp_memory:.3f} cp_mfu_ratio={cp_mfu:.3f}")


# --- calibration ------------------------------------------------------------------------------------


def _timed_ms(fn, *, repeats: int, device: str) -> float:
    import torch

    for _ in range(3):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        events = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def calibrate_worker(args: argparse.Namespace) -> None:
    """Under torchrun: kernel rates on rank 0, collectives over all ranks; rank 0 prints the file."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("gloo" if smoke else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16
    scale = 16 if smoke else 1  # smoke: the same shapes divided by this
    repeats = 3 if smoke else 20
    lines: dict[str, Any] = {}
    if rank == 0:
        name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
        total_gib = torch.cuda.mem_get_info()[1] / 2**30 if device == "cuda" else 0.0
        lines["device"] = (name, total_gib)
        copy_bytes = 2**31 // scale**2
        src = torch.empty(copy_bytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        lines["hbm"] = 2 * copy_bytes / _timed_ms(lambda: dst.copy_(src), repeats=repeats, device=device) / 1e6
        del src, dst
        matmul = []
        for m, k, n in (
            (8192, 8192, 8192),
            (4096, 2048, 6144),
            (4096, 2048, 12288),
            (4096, 6144, 2048),
            (4096, 2048, 151936),
            (16384, 7168, 7168),
            (16384, 2048, 7168),
        ):
            a = torch.randn(m // scale, k // scale, device=device, dtype=dtype)
            b = torch.randn(k // scale, n // scale, device=device, dtype=dtype)
            ms = _timed_ms(lambda a=a, b=b: a @ b, repeats=repeats, device=device)
            matmul.append((m, k, n, 2 * (m * k * n / scale**3) / ms / 1e9))
        lines["matmul"] = matmul
        grouped = []
        if hasattr(torch, "_grouped_mm") and not smoke:
            for rows, k, n in (
                (256, 2048, 1536),
                (256, 768, 2048),
                (1024, 2048, 1536),
                (1024, 768, 2048),
                (2048, 7168, 4096),
                (2048, 2048, 7168),
            ):
                experts = 16
                x = torch.randn(rows * experts, k, device=device, dtype=dtype)
                w = torch.randn(experts, n, k, device=device, dtype=dtype)
                offs = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * rows
                ms = _timed_ms(
                    lambda x=x, w=w, o=offs: torch._grouped_mm(x, w.transpose(-2, -1), offs=o),
                    repeats=repeats,
                    device=device,
                )
                grouped.append((rows, k, n, 2 * rows * experts * k * n / ms / 1e9))
        lines["grouped_mm"] = grouped
        attention = []
        for seq in (4096, 16384, 32768, 65536):
            heads, head_dim, s = 16, 128, seq // scale**2
            q, k, v = (
                torch.randn(1, heads, s, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
            )
            grad = torch.randn(1, heads, s, head_dim, device=device, dtype=dtype)
            fwd_ms = _timed_ms(
                lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                repeats=repeats,
                device=device,
            )

            def step(q=q, k=k, v=v, grad=grad) -> None:
                F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

            total_ms = _timed_ms(step, repeats=repeats, device=device)
            flops = 2 * heads * 2 * head_dim * s**2 / 2
            attention.append((seq, head_dim, flops / fwd_ms / 1e9, 2.5 * flops / max(total_ms - fwd_ms, 1e-6) / 1e9))
        lines["attention"] = attention
        lines["activations"] = measure_activation_factors(device, smoke)
    collectives = {}
    if world > 1:
        numel = (256 * 2**20 // 2) // scale**2  # bf16 elements of 256 MiB
        full = torch.empty(numel, dtype=dtype, device=device)
        shard = torch.empty(numel // world, dtype=dtype, device=device)
        full32 = torch.empty(numel, dtype=torch.float32, device=device)
        shard32 = torch.empty(numel // world, dtype=torch.float32, device=device)
        out = torch.empty_like(full)
        # torch 2.13 renames it (the device's 2.11 has only the old name).
        reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        busbw = lambda nbytes, ms: nbytes * (world - 1) / world / ms / 1e6  # noqa: E731
        r = 3 if smoke else 10
        collectives["all_gather"] = busbw(
            full.nbytes, _timed_ms(lambda: dist.all_gather_into_tensor(full, shard), repeats=r, device=device)
        )
        collectives["reduce_scatter"] = busbw(
            full32.nbytes, _timed_ms(lambda: reduce_scatter(shard32, full32), repeats=r, device=device)
        )
        collectives["all_to_all"] = busbw(
            full.nbytes, _timed_ms(lambda: dist.all_to_all_single(out, full), repeats=r, device=device)
        )
    if rank == 0:
        text = rates_toml(lines, collectives, world)
        print(text, flush=True)
        check_rates_file(text)
        gpu = "h100" if "H100" in lines["device"][0] else "h200" if "H200" in lines["device"][0] else "gpu"
        if OUT is not None:
            (OUT / f"rates-{gpu}.toml").write_text(text)
    dist.barrier()
    dist.destroy_process_group()


def measure_activation_factors(device: str, smoke: bool) -> dict[str, float]:
    """Bytes autograd keeps after a forward of the trainer's compiled blocks, over the planner's
    count (planner.memory.layer_activation_elements), for the bench's dense and MoE shapes."""
    import torch

    from primerl_trainer.models.registry import MODEL_SPECS
    from primerl_trainer.planner import shape_from_hf_config
    from primerl_trainer.planner.memory import layer_activation_elements

    factors = {}
    tokens = 256 if smoke else 4096
    for kind in ("dense", "moe"):
        config = model_config(kind, SMOKE_EXPERTS if smoke else MOE_EXPERTS_PER_GPU, smoke) | {"num_hidden_layers": 2}
        spec = MODEL_SPECS[config["model_type"]]
        with torch.device("meta"):
            model = spec.model_cls(spec.args_cls.from_hf_config(config))
        model = model.to_empty(device=device).to(torch.bfloat16)
        for param in model.parameters():
            torch.nn.init.normal_(param, std=0.02)
        model = spec.parallelize_fn(model, compile=not smoke)
        input_ids = torch.randint(0, config["vocab_size"], (1, tokens), device=device)
        for _ in range(2):  # compile, then measure
            if device == "cuda":
                torch.cuda.synchronize()
            before = torch.cuda.memory_allocated() if device == "cuda" else 0
            out = model(input_ids, compute_logits=False)
            hidden = out.hidden_states[0]
            after = torch.cuda.memory_allocated() if device == "cuda" else 0
            hidden.float().sum().backward()
        del out, hidden
        shape = shape_from_hf_config(config)
        counted = layer_activation_elements(shape, moe=kind == "moe") * 2 * tokens * config["num_hidden_layers"]
        saved = after - before - tokens * config["hidden_size"] * 2
        factors[kind] = saved / counted if device == "cuda" else 1.0
        del model
        gc.collect()
    return factors


def rates_toml(lines: dict[str, Any], collectives: dict[str, float], world: int) -> str:
    from primerl_trainer.planner.rates import load_rates

    name, total_gib = lines["device"]
    gpu = "h100" if "H100" in name else "h200"
    known = load_rates(gpu)  # what cannot be measured on one node is kept from the shipped file
    today = datetime.date.today().isoformat()
    where = f"bench/parallel_throughput.py --calibrate on {name}, {today}"
    out = io.StringIO()
    w = out.write
    w(f"# Per-kernel rates of one {name}, for primerl-trainer plan. Measured by {where}.\n")
    w(f'gpu = "{name}"\nsource = "{where}"\n')
    w(f"memory_gib = {total_gib:.1f}\nreserved_gib = {known.reserved_gib}\ngpus_per_node = {known.gpus_per_node}\n\n")
    w(f'[hbm]\ngbps = {lines["hbm"]:.0f}\nsource = "device-to-device copy, read + write: {where}"\n\n')
    w(f'[matmul]\nsource = "bf16 a @ b: {where}"\nshapes = [\n')
    for m, k, n, tflops in lines["matmul"]:
        w(f"  {{ m = {m}, k = {k}, n = {n}, tflops = {tflops:.0f} }},\n")
    w("]\n\n")
    grouped = lines["grouped_mm"] or [(r, k, n, t) for r, k, n, t in known.grouped_mm]
    source = f"torch._grouped_mm, 16 experts, bf16: {where}" if lines["grouped_mm"] else "kept: not measured"
    w(f'[grouped_mm]\nsource = "{source}"\nshapes = [\n')
    for rows, k, n, tflops in grouped:
        w(f"  {{ rows_per_expert = {rows}, k = {k}, n = {n}, tflops = {tflops:.0f} }},\n")
    w("]\n\n")
    w(f'[attention]\nsource = "SDPA causal (flash), 16 heads, bf16, fwd and bwd: {where}"\nshapes = [\n')
    for seq, head_dim, fwd, bwd in lines["attention"]:
        w(f"  {{ seq_len = {seq}, head_dim = {head_dim}, fwd_tflops = {fwd:.0f}, bwd_tflops = {bwd:.0f} }},\n")
    w("]\n\n")
    if collectives:
        w(f'[intra_node]\nsource = "NCCL busbw over {world} GPUs of one host, 256 MiB: {where}"\n')
        w(
            f"all_gather_gbps = {collectives['all_gather']:.0f}\nreduce_scatter_gbps = "
            f"{collectives['reduce_scatter']:.0f}\nall_to_all_gbps = {collectives['all_to_all']:.0f}\n\n"
        )
    else:
        link = known.intra_node
        w(
            f'[intra_node]\nsource = "kept: {link.source}"\nall_gather_gbps = {link.all_gather_gbps:.0f}\n'
            f"reduce_scatter_gbps = {link.reduce_scatter_gbps:.0f}\nall_to_all_gbps = {link.all_to_all_gbps:.0f}\n\n"
        )
    link = known.inter_node
    w(
        f'[inter_node]\nsource = "kept (one node measures no network): {link.source}"\n'
        f"all_gather_gbps = {link.all_gather_gbps:.0f}\nreduce_scatter_gbps = {link.reduce_scatter_gbps:.0f}\n"
        f"all_to_all_gbps = {link.all_to_all_gbps:.0f}\n\n"
    )
    factors = lines["activations"]
    w(
        f'[activations]\nsource = "saved bytes of compiled blocks at 4096 tokens over the planner\'s count: {where}"\n'
        f"factor_dense = {factors['dense']:.3f}\nfactor_moe = {factors['moe']:.3f}\n"
    )
    return out.getvalue()


def check_rates_file(text: str) -> None:
    """The planner reads what calibration prints."""
    from primerl_trainer.planner.rates import load_rates

    with tempfile.NamedTemporaryFile("w", suffix=".toml") as file:
        file.write(text)
        file.flush()
        load_rates(file.name)


def calibrate_main(args: argparse.Namespace) -> None:
    nproc = 2 if args.smoke else args.calibrate_gpus
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        __file__,
        "--calibrate-worker",
    ] + (["--smoke"] if args.smoke else [])
    subprocess.run(command, check=True)


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
    parser.add_argument("--only", nargs="+", help="run only these runs (by name; 'dense 2L cp=2' needs 'dense L')")
    parser.add_argument("--dense-seq", type=int, help="L of the dense runs (default: the longest that fits)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--write-checkpoints", help=argparse.SUPPRESS)
    parser.add_argument("--calibrate-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    use_source_tree()
    check_modules()
    if args.worker:
        worker_main(args)
    elif args.write_checkpoints:
        write_checkpoints(pathlib.Path(args.write_checkpoints), args.smoke, args.only)
    elif args.calibrate_worker:
        calibrate_worker(args)
    elif args.calibrate:
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
