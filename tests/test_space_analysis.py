"""What a search says about its space: importance on objectives whose answer is known, the
parallel-coordinates figure of a search with pruned and failed trials, and the Pareto front
against a brute-force oracle."""

from __future__ import annotations

import random
from dataclasses import replace

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from studies.catalog import Condition, Study  # noqa: E402
from studies.figures import render  # noqa: E402
from studies.insight import write_insight  # noqa: E402
from studies.runs import RunSet  # noqa: E402
from studies.space import Domain  # noqa: E402
from studies.space_analysis import (  # noqa: E402
    COMPLETE,
    FAIL,
    PRUNED,
    SearchTrial,
    at_deepest_epoch,
    contains,
    domain_tags,
    domains_from_tags,
    estimate_importance,
    front_of,
    importance_markdown,
    importance_metrics,
    needed_trials,
    observed_domains,
    pareto_front,
    search_trials,
    study_front,
)
from studies.space_figures import FAILED_STYLE, PRUNED_STYLE, parallel_coordinates  # noqa: E402

DOMAINS = {
    "loss.name": Domain("loss.name", "choice", ("infonce", "triplet")),
    "objective.eta": Domain("objective.eta", "uniform", (0.05, 0.3)),
    "loss.tau": Domain("loss.tau", "loguniform", (0.02, 0.2)),  # used by infonce only
}


def synthetic(n: int, seed: int = 0, decide: str = "objective.eta") -> list[SearchTrial]:
    """``n`` full-budget trials whose score is decided by ``decide`` (eta: a peak at 0.17;
    loss.name: infonce 40 points better) plus a little noise; tau, where used, is pure noise."""
    rng = random.Random(seed)
    trials = []
    for i in range(n):
        name = rng.choice(["infonce", "triplet"])
        params = {"loss.name": name, "objective.eta": rng.uniform(0.05, 0.3)}
        if name == "infonce":
            params["loss.tau"] = 0.02 * 10 ** rng.random()
        if decide == "objective.eta":
            score = 300 - 4000 * (params["objective.eta"] - 0.17) ** 2
        else:
            score = 300 - (40 if name == "triplet" else 0)
        trials.append(SearchTrial(f"r{i}", f"t{i}", COMPLETE, params, score + rng.uniform(-1, 1), 4))
    return trials


def shares(importance):
    return {k.key: k for k in importance.keys}


def test_the_key_that_decides_the_score_ranks_first_and_the_noise_last():
    importance = estimate_importance(synthetic(24), DOMAINS, "max", "lagrangian")
    found = shares(importance)
    assert importance.keys[0].key == "objective.eta" and found["objective.eta"].mean > 0.7
    assert found["objective.eta"].mean - 2 * found["objective.eta"].std > \
        found["loss.name"].mean + 2 * found["loss.name"].std
    assert not found["objective.eta"].conditional and found["objective.eta"].trials == 24
    # tau is used by the infonce trials only: estimated among them, and it is noise there too
    tau = found["loss.tau"]
    assert tau.conditional and tau.trials == sum("loss.tau" in t.params for t in synthetic(24))
    assert tau.mean < 0.3
    assert all(k.std >= 0 for k in importance.keys) and importance.note == ""


def test_a_categorical_key_that_decides_the_score_ranks_first():
    importance = estimate_importance(synthetic(24, seed=1, decide="loss.name"), DOMAINS, "max")
    assert importance.keys[0].key == "loss.name" and shares(importance)["loss.name"].mean > 0.7


def test_ped_anova_ranks_the_deciding_key_first_in_one_deterministic_run():
    importance = estimate_importance(synthetic(24, seed=1), DOMAINS, "max", evaluator="ped_anova")
    assert importance.keys[0].key == "objective.eta" and importance.keys[0].mean > 0.7
    assert all(k.std == 0.0 for k in importance.keys)  # no seeds: one run, no spread


def test_minimising_ranks_the_same_keys():
    trials = [replace(t, value=-t.value) for t in synthetic(24)]
    assert estimate_importance(trials, DOMAINS, "min", seeds=(0,)).keys[0].key == "objective.eta"


def test_only_full_budget_trials_count():
    trials = synthetic(24)
    # trials ASHA stopped, whose early scores would say the loss decides everything
    stopped = [SearchTrial(f"p{i}", f"p{i}", PRUNED, {**t.params, "loss.name": "triplet"}, 0.0, 1)
               for i, t in enumerate(synthetic(24, seed=5))]
    assert estimate_importance(trials + stopped, DOMAINS, "max", seeds=(0,)) == \
        estimate_importance(trials, DOMAINS, "max", seeds=(0,))


