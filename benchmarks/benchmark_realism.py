"""The embedded benchmark beside COCO, where the papers' mechanisms depend on the data.

    python benchmarks/benchmark_realism.py [--presets tiny,small,default] [--workspace DIR]

Prints one table: COCO's numbers in the first column, each embedded-benchmark preset in the next.
COCO's extended positives come from the files of the PyPI package ``eccv-caption`` (installed with
the ``dev`` extra): CxC (Parekh et al., EACL 2021) and ECCV Caption (Chun et al., ECCV 2022) for the
COCO 5k test split, as JSON of COCO ids. What those files do not hold is a literature value, with
its source in the row's note. The embedded benchmark's numbers are decided exactly from its scenes
(:mod:`icr.data.synthetic.semantics`): whether a caption is true of an image is known, not estimated.

Rows:

- false negatives per caption per 1,000 other images (test split): images other than its own a
  caption is true of, per 1,000 of them;
- false negatives at batch 128 (training split): the mean number of the batch's 127 other images a
  caption is true of, and the share of captions with at least one, both exact expectations over
  random batches (hypergeometric), not samples;
- extra positive captions per image (test split): captions of other images that are true of it;
- regions per image, words per caption, vocabulary size, objects per image;
- how much of an image one caption states (LTD's premise, Bleeker et al., Sec. 1: a caption states
  part of the image): the share of the image's objects it mentions, of the (object, attribute) facts
  it states, and the share of objects that none of the image's 5 captions mentions.

A second table, per preset, says what the region features carry: a linear probe (softmax
regression on the standardised feature) of each object's class and attributes, trained on the
training split's boxes and scored on the test split's, beside the majority class and beside what is
known of BUTD, whose features a model reads COCO through (Anderson et al., CVPR 2018). A region is
an object's when it is a detection of it (IoU >= 0.5, ``region_owner`` in ``scenes.json``); the
probe reads the object's best-scored region, and every region it owns.

``--learnability`` adds the third: how much a standard baseline learns (a study's condition,
default ``ltd_bound``'s ``contrastive``, trained by ``icr.train.fit`` for ``--epochs``) at the
recipe's sizes and at the papers' (``--sizes recipe,paper``), with its validation curve, its test
rsum and i2t R@1 at the best validation epoch, and its in-batch top-1 rate over the first epochs:
the share of queries whose positive is ranked first among a batch of 128, the regime in which the
papers found their losses and poolings to differ; beside VSE-infinity's numbers on COCO and
Flickr30K.

    python benchmarks/benchmark_realism.py --presets default --learnability --epochs 30
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from scipy.special import comb
from scipy.stats import hypergeom

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from icr.data.synthetic import TruthTable, ensure_benchmark, load_scenes  # noqa: E402
from icr.data.synthetic.lexicon import SHAPES  # noqa: E402
from icr.data.synthetic.regions import STUFF_COVERAGE, object_coverage  # noqa: E402
from icr.data.synthetic.world import (  # noqa: E402
    ATTRIBUTES,
    COLOURS,
    HPOS,
    HUES,
    SIZES,
    TEXTURES,
    TONES,
    VPOS,
    Scene,
)
from icr.train.seam import EpochReport  # noqa: E402
from icr.workspace import Workspace  # noqa: E402

BATCH = 128
_WORD = re.compile(r"[A-Za-z]")
# Literature values for what eccv-caption's files do not hold, with their sources.
COCO_LITERATURE = {
    "regions": (36.0, "BUTD features (Anderson et al., CVPR 2018), as SCAN/VSRN/VSE-inf use them"),
    "words": (10.5, "COCO captions' mean length (docs/reference-code.md section 8)"),
    "vocabulary": (9487.0, "Karpathy train split, words seen >= 5 times (neuraltalk2 preprocessing)"),
    "objects": (7.7, "instances per image; 3.5 categories (Lin et al., ECCV 2014, Sec. 5)"),
}


# ---------------------------------------------------------------------------------- batch maths


def batch_false_negatives(true_of_others: np.ndarray, num_others: int, batch: int = BATCH
                          ) -> tuple[float, float]:
    """Exact expectations over random batches: mean false negatives and share with at least one.

    A caption's batch holds ``batch - 1`` other images drawn without replacement from
    ``num_others``; ``true_of_others[i]`` of them are positives of caption ``i``.

    Returns:
        (mean false negatives per caption, share of captions with at least one).
    """
    draws = min(batch - 1, num_others)
    c = np.asarray(true_of_others, dtype=np.int64)
    mean = float((c * draws / num_others).mean())
    at_least_one = float((1.0 - hypergeom.pmf(0, num_others, c, draws)).mean())
    return mean, at_least_one


# ---------------------------------------------------------------------------------------- COCO


def coco_statistics() -> dict[str, dict[str, float]]:
    """CxC and ECCV Caption statistics of the COCO 5k test split, from ``eccv-caption``'s files."""
    try:
        with warnings.catch_warnings():  # it warns that it reads JSON without ujson: we read files
            warnings.filterwarnings("ignore", message="failed to import `ujson`")
            import eccv_caption
    except ImportError:
        raise SystemExit("error: eccv-caption is not installed; run `make install` (dev extra)") from None
    data = Path(eccv_caption.__file__).parent / "data"

    def read(name: str) -> dict[str, list[int]]:
        return json.loads((data / f"{name}.json").read_text())

    original_i2c = {int(k): set(v) for k, v in read("original_image_to_caption").items()}
    num_images = len(original_i2c)
    num_captions = sum(len(v) for v in original_i2c.values())
    out = {}
    for name in ("cxc", "eccv"):
        c2i, i2c = read(f"{name}_caption_to_image"), read(f"{name}_image_to_caption")
        extra_images = np.array([len(v) - 1 for v in c2i.values()])  # its own image is listed
        extra_captions = np.array([len(set(v) - original_i2c[int(k)]) for k, v in i2c.items()])
        fn_batch, share = batch_false_negatives(extra_images, num_images - 1)
        out[name] = {
            "queries": float(len(c2i)),
            "fn_per_1000": float(extra_images.mean() / (num_images - 1) * 1000),
            "fn_batch": fn_batch,
            "fn_batch_share": share,
            "extra_captions": float(extra_captions.mean()),
            "extra_captions_per_1000": float(extra_captions.mean() / (num_captions - 5) * 1000),
        }
    return out


