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

import atexit
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

import psutil

from studies.signals import STOP_SIGNALS

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


def launched_child_setup() -> None:
    """``preexec_fn`` of a process the driver launches: SIGTERM when the thread that started it
    dies (:func:`die_with_parent`), and the stop signals that :func:`stop_signals_deferred`
    blocked around the launch unblocked again (a signal mask survives ``exec``)."""
    die_with_parent()
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Hold the stop signals while a child process is launched; one that came is handled when
    the block ends.

    A handler runs at the next Python instruction, which during a fork is the fork handler of a
    library (``logging`` registers one): an exception raised there is printed with its traceback
    and dropped. Use it around the launch alone: a handler that raises does so as the block ends.
    """
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def family(marker: str | None, folder: Path | None = None,
           spare: Collection[int] = ()) -> list[psutil.Process]:
    """This user's running processes with ``MARKER=marker`` or a file open for writing inside
    ``folder`` (``None``: that test is not made), and their descendants; never this process, the
    PIDs in ``spare``, or what those started that is not of the family itself.

    Give a ``folder`` only where it is known to be the instance's own (its processes' logs are
    the only files in it): a file written there is then the mark of a process that Ray renamed
    (the dashboard's modules and agents carry no marker; each appends to its log), and a process
    that only reads a log there (a user's ``tail -f``) is not of the family. The driver writes
    its logs there too and is spared (the launcher's sweep spares it), and so are the processes
    it started itself: Python's ``multiprocessing`` resource tracker, a tracking server, a data
    loader's workers.
    """
    inside = str(folder.resolve()) + os.sep if folder is not None else None
    found: dict[int, psutil.Process] = {}
    for proc in _own_processes():
        if proc.pid in spare:
            continue
        try:
            if (marker is not None and proc.environ().get(MARKER) == marker) or (
                    inside and any(f.path.startswith(inside) and f.mode != "r"
                                   for f in proc.open_files())):
                found[proc.pid] = proc
        except (psutil.Error, OSError):  # gone, a zombie, or not readable: not ours to stop
            continue
    for proc in list(found.values()):  # started by the family: Ray's renamed agents, say
        with contextlib.suppress(psutil.Error):
            found.update({child.pid: child for child in proc.children(recursive=True)})
    return [proc for pid, proc in found.items() if pid not in spare and pid != os.getpid()]


def instance_markers() -> dict[str, list[int]]:
    """The families of private Ray instances this user runs: marker -> PIDs that carry it."""
    found: dict[str, list[int]] = {}
    for proc in _own_processes():
        with contextlib.suppress(psutil.Error, OSError):
            marker = proc.environ().get(MARKER)
            if marker:
                found.setdefault(marker, []).append(proc.pid)
    return found


def _own_processes() -> Iterator[psutil.Process]:
    """This user's processes other than this one."""
    uid = os.getuid()
    for proc in psutil.process_iter(["uids"]):
        uids = proc.info["uids"]
        if uids is not None and uids.real == uid and proc.pid != os.getpid():
            yield proc


def stop_family(marker: str | None, folder: Path | None = None, first: int | None = None,
                timeout: float = 30.0, spare: Collection[int] = ()) -> list[int]:
    """Stop every process of the family: SIGTERM to ``first`` (the launcher), then to the rest.

    The launcher stops the others in order (within ``timeout`` seconds); whatever is left then
    gets SIGTERM, and SIGKILL 5 s later. ``spare``: PIDs never signalled. Returns the PIDs that
    were running.
    """
    procs = family(marker, folder, spare)
    leader = [p for p in procs if p.pid == first]
    _signal(leader, signal.SIGTERM)
    psutil.wait_procs(leader, timeout=timeout)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        left = family(marker, folder, spare)
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


def parent_pid(proc: psutil.Process) -> int | None:
    """The PID of a process's parent; ``None`` when it is gone."""
    try:
        return proc.ppid()
    except psutil.Error:
        return None


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


def sweep_family_at_exit(marker: str, folder: Path) -> None:
    """When this process exits (``sys.exit``, also from a SIGTERM handler), stop every process of
    the family still running: SIGTERM, then SIGKILL 5 s later.

    Registered by a ``ray start --block`` launcher before Ray registers its own shutdown, so it
    runs after Ray stopped the processes it started itself: what Ray leaves (the dashboard's
    forkserver and its module processes, which die only when they notice their parent is gone)
    is stopped before the launcher exits. The launcher gets SIGTERM when the driver dies, also by
    SIGKILL (:func:`die_with_parent`), so no process of the instance outlives the driver.
    """
    def sweep() -> None:
        # The driver holds files open in the folder too: spared while it lives (a normal stop).
        stop_family(marker, folder, spare={os.getppid()})

    atexit.register(sweep)
