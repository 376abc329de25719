"""A split's image inputs: read without copying, held where the model reads them.

:class:`SplitImages` is what preparing the data gives for one split: its region features, decoded
pixels or pooled backbone features, in the split's image order, as the files hold them. A ``.npy``
file is opened as a read-only memory map, so every trial on a machine shares the operating
system's page cache and none holds a private copy (COCO's BUTD training features are
113,287 x 36 x 2048 float32, 33 GB; ``benchmarks/paper_scale.py`` measures what a trial holds).

:class:`ImageStore` places a split for training: copied to the training device when the trial's
inputs fit its budget (``data.device_budget_gb``), otherwise left in host memory and gathered
row by row for each batch (:mod:`icr.data.batches` prefetches those on CUDA).

:func:`erasing_boxes`, :func:`erase` and :func:`encoder_input` turn ``uint8`` pixels into what an
image encoder reads (normalised and randomly erased) on the device, for a whole batch at once.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "ERASING_ATTEMPTS",
    "ImageStore",
    "PixelNorm",
    "SplitImages",
    "encoder_input",
    "erase",
    "erasing_boxes",
    "place_images",
]

PixelNorm = Callable[[Tensor], Tensor]  # RGB in [0, 1] (B, 3, H, W) -> encoder input

ERASING_ATTEMPTS = 10  # torchvision's RandomErasing tries this many boxes before giving up
ERASING_SCALE = (0.02, 0.33)  # torchvision's defaults: the erased share of the image
ERASING_RATIO = (0.3, 3.3)  # and its aspect ratio


@dataclass(frozen=True)
class SplitImages:
    """One split's image inputs in the split's image order, as the file holds them.

    Attributes:
        array: ``(N_file, ...)``: region features ``(R, D)`` float, pixels ``(3, H, W)`` uint8,
            or pooled features ``(D,)`` float; often a read-only memory map.
        rows: ``(N,)`` int64, the row of ``array`` holding each image of the split, or ``None``
            when row ``i`` is image ``i``.
        boxes: ``(N_file, R, 4)`` float32 region boxes (xyxy over the image size, in [0, 1]),
            appended to each region's features, or ``None``.
    """

    array: np.ndarray
    rows: np.ndarray | None = None
    boxes: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.rows) if self.rows is not None else len(self.array)

    @property
    def pixels(self) -> bool:
        """Decoded ``uint8`` pixels (normalised by :func:`encoder_input`), not features."""
        return self.array.dtype == np.uint8

    @property
    def item_shape(self) -> tuple[int, ...]:
        """The shape of one image's input (boxes appended to each region)."""
        shape = tuple(self.array.shape[1:])
        return (*shape[:-1], shape[-1] + 4) if self.boxes is not None else shape

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self), *self.item_shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the split's inputs as :meth:`take` gives them (float32 or uint8)."""
        return len(self) * math.prod(self.item_shape) * (1 if self.pixels else 4)

    def take(self, index: np.ndarray | Tensor) -> Tensor:
        """Images ``index`` as a new CPU tensor: only their rows are read from the file.

        Shapes: index ``(B,)``; returns ``(B, *item_shape)``, float32 or uint8.
        """
        index = np.asarray(index, dtype=np.int64)
        rows = index if self.rows is None else self.rows[index]
        x = self.array[rows]  # (B, ...): fancy indexing copies the rows it reads
        if not self.pixels:
            x = x.astype(np.float32, copy=False)
        if self.boxes is not None:
            x = np.concatenate([x, self.boxes[rows].astype(np.float32, copy=False)], axis=-1)
        return torch.from_numpy(np.ascontiguousarray(x))

    def slice(self, start: int, stop: int) -> Tensor:
        """Images ``start:stop`` (see :meth:`take`)."""
        return self.take(np.arange(start, min(stop, len(self))))

    def tensor(self) -> Tensor:
        """The whole split as one tensor: a view of the (memory-mapped) array when nothing is
        rearranged (no row map, no boxes, float32 or uint8 already), which holds no private
        memory; otherwise a copy."""
        if self.rows is None and self.boxes is None and self.array.dtype in (np.float32,
                                                                              np.uint8):
            with warnings.catch_warnings():  # a read-only map: the tensor is never written
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                return torch.from_numpy(self.array)
        return self.slice(0, len(self))


class ImageStore:
    """A split's images where training reads them: on the device, or in host memory.

    A resident store holds the split as one tensor on ``device`` and gathers a batch with
    ``index_select`` (the index on the device); a host store reads a batch's rows from
    :class:`SplitImages` (the index on the CPU) and the caller moves them.
    """

    def __init__(self, images: SplitImages, device: torch.device, resident: bool) -> None:
        self.images, self.device, self.resident = images, device, resident
        self._data = images.tensor().to(device) if resident else None

    def __len__(self) -> int:
        return len(self.images)

    def take(self, index: Tensor) -> Tensor:
        """Images ``index``: on the device for a resident store (``index`` on the device), a
        CPU tensor otherwise (``index`` on the CPU)."""
        if self._data is not None:
            return self._data.index_select(0, index)
        return self.images.take(index.numpy())

    def rows(self, start: int, stop: int) -> Tensor:
        """Images ``start:stop`` on the device (evaluation reads a split in order); a copy, so
        that nothing the encoder does to its input reaches the store (or a read-only map)."""
        if self._data is not None:
            return self._data[start:stop].clone()
        return self.images.slice(start, stop).to(self.device)