# -------------------------------------------------------------------------- embedded benchmark


def _true_of_others(records: Sequence[dict], reading: Callable[[list], list] | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Per caption, the number of other images it is true of; per image, of other captions
    (each caption's meaning as ``reading`` rewrites it, if given)."""
    table = TruthTable([Scene.from_json(r["scene"]) for r in records])
    per_caption, per_image = [], np.zeros(len(records), dtype=np.int64)
    for i, record in enumerate(records):
        for caption in record["captions"]:
            meaning = caption["meaning"] if reading is None else reading(caption["meaning"])
            truth = table.holds(meaning)  # (N,)
            truth[i] = False
            per_caption.append(int(truth.sum()))
            per_image += truth
    return np.asarray(per_caption), per_image


def _partiality(records: Sequence[dict]) -> tuple[float, float, float]:
    """Shares of objects mentioned and facts stated per caption; objects no caption mentions."""
    objects, facts, unmentioned = [], [], []
    for record in records:
        n = len(record["scene"]["objects"])
        mentioned_by_any: set[int] = set()
        for caption in record["captions"]:
            stated = {m["object"]: m["attributes"] for m in caption["mentions"]}
            objects.append(len(stated) / n)
            facts.append(sum(len(a) for a in stated.values()) / (n * len(ATTRIBUTES)))
            mentioned_by_any |= set(stated)
        unmentioned.append(1 - len(mentioned_by_any) / n)
    return float(np.mean(objects)), float(np.mean(facts)), float(np.mean(unmentioned))


def embedded_statistics(root: Path) -> dict[str, float]:
    """The statistics of one generated benchmark folder (module docstring)."""
    records = list(load_scenes(root).values())
    split = {s: [r for r in records if r["split"] == s] for s in ("train", "test")}
    test_fn, test_extra = _true_of_others(split["test"])
    train_fn, _ = _true_of_others(split["train"])
    fn_batch, share = batch_false_negatives(train_fn, len(split["train"]) - 1)
    captions = [c["raw"] for r in split["train"] for c in r["captions"]]
    words = [[w.lower() for w in re.findall(r"[A-Za-z][A-Za-z-]*", c)] for c in captions]
    counts = Counter(w for ws in words for w in ws)
    num_test_captions = sum(len(r["captions"]) for r in split["test"])
    objects, facts, unmentioned = _partiality(split["train"])
    return {
        "fn_per_1000": float(test_fn.mean() / (len(split["test"]) - 1) * 1000),
        "fn_batch": fn_batch,
        "fn_batch_share": share,
        "extra_captions": float(test_extra.mean()),
        "extra_captions_per_1000": float(test_extra.mean() / (num_test_captions - 5) * 1000),
        "regions": float(np.load(root / "precomp" / "train_boxes.npy", mmap_mode="r").shape[1]),
        "words": float(np.mean([len(ws) for ws in words])),
        "vocabulary": float(sum(1 for n in counts.values() if n >= 5)),
        "vocabulary_all": float(len(counts)),
        "objects": float(np.mean([len(r["scene"]["objects"]) for r in records])),
        "objects_mentioned": objects,
        "facts_stated": facts,
        "objects_unmentioned": unmentioned,
    }


# ------------------------------------------------------------------------------ region probes

PROBED = {  # attribute -> its values, in a fixed order (the probe's class indices)
    "shape": SHAPES, "colour": tuple(COLOURS), "size": SIZES, "texture": TEXTURES,
    "hpos": HPOS, "vpos": VPOS,
}
BACKGROUND_PROBED = {"hue": HUES, "tone": TONES}  # the background's, read from its regions
PROBE_TRAIN_ROWS = 10_000  # training regions a probe fits at most (a seeded subsample)
# What is known of BUTD: its detector's own heads on Visual Genome's validation split. Detection
# mAP over 1,600 overlapping classes ("person / man / guy", singular and plural), not a probe's
# accuracy over disjoint classes; no published linear probe of BUTD's region features for COCO's
# objects or attributes was found, so the attribute rows cite none.
BUTD_SOURCE = ("Faster R-CNN ResNet-101 on Visual Genome val, the pretrained model's expected "
               "results (github.com/peteanderson80/bottom-up-attention, README, 'Expected "
               "detection results'; Anderson et al., CVPR 2018)")
BUTD_KNOWN = {
    "shape": "objects: mAP@0.5 10.2 % over 1,600 classes (15.1 % weighted) [B]",
    "attributes": "attributes: mAP@0.5 7.8 % over 400 (27.8 % weighted), given true boxes [B]",
}


@dataclass
class Regions:
    """The regions of one split that detect an object: their features and the object's labels."""

    features: np.ndarray  # (M, D)
    labels: dict[str, np.ndarray] = field(default_factory=dict)  # attribute -> (M,) class index


def object_regions(root: Path, records: dict[str, dict], split: str, every: bool) -> Regions:
    """The regions of ``split`` owned by an object (``region_owner`` of ``records``, the folder's
    ``scenes.json``): each object's best-scored one (the first, as the files are ordered by
    score), or with ``every`` all it owns."""
    ids = (root / "precomp" / f"{split}_ids.txt").read_text(encoding="utf-8").split()
    features = np.load(root / "precomp" / f"{split}_ims.npy", mmap_mode="r")  # (N, R, D)
    index = {name: {v: i for i, v in enumerate(values)} for name, values in PROBED.items()}
    rows, labels = [], {name: [] for name in PROBED}
    for i, name in enumerate(ids):
        record, seen = records[name], set()
        objects = record["scene"]["objects"]
        for r, k in enumerate(record["region_owner"]):
            if k < 0 or (not every and k in seen):
                continue
            seen.add(k)
            rows.append((i, r))
            for attribute in PROBED:
                labels[attribute].append(index[attribute][objects[k][attribute]])
    at = np.asarray(rows)
    return Regions(np.asarray(features[at[:, 0], at[:, 1]], dtype=np.float32),
                   {k: np.asarray(v) for k, v in labels.items()})


def background_regions(root: Path, records: dict[str, dict], split: str) -> Regions:
    """The regions of ``split`` that show the background (no object's, objects cover less than
    :data:`~icr.data.synthetic.regions.STUFF_COVERAGE` of them), labelled with its hue and tone."""
    ids = (root / "precomp" / f"{split}_ids.txt").read_text(encoding="utf-8").split()
    features = np.load(root / "precomp" / f"{split}_ims.npy", mmap_mode="r")  # (N, R, D)
    boxes = np.load(root / "precomp" / f"{split}_boxes.npy")  # (N, R, 4)
    index = {name: {v: i for i, v in enumerate(values)} for name, values in BACKGROUND_PROBED.items()}
    rows, labels = [], {name: [] for name in BACKGROUND_PROBED}
    for i, name in enumerate(ids):
        record = records[name]
        objects = [o["bbox"] for o in record["scene"]["objects"]]
        coverage = object_coverage(boxes[i].astype(np.float64), objects)  # (R,)
        for r, k in enumerate(record["region_owner"]):
            if k < 0 and coverage[r] < STUFF_COVERAGE:
                rows.append((i, r))
                for attribute in BACKGROUND_PROBED:
                    labels[attribute].append(index[attribute][record["scene"]["background"][attribute]])
    at = np.asarray(rows)
    return Regions(np.asarray(features[at[:, 0], at[:, 1]], dtype=np.float32),
                   {k: np.asarray(v) for k, v in labels.items()})


def linear_probe(train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray,
                 seed: int = 0) -> tuple[float, float]:
    """Held-out accuracy of softmax regression on standardised features, and the majority rate
    (the test share of the training split's most frequent class).

    At most :data:`PROBE_TRAIN_ROWS` training rows (a seeded subsample) keep a probe to seconds.
    """
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if len(train_x) > PROBE_TRAIN_ROWS:
        keep = np.random.default_rng(seed).choice(len(train_x), PROBE_TRAIN_ROWS, replace=False)
        train_x, train_y = train_x[keep], train_y[keep]
    probe = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500))
    probe.fit(train_x, train_y)
    majority = np.bincount(train_y).argmax()
    return float(probe.score(test_x, test_y)), float((test_y == majority).mean())


