"""Generate the shapes-world benchmark and write it in the real datasets' formats.

Layout of a generated folder::

    MANIFEST.json            preset, seed, counts, generator version, fingerprint of every file
    dataset_shapes.json      Karpathy split JSON (images/shapes_{imgid:06d}.png, 5 captions each)
    images/*.png
    precomp/{split}_ims.npy  (N, R, D) float32 region features (the detector's, from pixels),
            {split}_boxes.npy, {split}_caps.txt, {split}_ids.txt (image file names)
    entities/Sentences/<stem>.txt, entities/Annotations/<stem>.xml, entities/{split}.txt
    cxc/sits_{val,test}.csv  captions true of *other* images of the split (agg_score 5.0)
    relevance/semantic_{val,test}.npy
                             (N_cap, N_img) float32 SPICE-like nDCG relevance from the captions'
                             meanings (:mod:`.relevance`), rows and columns in the split's order
    scenes.json              per image: the scene (all attributes, boxes), the region owners and,
                             per caption, its meaning and which attributes of which objects it states

Every random choice is drawn from streams derived from ``(seed, imgid)``, files carry no timestamps
and JSON keys are sorted, so a preset and a seed give byte-identical files, on any CPU: the region
features come from the preset's detector, shipped with the package, in exact integer arithmetic
(:mod:`.extractor`), and every other number is computed by numpy's IEEE basic operations or
from values far from a rounding boundary (docs/embedded-benchmark.md, "The same files on every
CPU"). The folder appears only when complete: everything is written to a hidden temporary
sibling that is renamed at the end. Each worker renders its blocks of images and computes their
features.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import tempfile
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from icr.data.cxc import write_cxc_sits
from icr.data.entities import (
    EntityAnnotation,
    EntitySentence,
    Phrase,
    write_annotation,
    write_sentences,
    write_split_ids,
)
from icr.data.karpathy import write_karpathy_json
from icr.data.precomp import write_precomp
from icr.data.relevance import save_relevance
from icr.data.synthetic.detector import DETECTORS, one_thread
from icr.data.synthetic.extractor import ExactExtractor, shipped
from icr.data.synthetic.grammar import BACKGROUND_KEY, Caption, Specificity, sample_captions
from icr.data.synthetic.regions import region_boxes
from icr.data.synthetic.relevance import caption_relevance
from icr.data.synthetic.render import render_scene
from icr.data.synthetic.semantics import TruthTable
from icr.data.synthetic.world import Scene, sample_scene
from icr.errors import DataError

logger = logging.getLogger(__name__)

# shapes-2: adds relevance/; every other file is as in shapes-1 (but for this version string)
# shapes-3: calibrated to COCO (benchmarks/benchmark_realism.py): 3-8 objects at 96 x 96, a larger
#   lexicon with synonyms and hypernyms, specific captions, 36 BUTD-like regions, background hues
# shapes-4: region features from a detector trained to classify the boxes' objects and attributes
#   (detector.py) instead of a fixed random extractor; images, captions, boxes and every other file
#   as in shapes-3; the manifest describes the detector
# shapes-5: the same images, captions, boxes and every other file; the region features computed in
#   integers from the detector trained for shapes-4 on the development machine (x86-64 AVX-512,
#   torch 2.14.1), quantised and shipped with the package (extractor.py), so that every CPU and
#   torch release writes the same bytes; the manifest names the shipped weights, not a torch version
GENERATOR_VERSION = "shapes-5"
DATASET_NAME = "shapes"
SPLITS = ("train", "val", "test")
CXC_PREFIX = "shapes"
RELEVANCE_DIR = "relevance"
CHAINS_PER_IMAGE = 512  # chain id = imgid * 512 + key, key in 1..256 (grammar chain keys)
REFERENCE_SCENES = 2000  # scenes the specificity of captions is decided against
_BLOCK = 250  # images per work unit


@dataclass(frozen=True)
class Preset:
    """Size and shape of a generated benchmark."""

    name: str
    train: int
    val: int
    test: int
    image_size: int = 96
    regions: int = 36  # R: boxes per image in the precomputed features (BUTD: 36)
    captions_per_image: int = 5
    detector: str = "default"  # what computes the region features (:data:`.detector.DETECTORS`)

    @property
    def feature_dim(self) -> int:
        """``D``: the detector's feature size."""
        return DETECTORS[self.detector].feature_dim

    def count(self, split: str) -> int:
        return getattr(self, split)


