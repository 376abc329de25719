"""A study run, resolved and validated before anything is written.

``StudyPlan.build`` turns a study, the command-line options and the search-space file into the flat
overrides of every condition (validated into an ``ExperimentConfig`` once), the domains searched in
it and the settings of the run (workspace, tracking store, Tune storage, resources). Every user
mistake (unknown key, bad value, bad space file, unknown condition, a workspace that is a file, an
unknown URI scheme, a budget of 0, ...) surfaces here as a one-line UserError, before a folder, a
Ray instance or an MLflow run exists. The rest of the pipeline reads the plan, never the options.

Precedence of the flat overrides, lowest first: the ExperimentConfig defaults, the study's base,
the fixed values of the space file, the condition's overrides, the ``--smoke`` overrides, the
``--set`` overrides. A key set with ``--set`` is no longer searched.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icr.analysis import check_analyses
from icr.config import ExperimentConfig, Scalar, check_paths, from_flat, parse_value, to_flat
from icr.errors import ConfigError, UserError
from icr.train.tasks import check as check_task
from icr.workspace import Workspace
from studies.catalog import Study
from studies.space import Domain, load_space

CONFIRM_SEED_BASE = 1000  # confirmation seeds are 1000, 1001, ...: never a search trial's seed
TRACKING_SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks")
STORAGE_SCHEMES = ("s3", "gs", "gcs")


@dataclass(frozen=True)
class Options:
    """What the command line chose (see ``python -m studies.run --help``)."""

    overrides: dict[str, str] = field(default_factory=dict)
    smoke: bool = False
    seeds: int | None = None
    budget: int | None = None
    workspace: str | None = None
    tracking_uri: str | None = None
    address: str | None = None
    storage: str | None = None
    cpus_per_trial: int | None = None
    dashboard: bool = True


@dataclass(frozen=True)
class ConditionPlan:
    name: str
    label: str
    flat: dict[str, Scalar]  # every override of the condition (not the searched keys)
    domains: dict[str, Domain]  # searched keys
    config: ExperimentConfig  # the flat overrides, validated (searched keys at their defaults)

    def corners(self) -> Iterator[tuple[dict[str, Scalar], ExperimentConfig]]:
        """The configurations at the corners of the searched space, with the values drawn: every
        combination of each domain's choices and both ends of its ranges."""
        keys = list(self.domains)
        for values in itertools.product(*(self.domains[k].values for k in keys)):
            drawn = dict(zip(keys, values, strict=True))
            yield drawn, from_flat(drawn, self.config)


@dataclass(frozen=True)
class StudyPlan:
    study: Study
    workspace: Workspace
    conditions: tuple[ConditionPlan, ...]
    budget: int
    seeds: tuple[int, ...]
    max_epochs: int  # ASHA's max_t: the full budget of a trial, in epochs
    smoke: bool = False
    overrides: dict[str, str] = field(default_factory=dict)  # the --set values, as given
    tracking_uri: str = ""
    storage_root: str = ""  # Tune storage: --storage (S3, GCS, NFS) or <workspace>/ray
    address: str | None = None  # a Ray cluster to join; None: start a private instance
    cpus_per_trial: int | None = None
    dashboard: bool = True

    @property
    def key(self) -> str:
        """Name of the study's MLflow experiment, Tune folder and report folder."""
        return f"{self.study.name}-smoke" if self.smoke else self.study.name

    @property
    def state_root(self) -> Path:
        """Local folder of the study's runs: state files, searcher logs, the driver lock."""
        return self.workspace.ray / self.key

    @property
    def report_dir(self) -> Path:
        return self.workspace.reports / self.key

    def condition(self, name: str) -> ConditionPlan:
        for c in self.conditions:
            if c.name == name:
                return c
        raise ConfigError(f"study {self.study.name} has no condition {name!r}")

    def signature(self) -> dict[str, Any]:
        """The options a resumed run must share with the run it continues."""
        return {"overrides": dict(sorted(self.overrides.items())), "smoke": self.smoke,
                "budget": self.budget, "seeds": list(self.seeds)}

    @classmethod
    def build(cls, study: Study, options: Options) -> StudyPlan:
        """Validate everything the user gave; raise a one-line UserError at the first mistake."""
        workspace = Workspace.resolve(options.workspace)
        check_workspace(workspace.root)
        conditions = _conditions(study, options)
        epochs = {c.config.epochs for c in conditions}
        if len(epochs) != 1 or not epochs.pop():
            raise ConfigError("every condition of a study must train for the same number (> 0) of epochs")
        n_seeds = options.seeds if options.seeds is not None else (
            study.smoke_seeds if options.smoke else study.seeds
        )
        budget = options.budget if options.budget is not None else (
            study.smoke_budget if options.smoke else study.budget
        )
        if n_seeds < 1:
            raise UserError(f"--seeds {n_seeds}: give at least 1 confirmation seed per condition")
        if budget < 1:
            raise UserError(f"--budget {budget}: give at least 1 trial per condition")
        if options.cpus_per_trial is not None and options.cpus_per_trial < 1:
            raise UserError(f"--cpus-per-trial {options.cpus_per_trial}: give 1 or more CPUs")
        return cls(
            study=study, workspace=workspace, conditions=conditions, budget=budget,
            seeds=tuple(CONFIRM_SEED_BASE + i for i in range(n_seeds)),
            max_epochs=conditions[0].config.epochs, smoke=options.smoke,
            overrides=dict(options.overrides),
            tracking_uri=check_tracking_uri(options.tracking_uri or workspace.mlflow_uri),
            storage_root=check_storage_uri(options.storage or str(workspace.ray)),
            address=options.address, cpus_per_trial=options.cpus_per_trial,
            dashboard=options.dashboard,
        )

    def debug_config(self, condition: str | None) -> ExperimentConfig:
        """The config ``--debug`` trains: a condition's overrides, searched keys at a midpoint.

        The test split is evaluated at the end (``eval.test=true``) unless ``--set`` says otherwise.
        """
        plan = self.condition(condition or self.study.debug_condition or self.conditions[-1].name)
        values = {k: d.midpoint() for k, d in plan.domains.items()}
        test = {} if "eval.test" in self.overrides else {"eval.test": True}
        return from_flat({**test, **values}, plan.config)


