"""`primerl up` in the inference deployment shapes of several replicas ([inference.deployment])
on the tiny Qwen3-MoE with router replay: `replicas` (two behind the router, on the KV pool) and
`disaggregated` (1 prefill + 1 decode replica, the KV pool between them, the router
splitting each request). Each run trains its few steps with mismatch_kl below 1e-3; every pushed
sample has a routed-experts row for every token; in the disaggregated shape the decode replica
computes fewer prompt tokens than it serves, the pool supplying the difference (its hits counted
in the records of the run), and the progress line shows both groups. The `single` shape (one
replica, the launcher's default) is what tests/test_demo.py and most live runs start.

Kept short (CI time): two steps of four rollouts, answers of a few tokens; the prompts carry a
long system prompt so that they span several whole KV blocks, the unit the pool moves.
"""

from __future__ import annotations

import pathlib

import pytest
from safetensors.torch import load_file

from . import live_runs

pytestmark = pytest.mark.slow

MAX_STEPS = 2
MAX_MISMATCH_KL = 1e-3
# ~300 tokens with the byte-level tokenizer: the prompt spans whole KV blocks.
SYSTEM_PROMPT = "Reverse the text. " * 17
SHAPES = {
    "replicas": 'shape = "replicas"\nreplicas = 2\nkv_pool = true',
    "disaggregated": 'shape = "disaggregated"\nprefill = 1\ndecode = 1',
}


def launch_file(shape: str, batches: pathlib.Path) -> str:
    return f"""
{live_runs.launcher_section("tiny-moe")}check_config = false   # tested with cheap services in tools/launcher/tests

[inference.deployment]
{SHAPES[shape]}

{live_runs.inference_engine(max_model_len=512, max_num_seqs=8, kv_cache_gib=0.25)}
{live_runs.orchestrator_head(max_model_len=512, max_steps=MAX_STEPS, batch_size=4)}max_async_level = 1
max_off_policy_steps = 1
{live_runs.NO_ZERO_ADVANTAGE_FILTER}[orchestrator.output]
batches_dir = "{batches}"
{live_runs.reverse_text_environment(group_size=2, max_tokens=6)}[orchestrator.environments.options]
system_prompt = "{SYSTEM_PROMPT}"
max_length = 6

{live_runs.trainer_section(seq_len=2048, router_replay=True, optimizer=False)}
{live_runs.router_and_broadcaster(no_replica_wait_s=120.0)}"""


def run_up(tmp_path: pathlib.Path, shape: str) -> tuple[str, list[dict]]:
    config, run_dir, out = tmp_path / "launch.toml", tmp_path / "run", tmp_path / "launcher.out"
    config.write_text(launch_file(shape, tmp_path / "batches"))
    with live_runs.primerl_up(config, run_dir, out) as launcher:
        assert launcher.wait(600) == 0, out.read_text()
    records = live_runs.read_records(run_dir)
    return out.read_text(), records


def check_routed_experts(batches: pathlib.Path) -> int:
    """Every micro-batch of every pushed batch has one routed-experts row per token, each a
    valid expert index; returns the tokens checked."""
    checked = 0
    for path in sorted(batches.glob("step_*.safetensors")):
        tensors = load_file(path)
        index = 0
        while f"micro_batch_{index}.input_ids" in tensors:
            tokens = tensors[f"micro_batch_{index}.input_ids"]
            routed = tensors[f"micro_batch_{index}.routed_experts"]
            assert routed.shape[0] == tokens.shape[0], (path, index, routed.shape, tokens.shape)
            assert routed.ndim == 3 and routed.shape[1] >= 1 and routed.shape[2] >= 1
            checked += tokens.shape[0]
            index += 1
    return checked


@pytest.mark.parametrize("shape", list(SHAPES))
def test_primerl_up_trains_in_each_deployment_shape(tmp_path: pathlib.Path, shape: str) -> None:
    printed, records = run_up(tmp_path, shape)

    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1)), printed
    for record in records:
        assert record["mismatch_kl"] is not None and record["mismatch_kl"] < MAX_MISMATCH_KL, record
    assert check_routed_experts(tmp_path / "batches") > 0
    assert "not a clean exit" not in printed, printed
    last = records[-1]["replica_load"]
    if shape == "replicas":
        assert {name: load["role"] for name, load in last.items()} == {"inference-0": "both", "inference-1": "both"}
        return
    assert {name: load["role"] for name, load in last.items()} == {
        "inference-prefill-0": "prefill",
        "inference-decode-0": "decode",
    }
    decode = last["inference-decode-0"]
    computed = decode["prompt_tokens"] - decode["prefix_cache_hit_tokens"]
    assert computed < decode["prompt_tokens"], decode
    assert decode["kv_pool_hit_tokens"] > 0, decode  # not only its own prefix cache: the pool's blocks
    prefill = last["inference-prefill-0"]
    assert computed < prefill["prompt_tokens"] - prefill["prefix_cache_hit_tokens"], last  # prefill did the work
    assert records[-1]["replica_groups"]["decode"]["kv_pool_hit_tokens"] == decode["kv_pool_hit_tokens"]
    assert "prefill q " in printed and "| decode q " in printed and "pool hit " in printed, printed
