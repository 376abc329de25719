"""A study run, resolved and validated before anything is written.

``StudyPlan.build`` turns a study, the command-line options and the search-space file into the flat
overrides of every condition (validated into an ``ExperimentConfig`` once), the domains searched in
it and the settings of the run (workspace, tracking store, Tune storage, resources). Every user
mistake (unknown key, bad value, bad space file, unknown condition, a workspace that is a file, an
unknown URI scheme, a budget of 0, ...) surfaces here as a one-line UserError, before a folder, a
Ray instance or an MLflow run exists. The rest of the pipeline reads the plan, never the options.

Precedence of the flat overrides, lowest first: the ExperimentConfig defaults, the recipe's base
(``--recipe``: the study's ``embedded`` base, its ``smoke`` overrides on top of it, or the paper's
own recipe), the fixed values of the space file, the condition's overrides, the recipe's overrides
of that condition, the ``--set`` overrides. A key set with ``--set`` is no longer searched.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from icr.config import (
    ExperimentConfig,
    Scalar,
    check_paths,
    from_flat,
    is_uri,
    key_specs,
    parse_value,
    to_flat,
    used_keys,
)
from icr.errors import ConfigError, UserError
from icr.train.analyses import check_analyses
from icr.train.tasks import check as check_task
from icr.train.tasks import check_data as check_task_data
from icr.workspace import Workspace, sqlite_file
from studies.catalog import Recipe, Study, space_path
from studies.space import Domain, grid_size, load_space

if TYPE_CHECKING:
    from studies.warm_start import WarmStart

TRIALS_PER_GPU_VARIABLE = "ICR_TRIALS_PER_GPU"  # a machine's --trials-per-gpu (its GPUs' size)
MAX_TRIALS_PER_GPU = 64  # 1/N of a GPU at Ray's precision (0.0001) names N exactly up to 99
CONFIRM_SEED_BASE = 1000  # confirmation seeds are 1000, 1001, ...: never a search trial's seed
TRACKING_SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks")
STORAGE_SCHEMES = ("s3", "gs", "gcs")


@dataclass(frozen=True)
class Options:
    """What the command line chose (see ``python -m studies.run --help``)."""

    overrides: dict[str, str] = field(default_factory=dict)
    smoke: bool = False  # --smoke: the same as --recipe smoke
    recipe: str | None = None  # --recipe (None: embedded, or smoke with --smoke)
    seeds: int | None = None
    budget: int | None = None
    workspace: str | None = None
    tracking_uri: str | None = None
    address: str | None = None
    storage: str | None = None
    cpus_per_trial: int | None = None
    dashboard: bool = True
    trials_per_gpu: int | None = None  # --trials-per-gpu (None: ICR_TRIALS_PER_GPU, else 1)
    gpus: int | None = None  # --gpus with --address: the most GPUs the cluster can reach


@dataclass(frozen=True)
class ConditionPlan:
    name: str
    label: str
    flat: dict[str, Scalar]  # every override of the condition (not the searched keys)
    domains: dict[str, Domain]  # searched keys
    config: ExperimentConfig  # the flat overrides, validated (searched keys at their defaults)

    def trials(self, budget: int) -> int:
        """Search trials of this condition: every point of a grid, else the study's budget."""
        return grid_size(self.domains) or budget

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
    max_epochs: int  # the longest trial's epochs (a condition's own: its config.epochs)
    smoke: bool = False
    recipe: Recipe | None = None  # None: the study's embedded recipe
    overrides: dict[str, str] = field(default_factory=dict)  # the --set values, as given
    tracking_uri: str = ""
    storage_root: str = ""  # Tune storage: --storage (S3, GCS, NFS) or <workspace>/ray
    address: str | None = None  # a Ray cluster to join; None: start a private instance
    cpus_per_trial: int | None = None
    dashboard: bool = True
    trials_per_gpu: int = 1  # trials sharing one GPU (each reserves 1/N of it)
    gpus: int | None = None  # the most GPUs the cluster can reach, as stated (None: read it)
    warm: WarmStart | None = None  # --warm-start: an earlier study's trials (studies.warm_start)

    @property
    def recipe_name(self) -> str:
        return self.recipe.name if self.recipe is not None else "embedded"

    @property
    def analyses(self) -> tuple[str, ...]:
        """The analyses of the confirmation runs: the recipe's, else the study's."""
        return _analyses(self.study, self.recipe)

    @property
    def startup_trials(self) -> int:
        """Quasi-random trials before TPE, per condition (at most the budget)."""
        declared = self.recipe.startup_trials if self.recipe is not None else None
        return min(declared or self.study.startup_trials, self.budget)

    @property
    def early_stopping(self) -> bool:
        """ASHA stops weak search trials (a paper's grid trains every point to the end)."""
        return self.recipe is None or self.recipe.early_stopping

    @property
    def key(self) -> str:
        """Name of the study's MLflow experiment, Tune folder and report folder: the study's
        name, ``-smoke`` or ``-paper`` appended for those recipes."""
        name = self.recipe_name
        return self.study.name if name == "embedded" else f"{self.study.name}-{name}"

    @property
    def state_root(self) -> Path:
        """Local folder of the study's runs: state files, searcher logs (its lock: ``locks/``)."""
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
        warm = {"warm_start": self.warm.run_id} if self.warm is not None else {}
        return {"overrides": dict(sorted(self.overrides.items())), "smoke": self.smoke,
                "recipe": self.recipe_name, "budget": self.budget, "seeds": list(self.seeds),
                **warm}

    def missing(self) -> list[str]:
        """What the recipe needs that the configuration does not give: a dataset it is not for,
        a required file left unset (one line each, naming the key and the fix)."""
        recipe = self.recipe
        if recipe is None:
            return []
        out = []
        for c in self.conditions:
            data = c.config.data.dataset
            if recipe.datasets and data not in recipe.datasets:
                out.append(f"the {recipe.name} recipe of {self.study.name} trains on "
                           f"data.dataset={' or '.join(recipe.datasets)}, not {data}; --set "
                           f"data.dataset=... (or --recipe embedded)")
            flat, used = to_flat(c.config), set(used_keys(c.config))
            out += [f"the {recipe.name} recipe of {self.study.name} needs {key} ({what}); "
                    f"--set {key}=PATH" for key, what in recipe.requires.items()
                    if key in used and not _local(flat[key])]
        return list(dict.fromkeys(out))

    @classmethod
    def build(cls, study: Study, options: Options, strict: bool = True) -> StudyPlan:
        """Validate everything the user gave; raise a one-line UserError at the first mistake.

        With ``strict=False`` (``--plan``) what the recipe needs but lacks (:meth:`missing`) is
        left for the caller to list instead of raised.
        """
        workspace = Workspace.resolve(options.workspace)
        check_workspace(workspace.root)
        recipe = study.recipe(recipe_name(options))
        conditions = _conditions(study, options, recipe)
        for c in conditions:
            if not c.config.epochs:
                raise ConfigError(f"condition {c.name} trains for 0 epochs; set "
                                  f"train.warmup_epochs or train.finetune_epochs above 0")
        n_seeds = options.seeds if options.seeds is not None else (recipe.seeds or study.seeds)
        budget = options.budget if options.budget is not None else (recipe.budget or study.budget)
        if n_seeds < 1:
            raise UserError(f"--seeds {n_seeds}: give at least 1 confirmation seed per condition")
        if budget < 1:
            raise UserError(f"--budget {budget}: give at least 1 trial per condition")
        if options.cpus_per_trial is not None and options.cpus_per_trial < 1:
            raise UserError(f"--cpus-per-trial {options.cpus_per_trial}: give 1 or more CPUs")
        plan = cls(
            study=study, workspace=workspace, conditions=conditions, budget=budget,
            seeds=tuple(CONFIRM_SEED_BASE + i for i in range(n_seeds)),
            max_epochs=max(c.config.epochs for c in conditions), smoke=recipe.name == "smoke", recipe=recipe,
            overrides=dict(options.overrides),
            tracking_uri=check_tracking_uri(options.tracking_uri or workspace.mlflow_uri),
            storage_root=check_storage_uri(options.storage or str(workspace.ray)),
            address=options.address, cpus_per_trial=options.cpus_per_trial,
            dashboard=options.dashboard, trials_per_gpu=trials_per_gpu(options.trials_per_gpu),
            gpus=options.gpus,
        )
        missing = plan.missing()
        if strict and missing:
            raise UserError(missing[0])
        return plan

    def check_data(self) -> dict[str, tuple[str, ...]]:
        """Per condition, every file its runs will read checked by icr
        (:func:`icr.train.tasks.check_data`: names, shapes, dtypes, counts that agree, ids), and
        what preparation will choose (which files serve validation and test, the test's
        protocols); a condition whose data is that of an earlier one is checked once. A problem
        raises a one-line DataError naming the file and the fix. Conditions that lack what the
        recipe needs (:meth:`missing`) or name a local path that does not exist are skipped:
        ``--plan`` lists those instead."""
        if self.missing():
            return {}
        out: dict[str, tuple[str, ...]] = {}
        seen: dict[tuple, tuple[str, ...]] = {}
        for c in self.conditions:
            flat = to_flat(c.config)
            key = tuple((k, flat[k]) for k in used_keys(c.config) if k.startswith(DATA_KEYS))
            if any(_absent(c.config, k) for k, _ in key):
                continue
            if key not in seen:
                seen[key] = check_task_data(c.config, self.workspace)
            out[c.name] = seen[key]
        return out

    def debug_config(self, condition: str | None) -> ExperimentConfig:
        """The config ``--debug`` trains: a condition's overrides, searched keys at a midpoint.

        The test split is evaluated at the end (``eval.test=true``) unless ``--set`` says otherwise.
        """
        plan = self.condition(condition or self.study.debug_condition or self.conditions[-1].name)
        values = {k: d.midpoint() for k, d in plan.domains.items()}
        test = {} if "eval.test" in self.overrides else {"eval.test": True}
        return from_flat({**test, **values}, plan.config)


