"""Datasets by name: what a source offers analyses, and the training split's size read from the
files without loading them (``--plan``), the embedded benchmark's folder named in one place."""

from __future__ import annotations

from pathlib import Path

import pytest

from icr.config import from_flat
from icr.context import ImageFiles, Scenes
from icr.data.datasets import SHAPES_SPLITS, DatasetSource, shapes_folder, training_size
from icr.data.karpathy import write_karpathy_json
from icr.data.synthetic import PRESETS
from icr.workspace import Workspace


def test_a_source_offers_its_ground_truth_and_its_image_folder_when_present(tmp_path):
    bare = DatasetSource(tmp_path, {})
    assert bare.capabilities() == ()
    (tmp_path / "images").mkdir()
    (tmp_path / "scenes.json").write_text("{}")
    full = DatasetSource(tmp_path, {}, ground_truth=tmp_path / "scenes.json")
    assert full.capabilities() == (Scenes(tmp_path), ImageFiles(tmp_path / "images"))


def _karpathy(path: Path, train_images: int) -> None:
    """A split JSON with ``train_images`` training images of 5 captions each."""
    images = [{"split": split, "filename": f"{split}{i}.png",
               "sentences": [f"a shape number {i} {k}" for k in range(5)]}
              for split, n in (("train", train_images), ("val", 1), ("test", 1)) for i in range(n)]
    write_karpathy_json(path, "shapes", images)


def test_the_embedded_benchmark_before_and_after_it_is_generated(tmp_path):
    workspace = Workspace(tmp_path / "ws")
    config = from_flat({"data.preset": "tiny", "data.seed": 3})
    preset = PRESETS["tiny"]  # not generated: the sizes its preset will give
    assert training_size(config, workspace) == (preset.train * preset.captions_per_image,
                                                preset.train)
    folder = shapes_folder(preset="tiny", seed=3, root="", workspace=workspace)
    assert folder == workspace.data / "shapes-tiny-3"
    _karpathy(folder / SHAPES_SPLITS, 4)  # generated (here: a small stand-in): its files
    assert training_size(config, workspace) == (20, 4)
    elsewhere = tmp_path / "mine"
    _karpathy(elsewhere / SHAPES_SPLITS, 3)  # data.root names the folder instead
    assert training_size(from_flat({"data.root": str(elsewhere)}), workspace) == (15, 3)


def test_karpathy_and_precomp_sizes_from_their_files_none_without(tmp_path):
    workspace = Workspace(tmp_path / "ws")
    split = tmp_path / "coco" / "dataset_coco.json"
    karpathy = {"data.dataset": "karpathy", "data.karpathy_json": str(split)}
    assert training_size(from_flat(karpathy), workspace) is None
    _karpathy(split, 6)
    assert training_size(from_flat(karpathy), workspace) == (30, 6)
    folder = tmp_path / "precomp"
    precomp = {"data.dataset": "precomp", "data.precomp_dir": str(folder)}
    assert training_size(from_flat(precomp), workspace) is None
    folder.mkdir()
    (folder / "train_caps.txt").write_text("".join(f"caption {i}\n" for i in range(10)) + "\n")
    assert training_size(from_flat(precomp), workspace) == (10, 2)  # 5 captions an image


@pytest.mark.parametrize("name", ["shapes", "karpathy", "precomp"])
def test_every_builtin_dataset_registers_its_training_size(name):
    from icr.data.datasets import DATASETS

    assert callable(DATASETS.meta(name)["train_size"])
