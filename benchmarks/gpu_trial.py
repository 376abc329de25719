"""A trial's training on a GPU, per architecture: throughput, memory, data waits, CPU agreement.

    python benchmarks/gpu_trial.py                           # every architecture, 300 steps
    python benchmarks/gpu_trial.py --sizes paper             # the papers' model sizes
    python benchmarks/gpu_trial.py --archs tern vsrn --steps 100 --set model.embed_dim=1024

For each retrieval architecture of the studies (the recipe its study trains, on the embedded
benchmark, at the papers' batch size of 128 pairs):

- ``ltd_bound``: region MLP + max pooling, bi-GRU, LTD decoder, L_lag (eta 0.2);
- ``vsepp``: EfficientNet-Lite0 frozen (its cached features) + GRU, triplet SH (loss_functions);
- ``vsrn``: VSRN over the regions + GRU, triplet SH (loss_functions);
- ``adpool`` / ``gpo``: region tokens + bi-GRU tokens pooled by AdPool / GPO, AdOpt
  (pooling_objective);
- ``tern``: TERN (regions + MiniLM, shared layers), LTD L_lag (ltd_architectures);

it builds the trial's task on the GPU (``train.device=cuda``, AMP as configured), runs ``--steps``
training steps after ``--warmup`` untimed ones and prints:

- samples per second (pairs trained per second of wall time, the GPU synchronised per step);
- peak GPU memory allocated (``torch.cuda.max_memory_allocated``) over the timed steps;
- data wait: the share of step time spent waiting for the next batch (:mod:`icr.data.batches`:
  slices of the epoch's plan and a gather of the inputs on the GPU; the first batch of each
  epoch also plans the epoch);
- GPU busy: the share of the wall time of ``--profile-steps`` further steps (not synchronised
  one by one, as training runs them) in which a kernel runs on the GPU (``torch.profiler``: the
  union of the kernels' intervals), the figure that says how far a step is from the card's
  limit; and the ``--top`` kernels by time (with ``train.deterministic`` on and off, what the
  deterministic kernels cost);
- the CUDA graphs the steps were captured as (``train.cuda_graphs``, :mod:`icr.train.graphs`)
  and the steps run eagerly (each shape's warm-up);
- one fixed batch (the first of epoch 0) encoded in evaluation mode, float32, by the trained
  weights on the GPU and by a CPU copy of them: the largest embedding difference, the loss and
  the batch's retrieval metrics (R@1/5/10 both ways, rsum, over the batch's distinct images) on
  each, and whether they agree within ``--tolerance`` (embeddings, loss) and one query of the
  batch (recalls: a near-tie can swap ranks).

The exit code is 1 when any architecture disagrees beyond the tolerance. On a machine without
CUDA it says so and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ARCHS = ("ltd_bound", "vsepp", "vsrn", "adpool", "gpo", "tern")
BATCH = 128  # the papers' batch size (LTD, metric-learning losses, VSE+2AD; LTD's TERN runs)
# --sizes paper: the papers' model sizes (embedding and GRU 1024, the image side's output 1024)
# on the embedded benchmark's data, with cuDNN's autotuner on (as the table measured)
PAPER_SIZES = {"model.embed_dim": 1024, "text.hidden_dim": 1024, "image.output_dim": 1024,
               "train.deterministic": False}


def arch_config(name: str) -> dict[str, Any]:
    """The flat overrides of architecture ``name``: its study's recipe (see the docstring)."""
    if name == "ltd_bound":
        from studies.papers.ltd_bound import BASE, LAGRANGIAN

        return {**BASE, **LAGRANGIAN.overrides, "objective.eta": 0.2}
    if name in ("vsepp", "vsrn"):
        from studies.papers.loss_functions import ARCHITECTURES, BASE, LOSSES

        return {**BASE, **ARCHITECTURES[name][1], **LOSSES["triplet_sh"][1]}
    if name in ("adpool", "gpo"):
        from studies.papers.pooling_objective import BASE, OBJECTIVES

        return {**BASE, "image.pooling": name, "text.pooling": name, **OBJECTIVES["adopt"][1]}
    if name == "tern":
        from studies.papers.ltd_architectures import COMMON, OBJECTIVES, TERN

        return {**COMMON, **TERN, **OBJECTIVES["lagrangian"][1], "objective.eta": 0.2}
    raise ValueError(f"unknown architecture {name!r}; choose from {', '.join(ARCHS)}")


# -- measurement helpers (device-independent, tested on CPU) -------------------------------------


@dataclass(frozen=True)
class StepStats:
    """What ``steps`` timed training steps took."""

    steps: int
    samples: int
    seconds: float  # wall time of the timed steps, data waits included
    wait_seconds: float  # of which waiting for the next batch

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else float("nan")

    @property
    def wait_share(self) -> float:
        return self.wait_seconds / self.seconds if self.seconds > 0 else float("nan")


