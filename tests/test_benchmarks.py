"""The benchmark scripts run end to end on small inputs (their timings are not tested)."""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_tracking_throughput_small(capsys, tmp_path, monkeypatch):
    """The tracking benchmark end to end on a few records: both ways run and are compared."""
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    load("tracking_throughput").main(["--epochs", "2", "--rows", "5", "--trials", "2"])
    out = capsys.readouterr().out
    for needle in ("per-row:", "log_batch:", "one-txn:", "one-txn / per-row ="):
        assert needle in out


def test_eval_speed_small(capsys, monkeypatch):
    """The eval_speed script end to end on a small split: every line, ratios and metrics."""
    eval_speed = load("eval_speed")
    argv = ["eval_speed", "--images", "40", "--captions", "200", "--dim", "16",
            "--loop-queries", "10", "--repeats", "1"]  # fmt: skip
    monkeypatch.setattr(sys, "argv", argv)
    eval_speed.main()
    out = capsys.readouterr().out
    for needle in ("(a) floor", "(b) full", "(c) loop", "full / floor =", "loop / full  =", "rsum="):
        assert needle in out


def test_benchmark_realism_tiny(capsys, tmp_path):
    """The realism table end to end on the tiny preset: COCO's column from eccv-caption's files
    (CxC gives 0.42 extra images per caption among 5,000) and the preset's exact statistics."""
    realism = load("benchmark_realism")
    realism.main(["--workspace", str(tmp_path), "--presets", "tiny"])
    out = capsys.readouterr().out
    rows = {line.split(" | ")[0].strip("| "): line for line in out.splitlines()}
    coco, tiny = (c.strip() for c in rows["regions per image"].strip(" |").split(" | ")[1:3])
    assert coco.startswith("36") and tiny == "36"
    cxc = float(rows["false negatives per caption per 1,000 images"].split(" | ")[1].split(" / ")[0])
    assert cxc == pytest.approx(0.42 / 4999 * 1000, abs=0.002)
    mean, share = realism.batch_false_negatives(np.array([0, 10, 4999]), 4999, batch=128)
    assert mean == pytest.approx((0 + 10 + 4999) * 127 / 4999 / 3)
    assert share == pytest.approx((0 + (1 - _no_hit(10, 4999, 127)) + 1) / 3)


def _no_hit(positives: int, others: int, draws: int) -> float:
    """P(no positive among ``draws`` of ``others`` without replacement), as a plain product."""
    p = 1.0
    for i in range(draws):
        p *= (others - positives - i) / (others - i)
    return p


def test_negative_generators_tiny(capsys, tmp_path):
    """The negative-quality benchmark end to end on the tiny preset: every setting is a row whose
    verdict shares add up to 1, and the row of the smallest pool says it does no re-ranking."""
    load("negative_generators").main(["--workspace", str(tmp_path), "--preset", "tiny",
                                      "--negatives", "2", "--candidates", "4", "2", "--quiet"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    body = rows[2:]  # below the header and the alignment row
    assert [r.split(" | ")[0] for r in body] == [
        "| random", "| context, 4 candidates", "| context, 2 candidates (no re-ranking)"]
    for row in body:
        tn, fn, unjudged, same = (float(x) for x in row.strip(" |").split(" | ")[1:5])
        assert abs(tn + fn + unjudged - 1.0) <= 1.5e-3 and 0.0 <= same <= 1.0  # 3 decimals each
