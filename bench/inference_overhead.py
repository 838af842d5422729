"""What the inference service adds to vLLM: tokens/s of the same prompts through gRPC
Generate and submitted directly to the service's AsyncLLM, in one run on one engine, and
the time of a full weight update through UpdateWeights.

The service runs in this process (as `primerl-inference` does: gRPC server and AsyncLLM
frontend here, the engine core in the child process AsyncLLM spawns) on a tiny dense model
made on the spot; the gRPC client runs in this process too. A round submits all prompts at
once; rounds alternate between the two paths. Both paths ask for the same tokens:
temperature 1 with a seed per prompt, the sampled token's logprob, no detokenization; the
direct path hands vLLM the very SamplingParams the service makes for the request, so that the
two differ only in what the service adds.

On a machine shared with others, their load only ever slows a round down, by anything from
nothing to ten times: the fastest round of each path is the least disturbed one, and the
ratio compares those (the median of per-pair ratios is printed as well). Rounds go on until
the two fastest rounds of each path agree within 10% (each path has met a quiet spell twice),
up to --max-rounds.

Two stream modes, each path in its own terms:
- final: one message per request (StreamOptions.final_only; directly, FINAL_ONLY outputs), as
  an RL rollout consumes a completion. This is the RESULT.
- token: one message per token (the contract's default; directly, vLLM's per-step DELTA
  outputs). Python gRPC costs ~0.2 ms of CPU per message (server and client here), which a
  tiny model making ~2k tokens/s on two cores feels; shown for reference.
The CPU time this process (AsyncLLM frontend, gRPC server and client) spends per token is
printed too: unlike tokens/s it hardly depends on the load of others.

Last line: RESULT grpc_vs_direct_tokens_ratio=<x> weight_update_s=<y>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import tempfile
import time

# vLLM reads these at import; values already in the environment win (as in conftest.py).
for _name, _value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "HF_HUB_OFFLINE": "1",
    "MALLOC_MMAP_THRESHOLD_": str(128 << 20),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
}.items():
    os.environ.setdefault(_name, _value)

from safetensors.torch import load_file  # noqa: E402
from vllm.inputs.engine import tokens_input  # noqa: E402

from primerl.common.v1 import generation_pb2, tensor_pb2  # noqa: E402
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402
from primerl_common.client import make_channel  # noqa: E402
from primerl_common.server import GrpcService  # noqa: E402
from primerl_common.tensors import iter_tensor_chunks  # noqa: E402
from primerl_common.tiny_model import make_tiny_model  # noqa: E402
from primerl_inference.config import InferenceConfig  # noqa: E402
from primerl_inference.engine import InferenceEngine  # noqa: E402
from primerl_inference.generation import GenerateRequest, SamplingSpec, StreamPolicy  # noqa: E402
from primerl_inference.server import service_definition  # noqa: E402
from primerl_inference.streaming import sampling_params  # noqa: E402

MODES = ("final", "token")


def prompts(num_prompts: int, prompt_len: int) -> list[list[int]]:
    return [[(31 * p + 7 * i) % 250 + 1 for i in range(prompt_len)] for p in range(num_prompts)]


async def direct_round(llm, batch: list[list[int]], max_tokens: int, mode: str) -> int:
    """All prompts to the AsyncLLM at once; the number of tokens generated."""

    async def one(index: int, prompt: list[int]) -> int:
        # The very SamplingParams the service gives vLLM for this request (output kind, logprob
        # format and all), so that the two paths differ only in what the service adds.
        params = sampling_params(
            GenerateRequest(
                request_id=f"direct-{index}",
                prompt_token_ids=tuple(prompt),
                sampling=SamplingSpec(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=index),
                stream=StreamPolicy(final_only=mode == "final"),
            )
        )
        num_tokens = 0
        async for output in llm.generate(tokens_input(prompt), params, f"direct-{index}-{time.monotonic_ns()}"):
            num_tokens += len(output.outputs[0].token_ids)
        return num_tokens

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(batch))))


async def grpc_round(stub, batch: list[list[int]], max_tokens: int, mode: str) -> int:
    """All prompts through Generate at once; the tokens received."""
    stream = generation_pb2.StreamOptions(final_only=mode == "final")

    async def one(index: int, prompt: list[int]) -> int:
        request = inference_pb2.GenerateRequest(
            input=generation_pb2.GenerationInput(
                prompt_token_ids=prompt,
                sampling=generation_pb2.SamplingParams(
                    temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=index
                ),
                stream=stream,
            )
        )
        return sum([len(response.output.token_ids) async for response in stub.Generate(request)])

    return sum(await asyncio.gather(*(one(i, p) for i, p in enumerate(batch))))


async def timed(round_coro) -> tuple[float, float]:
    """Tokens per second of one round, and this process's CPU seconds per token."""
    started, cpu_started = time.perf_counter(), time.process_time()
    num_tokens = await round_coro
    return num_tokens / (time.perf_counter() - started), (time.process_time() - cpu_started) / num_tokens


