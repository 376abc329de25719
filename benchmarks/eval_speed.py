"""Speed of the full retrieval metric set against a floor and a plain per-query loop, in one run.

    python benchmarks/eval_speed.py                      # COCO 5k test size: 5,000 x 25,000, d 1024
    python benchmarks/eval_speed.py --images 1000 --captions 5000 --dim 256

(a) floor: one similarity product plus a top-10 over it (what any evaluation must pay);
(b) full: the similarity product plus ``retrieval_metrics`` with every metric (Recall@k, medr,
    meanr, R-precision, mAP@5, nDCG@25 from a relevance matrix, CxC Recall@k, R-precision and
    mAP@R);
    (b0) is the same without the relevance matrix and CxC (Recall@k, ranks, R-precision, mAP@5);
(c) loop: the same protocol one query at a time in numpy, VSE++ style (similarities of one query,
    argsort, look up the positives); timed on a subset of queries and extrapolated linearly.
    (c') is the same loop reading rows / columns of a precomputed similarity matrix, i.e. the metric
    code alone.

Targets: full <= 2 x floor; loop >= 20 x full.
"""

from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np
import torch

from icr.metrics import retrieval_metrics


def make_split(n_img: int, n_cap: int, dim: int, seed: int) -> dict:
    """Random L2-normalised embeddings with some signal, a shuffled caption map, relevance, CxC."""
    g = torch.Generator().manual_seed(seed)
    per_image = math.ceil(n_cap / n_img)
    caption_image = torch.arange(n_img).repeat_interleave(per_image)[:n_cap]
    caption_image = caption_image[torch.randperm(n_cap, generator=g)]  # (N_cap,)
    images = torch.nn.functional.normalize(torch.randn(n_img, dim, generator=g), dim=1)
    noise = torch.randn(n_cap, dim, generator=g) * 0.28  # positive cosine ~4 sd above chance
    captions = torch.nn.functional.normalize(images[caption_image] + noise, dim=1)  # (N_cap, D)
    relevance = torch.rand(n_cap, n_img, generator=g)  # (N_cap, N_img), then ~5% non-zero
    relevance.sub_(0.95).clamp_(min=0).mul_(20)
    relevance[torch.arange(n_cap), caption_image] = 1.0
    ext_i2t = [torch.randint(n_cap, (i % 4,), generator=g).tolist() for i in range(n_img)]
    ext_t2i = [torch.randint(n_img, (j % 3,), generator=g).tolist() for j in range(n_cap)]
    return dict(
        images=images, captions=captions, caption_image=caption_image,
        relevance=relevance.numpy(), ext_i2t=ext_i2t, ext_t2i=ext_t2i,
    )  # fmt: skip


def floor(s: dict) -> None:
    sims = s["images"] @ s["captions"].T  # (N_img, N_cap)
    sims.topk(10, dim=1)


def full(s: dict) -> dict[str, float]:
    sims = s["images"] @ s["captions"].T  # (N_img, N_cap)
    return retrieval_metrics(
        sims, s["caption_image"], relevance=s["relevance"],
        extended_i2t=s["ext_i2t"], extended_t2i=s["ext_t2i"],
    )  # fmt: skip


def core(s: dict) -> dict[str, float]:
    """Without relevance and CxC: Recall@k, ranks, R-precision and mAP@5 only."""
    return retrieval_metrics(s["images"] @ s["captions"].T, s["caption_image"])


def _loop_query(scores: np.ndarray, positives: set[int], extended: set[int]) -> dict[str, float]:
    """Per-query metrics from a full argsort: ranks, R-precision, AP@5, CxC with mAP@R (the naive
    protocol)."""
    order = np.argsort(-scores, kind="stable")
    ranks = np.sort(np.nonzero(np.isin(order, list(positives)))[0] + 1)
    cxc = np.nonzero(np.isin(order, list(positives | extended)))[0] + 1  # sorted ranks
    top5 = ranks[ranks <= 5]
    in_r = cxc[cxc <= len(cxc)]
    return dict(
        best=ranks[0], rprec=np.mean(ranks <= len(ranks)),
        ap5=np.sum(np.arange(1, len(top5) + 1) / top5) / min(5, len(ranks)),
        cxc_best=cxc.min(), cxc_rprec=np.mean(cxc <= len(cxc)),
        cxc_map_at_r=np.sum(np.arange(1, len(in_r) + 1) / in_r) / len(cxc), order=order,
    )  # fmt: skip


