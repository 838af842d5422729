"""`[[runs]]` in a launch file: many LoRA runs on one trainer, each with its own orchestrator
(primerl_launcher.spec parses them, primerl_launcher.runs writes each run's orchestrator)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import pathlib
import sys
import tomllib

import grpc
import pytest
from cryptography import x509

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.processes import ServiceProcess
from primerl_common.testing import bare_server
from primerl_launcher import _toml
from primerl_launcher.certs import run_certificates
from primerl_launcher.progress import RunFailed
from primerl_launcher.run import write_configs
from primerl_launcher.runs import (
    RunsFollower,
    create_runs,
    format_runs_summary,
    report_runs,
    run_holders,
    run_orchestrator_specs,
    service_name,
)
from primerl_launcher.service_group import RestartPolicy, ServiceGroup
from primerl_launcher.spec import LaunchConfigError, parse_launch_file
from primerl_launcher.wiring import address_of, identities, wire

TRAINER = {"lora": {"enabled": True, "rank": 8}, "runs": {"max_concurrent_runs": 2}}
TEMPLATE = {
    "run": {"max_steps": 5, "batch_size": 8},
    "environments": [{"name": "reverse_text", "kind": "reverse_text"}],
}


def launch_data(runs: list[dict] | None, **tables) -> dict:
    """A launch file with a LoRA trainer of two runs, the runs' template and `runs`; `tables`
    replace its tables (None: left out)."""
    data = {"launcher": {"model": "tiny-dense"}, "trainer": TRAINER, "orchestrator": TEMPLATE, "runs": runs}
    return copy.deepcopy({key: value for key, value in (data | tables).items() if value is not None})


def test_runs_are_parsed_with_their_spec_and_their_orchestrator_laid_over_the_template():
    launch = parse_launch_file(
        launch_data(
            [
                {"id": "a", "owner": "alice", "spec": {"lora_rank": 4, "seed": 3, "learning_rate": 1e-3}},
                {
                    "id": "b",
                    "spec": {"mode": "TRAINING_MODE_SFT", "warmup_steps": 2},
                    "orchestrator": {"run": {"max_steps": 2}, "seed": 7},
                },
            ]
        )
    )
    first, second = launch.runs
    assert (first.id, first.owner, first.where) == ("a", "alice", "[[runs]] #1")
    assert first.spec == trainer_pb2.RunSpec(lora_rank=4, seed=3, learning_rate=1e-3)
    assert first.orchestrator == TEMPLATE and first.max_steps == 5
    assert second.owner is None  # plaintext: the run is the operator's (the launcher's) to name
    assert second.spec == trainer_pb2.RunSpec(mode=trainer_pb2.TRAINING_MODE_SFT, warmup_steps=2)
    assert second.orchestrator == {
        "run": {"max_steps": 2, "batch_size": 8},
        "environments": TEMPLATE["environments"],
        "seed": 7,
    }
    assert second.max_steps == 2
    # The template is no service of its own; what the runs' orchestrators need is added.
    assert "orchestrator" not in launch.services
    assert {"trainer", "router", "weight_broadcaster", "inference-0"} <= set(launch.services)
    assert any(added.startswith("[router]") for added in launch.added)


def test_without_an_orchestrator_template_each_run_brings_its_own():
    [run] = parse_launch_file(
        launch_data([{"id": "a", "orchestrator": {"run": {"max_steps": 3}}}], orchestrator=None)
    ).runs
    assert run.orchestrator == {"run": {"max_steps": 3}}


def test_without_runs_the_orchestrator_is_a_service_as_before():
    launch = parse_launch_file(launch_data(None))
    assert launch.runs == [] and launch.services["orchestrator"].table == TEMPLATE


@pytest.mark.parametrize(
    ("runs", "tables", "message"),
    [
        ([], {}, "runs: must be an array of tables ([[runs]]), at least one"),
        ([{"owner": "alice"}], {}, "[[runs]] #1 id: required, a string"),
        ([{"id": "a"}, {"id": "-b"}], {}, "[[runs]] #2 id: '-b' is not an adapter name"),
        ([{"id": "a"}, {"id": "a"}], {}, "[[runs]] #2 id: 'a' is also the id of [[runs]] #1"),
        ([{"id": "a", "name": "x"}], {}, "[[runs]] #1 name: unknown key; known: id, owner, spec, orchestrator"),
        ([{"id": "a", "owner": "a b"}], {}, "[[runs]] #1 owner: 'a b' is not a tenant name"),
        ([{"id": "a", "spec": {"lora_rnk": 2}}], {}, "[[runs]] #1 spec.lora_rnk: unknown field of trainer.v1 RunSpec"),
        ([{"id": "a", "spec": {"learning_rate": "fast"}}], {}, "[[runs]] #1 spec.learning_rate: Couldn't parse"),
        ([{"id": "a", "spec": {"mode": "SFT"}}], {}, "[[runs]] #1 spec.mode: Failed to parse mode field"),
        ([{"id": "a", "spec": 3}], {}, "[[runs]] #1 spec: must be a table"),
        (
            [{"id": "a"}],
            {"orchestrator": {"environments": []}},
            "[[runs]] #1 orchestrator.run.max_steps: required, in the run's table or in [orchestrator]",
        ),
        ([{"id": "a"}, {"id": "b"}, {"id": "c"}], {}, "[trainer] runs.max_concurrent_runs: must be at least"),
        ([{"id": "a"}], {"trainer": {"runs": {"max_concurrent_runs": 2}}}, "[trainer] lora.enabled: must be true"),
        ([{"id": "a"}], {"trainer": None}, "[[runs]] needs a [trainer] table"),
        ([{"id": "a"}], {"warm_start": {}}, "[warm_start]: not with [[runs]]"),
        (
            [{"id": "a"}],
            {"launcher": {"model": "tiny-dense", "tls": "mtls"}},
            '[[runs]] #1 owner: required under [launcher] tls = "mtls"',
        ),
    ],
)
def test_bad_runs_are_refused_naming_the_run_and_the_field(runs, tables, message):
    with pytest.raises(LaunchConfigError) as error:
        parse_launch_file(launch_data(runs, **tables))
    assert message in str(error.value)


def test_an_owner_may_not_take_the_name_of_a_certificate_of_the_run():
    launch = parse_launch_file(
        launch_data([{"id": "a", "owner": "operator"}], launcher={"model": "tiny-dense", "tls": "mtls"})
    )
    with pytest.raises(LaunchConfigError, match=r"\[\[runs\]\] #1 owner: 'operator' is the name of a certificate"):
        run_holders(launch.runs, list(identities(launch.services)))


def services_json(tmp_path: pathlib.Path) -> dict:
    """The listing of the running services a run's orchestrator is wired to."""
    trainer = tmp_path / "trainer.toml"
    trainer.write_text(_toml.dumps({"model": {"path": "/models/tiny"}, **TRAINER}))
    return {
        "router": {"address": "127.0.0.1:1"},
        "weight_broadcaster": {"address": "127.0.0.1:2"},
        "trainer": {"address": "127.0.0.1:3", "config": str(trainer)},
    }


