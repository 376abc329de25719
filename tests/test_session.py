"""One driver per study: the lock refuses a second driver in one line and dies with its holder."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from icr.errors import UserError
from studies.session import DriverLock

ROOT = Path(__file__).resolve().parent.parent
HOLD = """
import sys, time
from pathlib import Path
from studies.session import DriverLock
with DriverLock(Path(sys.argv[1]), "ltd_bound"):
    print("locked", flush=True)
    time.sleep(120)
"""


def test_a_second_driver_is_refused_naming_the_first(tmp_path):
    with DriverLock(tmp_path, "ltd_bound"):
        with pytest.raises(UserError) as err, DriverLock(tmp_path, "ltd_bound"):
            pass
        message = str(err.value)
        assert f"driver pid {os.getpid()}" in message and f"kill {os.getpid()}" in message
        assert "\n" not in message
        with DriverLock(tmp_path, "ltd_itd"):  # another study runs beside it
            pass
    with DriverLock(tmp_path, "ltd_bound"):  # released on exit
        pass


def test_the_lock_dies_with_a_killed_driver(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])})
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError, match=f"driver pid {holder.pid}"), \
                DriverLock(tmp_path, "ltd_bound"):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with DriverLock(tmp_path, "ltd_bound"):  # the kernel dropped the lock with the process
        pass
