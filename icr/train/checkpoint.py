"""Checkpoint folders: written atomically, read without unpickling arbitrary objects.

A checkpoint is a folder holding ``state.pt`` (everything a run needs to continue exactly: model,
optimiser, schedule, objective, loop position, history, RNG states), ``best_model.pt`` (the weights
of the best validation epoch) and, on the last epoch, ``artifacts/`` (what the analyses wrote).

:func:`save_checkpoint` writes the new folder beside the old one, moves the old one aside, moves
the new one in, and only then deletes the old one: at every instant one complete checkpoint exists,
which :func:`find_checkpoint` finds. :func:`load_checkpoint` reads with
``torch.load(weights_only=True)``: a checkpoint holds tensors, numbers, strings and containers of
them only (the RNG states are stored as such), so loading a checkpoint from elsewhere cannot run
code.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

STATE_FILE = "state.pt"
BEST_FILE = "best_model.pt"
ARTIFACTS = "artifacts"


def save_checkpoint(
    directory: Path, state: dict[str, Any], best: dict[str, torch.Tensor] | None = None,
    artifacts: Path | None = None,
) -> Path:
    """Write ``state`` (and the best weights, and a folder of artifacts) to ``directory``."""
    directory = Path(directory)
    tmp, old = (directory.with_name(directory.name + suffix) for suffix in (".tmp", ".old"))
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(state, tmp / STATE_FILE)
    if best is not None:
        torch.save(best, tmp / BEST_FILE)
    if artifacts is not None and artifacts.is_dir():
        shutil.copytree(artifacts, tmp / ARTIFACTS)
    if (directory / STATE_FILE).exists():
        shutil.rmtree(old, ignore_errors=True)
        directory.rename(old)
    else:
        shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


def find_checkpoint(directory: Path | str) -> Path | None:
    """The complete checkpoint :func:`save_checkpoint` left at ``directory``, or ``None``.

    That is ``directory`` itself, or, after an interruption between the two renames of a save,
    the previous checkpoint moved aside to ``directory.old``.
    """
    directory = Path(directory)
    for candidate in (directory, directory.with_name(directory.name + ".old")):
        if (candidate / STATE_FILE).exists():
            return candidate
    return None


def load_checkpoint(directory: Path | str) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor] | None]:
    """``(folder found, state, best weights or None)`` of the checkpoint at ``directory``.

    Raises:
        FileNotFoundError: no complete checkpoint there.
    """
    found = find_checkpoint(directory)
    if found is None:
        raise FileNotFoundError(f"{Path(directory) / STATE_FILE}: no checkpoint")
    state = torch.load(found / STATE_FILE, map_location="cpu", weights_only=True)
    best_path = found / BEST_FILE
    best = torch.load(best_path, map_location="cpu", weights_only=True) if best_path.exists() else None
    return found, state, best