def test_each_run_s_orchestrator_feeds_its_run_and_keeps_its_state_in_the_run_dir(tmp_path):
    launch = parse_launch_file(launch_data([{"id": "a"}, {"id": "b", "orchestrator": {"seed": 9}}]))
    specs, paths = run_orchestrator_specs(
        launch.runs, services_json(tmp_path), run_dir=tmp_path / "run", host="127.0.0.1", tls=None
    )
    assert list(specs) == ["orchestrator-a", "orchestrator-b"] == [service_name(run) for run in launch.runs]
    ports = set()
    for run in launch.runs:
        name = service_name(run)
        written = tomllib.loads(paths[name].read_text())
        assert paths[name] == tmp_path / "run" / "config" / f"{name}.toml" and specs[name].table == written
        assert specs[name].service == "orchestrator" and specs[name].where == f"{run.where} orchestrator"
        assert written["peers"] == {
            "run_id": run.id,
            "router": "127.0.0.1:1",
            "weight_broadcaster": "127.0.0.1:2",
            "trainer": "127.0.0.1:3",
        }
        out = tmp_path / "run" / "runs" / run.id
        assert written["output"] == {
            "checkpoint_dir": str(out / "checkpoint"),
            "metrics_jsonl": str(out / "metrics.jsonl"),
            "samples_dir": str(out / "samples"),
        }
        assert written["tls"] == {"mode": "plaintext"} and written["run"] == TEMPLATE["run"]
        assert written["tracking"] == {"config_dir": str(tmp_path / "run" / "config")}
        ports.add(written["server"]["port"])
    assert len(ports) == 2
    assert tomllib.loads(paths["orchestrator-b"].read_text())["seed"] == 9


