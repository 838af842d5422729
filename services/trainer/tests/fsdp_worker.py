"""Run by test_data_parallel.py under torchrun: trains the tiny model sharded with FSDP2 (its
registry's parallelize function; gloo on the CPU, NCCL on GPUs) on the batches the test saved,
checkpoints with DCP, and has rank 0 save the metrics and the full weights for the test to
compare with one process.

    torchrun --standalone --nproc-per-node 2 fsdp_worker.py MODEL_DIR BATCHES_FILE OUT_DIR
"""

import os
import pathlib
import sys

import torch
import torch.distributed as dist
from tiny_training import DP_OPTIMIZER, DP_SCHEDULE, batch_spec, load_tiny_model, micro_batches_from_dicts
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from primerl_trainer.checkpoint import Checkpointer
from primerl_trainer.export import gather_state_dict, gather_to_rank0
from primerl_trainer.models import model_spec_of
from primerl_trainer.optim import build_lr_scheduler, build_optimizer
from primerl_trainer.process_group import init_distributed
from primerl_trainer.train import Trainer


def main(model_dir: pathlib.Path, batches_file: pathlib.Path, out_dir: pathlib.Path) -> None:
    device = init_distributed()
    model = load_tiny_model(model_dir).to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    # float32 compute, as the one-process reference.
    model_spec_of(model).parallelize_fn(model, dp_mesh=mesh, param_dtype=torch.float32)
    optimizer = build_optimizer(model, DP_OPTIMIZER)
    trainer = Trainer(
        model, optimizer, build_lr_scheduler(optimizer, DP_SCHEDULE), spec=batch_spec(model), device=device
    )
    checkpointer = Checkpointer(out_dir / "checkpoints", interval=2)
    metrics = []
    for batch in torch.load(batches_file):
        metrics.append(trainer.train_step(micro_batches_from_dicts(batch)))
        checkpointer.maybe_save(trainer)
    # Collective: every rank takes part in gathering the full weights.
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # What a publish gathers, tensor by tensor to rank 0 only.
    is_rank0 = dist.get_rank() == 0
    published = dict(gather_state_dict(model, kind="full", is_destination=is_rank0))
    assert is_rank0 or not published
    # Uneven shards on dim 0 and 1, an empty one included (a dim of 1 over 2 ranks).
    generator = torch.Generator().manual_seed(0)
    plain = [torch.randn(shape, generator=generator) for shape in ((5, 3), (3, 7, 2), (1, 4), (2, 1))]
    sharded = [distribute_tensor(t, mesh, [Shard(dim)]) for t in plain for dim in (0, 1)]
    gathered = [gather_to_rank0(t, is_destination=is_rank0) for t in sharded]
    if is_rank0:
        for t, got in zip([t for t in plain for _ in (0, 1)], gathered, strict=True):
            assert torch.equal(got.cpu(), t), (t.shape, got.shape)
        result = {"metrics": metrics, "weights": weights, "published": published, "world_size": dist.get_world_size()}
        torch.save(result, out_dir / "result.pt")
    dist.destroy_process_group()
    # About 1 run in 8 on torch 2.13 (CPU, gloo), a rank aborted after its interpreter had finalized
    # ("terminate called without an active exception", no Python frame left): a C++ thread torn down
    # joinable at exit. The results are on disk by now; leave without the static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(*(pathlib.Path(arg) for arg in sys.argv[1:]))
