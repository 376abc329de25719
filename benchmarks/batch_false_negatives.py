"""How often an in-batch "negative" image is one the caption is true of, on the embedded benchmark.

    python benchmarks/batch_false_negatives.py [--workspace DIR] [--batch 128] [--batches 30]

Every loss of the metric-learning study treats the batch's other images as negatives of a caption.
On the embedded benchmark the generator knows each image's scene and each caption's meaning, so
whether a caption is true of another image is decided exactly (:func:`holds`). For random batches
of ``--batch`` training pairs this prints the fraction of caption queries that are true of at least
one other image of their batch, and the mean number of such images: the false negatives that the
hardest-negative triplet loss (SH) picks first, and that no margin can separate from the positive.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from icr.data.synthetic import ensure_benchmark, holds  # noqa: E402
from icr.grounding.quality import load_shapes_truth  # noqa: E402
from icr.workspace import Workspace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", help="workspace folder (default ./workspace or ICR_WORKSPACE)")
    parser.add_argument("--batch", type=int, default=128, help="pairs per batch (128)")
    parser.add_argument("--batches", type=int, default=30, help="random batches to draw (30)")
    parser.add_argument("--preset", default="default", help="benchmark preset (default)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the batches")
    args = parser.parse_args(argv)

    workspace = Workspace.resolve(args.workspace)
    root = ensure_benchmark(workspace.data / f"shapes-{args.preset}-0", args.preset, 0)
    truth = load_shapes_truth(root, "train")
    rng = np.random.default_rng(args.seed)
    true_of_other = []
    for _ in range(args.batches):
        batch = rng.choice(len(truth), size=args.batch, replace=False)
        scenes = [truth[i].scene for i in batch]
        for i in batch:
            true_of_other.append(sum(scene is not truth[i].scene and holds(truth[i].meaning, scene)
                                     for scene in scenes))
    counts = np.array(true_of_other)
    print(f"{root.name}: {len(truth)} training captions; {args.batches} random batches of "
          f"{args.batch} pairs")
    print(f"caption queries true of at least one other image of their batch: {np.mean(counts > 0):.3f}")
    print(f"other images of the batch the caption is true of, per query: mean {counts.mean():.2f}, "
          f"median {np.median(counts):.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
