"""Fixtures of the inference tests. Engines are expensive (a vLLM engine process each), so
tests share them per module, on one session-wide event loop (an AsyncLLM stays bound to
the loop it was started on)."""

import pathlib

import pytest


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tiny-models")
