"""Features of a frozen CNN, computed once per (weights, images, resolution) and cached on disk.

When the image backbone stays frozen for a whole run (VSE++ in the metric-learning study trains
only the fc layer on top of a frozen ResNet) and no image augmentation is on, every epoch would
recompute the same pooled features. :func:`cached_backbone_features` computes them once, in eval
mode, without gradients and in batches, and stores them as ``.npy`` (written atomically, so
concurrent trials never read half a file). Training then feeds the cached ``(N, D)`` features to
the trainable projection. ``benchmarks/frozen_features.py`` measures what this saves.

The cache key covers everything the features depend on: the encoder's weights and buffers (a
digest of its state dict, so a different checkpoint or BatchNorm statistics give a new file),
the image bytes and their shape (so the resolution), the normalisation function's name and any
``key_parts`` the caller adds (e.g. the encoder's registry name).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from icr.io import save_npy_atomic

logger = logging.getLogger(__name__)

_HASH_CHUNK = 1 << 24  # bytes of image data hashed at a time


def weights_fingerprint(module: nn.Module) -> str:
    """Hex digest of a module's state dict: every name, dtype, shape and value."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().data)
    return digest.hexdigest()


def images_fingerprint(images: np.ndarray | Tensor) -> str:
    """Hex digest of an image array's dtype, shape and bytes (hashed in chunks)."""
    array = images.detach().cpu().numpy() if isinstance(images, Tensor) else np.asarray(images)
    flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
    digest = hashlib.sha256(f"{array.dtype}|{array.shape}|".encode())
    for start in range(0, len(flat), _HASH_CHUNK):
        digest.update(flat[start : start + _HASH_CHUNK].data)
    return digest.hexdigest()


def feature_cache_path(cache: str | Path, key: str) -> Path:
    """``<dir>/backbone_features_<key>.npy`` for a folder, ``<stem>_<key>.npy`` for a .npy name."""
    cache = Path(cache)
    if cache.suffix == ".npy":
        return cache.with_name(f"{cache.stem}_{key[:20]}.npy")
    return cache / f"backbone_features_{key[:20]}.npy"


def cache_key(
    encoder: nn.Module,
    images_uint8: np.ndarray | Tensor,
    normalize_fn: Callable[[Tensor], Tensor],
    *key_parts: object,
) -> str:
    """The digest naming a feature cache: weights, image data and shape, normalisation, extras."""
    module = getattr(normalize_fn, "__module__", "")
    fn_name = f"{module}.{getattr(normalize_fn, '__qualname__', repr(normalize_fn))}"
    digest = hashlib.sha256()
    for part in (
        weights_fingerprint(encoder),
        images_fingerprint(images_uint8),
        fn_name,
        *key_parts,
    ):
        digest.update(f"{part}\0".encode())
    return digest.hexdigest()


@torch.no_grad()
def compute_backbone_features(
    encoder: nn.Module,
    images_uint8: np.ndarray | Tensor,
    normalize_fn: Callable[[Tensor], Tensor],
    *,
    batch_size: int = 128,
    device: str | torch.device | None = None,
) -> Tensor:
    """Pooled features of every image, in eval mode, without gradients, ``batch_size`` at a time.

    The encoder's train / eval mode is restored afterwards.

    Args:
        encoder: maps normalised images to pooled features, e.g. an
            :class:`~icr.models.image.ImageEncoder`.
        images_uint8: RGB images, 0-255.
        normalize_fn: turns a float batch in [0, 1] into the encoder's input.
        batch_size: images per forward pass.
        device: where the encoder runs (its parameters' device by default); the encoder is
            moved there.

    Shapes:
        images_uint8: ``(N, 3, H, W)`` uint8; returns ``(N, D)`` float32 on ``device``.
    """
    if device is None:
        device = next(encoder.parameters()).device
    encoder.to(device)  # where the images go: the module and its input on one device
    was_training = encoder.training
    encoder.eval()
    try:
        parts = []
        for start in range(0, len(images_uint8), batch_size):
            batch = torch.as_tensor(np.array(images_uint8[start : start + batch_size]))
            batch = normalize_fn(batch.to(device).float() / 255.0)  # (b, 3, H, W)
            parts.append(encoder(batch).float())  # (b, D)
    finally:
        encoder.train(was_training)
    return torch.cat(parts)


def cached_backbone_features(
    encoder: nn.Module,
    images_uint8: np.ndarray | Tensor,
    normalize_fn: Callable[[Tensor], Tensor],
    cache: str | Path,
    *key_parts: object,
    batch_size: int = 128,
    device: str | torch.device | None = None,
) -> Tensor:
    """The frozen encoder's pooled features of ``images_uint8``, from the cache or computed once.

    Use it only when the backbone is frozen for the whole run and the images are not augmented:
    the cached features are those of the un-augmented images under the current weights.

    Args:
        encoder: the frozen encoder (see :func:`compute_backbone_features`).
        images_uint8: RGB images, 0-255, at the resolution the model sees.
        normalize_fn: turns a float batch in [0, 1] into the encoder's input.
        cache: a folder, or a ``.npy`` file name whose stem the key is appended to.
        *key_parts: anything else the features depend on (e.g. the encoder's name), for the key.
        batch_size: images per forward pass.
        device: where the encoder runs.

    Shapes:
        images_uint8: ``(N, 3, H, W)`` uint8; returns ``(N, D)`` float32 on the CPU.
    """
    path = feature_cache_path(cache, cache_key(encoder, images_uint8, normalize_fn, *key_parts))
    if path.exists():
        features = np.load(path)
        if features.ndim == 2 and features.shape[0] == len(images_uint8):
            logger.info("backbone features: cache hit %s %s", path, features.shape)
            return torch.from_numpy(features)
        logger.warning("backbone features: %s has shape %s; recomputing", path, features.shape)
    features = compute_backbone_features(
        encoder, images_uint8, normalize_fn, batch_size=batch_size, device=device
    ).cpu()
    save_npy_atomic(path, features.numpy())
    logger.info("backbone features %s written to %s", tuple(features.shape), path)
    return features
