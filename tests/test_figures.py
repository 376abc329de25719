"""Figures read as a reviewer reads them: what is drawn, checked on the matplotlib Axes."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from studies.figures import (  # noqa: E402
    Figure,
    mean_band,
    metric_per_epoch,
    metric_vs_value,
    rank_colours,
    render,
    series_by_value,
    series_per_condition,
)
from studies.runs import RunSet  # noqa: E402

ETAS = (0.05, 0.113, 0.144, 0.175, 0.211, 0.237, 0.269, 0.287)


def _runs(stopped_at: tuple[float, ...] = (0.113, 0.144)) -> RunSet:
    """Eight search trials of a Lagrangian condition (two stopped after epoch 1: those at
    ``stopped_at``), its three confirmation runs at eta 0.237, and two runs of a baseline."""
    rows, history = [], {}
    for i, eta in enumerate(ETAS):
        stopped = eta in stopped_at
        epochs = [1] if stopped else [1, 2, 3, 4]
        run = f"s{i}"
        rows.append({"run_id": run, "phase": "search", "condition": "lagrangian",
                     "budget_complete": "false" if stopped else "true",
                     "epochs": len(epochs), "objective.eta": eta})
        history[(run, "val_rsum")] = (epochs, [20.0 + 40 * e + 100 * eta for e in epochs])
        steps = list(range(0, 40, 10))
        lam = [max(1.0 - (eta - 0.2) * 10 * s / 10, 0.0) for s in steps]  # eta > 0.2 reach 0
        history[(run, "trajectory/lambda")] = (steps, lam)
    for seed in range(3):
        run = f"c{seed}"
        rows.append({"run_id": run, "phase": "confirm", "condition": "lagrangian",
                     "budget_complete": "true", "epochs": 4, "objective.eta": 0.237})
        history[(run, "val_rsum")] = ([1, 2, 3, 4], [100.0 + 10 * e + seed for e in range(4)])
        history[(run, "trajectory/K")] = ([0, 10, 20], [60.0 - seed, 50.0, 40.0 + seed])
    for seed in range(2):
        run = f"b{seed}"
        rows.append({"run_id": run, "phase": "confirm", "condition": "contrastive",
                     "budget_complete": "true", "epochs": 4})
        history[(run, "val_rsum")] = ([1, 2, 3, 4], [90.0 + 5 * e for e in range(4)])
    return RunSet(pd.DataFrame(rows), lambda run, key: history.get((run, key), ([], [])))


@pytest.fixture
def ax():
    fig, axes = plt.subplots()
    yield axes
    plt.close(fig)


def test_mean_band_over_runs_of_different_lengths():
    x, mean, low, high = mean_band([([1, 2, 3], [1.0, 2.0, 3.0]), ([1, 2], [3.0, 4.0])])
    np.testing.assert_allclose(x, [1, 2, 3])
    np.testing.assert_allclose(mean, [2.0, 3.0, 3.0])
    np.testing.assert_allclose(low, [1.0, 2.0, 3.0])
    np.testing.assert_allclose(high, [3.0, 4.0, 3.0])


def test_neighbouring_values_get_visibly_different_colours():
    colours = rank_colours([0.2, 0.21, 0.22, 0.5])  # close values, then a far one
    rgb = [np.array(colours[v][:3]) for v in sorted(colours)]
    steps = [np.linalg.norm(a - b) for a, b in zip(rgb, rgb[1:], strict=False)]
    assert min(steps) > 0.15  # by rank, not by value: 0.2 and 0.21 are far apart on the map
    assert len(rank_colours([0.3])) == 1


def test_confirmation_runs_are_one_mean_line_with_a_band_and_epochs_are_integers(ax):
    assert metric_per_epoch()(_runs(), ax)
    labels = [line.get_label() for line in ax.get_lines()]
    assert "lagrangian (confirm, mean of 3)" in labels and "contrastive (confirm, mean of 2)" in labels
    confirm = ax.get_lines()[labels.index("lagrangian (confirm, mean of 3)")]
    np.testing.assert_allclose(confirm.get_ydata(), [101.0, 111.0, 121.0, 131.0])  # mean of seeds
    assert len(ax.collections) == 2  # one band per condition with several seeds
    ax.figure.canvas.draw()
    ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
    assert all(float(t).is_integer() for t in ticks)


def test_best_value_against_eta_marks_the_choice_and_keeps_stopped_trials_off_the_scale(ax):
    assert metric_vs_value("val_rsum", "objective.eta", "lagrangian")(_runs(), ax)
    labels = [c.get_label() for c in ax.collections]
    assert "chosen: eta=0.237" in labels
    chosen = ax.collections[labels.index("chosen: eta=0.237")].get_offsets()[0]
    assert tuple(chosen) == pytest.approx((0.237, 20 + 160 + 23.7))
    full = ax.collections[labels.index("full budget")].get_offsets()
    assert len(full) == 6 and min(full[:, 1]) > 150  # the stopped trials' 60-ish values not here
    stopped = ax.collections[labels.index("stopped early / failed")]
    assert len(stopped.get_offsets()) == 2
    assert sorted(t.get_text() for t in ax.texts) == ["e1", "e1"]


def test_trials_stopped_outside_the_full_budget_range_stay_on_the_figure(ax):
    """As in the embedded ltd_bound: the lowest and highest eta stopped early, so the crosses
    (drawn in axes fractions) lie outside the full-budget points' range: the x axis takes them in."""
    assert metric_vs_value("val_rsum", "objective.eta", "lagrangian")(_runs((0.05, 0.287)), ax)
    labels = [c.get_label() for c in ax.collections]
    stopped = ax.collections[labels.index("stopped early / failed")].get_offsets()[:, 0]
    low, high = ax.get_xlim()
    assert sorted(stopped) == [0.05, 0.287] and low < 0.05 and high > 0.287