PRESETS = {
    "tiny": Preset("tiny", 40, 12, 12, detector="tiny"),
    "small": Preset("small", 600, 100, 100),
    "default": Preset("default", 4000, 500, 500),
    # the default's images and captions with BUTD's 2048-d features, for GPU runs (1.5 GB)
    "default-2048": Preset("default-2048", 4000, 500, 500, detector="default-2048"),
    # four times the default's training images (its first 4,000 are the default's), the same
    # number of validation and test images: how much a model learns from more data (GPU runs)
    "large": Preset("large", 16000, 500, 500),
    # twelve times the default's training images (42 % of COCO's 113,287), the same first 16,000
    # as large: where the learning curve goes with data (GPU runs; about 3 min with 12 workers)
    "xlarge": Preset("xlarge", 48000, 500, 500),
}


@dataclass
class GeneratedImage:
    """Everything generated for one image before it is written."""

    imgid: int
    split: str
    scene: Scene
    pixels: np.ndarray  # (H, W, 3) uint8
    object_boxes: tuple[tuple[float, float, float, float], ...]
    captions: list[Caption]
    region_boxes: np.ndarray  # (R, 4)
    region_owner: np.ndarray  # (R,)
    features: np.ndarray | None = None  # (R, D) once computed

    @property
    def filename(self) -> str:
        return f"shapes_{self.imgid:06d}.png"

    @property
    def stem(self) -> str:
        return self.filename.rsplit(".", 1)[0]

    def sentid(self, k: int) -> int:
        return self.imgid * len(self.captions) + k

    def chain(self, key: int) -> int:
        return self.imgid * CHAINS_PER_IMAGE + key


def get_preset(name: str) -> Preset:
    if name not in PRESETS:
        raise DataError(f"unknown shapes preset {name!r}; valid: {', '.join(PRESETS)}")
    return PRESETS[name]


