import json
import subprocess
import sys

import pytest

from primerl_trainer.planner.cli import main
from primerl_trainer.planner.shapes import BUILTIN_SHAPES


def test_plan_of_a_builtin_shape_lists_fitting_meshes_first(capsys):
    code = main(["--shape", "Kimi-K2", "--gpus", "256", "--gpu", "h200", "--seq-len", "65536",
                 "--tokens-per-step", str(64 * 65536), "--top", "0", "--json"])  # fmt: skip
    assert code == 0
    rows = json.loads(capsys.readouterr().out)
    fits = [row["fits"] for row in rows]
    assert any(fits) and not all(fits)
    assert fits == sorted(fits, reverse=True)
    fitting = [row["time"] for row in rows if row["fits"]]
    totals = [sum(part.values()) for part in fitting]
    assert totals == sorted(totals)


def test_plan_reads_the_config_and_its_model_path(tmp_path, capsys):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(BUILTIN_SHAPES["Qwen3-30B-A3B"]))
    config = tmp_path / "trainer.toml"
    config.write_text(f'seq_len = 8192\n[model]\npath = "{model}"\ndtype = "bfloat16"\n[parallel]\nep = 2\ncp = 2\n')
    assert main(["-c", str(config), "--gpus", "8", "--gpu", "h100", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "model: 30.5B parameters" in out and "rows of 8,192" in out and "master weights 16-bit" in out
    # The best row, and the config's mesh (with and without checkpointing) marked, however it ranks.
    rows = [line for line in out.splitlines() if line.startswith("dp")]
    marked = [line for line in rows if line.startswith("dp4 cp2 ep2 *")]
    assert len(marked) == 2 and len(rows) == (2 if rows[0] in marked else 3)
    assert "* the config's mesh (parallel.cp 2, parallel.ep 2)" in out


def test_plan_with_fp8_counts_the_dense_grids_third_all_to_all(capsys):
    # FP8 experts take no padded copies: on the dense grid (128 experts over 2 ranks, 8 a token)
    # each MoE layer's forward makes one all-to-all call more; nothing else changes.
    argv = ["--shape", "Qwen3-30B-A3B", "--gpus", "2", "--gpu", "h200", "--top", "0", "--json"]
    times = {}
    for fp8 in (False, True):
        assert main(argv + (["--fp8"] if fp8 else [])) == 0
        rows = json.loads(capsys.readouterr().out)
        times[fp8] = {(row["mesh"], row["activation_checkpointing"]): row["time"] for row in rows}
    ep2 = [key for key in times[False] if "ep2" in key[0]]
    assert ep2
    for key in ep2:
        plain, fp8 = times[False][key], times[True][key]
        assert fp8["ep"] > plain["ep"]
        assert {k: v for k, v in fp8.items() if k != "ep"} == {k: v for k, v in plain.items() if k != "ep"}
    assert all(times[True][key] == times[False][key] for key in times[False] if key not in ep2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gpus", "8"], "--shape"),
        (["--shape", "Qwen3-30B-A3B", "--gpus", "8", "--gpu", "a100"], "--gpu 'a100'"),
        (["--shape", "nope", "--gpus", "8"], "unknown shape"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_plan_imports_no_torch():
    code = (
        "import sys; from primerl_trainer.__main__ import main; "
        "assert main(['plan', '--shape', 'GLM-5', '--gpus', '64', '--top', '3']) == 0; "
        "print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "False"
