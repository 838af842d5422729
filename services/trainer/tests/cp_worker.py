"""Run by test_context_parallel.py under torchrun: trains a tiny model with context parallel on the
mesh of ParallelDims(world, cp) (FSDP2 over dp_shard x cp; gloo on the CPU, NCCL on GPUs) and has
rank 0 save what the test compares with one process.

    torchrun --standalone --nproc-per-node N cp_worker.py MODEL_DIR DATA_FILE OUT_DIR CP [options]

The data file holds the batches, the batch spec and a probe micro-batch: the worker scores the
probe, trains every batch, then scores the probe again (per-token logprobs in row order) with the attention backend it
trained with and, forward only (flex has no backward on the CPU), with the other one.
"""

import argparse
import pathlib

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


def main(args: argparse.Namespace) -> None:
    device = init_distributed()
    dtype = getattr(torch, args.dtype)
    compute_dtype = getattr(torch, args.compute_dtype or args.dtype)
    data = torch.load(args.data_file)
    dims = ParallelDims(world_size=dist.get_world_size(), cp=args.cp, ep=args.ep)
    dims.build_mesh(device.type)
    # torch._grouped_mm has no float64 kernel: float64 runs the experts one by one.
    experts_impl = "loop" if dtype == torch.float64 else "auto"
    model = load_model(
        args.model_dir, impl="auto", dtype=dtype, experts_impl=experts_impl, attn_backend=args.attn_backend
    ).to(device)
    # Reduced in the weights' dtype, as the one-process reference (CPU tests: computed in it too).
    expert_parallel = {"ep_mesh": dims.mesh("ep"), "efsdp_mesh": dims.mesh("efsdp")} if dims.ep_enabled else {}
    model_spec_of(model).parallelize_fn(
        model,
        dp_mesh=dims.mesh("dp_shard_cp"),
        **expert_parallel,
        param_dtype=compute_dtype,
        reduce_dtype=dtype,
        compile=args.compile,
        activation_checkpointing=args.compile,
    )
    if dims.cp_enabled:
        apply_context_parallel(model, cp_mesh=dims.mesh("cp"))
    optimizer = build_optimizer(model, DP_OPTIMIZER)
    trainer = Trainer(
        model,
        optimizer,
        build_lr_scheduler(optimizer, DP_SCHEDULE),
        spec=BatchSpec(**data["spec"]),
        device=device,
        dp_group=dims.group("dp_shard"),
        cp_group=dims.group("cp") if dims.cp_enabled else None,
    )
    probe = micro_batches_from_dicts([data["probe"]])[0]
    initial_logprobs, _ = trainer.token_logprobs(probe)
    metrics = [trainer.train_step(micro_batches_from_dicts(batch)) for batch in data["batches"]]
    logprobs, entropy = trainer.token_logprobs(probe)
    model.attn_backend = "sdpa" if args.attn_backend == "flex" else "flex"
    other_logprobs, _ = trainer.token_logprobs(probe)

    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    is_rank0 = dist.get_rank() == 0
    published = {name: t.cpu() for name, t in gather_state_dict(model, kind="full", is_destination=is_rank0)}
    # Every rank ends with the same row-order results.
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, logprobs.cpu())
    if is_rank0:
        result = {
            "metrics": metrics,
            "initial_logprobs": initial_logprobs.cpu(),
            "logprobs": logprobs.cpu(),
            "entropy": entropy.cpu(),
            "other_backend_logprobs": other_logprobs.cpu(),
            "all_ranks_logprobs": everyone,
            "weights": weights,
            "published": published,
        }
        torch.save(result, args.out_dir / "result.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir", type=pathlib.Path)
    parser.add_argument("data_file", type=pathlib.Path)
    parser.add_argument("out_dir", type=pathlib.Path)
    parser.add_argument("cp", type=int)
    parser.add_argument("--ep", type=int, default=1, help="expert parallel degree (MoE models)")
    parser.add_argument("--dtype", default="float32", help="weights, gradients' reduction and by default compute")
    parser.add_argument("--compute-dtype", default=None)
    parser.add_argument("--attn-backend", default="sdpa")
    parser.add_argument("--compile", action="store_true", help="compiled blocks with activation checkpointing")
    main(parser.parse_args())
