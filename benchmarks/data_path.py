"""What assembling a training batch costs against a training step, per architecture.

    python benchmarks/data_path.py                     # every architecture, small preset, CPU
    python benchmarks/data_path.py --archs vsrn --steps 100 --device cuda

For each architecture of ``benchmarks/gpu_trial.py`` (its study's recipe, batches of 128 pairs)
the trial's task is built on ``--device`` and, over ``--steps`` batches of one epoch, measured
side by side in one process:

- ``assembly``: the median time to get the next batch from :mod:`icr.data.batches` (slices of the
  epoch's plan, one gather of the image inputs, normalisation and erasing of pixels), on the
  device the step runs on;
- ``step``: the median time of one training step on that batch (forward, backward, optimiser;
  on CUDA synchronised, so its kernels are inside);
- ``ratio``: assembly / step;
- ``per-pair``: the median time of the path the project had before (a ``Dataset`` item per pair,
  its caption augmented in Python, a collate of the 128 dicts; written out below as the
  reference), and how many times the assembly that is;
- ``epoch plan``: what the first batch of an epoch pays once (the sampler's order, every
  caption's augmentation, the erasing boxes, their copy to the device).

The issue's target: at most 0.5 ms a batch on CPU, what 5 % of a GPU step allows.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_trial import ARCHS, BATCH, arch_config  # noqa: E402


def per_pair_batch(task, indices: Sequence[int], epoch: int) -> dict[str, torch.Tensor]:
    """The batch as the per-pair path made it: one item per caption (Python augmentation with a
    generator per item, the image's row normalised), then a collate that pads the ids."""
    from icr.data.images import encoder_input
    from icr.seeding import derive_seed

    data = task.data
    split, images = data.splits["train"], data.images["train"]
    items = []
    for index in indices:
        rng = random.Random(derive_seed(task.config.train.seed, epoch, index))
        image_index = int(split.caption_image[index])
        items.append({
            "image": encoder_input(images.take([image_index]), data.pixels)[0],
            "tokens": data.captions.augmented(split.captions[index], rng),
            "image_index": torch.tensor(image_index),
        })
    tokens = [it["tokens"] for it in items]
    lengths = torch.tensor([len(t) for t in tokens])
    padded = torch.zeros(len(tokens), int(lengths.max()), dtype=torch.long)
    for i, t in enumerate(tokens):
        padded[i, : len(t)] = t
    return {"images": torch.stack([it["image"] for it in items]), "tokens": padded,
            "lengths": lengths, "image_index": torch.stack([it["image_index"] for it in items])}


def _median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


def measure(name: str, args: argparse.Namespace, workspace, device: torch.device) -> dict:
    """The four figures of one architecture (module docstring), in milliseconds."""
    from icr.config import from_flat, parse_overrides
    from icr.train.tasks import build_task

    flat = {**arch_config(name), "data.preset": args.preset, "train.batch_size": BATCH,
            "train.device": str(device), **parse_overrides(args.set or [])}
    torch.manual_seed(0)
    task = build_task(from_flat(flat), workspace, device)
    task.net.train()
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    steps = min(args.steps, len(task.train_batches) - 1)
    batches = task.batches(0)
    start = time.perf_counter()
    batch = next(batches)  # pays the epoch's plan
    sync()
    plan = time.perf_counter() - start
    assembly, step_times = [], []
    for step in range(steps):
        start = time.perf_counter()
        task.train_step(batch, 0, step)
        sync()
        step_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        batch = next(batches)
        sync()
        assembly.append(time.perf_counter() - start)
    order, bounds = task.train_batches.sampler.plan()
    per_pair = []
    for b in range(min(steps, 20)):
        start = time.perf_counter()
        per_pair_batch(task, order[bounds[b]:bounds[b + 1]].tolist(), 0)
        per_pair.append(time.perf_counter() - start)
    return {"assembly": _median_ms(assembly), "step": _median_ms(step_times),
            "per_pair": _median_ms(per_pair), "plan": 1000 * plan,
            "epoch_steps": len(task.train_batches)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", nargs="+", default=list(ARCHS), choices=ARCHS)
    parser.add_argument("--steps", type=int, default=30, help="batches measured per architecture")
    parser.add_argument("--preset", default="small", choices=("tiny", "small", "default"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--workspace", type=Path, help="default: ICR_WORKSPACE or ./workspace")
    parser.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="config overrides for all")
    args = parser.parse_args(argv)
    from icr.workspace import Workspace

    device = torch.device(args.device)
    workspace = Workspace.resolve(args.workspace)
    print(f"{device}, preset {args.preset}, batches of {BATCH} pairs, medians over "
          f"{args.steps} batches (per-pair path: over {min(args.steps, 20)})")
    for name in args.archs:
        m = measure(name, args, workspace, device)
        print(f"{name} assembly {m['assembly']:.3f} ms step {m['step']:.1f} ms ratio "
              f"{m['assembly'] / m['step']:.4f} (per-pair path {m['per_pair']:.2f} ms: "
              f"{m['per_pair'] / m['assembly']:.1f}x; epoch plan {m['plan']:.1f} ms for "
              f"{m['epoch_steps']} steps)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
