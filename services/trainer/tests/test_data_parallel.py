"""FSDP2 over two processes (torchrun; gloo on the CPU, NCCL on two GPUs) trains as one process
does, and its sharded DCP checkpoint resumes in one process."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

from primerl_trainer.checkpoint import Checkpointer
from primerl_trainer.optim import build_lr_scheduler, build_optimizer
from primerl_trainer.train import Trainer

from .tiny_training import (
    DP_OPTIMIZER,
    DP_SCHEDULE,
    assert_weights_match_after_adam,
    batch_spec,
    load_tiny_model,
    make_samples,
    micro_batches_to_dicts,
    pack_into,
    parameters,
    tiny_model_dir,
)

HERE = pathlib.Path(__file__).parent
METRICS = ("loss", "grad_norm", "lr", "entropy", "mismatch_kl", "masked_fraction", "num_loss_tokens")
# DCP says so when it saves or loads in a process that is not part of a process group.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _trainer(model: torch.nn.Module, device: torch.device) -> Trainer:
    optimizer = build_optimizer(model, DP_OPTIMIZER)
    return Trainer(model, optimizer, build_lr_scheduler(optimizer, DP_SCHEDULE), spec=batch_spec(model), device=device)


def _assert_same_weights(got: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor]) -> None:
    assert got.keys() == wanted.keys()
    for name, weight in wanted.items():
        # Summing gradients in another order moves an Adam step a little on some CPUs (an H200
        # host's: 2 of 81920 embedding entries by 3.8e-5).
        assert_weights_match_after_adam(name, got[name].cpu(), weight.cpu())


@pytest.mark.parametrize("device_type", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fsdp_on_two_ranks_matches_one_process(
    device_type: str, tmp_path_factory: pytest.TempPathFactory, tmp_path: pathlib.Path
) -> None:
    if device_type == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    device = torch.device(device_type)
    model_dir = tiny_model_dir(tmp_path_factory)
    model = load_tiny_model(model_dir)
    # Three micro-batches per step: rank 0 trains two, rank 1 one and a loss-free filler.
    batches = [pack_into(make_samples(model, seed=seed, num_samples=5), 3) for seed in range(3)]
    torch.save([micro_batches_to_dicts(batch) for batch in batches[:2]], tmp_path / "batches.pt")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    # Hiding the GPUs makes the workers take gloo on the CPU.
    env = os.environ | ({"CUDA_VISIBLE_DEVICES": ""} if device_type == "cpu" else {})
    worker = subprocess.Popen(
        [*command, str(HERE / "fsdp_worker.py"), str(model_dir), str(tmp_path / "batches.pt"), str(tmp_path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        # The one-process reference runs while the workers do.
        reference = _trainer(model.to(device), device)
        expected = [reference.train_step(batch) for batch in batches[:2]]
        expected_weights = parameters(reference.model)
        output, _ = worker.communicate(timeout=240)
    finally:
        worker.kill()
    assert worker.returncode == 0, output[-5000:]

    result = torch.load(tmp_path / "result.pt")
    assert result["world_size"] == 2
    for got, wanted in zip(result["metrics"], expected, strict=True):
        for key in METRICS:
            # Relative: two ranks sum gradients in another order (grad_norm ~13 moved by
            # 1.1e-5 relative on one CPU).
            assert got[key] == pytest.approx(wanted[key], rel=1e-4, abs=1e-5), key
    _assert_same_weights(result["weights"], expected_weights)
    # A publish's gather (shard by shard to rank 0) gives the same full tensors.
    assert result["published"].keys() == result["weights"].keys()
    for name, weight in result["weights"].items():
        assert torch.equal(result["published"][name].cpu(), weight.cpu()), name

    # The two ranks' sharded checkpoint of step 2, resumed in one process: same weights, and the
    # optimizer and schedule state carry the third step as in the uninterrupted reference.
    resumed = _trainer(load_tiny_model(model_dir).to(device), device)
    assert Checkpointer(tmp_path / "checkpoints").load_latest(resumed) == 2
    _assert_same_weights(parameters(resumed.model), expected_weights)
    got, wanted = resumed.train_step(batches[2]), reference.train_step(batches[2])
    for key in METRICS:
        assert got[key] == pytest.approx(wanted[key], rel=1e-5, abs=1e-5), key
    _assert_same_weights(parameters(resumed.model), parameters(reference.model))
