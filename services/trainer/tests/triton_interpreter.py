"""Triton kernels checked on the CPU: Triton's interpreter (TRITON_INTERPRET=1) is chosen when a
kernel is defined, so a test module's `_check_against_reference()` runs in a child interpreter
started with it set."""

import os
import subprocess
import sys

TRAINER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_in_interpreter(test_module: str) -> None:
    """Runs tests/<test_module>.py's `_check_against_reference()` under Triton's interpreter; fails
    with the end of the child's stderr."""
    code = f"from tests.{test_module} import _check_against_reference as check; check()"
    env = os.environ | {"TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=TRAINER_DIR, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
