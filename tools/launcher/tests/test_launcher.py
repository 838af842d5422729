"""`primerl up` with real service processes (the cheap ones: router, kvstore, weight
broadcaster) and the launch file's splitting, wiring and validation."""

from __future__ import annotations

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

from primerl_launcher import _toml
from primerl_launcher.cli import demo_config_text
from primerl_launcher.spec import LaunchConfigError, parse_launch_file
from primerl_launcher.warm_start import sft_trainer_spec
from primerl_launcher.wiring import address_of, wire

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
        ({"router": {}, "warm_start": {"num_samples": 0}}, r"\[warm_start\] num_samples: Input should be"),
        ({"orchestrator": {}, "warm_start": {}}, r"\[warm_start\] needs a \[trainer\] table"),
        ({"router": 3}, r"router: must be a table"),
        ({"inference": [1, 2]}, r"inference: must be a table"),
        ({"launcher": {}}, r"no service table"),
    ],
)
def test_bad_launch_files_name_the_table_and_field(data, message):
    with pytest.raises(LaunchConfigError, match=message):
        parse_launch_file(data)


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


def test_warm_start_job_is_the_trainer_with_overrides_in_sft_mode(tmp_path):
    launch = parse_launch_file(
        {
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


# ---------------------------------------------------------------------------- real processes


def launch_file(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "launch.toml"
    path.write_text(text)
    return path


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
    result = subprocess.run(
        [*PRIMERL, "up", "-c", str(launch_file(tmp_path, text)), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result
    assert "[kvstore] server.prot: unknown key" in result.stderr
    assert "[router] policy: Value error, unknown routing policy 'nope'" in result.stderr
    assert "[router] health.interval_s: Input should be greater than 0" in result.stderr
    assert not (tmp_path / "run" / "logs").exists()  # validated before anything started
    # The config each service would have got is there to look at.
    assert tomllib.loads((tmp_path / "run" / "config" / "router.toml").read_text())["policy"]["name"] == "nope"


def test_a_service_that_dies_is_named_and_the_others_are_stopped(tmp_path):
    process, run_dir = start(tmp_path, "[launcher]\ncheck_config = false\n" + CHEAP)
    try:
        services = wait_for_services(process, run_dir, tmp_path)
        os.kill(services["kvstore"]["pid"], signal.SIGKILL)
        assert process.wait(60) == 1
    finally:
        process.kill()
    out = output(tmp_path)
    assert f"error: kvstore was killed by SIGKILL (log: {run_dir / 'logs' / 'kvstore.log'}); last lines:" in out
    assert "serving kvstore" in out  # the tail of its log
    assert out.index("error: kvstore") < out.index("stopping weight_broadcaster, router")
    assert not any(alive(service["pid"]) for service in services.values())
    for name in ("router", "weight_broadcaster"):
        assert f"stopped {name}" in (run_dir / "logs" / f"{name}.log").read_text()  # a graceful stop


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