@functools.lru_cache(maxsize=2)
def reference_specificity(seed: int, image_size: int) -> Specificity:
    """The reference scenes captions are made specific against (:mod:`.grammar`, step 2): drawn
    from the world's distribution with a stream of ``seed`` that no image uses."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, 2**32 - 1]))
    return Specificity([sample_scene(rng, size=image_size) for _ in range(REFERENCE_SCENES)])


def generate_image(seed: int, imgid: int, split: str, preset: Preset) -> GeneratedImage:
    """One image from independent streams (scene, pixels, captions, regions) of ``(seed, imgid)``."""
    streams = [np.random.default_rng(s) for s in np.random.SeedSequence([seed, imgid]).spawn(4)]
    scene = sample_scene(streams[0], size=preset.image_size)
    rendering = render_scene(scene, streams[1])
    captions = sample_captions(scene, streams[2], k=preset.captions_per_image,
                               specificity=reference_specificity(seed, preset.image_size))
    boxes, owner = region_boxes(list(rendering.boxes), preset.image_size, preset.regions, streams[3])
    return GeneratedImage(imgid, split, scene, rendering.pixels, rendering.boxes, captions, boxes, owner)


def _image_plan(preset: Preset) -> list[tuple[int, str]]:
    """``(imgid, split)`` of every image: train first, then val, then test."""
    return [(i, split) for i, split in enumerate(s for s in SPLITS for _ in range(preset.count(s)))]


def _generate_block(folder: Path, seed: int, preset: Preset, items: list[tuple[int, str]]
                    ) -> list[GeneratedImage]:
    """Generate a block of images, write their per-image files (PNG, entities) and compute their
    region features (one thread: the workers are processes).

    Runs in a worker process for large presets; its output does not depend on how images are
    split into blocks (per-image random streams, integer features).
    """
    images = [generate_image(seed, imgid, split, preset) for imgid, split in items]
    for im in images:
        Image.fromarray(im.pixels).save(folder / "images" / im.filename, format="PNG",
                                        compress_level=6)
        _write_entity_files(folder / "entities", im)
    with one_thread():
        features = shipped(preset.detector).features(  # (B, R, D)
            np.stack([im.pixels for im in images]), np.stack([im.region_boxes for im in images]))
    for im, feature in zip(images, features, strict=True):
        im.features = feature
        im.pixels = np.empty((0, 0, 3), dtype=np.uint8)  # written; not needed any more
    return images


class _InProcess(Executor):
    """An executor that runs each call at once, in this process (``workers=1``)."""

    def submit(self, fn, /, *args, **kwargs):  # noqa: ANN001, ANN201 - Executor's signature
        future: Future = Future()
        future.set_result(fn(*args, **kwargs))
        return future


def _executor(workers: int) -> Executor:
    if workers > 1:
        # spawn: safe whatever the caller imported (threads, CUDA)
        return ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
    return _InProcess()


def _generate_all(folder: Path, preset: Preset, seed: int, workers: int
                  ) -> dict[str, list[GeneratedImage]]:
    """Every image with its region features, split by split, generated in blocks by ``workers``."""
    (folder / "images").mkdir(parents=True)
    plan = _image_plan(preset)
    blocks = [plan[i:i + _BLOCK] for i in range(0, len(plan), _BLOCK)]
    with _executor(workers) as pool:
        jobs = [pool.submit(_generate_block, folder, seed, preset, b) for b in blocks]
        done = [job.result() for job in jobs]
    splits: dict[str, list[GeneratedImage]] = {s: [] for s in SPLITS}
    for im in (im for block in done for im in block):
        splits[im.split].append(im)
    return splits


# ------------------------------------------------------------------------------------ writers


def _write_karpathy(path: Path, splits: dict[str, list[GeneratedImage]]) -> None:
    records = [
        {
            "split": split, "filename": im.filename, "imgid": im.imgid,
            "sentences": [{"raw": c.raw, "sentid": im.sentid(k)} for k, c in enumerate(im.captions)],
        }
        for split in SPLITS for im in splits[split]
    ]
    write_karpathy_json(path, DATASET_NAME, records)


def _write_precomp(folder: Path, split: str, images: list[GeneratedImage]) -> None:
    features = np.stack([im.features for im in images])  # (N, R, D)
    boxes = np.stack([im.region_boxes for im in images])  # (N, R, 4)
    captions = [c.raw for im in images for c in im.captions]
    write_precomp(folder, split, features, boxes, captions, [im.filename for im in images])


def _entity_sentence(caption: Caption, image: GeneratedImage) -> EntitySentence:
    phrases = tuple(
        Phrase(start, " ".join(caption.tokens[start:end]), image.chain(key), (kind,))
        for start, end, key, kind in caption.phrases
    )
    return EntitySentence(" ".join(caption.tokens), phrases)


def _inclusive_box(box: tuple[float, float, float, float]) -> tuple[int, int, int, int]:
    """Float xyxy (right/bottom exclusive) -> 0-based inclusive pixel box, as the loader returns."""
    x0, y0, x1, y1 = box
    return (int(np.floor(x0)), int(np.floor(y0)), int(np.ceil(x1)) - 1, int(np.ceil(y1)) - 1)


def _entity_annotation(image: GeneratedImage) -> EntityAnnotation:
    keys = {1 << k for k in range(len(image.scene.objects))}  # every object has its own chain
    keys |= {key for c in image.captions for _, _, key, _ in c.phrases if key != BACKGROUND_KEY}
    boxes = {
        image.chain(key): [_inclusive_box(b) for k, b in enumerate(image.object_boxes) if key >> k & 1]
        for key in sorted(keys)
    }
    size = image.scene.size
    return EntityAnnotation(size, size, 3, boxes,
                            scene_chains=frozenset({image.chain(BACKGROUND_KEY)}))


def _write_entity_files(folder: Path, im: GeneratedImage) -> None:
    write_sentences(folder / "Sentences" / f"{im.stem}.txt",
                    [_entity_sentence(c, im) for c in im.captions])
    write_annotation(folder / "Annotations" / f"{im.stem}.xml", _entity_annotation(im))


def extended_positive_pairs(images: list[GeneratedImage]) -> list[tuple[int, str]]:
    """``(sentid, image file name)`` for every caption and every *other* image it is true of."""
    table = TruthTable([im.scene for im in images])
    pairs = []
    for i, im in enumerate(images):
        for k, caption in enumerate(im.captions):
            truth = table.holds(caption.meaning)  # (N,)
            if not truth[i]:
                raise AssertionError(f"caption {caption.raw!r} is false of its own image")  # a bug
            pairs += [(im.sentid(k), images[j].filename) for j in np.flatnonzero(truth) if j != i]
    return pairs


def _write_cxc(folder: Path, splits: dict[str, list[GeneratedImage]]) -> dict[str, int]:
    counts = {}
    for split in ("val", "test"):
        pairs = extended_positive_pairs(splits[split])
        rows = [(sentid, name, 5.0, "c2i_scene") for sentid, name in pairs]
        write_cxc_sits(folder / f"sits_{split}.csv", rows, prefix=CXC_PREFIX)
        counts[split] = len(rows)
    return counts


def _write_relevance(folder: Path, splits: dict[str, list[GeneratedImage]]) -> dict[str, str]:
    """Semantic relevance of each evaluation split; returns split -> path relative to the root."""
    files = {}
    for split in ("val", "test"):
        images = splits[split]
        matrix = caption_relevance(  # (N_cap, N_img), the Karpathy JSON's order
            [c.meaning for im in images for c in im.captions],
            [[c.meaning for c in im.captions] for im in images],
        )
        files[split] = f"{RELEVANCE_DIR}/semantic_{split}.npy"
        save_relevance(folder / files[split], matrix)
    return files


def _scene_record(im: GeneratedImage) -> dict:
    scene = im.scene.to_json()
    for obj, box in zip(scene["objects"], im.object_boxes, strict=True):
        obj["bbox"] = [round(v, 3) for v in box]  # tight box of the drawn pixels
    captions = [
        {
            "sentid": im.sentid(k), "raw": c.raw, "meaning": c.meaning,
            "mentions": [{"object": o, "attributes": sorted(a)} for o, a in sorted(c.mentions.items())],
            "phrases": [{"first_word_index": s, "end": e, "chain_id": im.chain(key), "type": kind}
                        for s, e, key, kind in c.phrases],
        }
        for k, c in enumerate(im.captions)
    ]
    return {"imgid": im.imgid, "filename": im.filename, "split": im.split, "scene": scene,
            "region_owner": im.region_owner.tolist(), "captions": captions}


def _write_json(path: Path, data: object, indent: int | None = None) -> None:
    path.write_text(json.dumps(data, sort_keys=True, indent=indent) + "\n", encoding="utf-8")


def fingerprint(folder: Path) -> str:
    """SHA-256 over every file's relative path and content, MANIFEST.json excluded."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != "MANIFEST.json"):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(path.read_bytes()).digest())
    return h.hexdigest()


