"""Analyses of a grounding run: the quality of its negative captions, and drawn examples.

- ``negative_quality``: on the embedded benchmark each substituted training caption is judged
  against the scene it describes (:mod:`icr.grounding.quality`): a true negative is false of its
  image, a false negative still true (a synonym, or an object or attribute the scene also has),
  unknown when the judge cannot read the substitute. Something no peer with real data can measure:
  ``negatives/{true_negative,false_negative,unknown}`` (fractions) and ``negatives/substitutes``.
- ``tagger_accuracy``: the part-of-speech tagger that picks a caption's nouns and adjectives,
  against the grammar's gold tags of the training captions (:func:`icr.grounding.words.tagger_accuracy`):
  ``tagger/content_accuracy`` (content vs function word), ``tagger/noun_adjective_accuracy``,
  ``tagger/content_precision``, ``tagger/content_recall``.
- ``grounding_examples``: a few test images drawn with each phrase's top-scoring region (red) and
  its ground-truth boxes (green), as ``examples/<image>.png``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from icr.analysis import ANALYSES
from icr.context import Attention, ImageFiles, Scenes, TaskContext
from icr.grounding import quality, words
from icr.grounding.train import GroundingInputs
from icr.metrics.grounding import phrase_region_scores

EXAMPLES = 4  # test images drawn per run


@ANALYSES.register("negative_quality", task="grounding", needs=(GroundingInputs, Scenes))
def negative_quality(*, context: TaskContext) -> Callable[[Path], dict[str, float]]:
    """The share of the run's negative captions that are true / false negatives."""
    negatives = context.get(GroundingInputs).data.negatives
    root = context.get(Scenes).root

    def run(out: Path) -> dict[str, float]:
        if negatives is None:  # L_img only: no negative captions to judge
            return {}
        verdicts = quality.negative_quality(quality.load_shapes_truth(root, "train"),
                                            {"run": negatives})
        return {f"negatives/{k.removeprefix('run_')}": v for k, v in verdicts.items()}

    return run


@ANALYSES.register("tagger_accuracy", task="grounding", needs=(GroundingInputs, Scenes))
def tagger_accuracy(*, context: TaskContext) -> Callable[[Path], dict[str, float]]:
    """How well the tagger finds the words the model grounds, against the benchmark's gold tags
    (the grammar of the benchmark's captions, which comes with its scenes)."""
    captions = context.get(GroundingInputs).data.splits["train"].captions
    context.get(Scenes)  # the captions are the embedded benchmark's, whose gold tags are known

    def run(out: Path) -> dict[str, float]:
        return {f"tagger/{k}": v for k, v in words.tagger_accuracy(captions).items()}

    return run


@ANALYSES.register("grounding_examples", task="grounding",
                   needs=(GroundingInputs, Attention, ImageFiles))
def grounding_examples(*, context: TaskContext) -> Callable[[Path], dict[str, float]]:
    """Test images with each phrase's top region and its ground truth, drawn to PNG files."""
    data = context.get(GroundingInputs).data
    attention = context.get(Attention).attention
    images = context.get(ImageFiles).folder

    def run(out: Path) -> dict[str, float]:
        split = data.splits["test"]
        piece_phrase = split.piece_phrase(data.words["test"].piece_word)  # (C, P)
        scores = phrase_region_scores(attention("test"), torch.as_tensor(piece_phrase),
                                      len(split.phrase_caption))  # (F, R)
        for image in range(min(EXAMPLES, len(split.image_ids))):
            phrases = np.flatnonzero(split.phrase_image == image)
            _draw(images, split, image, phrases, np.asarray(scores[phrases]), out)
        return {}

    return run


def _draw(folder: Path, split: Any, image: int, phrases: np.ndarray, scores: np.ndarray,
          out: Path) -> None:
    import matplotlib  # lazy: keeps matplotlib off every run that draws no examples

    matplotlib.use("Agg")  # no display: before pyplot is imported
    import matplotlib.pyplot as plt  # lazy: keeps matplotlib off every run that draws no examples

    name = split.image_ids[image]
    path = next(folder.glob(f"{name}.*"), None)
    if path is None:
        return
    regions, truth = split.boxes("continuous")  # pixel edges, as drawn
    fig, axes = plt.subplots(1, max(len(phrases), 1), figsize=(2.4 * max(len(phrases), 1), 2.8))
    for ax, phrase, row in zip(np.atleast_1d(axes), phrases, scores, strict=False):
        ax.imshow(Image.open(path).convert("RGB"))
        for box, real in zip(truth[phrase], split.phrase_box_mask[phrase], strict=True):
            if real:
                ax.add_patch(_rect(box, "lime"))
        if np.isfinite(row).any():
            ax.add_patch(_rect(regions[image][int(np.argmax(row))], "red"))
        caption = split.captions[split.phrase_caption[phrase]].split()
        ax.set_title(" ".join(caption[split.phrase_first[phrase]:split.phrase_end[phrase]]),
                     fontsize=7)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out / f"{name}.png", dpi=100)
    plt.close(fig)


def _rect(box: np.ndarray, color: str) -> Any:
    # lazy: keeps matplotlib off every run that draws no examples
    from matplotlib.patches import Rectangle

    x0, y0, x1, y1 = (float(v) for v in box)
    return Rectangle((x0, y0), x1 - x0, y1 - y0, fill=False, edgecolor=color, linewidth=1.5)
