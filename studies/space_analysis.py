"""What a condition's search says about its space: which searched keys mattered, and which
trials trade quality for cost.

Both analyses read the search trials from MLflow (:class:`~studies.runs.RunSet`), as the rest of
the report does, so every number is traceable to a run, and hand them to Optuna's own
estimators as an in-memory study (``optuna.trial.create_trial``, ``Study.add_trials``). The
searcher's own Optuna study is not read: it lives in memory on the driver and is saved as JSON
in the Tune experiment's storage (:mod:`studies.searcher`), which may be a bucket the machine
rebuilding a report (``python -m studies.report``) cannot reach, and its CSV log holds no
domains; the MLflow runs hold the same trials (each run's searched values, how it ended, its
per-epoch scores) with their run ids.

- **Importance** (:func:`estimate_importance`): the share of the validation objective's
  variance each searched key explains, by functional ANOVA over a random forest fitted to the
  trials (Hutter, Hoos & Leyton-Brown, "An Efficient Approach for Assessing Hyperparameter
  Importance", ICML 2014; ``optuna.importance.FanovaImportanceEvaluator``), or by PED-ANOVA
  (Watanabe, Bansal & Hutter, IJCAI 2023; ``PedAnovaImportanceEvaluator``). The forest is
  random, so fANOVA is estimated with several seeds and reported as their mean and standard
  deviation. Only trials that ran the full budget count (Optuna's COMPLETE): a trial ASHA
  stopped has a value from an earlier epoch, and a forest fitted to values of different epochs
  would credit to a key what is only the length of training; Optuna's estimators read COMPLETE
  trials only for the same reason. Where too few ran the full budget (ASHA stops most trials
  of a small search early), the estimate is made at the deepest epoch that enough trials
  reached, from each one's score at that epoch: values of one epoch, as ASHA compares them at
  its rungs; the report names that epoch. A key a trial's configuration does not use (``loss.tau``
  under the triplet loss) is absent from that trial; such a conditional key is estimated among
  the trials that use it, together with the keys those trials share.
- **Pareto front** (:func:`pareto_front`): with a second objective to minimise (a study's
  ``cost``, e.g. seconds per epoch), the full-budget runs no other run beats on both objectives,
  from ``Study.best_trials`` of a two-objective study. The front spans the whole study
  (:func:`study_front`): every search trial that ran the full budget and every finished
  confirmation run, of every condition, on the validation objective, so that a condition with
  nothing to search (the baseline) and one architecture against another are on one front.

The searched domains are recorded on the study's parent run (:func:`domain_tags`), so the
report, rebuilt later with ``python -m studies.report``, knows each key's range and choices.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from icr.config import Scalar
from icr.errors import ConfigError
from studies.space import Domain, parse_domain

if TYPE_CHECKING:
    import optuna

    from studies.runs import RunSet

DOMAINS_TAG = "domains."  # + condition: the parent run's tag holding the condition's domains (JSON)
EVALUATORS = ("fanova", "ped_anova")
SEEDS = (0, 1, 2, 3, 4)  # fANOVA's forest seeds: the estimate is their mean, the spread their std
COMPLETE, PRUNED, FAIL = "COMPLETE", "PRUNED", "FAIL"  # Optuna's TrialState names


# --- the searched domains, recorded on the parent run ---------------------------------------------


def domain_tags(domains: Mapping[str, Mapping[str, Domain]]) -> dict[str, str]:
    """The parent run's tags of each searched condition's domains (condition -> key -> domain):
    ``domains.<condition>`` = ``{"objective.eta": {"uniform": [0.05, 0.3]}}``."""
    return {DOMAINS_TAG + condition: json.dumps({k: {d.kind: list(d.values)} for k, d in keys.items()})
            for condition, keys in domains.items() if keys}


def domains_from_tags(tags: Mapping[str, str], condition: str) -> dict[str, Domain]:
    """A condition's domains as :func:`domain_tags` recorded them ({} when none were)."""
    text = tags.get(DOMAINS_TAG + condition)
    if not text:
        return {}
    try:
        return {key: parse_domain(key, spec) for key, spec in json.loads(text).items()}
    except (ValueError, AttributeError, ConfigError):
        return {}  # a tag this version cannot read: the observed values stand in


