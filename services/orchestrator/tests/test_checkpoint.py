import json

import pytest
from prometheus_client import REGISTRY

from primerl_orchestrator.checkpoint import CHECKPOINT_FILE, OrchestratorState, load_state, save_state
from primerl_orchestrator.metrics import RunCounters


def test_round_trip(tmp_path):
    assert load_state(tmp_path) is None
    counters = RunCounters(["a", "b"])
    counters.count("a", "episodes_started", 5)
    counters.count("b", "dropped_off_policy", 2)
    state = OrchestratorState(
        step=7, task_positions={"a": 40, "b": 3}, episodes_started={"a": 40, "b": 6}, counters=counters.state()
    )
    path = save_state(tmp_path, state)
    assert path.name == CHECKPOINT_FILE
    assert load_state(tmp_path) == state
    # Replaced whole: no temporary file is left behind.
    save_state(tmp_path, OrchestratorState(step=8))
    assert load_state(tmp_path).step == 8
    assert [p.name for p in tmp_path.iterdir()] == [CHECKPOINT_FILE]


def test_counters_resume_without_counting_twice():
    counters = RunCounters(["a"])
    counters.count("a", "turns", 3)
    restored = RunCounters(["a"])
    restored.restore(counters.state())
    restored.count("a", "turns", 2)
    assert restored.totals["a"].turns == 5
    # The Prometheus counter has everything this process counted.
    assert REGISTRY.get_sample_value("primerl_orchestrator_turns_total", {"environment": "a"}) == 5
    # The first step after a resume reports only what happened since.
    per_env = restored.close_step(policy_version=0)
    assert per_env["a"]["turns"] == 2


def test_unknown_format_is_refused(tmp_path):
    (tmp_path / CHECKPOINT_FILE).write_text(json.dumps({"format_version": 99, "step": 1}))
    with pytest.raises(ValueError, match="checkpoint format 99"):
        load_state(tmp_path)