def probe_statistics(root: Path) -> dict[str, dict[str, float]]:
    """Per attribute: probe accuracy from each object's best region (``first``) and from every
    region it owns (``every``), the majority rate, and how often captions state it (``stated``:
    the share of the training captions' object mentions that state the attribute); per
    background attribute (``background hue``, ``background tone``): from every background
    region, with the share of training captions that state it."""
    out: dict[str, dict[str, float]] = {name: {} for name in PROBED}
    records = load_scenes(root)
    for variant, every in (("first", False), ("every", True)):
        train, test = (object_regions(root, records, split, every) for split in ("train", "test"))
        for name in PROBED:
            accuracy, majority = linear_probe(train.features, train.labels[name],
                                              test.features, test.labels[name])
            out[name][variant] = accuracy
            out[name][f"majority_{variant}"] = majority
    train, test = (background_regions(root, records, split) for split in ("train", "test"))
    captions = [c for r in records.values() if r["split"] == "train" for c in r["captions"]]
    for name in BACKGROUND_PROBED:
        accuracy, majority = linear_probe(train.features, train.labels[name],
                                          test.features, test.labels[name])
        stated = np.mean([any(cl["kind"] == "background" and name in cl for cl in c["meaning"])
                          for c in captions])
        out[f"background {name}"] = {"every": accuracy, "majority_every": majority,
                                     "stated": float(stated)}
    mentions = [m["attributes"] for c in captions for m in c["mentions"]]
    for name in PROBED:
        out[name]["stated"] = float(np.mean([name in a for a in mentions]))
    return out


