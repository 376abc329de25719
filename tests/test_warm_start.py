"""``--warm-start``: an earlier study's trials as observations of a new search, none trained again;
every bad source refused in one line before anything is written."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path

import pytest

from studies.plan import Options, StudyPlan
from studies.run import main
from studies.samplers import SpreadThenTPESampler
from studies.searcher import StudySearcher
from studies.space import ConditionalSpace, Domain
from studies.space_analysis import COMPLETE, PRUNED
from studies.tracking import PARENT_TAG, Tracker
from studies.trials import KEY, TrialSpec
from studies.warm_start import OBSERVED_ATTR, Observation, WarmStart, load_warm_start

from fakes import fake_study

ETA = Domain("objective.eta", "uniform", (0.05, 0.3))
BASE = {"objective.name": "lagrangian", "decoder.name": "ltd"}
EPOCHS = 4


def observed_numbers(study) -> list[int]:
    """The numbers of the trials of an Optuna study that are observations of an earlier study."""
    return [t.number for t in study.get_trials(deepcopy=False) if OBSERVED_ATTR in t.user_attrs]


def score(eta: float, epoch: int) -> float:
    """The fake fit's validation rsum of a Lagrangian trial (tests/fakes.py), without its noise."""
    return (300.0 - 4000.0 * (eta - 0.17) ** 2) * (1.0 - 2.718281828 ** (-epoch / 2.0))


def searcher(seed: int = 0, warm: WarmStart | None = None) -> StudySearcher:
    found = StudySearcher(ConditionalSpace(BASE, (ETA,)),
                          functools.partial(TrialSpec.resolve, "lagrangian", BASE),
                          metric="val_rsum", mode="max", max_t=EPOCHS,
                          sampler=SpreadThenTPESampler(4, seed, ("objective.eta",)))
    if warm is not None:
        found.study.add_trials(warm.trials("lagrangian", {"objective.eta": ETA}, multi=False))
    return found


def search(s: StudySearcher, trials: int) -> list[tuple[float, float]]:
    """Train ``trials`` trials one after another on the seeded objective; (eta, score) each."""
    out = []
    for i in range(trials):
        eta = s.suggest(f"t{i}")[KEY].values["objective.eta"]
        for epoch in range(1, EPOCHS + 1):
            s.on_trial_result(f"t{i}", {"val_rsum": score(eta, epoch), "epoch": epoch})
        s.on_trial_complete(f"t{i}", {"val_rsum": score(eta, EPOCHS), "epoch": EPOCHS})
        out.append((eta, score(eta, EPOCHS)))
    return out


def test_a_warm_started_search_holds_the_earlier_best_untrained_and_needs_fewer_trials():
    cold = search(searcher(), 8)
    best_eta, best = max(cold, key=lambda t: t[1])
    observed = tuple(Observation(f"r{i}", COMPLETE, {"objective.eta": eta}, value, None,
                                 {EPOCHS: value}) for i, (eta, value) in enumerate(cold))
    warm = searcher(seed=1, warm=WarmStart("fake", "parent", {"lagrangian": observed}, {}))
    own = search(warm, 4)
    # the earlier trials are in the study as they were: numbers 0-7, the new ones after them
    assert observed_numbers(warm.study) == list(range(8))
    assert warm.study.trials[cold.index((best_eta, best))].value == best
    # none of them trained again: no new trial drew an earlier value
    assert not {eta for eta, _ in own} & {eta for eta, _ in cold}
    # at least as good as the cold search, with half its trials trained
    assert warm.study.best_value >= best and len(own) < len(cold)
    # the searcher's saved state keeps them: a resumed search has them once
    path = Path(warm.study.study_name)  # any name: written and read back below
    try:
        warm.save(str(path))
        again = searcher(seed=1)
        again.restore(str(path))
        assert observed_numbers(again.study) == list(range(8)) and len(again.study.trials) == 12
    finally:
        path.unlink(missing_ok=True)


def test_pruned_observations_keep_their_scores_for_tpe():
    observed = (Observation("a", PRUNED, {"objective.eta": 0.3}, None, None, {1: 10.0}),
                Observation("b", COMPLETE, {"objective.eta": 0.17}, 250.0, None, {1: 90.0, 4: 250.0}))
    trials = WarmStart("fake", "p", {"lagrangian": observed}, {}).trials(
        "lagrangian", {"objective.eta": ETA}, multi=False)
    assert [t.state.name for t in trials] == ["PRUNED", "COMPLETE"]
    assert trials[0].intermediate_values == {1: 10.0} and trials[0].values is None
    assert trials[1].value == 250.0 and trials[1].user_attrs[OBSERVED_ATTR] == "b"
    costly = Observation("c", COMPLETE, {"objective.eta": 0.17}, 250.0, 3.5, {4: 250.0})
    (two,) = WarmStart("fake", "p", {"lagrangian": (costly,)}, {}).trials(
        "lagrangian", {"objective.eta": ETA}, multi=True)
    assert two.values == [250.0, 3.5] and two.intermediate_values == {}  # none kept with two


# --- a source study in a tracking store, as a finished study leaves it ---------------------------


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """A tracking store with MLflow's tables made (its migrations take seconds): copied, not
    made again, by each test that records a study."""
    folder = tmp_path_factory.mktemp("store")
    Tracker(f"sqlite:///{folder / 'mlflow.db'}", "template").experiment_id  # noqa: B018
    return folder / "mlflow.db"


