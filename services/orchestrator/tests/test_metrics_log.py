"""The metrics file keeps one line per step: the lines of steps the trainer does not hold are
removed before those steps are collected again."""

import json

from primerl_orchestrator.metrics import MetricsLog


def test_rewind_removes_the_lines_of_a_step_and_later(tmp_path):
    log = MetricsLog(tmp_path / "out" / "metrics.jsonl")
    assert log.rewind(1) == 0  # no file yet
    for step in (1, 2, 3, 4):
        log.write({"step": step, "loss": step / 10})
    assert log.rewind(5) == 0
    assert log.rewind(3) == 2
    log.write({"step": 3, "loss": 0.0})
    records = [json.loads(line) for line in log.path.read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in records] == [(1, 0.1), (2, 0.2), (3, 0.0)]
    # Replaced whole: no temporary file is left behind.
    assert [p.name for p in log.path.parent.iterdir()] == ["metrics.jsonl"]
