"""The operating-system side of a study's driver: process families, records, stop signals.

A private Ray instance is a family of processes (the ``ray start`` launcher, GCS, raylet,
dashboard, agents, workers) that may outlive a driver killed with SIGKILL. Every process of
the family inherits one environment variable, :data:`MARKER`, set to a random id when the family
is started, and writes its logs into the instance's own temp folder. :func:`family` finds exactly
the processes of this user that carry the id or hold a file open in that folder (Ray's agents
rename themselves with ``setproctitle``, which blanks their ``/proc/PID/environ``), so stopping a
family never touches another study's processes or a PID that the system has reused.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import ray  # noqa: F401 - Ray ships psutil in ray/thirdparty_files and puts it on sys.path

import psutil  # isort: skip

log = logging.getLogger(__name__)

MARKER = "ICR_RAY_INSTANCE"  # environment variable naming the family a process belongs to
_PR_SET_PDEATHSIG = 1
# Looked up now: a forked child must not load libraries before exec (another thread may hold
# the loader's lock at the fork).
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent() -> None:
    """``preexec_fn`` for a child that must get SIGTERM when the thread that started it dies.

    Linux only (``prctl(PR_SET_PDEATHSIG)``); a no-op elsewhere, where the recorded family is
    stopped by :func:`stop_family` instead.
    """
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def family(marker: str, folder: Path | None = None) -> list[psutil.Process]:
    """This user's running processes with ``MARKER=marker`` or a file open inside ``folder``."""
    uid = os.getuid()
    inside = str(folder.resolve()) + os.sep if folder is not None else None
    found = []
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != uid or proc.pid == os.getpid():
                continue
            if proc.environ().get(MARKER) == marker or (
                    inside and any(f.path.startswith(inside) for f in proc.open_files())):
                found.append(proc)
        except (psutil.Error, OSError):  # gone, a zombie, or not readable: not ours to stop
            continue
    return found


def stop_family(marker: str, folder: Path | None = None, first: int | None = None,
                timeout: float = 30.0) -> list[int]:
    """Stop every process of the family: SIGTERM to ``first`` (the launcher), then to the rest.

    The launcher stops the others in order (within ``timeout`` seconds); whatever is left then
    gets SIGTERM, and SIGKILL 5 s later. Returns the PIDs that were running.
    """
    procs = family(marker, folder)
    leader = [p for p in procs if p.pid == first]
    _signal(leader, signal.SIGTERM)
    psutil.wait_procs(leader, timeout=timeout)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = family(marker, folder)
        if not left:
            break
        log.info("stopping %d leftover Ray process(es) with %s", len(left), sig.name)
        _signal(left, sig)
        psutil.wait_procs(left, timeout=5.0)
    return [p.pid for p in procs]


def _signal(procs: Sequence[psutil.Process], sig: signal.Signals) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)


def alive(pid: int, create_time: float) -> bool:
    """Whether the process ``pid`` started at ``create_time`` still runs (not a reused PID)."""
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - create_time) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def describe(procs: Sequence[psutil.Process | int]) -> list[dict[str, Any]]:
    """``{"pid", "create_time", "name"}`` of each process still running, for a record."""
    rows = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc = proc if isinstance(proc, psutil.Process) else psutil.Process(proc)
            rows.append({"pid": proc.pid, "create_time": proc.create_time(), "name": proc.name()})
    return rows


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write a JSON record atomically (a killed driver never leaves half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(record, indent=2, sort_keys=True))
    tmp.replace(path)


@contextlib.contextmanager
def stop_signals_as_ctrl_c(signals: Sequence[int] = (signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP do what Ctrl-C does.

    Each runs whichever SIGINT handler is active: Ray Tune's (it stops the experiment and saves
    its state) while a Tuner runs, else Python's (KeyboardInterrupt); KeyboardInterrupt too when
    SIGINT is ignored (a background job). Enter it after ``ray.init``, which installs its own
    SIGTERM handler (``sys.exit``). Main thread only; the previous handlers come back on exit.
    """
    previous = {sig: signal.getsignal(sig) for sig in signals}

    def as_interrupt(signum: int, frame: Any) -> None:
        log.warning("received %s: stopping as on Ctrl-C", signal.Signals(signum).name)
        on_ctrl_c = signal.getsignal(signal.SIGINT)
        if not callable(on_ctrl_c):
            raise KeyboardInterrupt
        on_ctrl_c(signal.SIGINT, frame)

    for sig in signals:
        signal.signal(sig, as_interrupt)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
