"""test_context_parallel.py's two-GPU check (test_cp2_on_two_gpus_trains_as_one_gpu: NCCL,
compiled blocks with activation checkpointing, rows of thousands of tokens; sdpa and flex,
float32 and bfloat16 compute) for a GPU machine where the project is not installed:

    python3 services/trainer/tests/gpu_context_parallel.py

From the repository root. Needs torch with two CUDA GPUs, pytest, transformers, tokenizers and the
trainer's other wheels (pydantic, pydantic-settings, protobuf, googleapis-common-protos, grpcio,
grpcio-status, safetensors). The packages are imported from this checkout. One line per case;
exit status 1 when one fails.
"""

import functools
import os
import pathlib
import sys
import tempfile
import traceback
from collections.abc import Callable

ROOT = pathlib.Path(__file__).resolve().parents[3]
SOURCES = [ROOT, ROOT / "libs/common/src", ROOT / "services/trainer/src", ROOT / "tools/launcher/src"]


def use_checkout() -> None:
    """The checkout's packages on the path of this process and of the workers it starts, with the
    distribution metadata their __init__ reads."""
    metadata = pathlib.Path(tempfile.mkdtemp(prefix="primerl-metadata-"))
    for name in ("primerl_common", "primerl_trainer", "primerl_launcher"):
        info = metadata / f"{name}-0+source.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0+source\n")
    paths = [str(path) for path in (*SOURCES, metadata)]
    sys.path[:0] = paths
    os.environ["PYTHONPATH"] = os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")])


def main() -> int:
    use_checkout()
    import torch

    from primerl_launcher.tiny_model import make_tiny_model
    from services.trainer.tests.test_context_parallel import test_cp2_on_two_gpus_trains_as_one_gpu

    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs")
        return 1
    work = pathlib.Path(tempfile.mkdtemp(prefix="cp-gpu-"))
    model_dir = make_tiny_model(work / "tiny-dense", kind="dense", dtype="float32")
    cases = {
        f"{attn_backend} {compute_dtype}": functools.partial(
            test_cp2_on_two_gpus_trains_as_one_gpu, attn_backend, compute_dtype, model_dir
        )
        for compute_dtype in ("float32", "bfloat16")
        for attn_backend in ("sdpa", "flex")
    }
    return run_cases(cases, work)


def run_cases(cases: dict[str, Callable[[pathlib.Path], None]], work: pathlib.Path) -> int:
    """Runs each case in a folder of its own under `work`, one line per case; 1 when one failed."""
    failed = 0
    for name, case in cases.items():
        (out := work / name.replace(" ", "-")).mkdir()
        try:
            case(out)
            print(f"ok      {name}", flush=True)
        except Exception:
            failed += 1
            print(f"FAILED  {name}\n{traceback.format_exc()[-4000:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