def write_benchmark(folder: Path, preset: Preset, seed: int, workers: int = 1) -> dict:
    """Generate and write everything into ``folder`` (not atomic; see :func:`generate`)."""
    detector: ExactExtractor = shipped(preset.detector)  # a missing or damaged file stops here
    splits = _generate_all(folder, preset, seed, workers)
    for split in SPLITS:
        write_split_ids(folder / "entities" / f"{split}.txt", [im.stem for im in splits[split]])
        _write_precomp(folder / "precomp", split, splits[split])
    _write_karpathy(folder / "dataset_shapes.json", splits)
    cxc_counts = _write_cxc(folder / "cxc", splits)
    relevance = _write_relevance(folder, splits)
    every = [im for s in SPLITS for im in splits[s]]
    _write_json(folder / "scenes.json", {"generator_version": GENERATOR_VERSION,
                                         "images": [_scene_record(im) for im in every]})
    manifest = {
        "generator_version": GENERATOR_VERSION, "preset": preset.name, "seed": seed,
        "image_size": preset.image_size, "regions": preset.regions,
        "feature_dim": preset.feature_dim, "captions_per_image": preset.captions_per_image,
        "counts": {s: {"images": len(splits[s]),
                       "captions": len(splits[s]) * preset.captions_per_image,
                       **({"cxc_pairs": cxc_counts[s]} if s in cxc_counts else {})} for s in SPLITS},
        "relevance": {"semantic": relevance},
        "detector": detector.describe(),
        "fingerprint": fingerprint(folder),
    }
    _write_json(folder / "MANIFEST.json", manifest, indent=1)
    return manifest


# ------------------------------------------------------------------------------------ public API


def read_manifest(folder: str | Path) -> dict | None:
    """The folder's ``MANIFEST.json``, or ``None`` when there is none."""
    path = Path(folder) / "MANIFEST.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        raise DataError(f"{path}: malformed manifest; delete {path.parent} to regenerate it") from None


def load_scenes(root: str | Path) -> dict[str, dict]:
    """``scenes.json`` of a generated folder: image file name -> its record (see module docstring).

    ``Scene.from_json(record["scene"])`` rebuilds the scene for :func:`~.semantics.holds`.
    """
    path = Path(root) / "scenes.json"
    if not path.is_file():
        raise DataError(f"{path}: not found; is {root} a shapes benchmark folder?")
    return {r["filename"]: r for r in json.loads(path.read_text(encoding="utf-8"))["images"]}