DATA_KEYS = ("task.", "data.")  # the keys that decide which files a run reads


def _absent(config: ExperimentConfig, key: str) -> bool:
    """``key`` names a local path that does not exist (``--plan`` says MISSING)."""
    spec, value = key_specs()[key], to_flat(config)[key]
    return (spec.path is not None and value != "" and value not in spec.path
            and not _local(value))


def _local(value: Any) -> bool:
    """``value`` names an existing local file or folder (not a bundled asset's name), or a URI
    (where a key takes one, :func:`icr.config.check_paths` allowed it; copied by the data
    check)."""
    return bool(value) and (is_uri(value) or Path(str(value)).expanduser().exists())


def _analyses(study: Study, recipe: Recipe | None) -> tuple[str, ...]:
    return recipe.analyses if recipe is not None and recipe.analyses is not None else study.analyses


def recipe_name(options: Options) -> str:
    """The recipe the options ask for: ``--recipe``, or ``smoke`` for ``--smoke``."""
    if options.smoke and options.recipe not in (None, "smoke"):
        raise UserError(f"--smoke and --recipe {options.recipe}: --smoke is --recipe smoke; give one")
    return "smoke" if options.smoke else (options.recipe or "embedded")


def _conditions(study: Study, options: Options, recipe: Recipe) -> tuple[ConditionPlan, ...]:
    space = load_space(space_path(recipe.space_file or study.space_file),
                       tuple(c.name for c in study.conditions))
    user = {k: parse_value(k, v) for k, v in options.overrides.items()}
    out = []
    for condition in study.conditions:
        section = space.for_condition(condition.name)
        clash = set(section.domains) & set(condition.overrides)
        if clash:
            raise ConfigError(
                f"{space.path}: {sorted(clash)[0]} is searched but condition "
                f"{condition.name} fixes it in studies/papers/{study.name}.py"
            )
        flat = {**recipe.overrides, **section.fixed, **condition.overrides,
                **recipe.conditions.get(condition.name, {}), **user}
        config = from_flat(flat)  # validates every value
        check_paths(config)
        check_task(config)
        check_analyses(config, _analyses(study, recipe))  # each analysis fits the condition's task and data
        flat = {k: v for k, v in to_flat(config).items() if k in flat}
        domains = {k: d for k, d in section.domains.items() if k not in user}
        for domain in domains.values():  # every searched value must make a valid config too
            for value in domain.values:
                check_analyses(from_flat({domain.key: value}, config), _analyses(study, recipe))
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


