"""What a study is, and the registry of studies by name (DESIGN.md, "A study").

A study is a base config (flat overrides), a search-space file, the conditions it compares (the
rows of its table, each a set of fixed overrides), the metric and mode, the ASHA parameters, a
budget of trials per condition and the number of fresh seeds of the confirmation runs. Study
modules (``studies/ltd_bound.py``, ...) each define ``STUDY = Study(...)``; this module lists them.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from icr.errors import ConfigError

Scalar = bool | int | float | str

SEARCH_SPACES = Path(__file__).resolve().parent.parent / "search_spaces"

# The study modules, in the order ``--list`` shows them.
STUDY_MODULES = ("ltd_bound", "ltd_itd", "ltd_triplet")


@dataclass(frozen=True)
class Condition:
    """One row of the study's table: fixed overrides on top of the study's base config."""

    name: str
    label: str  # the row label of the paper table, e.g. "BL + LTD, L_lag"
    overrides: Mapping[str, Scalar] = field(default_factory=dict)


@dataclass(frozen=True)
class Study:
    """A hyperparameter study: searched per condition, confirmed over seeds, reported."""

    name: str
    description: str
    base: Mapping[str, Scalar]  # flat overrides of the ExperimentConfig defaults
    space_file: str  # a file in search_spaces/ (or an absolute path)
    conditions: tuple[Condition, ...]
    metric: str = "val_rsum"
    mode: str = "max"
    grace_period: int = 1  # ASHA: epochs every trial runs before it can be stopped
    reduction_factor: int = 2  # ASHA: 1/rf of the trials at a rung go on
    budget: int = 8  # trials per condition (each condition gets the same budget)
    seeds: int = 3  # fresh seeds of the confirmation runs
    searcher_seed: int = 0  # seed of Optuna's TPE sampler
    max_failures: int = 1  # retries of a failed trial (from its last checkpoint)
    smoke: Mapping[str, Scalar] = field(default_factory=dict)  # overrides of --smoke
    smoke_budget: int = 2
    smoke_seeds: int = 2
    debug_condition: str = ""  # the condition --debug runs ('' = the last one)

    def __post_init__(self) -> None:
        names = [c.name for c in self.conditions]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"study {self.name}: condition names must be unique and non-empty")
        if self.mode not in ("min", "max"):
            raise ValueError(f"study {self.name}: mode must be min or max")

    @property
    def space_path(self) -> Path:
        path = Path(self.space_file)
        return path if path.is_absolute() else SEARCH_SPACES / path

    def condition(self, name: str) -> Condition:
        for c in self.conditions:
            if c.name == name:
                return c
        known = ", ".join(c.name for c in self.conditions)
        raise ConfigError(f"study {self.name} has no condition {name!r}; its conditions: {known}")


def all_studies() -> dict[str, Study]:
    """Every registered study by name (imports the study modules)."""
    studies: dict[str, Study] = {}
    for module in STUDY_MODULES:
        study = importlib.import_module(f"studies.{module}").STUDY
        if study.name in studies:
            raise ValueError(f"study {study.name!r} is registered twice")
        studies[study.name] = study
    return studies


def get_study(name: str, extra: Mapping[str, Study] | None = None) -> Study:
    """The study called ``name``; ConfigError listing the known ones otherwise."""
    studies = {**all_studies(), **(extra or {})}
    if name in studies:
        return studies[name]
    close = difflib.get_close_matches(name, studies, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(f"unknown study {name!r}; {hint}known studies: {', '.join(studies)}")