def _conditions(study: Study, options: Options) -> tuple[ConditionPlan, ...]:
    space = load_space(study.space_path, tuple(c.name for c in study.conditions))
    user = {k: parse_value(k, v) for k, v in options.overrides.items()}
    smoke = dict(study.smoke) if options.smoke else {}
    out = []
    for condition in study.conditions:
        section = space.for_condition(condition.name)
        clash = set(section.domains) & set(condition.overrides)
        if clash:
            raise ConfigError(
                f"{space.path}: {sorted(clash)[0]} is searched but condition "
                f"{condition.name} fixes it in studies/{study.name}.py"
            )
        flat = {**study.base, **section.fixed, **condition.overrides, **smoke, **user}
        config = from_flat(flat)  # validates every value
        check_paths(config)
        check_task(config)
        check_analyses(config, study.analyses)  # each analysis fits the condition's task and data
        flat = {k: v for k, v in to_flat(config).items() if k in flat}
        domains = {k: d for k, d in section.domains.items() if k not in user}
        for domain in domains.values():  # every searched value must make a valid config too
            for value in domain.values:
                check_analyses(from_flat({domain.key: value}, config), study.analyses)
        out.append(ConditionPlan(condition.name, condition.label, flat, domains, config))
    return tuple(out)


def check_workspace(root: Path, flag: str = "--workspace") -> None:
    """``root`` must be a folder this user can write, or creatable as one."""
    if root.exists() and not root.is_dir():
        raise UserError(f"{flag} {root} is a file, not a folder; give a folder")
    existing = next(p for p in (root, *root.parents) if p.exists())
    if not existing.is_dir() or not _can_create_in(existing):
        raise UserError(f"{flag} {root}: cannot write in {existing}; give a folder you can write")


def _can_create_in(folder: Path) -> bool:
    """Whether a folder can be made in ``folder``: tried, not inferred from permission bits (which
    say yes to root everywhere, also on read-only and virtual file systems such as /proc)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".icr-write-check-", dir=folder))
    except OSError:
        return False
    return True


def check_tracking_uri(uri: str) -> str:
    """An MLflow tracking URI of a known kind (sqlite:///..., http(s)://..., a database URL)."""
    scheme = uri.split("://", 1)[0].split("+", 1)[0] if "://" in uri else ""
    if scheme not in TRACKING_SCHEMES:
        raise UserError(f"--tracking-uri {uri}: not an MLflow store; give sqlite:///path/mlflow.db "
                        "or the http(s):// address of an MLflow server")
    if scheme == "sqlite":
        check_workspace(Path(uri.split(":///", 1)[-1]).parent, "--tracking-uri")
    return uri


def check_storage_uri(storage: str) -> str:
    """Tune storage: a local or shared folder, or s3:// / gs:// (what pyarrow reads)."""
    if "://" in storage:
        if storage.split("://", 1)[0] not in STORAGE_SCHEMES:
            raise UserError(f"--storage {storage}: give a folder, s3://BUCKET/PATH or gs://BUCKET/PATH")
        return storage
    check_workspace(Path(storage).expanduser().absolute(), "--storage")
    return storage