async def compare(llm, stub, batch: list[list[int]], args: argparse.Namespace, mode: str) -> float:
    """gRPC/direct ratio of the fastest rounds of each path in stream mode `mode`."""
    measured: dict[str, list[tuple[float, float]]] = {"direct": [], "gRPC": []}
    for index in range(args.max_rounds):
        for path in ("direct", "gRPC") if index % 2 == 0 else ("gRPC", "direct"):
            if path == "gRPC":
                measured[path].append(await timed(grpc_round(stub, batch, args.max_tokens, mode)))
            else:
                measured[path].append(await timed(direct_round(llm, batch, args.max_tokens, mode)))
        print(
            f"{mode} round {index}: "
            + ", ".join(
                f"{path} {rounds[-1][0]:.0f} tokens/s ({1e6 * rounds[-1][1]:.0f} us CPU/token here)"
                for path, rounds in measured.items()
            ),
            flush=True,
        )
        if index + 1 >= max(args.min_rounds, 2) and all(_settled(rounds) for rounds in measured.values()):
            break
    best = {path: max(tps for tps, _ in rounds) for path, rounds in measured.items()}
    pair_ratios = [g / d for (g, _), (d, _) in zip(measured["gRPC"], measured["direct"], strict=True)]
    print(
        f"{mode}: fastest direct {best['direct']:.0f} tokens/s, fastest gRPC {best['gRPC']:.0f} tokens/s, "
        f"ratio {best['gRPC'] / best['direct']:.3f} (median of round pairs {statistics.median(pair_ratios):.3f})",
        flush=True,
    )
    return best["gRPC"] / best["direct"]


def _settled(rounds: list[tuple[float, float]]) -> bool:
    """Whether the two fastest rounds agree within 10%."""
    fastest, second = sorted((tps for tps, _ in rounds), reverse=True)[:2]
    return second >= 0.9 * fastest


def update_stream(tensors, policy_version: int):
    begin = inference_pb2.WeightUpdateBegin(
        policy_version=policy_version,
        format=tensor_pb2.WEIGHT_FORMAT_HF,
        num_tensors=len(tensors),
        num_bytes=sum(t.numel() * t.element_size() for t in tensors.values()),
    )
    yield inference_pb2.UpdateWeightsRequest(begin=begin)
    for chunk in iter_tensor_chunks(tensors.items()):
        yield inference_pb2.UpdateWeightsRequest(chunk=chunk)


async def bench(args: argparse.Namespace, work_dir: pathlib.Path) -> None:
    model_dir = make_tiny_model(work_dir / "dense", kind="dense", dtype="float32")
    config = InferenceConfig(
        engine={
            "model": model_dir,
            "dtype": "float32",
            "enforce_eager": True,
            "max_model_len": args.prompt_len + args.max_tokens,
            "max_num_seqs": args.num_prompts,
        },
        server={"host": "127.0.0.1", "port": 0},
    )
    engine = await InferenceEngine.start(config)
    service = GrpcService(service_definition(engine, config), config)
    port = await service.start()
    llm = engine.llm  # both paths go to the same engine
    batch = prompts(args.num_prompts, args.prompt_len)
    print(
        f"tiny dense float32 model, {args.num_prompts} prompts x {args.prompt_len} tokens -> "
        f"{args.max_tokens} tokens each, {args.min_rounds}-{args.max_rounds} rounds per path and stream mode",
        flush=True,
    )
    try:
        async with make_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            for mode in MODES:  # warm-up of both paths
                await direct_round(llm, batch[:4], 8, mode)
                await grpc_round(stub, batch[:4], 8, mode)
            ratios = {mode: await compare(llm, stub, batch, args, mode) for mode in MODES}

            tensors = load_file(model_dir / "model.safetensors")
            num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
            update_s = []
            for version in range(1, args.updates + 1):
                started = time.perf_counter()
                response = await stub.UpdateWeights(update_stream(tensors, version))
                update_s.append(time.perf_counter() - started)
                print(
                    f"weight update {version}: {len(tensors)} tensors, {num_bytes / 2**20:.1f} MiB, "
                    f"{update_s[-1]:.3f}s at the client (server: paused {response.pause_s:.3f}s, "
                    f"total {response.total_s:.3f}s)",
                    flush=True,
                )
    finally:
        await service.stop(grace_s=0)
    print(f"RESULT grpc_vs_direct_tokens_ratio={ratios['final']:.3f} weight_update_s={statistics.median(update_s):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-rounds", type=int, default=4, help="rounds per path and stream mode, at least")
    parser.add_argument("--max-rounds", type=int, default=16, help="rounds per path and stream mode, at most")
    parser.add_argument("--updates", type=int, default=3, help="full weight updates timed (median reported)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="primerl-bench-inference-") as work_dir:
        asyncio.run(bench(args, pathlib.Path(work_dir)))


if __name__ == "__main__":
    main()
