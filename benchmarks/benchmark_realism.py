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
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from scipy.stats import hypergeom

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from icr.data.synthetic import TruthTable, ensure_benchmark, load_scenes  # noqa: E402
from icr.data.synthetic.world import ATTRIBUTES, Scene  # noqa: E402
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


def _true_of_others(records: Sequence[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Per caption, the number of other images it is true of; per image, of other captions."""
    table = TruthTable([Scene.from_json(r["scene"]) for r in records])
    per_caption, per_image = [], np.zeros(len(records), dtype=np.int64)
    for i, record in enumerate(records):
        for caption in record["captions"]:
            truth = table.holds(caption["meaning"])  # (N,)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", help="workspace folder (default ./workspace or ICR_WORKSPACE)")
    parser.add_argument("--presets", default="tiny,small,default",
                        help="comma-separated embedded-benchmark presets (tiny,small,default)")
    parser.add_argument("--seed", type=int, default=0, help="benchmark generation seed (0)")
    args = parser.parse_args(argv)

    workspace = Workspace.resolve(args.workspace)
    coco = coco_statistics()
    presets = {}
    for preset in args.presets.split(","):
        root = ensure_benchmark(workspace.data / f"shapes-{preset}-{args.seed}", preset, args.seed)
        presets[preset] = embedded_statistics(root)
    print(table(coco, presets))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