def test_too_few_full_budget_trials_give_a_line_not_a_number():
    trials = synthetic(3)
    trials += [replace(t, state=PRUNED) for t in synthetic(6, seed=2)]
    importance = estimate_importance(trials, DOMAINS, "max", "lagrangian")
    assert importance.keys == () and importance.finished == 3
    assert importance.needed == needed_trials(3) == 6
    text = importance_markdown(importance, "BL + LTD")
    assert "No estimate: 3 trial(s) ran the full budget; the estimate needs 6" in text
    assert "|" not in text


def test_too_few_full_budget_trials_are_estimated_at_the_deepest_epoch_enough_reached():
    """As in the embedded recipe: ASHA let 2 of 8 trials run the full budget, all 8 reached
    epoch 1 and 3 epoch 2. One key searched (3 trials needed): estimated at epoch 2, from each
    trial's score there; a key that decides the early scores ranks first."""
    domains = {"objective.eta": DOMAINS["objective.eta"], "loss.name": DOMAINS["loss.name"]}
    rng = random.Random(3)
    trials = []
    for i in range(12):
        params = {"objective.eta": rng.uniform(0.05, 0.3), "loss.name": rng.choice(["infonce", "triplet"])}
        early = [100 - 800 * (params["objective.eta"] - 0.17) ** 2 + e * 10 + rng.uniform(-0.5, 0.5)
                 for e in range(4)]
        depth = 4 if i < 2 else 2 if i < 5 else 1  # full budget, stopped at rung 2, at rung 1
        trials.append(SearchTrial(f"r{i}", f"t{i}", COMPLETE if depth == 4 else PRUNED, params,
                                  early[depth - 1], depth, scores=tuple(early[:depth])))
    trials.append(SearchTrial("f", "f", FAIL, trials[0].params, None, 3, scores=(999.0, 999.0, 999.0)))
    importance = estimate_importance(trials, domains, "max", "lagrangian", seeds=(0, 1))
    assert needed_trials(2) == 4 and importance.finished == 2
    assert importance.epoch == 2 and importance.counted == 5  # 2 full budget + 3 stopped at 2
    assert [k.key for k in importance.keys][0] == "objective.eta"
    text = importance_markdown(importance, "BL + LTD")
    assert "over the 5 trial(s) that reached epoch 2, each scored at that epoch (2 ran the full " \
           "budget, fewer than the 4 the estimate needs" in text
    assert importance_metrics(importance)["importance_epoch.lagrangian"] == 2.0


def test_the_deepest_epoch_values_each_trial_at_that_epoch_and_leaves_failures_out():
    trials = [SearchTrial("a", "a", COMPLETE, {}, 3.0, 3, scores=(1.0, 2.0, 3.0)),
              SearchTrial("b", "b", PRUNED, {}, 5.0, 2, scores=(4.0, 5.0)),
              SearchTrial("c", "c", PRUNED, {}, 6.0, 1, scores=(6.0,)),
              SearchTrial("d", "d", FAIL, {}, None, 2, scores=(7.0, 8.0)),
              SearchTrial("e", "e", PRUNED, {}, None, 2, scores=(9.0, None))]
    epoch, counted = at_deepest_epoch(trials, 2)
    assert epoch == 2 and [(t.run_id, t.value, t.state) for t in counted] == \
        [("a", 2.0, COMPLETE), ("b", 5.0, COMPLETE)]
    epoch, counted = at_deepest_epoch(trials, 4)
    assert epoch == 1 and [t.value for t in counted] == [1.0, 4.0, 6.0, 9.0]
    assert at_deepest_epoch(trials, 5) == (0, [])


def test_an_objective_that_never_varied_is_said_so():
    trials = [replace(t, value=1.0) for t in synthetic(8)]
    importance = estimate_importance(trials, DOMAINS, "max")
    assert importance.keys == () and "scored the same" in importance.note


def test_domains_round_trip_through_the_parent_run_s_tags():
    tags = domain_tags({"lagrangian": DOMAINS, "contrastive": {}})
    assert set(tags) == {"domains.lagrangian"}
    assert domains_from_tags(tags, "lagrangian") == DOMAINS
    assert domains_from_tags(tags, "contrastive") == {}
    assert domains_from_tags({"domains.x": "{not json"}, "x") == {}
    seen = observed_domains({"a": [0.1, 0.3, float("nan")], "b": ["x", "y", "x"], "c": [2, 5]})
    assert seen["a"] == Domain("a", "uniform", (0.1, 0.3))
    assert seen["b"] == Domain("b", "choice", ("x", "y")) and seen["c"].kind == "int"
    assert contains(DOMAINS["objective.eta"], 0.3) and not contains(DOMAINS["objective.eta"], 0.31)
    assert contains(DOMAINS["loss.name"], "triplet") and not contains(DOMAINS["loss.name"], "nce")


