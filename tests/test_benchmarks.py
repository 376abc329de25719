"""The benchmark scripts run end to end on small inputs (their timings are not tested)."""

import importlib.util
import sys
from pathlib import Path

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


def test_batch_false_negatives_tiny(capsys, tmp_path):
    """The false-negative count end to end on the tiny preset; a caption is true of its own image."""
    from icr.data.synthetic import ensure_benchmark, holds
    from icr.grounding.quality import load_shapes_truth

    load("batch_false_negatives").main(["--workspace", str(tmp_path), "--preset", "tiny",
                                        "--batch", "8", "--batches", "2"])
    out = capsys.readouterr().out
    share = float(out.split("true of at least one other image of their batch: ")[1].split()[0])
    assert 0.0 <= share <= 1.0 and "median" in out
    truth = load_shapes_truth(ensure_benchmark(tmp_path / "data" / "shapes-tiny-0", "tiny", 0), "train")
    assert all(holds(t.meaning, t.scene) for t in truth)


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
        assert abs(tn + fn + unjudged - 1.0) < 1e-9 and 0.0 <= same <= 1.0
