"""`primerl up` with real service processes (the cheap ones: router, kvstore, weight
broadcaster) and the launch file's splitting, wiring and validation."""

from __future__ import annotations

import ipaddress
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import tomllib

import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from primerl.orchestrator.v1 import orchestrator_pb2
from primerl_common.processes import free_port
from primerl_common.security import certificate_identity, identity_uri
from primerl_common.testing import bare_server
from primerl_launcher import _toml
from primerl_launcher.certs import run_certificates
from primerl_launcher.checks import check_dtypes, check_outside_peers
from primerl_launcher.cli import demo_config_text
from primerl_launcher.progress import StallWatch, describe_groups
from primerl_launcher.report import format_summary, summary
from primerl_launcher.run import keep_state_in_run_dir, prepare_model, validate_configs, write_configs
from primerl_launcher.service_group import RestartPolicy
from primerl_launcher.spec import LaunchConfigError, parse_launch_file
from primerl_launcher.tiny_model import make_tiny_model
from primerl_launcher.warm_start import sft_trainer_spec
from primerl_launcher.wiring import address_of, identities, served_hosts, wire

PRIMERL = [sys.executable, "-m", "primerl_launcher"]
CHEAP = "[router.policy]\nname = 'round_robin'\n[kvstore]\n[weight_broadcaster]\n"


# ---------------------------------------------------------------------------- the launch file


def test_tables_split_into_one_config_per_process():
    launch = parse_launch_file(
        {
            "launcher": {"inference_replicas": 2},
            "inference": {"engine": {"dtype": "float32"}},
            "router": {},
            "kvstore": {"server": {"port": 7000}},
        }
    )
    assert list(launch.services) == ["kvstore", "inference-0", "inference-1", "router"]
    replicas = [launch.services[f"inference-{i}"] for i in range(2)]
    assert [r.table for r in replicas] == [{"engine": {"dtype": "float32"}}] * 2
    assert replicas[0].table is not replicas[1].table  # copies: each gets its own port and id
    array = parse_launch_file({"inference": [{"replica": {"id": "a"}}, {"engine": {"seed": 1}}]})
    assert [(s.name, s.where) for s in array.services.values()] == [
        ("inference-0", "[[inference]] #1"),
        ("inference-1", "[[inference]] #2"),
    ]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"trainr": {}}, r"\[trainr\]: unknown table"),
        ({"router": {}, "launcher": {"modle": "x"}}, r"\[launcher\] modle: unknown key"),
        ({"router": {}, "launcher": {"inference_replicas": 0}}, r"\[launcher\] inference_replicas: Input should be"),
        ({"router": {}, "launcher": {"model": "/no/such/model"}}, r"\[launcher\] model: '/no/such/model' is neither"),
        ({"router": {}, "launcher": {"max_restarts": -1}}, r"\[launcher\] max_restarts: Input should be"),
        (
            {"router": {}, "launcher": {"restart_backoff_s": 5, "restart_backoff_max_s": 1}},
            r"\[launcher\] restart_backoff_max_s: Value error, must be at least restart_backoff_s \(5.0\), got 1.0",
        ),
        ({"router": {}, "warm_start": {"num_samples": 0}}, r"\[warm_start\] num_samples: Input should be"),
        ({"orchestrator": {}, "warm_start": {}}, r"\[warm_start\] needs a \[trainer\] table"),
        ({"router": 3}, r"router: must be a table"),
        ({"inference": [1, 2]}, r"inference: must be a table"),
        ({"launcher": {}}, r"no service table"),
        ({"router": {}, "launcher": {"tls": "tcp"}}, r"\[launcher\] tls: Input should be 'plaintext' or 'mtls'"),
        (
            {"router": {}, "launcher": {"host": "0.0.0.0"}},
            r"\[launcher\] tls: Value error, plaintext is allowed only on a loopback host, not '0.0.0.0'",
        ),
    ],
)
def test_bad_launch_files_name_the_table_and_field(data, message):
    with pytest.raises(LaunchConfigError, match=message):
        parse_launch_file(data)