# --- the parallel-coordinates figure ---------------------------------------------------------------


def mixed_search() -> list[SearchTrial]:
    trials = synthetic(5)
    trials.append(SearchTrial("p1", "p1", PRUNED, {"loss.name": "triplet", "objective.eta": 0.1},
                              120.0, 1))
    trials.append(SearchTrial("p2", "p2", PRUNED, {"loss.name": "infonce", "objective.eta": 0.2,
                                                   "loss.tau": 0.05}, 110.0, 2))
    trials.append(SearchTrial("f1", "f1", FAIL, {"loss.name": "infonce", "objective.eta": 0.29,
                                                 "loss.tau": 0.1}, None, 1))
    return trials


def styled(ax, style):
    return [line for line in ax.get_lines()
            if line.get_linestyle() == style["ls"] and line.get_color() == style["color"]]


def test_parallel_coordinates_draw_every_trial_with_pruned_and_failed_apart(tmp_path):
    fig, ax = plt.subplots()
    try:
        trials = mixed_search()
        runs = RunSet(pd.DataFrame(), lambda run, key: ([], []))
        assert parallel_coordinates(trials, DOMAINS, "val_rsum", "max")(runs, ax)
        full = [line for line in ax.get_lines() if len(line.get_xdata()) == len(DOMAINS) + 1]
        assert len(full) == 5  # the full-budget trials reach the objective's axis ...
        colours = {tuple(line.get_color()) for line in full}
        assert len(colours) == 5  # ... each in the colour of its score
        pruned, failed = styled(ax, PRUNED_STYLE), styled(ax, FAILED_STYLE)
        assert len(pruned) == 2 and len(failed) == 1  # drawn apart, ending before the objective
        assert all(len(line.get_xdata()) == len(DOMAINS) for line in pruned + failed)
        # a triplet trial does not use tau: its line has a gap on tau's axis
        triplet = next(line for line in pruned if pd.isna(line.get_ydata()[2]))
        assert triplet is not None
        assert [t.get_text() for t in ax.get_xticklabels()] == [*DOMAINS, "val_rsum"]
        texts = {t.get_text() for t in ax.texts}
        assert {"infonce", "triplet", "0.05", "0.3", "0.02", "0.2"} <= texts  # axes labelled
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend == ["full budget (5)", "stopped by ASHA (2)", "failed (1)"]
    finally:
        plt.close(fig)