def probe_table(probes: dict[str, dict[str, dict[str, float]]]) -> str:
    """Markdown: per attribute, BUTD's known figure and each preset's probe accuracies."""
    head = ("| attribute (classes) | captions state it | BUTD (detector heads, VG) | "
            + " | ".join(f"{p}: best region / every region (majority)" for p in probes) + " |")
    lines = [head, "| :--- | ---: | :--- |" + " ---: |" * len(probes)]
    first = next(iter(probes.values()))
    for name, values in PROBED.items():
        butd = BUTD_KNOWN["shape"] if name == "shape" else (
            BUTD_KNOWN["attributes"] if name in ("colour", "size", "texture") else "– (boxes)")
        cells = [f"{100 * p[name]['first']:.1f} / {100 * p[name]['every']:.1f} "
                 f"({100 * p[name]['majority_first']:.1f})" for p in probes.values()]
        lines.append(f"| {name} ({len(values)}) | {100 * first[name]['stated']:.1f} % | {butd} | "
                     + " | ".join(cells) + " |")
    for name, values in BACKGROUND_PROBED.items():
        key = f"background {name}"
        cells = [f"– / {100 * p[key]['every']:.1f} ({100 * p[key]['majority_every']:.1f})"
                 for p in probes.values()]
        lines.append(f"| {key} ({len(values)}) | {100 * first[key]['stated']:.1f} % | "
                     f"{BUTD_KNOWN['attributes']} | " + " | ".join(cells) + " |")
    lines += ["", "Held-out accuracy, %, of softmax regression on the standardised region feature "
              "(training boxes -> test boxes). 'captions state it': share of the training captions' "
              "object mentions that state the attribute, or of the captions that state the "
              "background's (first preset). The background is read from its regions (no object's, "
              f"objects cover under {STUFF_COVERAGE:.0%} of them). Positions are stated by captions "
              "but are a box's, not its crop's: a model reads them from the boxes.",
              f"[B] {BUTD_SOURCE}; the attribute figure covers VG's 400 attributes together (colours "
              "of objects and of stuff, 'blue sky'), not colour, size or texture apart: none is "
              "published per family."]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ learnability

