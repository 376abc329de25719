"""Training batches: index tensors into data that sits where the model is.

An epoch is planned at once (:meth:`TrainingBatches.epoch`): the sampler's caption order and
batch bounds (:mod:`icr.data.sampler`), every caption's augmented ids
(:meth:`~icr.data.captions.CaptionTable.augmented`) and the random-erasing boxes of pixel
images, all drawn from generators seeded by ``(seed, epoch)`` and moved to the training device
in one copy each. A step is then slices of that plan and one gather of each input
(:class:`~icr.data.images.ImageStore`, the latent targets): no per-pair Python, no collate.
The batches of an epoch are a function of ``(seed, epoch)`` alone, so a run resumed at an epoch
boundary sees the data an uninterrupted one sees, and the CPU and a GPU draw the same captions.

Inputs that do not fit the trial's device budget stay in host memory (memory-mapped files): on
CUDA a thread gathers the coming batches' rows into pinned memory and copies them on a side
stream while the current step runs (:class:`_Prefetch`); on the CPU they are gathered in place.
On CUDA a thread also plans the next epoch while this one trains (``plan_ahead``): a plan is
host work (the order and the word dropout of every caption), which would otherwise stall the
GPU at every epoch's first batch.

A batch is a dict: ``images`` ``(B, ...)`` (the encoder's input), ``image_index`` ``(B,)`` (the
dataset index of each pair's image), ``tokens`` ``(B, T)`` and ``lengths`` ``(B,)`` (augmented
caption ids; lengths on the CPU, where packed RNNs read them), ``clean_tokens`` and
``clean_lengths`` (the vocabulary ids the ITD decoder reconstructs), and ``targets``
``(B, D_target)`` when latent targets are given.

With ``static_shapes`` (the batches of a step captured as a CUDA graph, :mod:`icr.train.graphs`)
the captions are padded to the next of a few lengths (:func:`padded_length`: 8, 16, 24, 32, 48,
64, 96, ...) instead of the batch's longest, and both length vectors are on the device, so an
epoch of pair batches has a handful of shapes and nothing a step reads lives on the host.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from icr.data.captions import CaptionTable
from icr.data.images import ImageStore, PixelNorm, encoder_input, erase, erasing_boxes
from icr.data.sampler import build_batch_sampler
from icr.seeding import derive_seed

__all__ = ["Batch", "TrainingBatches", "padded_length"]

Batch = dict[str, Tensor]
_STREAM = 4  # derive_seed stream of augmentation (3: batch sampling, see icr.data.sampler)
PREFETCH_DEPTH = 3  # host batches gathered ahead of the step that reads them
# the lengths static-shape batches pad their captions to: fine steps where captions are (COCO's
# average 10.5 words, at most about 50), then steps of a half and a third
PADDED_LENGTHS = (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def padded_length(longest: int, width: int) -> int:
    """The length a static-shape batch whose longest caption has ``longest`` tokens is padded to:
    the first of :data:`PADDED_LENGTHS` that holds it, at most ``width`` (the table's)."""
    return min(next((n for n in PADDED_LENGTHS if n >= longest), longest), width)


@dataclass(frozen=True)
class _HostPlan:
    """One epoch's plan as drawn on the host (what :class:`_Epoch` places on the device)."""

    bounds: np.ndarray  # (steps + 1,)
    captions: Tensor  # (n,) caption indices in batch order
    images: Tensor  # (n,) the image of each
    tokens: Tensor  # (n, T) augmented ids
    lengths: Tensor  # (n,)
    erasing: Tensor | None  # (n, 4) random-erasing boxes of pixel images


@dataclass(frozen=True)
class _Epoch:
    """One epoch's plan: on the device unless said otherwise."""

    bounds: np.ndarray  # (steps + 1,) CPU
    captions: Tensor  # (n,) caption indices in batch order
    captions_cpu: Tensor  # (n,) CPU copy, for host arrays and the lengths
    images: Tensor  # (n,) the image of each
    images_cpu: Tensor  # (n,) CPU copy, for host stores
    tokens: Tensor  # (n, T) augmented ids
    lengths: Tensor  # (n,) CPU
    lengths_device: Tensor | None  # (n,) on the device (static shapes)
    erasing: Tensor | None  # (n, 4) random-erasing boxes of pixel images


class TrainingBatches:
    """The training split's batches, epoch by epoch (module docstring).

    Args:
        images: the training split's image store.
        caption_image: ``(C,)`` the image of each training caption.
        captions: what the caption encoder reads, per caption.
        clean: the captions' vocabulary ids (what the ITD decoder reconstructs).
        targets: ``(C, D_target)`` latent targets, resident on the device or a host array.
        sampler, batch_size, epoch_unit: :func:`~icr.data.sampler.build_batch_sampler`.
        seed: the run's seed; augmentation and order are functions of ``(seed, epoch)``.
        unk_prob, delete_prob: word dropout (:meth:`CaptionTable.augmented`).
        random_erasing: probability of erasing a box of a pixel image.
        normalize: the image encoder's pixel normalisation.
        device: the training device.
        prefetch: gather host rows in a thread (default: on CUDA when a store is on the host).
        static_shapes: captions padded to :func:`padded_length`, lengths on the device (module
            docstring).
        plan_ahead: plan the next epoch in a thread (default: on CUDA).
    """

    def __init__(
        self, *, images: ImageStore, caption_image: np.ndarray, captions: CaptionTable,
        clean: CaptionTable, targets: Tensor | np.ndarray | None, sampler: str,
        batch_size: int, epoch_unit: str, seed: int, unk_prob: float, delete_prob: float,
        random_erasing: float, normalize: PixelNorm, device: torch.device,
        prefetch: bool | None = None, static_shapes: bool = False,
        plan_ahead: bool | None = None,
    ) -> None:
        self.store, self.device, self.seed = images, device, seed
        self.captions, self.unk_prob, self.delete_prob = captions, unk_prob, delete_prob
        self.sampler = build_batch_sampler(sampler, caption_image, batch_size,
                                           seed=derive_seed(seed, 2), epoch_unit=epoch_unit)
        self.caption_image = torch.as_tensor(np.asarray(caption_image, dtype=np.int64))
        self.caption_image_device = self.caption_image.to(device)
        clean_tokens, self.clean_lengths = clean.clean()  # (C, T), (C,) CPU
        if static_shapes:
            clean_tokens = _pad_columns(clean_tokens)
        self.clean_tokens = clean_tokens.to(device)
        self.targets = targets
        self.erasing = random_erasing if images.images.pixels else 0.0
        self.static_shapes = static_shapes
        self.clean_lengths_device = self.clean_lengths.to(device) if static_shapes else None
        self.normalize = normalize
        host_targets = isinstance(targets, np.ndarray)
        self.prefetch = (device.type == "cuda" and (not images.resident or host_targets)
                         if prefetch is None else prefetch)
        self.plan_ahead = device.type == "cuda" if plan_ahead is None else plan_ahead
        self._sampling = threading.Lock()  # the sampler's epoch and its plan go together
        self._ahead: tuple[int, Future[_HostPlan]] | None = None
        self._planner: ThreadPoolExecutor | None = None

    def __len__(self) -> int:
        return len(self.sampler)

    def _host_plan(self, epoch: int) -> _HostPlan:
        """Epoch ``epoch``'s order, augmentation and erasing boxes, drawn on the host from
        generators seeded by ``(seed, epoch)`` alone (so a thread may draw it)."""
        with self._sampling:
            self.sampler.set_epoch(epoch)
            order, bounds = self.sampler.plan()  # (n,), (steps + 1,)
        captions = torch.from_numpy(order)  # (n,)
        generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, _STREAM))
        table = self.captions.rows(captions)
        tokens, lengths = table.augmented(generator, self.unk_prob, self.delete_prob)  # (n, T)
        if self.static_shapes:
            tokens = _pad_columns(tokens)
        erasing = None
        if self.erasing > 0:
            height, width = self.store.images.item_shape[-2:]
            erasing = erasing_boxes(len(order), height, width, self.erasing, generator)
        return _HostPlan(bounds, captions, self.caption_image[captions], tokens, lengths, erasing)

    def _plan(self, epoch: int) -> _Epoch:
        """Epoch ``epoch``'s plan on the device: the one planned ahead if there is one, and
        the next epoch's started (``plan_ahead``)."""
        if self._ahead is not None and self._ahead[0] == epoch:
            host = self._ahead[1].result()
        else:
            host = self._host_plan(epoch)
        if self.plan_ahead and (self._ahead is None or self._ahead[0] != epoch + 1):
            if self._planner is None:
                self._planner = ThreadPoolExecutor(1, thread_name_prefix="icr-plan")
            self._ahead = (epoch + 1, self._planner.submit(self._host_plan, epoch + 1))
        to = self._to_device
        return _Epoch(host.bounds, to(host.captions), host.captions, to(host.images),
                      host.images, to(host.tokens), host.lengths,
                      to(host.lengths) if self.static_shapes else None,
                      None if host.erasing is None else to(host.erasing))

    def _to_device(self, x: Tensor) -> Tensor:
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    def epoch(self, epoch: int, steps: int | None = None) -> Iterator[Batch]:
        """The batches of ``epoch`` (0-based), at most ``steps`` of them."""
        plan = self._plan(epoch)
        steps = len(plan.bounds) - 1 if steps is None else min(steps, len(plan.bounds) - 1)
        host = self._host_rows(plan)
        if self.prefetch and host is not None:
            with _Prefetch(host, steps, self.device) as fetched:
                for step in range(steps):
                    yield self._batch(plan, step, fetched.next())
        else:
            for step in range(steps):
                yield self._batch(plan, step, host(step) if host is not None else {})

    def _host_rows(self, plan: _Epoch) -> Callable[[int], Batch] | None:
        """The rows a step reads from host memory, or ``None`` when everything is resident."""
        host_images = not self.store.resident
        host_targets = isinstance(self.targets, np.ndarray)
        if not (host_images or host_targets):
            return None

        def rows(step: int) -> Batch:
            start, stop = plan.bounds[step], plan.bounds[step + 1]
            out = {}
            if host_images:
                out["images"] = self.store.take(plan.images_cpu[start:stop])
            if host_targets:
                index = plan.captions_cpu[start:stop].numpy()
                out["targets"] = torch.from_numpy(np.ascontiguousarray(self.targets[index]))
            return out

        return rows

    def _batch(self, plan: _Epoch, step: int, host: Batch) -> Batch:
        start, stop = int(plan.bounds[step]), int(plan.bounds[step + 1])
        captions = plan.captions[start:stop]  # (B,)
        image_index = plan.images[start:stop]  # (B,)
        lengths = plan.lengths[start:stop]  # (B,) CPU
        images = host.get("images")
        if images is None:
            images = self.store.take(image_index)
        images = encoder_input(images.to(self.device, non_blocking=True), self.normalize)
        if plan.erasing is not None:
            images = erase(images, plan.erasing[start:stop])
        clean_lengths = self.clean_lengths.index_select(0, plan.captions_cpu[start:stop])
        width, clean_width = int(lengths.max()), int(clean_lengths.max())
        if self.static_shapes:  # padded further: the tables are wide enough (see _plan, __init__)
            width = padded_length(width, plan.tokens.shape[1])
            clean_width = padded_length(clean_width, self.clean_tokens.shape[1])
            # the lengths' device copies, which a captured step reads (set with static shapes)
            lengths = plan.lengths_device[start:stop]
            clean_lengths = self.clean_lengths_device.index_select(0, captions)
        batch = {
            "images": images,  # (B, ...)
            "image_index": image_index,
            "tokens": plan.tokens[start:stop, :width],  # (B, T)
            "lengths": lengths,
            "clean_tokens": self.clean_tokens.index_select(0, captions)[:, :clean_width],  # (B, T')
            "clean_lengths": clean_lengths,
        }
        if "targets" in host:
            batch["targets"] = host["targets"].to(self.device, non_blocking=True)
        elif self.targets is not None:
            batch["targets"] = self.targets.index_select(0, captions)  # (B, D_target)
        return batch


