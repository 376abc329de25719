"""The seam: the real ``fit`` (tiny preset) and the platform's fake obey the same contract.

Whatever the platform relies on (one typed record per epoch, its metrics, the trajectory rows
since the previous report, the checkpoint, resuming) is asserted here once, for both, so the fake
that the platform's fast tests use cannot drift from the real loop unnoticed.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest

from icr.config import from_flat
from icr.train import EpochReport, fit

from fakes import FakeFit

TINY = {
    "data.preset": "tiny", "model.embed_dim": 32, "text.hidden_dim": 32, "decoder.hidden_dim": 32,
    "train.batch_size": 16, "train.warmup_epochs": 1, "train.finetune_epochs": 1,
    "train.swa_bn_batches": 2, "train.trajectory_every": 1, "eval.batch_size": 64,
    "objective.name": "lagrangian", "decoder.name": "ltd", "objective.eta": 0.1,
}

FITS = {"real": None, "fake": FakeFit()}


def _fit(kind: str):
    return fit if kind == "real" else FITS[kind]


@pytest.fixture(scope="module", params=sorted(FITS))
def fitted(request, workspace, tmp_path_factory):
    """Both fits on the same config: a full run whose epoch-1 checkpoint is kept, and a resume."""
    kind, tmp = request.param, tmp_path_factory.mktemp(request.param)
    config = from_flat(TINY)
    reports: list[EpochReport] = []
    seen: list[tuple[bool, list[str]]] = []

    def reporter(report: EpochReport) -> None:
        reports.append(report)
        seen.append((report.checkpoint.is_dir(), sorted(p.name for p in report.checkpoint.iterdir())))
        if report.epoch == 1:
            shutil.copytree(report.checkpoint, tmp / "after-1")

    result = _fit(kind)(config, reporter, workspace=workspace, run_dir=tmp / "run")
    resumed: list[EpochReport] = []
    again = _fit(kind)(config, resumed.append, tmp / "after-1", workspace=workspace,
                       run_dir=tmp / "resumed")
    return config, reports, seen, result, resumed, again


def test_one_record_per_epoch_with_the_metrics_the_platform_reads(fitted):
    config, reports, seen, result, _, _ = fitted
    assert [r.epoch for r in reports] == list(range(1, config.epochs + 1))
    assert [r.final for r in reports] == [False] * (config.epochs - 1) + [True]
    for report in reports:
        m = report.metrics
        for key in ("epoch", "val_rsum", "best_val_rsum", "best_epoch", "train_loss", "lr",
                    "epoch_time_s", "epoch_cpu_s", "lambda", "train_L_rec"):
            assert key in m and math.isfinite(m[key]), key
        assert m["epoch_time_s"] >= 0 and m["epoch_cpu_s"] >= 0
        assert m["epoch"] == report.epoch and 1 <= m["best_epoch"] <= report.epoch
        assert m["best_val_rsum"] >= m["val_rsum"] - 1e-9
        assert ("test_rsum" in m) == (report.final and config.eval.test)
        assert all(isinstance(v, float | int) for v in m.values())
    assert all(is_dir and files for is_dir, files in seen)  # a checkpoint folder at every report
    assert result.history == [r.metrics for r in reports]


def test_trajectory_rows_come_once_each_in_step_order(fitted):
    _, reports, _, result, _, _ = fitted
    rows = [row for r in reports for row in r.trajectory]
    assert rows and rows == result.trajectory
    steps = [row["step"] for row in rows]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    for report in reports:
        assert report.trajectory and all(row["epoch"] == report.epoch for row in report.trajectory)
    for row in rows:
        assert {"step", "epoch", "loss", "L_con", "L_rec", "lambda"} <= set(row)
        assert all(math.isfinite(v) for v in row.values())


def test_resuming_reports_only_the_epochs_after_the_checkpoint(fitted):
    config, reports, _, result, resumed, again = fitted
    assert [r.epoch for r in resumed] == list(range(2, config.epochs + 1))
    assert [row["step"] for r in resumed for row in r.trajectory] == \
        [row["step"] for r in reports[1:] for row in r.trajectory]
    assert again.history[-1]["val_rsum"] == pytest.approx(result.history[-1]["val_rsum"], rel=1e-5)
    assert len(again.history) == config.epochs and again.best_epoch == result.best_epoch
    assert isinstance(again.checkpoint_dir, Path)


def test_each_record_says_how_its_epoch_s_steps_ran(fitted):
    """On the CPU every step is eager, and the record says why (no CUDA): nothing fell back.
    trajectory_every=1, so an epoch's rows count its steps."""
    _, reports, _, _, _, _ = fitted
    for report in reports:
        steps = report.steps
        assert (steps.mode, steps.reason, steps.fell_back, steps.captured) == \
            ("eager", "no CUDA", False, 0)
        assert steps.eager == len(report.trajectory) > 0
