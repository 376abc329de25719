"""The data fingerprint a study prints when it starts and every report shows under its tables:
for the embedded benchmark, its manifest's (every file, the same on every CPU)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from icr.config import from_flat
from icr.data.synthetic import read_manifest
from icr.data.synthetic.writer import fingerprint
from studies.catalog import get_study
from studies.pipeline import Backend, default_prepare, prepare_data
from studies.plan import Options, StudyPlan
from studies.report import data_notes, write_table
from studies.runs import RunSet

from fakes import fake_prepare

STUDY = get_study("ltd_bound")


def test_the_driver_says_the_data_fingerprint_when_it_prepares(tmp_path: Path):
    plan = StudyPlan.build(STUDY, Options(workspace=str(tmp_path)))
    lines: list[str] = []
    prepared = prepare_data(plan, Backend(prepare=fake_prepare), say=lines.append)
    assert {c: p.fingerprint for c, p in prepared.items()} == \
        {c.name: "fake-default-0" for c in plan.conditions}
    # once per distinct data configuration (ltd_bound: the baseline's, then the decoders')
    assert lines.count("  data fingerprint fake-default-0") == 2
    assert lines.index("  data fingerprint fake-default-0") == 1  # right after the first prepare


def test_the_embedded_benchmarks_data_fingerprint_is_its_manifests(workspace):
    config = from_flat({"data.preset": "tiny", "text.glove": "none"})
    prepared = default_prepare(config, workspace)
    root = workspace.data / "shapes-tiny-0"
    assert prepared.fingerprint == read_manifest(root)["fingerprint"] == fingerprint(root)
    assert prepared.train_images == 40


def _runs() -> RunSet:
    g = np.random.default_rng(0)
    keys = [column.key for column in STUDY.tables[0].columns]
    rows = [{"run_id": f"{c.name}-{seed}", "phase": "confirm", "status": "FINISHED",
             "condition": c.name, "seed": seed, **{k: 50 + 10 * i + g.normal() for k in keys}}
            for i, c in enumerate(STUDY.conditions) for seed in (1000, 1001, 1002)]
    return RunSet(pd.DataFrame(rows), lambda run_id, key: ([], []))


def test_each_table_names_the_data_its_runs_trained_on(tmp_path: Path):
    shared = {f"data_fingerprint.{c.name}": "ab" * 32 for c in STUDY.conditions}
    assert data_notes(STUDY, shared) == [f"Data fingerprint `{'ab' * 32}`."]
    assert data_notes(STUDY, {}) == []  # a study run recorded before fingerprints were
    first, *others = STUDY.conditions
    mixed = {**shared, f"data_fingerprint.{first.name}": "cd" * 32}
    (line,) = data_notes(STUDY, mixed)
    assert line.startswith(f"Data fingerprints: {first.label} `{'cd' * 32}`; {others[0].label} `")

    table = STUDY.tables[0]
    labels = {c.name: c.label for c in STUDY.conditions}
    notes = ["- a failure note"]
    markdown, _ = write_table(table, STUDY, _runs(), labels, notes, tmp_path, data_notes(STUDY, shared))
    written = (tmp_path / f"{table.name}.md").read_text()
    assert written.endswith(f"\n- a failure note\n\nData fingerprint `{'ab' * 32}`.\n")
    assert markdown.startswith(written)  # and in the parent run's description
    assert (tmp_path / f"{table.name}.tex").read_text().endswith(f"% Data fingerprint `{'ab' * 32}`.\n")
