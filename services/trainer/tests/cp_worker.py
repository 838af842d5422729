"""Run by test_context_parallel.py under torchrun: trains a tiny model with context parallel on the
mesh of ParallelDims(world, cp) (FSDP2 over dp_shard x cp; gloo on the CPU) and has rank 0 save
what the test compares with one process.

    torchrun --standalone --nproc-per-node N cp_worker.py MODEL_DIR DATA_FILE OUT_DIR CP DTYPE

The data file holds the batches, the batch spec and a probe micro-batch: the worker trains every
batch, then scores the probe (per-token logprobs in row order) with the "sdpa" backend and, as a
forward-only check (flex has no backward on the CPU), with "flex".
"""

import pathlib
import sys

import torch
import torch.distributed as dist
from tiny_training import DP_OPTIMIZER, DP_SCHEDULE, micro_batches_from_dicts
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from primerl_trainer.batch import BatchSpec
from primerl_trainer.distributed.context_parallel import apply_context_parallel
from primerl_trainer.distributed.parallel_dims import ParallelDims
from primerl_trainer.export import gather_state_dict
from primerl_trainer.models import load_model, model_spec_of
from primerl_trainer.optim import build_lr_scheduler, build_optimizer
from primerl_trainer.process_group import init_distributed
from primerl_trainer.train import Trainer


def main(model_dir: pathlib.Path, data_file: pathlib.Path, out_dir: pathlib.Path, cp: int, dtype: torch.dtype) -> None:
    device = init_distributed()
    data = torch.load(data_file)
    dims = ParallelDims(world_size=dist.get_world_size(), cp=cp)
    dims.build_mesh(device.type)
    # torch._grouped_mm has no float64 kernel: float64 runs the experts one by one.
    experts_impl = "loop" if dtype == torch.float64 else "auto"
    model = load_model(model_dir, impl="auto", dtype=dtype, experts_impl=experts_impl).to(device)
    # Computed and reduced in the weights' dtype, as the one-process reference computes.
    model_spec_of(model).parallelize_fn(model, dp_mesh=dims.mesh("dp_shard_cp"), param_dtype=dtype, reduce_dtype=dtype)
    apply_context_parallel(model, cp_mesh=dims.mesh("cp"))
    optimizer = build_optimizer(model, DP_OPTIMIZER)
    trainer = Trainer(
        model,
        optimizer,
        build_lr_scheduler(optimizer, DP_SCHEDULE),
        spec=BatchSpec(**data["spec"]),
        device=device,
        dp_group=dims.group("dp_shard"),
        cp_group=dims.group("cp"),
    )
    metrics = [trainer.train_step(micro_batches_from_dicts(batch)) for batch in data["batches"]]
    probe = micro_batches_from_dicts([data["probe"]])[0]
    logprobs, entropy = trainer.token_logprobs(probe)
    model.attn_backend = "flex"
    flex_logprobs, _ = trainer.token_logprobs(probe)

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    is_rank0 = dist.get_rank() == 0
    published = {name: t.cpu() for name, t in gather_state_dict(model, kind="full", is_destination=is_rank0)}
    # Every rank ends with the same row-order results.
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, logprobs.cpu())
    if is_rank0:
        result = {
            "metrics": metrics,
            "logprobs": logprobs.cpu(),
            "entropy": entropy.cpu(),
            "flex_logprobs": flex_logprobs.cpu(),
            "all_ranks_logprobs": everyone,
            "weights": weights,
            "published": published,
        }
        torch.save(result, out_dir / "result.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*(pathlib.Path(arg) for arg in sys.argv[1:4]), int(sys.argv[4]), getattr(torch, sys.argv[5]))
