"""[inference.deployment]: each shape becomes its replicas (roles, pool switch), the router's
disaggregation and the kvstore, wired; a bad section is refused before anything starts, the
message naming the field."""

from __future__ import annotations

import pytest

from primerl.common.v1 import generation_pb2
from primerl_launcher.deployment import DeploymentConfig
from primerl_launcher.progress import RunMonitor, RunPeers
from primerl_launcher.spec import LaunchConfigError, parse_launch_file
from primerl_launcher.wiring import address_of, wire


def launch(deployment: dict | None = None, **tables: dict) -> dict:
    inference = {"engine": {"dtype": "float32"}}
    if deployment is not None:
        inference["deployment"] = deployment
    return {"inference": inference, **tables}


def test_single_is_one_replica_of_role_both_without_pool(tmp_path):
    parsed = parse_launch_file(launch({"shape": "single"}))
    assert list(parsed.services) == ["inference-0"]
    assert parsed.services["inference-0"].table == {"engine": {"dtype": "float32"}}  # nothing the service lacks
    assert parsed.deployment == DeploymentConfig()


def test_replicas_sit_behind_a_router_and_may_share_the_pool(tmp_path):
    parsed = parse_launch_file(launch({"shape": "replicas", "replicas": 3, "kv_pool": True}))
    assert list(parsed.services) == ["kvstore", "inference-0", "inference-1", "inference-2", "router"]
    assert any(added.startswith("[router]") for added in parsed.added)
    assert any(added.startswith("[kvstore]") for added in parsed.added)
    wire(parsed.services, run_dir=tmp_path, model=None, host="127.0.0.1")
    kvstore = address_of(parsed.services["kvstore"])
    for name in ("inference-0", "inference-1", "inference-2"):
        assert parsed.services[name].table["kv_cache_pool"] == {"enabled": True, "metadata_address": kvstore}
    router = parsed.services["router"].table
    assert [r.get("role", "both") for r in router["replicas"]] == ["both"] * 3
    assert "routing" not in router  # disaggregation stays off (the router's default)
    assert parse_launch_file(launch({"shape": "replicas"})).deployment.num_replicas == 2


def test_disaggregated_is_prefill_and_decode_replicas_the_pool_and_a_splitting_router(tmp_path):
    parsed = parse_launch_file(launch({"shape": "disaggregated", "prefill": 2, "decode": 1}, router={}))
    names = ["inference-prefill-0", "inference-prefill-1", "inference-decode-0"]
    assert list(parsed.services) == ["kvstore", *names, "router"]
    wire(parsed.services, run_dir=tmp_path, model=None, host="127.0.0.1")
    kvstore = address_of(parsed.services["kvstore"])
    roles = [parsed.services[name].table["replica"]["role"] for name in names]
    assert roles == ["prefill", "prefill", "decode"]
    assert all(parsed.services[n].table["kv_cache_pool"]["metadata_address"] == kvstore for n in names)
    router = parsed.services["router"].table
    assert router["routing"] == {"disaggregate": True}
    assert [(r["replica_id"], r["role"]) for r in router["replicas"]] == list(zip(names, roles, strict=True))
    assert parsed.deployment.describe() == "disaggregated (2 prefill + 1 decode, KV pool on)"


def test_the_orchestrator_removes_old_kv_namespaces_where_the_pool_is_on(tmp_path):
    pooled = parse_launch_file(
        launch({"shape": "disaggregated", "prefill": 1, "decode": 1}, router={}, orchestrator={}, trainer={})
    )
    wire(pooled.services, run_dir=tmp_path, model=None, host="127.0.0.1")
    peers = pooled.services["orchestrator"].table["peers"]
    assert peers["kv_cache_pool"] == address_of(pooled.services["kvstore"]) and peers["kv_cache_pool_model"] == ""
    unpooled = parse_launch_file(launch({"shape": "replicas"}, orchestrator={}, trainer={}))
    wire(unpooled.services, run_dir=tmp_path, model=None, host="127.0.0.1")
    assert "kv_cache_pool" not in unpooled.services["orchestrator"].table["peers"]


