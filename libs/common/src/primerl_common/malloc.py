"""glibc's allocator settings for processes that move large gRPC messages: with its
default thresholds, every multi-MiB message is mmapped and unmapped again, which halves
gRPC stream throughput (DESIGN.md). glibc reads them once, at process start."""

from __future__ import annotations

import os
import sys

__all__ = ["MALLOC_ENV", "reexec_with_malloc_env"]

MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def reexec_with_malloc_env() -> None:
    """Runs this program again with MALLOC_ENV set, unless it already is (then returns)."""
    if any(os.environ.get(name) != value for name, value in MALLOC_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})