def test_restart_waits_double_up_to_the_most():
    policy = RestartPolicy(max_restarts=5, backoff_s=1.0, max_backoff_s=5.0)
    assert [policy.delay_s(k) for k in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    with pytest.raises(ValueError, match="backoff_s <= max_backoff_s"):
        RestartPolicy(backoff_s=2.0, max_backoff_s=1.0)


def test_state_folders_go_under_the_run_dir_unless_named(tmp_path):
    launch = parse_launch_file(
        {
            "orchestrator": {"environments": [{"name": "e"}], "output": {"checkpoint_dir": "/elsewhere"}},
            "trainer": {},
            "inference": {},
        }
    )
    warnings = keep_state_in_run_dir(launch.services, tmp_path)
    assert launch.services["trainer"].table["checkpoint"]["dir"] == str(tmp_path / "trainer" / "checkpoints")
    assert launch.services["orchestrator"].table["output"]["checkpoint_dir"] == "/elsewhere"  # named: kept
    [warning] = warnings
    assert warning.startswith("[trainer] checkpoint.interval is 0: a trainer restarted after a crash")
    launch.services["trainer"].table["checkpoint"]["interval"] = 1
    assert keep_state_in_run_dir(launch.services, tmp_path) == []


def test_the_embedded_demo_parses():
    launch = parse_launch_file(tomllib.loads(demo_config_text()))
    assert set(launch.services) == {f"inference-{i}" for i in range(launch.launcher.inference_replicas)} | {
        "orchestrator",
        "trainer",
        "router",
        "weight_broadcaster",
        "kvstore",
    }
    assert launch.launcher.model == "tiny-dense" and launch.warm_start is not None


@pytest.mark.parametrize(("name", "model_type"), [("tiny-vl", "qwen3_vl"), ("tiny-vl-moe", "qwen3_vl_moe")])
def test_a_tiny_vision_model_is_made_and_filled_into_the_services(tmp_path, name, model_type):
    launch = parse_launch_file(
        {"launcher": {"model": name, "cache_dir": str(tmp_path / "cache")}, "trainer": {}, "inference": {}}
    )
    model = prepare_model(launch.launcher)
    assert model is not None and model.parent == tmp_path / "cache" and model.name.startswith(f"{name}-float32-")
    config = json.loads((model / "config.json").read_text())
    assert config["model_type"] == model_type and "vision_config" in config
    assert (model / "preprocessor_config.json").is_file()
    assert prepare_model(launch.launcher) == model  # cached: made once
    wire(launch.services, run_dir=tmp_path / "run", model=model, host="127.0.0.1")
    assert launch.services["inference-0"].table["engine"]["model"] == str(model)
    assert launch.services["trainer"].table["model"]["path"] == str(model)


def test_wiring_fills_every_link_that_is_unset(tmp_path):
    launch = parse_launch_file(
        {
            "launcher": {"inference_replicas": 2},
            "orchestrator": {"peers": {"trainer": "elsewhere:1"}, "environments": [{"name": "e"}]},
            "trainer": {},
            "inference": {},
            "router": {"server": {"port": 6123}},
            "weight_broadcaster": {},
            "kvstore": {},
        }
    )
    services = launch.services
    wire(services, run_dir=tmp_path, model=tmp_path / "model", host="127.0.0.1")
    tables = {name: spec.table for name, spec in services.items()}
    addresses = {name: address_of(spec) for name, spec in services.items()}
    ports = [table["server"]["port"] for table in tables.values()]
    assert len(set(ports)) == len(ports) and all(port > 0 for port in ports)
    assert addresses["router"] == "127.0.0.1:6123"  # given ports are kept
    assert tables["router"]["replicas"] == [
        {"replica_id": "inference-0", "address": addresses["inference-0"]},
        {"replica_id": "inference-1", "address": addresses["inference-1"]},
    ]
    assert tables["router"]["versions"]["weight_broadcaster_address"] == addresses["weight_broadcaster"]
    assert tables["orchestrator"]["peers"] == {
        "trainer": "elsewhere:1",  # set in the file: kept
        "router": addresses["router"],
        "weight_broadcaster": addresses["weight_broadcaster"],
    }
    assert tables["orchestrator"]["output"]["metrics_jsonl"] == str(tmp_path / "orchestrator" / "metrics.jsonl")
    assert tables["trainer"]["publish"]["weight_broadcaster"] == addresses["weight_broadcaster"]
    model = str(tmp_path / "model")
    assert tables["trainer"]["model"]["path"] == tables["orchestrator"]["model"]["path"] == model
    assert tables["inference-0"]["engine"]["model"] == tables["inference-1"]["engine"]["model"] == model
    assert tables["inference-1"]["replica"]["id"] == "inference-1"
    # What is written is what was wired.
    assert tomllib.loads(_toml.dumps(tables["orchestrator"])) == tables["orchestrator"]


def test_a_lora_trainer_publishes_its_adapter_which_replicas_serve_and_rollouts_use(tmp_path):
    def wired(trainer: dict, **tables: dict) -> dict:
        launch = parse_launch_file(
            {
                "launcher": {"inference_replicas": 2},
                "orchestrator": {"environments": [{"name": "e"}]},
                "trainer": trainer,
                "inference": {},
                "router": {},
                "weight_broadcaster": {},
                **tables,
            }
        )
        wire(launch.services, run_dir=tmp_path, model=tmp_path / "model", host="127.0.0.1")
        return {name: spec.table for name, spec in launch.services.items()}

    tables = wired({"lora": {"enabled": True, "rank": 12}, "publish": {"adapter_name": "run-a"}})
    assert tables["trainer"]["publish"]["kind"] == "adapter"
    assert tables["orchestrator"]["model"]["lora_adapter"] == "run-a"
    for replica in ("inference-0", "inference-1"):
        assert tables[replica]["engine"]["enable_lora"] is True and tables[replica]["engine"]["max_lora_rank"] == 12
    # Merged whole weights, as the file says: nothing adapter-specific is wired.
    tables = wired({"lora": {"enabled": True}, "publish": {"kind": "full"}})
    assert "lora_adapter" not in tables["orchestrator"]["model"]
    assert "enable_lora" not in tables["inference-0"]["engine"]
    # LoRA off: neither.
    assert "kind" not in wired({})["trainer"].get("publish", {})


def test_a_trainer_with_runs_publishes_an_adapter_per_run_which_every_replica_can_hold(tmp_path):
    """No orchestrator: each run's own orchestrator, started beside the launch, names its run."""
    launch = parse_launch_file(
        {
            "launcher": {"inference_replicas": 2},
            "trainer": {"lora": {"enabled": True, "rank": 8}, "runs": {"max_concurrent_runs": 6}},
            "inference": {},
            "router": {},
            "weight_broadcaster": {},
        }
    )
    wire(launch.services, run_dir=tmp_path, model=tmp_path / "model", host="127.0.0.1")
    tables = {name: spec.table for name, spec in launch.services.items()}
    assert "orchestrator" not in tables
    # Each run's adapter is named by its run id: no adapter name of the trainer's own.
    assert tables["trainer"]["publish"]["kind"] == "adapter" and "adapter_name" not in tables["trainer"]["publish"]
    for replica in ("inference-0", "inference-1"):
        assert tables[replica]["engine"] == {
            "model": str(tmp_path / "model"),
            "enable_lora": True,
            "max_lora_rank": 8,
            "max_loras": 6,
        }


def test_under_mtls_every_service_gets_its_own_certificate_and_process_environments_the_environment_one(tmp_path):
    launch = parse_launch_file(
        {
            "launcher": {"tls": "mtls", "host": "10.1.2.3"},
            "orchestrator": {
                "environments": [{"name": "v", "kind": "verifiers"}, {"name": "b"}],
                "peers": {"router": "elsewhere:1"},
            },
            "trainer": {},
            "kvstore": {"tls": {"mode": "mtls", "cert": "own.pem"}},
        }
    )
    services = launch.services
    certs = tmp_path / "certs"
    tls = run_certificates(certs, identities(services), hosts=served_hosts(services, launch.launcher.host))
    wire(services, run_dir=tmp_path, model=tmp_path / "model", host=launch.launcher.host, tls=tls)
    for name, spec in services.items():
        table = spec.table["tls"]
        assert table["mode"] == "mtls" and table["ca"] == str(certs / "ca.pem")
        if name == "kvstore":
            assert table["cert"] == "own.pem"  # set in the file: kept
            continue
        assert table["cert"] == str(certs / f"{name}.pem") and table["key"] == str(certs / f"{name}-key.pem")
        names = x509.load_pem_x509_certificate((certs / f"{name}.pem").read_bytes()).extensions
        alternatives = names.get_extension_for_class(x509.SubjectAlternativeName).value
        assert identity_uri(spec.service, name) in alternatives.get_values_for_type(x509.UniformResourceIdentifier)
        assert ipaddress.ip_address("10.1.2.3") in alternatives.get_values_for_type(x509.IPAddress)
    assert certificate_identity((certs / "operator.pem").read_bytes()) == ("operator", frozenset({"operator"}))
    verifiers, builtin = services["orchestrator"].table["environments"]
    assert verifiers["options"] == {
        "tls_cert": str(certs / "environment.pem"),
        "tls_key": str(certs / "environment-key.pem"),
    }
    assert certificate_identity((certs / "environment.pem").read_bytes()) == ("environment", frozenset({"environment"}))
    assert "options" not in builtin


def test_warm_start_job_is_the_trainer_with_overrides_in_sft_mode(tmp_path):
    launch = parse_launch_file(
        {
            "launcher": {"model": "tiny-dense"},
            "orchestrator": {"environments": [{"name": "e"}]},
            "trainer": {"optimizer": {"lr": 1e-6, "weight_decay": 0.1}, "checkpoint": {"dir": "/ckpt"}},
            "weight_broadcaster": {},
            "warm_start": {"trainer": {"optimizer": {"lr": 3e-3}, "sft": {"max_steps": 5}}},
        }
    )
    wire(launch.services, run_dir=tmp_path, model=tmp_path / "model", host="127.0.0.1")
    table = sft_trainer_spec(launch, tmp_path).table
    assert table["optimizer"] == {"lr": 3e-3, "weight_decay": 0.1}
    assert table["mode"] == "sft" and table["sft"]["max_steps"] == 5 and table["sft"]["exit_when_done"] is True
    assert table["sft"]["dataset"] == str(tmp_path / "warm_start" / "sft.jsonl")
    assert table["export"]["hf_dir"] == str(tmp_path / "warm_start" / "model")
    assert "weight_broadcaster" not in table["publish"] and "dir" not in table["checkpoint"]
    assert launch.services["trainer"].table["optimizer"]["lr"] == 1e-6  # the RL trainer is untouched


def test_toml_writer_round_trips():
    data = {
        "a": 1,
        "b": 'quote " and \\ and\nnewline',
        "c": [1.5, True, "x"],
        "weird key": {"inner": {"x": -0.0}},
        "environments": [{"name": "e", "sampling": {"max_tokens": 3}}, {"name": "f", "options": {}}],
    }
    assert tomllib.loads(_toml.dumps(data)) == data


# ---------------------------------------------------------------------------- what a run needs

# A newcomer's first run file: one replica asked for, an external environment, a trainer.
NEWCOMER = {
    "launcher": {"model": "tiny-dense", "inference_replicas": 1},
    "orchestrator": {"environments": [{"name": "env"}]},
    "trainer": {},
}


def test_the_serving_side_a_run_needs_is_started_on_its_defaults(tmp_path):
    launch = parse_launch_file(NEWCOMER)
    assert set(launch.services) == {"inference-0", "router", "weight_broadcaster", "trainer", "orchestrator"}
    # Said at start, with why.
    assert [added.split()[0] for added in launch.added] == ["[inference]", "[router]", "[weight_broadcaster]"]
    wire(launch.services, run_dir=tmp_path, model=tmp_path / "model", host="127.0.0.1")
    tables = {name: spec.table for name, spec in launch.services.items()}
    addresses = {name: address_of(spec) for name, spec in launch.services.items()}
    assert tables["orchestrator"]["peers"]["router"] == addresses["router"]
    assert tables["router"]["replicas"] == [{"replica_id": "inference-0", "address": addresses["inference-0"]}]
    assert tables["trainer"]["publish"]["weight_broadcaster"] == addresses["weight_broadcaster"]
    # A peer address the file sets stands for one outside the run: nothing is started for it.
    outside = parse_launch_file(NEWCOMER | {"orchestrator": {"peers": {"router": "elsewhere:1"}}})
    assert "router" not in outside.services and "inference-0" in outside.services


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"launcher": {"model": "tiny-dense"}, "orchestrator": {}},
            r"\[orchestrator\] needs a trainer: add a \[trainer\] table",
        ),
        (
            {"orchestrator": {}, "trainer": {}},
            r"\[orchestrator\] generates through a router that needs replicas but no \[inference\] table: add one "
            r"\(engine.model\), or set \[launcher\] model",
        ),
        (
            {"launcher": {"inference_replicas": 2}, "router": {}},
            r"\[launcher\] inference_replicas = 2 but no \[inference\] table",
        ),
    ],
)
def test_a_run_file_missing_what_it_needs_is_refused_naming_it(data, message):
    with pytest.raises(LaunchConfigError, match=message):
        parse_launch_file(data)