def loop(s: dict, n_i2t: int, n_t2i: int, sims: np.ndarray | None) -> float:
    """Seconds for the per-query loop over the first queries, extrapolated to all queries."""
    images, captions = s["images"].numpy(), s["captions"].numpy()
    cap_img, rel = s["caption_image"].numpy(), s["relevance"]
    discount = 1.0 / np.log2(np.arange(2, 27))
    start = time.perf_counter()
    for i in range(n_i2t):
        scores = sims[i] if sims is not None else captions @ images[i]
        _loop_query(scores, set(np.nonzero(cap_img == i)[0]), set(s["ext_i2t"][i]))
    mid = time.perf_counter()
    for j in range(n_t2i):
        scores = sims[:, j] if sims is not None else images @ captions[j]
        q = _loop_query(scores, {int(cap_img[j])}, set(s["ext_t2i"][j]))
        dcg = (2.0 ** rel[j, q["order"][:25]] - 1) @ discount
        ideal = (2.0 ** np.sort(rel[j])[::-1][:25] - 1) @ discount
        _ = dcg / ideal if ideal > 0 else 0.0
    end = time.perf_counter()
    return (mid - start) * len(images) / n_i2t + (end - mid) * len(captions) / n_t2i


def best_of(fn, repeats: int) -> tuple[float, float]:
    """Smallest wall-clock and CPU (all threads of this process) seconds over ``repeats`` runs."""
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return min(walls), min(cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=5000)
    parser.add_argument("--captions", type=int, default=25000)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--loop-queries", type=int, default=100, help="image queries timed in (c)")
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs of (a), (b)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    s = make_split(args.images, args.captions, args.dim, args.seed)
    n_i2t = min(args.loop_queries, args.images)
    n_t2i = min(5 * args.loop_queries, args.captions)
    print(
        f"eval_speed: {args.images} images x {args.captions} captions, d={args.dim}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu"
    )
    full(make_split(50, 250, 8, 1))  # warm-up
    runs = [best_of(lambda f=f: f(s), args.repeats) for f in (floor, core, full)]
    (t_floor, c_floor), (t_core, c_core), (t_full, c_full) = runs
    metrics = full(s)
    t_loop = loop(s, n_i2t, n_t2i, sims=None)
    sims = (s["images"] @ s["captions"].T).numpy()
    t_loop_sims = loop(s, n_i2t, n_t2i, sims=sims)
    del sims

    print(
        f"(a) floor: sims product + top-10            {t_floor:7.2f} s wall  {c_floor:7.2f} s cpu"
    )
    print(f"(b0) core: (b) without relevance and CxC {t_core:7.2f} s wall  {c_core:7.2f} s cpu")
    print(
        f"(b) full:  sims product + retrieval_metrics {t_full:7.2f} s wall  {c_full:7.2f} s cpu  ({len(metrics)} keys)"
    )
    print(
        f"(c) loop:  per-query similarity + argsort   {t_loop:7.2f} s wall  (extrapolated linearly "
        f"from {n_i2t} image + {n_t2i} caption queries)"
    )
    print(
        f"(c') loop over precomputed sims rows/cols   {t_loop_sims:7.2f} s wall  (same extrapolation)"
    )
    print(f"full / floor = {t_full / t_floor:.2f} wall, {c_full / c_floor:.2f} cpu   (target <= 2)")
    print(f"core / floor = {t_core / t_floor:.2f} wall, {c_core / c_floor:.2f} cpu")
    print(
        f"loop / full  = {t_loop / t_full:.1f}   (target >= 20);  loop' / full = {t_loop_sims / t_full:.1f}"
    )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(
        f"load average at the end: {load} on {os.cpu_count()} cores (others' jobs inflate wall times)"
    )
    shown = ("rsum", "i2t_R_at_1", "t2i_R_at_1", "i2t_rprec", "i2t_mAP_at_5", "t2i_nDCG_at_25")
    print("metrics: " + ", ".join(f"{k}={metrics[k]:.2f}" for k in shown))


if __name__ == "__main__":
    main()