@pytest.fixture
def record_study(empty_store):
    return functools.partial(_record_study, empty_store)


def _record_study(empty: Path, workspace: Path, key: str = "fake", searched: str = "objective.eta",
                  trials: tuple[tuple[float, int, str], ...] = ()) -> str:
    """A finished study run of ``key`` in ``workspace``'s store: search trials of ``lagrangian``
    given as (eta, epochs reached, status); returns the parent run's id."""
    workspace.mkdir(parents=True, exist_ok=True)
    shutil.copy(empty, workspace / "mlflow.db")
    tracker = Tracker(f"sqlite:///{workspace / 'mlflow.db'}", key, workspace / "mlartifacts")
    parent = tracker.create_run("parent", {"icr.role": "study", "searched.lagrangian": searched,
                                           "searched.contrastive": ""})
    for i, (eta, epochs, status) in enumerate(trials):
        run = tracker.create_run(f"lagrangian eta={eta}", {
            PARENT_TAG: parent, "icr.role": "trial", "phase": "search", "condition": "lagrangian",
            "budget_complete": str(epochs == EPOCHS).lower(), "epochs": str(epochs),
            "tune_trial_id": f"t{i}"}, {"objective.eta": eta, "objective.name": "lagrangian"})
        for epoch in range(1, epochs + 1):
            tracker.log_metrics(run, {"val_rsum": score(eta, epoch), "epoch": epoch}, step=epoch)
        tracker.finish(run, status)
    tracker.finish(parent)
    return parent


def plan_for(tmp_path: Path, workspace: Path) -> StudyPlan:
    return StudyPlan.build(fake_study(tmp_path), Options(workspace=str(workspace)))


def test_a_source_study_s_trials_become_observations(tmp_path, record_study):
    source = tmp_path / "source"
    parent = record_study(source, trials=((0.1, 4, "FINISHED"), (0.17, 4, "FINISHED"),
                                          (0.25, 1, "FINISHED"), (0.2, 2, "FAILED"),
                                          (0.4, 4, "FINISHED")))  # 0.4: outside [0.05, 0.3]
    warm = load_warm_start(str(source), plan_for(tmp_path, tmp_path / "new"))
    assert warm.run_id == parent and "fake in sqlite:///" in warm.source
    observed = warm.observations["lagrangian"]
    assert [(o.params["objective.eta"], o.state) for o in observed] == \
        [(0.1, COMPLETE), (0.17, COMPLETE), (0.25, PRUNED)]  # the failed one is not observed
    assert set(observed[0].params) == {"objective.eta"}  # objective.name: not searched, dropped
    assert observed[1].value == pytest.approx(score(0.17, EPOCHS))
    assert observed[2].scores == {1: pytest.approx(score(0.25, 1))}
    assert warm.dropped == {"lagrangian": 1} and "contrastive" not in warm.observations
    lines = warm.describe()
    assert "lagrangian: 3 observation(s) (2 full budget, 1 stopped early), none trained again" in lines[1]
    assert "1 trial(s) dropped: a value outside this study's domains" in lines[1]


def test_plan_shows_how_many_observations_each_condition_takes(tmp_path, capsys, record_study):
    source = tmp_path / "source"
    record_study(source, trials=((0.1, 4, "FINISHED"), (0.2, 1, "FINISHED")))
    study = fake_study(tmp_path)
    rc = main(["fake", "--plan", "--workspace", str(tmp_path / "new"), "--warm-start", str(source)],
              extra_studies={"fake": study})
    out = capsys.readouterr().out
    assert rc == 0 and "objectives: maximise val_rsum" in out
    assert "lagrangian: 2 observation(s) (1 full budget, 1 stopped early)" in out
    assert not (tmp_path / "new").exists()


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()} \
        if folder.exists() else {}


@pytest.mark.parametrize("case", ["missing study", "missing store", "no shared key", "damaged store"])
def test_a_bad_warm_start_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, case,
                                                                record_study):
    source, new = tmp_path / "source", tmp_path / "new"
    if case == "missing study":
        record_study(source, key="other", trials=((0.1, 4, "FINISHED"),))
    elif case == "no shared key":
        record_study(source, searched="loss.margin", trials=((0.1, 4, "FINISHED"),))
    elif case == "damaged store":
        source.mkdir()
        (source / "mlflow.db").write_bytes(b"SQLite format 3\x00" + b"\x13" * 4000)
    before = files(source)
    spec = "nosuch" if case == "missing store" else str(source)
    capsys.readouterr()
    rc = main(["fake", "--workspace", str(new), "--warm-start", spec],
              extra_studies={"fake": fake_study(tmp_path)})
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: "), err
    if case != "damaged store":  # that one names the store, as every damaged store is named
        assert err[0].startswith(f"error: --warm-start {spec}: ")
    assert files(source) == before and not new.exists()
    expected = {"missing study": "no study fake", "missing store": "holds no study yet",
                "no shared key": "searched loss.margin, none of the keys this study searches "
                                 "(objective.eta)", "damaged store": "damaged"}[case]
    assert expected in err[0]