def _pad_columns(tokens: Tensor) -> Tensor:
    """``tokens`` right-padded with 0 to :func:`padded_length` of its width, so that every batch
    of it can be padded to the padded length of its longest caption.

    Shapes: ``(n, T)`` -> ``(n, padded_length(T))``."""
    width = tokens.shape[1]
    return torch.nn.functional.pad(tokens, (0, padded_length(width, 2**31) - width))


class _Prefetch:
    """Host rows of the coming steps, gathered by a thread ahead of the step that reads them.

    On CUDA the thread pins each gathered tensor and copies it to the device on its own stream;
    the reader's stream waits for that copy (an event) and takes ownership of the memory
    (``record_stream``), so the gather and the copy overlap the steps before. On the CPU the
    thread only gathers (what a test runs). An exception in the thread is raised in the reader.
    """

    def __init__(self, rows: Callable[[int], Batch], steps: int, device: torch.device) -> None:
        self.rows, self.steps, self.device = rows, steps, device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.queue: queue.Queue = queue.Queue(maxsize=PREFETCH_DEPTH)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._work, name="icr-prefetch", daemon=True)

    def __enter__(self) -> _Prefetch:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        while self.thread.is_alive():  # unblock a thread waiting on a full queue
            try:
                self.queue.get_nowait()
            except queue.Empty:
                self.thread.join(timeout=0.05)

    def _work(self) -> None:
        try:
            for step in range(self.steps):
                if self.stop.is_set():
                    return
                self._put(self._fetch(step))
        except BaseException as exc:  # handed to the reader, which raises it
            self._put(exc)

    def _put(self, item: object) -> None:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _fetch(self, step: int) -> tuple[Batch, object]:
        rows = self.rows(step)
        if not self.cuda:
            return rows, None
        with torch.cuda.stream(self.stream):
            moved = {k: v.pin_memory().to(self.device, non_blocking=True) for k, v in rows.items()}
            event = torch.cuda.Event()
            event.record(self.stream)
        return moved, event

    def next(self) -> Batch:
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        rows, event = item
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for tensor in rows.values():
                tensor.record_stream(current)
        return rows