def test_the_figure_renders_to_a_png(tmp_path):
    from studies.space_figures import parallel_figure

    figure = parallel_figure("lagrangian", "BL + LTD", mixed_search(), DOMAINS, "val_rsum", "max")
    runs = RunSet(pd.DataFrame(), lambda run, key: ([], []))
    assert render(figure, runs, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 5000
    empty = parallel_figure("x", "x", [], DOMAINS, "val_rsum", "max")
    assert not render(empty, runs, tmp_path / "e.png") and not (tmp_path / "e.png").exists()


# --- the Pareto front -----------------------------------------------------------------------------


def brute_force_front(points, mode):
    sign = 1 if mode == "max" else -1

    def dominates(a, b):
        better_or_equal = sign * a[0] >= sign * b[0] and a[1] <= b[1]
        return better_or_equal and (sign * a[0] > sign * b[0] or a[1] < b[1])

    return [i for i, p in enumerate(points) if not any(dominates(q, p) for q in points)]


@pytest.mark.parametrize("mode", ["max", "min"])
def test_the_pareto_front_is_the_brute_force_one(mode):
    rng = random.Random(3)
    for n in (1, 2, 5, 30):
        points = [(float(rng.randint(0, 8)), float(rng.randint(0, 8))) for _ in range(n)]
        assert pareto_front(points, mode) == brute_force_front(points, mode), points
    square = [(0.0, 0.0), (1.0, 1.0), (1.0, 0.0), (0.0, 1.0)]
    assert pareto_front(square, mode) == ([2] if mode == "max" else [0])
    assert pareto_front([], mode) == []


def test_the_front_holds_full_budget_runs_by_cost():
    trials = [SearchTrial("a", "a", COMPLETE, {}, 300.0, 4, 9.0),
              SearchTrial("b", "b", COMPLETE, {}, 280.0, 4, 3.0),
              SearchTrial("c", "c", COMPLETE, {}, 270.0, 4, 5.0),  # worse and dearer than b
              SearchTrial("d", "d", PRUNED, {}, 400.0, 1, 1.0),  # stopped early: not a point
              SearchTrial("e", "e", COMPLETE, {}, 250.0, 4, None)]  # no cost recorded
    front = front_of(trials, "val_rsum", "epoch_time_s", "max")
    assert [t.run_id for t in front.trials] == ["a", "b", "c"]
    assert [front.trials[i].run_id for i in front.front] == ["b", "a"]


# --- the report's section, from runs as MLflow holds them ------------------------------------------


def study_runs() -> RunSet:
    """Ten search trials of a Lagrangian condition (every fourth stopped early), its confirmation
    runs and a baseline's, each with a cost that grows with eta (the baseline's the lowest)."""
    rng = random.Random(0)
    rows, history = [], {}
    for i in range(10):
        eta = rng.uniform(0.05, 0.3)
        stopped = i % 4 == 3
        rows.append({"run_id": f"s{i}", "run_name": f"lagrangian eta={eta:.3g}", "status": "FINISHED",
                     "phase": "search", "condition": "lagrangian", "epochs": 1 if stopped else 4,
                     "budget_complete": "false" if stopped else "true", "objective.eta": eta,
                     "val_rsum": 300 - 4000 * (eta - 0.17) ** 2})
        history[(f"s{i}", "epoch_time_s")] = ([1, 2], [1.0 + eta * 10, 1.0 + eta * 10])
    for seed, (condition, value, cost) in enumerate([("lagrangian", 301.0, 2.7), ("contrastive", 250.0, 0.5)]):
        rows.append({"run_id": f"c{seed}", "run_name": f"{condition} seed={seed}", "status": "FINISHED",
                     "phase": "confirm", "condition": condition, "epochs": 4, "budget_complete": "true",
                     "val_rsum": value})
        history[(f"c{seed}", "epoch_time_s")] = ([1, 2, 3, 4], [cost] * 4)
    return RunSet(pd.DataFrame(rows), lambda run, key: history.get((run, key), ([], [])))


def test_the_report_section_from_runs_as_mlflow_holds_them(tmp_path):
    runs = study_runs()
    study = Study("s", "s", {}, "x.yaml", (Condition("contrastive", "BL"),
                                           Condition("lagrangian", "BL + LTD")),
                  cost="epoch_time_s")
    tags = {"searched.lagrangian": "objective.eta", "searched.contrastive": "",
            **domain_tags({"lagrangian": {"objective.eta": DOMAINS["objective.eta"]}})}
    insight = write_insight(study, runs, tags, tmp_path)
    assert insight.metrics["importance.lagrangian.objective.eta"] == pytest.approx(1.0)
    assert "importance_spread.lagrangian.objective.eta" in insight.metrics
    for name in ("importance_lagrangian.png", "parallel_lagrangian.png", "pareto.png"):
        assert (tmp_path / name).stat().st_size > 5000 and name in insight.files
    assert not (tmp_path / "parallel_contrastive.png").exists()  # nothing searched there
    text = (tmp_path / "search_space.md").read_text()
    assert "| `objective.eta` | 1.000 |" in text and "### Quality against cost" in text
    # the front spans the study: the baseline's cheap confirmation run and the search trials
    points = [t for phase in ("search", "confirm") for c in ("contrastive", "lagrangian")
              for t in search_trials(runs, c, "val_rsum", [], "epoch_time_s", phase)
              if t.state == COMPLETE]
    oracle = {points[i].run_id for i in brute_force_front([(t.value, t.cost) for t in points], "max")}
    assert set(insight.front_runs) == oracle and {"c0", "c1"} <= oracle
    assert all(f"`{run}`" in text for run in insight.front_runs)  # each point names its run
    assert study_front(runs, ["lagrangian"], "val_rsum", "epoch_time_s", "max").trials


def test_one_searched_key_is_estimated_from_three_full_budget_trials():
    # one searched key: its share is the whole explained variance, by construction
    trials = [SearchTrial(str(i), str(i), COMPLETE, {"objective.eta": e}, 300 - 4000 * (e - 0.17) ** 2, 4)
              for i, e in enumerate(x / 10 for x in range(1, 4))]
    importance = estimate_importance(trials, {"objective.eta": DOMAINS["objective.eta"]}, "max")
    assert [k.key for k in importance.keys] == ["objective.eta"]
    assert importance.keys[0].mean == pytest.approx(1.0)
    assert estimate_importance(trials[:2], {"objective.eta": DOMAINS["objective.eta"]}, "max").note
