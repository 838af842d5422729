"""`primerl samples` on a run folder's samples (text and HTML) and `primerl eval`'s table."""

from __future__ import annotations

import hashlib
import io
import json
import re
import urllib.parse

import pytest
from PIL import Image

from primerl_launcher.cli import main
from primerl_launcher.evaluate import format_results


def png(color: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (4, 3), color).save(out, format="PNG")
    return out.getvalue()


# The files of the images folder, by path relative to the samples folder.
IMAGE_FILES = {f"images/{hashlib.sha256(data).hexdigest()}.png": data for data in (png("red"), png("blue"))}
IMAGES = [{"path": path, "mime_type": "image/png", "digest": path[7:-4]} for path in IMAGE_FILES]

ROWS = [
    {
        "step": 3,
        "environment": "reverse_text",
        "group_id": "0123456789abcdef",
        "episode_id": "e1",
        "sample_index": 0,
        "prompt": "system\nReverse the text.\nuser\nabc <b>",
        "completion": "cba",
        "reward": 1.0,
        "advantage": 0.5,
        "policy_version": 2,
        "num_tokens": 20,
        "num_loss_tokens": 4,
        "images": IMAGES,
    },
    {
        "step": 3,
        "environment": "reverse_text",
        "group_id": "0123456789abcdef",
        "episode_id": "e2",
        "sample_index": 0,
        "prompt": "system\nReverse the text.\nuser\nabc <b>",
        "completion": "x" * 500,
        "reward": 0.0,
        "advantage": -0.5,
        "policy_version": 2,
        "num_tokens": 30,
        "num_loss_tokens": 14,
        "images": [],
    },
]


def _run_dir(tmp_path, *, configured: bool):
    run = tmp_path / "run"
    samples = tmp_path / "elsewhere" if configured else run / "orchestrator" / "samples"
    samples.mkdir(parents=True)
    (samples / "step_000003.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (samples / "images").mkdir()
    for path, data in IMAGE_FILES.items():
        (samples / path).write_bytes(data)
    if configured:
        (run / "config").mkdir(parents=True)
        (run / "config" / "orchestrator.toml").write_text(f'[output]\nsamples_dir = "{samples}"\n')
    return run


def test_samples_prints_a_step_and_names_the_steps_there(tmp_path, capsys):
    run = _run_dir(tmp_path, configured=False)
    assert main(["samples", str(run), "--step", "3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("step 3: 2 samples, reward mean 0.500")
    assert "#0 reverse_text  reward 1.000  advantage +0.500  policy version 2  group 01234567" in out
    assert "completion: cba" in out and "... (100 more)" in out
    assert f"images:     {IMAGES[0]['path']}, {IMAGES[1]['path']}" in out and out.count("images:") == 1
    assert main(["samples", str(run), "--step", "4"]) == 1
    err = capsys.readouterr().err
    assert "no samples of step 4" in err and "steps 3..3 are there" in err


# Beside the run, deeper elsewhere, in the samples folder itself (the configured tmp_path/elsewhere).
@pytest.mark.parametrize("where", ["page.html", "pages/of/run/page.html", "elsewhere/page.html"])
def test_samples_html_page_shows_the_images_wherever_it_is_written(tmp_path, capsys, monkeypatch, where):
    run = _run_dir(tmp_path, configured=True)
    monkeypatch.chdir(tmp_path)  # the page's path relative to the working folder, as typed
    page = tmp_path / where
    page.parent.mkdir(parents=True, exist_ok=True)
    assert main(["samples", str(run), "--step", "3", "--html", where]) == 0
    text = page.read_text()
    assert text.count('<tr class="pos">') == 1 and text.count('<tr class="neg">') == 1
    assert "abc &lt;b&gt;" in text and "abc <b>" not in text
    sources = re.findall(r'<img src="([^"]+)"', text)
    shown = [(page.parent / urllib.parse.unquote(source)).read_bytes() for source in sources]
    assert shown == list(IMAGE_FILES.values())
    assert f"2 samples of step 3: {where}" in capsys.readouterr().out


def test_eval_results_as_a_table():
    results = [
        {
            "name": "heldout",
            "environment": "reverse_text",
            "num_tasks": 4,
            "num_samples": 2,
            "reward_mean": 0.25,
            "reward_std": 0.1,
            "pass@1": 0.125,
            "pass@2": 0.25,
            "num_errors": 0,
            "duration_s": 3.21,
        }
    ]
    header, rule, row = format_results(results).splitlines()
    assert header.split("  ")[0] == "eval" and "tasks x samples" in header
    assert header.split()[-5:] == ["pass@1", "pass@2", "errors", "time", "(s)"]
    assert set(rule) == {"-", " "}
    assert row.split() == ["heldout", "reverse_text", "4", "x", "2", "0.250", "0.100", "0.125", "0.250", "0", "3.2"]
