"""What the inference service adds to vLLM: tokens/s of the same prompts through gRPC
Generate and submitted directly to the service's AsyncLLM, in one run on one engine, and
the time of a full weight update through UpdateWeights.

The service runs in this process as `primerl-inference` runs it (gRPC server and AsyncLLM
frontend here, the engine core in the child process AsyncLLM spawns) on a tiny dense model
made on the spot. The gRPC client runs in a process of its own (this script with --client,
a child of this one, told what to run on its stdin and answering on its stdout), as every
real client (orchestrator, router) does: in one process, the client's grpc.aio work would
share the GIL and the event loop with the service and be counted against the service. A
round submits all prompts at once; rounds alternate between the two paths. Both paths ask
for the same tokens: temperature 1 with a seed per prompt, the sampled token's logprob, no
detokenization; the direct path hands vLLM the very SamplingParams the service makes for
the request, so that the two differ only in what the service adds.

The ratio is the median over round pairs (one round of each path, back to back) of gRPC
tokens/s over direct tokens/s: a pair sees nearly the same load from others, and the median
leaves out the pair that an outside burst hit (the ratio of the two paths' fastest rounds is
printed as well; it favours whichever path happened to meet the quietest spell, so it is not
the result). A gRPC round is timed in the client, from its first request to its last
response. Rounds go on until the two fastest rounds of each path agree within 10% (each path
has met a quiet spell twice), up to --max-rounds. Before the rounds, each path runs one
full-size round unmeasured, and the startup heap of both processes is frozen as
`primerl-inference` does (primerl_common.server.freeze_startup_heap): a full garbage
collection of it costs 0.2-0.3 s and otherwise lands in whichever round is unlucky.

Two stream modes, each path in its own terms:
- final: one message per request (StreamOptions.final_only; directly, FINAL_ONLY outputs), as
  an RL rollout consumes a completion. This is the RESULT.
- token: one message per token (the contract's default; directly, vLLM's per-step DELTA
  outputs). Python gRPC costs ~60-80 us of CPU per message on each side (server, client),
  which a tiny model making ~3k tokens/s on two cores feels; shown for reference.
The CPU time per token of the service process (AsyncLLM frontend and, on the gRPC path, the
gRPC server) is printed for both paths, and the client process's for the gRPC path: unlike
tokens/s they hardly depend on the load of others. Neither counts the engine core process.

Last line: RESULT grpc_vs_direct_tokens_ratio=<x> weight_update_s=<y>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import statistics
import sys
import tempfile
import time

from primerl_common.local_vllm import set_local_vllm_env
from primerl_common.malloc import MALLOC_ENV

# vLLM reads its settings at import, glibc the MALLOC ones when a process starts (the engine
# core's and the client's); values already in the environment win.
set_local_vllm_env()
for _name, _value in MALLOC_ENV.items():
    os.environ.setdefault(_name, _value)

from safetensors.torch import load_file  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cpu_burner import cpu_burner  # noqa: E402

from primerl.common.v1 import generation_pb2, tensor_pb2  # noqa: E402
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc  # noqa: E402
from primerl_common.client import make_channel  # noqa: E402
from primerl_common.server import freeze_startup_heap  # noqa: E402
from primerl_common.tensors import iter_tensor_chunks  # noqa: E402

# vLLM and the service are imported where the service runs (bench, direct_round): the client
# process needs neither, and importing vLLM costs ~8 s of CPU.

MODES = ("final", "token")


def prompts(num_prompts: int, prompt_len: int) -> list[list[int]]:
    return [[(31 * p + 7 * i) % 250 + 1 for i in range(prompt_len)] for p in range(num_prompts)]


async def direct_round(llm, batch: list[list[int]], max_tokens: int, mode: str) -> int:
    """All prompts to the AsyncLLM at once; the number of tokens generated."""
    from vllm.inputs.engine import tokens_input

    from primerl_inference.generation import GenerateRequest, SamplingSpec, StreamPolicy
    from primerl_inference.streaming import sampling_params

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


async def client_main(args: argparse.Namespace) -> None:
    """The client process: one JSON command a line on stdin, one JSON answer a line on stdout.

    {"round": mode} -> {"tokens", "wall_s", "cpu_s"} (a gRPC round, timed here);
    {"update": version, "model": path} -> {"client_s", "pause_s", "total_s"}."""
    batch = prompts(args.num_prompts, args.prompt_len)
    async with make_channel(args.client) as channel:
        stub = inference_pb2_grpc.InferenceServiceStub(channel)
        freeze_startup_heap()
        while line := await asyncio.to_thread(sys.stdin.readline):
            command = json.loads(line)
            if "round" in command:
                started, cpu_started = time.perf_counter(), time.process_time()
                num_tokens = await grpc_round(stub, batch, args.max_tokens, command["round"])
                answer = {
                    "tokens": num_tokens,
                    "wall_s": time.perf_counter() - started,
                    "cpu_s": time.process_time() - cpu_started,
                }
            else:
                tensors = load_file(command["model"])
                started = time.perf_counter()
                response = await stub.UpdateWeights(update_stream(tensors, command["update"]))
                answer = {
                    "client_s": time.perf_counter() - started,
                    "pause_s": response.pause_s,
                    "total_s": response.total_s,
                }
            print(json.dumps(answer), flush=True)


class ClientProcess:
    """This script with --client, a child process that talks to the service over gRPC."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self._process = process

    @classmethod
    async def start(cls, address: str) -> ClientProcess:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            *sys.argv[1:],
            "--client",
            address,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(process)

    async def call(self, **command) -> dict:
        self._process.stdin.write(json.dumps(command).encode() + b"\n")
        await self._process.stdin.drain()
        line = await self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the client process exited with {await self._process.wait()}")
        return json.loads(line)

    async def close(self) -> None:
        self._process.stdin.close()
        await self._process.wait()