def observed_domains(values: Mapping[str, Sequence[Any]]) -> dict[str, Domain]:
    """Domains spanning the values a condition's trials took, for a run recorded without
    :func:`domain_tags`: a range for numbers, a choice for anything else."""
    out = {}
    for key, seen in values.items():
        seen = [v for v in seen if v is not None and not (isinstance(v, float) and math.isnan(v))]
        if not seen:
            continue
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in seen) and \
                min(seen) < max(seen):
            kind = "int" if all(isinstance(v, int) for v in seen) else "uniform"
            out[key] = Domain(key, kind, (min(seen), max(seen)))
        else:
            out[key] = Domain(key, "choice", tuple(dict.fromkeys(seen)))
    return out


def distribution(domain: Domain) -> optuna.distributions.BaseDistribution:
    """A space-file domain as the Optuna distribution :func:`studies.space.suggest` samples."""
    # lazy: keeps optuna off --list and --keys (the catalog imports this module)
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    if domain.kind in ("choice", "grid"):
        return CategoricalDistribution(list(domain.values))
    low, high = domain.values
    if domain.kind == "int":
        return IntDistribution(int(low), int(high))
    return FloatDistribution(float(low), float(high), log=domain.kind == "loguniform")


def contains(domain: Domain, value: Any) -> bool:
    """Whether ``value`` is one the domain can draw (a choice it lists, a number in its range)."""
    if domain.kind in ("choice", "grid"):
        return value in domain.values
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return False
    if domain.kind == "int" and value != int(value):
        return False
    low, high = domain.values
    return low <= value <= high


# --- the search trials, as MLflow recorded them ---------------------------------------------------


@dataclass(frozen=True)
class SearchTrial:
    """One trial of a condition, from its MLflow run: a search trial (or, for the Pareto front,
    a confirmation run, ``phase``).

    Attributes:
        state: how it ended, as Optuna was told: COMPLETE (the full budget), PRUNED (stopped by
            ASHA) or FAIL.
        params: the searched keys its configuration uses, with their values.
        value: the objective at its last epoch (``None`` if it reported none).
        cost: the second objective (the mean of the cost metric over its epochs), if declared.
        scores: the objective at each epoch it reported (``scores[e - 1]``: at epoch ``e``;
            ``None`` where it reported none).
    """

    run_id: str
    name: str
    state: str
    params: dict[str, Scalar]
    value: float | None
    epochs: int
    cost: float | None = None
    condition: str = ""
    phase: str = "search"
    scores: tuple[float | None, ...] = ()


def search_trials(runs: RunSet, condition: str, metric: str, keys: Iterable[str],
                  cost: str = "", phase: str = "search") -> list[SearchTrial]:
    """The search trials (or the runs of another ``phase``) of ``condition`` with their values
    of ``keys`` (a key its configuration does not use is absent)."""
    rows = runs.where(phase=phase, condition=condition)
    out = []
    for _, row in rows.iterrows():
        if row["status"] == "FAILED":
            state = FAIL
        elif str(row.get("budget_complete", "")) == "true":
            state = COMPLETE
        else:
            state = PRUNED
        params = {k: _scalar(row[k]) for k in keys if k in row and not _missing(row[k])}
        spent = None
        if cost:
            series = runs.history(row["run_id"], cost)[1]
            spent = float(np.mean(series)) if series else None
        out.append(SearchTrial(str(row["run_id"]), str(row["run_name"]), state, params,
                               _finite_or_none(row.get(metric)), _epochs(row.get("epochs")), spent,
                               condition, phase, _per_epoch(*runs.history(row["run_id"], metric))))
    return out


def _per_epoch(steps: Sequence[int], values: Sequence[float]) -> tuple[float | None, ...]:
    """A metric's series (its step is the epoch) as the value at each epoch from 1."""
    by_epoch = {int(s): _finite_or_none(v) for s, v in zip(steps, values, strict=True)}
    return tuple(by_epoch.get(e) for e in range(1, max(by_epoch, default=0) + 1))


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or value == ""


