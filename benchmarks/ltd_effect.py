"""Does latent target decoding reduce predictive feature suppression on the embedded benchmark?

    python benchmarks/ltd_effect.py                                 # the default run (see below)
    python benchmarks/ltd_effect.py --smoke                         # tiny preset, about a minute
    python benchmarks/ltd_effect.py --preset default --epochs 3+3 --seeds 0 1 2 \\
        --conditions contrastive dual ltd:0.1 ltd:0.2 ltd:0.3 itd --out ltd_effect.md

Conditions (rows; every one on the same base configuration, ``--seeds`` seeds each):

- ``contrastive``: InfoNCE only (Eq. 1 of the LTD paper);
- ``dual``: LTD as a dual loss, ``L_con + 1 * L_rec`` (Eq. 7);
- ``ltd:ETA``: LTD as the constraint ``L_rec <= ETA`` with a Lagrange multiplier (Eq. 8-9);
- ``itd``: input target decoding (GRU token decoder, Eq. 4) as a dual loss with beta 1, the better
  of the two ITD variants in the paper's Table 1 (``itd:ETA`` for the constraint, ETA in nats);

and, without training, three references for the probes: ``input`` (pooled region features or
downsampled pixels on the image side, a bag of words on the caption side: what is linearly there
before any encoder), ``init`` (the contrastive model at initialisation, seed 0) and ``random``
(Gaussian embeddings: chance, ~0.5).

Per run: test rsum and R-precision (i2t) of the best-validation checkpoint, the last epoch's
training ``L_rec`` and lambda, and linear probes (``icr.analysis.probe``) of the frozen test
embeddings, fitted on the training split: image side "does the scene contain the value", caption
side "does the caption state it", ROC-AUC averaged per attribute family. The tables give mean +- std
over seeds. Suppression shows as a trained encoder probing *below* its own initialisation or the
input reference on a family; LTD reducing it would show as higher caption-side (and, through the
contrastive coupling, image-side) probes than the baseline.

The default is sized for 2 CPU cores: the ``default`` preset (4,000 / 500 / 500 images), region
features, 128-d embeddings, 1 + 3 epochs at lr 1e-3 in both phases (the paper's 2e-4 and x0.1
fine-tune are for 60 epochs from a pretrained backbone), 3 seeds, 6 conditions; ``--preset small``
runs in a fraction of the time but gives too few steps to train.
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from icr.analysis.probe import FAMILIES, ProbeResult, probe, split_targets
from icr.config import ExperimentConfig, from_flat
from icr.data.pipeline import encode_split_captions, prepare_data
from icr.data.synthetic import load_scenes
from icr.seeding import seed_everything
from icr.train import Trainer, find_checkpoint, fit, resolve_device, restore
from icr.workspace import Workspace
from studies.ltd_bound import BASE as LTD_BOUND_RECIPE

log = logging.getLogger("ltd_effect")

# Shared by every condition: the training recipe of the ltd_bound study (a CPU-sized retrieval
# model on precomputed region features, lr 1e-3 in both phases), evaluated on test; preset,
# epochs and seed come from the command line.
BASE = {**LTD_BOUND_RECIPE, "eval.test": True, "train.batch_size": 128, "train.device": "cpu"}
DEFAULT_CONDITIONS = ("contrastive", "dual", "ltd:0.1", "ltd:0.2", "ltd:0.3", "itd")
REFERENCES = ("input", "init", "random")


def condition_overrides(name: str) -> dict[str, object]:
    """Config keys of a condition name: contrastive, dual, itd, ltd:ETA or itd:ETA."""
    kind, _, eta = name.partition(":")
    if kind == "contrastive" and not eta:
        return {"decoder.name": "none", "objective.name": "contrastive"}
    if kind == "dual" and not eta:
        return {"decoder.name": "ltd", "objective.name": "dual", "objective.beta": 1.0}
    if kind in ("ltd", "itd") and eta:
        return {"decoder.name": kind, "objective.name": "lagrangian", "objective.eta": float(eta)}
    if kind == "itd":
        return {"decoder.name": "itd", "objective.name": "dual", "objective.beta": 1.0}
    raise ValueError(f"unknown condition {name!r}; use contrastive, dual, itd, ltd:ETA or itd:ETA")


@dataclass
class Row:
    """One trained run (or one reference) of the table."""

    condition: str
    seed: int
    metrics: dict[str, float] = field(default_factory=dict)
    image_probe: dict[str, float] = field(default_factory=dict)
    caption_probe: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Targets:
    image: dict[str, np.ndarray]  # split -> (N_img, K)
    caption: dict[str, np.ndarray]  # split -> (N_cap, K)


def targets_of(trainer: Trainer) -> Targets:
    scenes = load_scenes(trainer.data.root)
    pairs = {s: split_targets(scenes, trainer.data.splits[s]) for s in ("train", "test")}
    return Targets({s: p[0] for s, p in pairs.items()}, {s: p[1] for s, p in pairs.items()})


def probe_pair(
    train: tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray],
    test: tuple[torch.Tensor | np.ndarray, torch.Tensor | np.ndarray],
    targets: Targets, min_positives: int,
) -> tuple[ProbeResult, ProbeResult]:
    """Image-side and caption-side probes of (image, caption) features of train and test."""
    image = probe(train[0], targets.image["train"], test[0], targets.image["test"],
                  min_positives=min_positives)
    caption = probe(train[1], targets.caption["train"], test[1], targets.caption["test"],
                    min_positives=min_positives)
    return image, caption


def embed(trainer: Trainer) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    return trainer.embed_split("train"), trainer.embed_split("test")


def run_one(config: ExperimentConfig, condition: str, ws: Workspace, run_dir: Path,
            min_positives: int) -> Row:
    """Train one condition and seed, evaluate it on test, probe its frozen embeddings.

    A run whose ``run_dir`` already holds a checkpoint resumes from it (a finished one trains no
    further), so an interrupted benchmark, or several invocations with disjoint ``--seeds``
    sharing a workspace, lose no work and give the same rows as one uninterrupted run.
    """
    start = time.perf_counter()
    resume = find_checkpoint(run_dir / "checkpoint")
    result = fit(config, resume_from=resume, workspace=ws, run_dir=run_dir)
    trainer = restore(config, result.checkpoint_dir, workspace=ws)
    image, caption = probe_pair(*embed(trainer), targets_of(trainer), min_positives)
    last = result.history[-1]
    metrics = {"rsum": result.test["rsum"], "i2t_rprec": result.test["i2t_rprec"],
               "val_rsum": result.best_val["rsum"], "best_epoch": result.best_epoch,
               "L_con": last.get("train_L_con", math.nan), "L_rec": last.get("train_L_rec", math.nan),
               "lambda": last.get("lambda", math.nan),
               # Training time summed over epochs (correct across resumes), then the whole call.
               "train_seconds": sum(h["epoch_time_s"] for h in result.history),
               "call_seconds": time.perf_counter() - start}
    return Row(condition, config.train.seed, metrics, image.per_family, caption.per_family)


def reference_rows(config: ExperimentConfig, ws: Workspace, min_positives: int) -> list[Row]:
    """Probes without training: the inputs, the initial encoders, random embeddings."""
    device = resolve_device(config.train.device)
    seed_everything(config.train.seed)  # the same "init" weights at every invocation
    trainer = Trainer(config, prepare_data(config, ws, device), device)  # untrained
    targets = targets_of(trainer)
    rows = []
    inputs = ((input_image_features(trainer, "train"), bag_of_words(trainer, "train")),
              (input_image_features(trainer, "test"), bag_of_words(trainer, "test")))
    for name, (train, test) in (("input", inputs), ("init", embed(trainer))):
        image, caption = probe_pair(train, test, targets, min_positives)
        rows.append(Row(name, config.train.seed, {}, image.per_family, caption.per_family))
    g = np.random.default_rng(config.train.seed)
    dim = config.model.embed_dim
    train, test = ((g.normal(size=(len(targets.image[s]), dim)), g.normal(size=(len(targets.caption[s]), dim)))
                   for s in ("train", "test"))
    image, caption = probe_pair(train, test, targets, min_positives)
    rows.append(Row("random", config.train.seed, {}, image.per_family, caption.per_family))
    return rows


def input_image_features(trainer: Trainer, split: str) -> np.ndarray:
    """Mean- and max-pooled regions ``(N, 2 D)``, or 8 x 8 average-pooled pixels ``(N, 192)``."""
    x = trainer.data.images[split]
    if x.dtype == torch.uint8:  # (N, 3, H, W) pixels
        pooled = torch.nn.functional.adaptive_avg_pool2d(x.float() / 255.0, 8)  # (N, 3, 8, 8)
        return pooled.flatten(1).numpy()
    return torch.cat([x.mean(1), x.amax(1)], dim=1).numpy()  # (N, R, D) -> (N, 2 D)


def bag_of_words(trainer: Trainer, split: str) -> np.ndarray:
    """Binary bag of words ``(N_cap, V)`` of a split's captions over the training vocabulary."""
    ids = encode_split_captions(trainer.data.splits[split], trainer.data.vocab, 10_000)
    out = np.zeros((len(ids), len(trainer.data.vocab)), dtype=np.float32)
    for i, tokens in enumerate(ids):
        out[i, tokens.numpy()] = 1.0
    return out