def measure_steps(
    batches: Iterator[Any], step: Callable[[Any], None], steps: int, *, warmup: int = 0,
    size: Callable[[Any], int] = len, sync: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> StepStats:
    """Run ``warmup + steps`` steps on ``batches``; time the last ``steps``.

    Per step: the wait for ``next(batches)``, then ``step(batch)`` and ``sync()`` (on a GPU,
    ``torch.cuda.synchronize``, so the step's kernels are inside its time).

    Raises:
        ValueError: ``batches`` ran out before ``warmup + steps`` steps.
    """
    timed = samples = 0
    seconds = wait = 0.0
    for i in range(warmup + steps):
        start = clock()
        try:
            batch = next(batches)
        except StopIteration:
            raise ValueError(f"the batches ran out after {i} of {warmup + steps} steps") from None
        ready = clock()
        step(batch)
        sync()
        end = clock()
        if i >= warmup:
            timed += 1
            samples += size(batch)
            seconds += end - start
            wait += ready - start
    return StepStats(timed, samples, seconds, wait)


def busy_share(intervals: Sequence[tuple[float, float]], wall: float) -> float:
    """The share of ``wall`` covered by the union of ``intervals`` (kernels, which may overlap
    on several streams): ``(start, end)`` pairs in the wall's unit."""
    covered, reach = 0.0, -math.inf
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        covered += end - max(start, reach)
        reach = end
    return covered / wall if wall > 0 else float("nan")


def profile_steps(batches: Iterator[Any], step: Callable[[Any], None], steps: int, top: int
                  ) -> tuple[float, list[tuple[str, float]]]:
    """Profile ``steps`` steps on the GPU, synchronised at the end only: the GPU's busy share
    of their wall time and the ``top`` kernels by total time ``(name, ms)``."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step(next(batches))
        torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    # kernels and copies; not the GPU-side spans of annotations (an optimiser's step), which
    # cover the gaps between their kernels too
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not getattr(e, "is_user_annotation", False)]
    share = busy_share([(e.time_range.start, e.time_range.end) for e in kernels], wall_us)
    totals: dict[str, float] = {}
    for e in kernels:
        totals[e.name] = totals.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e3
    return min(share, 1.0), sorted(totals.items(), key=lambda kv: -kv[1])[:top]


def batch_metrics(img: torch.Tensor, cap: torch.Tensor, image_index: torch.Tensor
                  ) -> dict[str, float]:
    """Retrieval metrics of one training batch of pairs: its distinct images against its captions.

    Shapes:
        img ``(B, D)`` (a row per pair; an image may repeat), cap ``(B, D)``, image_index ``(B,)``.
    """
    from icr.metrics import retrieval_metrics

    unique, caption_image = torch.unique(image_index, return_inverse=True)  # (U,), (B,)
    first = torch.full((len(unique),), len(image_index), dtype=torch.long, device=img.device)
    first = first.scatter_reduce(0, caption_image, torch.arange(len(image_index),
                                                                device=img.device), "amin")
    sims = img[first] @ cap.t()  # (U, B)
    out = retrieval_metrics(sims.float().cpu(), caption_image.cpu())
    return {k: out[k] for k in ("i2t_R_at_1", "i2t_R_at_5", "i2t_R_at_10", "t2i_R_at_1",
                                "t2i_R_at_5", "t2i_R_at_10", "rsum")}


def agreement(reference: Mapping[str, float], other: Mapping[str, float], *, tolerance: float,
              recall_step: float) -> list[tuple[str, float, float, bool]]:
    """Per metric ``(name, reference, other, within)``: ``loss`` within ``tolerance`` relative,
    a recall (or rsum) within ``recall_step`` (one query of the batch, in %; rsum: six of them),
    the embedding difference ``emb_max_abs`` within ``tolerance``."""
    rows = []
    for name, ref in reference.items():
        value = other[name]
        if name == "emb_max_abs":
            ok = value <= tolerance
        elif name == "loss":
            ok = abs(value - ref) <= tolerance * max(1.0, abs(ref))
        else:
            allowed = recall_step * (6 if name == "rsum" else 1)
            ok = abs(value - ref) <= allowed + 1e-9
        rows.append((name, ref, value, ok))
    return rows


# -- the GPU run ----------------------------------------------------------------------------------


def _batches(task: Any) -> Iterator[dict[str, torch.Tensor]]:
    epoch = 0
    while True:
        yield from task.batches(epoch)
        epoch += 1


def _encode(net: Any, loss_fn: Any, batch: Mapping[str, torch.Tensor], device: torch.device
            ) -> tuple[torch.Tensor, dict[str, float]]:
    """The fixed batch through ``net`` in evaluation mode, float32: embeddings and metrics."""
    from icr.losses.contrastive import split_output

    net.eval()
    with torch.no_grad():
        img, cap = net["encoder"](batch["images"].to(device), batch["tokens"].to(device),
                                  batch["lengths"])
        index = batch["image_index"].to(device)
        loss, _ = split_output(loss_fn((img @ cap.t()).float(), index))
    return torch.cat([img, cap]).float().cpu(), {"loss": float(loss),
                                                 **batch_metrics(img, cap, index)}


def run_arch(name: str, args: argparse.Namespace, workspace: Any,
             device: torch.device | None = None) -> bool:
    """Measure one architecture on ``device`` (default: the GPU); print its row; True if the
    device and the CPU agree on the fixed batch. (The tests run it on CPU against itself.)"""
    from icr.config import from_flat, parse_overrides
    from icr.train.device import configure_backends
    from icr.train.tasks import build_task

    device = device or torch.device("cuda")
    cuda = device.type == "cuda"
    sizes = PAPER_SIZES if args.sizes == "paper" else {}
    flat = {**arch_config(name), **sizes, "data.preset": args.preset,
            "train.batch_size": args.batch_size, "train.device": str(device),
            **parse_overrides(args.set or [])}
    config = from_flat(flat)
    configure_backends(device, config.train.deterministic)
    torch.manual_seed(0)
    task = build_task(config, workspace, device)
    task.encoder.set_backbone_trainable(True)  # the fine-tune phase: everything trains
    if config.image.frozen:
        task.encoder.image_encoder.set_backbone_trainable(False)
    task.net.train()
    fixed = next(task.batches(0))
    counter = iter(range(10**9))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    batches = _batches(task)

    def train(batch: Any) -> None:
        task.train_step(batch, 0, next(counter))

    stats = measure_steps(batches, train, args.steps, warmup=args.warmup,
                          size=lambda b: len(b["image_index"]),
                          sync=torch.cuda.synchronize if cuda else (lambda: None))
    peak = f"{torch.cuda.max_memory_allocated() / 2**20:,.0f}" if cuda else "–"
    busy, kernels = (profile_steps(batches, train, args.profile_steps, args.top)
                     if cuda and args.profile_steps else (float("nan"), []))
    runner = task.step_runner
    graphs = f"{runner.captured} graphs, {runner.eager_calls} eager" if runner.enabled else "off"
    gpu_emb, gpu = _encode(task.net, task.loss_fn, fixed, device)
    cpu_net = copy.deepcopy(task.net).to("cpu")
    cpu_emb, cpu = _encode(cpu_net, task.loss_fn, fixed, torch.device("cpu"))
    gpu["emb_max_abs"] = float((gpu_emb - cpu_emb).abs().max())
    cpu["emb_max_abs"] = 0.0
    images = len(torch.unique(fixed["image_index"]))  # an i2t query is 100 / images %
    rows = agreement(cpu, gpu, tolerance=args.tolerance, recall_step=100.0 / images)
    print(f"| {name} | {stats.samples_per_second:,.0f} | {peak} | "
          f"{100 * stats.wait_share:.1f} | {100 * busy:.0f} | {graphs} | "
          + " ".join(f"{n}={c:.4g}/{g:.4g}{'' if ok else ' DIFFERS'}" for n, c, g, ok in rows)
          + " |", flush=True)
    if kernels:
        print(f"  {name} top kernels over {args.profile_steps} steps: "
              + "; ".join(f"{k[:60]} {ms:.1f} ms" for k, ms in kernels), flush=True)
    return all(ok for *_, ok in rows)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--steps", type=int, default=300, help="timed training steps")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    parser.add_argument("--batch-size", type=int, default=BATCH)
    parser.add_argument("--preset", default="default", choices=("tiny", "small", "default"))
    parser.add_argument("--sizes", default="recipe", choices=("recipe", "paper"),
                        help="the study recipe's model sizes, or the papers' (PAPER_SIZES)")
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest embedding difference and relative loss difference")
    parser.add_argument("--profile-steps", type=int, default=20,
                        help="steps profiled for the GPU's busy share (0: none)")
    parser.add_argument("--top", type=int, default=3, help="kernels listed by time")
    parser.add_argument("--workspace", type=Path, help="default: ICR_WORKSPACE or ./workspace")
    parser.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="config overrides for all")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_trial: no CUDA device on this machine; it measures training on a GPU, so "
              "there is nothing to measure here.")
        return 0
    from icr.workspace import Workspace

    workspace = Workspace.resolve(args.workspace)
    print(f"{torch.cuda.get_device_name()}: {args.steps} steps of {args.batch_size} pairs after "
          f"{args.warmup} warm-up steps, preset {args.preset}, {args.sizes} sizes, torch "
          f"{torch.__version__}")
    print("| arch | samples/s | peak MiB | data wait % | GPU busy % | CUDA graphs | fixed batch, "
          f"CPU/GPU (tolerance {args.tolerance:g}) |")
    print("| :--- | ---: | ---: | ---: | ---: | :--- | :--- |")
    agree = [run_arch(name, args, workspace) for name in args.archs]
    return 0 if all(agree) else 1


if __name__ == "__main__":
    sys.exit(main())
