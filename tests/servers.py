"""``mlflow server`` on loopback, for the tests and the tracking benchmark (not the product:
``benchmarks/testfakes.py`` loads this folder's modules for the benchmarks).

Its flags, its ``/health`` page and the variable that leaves out its job runner are those of
MLflow 3.16 and 3.17.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from studies.launcher import free_port


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:  # refused, reset, timed out, or an HTTP error status
        return False


@contextlib.contextmanager
def loopback_server(backend_store_uri: str, folder: Path, workers: int = 1,
                    timeout: float = 300.0) -> Iterator[str]:
    """``mlflow server`` on 127.0.0.1 at a free port, over ``backend_store_uri``, its artifacts
    and its log in ``folder``: yields its URL once it answers. When the block ends (also on an
    error or Ctrl-C) the server is stopped by the process group it was started in, so its
    workers with it. Its job runner (seven processes MLflow 3.17 starts for GenAI jobs) is left
    out: recording runs does not use it.

    Raises:
        RuntimeError: the server exited, or did not answer within ``timeout`` seconds (the
            message ends with the last line of its log).
    """
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_store_uri,
               "--artifacts-destination", str(folder / "artifacts"), "--host", "127.0.0.1",
               "--port", str(port), "--workers", str(workers)]
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    with open(folder / "server.log", "wb") as out:
        server = subprocess.Popen(command, cwd=folder, env=env, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    try:
        start = time.monotonic()
        while not _answers(url):
            if server.poll() is not None or time.monotonic() - start > timeout:
                lines = (folder / "server.log").read_text(errors="replace").strip().splitlines()
                state = (f"exited with {server.returncode}" if server.returncode is not None
                         else f"did not answer within {timeout:.0f} s")
                raise RuntimeError(f"mlflow server at {url} {state}: "
                                   f"{lines[-1] if lines else 'no output'}")
            time.sleep(0.2)
        yield url
    finally:
        _stop(server)


def _stop(server: subprocess.Popen, grace: float = 20.0) -> None:
    """Stop the process group that ``server`` leads: SIGTERM (the server passes it on to its
    workers), then SIGKILL for whatever of the group is left after ``grace`` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=grace)
    while time.monotonic() < deadline:
        try:
            os.killpg(server.pid, 0)  # raises once no process of the group is left
        except ProcessLookupError:
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()
