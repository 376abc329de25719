"""A study run, resolved and validated before anything is written.

``StudyPlan.build`` turns a study, the command-line options and the search-space file into the
flat overrides of every condition, the domains searched in it, and the settings of the run. Every
user mistake (unknown key, bad value, bad space file, unknown condition) surfaces here as a
ConfigError, before a directory, a Ray instance or an MLflow run exists.

Precedence of the flat overrides, lowest first: the ExperimentConfig defaults, the study's base,
the fixed values of the space file, the condition's overrides, the ``--smoke`` overrides, the
``--set`` overrides. A key set with ``--set`` is no longer searched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from icr.config import ExperimentConfig, from_flat, parse_value, to_flat
from icr.errors import ConfigError
from icr.workspace import Workspace
from studies.catalog import Study
from studies.space import Domain, load_space

Scalar = bool | int | float | str

CONFIRM_SEED_BASE = 1000  # confirmation seeds are 1000, 1001, ...: never a search trial's seed


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

    def config(self) -> ExperimentConfig:
        return from_flat(self.flat)


@dataclass(frozen=True)
class StudyPlan:
    study: Study
    options: Options
    workspace: Workspace
    conditions: tuple[ConditionPlan, ...]
    budget: int
    seeds: tuple[int, ...]
    max_epochs: int  # ASHA's max_t: the full budget of a trial, in epochs

    @property
    def key(self) -> str:
        """Name of the study's MLflow experiment, Tune folder and report folder."""
        return f"{self.study.name}-smoke" if self.options.smoke else self.study.name

    @property
    def tracking_uri(self) -> str:
        return self.options.tracking_uri or self.workspace.mlflow_uri

    @property
    def state_root(self) -> Path:
        """Local folder of the study's runs: state files and searcher logs."""
        return self.workspace.ray / self.key

    @property
    def storage_root(self) -> str:
        """Where Tune writes experiments: ``--storage`` (S3, GCS, NFS) or the workspace."""
        return self.options.storage or str(self.workspace.ray)

    @property
    def report_dir(self) -> Path:
        return self.workspace.reports / self.key

    def condition(self, name: str) -> ConditionPlan:
        for c in self.conditions:
            if c.name == name:
                return c
        raise ConfigError(f"study {self.study.name} has no condition {name!r}")

    @classmethod
    def build(cls, study: Study, options: Options) -> StudyPlan:
        space = load_space(study.space_path, tuple(c.name for c in study.conditions))
        user = {k: parse_value(k, v) for k, v in options.overrides.items()}
        smoke = dict(study.smoke) if options.smoke else {}
        conditions = []
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
            flat = {k: v for k, v in to_flat(config).items() if k in flat}
            domains = {k: d for k, d in section.domains.items() if k not in user}
            conditions.append(ConditionPlan(condition.name, condition.label, flat, domains))
        epochs = {c.config().epochs for c in conditions}
        if len(epochs) != 1 or not epochs.pop():
            raise ConfigError("every condition of a study must train for the same number (> 0) of epochs")
        n_seeds = options.seeds if options.seeds is not None else (
            study.smoke_seeds if options.smoke else study.seeds
        )
        budget = options.budget or (study.smoke_budget if options.smoke else study.budget)
        if n_seeds < 0 or budget < 1:
            raise ConfigError("--seeds must be >= 0 and --budget >= 1")
        return cls(
            study=study,
            options=options,
            workspace=Workspace.resolve(options.workspace),
            conditions=tuple(conditions),
            budget=budget,
            seeds=tuple(CONFIRM_SEED_BASE + i for i in range(n_seeds)),
            max_epochs=conditions[0].config().epochs,
        )

    def debug_config(self, condition: str | None, extra: dict[str, Any] | None = None) -> ExperimentConfig:
        """The config ``--debug`` trains: a condition's overrides, searched keys at a midpoint.

        The test split is evaluated at the end (``eval.test=true``) unless ``--set`` says otherwise.
        """
        name = condition or self.study.debug_condition or self.conditions[-1].name
        plan = self.condition(name)
        values = {k: d.midpoint() for k, d in plan.domains.items()}
        test = {} if "eval.test" in self.options.overrides else {"eval.test": True}
        return from_flat({**plan.flat, **test, **values, **(extra or {})})
