"""What a study is, and the studies by name (docs/architecture.md, "A study").

A study is a base config (flat overrides), a search-space file, the conditions it compares (the
rows of its tables, each a set of fixed overrides), the metric and mode, the ASHA parameters, a
budget of trials per condition, the searcher's quasi-random start, the number of fresh seeds of the
confirmation runs, and what its report holds: tables (:mod:`studies.tables`), figures
(:mod:`studies.figures`) and analyses (run in each confirmation run on its best checkpoint, see
:mod:`icr.analysis`). Each module of :mod:`studies.papers` that defines ``STUDY = Study(...)`` is a
study; this module finds them by scanning that package, so a new paper's study is one new module.
"""

from __future__ import annotations

import difflib
import importlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from icr.config import Scalar
from icr.errors import ConfigError
from icr.registry import package_modules
from studies import papers
from studies.figures import Figure
from studies.space_analysis import EVALUATORS
from studies.tables import Column, Table

SEARCH_SPACES = Path(__file__).resolve().parent.parent / "search_spaces"

# The table a study gets when it declares none: test retrieval, both directions, rsum.
RETRIEVAL_TABLE = Table(
    "retrieval", "Retrieval on the test split",
    tuple(Column(f"test_{d}_R_at_{k}", f"R@{k}", d) for d in ("i2t", "t2i") for k in (1, 5, 10))
    + (Column("test_rsum", "rsum"),),
    caption="best-validation checkpoint of each confirmation run; R@k in %",
)


@dataclass(frozen=True)
class Condition:
    """One row of the study's tables: fixed overrides on top of the study's base config."""

    name: str
    label: str  # the row label of the paper table, e.g. "BL + LTD, L_lag"
    overrides: Mapping[str, Scalar] = field(default_factory=dict)


RECIPES = ("embedded", "paper", "smoke")