def _scalar(value: Any) -> Scalar:
    if isinstance(value, np.generic):
        return value.item()
    return value


def _finite_or_none(value: Any) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def _epochs(value: Any) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


# --- importance -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyImportance:
    """One key's share of the objective's variance: the mean and std over the estimator's seeds,
    from ``trials`` finished trials (among those that use the key, when ``conditional``)."""

    key: str
    mean: float
    std: float
    trials: int
    conditional: bool = False


@dataclass(frozen=True)
class Importance:
    """The importance of a condition's searched keys, or why there is none (``note``)."""

    condition: str
    evaluator: str
    finished: int  # trials that ran the full budget
    needed: int  # finished trials the estimate needs
    keys: tuple[KeyImportance, ...] = ()  # most important first, conditional keys after
    note: str = ""  # '' when estimated
    epoch: int = 0  # the epoch whose scores were used when too few ran the full budget; 0: theirs
    counted: int = 0  # the trials the estimate used


def needed_trials(keys: int) -> int:
    """Finished trials an importance estimate needs over ``keys`` searched keys: at least 3, and
    2 per key. A forest fitted to fewer points than twice the keys has splits its data cannot
    place, and with two points any key that differs between them explains everything."""
    return max(3, 2 * keys)


def estimate_importance(trials: Sequence[SearchTrial], domains: Mapping[str, Domain], mode: str,
                        condition: str = "", *, evaluator: str = "fanova",
                        seeds: Sequence[int] = SEEDS) -> Importance:
    """The importance of each key of ``domains`` for the objective (``mode``: max or min), from
    the COMPLETE ``trials``, or, where too few, from the scores of the deepest epoch enough
    trials reached (:func:`at_deepest_epoch`; module docstring)."""
    if evaluator not in EVALUATORS:
        raise ConfigError(f"importance evaluator {evaluator!r}; known: {', '.join(EVALUATORS)}")
    finished = [t for t in trials if t.state == COMPLETE and t.value is not None]
    needed = needed_trials(len(domains))  # every searched key, whether it varied or not
    base = Importance(condition, evaluator, len(finished), needed, counted=len(finished))
    if len(finished) < needed:
        epoch, finished = at_deepest_epoch(trials, needed)
        if not epoch:
            return replace(base, note=f"{base.finished} trial(s) ran the full budget; the "
                                    f"estimate needs {needed}, and no earlier epoch was reached "
                                    f"by {needed} trials (raise the budget)")
        base = replace(base, epoch=epoch, counted=len(finished))
    common = _varying(finished, [k for k in domains if all(k in t.params for t in finished)])
    if len({t.value for t in finished}) == 1:
        return replace(base, note="every trial counted scored the same: nothing to attribute")
    if not common:
        return replace(base, note="no searched key took two values among the trials counted")
    estimated = list(_shares(finished, domains, common, mode, evaluator, seeds, conditional=False))
    for key in domains:
        if key in common:
            continue
        using = [t for t in finished if key in t.params]
        keys = _varying(using, [k for k in domains if all(k in t.params for t in using)])
        if key in keys and len(using) >= needed_trials(len(keys)) and \
                len({t.value for t in using}) > 1:
            estimated += [k for k in _shares(using, domains, keys, mode, evaluator, seeds,
                                             conditional=True) if k.key == key]
    # a conditional key's share is of the variance among the trials that use it: listed after
    estimated.sort(key=lambda k: (k.conditional, -k.mean, k.key))
    return replace(base, keys=tuple(estimated))


def at_deepest_epoch(trials: Sequence[SearchTrial], needed: int) -> tuple[int, list[SearchTrial]]:
    """The deepest epoch that at least ``needed`` trials (failed ones left out) reported a
    score at, and those trials, each valued at that epoch (as COMPLETE: one study's values);
    ``(0, [])`` when no epoch was reached by so many."""
    usable = [t for t in trials if t.state != FAIL]
    for epoch in range(max((len(t.scores) for t in usable), default=0), 0, -1):
        reached = [replace(t, state=COMPLETE, value=t.scores[epoch - 1]) for t in usable
                   if len(t.scores) >= epoch and t.scores[epoch - 1] is not None]
        if len(reached) >= needed:
            return epoch, reached
    return 0, []


