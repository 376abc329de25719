"""The ltd_architectures study (LTD Table 3): its conditions, its search, one table per
architecture in the report, and the paper's recipe values as valid configurations."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from icr.config import from_flat
from studies.catalog import get_study
from studies.papers.ltd_architectures import BEST_ETA, PAPER_VALUES
from studies.plan import Options, StudyPlan
from studies.report import write_table
from studies.runs import RunSet

STUDY = get_study("ltd_architectures")


def test_conditions_are_the_architectures_times_the_objectives():
    plan = StudyPlan.build(STUDY, Options())
    configs = {c.name: c.config for c in plan.conditions}
    assert set(configs) == {f"{a}_{o}" for a in ("vsrn", "tern")
                            for o in ("contrastive", "dual", "lagrangian")}
    for name, config in configs.items():
        arch, objective = name.split("_")
        assert config.image.encoder == arch and config.objective.name == objective
        assert config.text.encoder == ("tern" if arch == "tern" else "gru")
        assert config.decoder.name == ("none" if objective == "contrastive" else "ltd")
        assert config.data.features == "regions" and config.data.preset == "default"
        assert config.loss.name == "infonce" and config.train.batch_size == 128
    assert configs["vsrn_dual"].objective.beta == configs["tern_dual"].objective.beta == 1.0
    assert configs["vsrn_contrastive"].model.head_batchnorm  # VSRN's BatchNorm


def test_only_the_lagrangian_conditions_search_eta_over_the_paper_range():
    plan = StudyPlan.build(STUDY, Options())
    for condition in plan.conditions:
        if condition.name.endswith("lagrangian"):
            eta = condition.domains["objective.eta"]
            assert (eta.kind, eta.values) == ("uniform", (0.05, 0.3))
        else:
            assert not condition.domains


def test_smoke_preset_is_tiny():
    plan = StudyPlan.build(STUDY, Options(smoke=True))
    assert all(c.config.data.preset == "tiny" for c in plan.conditions)
    assert plan.budget == 1 and len(plan.seeds) == 1


def _runs() -> RunSet:
    g = np.random.default_rng(0)
    rows = [{"run_id": f"{c.name}-{seed}", "phase": "confirm", "status": "FINISHED",
             "condition": c.name, "seed": seed, "test_rsum": 100 + 10 * i + g.normal(),
             **{f"test_{d}_R_at_{k}": 10.0 + i + g.normal() for d in ("i2t", "t2i")
                for k in (1, 5, 10)}, "test_t2i_nDCG_at_25": 50 + g.normal()}
            for i, c in enumerate(STUDY.conditions) for seed in (1000, 1001)]
    return RunSet(pd.DataFrame(rows), lambda run_id, key: ([], []))


@pytest.mark.parametrize("arch", ["vsrn", "tern"])
def test_each_architecture_has_its_own_table_and_baseline(arch: str, tmp_path: Path):
    (table,) = [t for t in STUDY.tables if t.name == f"table3_{arch}"]
    labels = {c.name: c.label for c in STUDY.conditions}
    markdown, metrics = write_table(table, STUDY, _runs(), labels, [], tmp_path)
    shown = [c.label for c in STUDY.conditions if c.name.startswith(arch)]
    hidden = [c.label for c in STUDY.conditions if not c.name.startswith(arch)]
    assert all(f"| {label} |" in markdown for label in shown)
    assert not any(label in markdown for label in hidden)
    assert f"differs from {labels[f'{arch}_contrastive']}" in markdown
    assert "Holm-Bonferroni over the table's 16 tests" in markdown  # 2 rows x 8 columns
    differences = (tmp_path / f"table3_{arch}_vs_baseline.md").read_text()
    assert f"| {labels[f'{arch}_lagrangian']} |" in differences
    assert f"| {labels[f'{arch}_contrastive']} |" not in differences
    assert (tmp_path / f"table3_{arch}.tex").is_file()
    assert all(key.startswith(f"report/{arch}_") for key in metrics)


@pytest.mark.parametrize("arch", ["vsrn", "tern"])
def test_the_paper_recipes_are_valid_configurations(arch: str):
    """Every value of the paper recipes parses as a config key."""
    config = from_flat(PAPER_VALUES[arch])
    assert config.image.encoder == arch and config.train.batch_size == 128
    assert config.loss.name == "infonce" and config.loss.tau == 0.05
    assert config.epochs == 30  # both papers train 30 epochs
    assert set(BEST_ETA) == {("vsrn", "f30k"), ("vsrn", "coco"), ("tern", "coco")}
