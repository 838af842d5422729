"""Joining the process group torchrun describes: NCCL on GPUs, gloo on the CPU."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from primerl_trainer.config_types import DeviceType

__all__ = ["DeviceType", "init_distributed", "launched_by_torchrun"]


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a torchrun (or Slurm/Kubernetes) launch."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def init_distributed(device_type: DeviceType = "auto") -> torch.device:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ...); return this
    process's device: the GPU of LOCAL_RANK with NCCL when CUDA is present (or asked for), else
    the CPU with gloo.

    Without torchrun's environment the process makes a group of its own (world size 1, an
    in-memory store), so that one process runs the same sharded code path as many.

    Shard the model afterwards with its parallelize function over a mesh of the ranks, e.g.
    `init_device_mesh(device.type, (dist.get_world_size(),))`.
    """
    use_cuda = torch.cuda.is_available() if device_type == "auto" else device_type == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise ValueError("device 'cuda' asked for, but CUDA is not available")
    single = {} if launched_by_torchrun() else {"store": dist.HashStore(), "rank": 0, "world_size": 1}
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        # device_id binds the communicator to this GPU up front instead of at the first collective.
        dist.init_process_group("nccl", device_id=device, **single)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **single)
    return device
