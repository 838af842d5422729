"""`primerl-trainer`'s entry point validates a config without importing torch."""

import pathlib
import subprocess
import sys

EXAMPLE = pathlib.Path(__file__).parents[1] / "config.example.toml"


def _run(argv: list[str]) -> tuple[int, bool, str]:
    """(exit code, whether torch got imported, stderr) of main(argv) in a fresh interpreter."""
    code = (
        "import sys; from primerl_trainer.__main__ import main; "
        f"code = main({argv!r}); print(code, 'torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    exit_code, imported = result.stdout.split()[-2:]
    return int(exit_code), imported == "True", result.stderr


def test_check_config_imports_no_torch():
    assert _run(["--check-config", "-c", str(EXAMPLE), "--server.host=127.0.0.1"])[:2] == (0, False)


def test_an_invalid_config_exits_2_without_torch(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text(EXAMPLE.read_text().replace("seq_len = 4096", "seq_len = -1"))
    code, imported, stderr = _run(["--check-config", "-c", str(config)])
    assert (code, imported) == (2, False)
    assert "seq_len" in stderr


def test_a_follower_rank_checks_its_config_without_torch(monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _run(["--check-config", "-c", str(EXAMPLE), "--server.host=127.0.0.1"])[:2] == (0, False)