def wired_listing(services: dict, run_dir: pathlib.Path) -> dict:
    """services.json of `services` wired and their configs written as `primerl up` does, without
    starting them."""
    wire(services, run_dir=run_dir, model=run_dir / "model", host="127.0.0.1")
    paths = write_configs(list(services.values()), run_dir / "config")
    return {
        name: {"service": spec.service, "address": address_of(spec), "config": str(paths[name])}
        for name, spec in services.items()
    }


@pytest.mark.parametrize(
    ("inference", "pool_model"),
    [({}, ""), ({"kv_cache_pool": {"model": "tiny"}}, "tiny")],
    ids=["pool-of-every-model", "pool-of-a-named-model"],
)
def test_where_the_replicas_pool_their_kv_cache_each_run_s_orchestrator_is_wired_to_the_pool(
    tmp_path, inference, pool_model
):
    """Each run's orchestrator gets the links the launcher's own orchestrator gets (wiring.wire),
    the kvstore among them: it removes a policy version's KV namespace once nothing can use it."""
    deployment = {"deployment": {"shape": "replicas", "replicas": 2, "kv_pool": True}}
    launch = parse_launch_file(launch_data([{"id": "a"}, {"id": "b"}], inference=copy.deepcopy(inference) | deployment))
    assert {"kvstore", "inference-0", "inference-1"} <= set(launch.services)
    run_dir = tmp_path / "run"
    listing = wired_listing(launch.services, run_dir)
    specs, _ = run_orchestrator_specs(launch.runs, listing, run_dir=run_dir, host="127.0.0.1", tls=None)
    # The launcher's own orchestrator, of the same launch file without [[runs]].
    own = parse_launch_file(launch_data(None, inference=copy.deepcopy(inference) | deployment))
    wire(own.services, run_dir=tmp_path / "own", model=tmp_path / "own" / "model", host="127.0.0.1")
    own_peers = own.services["orchestrator"].table["peers"]
    assert own_peers["kv_cache_pool"] == address_of(own.services["kvstore"])
    assert own_peers["kv_cache_pool_model"] == pool_model
    for run, spec in zip(launch.runs, specs.values(), strict=True):
        assert spec.table["peers"] == {
            "run_id": run.id,
            **{peer: listing[peer]["address"] for peer in ("router", "trainer", "weight_broadcaster")},
            "kv_cache_pool": address_of(launch.services["kvstore"]),
            "kv_cache_pool_model": own_peers["kv_cache_pool_model"],
        }
        assert spec.table["tracking"]["config_dir"] == str(run_dir / "config")
        assert own.services["orchestrator"].table["tracking"]["config_dir"] == str(tmp_path / "own" / "config")


def test_without_the_kv_pool_a_run_s_orchestrator_has_no_pool_peer(tmp_path):
    launch = parse_launch_file(
        launch_data([{"id": "a"}], inference={"deployment": {"shape": "replicas", "replicas": 2}})
    )
    run_dir = tmp_path / "run"
    specs, _ = run_orchestrator_specs(
        launch.runs, wired_listing(launch.services, run_dir), run_dir=run_dir, host="127.0.0.1", tls=None
    )
    assert "kvstore" not in launch.services
    assert "kv_cache_pool" not in specs["orchestrator-a"].table["peers"]


def test_a_pool_peer_the_run_s_table_sets_is_kept(tmp_path):
    deployment = {"deployment": {"shape": "replicas", "replicas": 2, "kv_pool": True}}
    own = {"peers": {"kv_cache_pool": "10.0.0.1:7", "kv_cache_pool_model": "other"}}
    launch = parse_launch_file(launch_data([{"id": "a", "orchestrator": own}], inference=deployment))
    run_dir = tmp_path / "run"
    specs, _ = run_orchestrator_specs(
        launch.runs, wired_listing(launch.services, run_dir), run_dir=run_dir, host="127.0.0.1", tls=None
    )
    peers = specs["orchestrator-a"].table["peers"]
    assert (peers["kv_cache_pool"], peers["kv_cache_pool_model"]) == ("10.0.0.1:7", "other")


