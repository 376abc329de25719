"""``python -m studies.run``: user mistakes give one line, exit code 2, and write nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_cli(*args: str, module: str = "studies.run") -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true"}
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["no_such_study"], "unknown study 'no_such_study'"),
        (["ltd_bound", "--set", "loss.tauu=0.1"], "unknown config key 'loss.tauu'"),
        (["ltd_bound", "--set", "loss.tau=abc"], "loss.tau='abc' is invalid"),
        (["ltd_bound", "--set", "objective.name=magic"], "objective.name='magic' is not allowed"),
        (["ltd_bound", "--set", "loss.tau"], "not of the form key=value"),
        (["ltd_bound", "--debug", "--set", "train.batch_size=1"], "train.batch_size='1' is out of range"),
        (["ltd_bound", "--debug", "--condition", "nope"], "has no condition 'nope'"),
        (["ltd_bound", "--resume", "--smoke"], "nothing to resume"),
    ],
)
def test_user_errors_exit_2_with_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
    workspace = tmp_path / "ws"
    result = run_cli(*args, "--workspace", str(workspace), "--no-dashboard")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
    assert "Traceback" not in result.stderr
    assert not (workspace / "ray").exists() and not (workspace / "mlflow.db").exists()


def test_report_of_a_study_never_run_exits_2(tmp_path: Path) -> None:
    result = run_cli("ltd_bound", "--workspace", str(tmp_path), module="studies.report")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "Traceback" not in result.stderr


def test_list_and_keys() -> None:
    listed = run_cli("--list")
    assert listed.returncode == 0
    for name in ("ltd_bound", "ltd_itd", "ltd_triplet"):
        assert name in listed.stdout
    keys = run_cli("--keys")
    assert keys.returncode == 0 and "objective.eta" in keys.stdout and "loss.tau" in keys.stdout