# VSE-infinity (BUTD regions + bi-GRU) as the VSE+2AD paper's Table 1 reports it: COCO 5-fold 1k
# test and Flickr30K's 1k test; rsum out of 600, R@1 in %.
PAPERS = {
    "COCO 1k": {"rsum": 520.5, "i2t_R_at_1": 78.5, "t2i_R_at_1": 61.7},
    "Flickr30K 1k": {"rsum": 498.1, "i2t_R_at_1": 76.5, "t2i_R_at_1": 56.4},
}
PAPERS_SOURCE = "VSE-infinity, BUTD + BiGRU, as the VSE+2AD paper's Table 1 reports it"
# The sizes a learnability run trains at: the study's recipe, or the papers' (VSE-infinity and
# LTD: a 1024-d joint space, 1024 GRU units, 300-d word vectors; no 300-d GloVe ships offline, so
# the words start random).
MODEL_SIZES = {
    "recipe": {},
    "paper": {"model.embed_dim": "1024", "text.hidden_dim": "1024", "text.word_dim": "300",
              "text.glove": "none"},
}
TOP1_EPOCHS = 2  # the first epochs after which the in-batch top-1 rate is measured (and the last)
COCO_STEPS = 4425  # an epoch of COCO's Karpathy training split: 566,435 captions in batches of 128


def in_batch_top1(img: torch.Tensor, cap: torch.Tensor, caption_image: torch.Tensor,
                  batch: int = BATCH, chunk: int = 64) -> tuple[float, float]:
    """Expected share of queries whose positive is ranked first in a random batch of ``batch``
    pairs: (image -> caption, caption -> image), exact expectations (hypergeometric).

    A caption query faces its image and ``batch - 1`` images drawn from the others; an image query
    (one per pair) its caption and ``batch - 1`` captions of other images. With ``n`` of the
    drawable candidates scored above the positive, the positive is first with probability
    ``hypergeom.pmf(0, population, n, batch - 1)``. The counts are made on the embeddings'
    device, ``chunk`` images at a time (a (5 chunk, N_cap) comparison on the image side).

    Shapes: ``img`` (N_img, D), ``cap`` (N_cap, D), ``caption_image`` (N_cap,).
    """
    n_img, n_cap = len(img), len(cap)
    caption_image = caption_image.to(img.device)
    above_t2i = torch.empty(n_cap, dtype=torch.int64, device=img.device)
    above_i2t = torch.empty(n_cap, dtype=torch.int64, device=img.device)
    for start in range(0, n_cap, 4 * chunk):
        part = slice(start, start + 4 * chunk)
        sims = img @ cap[part].t()  # (N_img, c)
        own = caption_image[part]  # (c,)
        positive = sims[own, torch.arange(len(own), device=img.device)]  # (c,)
        above_t2i[part] = (sims > positive).sum(0)
    for start in range(0, n_img, chunk):
        stop = min(start + chunk, n_img)
        mine = torch.nonzero((caption_image >= start) & (caption_image < stop)).flatten()  # (m,)
        owner = caption_image[mine]  # (m,): each of the chunk's captions' image
        sims = img[owner] @ cap.t()  # (m, N_cap)
        positive = sims[torch.arange(len(mine), device=img.device), mine]  # (m,)
        foreign = caption_image[None, :] != owner[:, None]  # (m, N_cap)
        above_i2t[mine] = ((sims > positive[:, None]) & foreign).sum(1)
    per_image = n_cap / n_img
    draws = batch - 1
    t2i = hypergeom.pmf(0, n_img - 1, above_t2i.cpu().numpy(), min(draws, n_img - 1)).mean()
    population = int(round(n_cap - per_image))
    i2t = hypergeom.pmf(0, population, above_i2t.cpu().numpy(), min(draws, population)).mean()
    return float(i2t), float(t2i)