async def measure(path: str, llm, client: ClientProcess, batch, args, mode: str) -> tuple[float, float, float]:
    """One round of `path`: tokens/s, the service's CPU seconds per token, the client's."""
    started, cpu_started = time.perf_counter(), time.process_time()
    if path == "gRPC":
        answer = await client.call(round=mode)
        service_cpu_s = time.process_time() - cpu_started
        return answer["tokens"] / answer["wall_s"], service_cpu_s / answer["tokens"], answer["cpu_s"] / answer["tokens"]
    num_tokens = await direct_round(llm, batch, args.max_tokens, mode)
    wall_s, service_cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
    return num_tokens / wall_s, service_cpu_s / num_tokens, 0.0


async def compare(llm, client: ClientProcess, batch, args: argparse.Namespace, mode: str) -> float:
    """The median over round pairs of gRPC/direct tokens/s in stream mode `mode`."""
    measured: dict[str, list[tuple[float, float, float]]] = {"direct": [], "gRPC": []}
    for index in range(args.max_rounds):
        for path in ("direct", "gRPC") if index % 2 == 0 else ("gRPC", "direct"):
            measured[path].append(await measure(path, llm, client, batch, args, mode))
        direct, grpc = measured["direct"][-1], measured["gRPC"][-1]
        print(
            f"{mode} round {index}: direct {direct[0]:.0f} tokens/s ({1e6 * direct[1]:.0f} us service CPU/token), "
            f"gRPC {grpc[0]:.0f} tokens/s ({1e6 * grpc[1]:.0f} us service + {1e6 * grpc[2]:.0f} us client "
            "CPU/token)",
            flush=True,
        )
        if index + 1 >= max(args.min_rounds, 2) and all(_settled(rounds) for rounds in measured.values()):
            break
    best = {path: max(tps for tps, _, _ in rounds) for path, rounds in measured.items()}
    pair_ratios = [g[0] / d[0] for g, d in zip(measured["gRPC"], measured["direct"], strict=True)]
    ratio = statistics.median(pair_ratios)

    def median_us(path: str, column: int) -> float:
        return 1e6 * statistics.median(row[column] for row in measured[path])

    print(
        f"{mode}: ratio {ratio:.3f} (median of round pairs; fastest direct {best['direct']:.0f} tokens/s, "
        f"fastest gRPC {best['gRPC']:.0f} tokens/s, ratio of the fastest {best['gRPC'] / best['direct']:.3f}); "
        f"median CPU/token: service {median_us('direct', 1):.0f} us direct, {median_us('gRPC', 1):.0f} us gRPC; "
        f"gRPC client {median_us('gRPC', 2):.0f} us",
        flush=True,
    )
    return ratio


