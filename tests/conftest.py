"""One stack of real services (stack.py) for the session: the end-to-end tests share it and
read the trainer's next expected step first, so that they run in any order. And the security
tests' certificates, per module."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
from collections.abc import Iterator

import pytest

from .security_attacks import make_certs
from .stack import Stack, running_stack


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    root = tmp_path_factory.mktemp("stack")
    with contextlib.ExitStack() as exits:
        runner = asyncio.Runner()
        exits.enter_context(runner)
        context = running_stack(root)
        stack = runner.run(context.__aenter__())
        exits.callback(lambda: runner.run(context.__aexit__(None, None, None)))
        yield stack


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The security tests' certificates and tokens (tests/security_attacks.py's make_certs)."""
    return make_certs(tmp_path_factory.mktemp("certs"))