def test_under_mtls_a_run_s_orchestrator_shows_a_certificate_named_after_its_owner(tmp_path):
    launch = parse_launch_file(
        launch_data(
            [{"id": "a", "owner": "alice"}, {"id": "b", "owner": "alice"}],
            launcher={"model": "tiny-dense", "tls": "mtls"},
            orchestrator={**TEMPLATE, "environments": [{"name": "v", "kind": "verifiers"}]},
        )
    )
    holders = run_holders(launch.runs, list(identities(launch.services)))
    assert holders == {"alice": ["orchestrator"]}  # one per owner
    certs = tmp_path / "certs"
    tls = run_certificates(certs, {**identities(launch.services), **holders})
    specs, _ = run_orchestrator_specs(
        launch.runs, services_json(tmp_path), run_dir=tmp_path / "run", host="127.0.0.1", tls=tls
    )
    for spec in specs.values():
        assert spec.table["tls"] == {
            "mode": "mtls",
            "cert": str(certs / "alice.pem"),
            "key": str(certs / "alice-key.pem"),
            "ca": str(certs / "ca.pem"),
        }
        assert spec.table["environments"][0]["options"]["tls_cert"] == str(certs / "environment.pem")
    certificate = x509.load_pem_x509_certificate((certs / "alice.pem").read_bytes())
    names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://primerl/orchestrator/alice"]


async def test_a_discarded_service_is_stopped_and_never_restarted(tmp_path):
    group = ServiceGroup()
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    for name in ("kept", "dropped"):
        group.add(ServiceProcess(sleeper, name=name, log_path=tmp_path / f"{name}.log"))
        group.processes[name].launch()
    watch = asyncio.ensure_future(group.supervise(RestartPolicy(1, 0.5), start_timeout_s=5, say=print, poll_s=0.05))
    try:
        group.processes["dropped"].kill()
        await asyncio.sleep(0.2)  # its restart is waiting
        assert group.restarts == {"dropped": 1}
        await group.discard("dropped", grace_s=1)
        await asyncio.sleep(0.8)
        assert list(group.processes) == ["kept"] and not watch.done()
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await group.stop([], grace_s=1)


def test_the_runs_summary_says_how_each_run_ended(tmp_path, capsys):
    runs = {
        "a": {
            "outcome": "finished",
            "owner": "alice",
            "step": 6,
            "max_steps": 6,
            "served_versions": {"inference-0": 6},
            "orchestrator_restarts": 1,
        },
        "b": {
            "outcome": "deleted",
            "owner": "",
            "step": 3,
            "max_steps": 6,
            "served_versions": {},
            "orchestrator_restarts": 0,
        },
    }
    assert format_runs_summary(runs).splitlines() == [
        "runs:",
        "  a (alice): finished, step 6/6, adapter version served 6, orchestrator restarts 1",
        "  b (no owner): deleted, step 3/6, adapter version served -, orchestrator restarts 0",
    ]
    assert report_runs(runs, {"orchestrator-a": 1, "router": 0}, tmp_path, wall_time_s=12.34)
    assert json.loads((tmp_path / "summary.json").read_text()) == {
        "runs": runs,
        "wall_time_s": 12.3,
        "restarts": {"orchestrator-a": 1},
    }
    assert format_runs_summary(runs) in capsys.readouterr().out
    unfinished = {"a": {**runs["a"], "outcome": "unfinished"}}
    assert not report_runs(unfinished, {}, tmp_path, wall_time_s=1.0)


class FakeTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """The runs of a trainer, as GetRun and CreateRun tell them."""

    def __init__(self, runs: dict[str, trainer_pb2.Run]) -> None:
        self.runs = runs

    async def CreateRun(self, request, context):
        if request.run_id in self.runs:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"run {request.run_id!r} exists")
        self.runs[request.run_id] = trainer_pb2.Run(run_id=request.run_id, owner=request.owner, spec=request.spec)
        return trainer_pb2.CreateRunResponse(run=self.runs[request.run_id])

    async def GetRun(self, request, context):
        if request.run_id not in self.runs:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no run {request.run_id!r}")
        return trainer_pb2.GetRunResponse(run=self.runs[request.run_id])


class FakeReplica(inference_pb2_grpc.InferenceServiceServicer):
    def __init__(self) -> None:
        self.adapter_versions: dict[str, int] = {}

    async def GetLoad(self, request, context):
        return inference_pb2.GetLoadResponse(load=generation_pb2.LoadReport(adapter_versions=self.adapter_versions))