def test_log_series_draws_no_zero_and_says_where_it_reached_zero(ax):
    assert series_by_value("lambda", "objective.eta", "lagrangian", log=True)(_runs(), ax)
    for line in ax.get_lines():
        y = np.asarray(line.get_ydata(), dtype=float)
        assert not (y[np.isfinite(y)] <= 0).any()  # nothing drawn at or below 0, no floor
    labels = [line.get_label() for line in ax.get_lines()]
    assert "eta=0.287 (0 from step 20)" in labels  # 1 - 0.87 * 2 < 0 at step 20
    assert "eta=0.05" in labels  # never reached 0


def test_series_per_condition_is_a_mean_with_a_band(ax):
    assert series_per_condition("K")(_runs(), ax)
    (line,) = ax.get_lines()
    assert line.get_label() == "lagrangian (mean of 3)"
    np.testing.assert_allclose(line.get_ydata(), [59.0, 50.0, 41.0])
    assert len(ax.collections) == 1


def test_render_writes_a_png_only_when_there_is_something_to_draw(tmp_path):
    runs = _runs()
    assert render(Figure("f", "a title", metric_per_epoch()), runs, tmp_path / "f.png")
    assert (tmp_path / "f.png").stat().st_size > 1000
    empty = Figure("g", "nothing", series_by_value("L_rec", "objective.eta", "dual"))
    assert not render(empty, runs, tmp_path / "g.png") and not (tmp_path / "g.png").exists()


def test_best_value_against_a_component_choice_marks_the_chosen_component(ax, tmp_path):
    """loss_search searches ``loss.name``: a category on the x axis, the chosen one starred (its
    report failed with ``float('infonce')``)."""
    rows = [{"run_id": f"s{i}", "phase": "search", "condition": "searched", "loss.name": name,
             "budget_complete": "true" if i else "false", "epochs": 4 if i else 1}
            for i, name in enumerate(["triplet", "triplet_all", "infonce", "triplet_all"])]
    rows.append({"run_id": "c0", "phase": "confirm", "condition": "searched",
                 "loss.name": "infonce", "budget_complete": "true", "epochs": 4})
    runs = RunSet(pd.DataFrame(rows), lambda run, key: ([1], [10.0 * int(run[1:]) + 1]))
    assert metric_vs_value("val_rsum", "loss.name", "searched")(runs, ax)
    labels = [c.get_label() for c in ax.collections]
    star = ax.collections[labels.index("chosen: name=infonce")].get_offsets()[0]
    full = ax.collections[labels.index("full budget")].get_offsets()
    assert star[1] == 21.0 and len(full) == 3
    assert star[0] == full[1][0]  # at infonce's place on the category axis
    assert [t.get_text() for t in ax.texts] == ["e1"]
    assert render(Figure("f", "t", metric_vs_value("val_rsum", "loss.name", "searched")), runs,
                  tmp_path / "f.png")
