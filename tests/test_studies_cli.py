"""``python -m studies.run``: user mistakes give one line, exit code 2, and write nothing; a stop
signal gives one line, exit code 130."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from studies.catalog import all_studies

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
        (["ltd_bound", "--smoke", "--tracking-uri", "bogus://x"],
         "--tracking-uri bogus://x: not an MLflow store"),
        (["ltd_bound", "--smoke", "--storage", "bogus://x"], "--storage bogus://x: give a folder"),
        (["ltd_bound", "--smoke", "--budget", "0"], "--budget 0: give at least 1"),
        (["ltd_bound", "--smoke", "--cpus-per-trial", "0"], "--cpus-per-trial 0: give 1 or more"),
        (["ltd_bound", "--smoke", "--cpus-per-trial", "-1"], "--cpus-per-trial -1: give 1 or more"),
        (["ltd_bound", "--smoke", "--seeds", "0"], "--seeds 0: give at least 1"),
        (["ltd_bound", "--seeds", "abc"], "argument --seeds: invalid int value: 'abc'"),
        (["ltd_bound", "--smoke", "--set", "text.glove={binary}"], "not UTF-8 text"),
        (["ltd_bound", "--smoke", "--address", "127.0.0.1:1"],
         "cannot join the Ray cluster at --address 127.0.0.1:1: nothing answers"),
        (["ltd_bound", "--smoke", "--set", "image.encoder=vsrn", "data.features=pixels"],
         "image.encoder=vsrn reads regions, not data.features=pixels"),
        (["ltd_bound", "--smoke", "--set", "decoder.target_model=/missing/model"],
         "decoder.target_model=/missing/model: no such file or folder"),
    ],
)
def test_user_errors_exit_2_with_one_line(tmp_path: Path, args: list[str], expected: str) -> None:
    workspace = tmp_path / "ws"
    binary = tmp_path / "vectors.txt"
    binary.write_bytes(b"the 0.1 0.2\n\xff\xfe\x00 0.3 0.4\n")
    args = [a.format(binary=binary) for a in args]
    result = run_cli(*args, "--workspace", str(workspace), "--no-dashboard")
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
    assert "Traceback" not in result.stderr
    assert not workspace.exists()  # nothing written: no data, no lock, no Ray, no MLflow store


@pytest.mark.parametrize("kind", ["file", "inside a file"])
def test_a_workspace_that_cannot_be_a_folder_exits_2(tmp_path: Path, kind: str) -> None:
    file = tmp_path / "not-a-folder"
    file.write_text("x")
    workspace = file if kind == "file" else file / "ws"
    result = run_cli("ltd_bound", "--smoke", "--workspace", str(workspace))
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: --workspace ") and ("is a file" in line or "cannot write" in line)
    assert file.read_text() == "x"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_an_unwritable_workspace_exits_2_also_for_root() -> None:
    # /proc refuses new folders even to root, for whom the permission bits always say yes.
    result = run_cli("ltd_bound", "--smoke", "--workspace", "/proc/icr-studies-ws")
    assert result.returncode == 2, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line == "error: --workspace /proc/icr-studies-ws: cannot write in /proc; give a folder you can write"
    assert "Traceback" not in result.stderr


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


def test_an_interpreter_without_the_dependencies_gets_one_line_naming_make_install() -> None:
    # As with the system python instead of .venv/bin/python: pandas cannot be imported there.
    blocked = ("import runpy, sys; sys.modules['pandas'] = None; sys.argv = ['run', '--list']; "
               "runpy.run_module('studies.run', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [
        f"error: pandas is not installed for {sys.executable}; run `make install` and use "
        ".venv/bin/python -m studies.run (see README)"]


PREPARING = """
import sys, time
from pathlib import Path
from fakes import FakeFit
from studies.pipeline import Backend
from studies.run import main

def prepare(config, workspace):
    Path(sys.argv[1]).touch()
    while True:  # preparing data until a signal comes
        time.sleep(0.05)

sys.exit(main(["ltd_bound", "--smoke", "--workspace", sys.argv[2], "--no-dashboard"],
              backend=Backend(FakeFit(), prepare)))
"""


def test_a_stop_signal_while_data_is_prepared_says_interrupted(tmp_path: Path) -> None:
    # SIGTERM here; SIGHUP takes the same path (tests/test_ray_cluster.py, stop signals).
    ready = tmp_path / "preparing"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "RAY_USAGE_STATS_ENABLED": "0"}
    driver = subprocess.Popen([sys.executable, "-c", PREPARING, str(ready), str(tmp_path / "ws")],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        while not ready.exists() and driver.poll() is None:
            time.sleep(0.05)  # waits for the driver, not for time
        driver.send_signal(signal.SIGTERM)
        out, err = driver.communicate(timeout=120)
    finally:
        driver.kill()
    assert "preparing data for" in out
    assert driver.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted: run the same command again to continue"
    assert "Traceback" not in err


STARTING_RAY = """
import sys
from pathlib import Path
from fakes import FakeFit, fake_prepare
from studies.pipeline import Backend
from studies.run import main

def prepare(config, workspace):
    Path(sys.argv[1]).touch()  # data prepared: the private Ray instance starts next
    return fake_prepare(config, workspace)

sys.exit(main(["ltd_bound", "--smoke", "--workspace", sys.argv[2], "--no-dashboard"],
              backend=Backend(FakeFit(), prepare)))
"""


@pytest.mark.slow
def test_a_stop_signal_while_ray_starts_says_interrupted(tmp_path: Path) -> None:
    """Between the data and the session (Ray starting, `ray.init` with its own SIGTERM
    handler) a SIGTERM or SIGHUP killed the driver without a word (rc -15, -1; SIGHUP takes
    SIGTERM's handler)."""
    sig = signal.SIGTERM
    import psutil

    ready = tmp_path / "prepared"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]), "RAY_USAGE_STATS_ENABLED": "0"}
    driver = subprocess.Popen([sys.executable, "-c", STARTING_RAY, str(ready), str(tmp_path / "ws")],
                              cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        while not ready.exists() and driver.poll() is None:
            time.sleep(0.05)  # waits for the driver, not for time
        children = psutil.Process(driver.pid).children(recursive=True)
        driver.send_signal(sig)
        out, err = driver.communicate(timeout=180)
    finally:
        driver.kill()
    assert driver.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted: run the same command again to continue"
    assert "Traceback" not in err
    gone, alive = psutil.wait_procs(children, timeout=60)
    assert not alive  # the Ray instance it was starting is stopped


@pytest.mark.parametrize("flag", ["--list", "--keys"])
def test_list_and_keys_import_neither_ray_nor_mlflow(flag):
    """The catalog and the key list are read without the frameworks (seconds, not a Ray import)."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['studies.run', '{flag}']\n"
            "try:\n    runpy.run_module('studies.run', run_name='__main__')\n"
            "except SystemExit as exit:\n    assert not exit.code, exit.code\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'mlflow', 'optuna'}))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT).stdout
    assert out.strip().splitlines()[-1] == "[]"
    if flag == "--list":
        assert out.count("conditions:") == len(all_studies())
