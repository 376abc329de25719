"""The attribute-probe analysis: which ground-truth attributes a trained encoder kept (``probe``).

LTD paper section 1 (predictive feature suppression), measured directly on the embedded benchmark:
linear probes (:mod:`icr.analysis.probe`) of the frozen training and test embeddings of the best
checkpoint, for every attribute family, on both sides (image: does the scene contain the value;
caption: does the caption state it). Besides the trained model, three references on the same
probes: ``input`` (what is linearly there before any encoder: mean- and max-pooled region features
or 8 x 8 pooled pixels; a bag of words of the captions), ``init`` (the same model at its
initialisation, rebuilt from the run's seed) and ``random`` (Gaussian embeddings: chance).

Metrics: ``probe/{image,caption}/{family}`` (ROC-AUC, the mean over the family's values) and
``probe_ref/{input,init,random}/{image,caption}/{family}``; the per-value AUCs go to
``probe_values.csv``.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from icr.analysis import ANALYSES
from icr.analysis.probe import ProbeResult, probe, split_targets
from icr.data.captions import VocabInput
from icr.data.pipeline import encode_split_captions
from icr.data.synthetic import load_scenes
from icr.errors import ConfigError
from icr.seeding import seed_everything

MIN_POSITIVES = 20  # a value is probed only with this many positives and negatives per split


@dataclass(frozen=True)
class Targets:
    image: dict[str, np.ndarray]  # split -> (N_img, K)
    caption: dict[str, np.ndarray]  # split -> (N_cap, K)


Features = tuple[np.ndarray | torch.Tensor, np.ndarray | torch.Tensor]  # (image, caption)


def probe_sides(train: Features, test: Features, targets: Targets,
                min_positives: int = MIN_POSITIVES) -> dict[str, ProbeResult]:
    """Image-side and caption-side probes of (image, caption) features of train and test."""
    return {
        "image": probe(train[0], targets.image["train"], test[0], targets.image["test"],
                       min_positives=min_positives),
        "caption": probe(train[1], targets.caption["train"], test[1], targets.caption["test"],
                         min_positives=min_positives),
    }


def input_image_features(images: torch.Tensor) -> np.ndarray:
    """Mean- and max-pooled regions ``(N, 2 D)``, or 8 x 8 average-pooled pixels ``(N, 192)``."""
    if images.dtype == torch.uint8:  # (N, 3, H, W) pixels
        pooled = torch.nn.functional.adaptive_avg_pool2d(images.float() / 255.0, 8)  # (N, 3, 8, 8)
        return pooled.flatten(1).numpy()
    return torch.cat([images.mean(1), images.amax(1)], dim=1).numpy()  # (N, R, D) -> (N, 2 D)


def bag_of_words(ids: list[torch.Tensor], vocab_size: int) -> np.ndarray:
    """Binary bag of words ``(N_cap, V)`` of token id sequences."""
    out = np.zeros((len(ids), vocab_size), dtype=np.float32)
    for i, tokens in enumerate(ids):
        out[i, tokens.numpy()] = 1.0
    return out


def _flatten(prefix: str, sides: dict[str, ProbeResult]) -> dict[str, float]:
    return {f"{prefix}/{side}/{family}": auc
            for side, result in sides.items() for family, auc in result.per_family.items()}


@ANALYSES.register("probe")
def attribute_probes(*, task: object) -> Callable[[Path], dict[str, float]]:
    """Probes of the best checkpoint's embeddings, with the input, init and random references."""
    data = task.data  # type: ignore[attr-defined]
    if not hasattr(task, "embed_split"):
        raise ConfigError("eval.analyses=probe needs a retrieval task (task.name=retrieval)")
    if data.source.ground_truth is None:
        raise ConfigError("eval.analyses=probe needs the embedded benchmark's ground truth "
                          "(scenes.json); use data.dataset=shapes or drop the probe analysis")
    scenes = load_scenes(data.root)
    pairs = {s: split_targets(scenes, data.splits[s]) for s in ("train", "test")}
    targets = Targets({s: p[0] for s, p in pairs.items()}, {s: p[1] for s, p in pairs.items()})

    # 20 positives per value on the default preset's 500 test images; fewer on the small presets.
    min_positives = min(MIN_POSITIVES, max(2, data.splits["test"].num_images // 25))

    def run(out: Path) -> dict[str, float]:
        def sides(train: Features, test: Features) -> dict[str, ProbeResult]:
            return probe_sides(train, test, targets, min_positives)

        trained = sides(task.embed_split("train"), task.embed_split("test"))
        metrics = _flatten("probe", trained)
        refs = {"input": _input_features(data), "init": _init_features(task),
                "random": _random_features(targets, task.config)}  # type: ignore[attr-defined]
        ref_results = {name: sides(*features) for name, features in refs.items()}
        for name, sides in ref_results.items():
            metrics.update(_flatten(f"probe_ref/{name}", sides))
        _write_values(out / "probe_values.csv", {"trained": trained, **ref_results})
        return metrics

    return run


def _input_features(data: object) -> tuple[Features, Features]:
    def side(split: str) -> Features:
        clean = VocabInput(data.vocab, 10_000, 0.0, 0.0)  # type: ignore[attr-defined]
        ids = encode_split_captions(data.splits[split], clean)  # type: ignore[attr-defined]
        return (input_image_features(data.images[split]),  # type: ignore[attr-defined]
                bag_of_words(ids, len(data.vocab)))  # type: ignore[attr-defined]

    return side("train"), side("test")


def _init_features(task: object) -> tuple[Features, Features]:
    """Embeddings of the model at its initialisation: rebuilt exactly as ``fit`` built it."""
    from icr.train.retrieval import RetrievalTask

    config = task.config  # type: ignore[attr-defined]
    seed_everything(config.train.seed)
    fresh = RetrievalTask(config, task.prepared, task.device, task.cache)  # type: ignore[attr-defined]
    return fresh.embed_split("train"), fresh.embed_split("test")


def _random_features(targets: Targets, config: object) -> tuple[Features, Features]:
    g = np.random.default_rng(config.train.seed)  # type: ignore[attr-defined]
    dim = config.model.embed_dim  # type: ignore[attr-defined]
    train, test = ((g.normal(size=(len(targets.image[s]), dim)),
                    g.normal(size=(len(targets.caption[s]), dim))) for s in ("train", "test"))
    return train, test


def _write_values(path: Path, results: dict[str, dict[str, ProbeResult]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "side", "value", "auc"])
        for model, sides in results.items():
            for side, result in sides.items():
                for value, auc in sorted(result.per_value.items()):
                    writer.writerow([model, side, value, f"{auc:.6f}"])