def place_images(
    splits: dict[str, SplitImages], device: torch.device, budget_bytes: float
) -> dict[str, ImageStore]:
    """Each split resident on ``device`` while the splits placed so far fit ``budget_bytes``
    (in the order given: the training split first), the rest in host memory."""
    used, stores = 0, {}
    for name, images in splits.items():
        resident = used + images.nbytes <= budget_bytes
        used += images.nbytes if resident else 0
        stores[name] = ImageStore(images, device, resident)
    return stores


def encoder_input(images: Tensor, normalize: PixelNorm) -> Tensor:
    """What an image encoder reads: ``uint8`` pixels as floats in [0, 1] through ``normalize``
    (ImageNet statistics unless the encoder registered its own); features as they are."""
    if images.dtype != torch.uint8:
        return images
    return normalize(images.float().div_(255.0))


def erasing_boxes(
    count: int, height: int, width: int, p: float, generator: torch.Generator
) -> Tensor:
    """Random-erasing boxes of ``count`` images, drawn as torchvision's ``RandomErasing`` draws
    them (Zhong et al., AAAI 2020; VSE++ and the LTD reference erase training images with
    p = 0.2), all at once.

    Per image: erase with probability ``p``; try up to :data:`ERASING_ATTEMPTS` boxes of area
    ``U(0.02, 0.33)`` of the image and aspect ratio ``exp(U(log 0.3, log 3.3))``, with sides
    ``round(sqrt(area * ratio))`` by ``round(sqrt(area / ratio))``; the first box smaller than
    the image is placed at a uniformly drawn corner; none fitting, nothing is erased.

    Returns:
        ``(count, 4)`` int64 ``(top, left, h, w)``; ``h = w = 0`` where nothing is erased.
    """
    shape = (count, ERASING_ATTEMPTS)
    u_apply = torch.rand(count, generator=generator, dtype=torch.float64)
    u_area, u_ratio, u_top, u_left = (
        torch.rand(shape, generator=generator, dtype=torch.float64) for _ in range(4))
    return erasing_boxes_from(u_apply, u_area, u_ratio, u_top, u_left, height, width, p)


def erasing_boxes_from(
    u_apply: Tensor, u_area: Tensor, u_ratio: Tensor, u_top: Tensor, u_left: Tensor,
    height: int, width: int, p: float,
) -> Tensor:
    """:func:`erasing_boxes` from given uniforms in [0, 1): ``u_apply (N,)``, the others
    ``(N, attempts)``. Returns ``(N, 4)`` int64 ``(top, left, h, w)``."""
    lo, hi = ERASING_SCALE
    area = height * width * (lo + (hi - lo) * u_area)  # (N, A)
    log_lo, log_hi = math.log(ERASING_RATIO[0]), math.log(ERASING_RATIO[1])
    ratio = torch.exp(log_lo + (log_hi - log_lo) * u_ratio)  # (N, A)
    h = torch.round(torch.sqrt(area * ratio)).long()  # (N, A): half to even, as Python's round
    w = torch.round(torch.sqrt(area / ratio)).long()
    fits = (h < height) & (w < width)  # (N, A)
    top = torch.floor(u_top * (height - h + 1)).long()
    left = torch.floor(u_left * (width - w + 1)).long()
    first = fits.to(torch.uint8).argmax(dim=1, keepdim=True)  # (N, 1): the first box that fits
    box = torch.cat([t.gather(1, first) for t in (top, left, h, w)], dim=1)  # (N, 4)
    erased = (u_apply < p) & fits.any(dim=1)  # (N,)
    return box * erased[:, None]


def erase(images: Tensor, boxes: Tensor) -> Tensor:
    """Set each image's box to 0 (after normalisation, as torchvision erases a normalised
    tensor with value 0). Shapes: images ``(B, C, H, W)``, boxes ``(B, 4)``; returns images."""
    top, left, h, w = (boxes[:, i, None, None] for i in range(4))  # (B, 1, 1) each
    ys = torch.arange(images.shape[-2], device=images.device)[None, :, None]  # (1, H, 1)
    xs = torch.arange(images.shape[-1], device=images.device)[None, None, :]  # (1, 1, W)
    inside = (ys >= top) & (ys < top + h) & (xs >= left) & (xs < left + w)  # (B, H, W)
    return images.masked_fill(inside[:, None], 0.0)
