"""NCCL transfer of a 2 GiB buffer from GPU 0 to GPU 1 (the weight
broadcaster's NCCL transport path) against a plain device-to-device copy
between the same GPUs, in one run (needs two CUDA GPUs).

Last line: RESULT nccl_vs_d2d_ratio=<x> nccl_gbps=<y> d2d_gbps=<z>
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# NVLink multicast stays off on shared hosts.
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def timed(fn, repeats: int) -> float:
    """Median seconds of fn over repeats, after warm-up, with CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def d2d_gbps(num_bytes: int, repeats: int) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:0").random_()
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:1")
    seconds = timed(lambda: dst.copy_(src, non_blocking=True), repeats)
    assert torch.equal(dst[:4096].cpu(), src[:4096].cpu())
    return num_bytes / seconds / 1e9


def nccl_rank(rank: int, num_bytes: int, repeats: int, port: int, result) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    buffer = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    if rank == 0:
        buffer.random_()

    def transfer() -> None:
        dist.broadcast(buffer, src=0)

    seconds = timed(transfer, repeats)
    checksum = buffer[:: 1 << 20].to(torch.int64).sum()
    dist.all_reduce(checksum)  # equal buffers give twice rank 0's sum
    if rank == 0:
        result.put((num_bytes / seconds / 1e9, checksum.item()))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("needs two CUDA GPUs")
    num_bytes = int(args.gib * (1 << 30))
    d2d = d2d_gbps(num_bytes, args.repeats)
    context = mp.get_context("spawn")
    result = context.Queue()
    port = 29500 + os.getpid() % 1000
    mp.spawn(nccl_rank, args=(num_bytes, args.repeats, port, result), nprocs=2, join=True)
    nccl, _ = result.get()
    print(f"devices: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}   torch {torch.__version__}")
    print(f"{'transfer':<28} {'GB/s':>8}")
    print(f"{'device-to-device copy 0->1':<28} {d2d:>8.1f}")
    print(f"{'NCCL broadcast 0->1':<28} {nccl:>8.1f}")
    print(f"RESULT nccl_vs_d2d_ratio={nccl / d2d:.3f} nccl_gbps={nccl:.1f} d2d_gbps={d2d:.1f}")


if __name__ == "__main__":
    main()
