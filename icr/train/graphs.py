"""A training step replayed as a CUDA graph: one launch for the hundreds of kernels of a step.

A step of the papers' models at their batch size of 128 is a few GFLOP spread over hundreds of
small kernels; launched one by one from Python it keeps the CPU busy for longer than the GPU
needs to run them (the step is launch-bound: four times the batch costs about 1.08x the time).
A CUDA graph records the kernels of one call once and replays them with a single launch
(`CUDA graphs <https://pytorch.org/docs/stable/notes/cuda.html#cuda-graphs>`_).

What that asks of the step (:class:`GraphedStep` checks none of it; the task is built for it):

- **Static shapes and addresses.** A graph replays the shapes and memory it recorded: the step's
  inputs are copied into tensors the graphs read, one graph per input shape (the batches pad their
  captions to a few lengths, :func:`icr.data.batches.padded_length`), and its outputs are copied
  out after each replay. Graphs never run at once, so those input tensors are shared, one per
  (name, shape, dtype): a batch of 128 images at 224 x 224 is 77 MB once, not once per graph.
- **Nothing read on the host.** A value read by the CPU (``.item()``, a packed sequence's
  lengths, a Python branch on a tensor) would be frozen at its captured value, or fail the capture.
  The models' static-shape paths (:mod:`icr.models.recurrent`) and the sync-free losses and
  optimisers avoid them; ``tests/test_graphs.py`` traces every architecture's forward pass and
  loss, and every registered loss, with ``torch._dynamo`` and fails on a graph break, which is
  what such a read causes (the backward and the optimisers are not traced there).
- **State that changes between steps lives on the device**: the learning rate (a tensor the
  schedule fills), the optimiser's step counts (``capturable``), the Lagrange multiplier.
- **The same computation every replay.** What changes the computation (freezing the backbone in
  the warm-up epochs, the loss's warm-up form) is part of the key a graph is kept under.

Each new (key, shapes) runs ``warmup`` eager steps first, on a side stream as PyTorch asks
(lazy state: the optimiser's moments, cuDNN's workspaces), then is captured and replayed; the
capture records without running, so the step of the batch at hand is its first replay. All
graphs share one memory pool: only the model's and the optimiser's state (allocated outside the
graphs) carries values from one step to the next. Other threads may use CUDA during a capture
(``capture_error_mode="thread_local"``): the thread that prefetches host rows of a split too
large for the device pins and copies them on its own stream meanwhile. A capture that fails (an op that cannot be
captured) logs why and the step stays eager from then on; ``train.cuda_graphs=false`` runs eagerly
from the start. Either way the run says so: :meth:`GraphedStep.take_modes` is the epoch's
:class:`~icr.train.seam.StepModes` (steps replayed and eager, the shapes captured, the reason for
eager steps), which each epoch's report carries to the platform (MLflow, the status line).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from icr.train.seam import CAPTURED, EAGER, PARTLY_EAGER, StepModes

__all__ = ["GraphedStep", "StepFn"]

log = logging.getLogger(__name__)

StepFn = Callable[[dict[str, Tensor]], dict[str, Tensor]]


@dataclass
class _Graph:
    """One captured shape: its graph and the tensors it reads and writes."""

    calls: int = 0  # eager calls made before the capture
    graph: Any = None  # torch.cuda.CUDAGraph once captured
    inputs: dict[str, Tensor] = field(default_factory=dict)
    outputs: dict[str, Tensor] = field(default_factory=dict)


class GraphedStep:
    """Run ``step`` as CUDA graphs, one per (key, input shapes) (module docstring).

    Args:
        step: inputs -> outputs, all device tensors; runs a whole training step (forward,
            backward, optimiser updates) without reading the device from the host.
        enabled: capture graphs; ``False`` calls ``step`` eagerly (the CPU, or
            ``train.cuda_graphs=false``).
        warmup: eager calls of each new (key, shapes) before its capture.
        max_graphs: graphs kept at most; a shape beyond them runs eagerly.
        new_graph: makes a graph (``torch.cuda.CUDAGraph``; a test passes a stand-in).
        capture: the context that records into a graph (``torch.cuda.graph``).
        on_failed_capture: called when a capture fails, before the step runs eagerly: what the
            recorded (never run) step left in Python state must go (an objective's pending
            terms).
        eager_reason: why ``enabled`` is ``False`` (``no CUDA``, ``train.cuda_graphs=false``),
            for :meth:`take_modes`.
    """

    def __init__(
        self, step: StepFn, *, enabled: bool, warmup: int = 3, max_graphs: int = 16,
        new_graph: Callable[[], Any] | None = None, capture: Callable[..., Any] | None = None,
        on_failed_capture: Callable[[], None] = lambda: None, eager_reason: str = "",
    ) -> None:
        self.step, self.enabled, self.warmup, self.max_graphs = step, enabled, warmup, max_graphs
        self.on_failed_capture = on_failed_capture
        self.reason = "" if enabled else (eager_reason or "capture off")
        self.fell_back = False  # steps meant to be captured run eagerly (see reason)
        self._new_graph = new_graph or torch.cuda.CUDAGraph
        self._capture_context = capture or torch.cuda.graph
        self._graphs: dict[Hashable, _Graph] = {}
        self._pool: Any = None
        self._inputs: dict[tuple[str, tuple[int, ...], torch.dtype], Tensor] = {}  # shared
        self.captured = 0  # graphs captured so far
        self.eager_calls = 0  # steps run eagerly (warm-up, fallback, or disabled)
        self.replays = 0  # steps replayed from a graph
        self._taken = (0, 0)  # (replays, eager_calls) at the last take_modes
    def __call__(self, key: Hashable, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        """One step on ``inputs``; ``key`` names what else the step's computation depends on."""
        if not self.enabled:
            return self._eager(inputs)
        signature = (key, tuple((name, tuple(t.shape), t.dtype) for name, t in inputs.items()))
        entry = self._graphs.get(signature)
        if entry is None:
            if self.captured >= self.max_graphs:
                return self._beyond_max_graphs(inputs)
            entry = self._graphs[signature] = _Graph()
        if entry.graph is None:
            if entry.calls < self.warmup:
                entry.calls += 1
                return self._eager(inputs, side_stream=True)
            # shapes that began their warm-up together may have filled the graphs meanwhile
            if self.captured >= self.max_graphs:
                return self._beyond_max_graphs(inputs)
            if not self._capture(entry, inputs):
                return self._eager(inputs)
        for name, tensor in inputs.items():
            entry.inputs[name].copy_(tensor, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return {name: tensor.clone() for name, tensor in entry.outputs.items()}

    def take_modes(self) -> StepModes:
        """How the steps since the last call ran, and the run's state now (module docstring)."""
        replays, eager = self.replays - self._taken[0], self.eager_calls - self._taken[1]
        self._taken = (self.replays, self.eager_calls)
        mode = EAGER if not self.enabled else PARTLY_EAGER if self.fell_back else CAPTURED
        reason = self.reason
        if mode == CAPTURED and not self.captured:  # a short run: every step was a warm-up
            mode, reason = EAGER, f"warm-up: each shape is captured after {self.warmup} eager steps"
        return StepModes(mode, replays, eager, self.shapes(), reason, self.fell_back)

    def shapes(self) -> tuple[str, ...]:
        """The captured graphs' input shapes, each as the inputs that tell the graphs apart
        (``tokens 128x16``; every input's while one shape is captured), in capture order."""
        captured = [{name: shape for name, shape, _ in inputs}
                    for (_, inputs), entry in self._graphs.items() if entry.graph is not None]
        if not captured:
            return ()
        names = [name for name in captured[0] if len({c.get(name) for c in captured}) > 1]
        described = (", ".join(f"{name} {'x'.join(map(str, c[name])) or 'scalar'}"
                               for name in names or captured[0] if name in c) for c in captured)
        return tuple(dict.fromkeys(described))  # graphs of one shape under two keys: once

    def reset(self) -> None:
        """Forget every graph: the state they read was replaced (a checkpoint loaded into the
        model, optimiser or objective); each shape warms up and is captured again."""
        self._graphs.clear()
        self._inputs.clear()
        self.captured = 0

    def _input(self, name: str, like: Tensor) -> Tensor:
        """The input tensor of ``name`` at ``like``'s shape and dtype that every graph reads,
        holding ``like``'s values (the capture records without running)."""
        slot = (name, tuple(like.shape), like.dtype)
        if slot not in self._inputs:
            self._inputs[slot] = like.clone()
        else:
            self._inputs[slot].copy_(like)
        return self._inputs[slot]

    def _beyond_max_graphs(self, inputs: dict[str, Tensor]) -> dict[str, Tensor]:
        if not self.fell_back:
            self.fell_back = True
            self.reason = (f"more than {self.max_graphs} input shapes: the shapes beyond them "
                           "run eagerly")
            log.warning("the training step has %s", self.reason)
        return self._eager(inputs)

    def _eager(self, inputs: dict[str, Tensor], side_stream: bool = False) -> dict[str, Tensor]:
        self.eager_calls += 1
        if not (side_stream and self._is_cuda(inputs)):
            return self.step(inputs)
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            outputs = self.step(inputs)
        current.wait_stream(side)
        for tensor in (*inputs.values(), *outputs.values()):
            tensor.record_stream(current)
        return outputs

    @staticmethod
    def _is_cuda(inputs: dict[str, Tensor]) -> bool:
        return any(t.is_cuda for t in inputs.values())

    def _capture(self, entry: _Graph, inputs: dict[str, Tensor]) -> bool:
        """Record ``step`` on copies of ``inputs``; ``False`` (and eager from now on) when the
        step cannot be captured."""
        entry.inputs = {name: self._input(name, tensor) for name, tensor in inputs.items()}
        graph = self._new_graph()
        # a capture that fails at its end leaves its side stream current (torch.cuda.graph's
        # exit stops before restoring it): the eager steps go back to this one
        stream = torch.cuda.current_stream() if self._is_cuda(inputs) else None
        # thread_local: only this thread's calls that a capture forbids fail it; the thread
        # that prefetches host rows (pinning, copying on its own stream) goes on meanwhile
        try:  # the first capture creates the memory pool the others share
            with self._capture_context(graph, pool=self._pool, capture_error_mode="thread_local"):
                entry.outputs = self.step(entry.inputs)
        except RuntimeError as exc:
            if stream is not None:
                torch.cuda.set_stream(stream)
                torch.cuda.synchronize()
            self.on_failed_capture()
            self.enabled, self.fell_back = False, True
            self._graphs.clear()
            self._inputs.clear()
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.reason = f"capture failed: {reason}"
            log.warning("the training step cannot be captured as a CUDA graph (%s); it runs "
                        "eagerly (train.cuda_graphs=false skips the attempt)", reason)
            return False
        if self._pool is None:
            self._pool = graph.pool()
        entry.graph = graph
        self.captured += 1
        return True