def _varying(trials: Sequence[SearchTrial], keys: Sequence[str]) -> list[str]:
    """The keys that took at least two values among ``trials`` (a constant explains nothing)."""
    return [k for k in keys if len({repr(t.params[k]) for t in trials}) > 1]


def _shares(trials: Sequence[SearchTrial], domains: Mapping[str, Domain], keys: Sequence[str],
            mode: str, evaluator: str, seeds: Sequence[int], *, conditional: bool
            ) -> Iterable[KeyImportance]:
    from optuna.importance import (  # lazy: keeps optuna off --list and --keys (the catalog imports this module)
        FanovaImportanceEvaluator,
        PedAnovaImportanceEvaluator,
        get_param_importances,
    )

    study = optuna_study(trials, domains, keys, ["maximize" if mode == "max" else "minimize"])
    with quiet_optuna():
        if evaluator == "fanova":
            runs = [get_param_importances(study, evaluator=FanovaImportanceEvaluator(seed=s),
                                          params=list(keys)) for s in seeds]
        else:  # deterministic: one run
            runs = [get_param_importances(study, evaluator=PedAnovaImportanceEvaluator(),
                                          params=list(keys))]
    for key in keys:
        values = np.array([r.get(key, 0.0) for r in runs], dtype=float)
        yield KeyImportance(key, float(values.mean()), float(values.std()), len(trials), conditional)


class quiet_optuna:
    """Optuna's chatter off inside the block: its INFO line per study made (the searcher's and
    the analyses'), and PED-ANOVA's warning that it is experimental; the verbosity the process
    had is put back."""

    def __enter__(self) -> None:
        import warnings  # lazy: beside optuna's import, which waits

        import optuna  # lazy: keeps optuna off --list and --keys (the catalog imports this module)

        self._verbosity = optuna.logging.get_verbosity()
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)

    def __exit__(self, *exc: Any) -> None:
        import optuna  # lazy: keeps optuna off --list and --keys (the catalog imports this module)

        self._catch.__exit__(*exc)
        optuna.logging.set_verbosity(self._verbosity)


def optuna_study(trials: Sequence[SearchTrial], domains: Mapping[str, Domain],
                 keys: Sequence[str], directions: Sequence[str],
                 values: Any = None) -> optuna.Study:
    """An in-memory Optuna study of ``trials`` (their ``keys`` only), each COMPLETE with its
    objective, or with ``values(trial)`` (one per direction); trial ``i`` carries its index in
    the user attribute ``index``."""
    import optuna  # lazy: keeps optuna off --list and --keys (the catalog imports this module)

    with quiet_optuna():
        study = optuna.create_study(directions=list(directions))
    dists = {k: distribution(domains[k]) for k in keys}
    study.add_trials([optuna.trial.create_trial(
        params={k: t.params[k] for k in keys if k in t.params},
        distributions={k: dists[k] for k in keys if k in t.params},
        values=values(t) if values is not None else [t.value],
        user_attrs={"index": i}) for i, t in enumerate(trials)])
    return study


def importance_metrics(importance: Importance) -> dict[str, float]:
    """The parent run's metrics of one condition's importance: ``importance.<condition>.<key>``
    (the mean over seeds) and ``importance_spread.<condition>.<key>`` (their std), and
    ``importance_epoch.<condition>`` where the scores of an earlier epoch were used."""
    out = {f"importance_epoch.{importance.condition}": float(importance.epoch)} if \
        importance.epoch and importance.keys else {}
    for k in importance.keys:
        out[f"importance.{importance.condition}.{k.key}"] = round(k.mean, 4)
        out[f"importance_spread.{importance.condition}.{k.key}"] = round(k.std, 4)
    return out