def test_without_the_section_inference_replicas_gives_the_shape():
    parsed = parse_launch_file({"launcher": {"inference_replicas": 2}, "inference": {}})
    assert parsed.deployment.shape == "replicas" and list(parsed.services) == ["inference-0", "inference-1"]
    assert parse_launch_file({"inference": [{}, {}]}).deployment is None  # replicas listed one by one


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (launch({"shape": "mesh"}), r"\[inference.deployment\] shape: Input should be 'single', 'replicas'"),
        (
            launch({"shape": "single", "replicas": 2}),
            r"\[inference.deployment\] replicas: (Value error, )?.*shape single has one",
        ),
        (
            launch({"shape": "replicas", "prefill": 1}),
            r"\[inference.deployment\] prefill: (Value error, )?only with shape disagg",
        ),
        (
            launch({"shape": "disaggregated", "decode": 1}),
            r"\[inference.deployment\] prefill: (Value error, )?required with shape",
        ),
        (
            launch({"shape": "disaggregated", "prefill": 1}),
            r"\[inference.deployment\] decode: (Value error, )?required with shape",
        ),
        (launch({"shape": "disaggregated", "prefill": 0, "decode": 1}), r"\[inference.deployment\] prefill: Input"),
        (
            launch({"shape": "disaggregated", "prefill": 1, "decode": 1, "kv_pool": False}),
            r"\[inference.deployment\] kv_pool: (Value error, )?.*needs the KV pool",
        ),
        (
            launch({"shape": "disaggregated", "prefill": 1, "decode": 1, "replicas": 2}),
            r"\[inference.deployment\] replicas: (Value error, )?shape disaggregated counts",
        ),
        (launch({"shape": "single", "replica": 1}), r"\[inference.deployment\] replica: unknown key"),
        (
            {**launch({"shape": "replicas"}), "launcher": {"inference_replicas": 2}},
            r"\[launcher\] inference_replicas: not with \[inference.deployment\]",
        ),
        (
            launch({"shape": "replicas"}, router={"routing": {"disaggregate": True}}),
            r"\[router\] routing.disaggregate: the deployment shape sets it to False",
        ),
        (
            {
                "inference": {
                    "deployment": {"shape": "disaggregated", "prefill": 1, "decode": 1},
                    "replica": {"role": "both"},
                }
            },
            r"\[inference\] replica.role: the deployment shape sets it to 'prefill'",
        ),
        (
            {"inference": [{"deployment": {"shape": "single"}}]},
            r"\[\[inference\]\] #1 deployment: the deployment section needs a single \[inference\]",
        ),
        (
            {
                "inference": {"deployment": {"shape": "disaggregated", "prefill": 1, "decode": 1}},
                "orchestrator": {"peers": {"router": "10.0.0.1:1", "trainer": "10.0.0.1:2"}},
            },
            r"\[inference.deployment\] shape: disaggregated needs the run's \[router\]",
        ),
    ],
)
def test_a_bad_deployment_is_refused_naming_the_field(data, message):
    with pytest.raises(LaunchConfigError, match=message):
        parse_launch_file(data)


def test_the_progress_line_shows_each_replica_group_and_the_pool_hit_rate(tmp_path):
    monitor = RunMonitor(
        RunPeers(orchestrator="", trainer="", replicas={}),
        metrics_path=tmp_path / "metrics.jsonl",
        orchestrator_metrics=None,
        poll_interval_s=1.0,
        finish_timeout_s=1.0,
    )
    roles = generation_pb2.REPLICA_ROLE_PREFILL, generation_pb2.REPLICA_ROLE_DECODE
    monitor.loads = {
        "inference-prefill-0": generation_pb2.LoadReport(role=roles[0], num_waiting=3, num_running=1,
                                                         num_prompt_tokens_total=1000),
        "inference-decode-0": generation_pb2.LoadReport(role=roles[1], num_running=4, num_prompt_tokens_total=1000,
                                                        num_prefix_cache_hit_tokens_total=900,
                                                        num_kv_pool_hit_tokens_total=800),
    }  # fmt: skip
    monitor._sum_groups()
    assert monitor.shows_replica_groups()
    line = monitor.postfix()
    assert "prefill q 3 run 1 prefill 0 tok/s | decode q 0 run 4 decode 0 tok/s pool hit 80%" in line, line
    assert monitor.groups["decode"].kv_pool_hit_rate == 0.8
