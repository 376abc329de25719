"""Look at a study's MLflow experiment as a researcher does: MLflow's own UI in headless Chromium.

``python benchmarks/mlflow_ui_check.py OUT [--workspace WS] [--experiment NAME]``

Without ``--workspace`` it first runs a small fake study (``tests/fakes.py``: the platform's whole
pipeline, Ray, Optuna, MLflow and the report, with a fake ``fit``) into ``OUT/workspace``. It then
starts ``mlflow ui`` on 127.0.0.1 at a free port on the workspace's store, opens the experiment's
page and the parent run's page in headless Chromium, saves screenshots (``OUT/*.png``) and the
rendered pages (``OUT/*.html``), checks that the experiment opened on its runs table (not on
MLflow 3's GenAI traces page) and that the parent's description is rendered as a table, and
stops the server it started (by its process id). Exit 0 when the checks pass, 1 when one fails,
2 when no Chromium or MLflow can be found.

Needs a Chromium (``apt-get install chromium``); nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import testfakes  # benchmarks/testfakes.py: the platform's test fakes

ROOT = Path(__file__).resolve().parent.parent


def fake_workspace(out: Path) -> Path:
    """A workspace with one finished fake study ``fake`` (2 conditions, 3 seeds)."""
    from studies.pipeline import Backend
    from studies.run import main

    fakes = testfakes.load()
    out = out.resolve()
    study = fakes.fake_study(out, budget=4)
    workspace = out / "workspace"
    rc = main(["fake", "--workspace", str(workspace)],
              backend=Backend(fakes.FakeFit(epoch_seconds=0.05), fakes.fake_prepare),
              extra_studies={"fake": study})
    if rc != 0:
        raise SystemExit(f"the fake study failed (exit {rc})")
    return workspace


def wait_until_up(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if process.poll() is not None:
            raise SystemExit(f"mlflow ui exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise SystemExit(f"mlflow ui did not answer at {url} within {timeout:.0f} s")


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    print("no Chromium found (apt-get install chromium)", file=sys.stderr)
    raise SystemExit(2)


def capture(browser: str, url: str, png: Path, size: str = "1600,1000") -> str:
    """The page at ``url`` after its scripts ran: a screenshot to ``png``; returns its DOM."""
    with tempfile.TemporaryDirectory() as profile:
        common = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                  f"--user-data-dir={profile}", f"--window-size={size}",
                  "--virtual-time-budget=20000", "--run-all-compositor-stages-before-draw"]
        subprocess.run([*common, f"--screenshot={png}", url], check=True,
                       capture_output=True, timeout=180)
        dom = subprocess.run([*common, "--dump-dom", url], check=True, capture_output=True,
                             text=True, timeout=180).stdout
    png.with_suffix(".html").write_text(dom, encoding="utf-8")
    return dom


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for the screenshots and rendered pages")
    parser.add_argument("--workspace", type=Path, help="a workspace with a finished study")
    parser.add_argument("--experiment", default="fake", help="the experiment (study key)")
    args = parser.parse_args(argv)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    browser = chromium()
    mlflow = Path(sys.executable).with_name("mlflow")
    if not mlflow.exists():
        print(f"no mlflow command beside {sys.executable}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    workspace = (args.workspace or fake_workspace(args.out)).resolve()

    from mlflow.tracking import MlflowClient

    store = f"sqlite:///{workspace / 'mlflow.db'}"
    client = MlflowClient(store)
    experiment = client.get_experiment_by_name(args.experiment)
    parent = client.search_runs([experiment.experiment_id], "tags.`icr.role` = 'study'")[0]
    from studies.launcher import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([str(mlflow), "ui", "--backend-store-uri", store,
                               "--artifacts-destination", str(workspace / "mlartifacts"),
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              cwd=workspace, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    failures = []
    try:
        wait_until_up(url, server)
        # MLflow 3.17 follows its GenAI / Model training toggle (default GenAI) over the
        # experiment's kind tag: the bare page is saved to be looked at, the link the study
        # prints is checked.
        capture(browser, f"{url}/#/experiments/{experiment.experiment_id}",
                args.out / "experiment_bare.png")
        page = capture(browser, f"{url}/#/experiments/{experiment.experiment_id}/runs"
                       "?workflowType=machine_learning", args.out / "experiment.png")
        text = re.sub(r"<[^>]+>", " ", page)
        if parent.info.run_name not in text:
            failures.append("the experiment page does not list the study's runs")
        if "No data available" in text or "Detect Issues" in text:
            failures.append("the experiment page is MLflow's GenAI traces page")
        run_page = capture(browser, f"{url}/#/experiments/{experiment.experiment_id}/runs/"
                           f"{parent.info.run_id}", args.out / "parent_run.png", "1600,1800")
        if "<table" not in run_page or "<td" not in run_page:
            failures.append("the parent's description is not rendered as a table")
        capture(browser, f"{url}/#/experiments/{experiment.experiment_id}/runs/"
                f"{parent.info.run_id}/model-metrics", args.out / "parent_charts.png", "1600,1400")
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # the server and the workers it started
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
    for line in failures:
        print(f"FAIL: {line}")
    print(f"screenshots and pages in {args.out}: "
          f"{', '.join(sorted(p.name for p in args.out.glob('*.png')))}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
