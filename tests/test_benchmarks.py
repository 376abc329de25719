"""The benchmark scripts run, and ltd_effect resumes without training twice."""

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def read_rows(path: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(path, newline="") as f:
        return {(r["condition"], r["seed"]): r for r in csv.DictReader(f)}


def test_ltd_effect_condition_names():
    ltd_effect = load("ltd_effect")
    assert ltd_effect.condition_overrides("ltd:0.2") == {
        "decoder.name": "ltd", "objective.name": "lagrangian", "objective.eta": 0.2,
    }  # fmt: skip
    assert ltd_effect.condition_overrides("itd")["objective.name"] == "dual"
    with pytest.raises(ValueError, match="unknown condition 'ltd'"):
        ltd_effect.condition_overrides("ltd")


@pytest.mark.slow
def test_ltd_effect_smoke_resumes_finished_runs(workspace, tmp_path, capsys):
    """A second invocation reads every finished run back from its checkpoint: same rows, no
    training (the summed epoch times are those of the first invocation)."""
    ltd_effect = load("ltd_effect")
    out = tmp_path / "effect.md"
    args = ["--smoke", "--workspace", str(workspace.root), "--out", str(out)]
    ltd_effect.main(args)
    first = read_rows(out.with_suffix(".csv"))
    ltd_effect.main(args)
    second = read_rows(out.with_suffix(".csv"))

    assert set(first) == {("contrastive", "0"), ("ltd:0.2", "0"), ("input", "0"),
                          ("init", "0"), ("random", "0")}  # fmt: skip
    for key, row in first.items():
        assert {k: v for k, v in second[key].items() if k != "call_seconds"} == {
            k: v for k, v in row.items() if k != "call_seconds"
        }
    assert 0 < float(first[("ltd:0.2", "0")]["rsum"]) <= 600
    assert 0.0 <= float(first[("ltd:0.2", "0")]["cap_shape"]) <= 1.0
    table = out.read_text()
    assert "2 of 2 runs" in table and "| ltd:0.2 | 1 |" in table
    assert "| random (ref) |" in capsys.readouterr().out


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
