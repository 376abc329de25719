"""Checkpoint marks: the result a checkpoint was reported with, written into it.

A trial marks each checkpoint it reports before Tune copies it to storage
(:func:`studies.trainable.run_trial`); the driver's MLflow callback marks one that came without
a mark before it records the result
(:meth:`studies.tracking.MlflowTrialCallback.on_checkpoint`); a restored trial continues after
the newest whole marked checkpoint of its folder (:func:`studies.trainable.resume_point`). A
mark lists the size of every file of its checkpoint, so that a copy cut short by a kill is not
taken for a marked checkpoint (:func:`marked_checkpoints`).

A module of its own, without ``icr`` or torch: :mod:`studies.tracking` imports it, and
``python -m studies.report`` imports that.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pyarrow.fs
from ray import tune

from studies.frameworks.tune import BOOKKEEPING, METADATA_FILE

REPORTED = "icr_reported"  # a checkpoint's metadata key: the result it was reported with
FILES = "icr_files"  # a checkpoint's metadata key: its files and their sizes, when it was reported


def mark(checkpoint: tune.Checkpoint, result: Mapping[str, Any]) -> None:
    """Write into a checkpoint the result it comes with (Tune's bookkeeping left out) and the
    size of each of its files."""
    checkpoint.set_metadata({REPORTED: {k: v for k, v in result.items() if k not in BOOKKEEPING},
                             FILES: _file_sizes(checkpoint)})


def unmark(checkpoint: tune.Checkpoint) -> None:
    with contextlib.suppress(OSError):
        checkpoint.set_metadata({})


def marked_checkpoints(folder: str) -> list[tuple[tune.Checkpoint, dict[str, Any]]]:
    """The checkpoints in a trial's folder that carry a mark, with the result each was marked
    with. A mark that cannot be read (e.g. half written) counts as none, and so does one whose
    checkpoint lacks a file it lists or holds it at another size (a copy cut short)."""
    fs, path = _filesystem(folder)
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(path, allow_not_found=True))
    except OSError:
        return []
    found = []
    for info in infos:
        if info.type != pyarrow.fs.FileType.Directory or not info.base_name.startswith("checkpoint_"):
            continue
        checkpoint = tune.Checkpoint(info.path, filesystem=fs)
        record = mark_of(checkpoint)
        if record is not None:
            found.append((checkpoint, record))
    return found


def mark_of(checkpoint: tune.Checkpoint) -> dict[str, Any] | None:
    """The result a whole checkpoint was marked with; ``None`` when unmarked or not whole."""
    try:
        metadata = checkpoint.get_metadata()
        record, files = metadata.get(REPORTED), metadata.get(FILES)
        whole = files is None or files == _file_sizes(checkpoint)  # None: marked by the driver
    except (OSError, ValueError, AttributeError):
        return None
    if whole and isinstance(record, dict) and isinstance(record.get("epoch"), int | float):
        return record
    return None


def _file_sizes(checkpoint: tune.Checkpoint) -> dict[str, int]:
    """Each file of a checkpoint (its path inside it) and its size; the mark itself left out."""
    fs, root = checkpoint.filesystem, checkpoint.path.rstrip("/")
    infos = fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True))
    return {info.path[len(root) + 1:]: info.size for info in infos
            if info.type == pyarrow.fs.FileType.File and info.base_name != METADATA_FILE}


def _filesystem(uri: str) -> tuple[pyarrow.fs.FileSystem, str]:
    if "://" in uri:
        return pyarrow.fs.FileSystem.from_uri(uri)
    return pyarrow.fs.LocalFileSystem(), str(Path(uri).absolute())