def generate(
    out_dir: str | Path,
    preset: str = "default",
    seed: int = 0,
    overwrite: bool = False,
    workers: int | None = None,
) -> Path:
    """Generate the benchmark into ``out_dir`` atomically and return ``out_dir``.

    The files are written to a hidden temporary folder beside ``out_dir`` that is renamed to
    ``out_dir`` only when complete; on any error (or interrupt) it is removed, so ``out_dir``
    either holds a whole dataset or does not exist.

    Args:
        out_dir: the dataset folder to create.
        preset: ``tiny``, ``small`` or ``default`` (see :data:`PRESETS`).
        seed: the generation seed; equal seeds give byte-identical files.
        overwrite: replace an existing ``out_dir`` (atomically, once the new one is complete).
        workers: processes for image generation (``None``: up to 2, by CPU count); the files do
            not depend on it.

    Raises:
        DataError: unknown preset, ``out_dir`` exists and is not empty (and not ``overwrite``),
            or the preset's shipped detector is missing or damaged.
    """
    spec = get_preset(preset)
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise DataError(f"{out}: folder exists and is not empty; delete it or choose another folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)
        if workers is None:
            workers = min(2, os.cpu_count() or 1)
        manifest = write_benchmark(tmp, spec, seed, workers)
        _replace(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote shapes benchmark %s (preset %s, seed %d): %s", out, preset, seed,
                manifest["counts"])
    return out


def _replace(tmp: Path, out: Path, overwrite: bool) -> None:
    """Rename ``tmp`` to ``out``; without ``overwrite`` this fails if ``out`` has files by now."""
    if overwrite and out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / "data")
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)  # an empty ``out`` is replaced, a non-empty one raises OSError


def _version_number(version: object) -> int | None:
    """``"shapes-<n>"`` -> ``n``; ``None`` for anything else."""
    prefix = "shapes-"
    if isinstance(version, str) and version.startswith(prefix) and version[len(prefix):].isdigit():
        return int(version[len(prefix):])
    return None


def _is_older(manifest: dict, preset: str, seed: int) -> bool:
    """Whether ``manifest`` is of the same preset and seed, written by an older generator."""
    found = _version_number(manifest.get("generator_version"))
    current = _version_number(GENERATOR_VERSION)
    same = manifest.get("preset") == preset and manifest.get("seed") == seed
    return same and found is not None and current is not None and found < current


def _remove_stale(root: Path) -> None:
    """Rename a stale benchmark folder out of the way (atomically), then delete it.

    Of several processes doing this at once, one renames the folder and the others find it gone.
    A process that finds it renamed a current benchmark (regenerated by another process since it
    read the manifest) puts it back.
    """
    aside = Path(tempfile.mkdtemp(prefix=f".{root.name}.stale-", dir=root.parent))
    try:
        try:
            os.rename(root, aside / "data")
        except FileNotFoundError:
            return
        try:
            moved = read_manifest(aside / "data") or {}
        except DataError:
            moved = {}
        if moved.get("generator_version") == GENERATOR_VERSION:
            with contextlib.suppress(OSError):
                os.rename(aside / "data", root)
    finally:
        shutil.rmtree(aside, ignore_errors=True)


def ensure_benchmark(root: str | Path, preset: str = "default", seed: int = 0) -> Path:
    """Return the benchmark folder ``root``, generating it first if it does not exist yet.

    A complete folder (one with a ``MANIFEST.json`` of the same preset, seed and generator version)
    is reused as is; one of the same preset and seed written by an older generator version is
    deleted and generated again. Another process generating or upgrading the same folder at the
    same time is harmless.

    Raises:
        DataError: ``root`` holds something else (another preset or seed, a newer or unknown
            version, or no manifest).
    """
    root = Path(root)
    get_preset(preset)
    wanted = {"preset": preset, "seed": seed, "generator_version": GENERATOR_VERSION}

    def check(manifest: dict) -> Path:
        found = {k: manifest.get(k) for k in wanted}
        if found != wanted:
            raise DataError(f"{root}: holds a shapes benchmark with {found}, not {wanted}; delete "
                            "it or set data.root to another folder")
        return root

    manifest = read_manifest(root)
    if manifest is not None and _is_older(manifest, preset, seed):
        logger.warning("%s: shapes benchmark of generator version %s; generating version %s",
                       root, manifest.get("generator_version"), GENERATOR_VERSION)
        _remove_stale(root)
        manifest = read_manifest(root)
    if manifest is not None:
        return check(manifest)
    if root.exists() and any(root.iterdir()):
        raise DataError(f"{root}: exists but has no MANIFEST.json (an incomplete or foreign folder); "
                        "delete it to regenerate the benchmark")
    try:
        return generate(root, preset, seed)
    except OSError:
        manifest = read_manifest(root)  # another process won the race
        if manifest is None:
            raise
        return check(manifest)