def test_a_peer_outside_the_run_that_nothing_serves_is_refused_before_anything_starts(tmp_path):
    port = free_port()
    text = f"[router]\nreplicas = [{{replica_id = 'a', address = '127.0.0.1:{port}'}}]\n"
    stderr = up_refused(tmp_path, text)
    assert f"[router] replicas[0].address = '127.0.0.1:{port}': nothing serves there" in stderr
    assert not (tmp_path / "run" / "logs").exists()


async def test_a_peer_outside_the_run_that_serves_is_accepted():
    servicer = health.aio.HealthServicer()
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    async with bare_server(lambda server: health_pb2_grpc.add_HealthServicer_to_server(servicer, server)) as address:
        launch = parse_launch_file(
            {"trainer": {"publish": {"weight_broadcaster": address}}, "router": {}, "weight_broadcaster": {}}
        )
        wire(launch.services, run_dir=pathlib.Path("unused"), model=None, host="127.0.0.1")
        # The router's broadcaster is the run's own (wired); the trainer's is the outside one.
        assert await check_outside_peers(launch.services) == [f"[trainer] publish.weight_broadcaster = {address}"]


@pytest.fixture(scope="module")
def float32_model(tmp_path_factory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("model") / "tiny-dense", kind="dense", dtype="float32")


