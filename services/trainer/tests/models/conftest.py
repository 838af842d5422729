"""Tiny Qwen3 / Qwen3-MoE checkpoints (made once per session) and the models loaded from them."""

import pathlib

import pytest
import torch

from primerl_launcher.tiny_model import VOCAB_SIZE, make_tiny_model


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session")
def dense_path(model_root: pathlib.Path) -> pathlib.Path:
    return make_tiny_model(model_root / "dense", kind="dense", seed=0)


@pytest.fixture(scope="session")
def moe_path(model_root: pathlib.Path) -> pathlib.Path:
    return make_tiny_model(model_root / "moe", kind="moe", seed=0)


def random_ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB_SIZE, shape, generator=torch.Generator().manual_seed(seed))


def packed_inputs(lengths: list[int], *, seed: int = 0) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Samples of the given lengths, and the same packed into one row: (samples [1, len_i],
    input_ids [1, sum], position_ids [1, sum] restarting at 0 for each sample)."""
    samples = [random_ids(1, length, seed=seed + i) for i, length in enumerate(lengths)]
    position_ids = torch.cat([torch.arange(length) for length in lengths]).unsqueeze(0)
    return samples, torch.cat(samples, dim=1), position_ids
