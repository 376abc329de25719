"""Records of private Ray instances: stopping what a killed driver left.

When a driver starts a private Ray instance (:mod:`studies.launcher`) it writes a record
(``<workspace>/locks/<study>.ray.json``): the instance's marker, temp folder, launcher and
processes. A driver killed even by SIGKILL leaves it behind, and the next run of the study
stops that instance (:func:`stop_recorded_instance`) before it starts its own.

A record is a claim, not a proof: a workspace can sit on shared storage, and a record can be
damaged or written by someone else. So nothing is stopped or deleted on its word alone. Every
instance a study starts carries a marker that begins with the study's owner id
(:func:`owner_of`: the record's own real path, i.e. this workspace and this study), inherited by
each of its processes, and its temp folder holds that marker (:func:`studies.launcher.made_for`).
A process is stopped only when it carries such a marker, descends from one that does, or holds a
file open in a temp folder made for it; a folder is deleted only when it was made for it. What a
record names beyond that is left running, or in place, and a warning says which.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from icr.errors import UserError
from studies import processes
from studies.launcher import TEMP_PREFIX, LocalInstance, made_for, remove_temp_dir

log = logging.getLogger(__name__)


def owner_of(record_path: Path) -> str:
    """The owner id of the study whose record lives at ``record_path``: every marker of the
    instances it starts begins with it (a digest of the record's real path, so another
    workspace, or another study of this one, has another)."""
    return hashlib.sha256(str(Path(record_path).resolve()).encode()).hexdigest()[:16]


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
    """Stop what the study of this record left running; PIDs stopped. Removes the record.

    Stopped: every running instance whose marker carries this study's owner id (the recorded
    one first, its launcher first: it stops the rest in order), with the processes that hold a
    file open in the recorded temp folder when that folder was made for it; a process of
    another user, study or workspace is never touched, nor a PID the system has reused. The
    temp folder is removed when it was made for the recorded instance. Whatever else the record
    names (processes, a folder, another instance) is left, and a warning says which.

    Refuses (UserError) while the driver that started the recorded instance still runs (its
    launcher is that driver's child), unless ``force``. A record that cannot be read whole
    (damaged, or from another version) is used for what it still tells.
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
    owner = owner_of(record_path)
    claimed = record.get("marker") if isinstance(record.get("marker"), str) else None
    marker = claimed if claimed and claimed.startswith(f"{owner}-") else None
    folder = _claimed_folder(record)
    own_folder = folder if marker is not None and folder is not None and made_for(folder, marker) \
        else None
    members = processes.family(marker, own_folder) if marker is not None else []
    _refuse_while_its_driver_runs(record_path, record.get("driver"), members, force)
    launcher = record.get("launcher")
    first = launcher["pid"] if _is_process(launcher) else None
    stopped = processes.stop_family(marker, own_folder, first=first) if members else []
    for other in sorted(set(_own_markers(owner)) - {marker}):  # e.g. named by a damaged record
        stopped += processes.stop_family(other)
    _say_what_was_left(record_path, record, claimed if claimed != marker else None,
                       folder if folder != own_folder else None, stopped)
    if problem:
        log.warning("the Ray instance record %s was unreadable or incomplete (%s); removed it "
                    "after stopping what this study's Ray instances had left (%d process(es))",
                    record_path, problem, len(stopped))
    if own_folder is not None:
        remove_temp_dir(own_folder)
    record_path.unlink(missing_ok=True)
    return stopped


def _claimed_folder(record: dict[str, Any]) -> Path | None:
    """The temp folder a record names, if it could be one the launcher makes (an absolute
    ``icr-ray-*`` path: never e.g. /tmp, which would select every process with a file there)."""
    value = record.get("temp_dir")
    if not isinstance(value, str):
        return None
    folder = Path(value)
    return folder if folder.is_absolute() and folder.name.startswith(TEMP_PREFIX) else None


def _refuse_while_its_driver_runs(record_path: Path, driver: Any, members: list[Any],
                                  force: bool) -> None:
    """UserError when the recorded driver runs and the instance's launcher is its child (a
    record that merely names a running process proves nothing)."""
    if force or not _is_process(driver) or driver["pid"] == os.getpid():
        return
    if not processes.alive(driver["pid"], driver["create_time"]):
        return
    if any(processes.parent_pid(proc) == driver["pid"] for proc in members):
        raise UserError(f"the Ray instance in {record_path} belongs to a running driver "
                        f"(PID {driver['pid']}); stop it first: kill -INT {driver['pid']}")


def _own_markers(owner: str) -> dict[str, list[int]]:
    """The running instances of the study with owner id ``owner``: marker -> PIDs."""
    return {marker: pids for marker, pids in processes.instance_markers().items()
            if marker.startswith(f"{owner}-")}


def _say_what_was_left(record_path: Path, record: dict[str, Any], marker: str | None,
                       folder: Path | None, stopped: list[int]) -> None:
    """A warning naming what the record claims that is not this study's: another instance, a
    folder it did not make, listed processes that carry no proof (left running)."""
    left = []
    if marker is not None:
        left.append(f"the Ray instance {marker} (not one this study started: another "
                    "workspace's or study's)")
    if folder is not None and folder.exists():
        left.append(f"the folder {folder} (not one this study made)")
    listed = [p for p in record.get("processes") or () if _is_process(p)]
    running = [p for p in listed if p["pid"] not in stopped
               and processes.alive(p["pid"], p["create_time"])]
    if running:
        names = ", ".join(f"{p['pid']} ({p.get('name', '?')})" for p in running[:5])
        more = f" and {len(running) - 5} more" if len(running) > 5 else ""
        left.append(f"the running process(es) {names}{more} (nothing shows that this study "
                    "started them)")
    if left:
        log.warning("the Ray instance record %s names %s: left as they are", record_path,
                    "; ".join(left))


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
