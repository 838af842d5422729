"""Joining the process group torchrun describes: NCCL on GPUs, gloo on the CPU."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["init_distributed"]


def init_distributed() -> torch.device:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ...); return this
    process's device: the GPU of LOCAL_RANK with NCCL when CUDA is present, else the CPU with gloo.

    Shard the model afterwards with its parallelize function over a mesh of the ranks, e.g.
    `init_device_mesh(device.type, (dist.get_world_size(),))`.
    """
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        # device_id binds the communicator to this GPU up front instead of at the first collective.
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device