# ------------------------------------------------------------------------------------ report


def _mean_std(values: list[float], digits: int) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{np.mean(values):.{digits}f} +- {np.std(values, ddof=1):.{digits}f}"


def _by_condition(rows: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for row in rows:
        out.setdefault(row.condition, []).append(row)
    return out


def markdown(rows: list[Row], refs: list[Row]) -> str:
    groups = _by_condition(rows)
    lines = ["### Retrieval (test, best-validation checkpoint; mean +- std over seeds)", "",
             "| condition | seeds | rsum | R-precision i2t (%) | L_rec (last epoch) | lambda (last) |",
             "|---|---|---|---|---|---|"]
    for name, group in groups.items():
        m = [r.metrics for r in group]
        lines.append(f"| {name} | {len(group)} | {_mean_std([x['rsum'] for x in m], 1)} | "
                     f"{_mean_std([x['i2t_rprec'] for x in m], 2)} | "
                     f"{_mean_std([x['L_rec'] for x in m], 3)} | {_mean_std([x['lambda'] for x in m], 2)} |")
    for side, attr in (("Image side: does the scene contain the value", "image_probe"),
                       ("Caption side: does the caption state the value", "caption_probe")):
        lines += ["", f"### Probe ROC-AUC, {side} (test; mean over the family's values)", "",
                  "| condition | " + " | ".join(FAMILIES) + " |", "|---|" + "---|" * len(FAMILIES)]
        for name, group in list(groups.items()) + [(r.condition + " (ref)", [r]) for r in refs]:
            cells = [_mean_std([getattr(r, attr).get(f, math.nan) for r in group], 3) for f in FAMILIES]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_csv(path: Path, rows: list[Row]) -> None:
    metric_keys = sorted({k for r in rows for k in r.metrics})
    header = ["condition", "seed", *metric_keys, *(f"img_{f}" for f in FAMILIES),
              *(f"cap_{f}" for f in FAMILIES)]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for r in rows:
            writer.writerow([r.condition, r.seed, *(r.metrics.get(k, "") for k in metric_keys),
                             *(r.image_probe.get(x, "") for x in FAMILIES),
                             *(r.caption_probe.get(x, "") for x in FAMILIES)])


# ------------------------------------------------------------------------------------ main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="default", choices=("tiny", "small", "default"))
    p.add_argument("--features", default="regions", choices=("regions", "pixels"),
                   help="regions: region MLP encoder; pixels: the small CNN")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", default="1+3", help="WARMUP+FINETUNE epochs, e.g. 3+3")
    p.add_argument("--conditions", nargs="+", default=list(DEFAULT_CONDITIONS))
    p.add_argument("--workspace", default=None, help="default: ICR_WORKSPACE or ./workspace")
    p.add_argument("--out", type=Path, default=None, help="write the Markdown here and a CSV beside it")
    p.add_argument("--min-positives", type=int, default=20, help="skip probe values with fewer")
    p.add_argument("--smoke", action="store_true", help="tiny preset, 1+0 epochs, 1 seed, 2 conditions")
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.epochs, args.seeds = "tiny", "1+0", [0]
        args.conditions, args.min_positives = ["contrastive", "ltd:0.2"], 2
    for name in args.conditions:
        condition_overrides(name)  # fail before any training
    warmup, _, finetune = args.epochs.partition("+")
    args.warmup, args.finetune = int(warmup), int(finetune or 0)
    return args


def config_for(args: argparse.Namespace, condition: str, seed: int) -> ExperimentConfig:
    flat = {**BASE, "data.preset": args.preset, "train.seed": seed,
            "train.warmup_epochs": args.warmup, "train.finetune_epochs": args.finetune,
            **condition_overrides(condition)}
    if args.features == "pixels":
        flat.update({"data.features": "pixels", "image.encoder": "small_cnn"})
    if args.preset == "tiny":
        flat["train.batch_size"] = 32
    return from_flat(flat)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    ws = Workspace.resolve(args.workspace)
    start = time.perf_counter()
    refs = reference_rows(config_for(args, "contrastive", args.seeds[0]), ws, args.min_positives)
    rows: list[Row] = []
    runs = [(c, s) for s in args.seeds for c in args.conditions]  # every condition per seed first
    for done, (condition, seed) in enumerate(runs, start=1):
        config = config_for(args, condition, seed)
        run_dir = ws.runs / "ltd_effect" / f"{args.preset}-{condition.replace(':', '')}-s{seed}"
        row = run_one(config, condition, ws, run_dir, args.min_positives)
        log.info("%s seed %d: %s | image %s | caption %s", condition, seed,
                 {k: round(v, 3) for k, v in row.metrics.items()},
                 {k: round(v, 3) for k, v in row.image_probe.items()},
                 {k: round(v, 3) for k, v in row.caption_probe.items()})
        rows.append(row)
        # Written after every run, so an interrupted benchmark still leaves its finished rows.
        report = _report(args, rows, refs, time.perf_counter() - start, done, len(runs))
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(report, encoding="utf-8")
            write_csv(args.out.with_suffix(".csv"), rows + refs)
    print(report)


def _report(args: argparse.Namespace, rows: list[Row], refs: list[Row], wall: float, done: int,
            total: int) -> str:
    train = sum(r.metrics.get("train_seconds", 0.0) for r in rows)
    header = (f"ltd_effect: preset {args.preset}, features {args.features}, epochs {args.epochs}, "
              f"seeds {args.seeds}, {os.cpu_count()} CPUs, {done} of {total} runs, "
              f"training {train / 60:.1f} min summed over runs (resumed ones included), "
              f"this invocation {wall / 60:.1f} min\n\n")
    return header + markdown(rows, refs)

if __name__ == "__main__":
    main()
