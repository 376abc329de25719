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

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from icr.config import DataConfig, is_uri
from icr.context import Capability, ImageFiles, Scenes
from icr.data import karpathy, precomp, remote
from icr.data.types import CaptionedImages
from icr.errors import ConfigError
from icr.registry import Registry
from icr.workspace import Workspace

if TYPE_CHECKING:
    from icr.config import ExperimentConfig

SPLITS = precomp.ROLES  # what a run reads, in evaluation order, whatever the files call them
# Karpathy's COCO sizes: a folder whose validation or training split is this large is COCO's
COCO_VAL_IMAGES, COCO_TRAIN_IMAGES = 5000, 100_000
# COCO's test as papers report it (icr.metrics.protocols evaluates the protocols by these names):
# its 5,000 images in full (5K) and as the mean over 5 folds of 1,000 (1K)
COCO_TEST_IMAGES, FOLDS, FOLD_SIZE = 5000, 5, 1000
PROTOCOLS_5K = ("full", "coco_5fold_1k")

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
        protocols: the evaluation protocols its test split is reported with
            (:mod:`icr.metrics.protocols`).
        fold_size: images per fold of ``coco_5fold_1k``: 1,000 on COCO's 5,000 test images, a
            fifth of a scaled-down COCO-layout test split.
        region_splits: per role (``train``, ``val``, ``test``), the split name of the region
            feature files in ``regions_dir`` (SCAN's ``dev``, ``testall``).
        notes: what was chosen and why, one line each: which files serve each role, which
            protocols the test split gets and which it cannot give (printed at preparation and
            by ``--plan``).
    """

    root: Path
    splits: dict[str, CaptionedImages]
    regions_dir: Path | None = None
    cxc: dict[str, Path | None] = field(default_factory=dict)
    relevance: dict[str, dict[str, Path]] = field(default_factory=dict)
    ground_truth: Path | None = None
    entities_dir: Path | None = None
    protocols: tuple[str, ...] = ("full",)
    fold_size: int = FOLD_SIZE
    region_splits: dict[str, str] = field(default_factory=lambda: {s: s for s in SPLITS})
    notes: tuple[str, ...] = ()

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
    sizes = ", ".join(f"{s} {splits[s].num_images:,} images" for s in SPLITS)
    return DatasetSource(
        folder, splits, regions_dir=folder / "precomp",
        cxc={s: _existing(folder / "cxc" / f"sits_{s}.csv") for s in ("val", "test")},
        relevance=relevance, ground_truth=_existing(folder / "scenes.json"),
        entities_dir=_existing(folder / "entities"),
        notes=(f"data: the embedded benchmark {folder}: {sizes}; test reported in full",),
    )


def regions_folder(precomp_dir: str, workspace: Workspace) -> tuple[Path, tuple[str, ...]]:
    """The folder ``data.precomp_dir`` names, a URI's local copy on this node brought up to
    date (:mod:`icr.data.remote`), and the line that says where it came from (none for a
    local folder)."""
    if not is_uri(precomp_dir):
        return Path(precomp_dir), ()
    copy = remote.fetch(precomp_dir, workspace.cache)
    return copy.folder, (copy.describe(),)


def _karpathy_json_size(data: DataConfig, workspace: Workspace) -> tuple[int, int] | None:
    path = Path(data.karpathy_json)
    return _karpathy_size(path) if data.karpathy_json and path.is_file() else None


@DATASETS.register("karpathy", train_size=_karpathy_json_size)
def karpathy_json(
    *, karpathy_json: str, image_root: str, features: str, precomp_dir: str, splits: str,
    entities_dir: str, workspace: Workspace,
) -> DatasetSource:
    """A Karpathy split JSON (COCO, Flickr30k) with its image folder (and optional regions: a
    SCAN/BUTD folder, its splits chosen as for ``data.dataset=precomp`` when the image encoder
    reads them, ``data.features=regions``)."""
    if not karpathy_json:
        raise ConfigError("data.dataset=karpathy needs data.karpathy_json=<path to the split JSON>")
    path = Path(karpathy_json)
    if not path.is_file():
        raise ConfigError(f"data.karpathy_json={karpathy_json} does not exist; give the split JSON")
    images = Path(image_root) if image_root else path.parent / "images"
    loaded = {s: karpathy.load_karpathy(path, s, image_root=images) for s in SPLITS}
    sizes = ", ".join(f"{s} {loaded[s].num_images:,} images" for s in SPLITS)
    notes = [f"data: {path.name}: {sizes} (restval in train)"]
    protocols, fold_size, note = reporting_protocols(loaded, "test", coco_like(loaded))
    notes.append(note)
    regions = None
    if precomp_dir:
        regions, copied = regions_folder(precomp_dir, workspace)
        notes.extend(copied)
    region_splits = {s: s for s in SPLITS}
    if regions is not None and features == "regions":
        region_splits = precomp.choose_splits(regions, splits)
        notes.append(f"data: region features from {regions}: "
                     + ", ".join(f"{s} {region_splits[s]}_ims.npy" for s in SPLITS))
    return DatasetSource(
        path.parent, loaded, regions_dir=regions,
        entities_dir=Path(entities_dir) if entities_dir else None,
        protocols=protocols, fold_size=fold_size, region_splits=region_splits, notes=tuple(notes),
    )


def _precomp_size(data: DataConfig, workspace: Workspace) -> tuple[int, int] | None:
    """Counted from ``train_caps.txt`` (or the file ``data.splits`` names): SCAN's precomputed
    folders hold 5 captions an image."""
    train = precomp.parse_splits(data.splits).get("train", "train")
    if not data.precomp_dir:
        return None
    caps = regions_folder(data.precomp_dir, workspace)[0] / f"{train}_caps.txt"
    if not caps.is_file():
        return None
    with caps.open(encoding="utf-8") as f:
        captions = sum(1 for line in f if line.strip())
    return captions, captions // 5


@DATASETS.register("precomp", train_size=_precomp_size)
def precomp_folder(*, precomp_dir: str, splits: str, entities_dir: str, workspace: Workspace
                   ) -> DatasetSource:
    """A SCAN/BUTD precomputed folder as published (``{split}_ims.npy``, ``{split}_caps.txt``,
    ``{split}_ids.txt``; validation from ``dev``, COCO's test from ``testall``: see
    :func:`icr.data.precomp.choose_splits`), with a Flickr30K Entities folder for grounding when
    ``data.entities_dir`` names one."""
    if not precomp_dir:
        raise ConfigError("data.dataset=precomp needs data.precomp_dir=<SCAN/BUTD folder>")
    folder, copied = regions_folder(precomp_dir, workspace)
    if not folder.is_dir():
        raise ConfigError(f"data.precomp_dir={precomp_dir} is not a folder; give the SCAN/BUTD folder")
    files = precomp.choose_splits(folder, splits)
    loaded = {role: replace(precomp.load_precomp(folder, files[role]).images, split=role)
              for role in SPLITS}
    how = "named by data.splits" if splits != "auto" else "chosen from the files"
    notes = [*copied, f"data: {folder}: " + ", ".join(
        f"{role} from {files[role]}_* ({loaded[role].num_images:,} images)" for role in SPLITS)
        + f" ({how})"]
    protocols, fold_size, note = reporting_protocols(loaded, files["test"], coco_like(loaded))
    notes.append(note)
    held = precomp.folder_splits(folder)
    if "testall" in held and files["test"] != "testall":
        notes.append(f"data: testall_* is in the folder but the test split is {files['test']}: "
                     "COCO's 5K and 5-fold 1K protocols are not given (data.splits=auto reads "
                     "testall)")
    return DatasetSource(folder, loaded, regions_dir=folder,
                         entities_dir=Path(entities_dir) if entities_dir else None,
                         protocols=protocols, fold_size=fold_size, region_splits=files,
                         notes=tuple(notes))


def coco_like(splits: dict[str, CaptionedImages]) -> bool:
    """The splits are COCO's by their size: Karpathy's COCO validation split has 5,000 images and
    its training split over 100,000 (Flickr30K: 1,014 and 29,000)."""
    return (splits["val"].num_images == COCO_VAL_IMAGES
            or splits["train"].num_images >= COCO_TRAIN_IMAGES)


def reporting_protocols(splits: dict[str, CaptionedImages], test_file: str, coco: bool
                   ) -> tuple[tuple[str, ...], int, str]:
    """How the test split is reported: (protocols, images per fold, the line that says so).

    COCO's test (``testall``, or any test split of 5,000 images) is reported on the full 5K and
    as the mean over 5 folds of 1,000 (``coco_5fold_1k``, keys ``1k_*``). A ``testall`` of
    another size is a scaled-down COCO layout (a fixture): its 5 folds hold a fifth of it each,
    and the line says its ``1k_`` values are not comparable with published 1K numbers. A
    COCO-sized folder (:func:`coco_like`) whose test is not its 5,000 images gets a line saying
    which protocols it cannot give. Everything else (Flickr30K's 1,000) is reported in full.
    """
    n = splits["test"].num_images
    where = f"test from {test_file}_* ({n:,} images)"
    if test_file == "testall" or n == COCO_TEST_IMAGES:
        if n % FOLDS:
            return ("full",), FOLD_SIZE, (f"data: {where}: reported in full; {n:,} images do not "
                                          f"split into {FOLDS} equal folds, so no 1k_ metrics")
        fold = n // FOLDS
        if fold == FOLD_SIZE:
            return PROTOCOLS_5K, fold, (f"data: {where}: COCO 5K, and COCO 1K as the mean over "
                                        f"{FOLDS} folds of {fold:,} images (1k_ metrics)")
        return PROTOCOLS_5K, fold, (
            f"data: {where}: in full, and over {FOLDS} folds of {fold:,} images (COCO's 5-fold 1K "
            f"protocol scaled down from folds of {FOLD_SIZE:,}: its 1k_ metrics are not "
            "comparable with published 1K numbers)")
    if coco:
        return ("full",), FOLD_SIZE, (
            f"data: {where}, but the other splits are COCO's: COCO's 5K and 5-fold 1K protocols "
            f"cannot be given without its {COCO_TEST_IMAGES:,} test images (SCAN's coco_precomp "
            "ships them as testall_*); reported in full only")
    return ("full",), FOLD_SIZE, f"data: {where}: reported in full, as Flickr30K's 1K test is"


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
