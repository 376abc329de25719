"""Datasets by name (``data.dataset``): where a dataset lives and how its splits load.

Each builder takes the ``data.*`` fields it needs as keyword arguments (and the workspace) and
returns a :class:`DatasetSource`: the loaded splits plus the paths of the assets that come with the
dataset (region features, CxC files, relevance matrices, ground truth for analyses). The data
pipeline (:mod:`icr.data.pipeline`) turns a source into tensors; nothing else knows which dataset
it is. A dataset whose files give analyses something (ground truth, image files) registers it as
``provides=`` (:mod:`icr.context`) and its source hands them out
(:meth:`DatasetSource.capabilities`). A dataset may register ``train_size=``, which reads the size
of its training split from its files without loading them (:func:`training_size`, for
``--plan``). A new dataset is a module with one ``@DATASETS.register(name)`` builder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from icr.config import DataConfig
from icr.context import Capability, ImageFiles, Scenes
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

    def capabilities(self) -> tuple[Capability, ...]:
        """What comes with the dataset's files for analyses: its ground truth (:class:`Scenes`)
        and its image folder (:class:`ImageFiles`), when present."""
        found: list[Capability] = []
        if self.ground_truth is not None:
            found.append(Scenes(self.root))
        if (self.root / "images").is_dir():
            found.append(ImageFiles(self.root / "images"))
        return tuple(found)


def _existing(path: Path) -> Path | None:
    return path if path.exists() else None


def _karpathy_size(path: Path) -> tuple[int, int]:
    """(captions, images) of the training split of a Karpathy split JSON."""
    train = karpathy.load_karpathy(path, "train", image_root=path.parent)
    return train.num_captions, train.num_images


SHAPES_SPLITS = "dataset_shapes.json"  # the embedded benchmark's Karpathy split JSON


def shapes_folder(*, preset: str, seed: int, root: str, workspace: Workspace) -> Path:
    """Where the embedded benchmark of ``preset`` and ``seed`` lives: ``data.root``, else
    ``<workspace>/data/shapes-<preset>-<seed>``."""
    return Path(root) if root else workspace.data / f"shapes-{preset}-{seed}"


def _shapes_size(data: DataConfig, workspace: Workspace) -> tuple[int, int]:
    """The benchmark's training split as generated, or as its preset will generate it."""
    folder = shapes_folder(preset=data.preset, seed=data.seed, root=data.root, workspace=workspace)
    if (folder / SHAPES_SPLITS).is_file():
        return _karpathy_size(folder / SHAPES_SPLITS)
    # lazy: keeps the benchmark's generator (PIL, its renderer) off the command line's start
    from icr.data.synthetic import PRESETS

    sizes = PRESETS[data.preset]
    return sizes.train * sizes.captions_per_image, sizes.train


@DATASETS.register("shapes", provides=(Scenes, ImageFiles), train_size=_shapes_size)
def shapes(*, preset: str, seed: int, root: str, workspace: Workspace) -> DatasetSource:
    """The embedded benchmark, generated into the workspace on first use."""
    # lazy: keeps the benchmark's generator (PIL, its renderer) off the command line's start
    from icr.data.synthetic import ensure_benchmark

    folder = ensure_benchmark(
        shapes_folder(preset=preset, seed=seed, root=root, workspace=workspace), preset, seed
    )
    image_root = folder / "images"
    splits = {s: karpathy.load_karpathy(folder / SHAPES_SPLITS, s, image_root=image_root)
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


def _karpathy_json_size(data: DataConfig, workspace: Workspace) -> tuple[int, int] | None:
    path = Path(data.karpathy_json)
    return _karpathy_size(path) if data.karpathy_json and path.is_file() else None


@DATASETS.register("karpathy", train_size=_karpathy_json_size)
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


def _precomp_size(data: DataConfig, workspace: Workspace) -> tuple[int, int] | None:
    """Counted from ``train_caps.txt``: SCAN's precomputed folders hold 5 captions an image."""
    caps = Path(data.precomp_dir) / "train_caps.txt"
    if not data.precomp_dir or not caps.is_file():
        return None
    with caps.open(encoding="utf-8") as f:
        captions = sum(1 for line in f if line.strip())
    return captions, captions // 5


@DATASETS.register("precomp", train_size=_precomp_size)
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


def training_size(config: ExperimentConfig, workspace: Workspace) -> tuple[int, int] | None:
    """(training captions, training images) of the dataset ``config.data`` names, read from its
    files without loading or generating it (the embedded benchmark not yet generated: the sizes
    its preset will give); ``None`` when its files are absent or it registered no
    ``train_size=`` (``(data section, workspace) -> (captions, images) | None``). What ``--plan``
    counts the steps of an epoch with, so the platform never opens a dataset's files itself."""
    size = DATASETS.meta(config.data.dataset).get("train_size")
    return None if size is None else size(config.data, workspace)