async def validated(tmp_path, float32_model, data) -> tuple[dict, dict]:
    launch = parse_launch_file(data)
    wire(launch.services, run_dir=tmp_path, model=float32_model, host="127.0.0.1")
    paths = write_configs(list(launch.services.values()), tmp_path / "config")
    return launch.services, await validate_configs(list(launch.services.values()), paths, dict(os.environ))


async def test_inference_in_another_dtype_than_the_trainer_computes_in_is_refused_unless_allowed(
    tmp_path, float32_model
):
    # engine.dtype auto is the model's (float32); the trainer computes in bfloat16 unless told.
    services, configs = await validated(tmp_path, float32_model, {"trainer": {}, "inference": {}})
    message = (
        r"\[inference\] engine.dtype = float32 \(auto: the model's config.json\) differs from \[trainer\] "
        r"model.compute_dtype = bfloat16"
    )
    with pytest.raises(LaunchConfigError, match=message + r".*allow_dtype_mismatch = true to run like this"):
        check_dtypes(services, configs, allowed=False)
    assert "mismatch_kl > 0" in check_dtypes(services, configs, allowed=True)

    same = {"trainer": {"model": {"compute_dtype": "float32"}}, "inference": {}}
    services, configs = await validated(tmp_path, float32_model, same)
    assert check_dtypes(services, configs, allowed=False) is None