@dataclass
class Learnability:
    """One long run of a baseline: its curve, its test scores, its in-batch top-1 rates."""

    sizes: str
    epochs: int
    steps_per_epoch: int
    val_rsum: list[float]
    train_loss: list[float]  # the epoch's mean training loss (a collapse shows here)
    best_epoch: int
    test: dict[str, float]
    top1: dict[int, tuple[float, float]]  # epoch -> (i2t, t2i) on the training split
    seconds: float


def learnability(workspace: Workspace, preset: str, seed: int, epochs: int, sizes: str,
                 study: str = "ltd_bound", condition: str = "contrastive",
                 overrides: dict[str, str] | None = None) -> Learnability:
    """Train ``study``'s ``condition`` (its ``--debug`` config) for ``epochs`` on the preset.

    The recipe's warm-up epochs stay; the fine-tune phase takes the rest. After each of the first
    :data:`TOP1_EPOCHS` epochs and after the last, the run's live weights embed the training split
    for :func:`in_batch_top1`; the test split is scored once, at the best validation epoch
    (``fit``).
    """
    from icr.train import fit, load_trained
    from studies.catalog import get_study
    from studies.plan import Options, StudyPlan

    sets = {"data.preset": preset, "data.seed": str(seed), "train.live_cocos": "false",
            "eval.test": "true", **MODEL_SIZES[sizes], **(overrides or {})}
    base = StudyPlan.build(get_study(study), Options(overrides=sets, workspace=str(workspace.root)))
    warmup = base.debug_config(condition).train.warmup_epochs
    if epochs <= warmup:
        raise SystemExit(f"error: --epochs {epochs}: {study} warms up for {warmup}; give more")
    sets["train.finetune_epochs"] = str(epochs - warmup)
    plan = StudyPlan.build(get_study(study), Options(overrides=sets, workspace=str(workspace.root)))
    config = plan.debug_config(condition)
    val_rsum: list[float] = []
    train_loss: list[float] = []
    top1: dict[int, tuple[float, float]] = {}
    captions: list[int] = []  # the training split's size, once read

    def reporter(report: EpochReport) -> None:
        val_rsum.append(report.metrics["val_rsum"])
        train_loss.append(report.metrics.get("train_loss", float("nan")))
        print(f"  {sizes} sizes, epoch {report.epoch}/{epochs}: val rsum {val_rsum[-1]:.1f}, "
              f"training loss {train_loss[-1]:.3f}, {report.metrics['epoch_time_s']:.0f} s",
              flush=True)
        if (report.epoch <= TOP1_EPOCHS or report.final) and report.checkpoint is not None:
            task = load_trained(config, report.checkpoint, workspace=workspace, best=False)
            with torch.no_grad():
                img, cap = task.embed_split("train")  # (N_img, D), (N_cap, D)
            caption_image = torch.as_tensor(task.data.splits["train"].caption_image)
            top1[report.epoch] = rates = in_batch_top1(img, cap, caption_image)
            captions.append(len(caption_image))
            print(f"  {sizes} sizes, after epoch {report.epoch}: in-batch top-1 at {BATCH} "
                  f"{100 * rates[0]:.1f} % (i2t), {100 * rates[1]:.1f} % (t2i)", flush=True)

    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="realism-learnability-") as run_dir:
        result = fit(config, reporter, workspace=workspace, run_dir=run_dir)
    steps = -(-captions[0] // config.train.batch_size) if captions else 0
    return Learnability(sizes, epochs, steps, val_rsum, train_loss, result.best_epoch,
                        result.test or {}, top1, time.perf_counter() - start)


def ceiling_recalls(other_images: np.ndarray, other_captions: np.ndarray, per_image: int,
                    ks: Sequence[int] = (1, 5, 10)) -> dict[str, float]:
    """Recalls (%) of a model that ranks first whatever is true of the query, ties in random
    order; the papers' recall counts only a caption's own image, an image's own captions.

    Args:
        other_images: ``(N_cap,)`` other images each caption is true of.
        other_captions: ``(N_img,)`` captions of other images true of each image.
        per_image: captions per image.
    """
    true_images = 1 + np.asarray(other_images)  # its own image first among these, at random
    true_captions = per_image + np.asarray(other_captions)
    out = {}
    for k in ks:
        out[f"t2i_R_at_{k}"] = 100 * float(np.mean(np.minimum(k, true_images) / true_images))
        # none of the image's own captions among the first k of the captions true of it
        total = comb(true_captions, k)  # 0 (and so is the numerator) when fewer than k
        miss = np.divide(comb(other_captions, k), total, out=np.zeros(len(total)), where=total > 0)
        out[f"i2t_R_at_{k}"] = 100 * float(np.mean(1 - miss))
    out["rsum"] = sum(out.values())
    return out


def bag_of_objects(meaning: Sequence[dict]) -> list[dict]:
    """A caption's meaning as a model that pools its regions might read it: each object it
    describes exists (with its position words, which the boxes give), the background, and no
    relation, count or total (one object per relation's side; a count of one or more: one)."""
    out: list[dict] = []
    for clause in meaning:
        kind = clause["kind"]
        if kind in ("exists", "background"):
            out.append(clause)
        elif kind == "count" and clause["n"] > 0:
            out.append({"kind": "exists", "desc": clause["desc"]})
        elif kind == "relation":
            out += [{"kind": "exists", "desc": clause["a"]}, {"kind": "exists", "desc": clause["b"]}]
    return out


def retrieval_ceiling(root: Path) -> dict[str, dict[str, float]]:
    """:func:`ceiling_recalls` of the test split, exact from its scenes, of a model that reads
    everything a caption states (``all``) and of one that reads its objects and background but
    no relation or count (``objects``, :func:`bag_of_objects`)."""
    records = [r for r in load_scenes(root).values() if r["split"] == "test"]
    per_image = len(records[0]["captions"])
    out = {}
    for name, reading in (("all", None), ("objects", bag_of_objects)):
        other_images, other_captions = _true_of_others(records, reading)  # (N_cap,), (N_img,)
        out[name] = ceiling_recalls(other_images, other_captions, per_image)
    return out


def learnability_table(runs: Sequence[Learnability], ceiling: dict[str, dict[str, float]]
                       ) -> str:
    """Markdown: each run beside the papers' values and the benchmark's ceiling, then each run's
    validation curve."""
    lines = ["| model | epochs (steps) | test rsum (best val epoch) | test i2t R@1 | test t2i R@1 | "
             f"in-batch top-1 at {BATCH}, i2t / t2i, after epoch: |",
             "| :--- | ---: | ---: | ---: | ---: | :--- |"]
    for name, values in PAPERS.items():
        lines.append(f"| {name} [P] | 25 | {values['rsum']:.1f} | {values['i2t_R_at_1']:.1f} | "
                     f"{values['t2i_R_at_1']:.1f} | – |")
    for name, label in (("all", "ranks what is true first [C]"),
                        ("objects", "the same, reading objects, not relations or counts [C]")):
        values = ceiling[name]
        lines.append(f"| {label} | – | {values['rsum']:.1f} | {values['i2t_R_at_1']:.1f} | "
                     f"{values['t2i_R_at_1']:.1f} | – |")
    for run in runs:
        rates = ", ".join(f"{epoch}: {100 * a:.1f} / {100 * b:.1f}"
                          for epoch, (a, b) in sorted(run.top1.items()))
        lines.append(f"| {run.sizes} sizes | {run.epochs} ({run.epochs * run.steps_per_epoch}) | "
                     f"{run.test.get('rsum', float('nan')):.1f} ({run.best_epoch}) | "
                     f"{run.test.get('i2t_R_at_1', float('nan')):.1f} | "
                     f"{run.test.get('t2i_R_at_1', float('nan')):.1f} | {rates} |")
    lines += ["", f"[P] {PAPERS_SOURCE}; 1,000 test images (the embedded benchmark's test split: "
              f"500); an epoch of COCO is {COCO_STEPS:,} steps of 128 pairs.",
              "[C] the test split's recalls when everything a query is true of ranks first, ties "
              "in random order (exact expectations from the scenes); the second reads a caption "
              "as its objects (with their positions) and background only.",
              "Validation rsum per epoch:"]
    lines += [f"- {run.sizes} sizes ({run.seconds / 60:.1f} min): "
              + ", ".join(f"{v:.1f}" for v in run.val_rsum) for run in runs]
    lines += ["", "Mean training loss per epoch:"]
    lines += [f"- {run.sizes} sizes: " + ", ".join(f"{v:.3g}" for v in run.train_loss)
              for run in runs]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- output


ROWS = (  # key, label, COCO source ("cxc/eccv" pair, a literature key, or None), digits
    ("fn_per_1000", "false negatives per caption per 1,000 images", "pair", 3),
    ("fn_batch", f"false negatives per caption at batch {BATCH} (mean)", "pair", 3),
    ("fn_batch_share", f"captions with >= 1 false negative at batch {BATCH}", "pair", 3),
    ("extra_captions", "extra positive captions per image", "pair", 2),
    ("extra_captions_per_1000", "extra positive captions per image per 1,000 captions", "pair", 3),
    ("regions", "regions per image", "regions", 0),
    ("words", "words per caption", "words", 1),
    ("vocabulary", "vocabulary (training words seen >= 5 times)", "vocabulary", 0),
    ("vocabulary_all", "vocabulary (every training word)", None, 0),
    ("objects", "objects per image", "objects", 2),
    ("objects_mentioned", "share of an image's objects one caption mentions", None, 2),
    ("facts_stated", "share of an image's (object, attribute) facts one caption states", None, 2),
    ("objects_unmentioned", "share of objects none of the 5 captions mentions", None, 2),
)


def table(coco: dict[str, dict[str, float]], presets: dict[str, dict[str, float]]) -> str:
    """The side-by-side Markdown table, with the COCO sources as notes below it."""
    head = "| statistic | COCO 5k test (CxC / ECCV Caption) | " + " | ".join(presets) + " |"
    lines = [head, "| :--- | ---: |" + " ---: |" * len(presets)]
    notes = []
    for key, label, source, digits in ROWS:
        if source == "pair":
            cell = f"{coco['cxc'][key]:.{digits}f} / {coco['eccv'][key]:.{digits}f}"
        elif source is not None:
            value, note = COCO_LITERATURE[source]
            cell = f"{value:.{digits}f} [{len(notes) + 1}]"
            notes.append(note)
        else:
            cell = "–"
        values = " | ".join(f"{p[key]:.{digits}f}" for p in presets.values())
        lines.append(f"| {label} | {cell} | {values} |")
    lines.append("")
    lines.append(f"CxC: {coco['cxc']['queries']:.0f} caption queries, ECCV Caption: "
                 f"{coco['eccv']['queries']:.0f} (eccv-caption 0.1.0's files).")
    lines += [f"[{i}] {note}" for i, note in enumerate(notes, start=1)]
    return "\n".join(lines)


def _overrides(pairs: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings -> a dict; a malformed one stops with one line."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"error: --set {pair!r}: write KEY=VALUE, e.g. --set loss.tau=0.07")
        out[key] = value
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", help="workspace folder (default ./workspace or ICR_WORKSPACE)")
    parser.add_argument("--presets", default="tiny,small,default",
                        help="comma-separated embedded-benchmark presets (tiny,small,default)")
    parser.add_argument("--seed", type=int, default=0, help="benchmark generation seed (0)")
    parser.add_argument("--learnability", action="store_true",
                        help="also train a baseline on each preset (long: minutes per epoch on CPU)")
    parser.add_argument("--epochs", type=int, default=30, help="learnability: epochs per run (30)")
    parser.add_argument("--sizes", default="recipe,paper",
                        help=f"learnability: model sizes, comma-separated ({','.join(MODEL_SIZES)})")
    parser.add_argument("--study", default="ltd_bound", help="learnability: the study (ltd_bound)")
    parser.add_argument("--condition", default="contrastive",
                        help="learnability: the study's condition (contrastive)")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                        help="learnability: config overrides, e.g. train.device=cuda")
    parser.add_argument("--only-learnability", action="store_true",
                        help="skip the statistics and probe tables (and COCO's files): a GPU run")
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    if unknown := [s for s in sizes if s not in MODEL_SIZES]:
        parser.error(f"--sizes {unknown[0]}: choose from {', '.join(MODEL_SIZES)}")
    overrides = _overrides(args.set)

    workspace = Workspace.resolve(args.workspace)
    names = args.presets.split(",")
    roots = {p: ensure_benchmark(workspace.data / f"shapes-{p}-{args.seed}", p, args.seed)
             for p in names}
    if not args.only_learnability:
        presets = {p: embedded_statistics(root) for p, root in roots.items()}
        probes = {p: probe_statistics(root) for p, root in roots.items()}
        print(table(coco_statistics(), presets))
        print()
        print(probe_table(probes))
    for preset in names if args.learnability or args.only_learnability else ():
        runs = [learnability(workspace, preset, args.seed, args.epochs, s, args.study,
                             args.condition, overrides) for s in sizes]
        ceiling = retrieval_ceiling(roots[preset])
        print(f"\nLearnability on {preset} ({args.study} {args.condition}):\n")
        print(learnability_table(runs, ceiling))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
