"""Speed-up of caching a frozen CNN's features: an epoch's image side with and without the cache.

    python benchmarks/frozen_features.py                       # 512 images at 64 and 224 px
    python benchmarks/frozen_features.py --smoke               # 32 images at 32 px, seconds

The image side of one training epoch with a frozen backbone (VSE++ in the metric-learning study:
frozen CNN, trainable fc), batch 128, measured side by side in one process, epochs interleaved:

(a) recompute: every batch runs the frozen EfficientNet-Lite0 (real ImageNet weights, BatchNorm
    in eval mode, no gradients into it) and then the trainable projection 1280 -> 1024
    (forward, backward, Adam step);
(b) cached: every batch gathers its rows of the cached (N, 1280) features and runs the same
    projection step;
(c) build: computing and writing the cache once (:func:`icr.data.features.cached_backbone_features`,
    including the fingerprints), i.e. what (b) pays before its first epoch.

Printed: median seconds per epoch over ``--repeats`` epochs of each (after one warm-up batch of
each), and the ratio (a) / (b).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from torch import nn

from icr.data.features import cached_backbone_features
from icr.models.efficientnet import efficientnet_lite0, normalize


def projection_step(proj: nn.Module, opt: torch.optim.Optimizer, features: torch.Tensor) -> None:
    """One optimiser step of the trainable projection on a batch of pooled features."""
    opt.zero_grad(set_to_none=True)
    proj(features).pow(2).mean().backward()  # stands in for the contrastive loss
    opt.step()


def epoch_recompute(encoder, proj, opt, images: torch.Tensor, batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(images), batch):
        pixels = normalize(images[i : i + batch].float() / 255.0)  # (B, 3, H, W)
        projection_step(proj, opt, encoder(pixels))  # frozen: no graph through the backbone
    return time.perf_counter() - start


def epoch_cached(proj, opt, features: torch.Tensor, order: torch.Tensor, batch: int) -> float:
    start = time.perf_counter()
    for i in range(0, len(order), batch):
        projection_step(proj, opt, features[order[i : i + batch]])  # (B, 1280)
    return time.perf_counter() - start


def measure(num_images: int, size: int, batch: int, repeats: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (num_images, 3, size, size), generator=g, dtype=torch.uint8)
    encoder = efficientnet_lite0()  # real ImageNet weights
    encoder.set_backbone_trainable(False)
    encoder.train()  # as in training: the frozen backbone keeps itself in eval mode
    proj = nn.Linear(encoder.output_dim, 1024)
    opt = torch.optim.Adam(proj.parameters(), lr=2e-4)
    with tempfile.TemporaryDirectory() as cache:
        start = time.perf_counter()
        features = cached_backbone_features(encoder, images, normalize, cache, batch_size=batch)
        build = time.perf_counter() - start
    recompute, cached = [], []
    order = torch.randperm(num_images, generator=g)[:batch]  # warm-up batch: first-call costs
    epoch_recompute(encoder, proj, opt, images[order], batch)
    epoch_cached(proj, opt, features, order, batch)
    for _ in range(repeats):  # interleaved, so that load from other processes hits both alike
        order = torch.randperm(num_images, generator=g)
        recompute.append(epoch_recompute(encoder, proj, opt, images[order], batch))
        cached.append(epoch_cached(proj, opt, features, order, batch))
    a, b = statistics.median(recompute), statistics.median(cached)
    return {"size": size, "recompute": a, "cached": b, "ratio": a / b, "build": build}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 224])
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="32 images at 32 px, 1 repeat")
    args = parser.parse_args(argv)
    if args.smoke:
        args.images, args.sizes, args.batch, args.repeats = 32, [32], 16, 1
    torch.set_num_threads(args.threads)
    print(
        f"{args.images} images, batch {args.batch}, {args.threads} threads, "
        f"median of {args.repeats} epochs (EfficientNet-Lite0 frozen + Linear 1280->1024)"
    )
    print(f"{'px':>5} {'recompute s':>12} {'cached s':>10} {'speed-up':>9} {'cache build s':>14}")
    rows = []
    for size in args.sizes:
        row = measure(args.images, size, args.batch, args.repeats)
        rows.append(row)
        print(
            f"{size:>5} {row['recompute']:>12.3f} {row['cached']:>10.4f} "
            f"{row['ratio']:>8.0f}x {row['build']:>14.3f}"
        )
    return rows


if __name__ == "__main__":
    main()
