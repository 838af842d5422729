"""One stack of real services (stack.py) for the session: the end-to-end tests share it and
read the trainer's next expected step first, so that they run in any order."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest

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
