"""Datasets by name (``data.dataset``): where a dataset lives and how its splits load.

Each builder takes the ``data.*`` fields it needs as keyword arguments (and the workspace) and
returns a :class:`DatasetSource`: the loaded splits plus the paths of the assets that come with the
dataset (region features, CxC files, relevance matrices, ground truth for analyses). The data
pipeline (:mod:`icr.data.pipeline`) turns a source into tensors; nothing else knows which dataset
it is. A dataset whose files give analyses something (ground truth, image files) registers it as
``provides=`` (:mod:`icr.context`). A new dataset is a module with one ``@DATASETS.register(name)``
builder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from icr.config import DataConfig
from icr.context import ImageFiles, Scenes
from icr.data import karpathy, precomp
from icr.data.types import CaptionedImages
from icr.errors import ConfigError
from icr.registry import Registry
from icr.workspace import Workspace

if TYPE_CHECKING:
    from icr.config import ExperimentConfig

SPLITS = ("train", "val", "test")

DATASETS: Registry = Registry("dataset", section=DataConfig, package="icr.data")


@dataclass(frozen=True)
class DatasetSource:
    """A dataset's splits and the assets that come with it.

    Attributes:
        root: the dataset folder (caches are keyed by content, not by this path).
        splits: ``train``, ``val`` and ``test``, in evaluation order.
        regions_dir: a SCAN/BUTD folder of region features for these images, or ``None``.
        cxc: per evaluation split, the CxC sits CSV shipped with the dataset, or ``None``.
        relevance: per evaluation split, named relevance matrices (``.npy``) shipped with it,
            the one ``data.relevance=auto`` takes first.
        ground_truth: ``scenes.json`` of the embedded benchmark (attribute probes), or ``None``.
        entities_dir: a Flickr30K Entities folder (grounding), or ``None``.
        protocols: the evaluation protocols its test split is reported with.
    """

    root: Path
    splits: dict[str, CaptionedImages]
    regions_dir: Path | None = None
    cxc: dict[str, Path | None] = field(default_factory=dict)
    relevance: dict[str, dict[str, Path]] = field(default_factory=dict)
    ground_truth: Path | None = None
    entities_dir: Path | None = None
    protocols: tuple[str, ...] = ("full",)


def _existing(path: Path) -> Path | None:
    return path if path.exists() else None


@DATASETS.register("shapes", provides=(Scenes, ImageFiles))
def shapes(*, preset: str, seed: int, root: str, workspace: Workspace) -> DatasetSource:
    """The embedded benchmark, generated into the workspace on first use."""
    # lazy: keeps the benchmark's generator (PIL, its renderer) off the command line's start
    from icr.data.synthetic import ensure_benchmark

    folder = ensure_benchmark(
        Path(root) if root else workspace.data / f"shapes-{preset}-{seed}", preset, seed
    )
    image_root = folder / "images"
    splits = {s: karpathy.load_karpathy(folder / "dataset_shapes.json", s, image_root=image_root)
              for s in SPLITS}
    relevance = {
        s: {name: p for name in ("semantic",)
            if (p := folder / "relevance" / f"{name}_{s}.npy").exists()}
        for s in ("val", "test")
    }
    return DatasetSource(
        folder, splits, regions_dir=folder / "precomp",
        cxc={s: _existing(folder / "cxc" / f"sits_{s}.csv") for s in ("val", "test")},
        relevance=relevance, ground_truth=_existing(folder / "scenes.json"),
        entities_dir=_existing(folder / "entities"),
    )


@DATASETS.register("karpathy")
def karpathy_json(
    *, karpathy_json: str, image_root: str, precomp_dir: str, entities_dir: str,
    workspace: Workspace,
) -> DatasetSource:
    """A Karpathy split JSON (COCO, Flickr30k) with its image folder (and optional regions)."""
    if not karpathy_json:
        raise ConfigError("data.dataset=karpathy needs data.karpathy_json=<path to the split JSON>")
    path = Path(karpathy_json)
    if not path.is_file():
        raise ConfigError(f"data.karpathy_json={karpathy_json} does not exist; give the split JSON")
    images = Path(image_root) if image_root else path.parent / "images"
    splits = {s: karpathy.load_karpathy(path, s, image_root=images) for s in SPLITS}
    coco = splits["test"].num_images == 5000
    return DatasetSource(
        path.parent, splits, regions_dir=Path(precomp_dir) if precomp_dir else None,
        entities_dir=Path(entities_dir) if entities_dir else None,
        protocols=("full", "coco_5fold_1k") if coco else ("full",),
    )


@DATASETS.register("precomp")
def precomp_folder(*, precomp_dir: str, entities_dir: str, workspace: Workspace) -> DatasetSource:
    """A SCAN/BUTD precomputed folder (``{split}_ims.npy``, ``{split}_caps.txt``, ids), with a
    Flickr30K Entities folder for grounding when ``data.entities_dir`` names one."""
    if not precomp_dir:
        raise ConfigError("data.dataset=precomp needs data.precomp_dir=<SCAN/BUTD folder>")
    folder = Path(precomp_dir)
    if not folder.is_dir():
        raise ConfigError(f"data.precomp_dir={precomp_dir} is not a folder; give the SCAN/BUTD folder")
    splits = {s: precomp.load_precomp(folder, s).images for s in SPLITS}
    coco = splits["test"].num_images == 5000
    return DatasetSource(folder, splits, regions_dir=folder,
                         entities_dir=Path(entities_dir) if entities_dir else None,
                         protocols=("full", "coco_5fold_1k") if coco else ("full",))


def load_source(config: ExperimentConfig, workspace: Workspace) -> DatasetSource:
    """The :class:`DatasetSource` named by ``config.data.dataset``."""
    data = config.data
    return DATASETS.build(data.dataset, data, workspace=workspace)
