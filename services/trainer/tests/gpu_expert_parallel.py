"""test_expert_parallel.py's two-GPU check for a GPU machine where the project is not installed:

    python3 services/trainer/tests/gpu_expert_parallel.py

From the repository root. Needs torch with two CUDA GPUs, pytest, transformers, tokenizers and the
trainer's other wheels (pydantic, pydantic-settings, protobuf, googleapis-common-protos, grpcio,
grpcio-status, safetensors) and, for the serving helpers test_expert_parallel.py imports (through
primerl_common.client), grpcio-health-checking, grpcio-reflection, cryptography (cffi, pycparser) and
opentelemetry-api, -sdk, -semantic-conventions, -proto, -exporter-otlp-proto-grpc, -exporter-otlp-proto-common,
-exporter-otlp-common: the device image lacks these (2026-11-30: ModuleNotFoundError: opentelemetry).
The packages are imported from this checkout. Five cases, one line
each; exit status 1 when one fails:

- float32: ep=2 over NCCL trains as one CPU process does (losses, replayed logprobs, weights,
  publish, LoRA; the ep=2 checkpoint resumes under FSDP on 2 GPUs), as on the CPU, through the
  fused Triton row kernels (kernels.token_rows) and the packed dispatch (routing in the rows'
  all-to-all); again with parallel.accumulate_unsharded and the routing in an all-to-all of its own;
  again with the dense send grid (every token to both ranks: the benchmark's dispatch at 256
  experts, where this model's top-2 of 8 sends each token only to its experts' ranks);
- bfloat16: the same run computing in bf16 (the experts through torch._grouped_mm, the path the
  benchmark takes) stays near the float32 reference: a wrong dispatch would not; again with the
  dense grid, where the grouped products take padded copies (the benchmark's path at 256 experts).
"""

import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gpu_context_parallel import run_cases, use_checkout


def bf16_case(
    moe_dir: pathlib.Path, batches: pathlib.Path, data: dict, out: pathlib.Path, dispatch: dict | None = None
) -> None:
    import torch

    from services.trainer.tests.test_expert_parallel import _run_workers

    data_file = out / "batches.pt"
    torch.save(torch.load(batches) | {"compute_dtype": "bfloat16", "dispatch": dispatch or {}}, data_file)
    result = _run_workers(moe_dir, data_file, out, nproc=2, ep=2, device_type="cuda")
    reference = data["reference"]
    for got, wanted in zip(result["metrics"], reference["metrics"], strict=True):
        assert abs(got["loss"] - wanted["loss"]) <= 0.03 * abs(wanted["loss"]) + 0.01, (got["loss"], wanted["loss"])
    assert torch.equal(result["routed_experts"], data["probe_routed_experts"].long())
    error = (result["logprobs"] - reference["logprobs"]).abs().max().item()
    assert error < 0.1, f"probe logprobs {error} from float32"


def main() -> int:
    use_checkout()
    import torch

    from services.trainer.tests.test_expert_parallel import (
        make_ep_data,
        make_ep_model,
        test_ep2_trains_as_one_process_and_its_checkpoint_resumes_under_fsdp2,
    )

    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs")
        return 1
    work = pathlib.Path(tempfile.mkdtemp(prefix="ep-gpu-"))
    moe_dir = make_ep_model(work)
    (data_dir := work / "data").mkdir()
    batches, data = make_ep_data(moe_dir, data_dir)
    cases = {
        "ep=2 float32": lambda out: test_ep2_trains_as_one_process_and_its_checkpoint_resumes_under_fsdp2(
            "cuda", False, {}, moe_dir, (batches, data), out
        ),
        "ep=2 float32 accumulate_unsharded unpacked": lambda out: (
            test_ep2_trains_as_one_process_and_its_checkpoint_resumes_under_fsdp2(
                "cuda", True, {"packed": False}, moe_dir, (batches, data), out
            )
        ),
        "ep=2 float32 dense grid": lambda out: test_ep2_trains_as_one_process_and_its_checkpoint_resumes_under_fsdp2(
            "cuda", False, {"dense_grid": True}, moe_dir, (batches, data), out
        ),
        "ep=2 bfloat16": lambda out: bf16_case(moe_dir, batches, data, out),
        "ep=2 bfloat16 dense grid, padded copies": lambda out: bf16_case(
            moe_dir, batches, data, out, {"dense_grid": True}
        ),
    }
    return run_cases(cases, work)


if __name__ == "__main__":
    sys.exit(main())