def trials_per_gpu(given: int | None, environ: Mapping[str, str] = os.environ) -> int:
    """Trials that share one GPU: ``--trials-per-gpu N``, else the machine's setting
    (:data:`TRIALS_PER_GPU_VARIABLE`: how many of a study's trials its GPUs hold is a property
    of the machine, as the workspace is), else 1. A bad value is a one-line UserError."""
    most = MAX_TRIALS_PER_GPU
    if given is not None:
        if not 1 <= given <= most:
            raise UserError(f"--trials-per-gpu {given}: give 1 to {most} trials per GPU")
        return given
    text = environ.get(TRIALS_PER_GPU_VARIABLE, "").strip()
    if not text:
        return 1
    if not text.isdigit() or not 1 <= int(text) <= most:
        raise UserError(f"{TRIALS_PER_GPU_VARIABLE}={text}: give a whole number of trials per GPU, "
                        f"1 to {most} (or unset it)")
    return int(text)


def check_tracking_uri(uri: str) -> str:
    """An MLflow tracking URI of a known kind (sqlite:///..., http(s)://..., a database URL)."""
    scheme = uri.split("://", 1)[0].split("+", 1)[0] if "://" in uri else ""
    if scheme not in TRACKING_SCHEMES:
        raise UserError(f"--tracking-uri {uri}: not an MLflow store; give sqlite:///path/mlflow.db "
                        "or the http(s):// address of an MLflow server")
    if scheme == "sqlite":
        db = sqlite_file(uri)
        if db is None:
            raise UserError(f"--tracking-uri {uri}: give sqlite:///path/mlflow.db (three slashes)")
        check_workspace(db.parent, "--tracking-uri")
    return uri


def check_storage_uri(storage: str) -> str:
    """Tune storage: a local or shared folder, or s3:// / gs:// (what pyarrow reads)."""
    if "://" in storage:
        if storage.split("://", 1)[0] not in STORAGE_SCHEMES:
            raise UserError(f"--storage {storage}: give a folder, s3://BUCKET/PATH or gs://BUCKET/PATH")
        return storage
    folder = Path(storage).expanduser().absolute()  # as the trials read it, from their own cwd
    check_workspace(folder, "--storage")
    return str(folder)
