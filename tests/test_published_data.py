"""The data as labs download it: SCAN's precomputed folders (``dev``, ``testall``) read without
renaming, every choice stated, COCO's test reported as 5K and as the mean of five 1K folds, and
``--plan`` checking every file a run will read."""

from __future__ import annotations

import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from published import write_scan_coco, write_scan_f30k

from icr.config import from_flat
from icr.data import entities, karpathy, precomp
from icr.data.datasets import load_source, reporting_protocols
from icr.data.pipeline import image_inputs
from icr.data.types import CaptionedImages
from icr.errors import ConfigError, DataError
from icr.metrics.retrieval import retrieval_metrics
from icr.train.evaluation import split_metrics
from icr.train.retrieval_data import check_data
from icr.train.tasks import check_data as check_task_data
from studies.run import main

ROOT = Path(__file__).resolve().parent.parent
CXC = Path(__file__).resolve().parent / "fixtures" / "cxc"  # real CxC rows (README: source, licence)


def precomp_config(folder, **extra):
    return from_flat({"data.dataset": "precomp", "data.precomp_dir": str(folder),
                      "data.features": "regions", "image.encoder": "regions", **extra})


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    return write_scan_coco(tmp_path_factory.mktemp("coco_precomp"), fold_images=4)


@pytest.fixture(scope="module")
def f30k(tmp_path_factory):
    return write_scan_f30k(tmp_path_factory.mktemp("f30k_precomp"))


def test_scan_coco_folder_reads_dev_and_testall(coco, workspace):
    source = load_source(precomp_config(coco), workspace)
    assert source.region_splits == {"train": "train", "val": "dev", "test": "testall"}
    assert [source.splits[s].num_images for s in ("train", "val", "test")] == [40, 10, 20]
    assert {s.split for s in source.splits.values()} == {"train", "val", "test"}  # roles
    assert source.protocols == ("full", "coco_5fold_1k") and source.fold_size == 4
    notes = "\n".join(source.notes)
    assert "val from dev_*" in notes and "test from testall_* (20 images)" in notes
    assert "5 folds of 4 images" in notes and "not comparable" in notes


def test_data_splits_names_the_files(coco, workspace):
    source = load_source(precomp_config(coco, **{"data.splits": "test=test"}), workspace)
    assert source.region_splits["test"] == "test" and source.splits["test"].num_images == 4
    assert source.protocols == ("full",)
    assert any("testall_* is in the folder" in n for n in source.notes)
    with pytest.raises(ConfigError, match="data.splits"):
        precomp_config(coco, **{"data.splits": "valid=dev"})


def test_project_names_still_work(tmp_path, workspace):
    rng = np.random.default_rng(0)
    for split, n in (("train", 10), ("val", 3), ("test", 3)):
        precomp.write_precomp(tmp_path, split, rng.standard_normal((n, 2, 4)), None,
                              [f"caption {i}" for i in range(5 * n)], [f"im{split}{i}" for i in range(n)])
    source = load_source(precomp_config(tmp_path), workspace)
    assert source.region_splits == {"train": "train", "val": "val", "test": "test"}
    assert source.protocols == ("full",)


def test_f30k_repeated_training_rows_and_1k_test(f30k, workspace):
    source = load_source(precomp_config(f30k), workspace)
    assert source.region_splits == {"train": "train", "val": "dev", "test": "test"}
    assert source.splits["train"].num_images == 40  # 200 rows stored, one per caption
    assert source.protocols == ("full",)
    assert any("reported in full" in n for n in source.notes)


def _split(n: int, role: str) -> CaptionedImages:
    return CaptionedImages(role, tuple(map(str, range(n))), ("c",) * 5 * n, tuple(range(5 * n)),
                           np.repeat(np.arange(n), 5))


@pytest.mark.parametrize("test, file, val, train, expected, says", [
    (5000, "testall", 5000, 113_287, ("full", "coco_5fold_1k"), "COCO 5K, and COCO 1K"),
    (5000, "test", 5000, 113_287, ("full", "coco_5fold_1k"), "folds of 1,000"),
    (1000, "test", 5000, 113_287, ("full",), "cannot be given"),
    (1000, "test", 1014, 29_000, ("full",), "Flickr30K"),
    (22, "testall", 10, 40, ("full",), "do not split into 5"),
])
def test_protocols_from_what_the_folder_holds(test, file, val, train, expected, says):
    splits = {"train": _split(train, "train"), "val": _split(val, "val"),
              "test": _split(test, "test")}
    coco = val == 5000 or train >= 100_000
    protocols, fold, note = reporting_protocols(splits, file, coco)
    assert protocols == expected and says in note
    if "coco_5fold_1k" in protocols:
        assert fold == test // 5


