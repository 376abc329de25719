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
from icr.config import ExperimentConfig
from icr.context import Embedder, Embeddings, InitialEmbeddings, Scenes, TaskContext
from icr.data.captions import VocabInput
from icr.data.pipeline import PreparedData, encode_split_captions
from icr.data.synthetic import load_scenes
from icr.train.retrieval_data import RetrievalInputs

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


@ANALYSES.register("probe", task="retrieval",
                   needs=(Embeddings, InitialEmbeddings, RetrievalInputs, Scenes))
def attribute_probes(*, context: TaskContext) -> Callable[[Path], dict[str, float]]:
    """Probes of the best checkpoint's embeddings, with the input, init and random references."""
    embeddings, initial = context.get(Embeddings), context.get(InitialEmbeddings)
    data = context.get(RetrievalInputs).data
    scenes = load_scenes(context.get(Scenes).root)
    pairs = {s: split_targets(scenes, data.splits[s]) for s in ("train", "test")}
    targets = Targets({s: p[0] for s, p in pairs.items()}, {s: p[1] for s, p in pairs.items()})

    # 20 positives per value on the default preset's 500 test images; fewer on the small presets.
    min_positives = min(MIN_POSITIVES, max(2, data.splits["test"].num_images // 25))

    def run(out: Path) -> dict[str, float]:
        def sides(train: Features, test: Features) -> dict[str, ProbeResult]:
            return probe_sides(train, test, targets, min_positives)

        trained = sides(embeddings.embed("train"), embeddings.embed("test"))
        metrics = _flatten("probe", trained)
        refs = {"input": _input_features(data), "init": _both_splits(initial.build()),
                "random": _random_features(targets, context.config)}
        ref_results = {name: sides(*features) for name, features in refs.items()}
        for name, sides in ref_results.items():
            metrics.update(_flatten(f"probe_ref/{name}", sides))
        _write_values(out / "probe_values.csv", {"trained": trained, **ref_results})
        return metrics

    return run


def _input_features(data: PreparedData) -> tuple[Features, Features]:
    def side(split: str) -> Features:
        clean = VocabInput(data.vocab, 10_000, 0.0, 0.0)
        ids = encode_split_captions(data.splits[split], clean)
        return input_image_features(data.images[split].tensor()), bag_of_words(ids, len(data.vocab))

    return side("train"), side("test")


def _both_splits(embed: Embedder) -> tuple[Features, Features]:
    return embed("train"), embed("test")


def _random_features(targets: Targets, config: ExperimentConfig) -> tuple[Features, Features]:
    g = np.random.default_rng(config.train.seed)
    dim = config.model.embed_dim
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