def importance_markdown(importance: Importance, label: str) -> str:
    """A condition's importance as a Markdown table, or the line saying why there is none."""
    over = f"the {importance.counted} full-budget trial(s)"
    if importance.epoch:
        over = (f"the {importance.counted} trial(s) that reached epoch {importance.epoch}, each "
                f"scored at that epoch ({importance.finished} ran the full budget, fewer than the "
                f"{importance.needed} the estimate needs: the score after {importance.epoch} "
                "epoch(s), not the final one)")
    head = (f"### Importance of the searched keys: {label}\n\n"
            f"Share of the variance of the validation objective over {over}, "
            f"{_evaluator_name(importance.evaluator)}.\n\n")
    if importance.note:
        return head + f"No estimate: {importance.note}.\n"
    rows = ["| key | importance | spread over seeds | trials |", "|---|---:|---:|---:|"]
    for k in importance.keys:
        where = f"{k.trials} (those that use it)" if k.conditional else str(k.trials)
        rows.append(f"| `{k.key}` | {k.mean:.3f} | ± {k.std:.3f} | {where} |")
    return head + "\n".join(rows) + "\n"


def _evaluator_name(evaluator: str) -> str:
    if evaluator == "fanova":
        return f"fANOVA (Optuna's FanovaImportanceEvaluator, mean ± std over {len(SEEDS)} forest seeds)"
    return "PED-ANOVA (Optuna's PedAnovaImportanceEvaluator, deterministic)"


# --- the Pareto front -----------------------------------------------------------------------------


def pareto_front(points: Sequence[tuple[float, float]], mode: str) -> list[int]:
    """The indices of the points (objective, cost) no other point beats on both: a better or
    equal objective (``mode``: max or min) at a lower or equal cost, better on one. Optuna's
    ``Study.best_trials`` of a two-objective study; in the points' order."""
    if not points:
        return []
    trials = [SearchTrial(str(i), str(i), COMPLETE, {}, float(v), 0, float(c))
              for i, (v, c) in enumerate(points)]
    study = optuna_study(trials, {}, [], ["maximize" if mode == "max" else "minimize", "minimize"],
                         values=lambda t: [t.value, t.cost])
    return sorted(t.user_attrs["index"] for t in study.best_trials)


@dataclass(frozen=True)
class Front:
    """A study's full-budget runs on the two objectives, and which are on the front."""

    metric: str
    cost: str
    trials: tuple[SearchTrial, ...]  # full-budget runs with both objectives
    front: tuple[int, ...]  # indices into ``trials``, by cost


def front_of(trials: Sequence[SearchTrial], metric: str, cost: str, mode: str) -> Front:
    """The Pareto front of the full-budget ``trials`` (objective against cost)."""
    usable = tuple(t for t in trials if t.state == COMPLETE and t.value is not None
                   and t.cost is not None)
    front = pareto_front([(t.value, t.cost) for t in usable], mode)
    return Front(metric, cost, usable,
                 tuple(sorted(front, key=lambda i: (usable[i].cost, usable[i].run_id))))


def study_front(runs: RunSet, conditions: Sequence[str], metric: str, cost: str,
                mode: str) -> Front:
    """The front of a whole study run: every condition's full-budget search trials and finished
    confirmation runs, on the validation objective (module docstring)."""
    trials = [t for phase in ("search", "confirm") for c in conditions
              for t in search_trials(runs, c, metric, (), cost, phase)]
    return front_of(trials, metric, cost, mode)


def front_markdown(front: Front, mode: str) -> str:
    """The front as a Markdown table, each point its MLflow run."""
    better = "higher" if mode == "max" else "lower"
    head = (f"### Quality against cost\n\n{front.metric} ({better} is better) against "
            f"{front.cost} (its mean over a run's epochs, lower is better) over the "
            f"{len(front.trials)} full-budget run(s) of the study (search trials and "
            "confirmation runs)")
    if not front.trials:
        return head + ": none recorded both.\n"
    rows = [f"| run | condition | phase | {front.metric} | {front.cost} | MLflow run |",
            "|---|---|---|---:|---:|---|"]
    for i in front.front:
        t = front.trials[i]
        rows.append(f"| {t.name} | {t.condition} | {t.phase} | {t.value:.2f} | {t.cost:.4g} | "
                    f"`{t.run_id}` |")
    return head + "; the Pareto front, by cost (tagged `pareto_front=true` in MLflow):\n\n" + \
        "\n".join(rows) + "\n"