# -- --plan checks every file -------------------------------------------------------------------


@pytest.mark.parametrize("damage, culprit", [
    ("caps", "dev_caps.txt has 19 captions"),
    ("dtype", "dtype float64, expected float32"),
    ("shape", "expected a 3-d array"),
    ("ids", "image ids are not unique"),
    ("missing", "no val split"),
])
def test_check_data_names_the_file(tmp_path, workspace, damage, culprit):
    folder = write_scan_coco(tmp_path / "coco", fold_images=2, train=12, dev=4)
    dev = folder / "dev_ims.npy"
    if damage == "caps":
        lines = (folder / "dev_caps.txt").read_text(encoding="utf-8").splitlines()[:-1]
        (folder / "dev_caps.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    elif damage == "dtype":
        np.save(dev, np.load(dev).astype(np.float64))
    elif damage == "shape":
        np.save(dev, np.load(dev)[:, 0])
    elif damage == "ids":
        (folder / "dev_ids.txt").write_text("1\n1\n2\n3\n", encoding="utf-8")
    else:
        for path in folder.glob("dev_*"):
            path.unlink()
    with pytest.raises(DataError, match=culprit) as info:
        check_data(precomp_config(folder), workspace)
    assert "\n" not in str(info.value)


def test_check_data_says_what_preparation_chooses(coco, workspace):
    lines = check_data(precomp_config(coco), workspace)
    assert lines == load_source(precomp_config(coco), workspace).notes


# -- COCO 1K: the evaluation reports both protocols -----------------------------------------------


def _prepared(caption_image: np.ndarray, protocols, fold_size: int):
    """What :func:`split_metrics` reads of the prepared data."""
    assets = types.SimpleNamespace(relevance=None, extended_i2t=None, extended_t2i=None)
    split = types.SimpleNamespace(caption_image=caption_image)
    source = types.SimpleNamespace(protocols=protocols, fold_size=fold_size)
    return types.SimpleNamespace(eval_assets={"test": assets, "val": assets},
                                 splits={"test": split, "val": split}, source=source)


def _brute_recall(sims: np.ndarray, caption_image: np.ndarray, k: int) -> tuple[float, float]:
    """R@k both ways by sorting each query's row: i2t a hit when any of the image's captions is
    in its top k, t2i when the caption's image is."""
    i2t = np.mean([any(caption_image[j] == i for j in np.argsort(-sims[i])[:k])
                   for i in range(sims.shape[0])])
    t2i = np.mean([caption_image[j] in np.argsort(-sims[:, j])[:k] for j in range(sims.shape[1])])
    return 100 * i2t, 100 * t2i


def test_test_split_gets_5k_and_the_mean_of_5_folds_by_brute_force():
    gen = torch.Generator().manual_seed(0)
    images, fold = 20, 4
    caption_image = np.repeat(np.arange(images), 5)[np.asarray(torch.randperm(100, generator=gen))]
    img = torch.randn(images, 8, generator=gen)
    cap = img[torch.as_tensor(caption_image)] + 1.2 * torch.randn(100, 8, generator=gen)
    data = _prepared(caption_image, ("full", "coco_5fold_1k"), fold)
    got = split_metrics((img, cap), data, "test")
    sims = (img @ cap.T).numpy()
    for k in (1, 5, 10):
        full = _brute_recall(sims, caption_image, k)
        assert (got[f"i2t_R_at_{k}"], got[f"t2i_R_at_{k}"]) == pytest.approx(full)
        folds = []
        for start in range(0, images, fold):
            cols = np.flatnonzero((caption_image >= start) & (caption_image < start + fold))
            folds.append(_brute_recall(sims[start:start + fold][:, cols],
                                       caption_image[cols] - start, k))
        assert (got[f"1k_i2t_R_at_{k}"], got[f"1k_t2i_R_at_{k}"]) == pytest.approx(
            tuple(np.mean(folds, axis=0)))
    assert got["1k_rsum"] == pytest.approx(sum(got[f"1k_{d}_R_at_{k}"] for d in ("i2t", "t2i")
                                                for k in (1, 5, 10)))
    assert got["1k_fold_images"] == fold
    val = split_metrics((img, cap), data, "val")  # validation: the full split only
    assert not any(k.startswith("1k_") for k in val)


def test_coco_1k_equals_eccv_caption_on_the_real_coco_ids():
    """On COCO's 5K test ground truth (25,000 caption ids, eccv-caption's files), the 1K metrics
    equal eccv-caption's ``coco_1k_recalls`` on the same similarities."""
    eccv = pytest.importorskip("eccv_caption")
    metrics = eccv.Metrics()
    caption_ids = [int(c) for c in metrics.coco_ids]  # (25000,) in the test split's order
    t2i = metrics.coco_gts["t2i"]
    image_ids = list(dict.fromkeys(t2i[c][0] for c in caption_ids))  # (5000,) first seen
    index = {i: n for n, i in enumerate(image_ids)}
    caption_image = np.array([index[t2i[c][0]] for c in caption_ids])
    gen = torch.Generator().manual_seed(0)
    img = torch.randn(len(image_ids), 16, generator=gen)
    cap = img[torch.as_tensor(caption_image)] + 2.0 * torch.randn(len(caption_ids), 16,
                                                                 generator=gen)
    got = split_metrics((img, cap), _prepared(caption_image, ("coco_5fold_1k",), 1000), "test")
    retrieved: dict[str, dict[int, list[int]]] = {"i2t": {}, "t2i": {}}
    for start in range(0, len(image_ids), 1000):  # each fold's top 10 is all eccv looks at
        cols = np.flatnonzero((caption_image >= start) & (caption_image < start + 1000))
        sims = img[start:start + 1000] @ cap[torch.as_tensor(cols)].T  # (1000, 5000)
        for row, top in enumerate(sims.topk(10, dim=1).indices.tolist()):
            retrieved["i2t"][image_ids[start + row]] = [caption_ids[cols[j]] for j in top]
        for col, top in enumerate(sims.T.topk(10, dim=1).indices.tolist()):
            retrieved["t2i"][caption_ids[cols[col]]] = [image_ids[start + i] for i in top]
    for k in (1, 5, 10):
        expected = metrics.coco_1k_recalls(retrieved, "all", K=k)
        assert got[f"1k_i2t_R_at_{k}"] == pytest.approx(100 * expected["i2t"])
        assert got[f"1k_t2i_R_at_{k}"] == pytest.approx(100 * expected["t2i"])
    assert 0 < got["1k_t2i_R_at_1"] < 100  # neither trivial nor hopeless


def test_full_protocol_is_unchanged():
    gen = torch.Generator().manual_seed(1)
    caption_image = np.repeat(np.arange(6), 5)
    img, cap = torch.randn(6, 4, generator=gen), torch.randn(30, 4, generator=gen)
    got = split_metrics((img, cap), _prepared(caption_image, ("full",), 1000), "test")
    assert got == pytest.approx(retrieval_metrics(img @ cap.T, torch.as_tensor(caption_image)))


# -- the command line on a published folder, without renaming -----------------------------------


def run_cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "MLFLOW_DISABLE_TELEMETRY": "true"}
    return subprocess.run([sys.executable, "-m", "studies.run", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def data_flags(folder: Path) -> list[str]:
    return ["--set", "data.dataset=precomp", f"data.precomp_dir={folder}"]


def test_plan_checks_the_folder_and_refuses_a_broken_one(coco, tmp_path, capsys):
    assert main(["ltd_bound", "--plan", "--workspace", str(tmp_path), *data_flags(coco)]) == 0
    out = capsys.readouterr().out
    assert f"needs data.precomp_dir={coco}: present and checked" in out
    assert "val from dev_*" in out and "test from testall_*" in out
    broken = write_scan_coco(tmp_path / "broken", fold_images=2, train=12, dev=4)
    (broken / "testall_ids.txt").write_text("1\n2\n", encoding="utf-8")
    assert main(["ltd_bound", "--plan", "--workspace", str(tmp_path), *data_flags(broken)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "testall_ids.txt has 2 ids" in err


def test_debug_trains_two_steps_on_a_scan_folder(coco, tmp_path, capsys):
    code = main(["ltd_bound", "--debug", "--condition", "contrastive", "--workspace",
                 str(tmp_path), *data_flags(coco), "train.warmup_epochs=1",
                 "train.finetune_epochs=0", "train.max_steps_per_epoch=2", "train.batch_size=16"])
    out = capsys.readouterr().out
    assert code == 0
    assert "val from dev_*" in out and "5 folds of 4 images" in out and "epoch 1/1" in out
    folds = out.split("(1K).**")[1]  # the 5-fold table of --debug: its test row only
    assert "| test |" in folds.split("best validation")[0] and "| val |" not in folds


@pytest.mark.slow
def test_a_coco_layout_study_reports_5k_and_1k(coco, tmp_path):
    result = run_cli("ltd_bound", "--smoke", "--budget", "1", "--seeds", "2", "--no-dashboard",
                     "--workspace", str(tmp_path), *data_flags(coco), "train.batch_size=16",
                     timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "test from testall_* (20 images)" in result.stdout
    report = tmp_path / "reports" / "ltd_bound-smoke"
    folds = (report / "table1_1k.md").read_text(encoding="utf-8")
    assert "5 folds of 4 images" in folds and "BL, L_con" in folds
    trials = pd.read_csv(report / "trials.csv")
    confirm = trials[trials["phase"] == "confirm"]
    assert confirm["test_1k_rsum"].notna().all() and (confirm["test_1k_fold_images"] == 4).all()


# -- Karpathy JSON with SCAN's regions, CxC --------------------------------------------------------


def test_karpathy_json_reads_scan_regions_by_cocoid(coco, tmp_path, workspace):
    """SCAN's ids files list COCO's cocoid (Flickr30K's imgid), not file names."""
    images = []
    for split, file_split in (("train", "train"), ("val", "dev"), ("test", "testall")):
        ids = (coco / f"{file_split}_ids.txt").read_text(encoding="utf-8").split()
        captions = (coco / f"{file_split}_caps.txt").read_text(encoding="utf-8").splitlines()
        for n, cocoid in enumerate(ids):
            images.append({"split": split, "filename": f"COCO_val2014_{int(cocoid):012d}.jpg",
                           "filepath": "val2014", "cocoid": int(cocoid),
                           "sentences": captions[5 * n:5 * n + 5]})
    karpathy.write_karpathy_json(tmp_path / "dataset_coco.json", "coco", images)
    config = from_flat({"data.dataset": "karpathy", "data.karpathy_json": str(tmp_path / "dataset_coco.json"),
                        "data.precomp_dir": str(coco), "data.features": "regions",
                        "image.encoder": "regions"})
    assert any("val dev_ims.npy" in line for line in check_data(config, workspace))
    source = load_source(config, workspace)
    test = source.splits["test"]
    regions = image_inputs(config, source, test, workspace.cache)
    assert len(regions) == test.num_images == 20


def test_cxc_on_a_precomputed_folder_is_refused(coco, workspace):
    """A precomputed split's captions are line numbers: no CxC sentid maps onto them, which
    would otherwise leave every cxc_ metric equal to the plain one without a word."""
    config = precomp_config(coco, **{"data.cxc_test": str(CXC / "sits_test.head.csv")})
    with pytest.raises(DataError, match="none of its .* pairs"):
        check_data(config, workspace)


def _entities_download(root: Path) -> tuple[Path, Path]:
    """A Flickr30K Entities folder as unzipped (``Annotations/``, ``Sentences/``, split lists)
    and BUTD regions with boxes of its images (``dev`` for validation), ids = image ids."""
    ents, regions = root / "flickr30k_entities", root / "f30k_entities_butd"
    rng = np.random.default_rng(0)
    for split, names in (("train", ["11", "12"]), ("val", ["21"]), ("test", ["31"])):
        for name in names:
            lines = [f"[/EN#{k + 1}/people A man] runs near [/EN#0/notvisual someone] ."
                     for k in range(5)]
            entities.write_sentences(ents / "Sentences" / f"{name}.txt",
                                     [entities.parse_sentence_line(x) for x in lines])
            entities.write_annotation(ents / "Annotations" / f"{name}.xml", entities.EntityAnnotation(
                100, 80, 3, {k + 1: [(10, 10, 40, 50)] for k in range(5)}))
        entities.write_split_ids(ents / f"{split}.txt", names)
        boxes = np.tile(np.array([0, 0, 50, 40], dtype=np.float32), (len(names), 3, 1))
        precomp.write_precomp(regions, "dev" if split == "val" else split,
                              rng.standard_normal((len(names), 3, 8)), boxes,
                              ["a man runs near someone ."] * 5 * len(names), names)
    return ents, regions


def test_grounding_plan_checks_entities_and_boxes(tmp_path, workspace):
    ents, regions = _entities_download(tmp_path)
    config = from_flat({"task.name": "grounding", "data.dataset": "precomp",
                        "data.precomp_dir": str(regions), "data.entities_dir": str(ents)})
    assert any("val from dev_*" in line for line in check_task_data(config, workspace))
    (regions / "dev_boxes.npy").unlink()
    with pytest.raises(DataError, match="dev_boxes.npy"):
        check_task_data(config, workspace)
