"""The per-kernel rates file of the capacity planner (primerl_trainer.planner), measured on this
GPU kind: HBM copy, bf16 matmuls and grouped matmuls of the benchmark's shapes, SDPA attention
forward and backward, NCCL collectives over the GPUs of one host, and the activation bytes the
trainer's compiled blocks keep. Run through bench/parallel_throughput.py --calibrate (which starts
this module under torchrun); rank 0 prints the TOML file, and writes $OUT/rates-<gpu>.toml.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from parallel_throughput import MOE_EXPERTS_PER_GPU, OUT, SMOKE_EXPERTS, check_modules, model_config, use_source_tree


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
    # all_to_all_call_s and [fit] are fitted to bench/parallel_throughput.py runs, not measured
    # here: kept from the shipped file like the inter-node rates.
    if collectives:
        w(f'[intra_node]\nsource = "NCCL busbw over {world} GPUs of one host, 256 MiB: {where}"\n')
        w(
            f"all_gather_gbps = {collectives['all_gather']:.0f}\nreduce_scatter_gbps = "
            f"{collectives['reduce_scatter']:.0f}\nall_to_all_gbps = {collectives['all_to_all']:.0f}\n"
        )
    else:
        link = known.intra_node
        w(
            f'[intra_node]\nsource = "kept: {link.source}"\nall_gather_gbps = {link.all_gather_gbps:.0f}\n'
            f"reduce_scatter_gbps = {link.reduce_scatter_gbps:.0f}\nall_to_all_gbps = {link.all_to_all_gbps:.0f}\n"
        )
    w(f"all_to_all_call_s = {known.intra_node.all_to_all_call_s!r}  # kept: see [fit]\n\n")
    link = known.inter_node
    w(
        f'[inter_node]\nsource = "kept (one node measures no network): {link.source}"\n'
        f"all_gather_gbps = {link.all_gather_gbps:.0f}\nreduce_scatter_gbps = {link.reduce_scatter_gbps:.0f}\n"
        f"all_to_all_gbps = {link.all_to_all_gbps:.0f}\nall_to_all_call_s = {link.all_to_all_call_s!r}\n\n"
    )
    factors = lines["activations"]
    w(
        f'[activations]\nsource = "saved bytes of compiled blocks at 4096 tokens over the planner\'s count: {where}"\n'
        f"factor_dense = {factors['dense']:.3f}\nfactor_moe = {factors['moe']:.3f}\n\n"
    )
    fit = known.fit
    w(f"[fit]\nsource = {json.dumps('kept: ' + fit.source)}\n")
    w(f"ep_layer_s = {fit.ep_layer_s!r}\nfsdp_exposed_fraction = {fit.fsdp_exposed_fraction!r}\n")
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
    ] + (["--smoke"] if args.smoke else [])
    subprocess.run(command, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU with gloo")
    args = parser.parse_args()
    use_source_tree()
    check_modules()
    calibrate_worker(args)


if __name__ == "__main__":
    main()