@dataclass(frozen=True)
class Recipe:
    """How a study's trials are trained: the base config, the space, the trials and seeds.

    Every study has three: ``embedded`` (the default: scaled to the embedded benchmark and 2 CPU
    cores; the study's ``base``, ``space_file``, ``budget``, ``seeds``), ``smoke`` (the tiny
    preset: ``base`` + ``smoke``) and ``paper`` (the paper's own recipe for its real datasets,
    declared with :attr:`Study.paper`, every value cited where it is set).

    Attributes:
        name: one of :data:`RECIPES`.
        source: where its values come from (e.g. "LTD paper Sec. 4.3; PCME code").
        overrides: flat config overrides of the ExperimentConfig defaults (the study's base).
        conditions: per condition, overrides applied after the condition's own (e.g. the
            paper's epochs of one loss).
        space_file: its search space (``None``: the study's).
        budget: trials per condition (``None``: the study's); a grid space runs each point once.
        startup_trials: quasi-random trials before TPE (``None``: the study's).
        seeds: confirmation seeds per condition (``None``: the study's).
        early_stopping: ASHA stops weak trials; ``False``: every trial trains its full budget
            (the papers trained every grid point to the end).
        datasets: the ``data.dataset`` values it trains on (empty: any).
        requires: config keys that must name a local file for it (value: what the file is).
        notes: what the paper leaves open, with the choice made.
        analyses: the analyses its confirmation runs end with (``None``: the study's); real
            data lacks what some need (e.g. the benchmark's ground-truth scenes).
        reference_data: the datasets its paper trained on, names of
            :data:`studies.estimate.REFERENCE_DATASETS`: ``--plan`` counts an epoch's steps
            from their sizes when the files are absent.
    """

    name: str
    source: str
    overrides: Mapping[str, Scalar]
    conditions: Mapping[str, Mapping[str, Scalar]] = field(default_factory=dict)
    space_file: str | None = None
    budget: int | None = None
    startup_trials: int | None = None
    seeds: int | None = None
    early_stopping: bool = True
    datasets: tuple[str, ...] = ()
    requires: Mapping[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    analyses: tuple[str, ...] | None = None
    reference_data: tuple[str, ...] = ("coco", "f30k")


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
    startup_trials: int = 4  # quasi-random trials before TPE takes over (per condition)
    seeds: int = 3  # fresh seeds of the confirmation runs
    searcher_seed: int = 0  # seed of the searcher
    max_failures: int = 1  # retries of a failed trial (from its last checkpoint)
    tables: tuple[Table, ...] = (RETRIEVAL_TABLE,)
    figures: tuple[Figure, ...] = ()
    analyses: tuple[str, ...] = ()  # icr.analysis names, run in every confirmation run
    ensemble: bool = False  # the report adds a row: the best condition's seeds as one ensemble
    # A second objective to minimise: a metric every epoch reports, its mean over the trial's
    # epochs (e.g. epoch_time_s); '' = one objective. The search is then multi-objective
    # (studies.searcher) and the report draws the Pareto front (studies.space_analysis).
    cost: str = ""
    importance: str = "fanova"  # the report's importance estimator: fanova or ped_anova
    smoke: Mapping[str, Scalar] = field(default_factory=dict)  # overrides of --smoke
    smoke_budget: int = 2
    smoke_seeds: int = 2
    debug_condition: str = ""  # the condition --debug runs ('' = the last one)
    paper: Recipe | None = None  # the paper's own recipe (--recipe paper)

    def __post_init__(self) -> None:
        names = [c.name for c in self.conditions]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"study {self.name}: condition names must be unique and non-empty")
        if self.mode not in ("min", "max"):
            raise ValueError(f"study {self.name}: mode must be min or max")
        if self.importance not in EVALUATORS:
            raise ValueError(f"study {self.name}: importance must be one of {', '.join(EVALUATORS)}")
        if self.cost == self.metric:
            raise ValueError(f"study {self.name}: the cost must be another metric than {self.metric}")
        for table in self.tables:
            if table.baseline is not None and table.baseline not in names:
                raise ValueError(f"study {self.name}: table {table.name} baseline "
                                 f"{table.baseline!r} is not a condition")
            unknown = sorted(set(table.rows or ()) - set(names))
            if unknown:
                raise ValueError(f"study {self.name}: table {table.name} rows {unknown} are not "
                                 "conditions")

        if self.paper is not None:
            unknown = set(self.paper.conditions) - set(names)
            if self.paper.name != "paper" or unknown:
                raise ValueError(f"study {self.name}: its paper recipe must be named 'paper' and "
                                 f"name only its conditions (not {sorted(unknown)})")

    @property
    def space_path(self) -> Path:
        return space_path(self.space_file)

    def recipe(self, name: str) -> Recipe:
        """The recipe called ``name`` (:data:`RECIPES`); ConfigError when the study has none."""
        if name == "embedded":
            return Recipe("embedded", "scaled to the embedded benchmark and 2 CPU cores",
                          self.base, space_file=self.space_file, budget=self.budget,
                          startup_trials=self.startup_trials, seeds=self.seeds)
        if name == "smoke":
            # the smoke overrides come after each condition's own, as they always have
            return Recipe("smoke", "the tiny preset, a few short trials", self.base,
                          conditions={c.name: self.smoke for c in self.conditions},
                          space_file=self.space_file, budget=self.smoke_budget,
                          startup_trials=min(self.startup_trials, self.smoke_budget),
                          seeds=self.smoke_seeds)
        if name == "paper" and self.paper is not None:
            return self.paper
        have = [r for r in RECIPES if r != "paper" or self.paper is not None]
        raise ConfigError(f"study {self.name} has no recipe {name!r}; its recipes: {', '.join(have)}")

    def condition(self, name: str) -> Condition:
        for c in self.conditions:
            if c.name == name:
                return c
        known = ", ".join(c.name for c in self.conditions)
        raise ConfigError(f"study {self.name} has no condition {name!r}; its conditions: {known}")


def space_path(space_file: str) -> Path:
    """A space file's path: in ``search_spaces/`` unless absolute."""
    path = Path(space_file)
    return path if path.is_absolute() else SEARCH_SPACES / path


def _declares_a_study(path: Path) -> bool:
    """The module's source assigns ``STUDY`` at top level (read before importing, so that a
    helper module of the package is never imported for nothing)."""
    try:
        return re.search(r"^STUDY\s*[:=]", path.read_text(encoding="utf-8"), re.M) is not None
    except OSError:
        return False


def all_studies() -> dict[str, Study]:
    """Every study of :mod:`studies.papers` by name: each module that declares ``STUDY``,
    found by scanning the package's sources and imported (only those are)."""
    found: dict[str, Study] = {}
    for module, source in package_modules(papers.__name__):
        if not _declares_a_study(source):
            continue
        study = getattr(importlib.import_module(module), "STUDY", None)
        if not isinstance(study, Study):
            continue
        if study.name in found:
            raise ValueError(f"study {study.name!r} is defined twice")
        found[study.name] = study
    return found


def get_study(name: str, extra: Mapping[str, Study] | None = None) -> Study:
    """The study called ``name``; ConfigError listing the known ones otherwise."""
    known = {**all_studies(), **(extra or {})}
    if name in known:
        return known[name]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(f"unknown study {name!r}; {hint}known studies: {', '.join(known)}")
