"""Records of private Ray instances: stopping what a killed driver left.

When a driver starts a private Ray instance (:mod:`studies.launcher`) it writes a record
(``<workspace>/locks/<study>.ray.json``): the instance's marker, temp folder, launcher and
processes. A driver killed even by SIGKILL leaves it behind, and the next run of the study
stops exactly those processes (:func:`stop_recorded_instance`) before it starts its own.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from icr.errors import UserError
from studies import processes
from studies.launcher import TEMP_PREFIX, LocalInstance, remove_temp_dir

log = logging.getLogger(__name__)


def write_record(instance: LocalInstance, path: Path, dashboard_url: str | None) -> None:
    """Write what identifies the instance's processes to ``path`` (JSON)."""
    instance.record = path
    members = processes.describe(processes.family(instance.marker, instance.temp_dir))
    launcher, driver = processes.describe([instance.launcher.pid, os.getpid()])
    processes.write_record(path, {
        "marker": instance.marker, "temp_dir": str(instance.temp_dir),
        "session_dir": str(instance.session_dir), "gcs_address": instance.address,
        "dashboard_url": dashboard_url, "ports": instance.ports, "launcher": launcher,
        "driver": driver, "processes": members,
    })


def stop_recorded_instance(record_path: Path, *, force: bool = False) -> list[int]:
    """Stop the Ray instance a record names (its launcher, then any process left); PIDs stopped.

    Only processes of this user that carry the instance's marker or hold a file open in its temp
    folder (or that the record lists, with their start time) are signalled, so a reused PID or
    another study's Ray is never touched. Refuses (UserError) while the driver that started it
    still runs, unless ``force``. Removes the record and the instance's temp folder.

    A record that cannot be read whole (damaged, or from another version) is used for what it
    still tells; when it tells nothing that finds processes, it is removed with a log line if no
    private Ray instance of this user runs that no live driver accounts for (so none can be its),
    else refused in one line that names the file and says when removing it is safe.
    """
    record_path = Path(record_path)
    try:
        text = record_path.read_text()
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise UserError(f"cannot read the Ray instance record {record_path} ({exc.strerror}); "
                        "give this user access to it, or remove it") from None
    record, problem = _parse_record(text)
    driver = record.get("driver") or {}
    if (not force and _is_process(driver) and driver["pid"] != os.getpid()
            and processes.alive(driver["pid"], driver["create_time"])):
        raise UserError(f"the Ray instance in {record_path} belongs to a running driver "
                        f"(PID {driver['pid']}); stop it first: kill -INT {driver['pid']}")
    marker = record.get("marker") if isinstance(record.get("marker"), str) else None
    marker = marker or None
    temp_dir = Path(record["temp_dir"]) if isinstance(record.get("temp_dir"), str) else None
    if temp_dir is not None and not (temp_dir.is_absolute() and temp_dir.name.startswith(TEMP_PREFIX)):
        temp_dir = None  # only a folder this module makes names processes (not e.g. /tmp)
    listed = [p for p in record.get("processes") or () if _is_process(p)]
    if marker is None and temp_dir is None and not listed:
        _unusable_record(record_path, problem or "it names no process")
        return []
    launcher = record.get("launcher") or {}
    stopped = []
    if marker is not None or temp_dir is not None:
        stopped = processes.stop_family(marker, temp_dir,
                                         first=launcher.get("pid") if _is_process(launcher) else None)
    left = [p["pid"] for p in listed if processes.alive(p["pid"], p["create_time"])]
    if left:
        stopped += processes.stop_pids(left)
    if problem:
        log.warning("the Ray instance record %s was incomplete (%s); stopped what it named "
                    "(%d process(es) left by a killed driver) and removed it", record_path,
                    problem, len(stopped))
    if temp_dir is not None:
        remove_temp_dir(temp_dir)
    record_path.unlink(missing_ok=True)
    return stopped


def _parse_record(text: str) -> tuple[dict[str, Any], str]:
    """The record as a mapping, and what is wrong with it ('' if nothing)."""
    try:
        record = json.loads(text)
    except ValueError as exc:
        return {}, f"not JSON: {exc}"
    if not isinstance(record, dict):
        return {}, "not a JSON object"
    missing = [k for k in ("marker", "temp_dir", "launcher", "driver", "processes") if k not in record]
    return record, f"no {', '.join(missing)}" if missing else ""


def _is_process(entry: Any) -> bool:
    """A record's ``{"pid": int, "create_time": float}`` entry."""
    return (isinstance(entry, dict) and isinstance(entry.get("pid"), int)
            and isinstance(entry.get("create_time"), (int, float)))


def _unusable_record(path: Path, problem: str) -> None:
    """A record that finds no process: removed if no private Ray instance of this user could be
    the one it recorded, else a UserError saying when removing it is safe."""
    running = processes.instance_markers()
    for sibling in path.parent.glob("*.ray.json"):  # instances of live drivers of other studies
        if sibling != path:
            with contextlib.suppress(OSError, ValueError, AttributeError):
                other = json.loads(sibling.read_text())
                driver = other.get("driver") or {}
                if _is_process(driver) and processes.alive(driver["pid"], driver["create_time"]):
                    running.pop(other.get("marker"), None)
    if not running:
        log.warning("removed the unreadable Ray instance record %s (%s): no private Ray instance "
                    "of this user runs, so nothing it recorded is left", path, problem)
        path.unlink(missing_ok=True)
        return
    pids = sorted(pid for family in running.values() for pid in family)
    raise UserError(
        f"the Ray instance record {path} is unreadable ({problem}) and {len(running)} private Ray "
        f"instance(s) of this user run without a live driver here (PIDs {_shorten(pids)}): "
        f"removing the record is safe if none of them is this study's (stop it with kill "
        f"-TERM PID); rm {path}, then run the same command again")


def _shorten(pids: list[int], shown: int = 5) -> str:
    return " ".join(map(str, pids[:shown])) + (f" and {len(pids) - shown} more" if len(pids) > shown else "")
