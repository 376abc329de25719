"""Linear probes of frozen embeddings: which ground-truth attributes an encoder kept.

Predictive feature suppression (section 1 of the LTD paper) is a claim about what an encoder's
representation *contains*, which retrieval metrics measure only indirectly. The embedded benchmark
knows the truth of every image and caption, so the claim can be measured directly: for each
attribute value (``colour=red``, ``size=large``, ``hpos=left``, ``count=3``, ``background=dark``, ...)
fit a logistic regression on frozen training-split embeddings and report its ROC-AUC on the test
split. An AUC near 1 means the value is linearly decodable from the embedding; near 0.5, that it
was dropped (or never encoded).

Two sides, two questions:

- image side: does the *scene* contain the value (some object has it; ``count=n``: the scene has
  ``n`` objects; ``background=tone``)?
- caption side: does the *caption state* it (it appears in a clause of the caption's meaning;
  ``count=n``: the caption says how many objects the scene has)? A caption encoder that suppresses
  e.g. texture words scores low on ``texture=*`` although every such caption spells them out.

Everything here is a pure function of arrays (the probe) or of scene records (the labels), so the
probe can be tested on constructed embeddings. Typical use::

    scenes = load_scenes(trainer.data.root)
    y_img_tr, y_cap_tr = split_targets(scenes, trainer.data.splits["train"])
    y_img_te, y_cap_te = split_targets(scenes, trainer.data.splits["test"])
    img_tr, cap_tr = trainer.embed_split("train")
    img_te, cap_te = trainer.embed_split("test")
    result = probe(img_tr, y_img_tr, img_te, y_img_te)
    result.per_family  # {"shape": 0.93, "colour": 0.97, ...}
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from icr.data.synthetic.world import (
    COLOURS,
    HPOS,
    HUES,
    OBJECT_COUNTS,
    SHAPES,
    SIZES,
    TEXTURES,
    TONES,
    VPOS,
)
from icr.data.types import CaptionedImages
from icr.errors import DataError

log = logging.getLogger(__name__)

FAMILIES = ("shape", "colour", "size", "texture", "position", "count", "background")
_ATTRIBUTE_FAMILY = {"shape": "shape", "colour": "colour", "size": "size", "texture": "texture",
                     "hpos": "position", "vpos": "position"}


@dataclass(frozen=True)
class Label:
    """One probed attribute value, e.g. ``Label("position", "hpos=left")``."""

    family: str
    name: str


def label_space() -> tuple[Label, ...]:
    """Every attribute value of the shapes world, in a fixed order (the columns of the targets)."""
    values = {"shape": SHAPES, "colour": tuple(COLOURS), "size": SIZES, "texture": TEXTURES,
              "hpos": HPOS, "vpos": VPOS}
    labels = [Label(_ATTRIBUTE_FAMILY[a], f"{a}={v}") for a, vs in values.items() for v in vs]
    labels += [Label("count", f"count={n}") for n in OBJECT_COUNTS]
    labels += [Label("background", f"background={t}") for t in TONES]
    labels += [Label("background", f"background_hue={h}") for h in HUES]
    return tuple(labels)


LABELS = label_space()


# ------------------------------------------------------------------------------------- labels


def image_labels(record: Mapping) -> set[str]:
    """Label names true of an image: its objects' attribute values, object count, background.

    Args:
        record: a ``scenes.json`` record (see :func:`icr.data.synthetic.load_scenes`), or anything
            with its ``scene`` entry (``objects`` with the attributes, ``background.tone``).
    """
    scene = record["scene"]
    names = {f"{a}={obj[a]}" for obj in scene["objects"] for a in _ATTRIBUTE_FAMILY}
    names.add(f"count={len(scene['objects'])}")
    names.add(f"background={scene['background']['tone']}")
    names.add(f"background_hue={scene['background']['hue']}")
    return names


def caption_labels(caption: Mapping) -> set[str]:
    """Label names a caption states, read from the clauses of its ``meaning``.

    Object descriptions of ``exists``, ``count`` and ``relation`` clauses state their attribute
    values (a hypernym such as ``shape=polygon`` is no label and is ignored); a ``background`` clause
    its tone and hue; a ``total`` clause ``count=n``. A ``count`` clause
    ("two red circles") counts a subset, not the scene's objects, so it states no ``count=n``.
    Relations state no absolute position.
    """
    names: set[str] = set()
    for clause in caption["meaning"]:
        kind = clause["kind"]
        descs = [clause["desc"]] if kind in ("exists", "count") else []
        if kind == "relation":
            descs = [clause["a"], clause["b"]]
        names.update(f"{a}={v}" for desc in descs for a, v in desc.items())
        if kind == "background":
            names.update(f"background{suffix}={clause[field]}"
                         for field, suffix in (("tone", ""), ("hue", "_hue")) if field in clause)
        if kind == "total":
            names.add(f"count={clause['n']}")
    return names


def label_matrix(label_sets: Iterable[set[str]], labels: Sequence[Label] = LABELS) -> np.ndarray:
    """``(N, K)`` bool: row ``i`` marks the labels in ``label_sets[i]``."""
    column = {label.name: k for k, label in enumerate(labels)}
    rows = list(label_sets)
    out = np.zeros((len(rows), len(labels)), dtype=bool)
    for i, names in enumerate(rows):
        for name in names:
            if name in column:
                out[i, column[name]] = True
    return out


def split_targets(
    scenes: Mapping[str, Mapping], split: CaptionedImages, labels: Sequence[Label] = LABELS
) -> tuple[np.ndarray, np.ndarray]:
    """Image ``(N_img, K)`` and caption ``(N_cap, K)`` targets of a split, in the split's order.

    Images are matched by file name, captions by ``sentid`` (``split.caption_ids``), so the rows line
    up with ``trainer.embed_split(split.split)``.
    """
    missing = [i for i in split.image_ids if i not in scenes]
    if missing:
        raise DataError(f"{len(missing)} {split.split} images (e.g. {missing[0]}) have no record in "
                        "scenes.json; probes need the embedded benchmark's ground truth")
    records = [scenes[i] for i in split.image_ids]
    by_sentid = {c["sentid"]: c for r in records for c in r["captions"]}
    captions = [by_sentid.get(s) for s in split.caption_ids]
    if any(c is None for c in captions):
        raise DataError(f"some {split.split} caption ids have no caption in scenes.json")
    images = label_matrix((image_labels(r) for r in records), labels)
    return images, label_matrix((caption_labels(c) for c in captions), labels)


# ------------------------------------------------------------------------------------- probe


@dataclass(frozen=True)
class LinearProbe:
    """Independent logistic regressions, one per label, over standardised features.

    ``weight`` ``(D, K)``, ``bias`` ``(K,)``; ``mean`` and ``std`` ``(D,)`` of the training features.
    """

    weight: torch.Tensor
    bias: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor

    def scores(self, x: torch.Tensor | np.ndarray) -> np.ndarray:
        """Logits ``(N, K)`` of features ``x`` ``(N, D)``."""
        x = (torch.as_tensor(x, dtype=torch.float64) - self.mean) / self.std  # (N, D)
        return (x @ self.weight + self.bias).numpy()  # (N, K)


def fit_linear_probe(
    x: torch.Tensor | np.ndarray, y: torch.Tensor | np.ndarray, *, l2: float = 1e-3,
    max_iter: int = 200,
) -> LinearProbe:
    """Fit one L2-regularised logistic regression per column of ``y``, full batch, by L-BFGS.

    The objective ``sum_k mean_i BCE(x_i w_k + b_k, y_ik) + l2 / 2 * ||W||^2`` separates over the
    labels, so one L-BFGS run over all of them equals K independent fits.

    Shapes:
        x: ``(N, D)`` features; y: ``(N, K)`` binary targets.
    """
    x = torch.as_tensor(x, dtype=torch.float64)  # (N, D)
    y = torch.as_tensor(y, dtype=torch.float64)  # (N, K)
    mean, std = x.mean(0), x.std(0).clamp_min(1e-8)  # (D,)
    z = (x - mean) / std  # (N, D)
    weight = torch.zeros(x.shape[1], y.shape[1], dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(y.shape[1], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], lr=1.0, max_iter=max_iter, history_size=20,
                            tolerance_grad=1e-9, tolerance_change=1e-12,
                            line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        logits = z @ weight + bias  # (N, K)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, y, reduction="none")
        loss = bce.mean(0).sum() + 0.5 * l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return LinearProbe(weight.detach(), bias.detach(), mean, std)


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """ROC-AUC of each column (Mann-Whitney U with tied scores counted half); NaN for a column
    without both classes.

    Shapes:
        scores, labels: ``(N, K)``; returns ``(K,)``.
    """
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
    out = np.full(scores.shape[1], np.nan)
    for k in range(scores.shape[1]):
        pos = int(labels[:, k].sum())
        neg = len(labels) - pos
        if pos and neg:
            ranks = _average_ranks(scores[:, k])  # (N,) 1-based
            out[k] = (ranks[labels[:, k]].sum() - pos * (pos + 1) / 2) / (pos * neg)
    return out


def _average_ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    first = np.r_[True, sorted_values[1:] != sorted_values[:-1]]  # start of each tie group
    group = np.cumsum(first) - 1
    starts = np.flatnonzero(first)
    ends = np.r_[starts[1:], len(values)]
    ranks = np.empty(len(values))
    ranks[order] = ((starts + 1 + ends) / 2)[group]  # mean of the 1-based ranks start+1 .. end
    return ranks


@dataclass(frozen=True)
class ProbeResult:
    """Test ROC-AUC per label value and its mean per family.

    ``per_value`` holds only the values probed (enough positives and negatives on both splits);
    ``skipped`` names the others; a family with no probed value is missing from ``per_family``.
    """

    per_value: dict[str, float]
    per_family: dict[str, float]
    skipped: tuple[str, ...]


def probe(
    train_x: torch.Tensor | np.ndarray, train_y: np.ndarray, test_x: torch.Tensor | np.ndarray,
    test_y: np.ndarray, labels: Sequence[Label] = LABELS, *, min_positives: int = 20,
    l2: float = 1e-3, max_iter: int = 200,
) -> ProbeResult:
    """Fit probes on the training split, score them on the test split, average per family.

    A value is probed only when both splits hold at least ``min_positives`` positives and as many
    negatives; fewer make the test AUC too noisy to compare conditions.

    Shapes:
        train_x ``(N_tr, D)``, train_y ``(N_tr, K)``, test_x ``(N_te, D)``, test_y ``(N_te, K)``,
        ``K = len(labels)``.
    """
    train_y, test_y = np.asarray(train_y, dtype=bool), np.asarray(test_y, dtype=bool)
    if train_y.shape[1] != len(labels) or test_y.shape[1] != len(labels):
        raise ValueError(f"targets have {train_y.shape[1]} / {test_y.shape[1]} columns, "
                         f"expected {len(labels)} (one per label)")
    keep = np.array([_enough(train_y[:, k], min_positives) and _enough(test_y[:, k], min_positives)
                     for k in range(len(labels))], dtype=bool)
    skipped = tuple(label.name for label, k in zip(labels, keep, strict=True) if not k)
    per_value: dict[str, float] = {}
    if keep.any():
        fitted = fit_linear_probe(train_x, train_y[:, keep], l2=l2, max_iter=max_iter)
        auc = roc_auc(fitted.scores(test_x), test_y[:, keep])  # (K_kept,)
        kept = [label for label, k in zip(labels, keep, strict=True) if k]
        per_value = {label.name: float(a) for label, a in zip(kept, auc, strict=True)}
    return ProbeResult(per_value, family_means(per_value, labels), skipped)


def _enough(column: np.ndarray, minimum: int) -> bool:
    positives = int(column.sum())
    return positives >= minimum and len(column) - positives >= minimum


def family_means(per_value: Mapping[str, float], labels: Sequence[Label] = LABELS) -> dict[str, float]:
    """Mean of the per-value scores within each family (families without a value are left out)."""
    grouped: dict[str, list[float]] = {}
    for label in labels:
        if label.name in per_value:
            grouped.setdefault(label.family, []).append(per_value[label.name])
    return {f: float(np.mean(grouped[f])) for f in FAMILIES if f in grouped}
