"""Shared fixtures of the trainer's tests: the tiny models (made once per session) and RL batches."""

import pathlib

import pytest
import torch

from primerl_launcher.tiny_model import make_tiny_model
from primerl_trainer.batch import MicroBatch

from .tiny_training import load_tiny_model, make_samples, pack_into, tiny_model_dir


@pytest.fixture(scope="session")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="session")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.getbasetemp() / "trainer-tiny-moe", kind="moe", dtype="float32")


@pytest.fixture(scope="session")
def rl_batches(dense_dir: pathlib.Path) -> list[list[MicroBatch]]:
    """Five RL batches of four samples in two micro-batches, scored by the tiny dense model."""
    model = load_tiny_model(dense_dir)
    with torch.no_grad():
        return [pack_into(make_samples(model, seed=seed, num_samples=4), 2) for seed in range(5)]
