"""Fixtures of the inference tests. Engines are expensive (a vLLM engine process each), so
tests share them per module, on one session-wide event loop (an AsyncLLM stays bound to
the loop it was started on)."""

import pathlib

import pytest
import pytest_asyncio

from .serving import running_service, tiny_model


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="module")
def model_dir(model_root: pathlib.Path) -> pathlib.Path:
    """The tiny dense model, float32 (a module serving another model defines its own)."""
    return tiny_model(model_root, "dense")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served(model_dir: pathlib.Path):
    # engine.dtype unset: the engine serves the checkpoint's float32 (asserted by test_service_info_...).
    async with running_service(model=model_dir) as served:
        yield served