def test_the_launcher_refuses_the_dtype_mismatch_before_anything_starts(tmp_path, float32_model):
    text = f"[launcher]\nmodel = '{float32_model}'\n[trainer]\n[inference.engine]\ndtype = 'float32'\n"
    stderr = up_refused(tmp_path, text, timeout_s=180)
    assert "[inference] engine.dtype = float32 differs from [trainer] model.compute_dtype = bfloat16" in stderr
    assert not (tmp_path / "run" / "logs").exists()


def groups(**counts: int) -> orchestrator_pb2.GetRunStatusResponse:
    return orchestrator_pb2.GetRunStatusResponse(
        state=orchestrator_pb2.RUN_STATE_RUNNING, max_steps=6, groups=orchestrator_pb2.GroupCounts(**counts)
    )


def test_groups_that_end_without_a_batch_are_shown_and_warned_about_once_a_minute_has_passed():
    watch = StallWatch(warn_after_s=60)
    assert watch.update(groups(), now=0.0) is None and watch.shows_groups(groups())  # no step yet
    status = groups(finished=12, filtered_equal_rewards=10, incomplete=2, episodes_timed_out=1)
    assert watch.update(status, now=59.0) is None  # not a minute yet
    warning = watch.update(status, now=61.0)
    assert warning is not None and warning.startswith("no batch for 61s while 14 groups ended (12 finished)")
    assert "10 filtered for equal rewards" in warning and "advantage.filter_zero_advantage = false" in warning
    assert "2 incomplete" in warning and "1 episodes timed out ([orchestrator] run.episode_timeout_s)" in warning
    assert watch.update(status, now=200.0) is None  # said once per stall
    assert describe_groups(status.groups) == (
        "groups 12 finished, 10 filtered (equal rewards), 2 incomplete, 0 batched, 1 episodes timed out"
    )
    # A step resets it; groups ending after it are shown again, and warned about a minute later.
    stepped = groups(finished=13, filtered_equal_rewards=10, incomplete=2, episodes_timed_out=1, batched=1)
    stepped.step = 1
    assert watch.update(stepped, now=201.0) is None and not watch.shows_groups(stepped)
    later = groups(finished=15, filtered_equal_rewards=12, incomplete=2, episodes_timed_out=1, batched=1)
    later.step = 1
    assert watch.update(later, now=230.0) is None and watch.shows_groups(later)
    assert watch.update(later, now=262.0).startswith("no batch for 61s while 2 groups ended (2 finished): 2 filtered")


