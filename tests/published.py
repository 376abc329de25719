"""Folders laid out file for file as the published downloads, scaled down, for the tests.

- :func:`write_scan_coco`: SCAN's ``coco_precomp`` (the folder VSE-infinity and the LTD code read
  as published): ``{train,dev,test,testall}_{ims.npy,caps.txt,ids.txt}``; ``testall`` holds the
  5K test images, ``test`` a 1K test (here: the first fold of ``testall``), ``dev`` the
  validation images, ids are COCO image ids, features ``(N, 36, D)`` float32.
- :func:`write_scan_f30k`: SCAN's ``f30k_precomp``: ``{train,dev,test}_*``, ids are Karpathy
  ``imgid`` numbers (VSE-infinity's ``id_mapping.json`` maps them to file names), and the
  training features stored once per caption (the releases that repeat each image 5 times).

Scaled down: the real COCO test holds 5 folds of 1,000 images, these hold 5 folds of
``fold_images`` (4 by default), so a test exercises the 5-fold protocol on 20 images; the
preparation says the folds are smaller than COCO's (its ``1k_`` values are not comparable with
published 1K numbers). Region features are 36 x ``dims`` (BUTD: 36 x 2048).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

REGIONS = 36  # BUTD's regions per image
WORDS = ["a", "man", "woman", "dog", "cat", "bird", "red", "blue", "green", "small", "large", "on", "in", "near", "with", "the", "sits", "runs", "stands", "holds", "street", "table", "grass", "water", "ball", "bike"]


def _captions(rng: np.random.Generator, images: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 11)))) for _ in range(5 * images)]


def write_split(folder: Path, split: str, ids: list[int], rng: np.random.Generator, dims: int,
                repeat: bool = False) -> None:
    """One split as SCAN publishes it: ``{split}_ims.npy`` ``(N, 36, dims)`` float32 (``5N``
    rows when ``repeat``: each image once per caption), ``{split}_caps.txt`` (5 captions a line
    per image, in image order), ``{split}_ids.txt`` (one id a line)."""
    folder.mkdir(parents=True, exist_ok=True)
    features = rng.standard_normal((len(ids), REGIONS, dims)).astype(np.float32)
    if repeat:
        features = np.repeat(features, 5, axis=0)  # (5N, 36, dims)
    np.save(folder / f"{split}_ims.npy", features)
    (folder / f"{split}_caps.txt").write_text(
        "".join(f"{c}\n" for c in _captions(rng, len(ids))), encoding="utf-8")
    (folder / f"{split}_ids.txt").write_text("".join(f"{i}\n" for i in ids), encoding="utf-8")


def write_scan_coco(folder: Path, *, fold_images: int = 4, train: int = 40, dev: int = 10,
                    dims: int = 16, seed: int = 0) -> Path:
    """SCAN's ``coco_precomp``, scaled: ``testall`` of 5 x ``fold_images`` images, ``test`` its
    first fold (the same ids, features and captions)."""
    rng = np.random.default_rng(seed)
    write_split(folder, "train", [100_000 + i for i in range(train)], rng, dims)
    write_split(folder, "dev", [200_000 + i for i in range(dev)], rng, dims)
    write_split(folder, "testall", [300_000 + i for i in range(5 * fold_images)], rng, dims)
    first = fold_images
    np.save(folder / "test_ims.npy", np.load(folder / "testall_ims.npy")[:first])
    for kind, lines in (("caps", 5 * first), ("ids", first)):
        text = (folder / f"testall_{kind}.txt").read_text(encoding="utf-8").splitlines()[:lines]
        (folder / f"test_{kind}.txt").write_text("".join(f"{t}\n" for t in text),
                                                 encoding="utf-8")
    return folder


def write_scan_f30k(folder: Path, *, train: int = 40, dev: int = 10, test: int = 10,
                    dims: int = 16, seed: int = 1) -> Path:
    """SCAN's ``f30k_precomp``, scaled: ``train`` stored once per caption, ids are imgid."""
    rng = np.random.default_rng(seed)
    write_split(folder, "train", list(range(train)), rng, dims, repeat=True)
    write_split(folder, "dev", list(range(train, train + dev)), rng, dims)
    write_split(folder, "test", list(range(train + dev, train + dev + test)), rng, dims)
    return folder


if __name__ == "__main__":  # python tests/published.py OUT: both folders, to try a study on
    import sys

    out = Path(sys.argv[1])
    print(write_scan_coco(out / "coco_precomp"), write_scan_f30k(out / "f30k_precomp"))