def _settled(rounds: list[tuple[float, float, float]]) -> bool:
    """Whether the two fastest rounds agree within 10%."""
    fastest, second = sorted((tps for tps, _, _ in rounds), reverse=True)[:2]
    return second >= 0.9 * fastest


async def bench(args: argparse.Namespace, work_dir: pathlib.Path) -> None:
    from primerl_common.server import GrpcService
    from primerl_inference.config import InferenceConfig
    from primerl_inference.engine import InferenceEngine
    from primerl_inference.server import service_definition
    from primerl_launcher.tiny_model import make_tiny_model

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
        tls={"mode": "plaintext"},  # loopback
    )
    engine = await InferenceEngine.start(config)
    service = GrpcService(service_definition(engine, config), config)
    port = await service.start()
    client = await ClientProcess.start(f"127.0.0.1:{port}")
    freeze_startup_heap()
    llm = engine.llm  # both paths go to the same engine
    batch = prompts(args.num_prompts, args.prompt_len)
    print(
        f"tiny dense float32 model, {args.num_prompts} prompts x {args.prompt_len} tokens -> "
        f"{args.max_tokens} tokens each, {args.min_rounds}-{args.max_rounds} rounds per path and stream mode, "
        "gRPC client in its own process",
        flush=True,
    )
    try:
        for mode in MODES:  # warm-up of both paths, full size
            await direct_round(llm, batch, args.max_tokens, mode)
            await client.call(round=mode)
        ratios = {mode: await compare(llm, client, batch, args, mode) for mode in MODES}

        tensors = load_file(model_dir / "model.safetensors")
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        update_s = []
        for version in range(1, args.updates + 1):
            answer = await client.call(update=version, model=str(model_dir / "model.safetensors"))
            update_s.append(answer["client_s"])
            print(
                f"weight update {version}: {len(tensors)} tensors, {num_bytes / 2**20:.1f} MiB, "
                f"{update_s[-1]:.3f}s at the client (server: paused {answer['pause_s']:.3f}s, "
                f"total {answer['total_s']:.3f}s)",
                flush=True,
            )
    finally:
        await client.close()
        await service.stop(grace_s=0)
    print(f"RESULT grpc_vs_direct_tokens_ratio={ratios['final']:.3f} weight_update_s={statistics.median(update_s):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--min-rounds", type=int, default=9, help="rounds per path and stream mode, at least")
    parser.add_argument("--max-rounds", type=int, default=16, help="rounds per path and stream mode, at most")
    parser.add_argument("--updates", type=int, default=3, help="full weight updates timed (median reported)")
    parser.add_argument("--burner", action="store_true", help="run beside bench/cpu_burner.py's half-busy process")
    parser.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)  # the client process's mode
    args = parser.parse_args()
    if args.client:
        asyncio.run(client_main(args))
        return
    with tempfile.TemporaryDirectory(prefix="primerl-bench-inference-") as work_dir, cpu_burner(args.burner) as beside:
        print(beside)
        asyncio.run(bench(args, pathlib.Path(work_dir)))


if __name__ == "__main__":
    main()