def test_the_run_report_counts_the_groups():
    status = groups(finished=40, filtered_equal_rewards=36, incomplete=3, episodes_timed_out=2, batched=4)
    text = format_summary(summary([], wall_time_s=1.0, groups=status.groups))
    assert "groups: 40 finished, 36 filtered for equal rewards, 3 incomplete (2 episodes timed out), 4 batched" in text


# ---------------------------------------------------------------------------- real processes


def launch_file(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "launch.toml"
    path.write_text(text)
    return path


def up_refused(tmp_path: pathlib.Path, text: str, *, timeout_s: float = 120) -> str:
    """`primerl up` on this run file, expected to refuse it (exit 2) before anything starts: its stderr."""
    result = subprocess.run(
        [*PRIMERL, "up", "-c", str(launch_file(tmp_path, text)), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert result.returncode == 2, result
    return result.stderr


def start(tmp_path: pathlib.Path, text: str) -> tuple[subprocess.Popen[str], pathlib.Path]:
    run_dir = tmp_path / "run"
    log = (tmp_path / "launcher.out").open("w")
    process = subprocess.Popen(
        [*PRIMERL, "up", "-c", str(launch_file(tmp_path, text)), "--run-dir", str(run_dir)],
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return process, run_dir


def output(tmp_path: pathlib.Path) -> str:
    return (tmp_path / "launcher.out").read_text()


def wait_for_services(process: subprocess.Popen[str], run_dir: pathlib.Path, tmp_path) -> dict:
    deadline = time.monotonic() + 240  # a shared 2-core box can be slow to start even these
    while not (run_dir / "services.json").is_file():
        assert process.poll() is None, output(tmp_path)
        assert time.monotonic() < deadline, output(tmp_path)
        time.sleep(0.1)
    return json.loads((run_dir / "services.json").read_text())


def alive(pid: int) -> bool:
    """Running (a zombie, whose parent has not reaped it yet, has stopped)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_service_config_errors_name_the_table_and_field_and_nothing_starts(tmp_path):
    text = "[router.policy]\nname = 'nope'\n[router.health]\ninterval_s = -1\n[kvstore.server]\nprot = 3\n"
    stderr = up_refused(tmp_path, text)
    assert "[kvstore] server.prot: unknown key" in stderr
    assert "[router] policy: Value error, unknown routing policy 'nope'" in stderr
    assert "[router] health.interval_s: Input should be greater than 0" in stderr
    assert not (tmp_path / "run" / "logs").exists()  # validated before anything started
    # The config each service would have got is there to look at.
    assert tomllib.loads((tmp_path / "run" / "config" / "router.toml").read_text())["policy"]["name"] == "nope"


def serving(address: str) -> bool:
    import grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_service_that_dies_is_restarted_on_its_address_until_its_restarts_are_spent(tmp_path):
    text = "[launcher]\ncheck_config = false\nmax_restarts = 1\nrestart_backoff_s = 0.2\n" + CHEAP
    process, run_dir = start(tmp_path, text)
    try:
        services = wait_for_services(process, run_dir, tmp_path)
        kvstore = services["kvstore"]
        os.kill(kvstore["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 120
        while (restarted := json.loads((run_dir / "services.json").read_text())["kvstore"])["restarts"] != 1:
            assert process.poll() is None and time.monotonic() < deadline, output(tmp_path)
            time.sleep(0.1)
        assert restarted["address"] == kvstore["address"] and restarted["pid"] != kvstore["pid"]
        assert serving(kvstore["address"])  # on the same port, SERVING (services.json is written after)
        others = [services[name]["pid"] for name in ("router", "weight_broadcaster")]
        assert all(alive(pid) for pid in others)  # the others went on

        os.kill(restarted["pid"], signal.SIGKILL)  # once more than max_restarts allows
        assert process.wait(60) == 1
    finally:
        process.kill()
    out = output(tmp_path)
    log = run_dir / "logs" / "kvstore.log"
    assert f"kvstore was killed by SIGKILL: restart 1 of 1 in 0.2s (log: {log})" in out, out
    assert f"kvstore SERVING again at {kvstore['address']}" in out
    assert (
        "error: kvstore died after 1 restart, the most [launcher] max_restarts = 1 allows: "
        f"kvstore was killed by SIGKILL (log: {log}); last lines:"
    ) in out, out
    assert "serving kvstore" in out  # the tail of its log
    assert out.index("error: kvstore") < out.index("stopping weight_broadcaster, router")
    assert not any(alive(pid) for pid in [*others, restarted["pid"]])
    for name in ("router", "weight_broadcaster"):
        assert f"stopped {name}" in (run_dir / "logs" / f"{name}.log").read_text()  # a graceful stop
    assert log.read_text().count("serving kvstore") == 2  # one log, appended by the restart


def test_a_service_that_fails_to_start_is_named_with_its_log(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        text = f"[launcher]\ncheck_config = false\n{CHEAP}[kvstore.server]\nport = {port}\n"
        process, _ = start(tmp_path, text)
        try:
            assert process.wait(90) == 1
        finally:
            process.kill()
    out = output(tmp_path)
    assert "error: kvstore exited with code 1" in out, out
    assert f"127.0.0.1:{port}" in out  # from its log: the address it could not bind
    assert "all services SERVING" not in out


def test_ctrl_c_stops_every_service_cleanly(tmp_path):
    process, run_dir = start(tmp_path, CHEAP)
    try:
        services = wait_for_services(process, run_dir, tmp_path)
        assert all(alive(service["pid"]) for service in services.values())
        process.send_signal(signal.SIGINT)
        assert process.wait(60) == 130
    finally:
        process.kill()
    out = output(tmp_path)
    assert "configuration: valid (kvstore, weight_broadcaster, router" in out
    assert "all services stopped" in out and "interrupted: every service stopped" in out, out
    assert not any(alive(service["pid"]) for service in services.values())
    for name in services:
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert f"stopped {name}" in log and "Traceback" not in log, log


def test_services_stop_on_their_own_when_the_launcher_is_killed(tmp_path):
    process, run_dir = start(tmp_path, "[launcher]\ncheck_config = false\n" + CHEAP)
    try:
        services = wait_for_services(process, run_dir, tmp_path)
        process.kill()  # no chance to stop anything: the kernel tells the services (SIGTERM)
        process.wait(10)
        deadline = time.monotonic() + 60
        while any(alive(service["pid"]) for service in services.values()):
            assert time.monotonic() < deadline, "services outlived the launcher"
            time.sleep(0.1)
    finally:
        process.kill()
    for name in services:
        assert f"stopped {name}" in (run_dir / "logs" / f"{name}.log").read_text()  # gracefully