@contextlib.asynccontextmanager
async def fakes(runs: dict[str, trainer_pb2.Run]):
    trainer, replica = FakeTrainer(runs), FakeReplica()
    async with (
        bare_server(functools.partial(trainer_pb2_grpc.add_TrainerServiceServicer_to_server, trainer)) as at_trainer,
        bare_server(
            functools.partial(inference_pb2_grpc.add_InferenceServiceServicer_to_server, replica)
        ) as at_replica,
    ):
        yield trainer, replica, at_trainer, at_replica


def two_runs() -> list:
    return parse_launch_file(launch_data([{"id": "a", "owner": "alice"}, {"id": "b", "owner": "bob"}])).runs


async def test_runs_are_created_and_one_the_trainer_has_already_is_taken_as_it_is():
    said = []
    restored = trainer_pb2.Run(run_id="b", owner="bob", step=4)
    async with fakes({"b": restored}) as (trainer, _, address, _):
        created = await create_runs(address, two_runs(), say=said.append)
        assert created["a"].owner == "alice" and created["a"].spec.ByteSize() == 0 and created["b"] == restored
        assert said == [
            "run a: created for alice (the trainer's settings)",
            "run b: exists already (restored from its checkpoints) at step 4; going on",
        ]
        trainer.runs["b"].owner = "mallory"
        with pytest.raises(LaunchConfigError, match=r"\[\[runs\]\] #2 owner: run 'b' exists already on the trainer"):
            await create_runs(address, two_runs(), say=said.append)


async def test_the_follow_ends_once_each_run_is_served_at_its_last_step_or_deleted(tmp_path):
    active = trainer_pb2.RUN_STATE_ACTIVE
    runs = {
        run_id: trainer_pb2.Run(run_id=run_id, owner=owner, state=active)
        for run_id, owner in (("a", "alice"), ("b", "bob"))
    }
    group, said = ServiceGroup(), []
    group.add(ServiceProcess([sys.executable, "-c", "import time; time.sleep(60)"], name="orchestrator-b"))
    group.processes["orchestrator-b"].launch()
    async with fakes(runs) as (trainer, replica, at_trainer, at_replica):
        follower = RunsFollower(
            two_runs(),
            trainer=at_trainer,
            replicas={"inference-0": at_replica},
            group=group,
            poll_interval_s=0.05,
            finish_timeout_s=30,
            stop_grace_s=5,
            say=said.append,
        )
        follow = asyncio.ensure_future(follower.run())
        trainer.runs["a"].step, trainer.runs["a"].next_step = 5, 6
        await asyncio.sleep(0.3)
        assert not follow.done()  # trained, not yet served
        replica.adapter_versions["a"] = 5
        del trainer.runs["b"]
        await asyncio.wait_for(follow, 10)
    assert list(group.processes) == []  # b's orchestrator stopped
    assert "run a: finished, step 5, served at version 5 by every replica" in said
    assert "run b: deleted through the trainer's API at step 0; dropped from the follow, orchestrator-b stopped" in said
    assert "run a step 5/5 | active | orchestrator restarts 0" in said
    summary = follower.summary()
    assert summary["a"] | {"served_versions": None} == {
        "outcome": "finished",
        "owner": "alice",
        "step": 5,
        "max_steps": 5,
        "served_versions": None,
        "orchestrator_restarts": 0,
    }
    assert summary["a"]["served_versions"] == {"inference-0": 5} and summary["b"]["outcome"] == "deleted"


@pytest.mark.parametrize("failed", [True, False])
async def test_a_failed_run_or_one_not_served_in_time_stops_the_follow(failed):
    runs = {run_id: trainer_pb2.Run(run_id=run_id, step=5, next_step=6) for run_id in ("a", "b")}
    if failed:
        runs["b"].state, runs["b"].error = trainer_pb2.RUN_STATE_FAILED, "step 5: boom"
    async with fakes(runs) as (_, _, at_trainer, at_replica):
        follower = RunsFollower(
            two_runs(),
            trainer=at_trainer,
            replicas={"inference-0": at_replica},
            group=ServiceGroup(),
            poll_interval_s=0.05,
            finish_timeout_s=0.3,
            stop_grace_s=1,
            say=lambda message: None,
        )
        error, message = (RunFailed, "run b failed at step 5: step 5: boom") if failed else (TimeoutError, "a step 5/5")
        with pytest.raises(error, match=message):
            await asyncio.wait_for(follower.run(), 10)
