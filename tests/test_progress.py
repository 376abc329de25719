"""The driver's status line: counts, best so far, elapsed and the estimate of the rest, every
30 s of a clock and at each trial's end (a fake clock: nothing sleeps)."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

import pytest

from studies.progress import DONE, RUNNING, WAITING, Progress, TrialView, _duration, say_now
from studies.trials import KEY, TrialSpec
from studies.tuning import ProgressCallback


class Clock:
    """Seconds that pass only when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_line_counts_the_trials_and_shows_the_best_with_its_values() -> None:
    clock = Clock()
    progress = Progress("search lagrangian", expected=8, max_epochs=4, metric="val_rsum",
                        slots=2, clock=clock)
    progress.on_result("a", {"epoch": 1, "val_rsum": 150.0, "time_this_iter_s": 60.0}, "lagrangian eta=0.1")
    progress.on_result("b", {"epoch": 1, "val_rsum": 188.24, "time_this_iter_s": 60.0},
                       "lagrangian eta=0.237")
    progress.on_result("a", {"epoch": 2, "val_rsum": 170.0, "time_this_iter_s": 60.0}, "lagrangian eta=0.1")
    clock.now += 312
    trials = [TrialView("a", DONE, 4), TrialView("b", RUNNING, 2), TrialView("c", RUNNING, 1),
              TrialView("d", WAITING)]
    line = progress.line(trials)
    assert line.startswith("search lagrangian: 1 done, 2 running, 5 left; ")
    assert "best val_rsum 188.2 (lagrangian eta=0.237)" in line
    assert "5m12s elapsed" in line
    # The rest: running trials to the full budget (2 + 3 epochs), the 5 not started at the full
    # budget while none has finished in this run (20): 25 epochs of 60 s on 2 slots, less the
    # epoch b has trained since its report 312 s ago (at most one: 60 s).
    assert line.endswith(f"about {_duration((25 * 60 - 60) / 2)} left")


def test_the_estimate_uses_the_length_of_the_trials_that_ended() -> None:
    progress = Progress("search x", expected=5, max_epochs=4, metric="val_rsum", slots=1,
                        clock=Clock())
    progress.on_result("a", {"epoch": 1, "val_rsum": 1.0, "time_this_iter_s": 10.0}, "")
    progress.on_trial_end(1)  # stopped by ASHA after one epoch
    progress.on_trial_end(3)
    ended = [TrialView("a", DONE, 1), TrialView("b", DONE, 3)]
    # 2 trials not started, expected to run (1 + 3) / 2 = 2 epochs each; one running at epoch 1.
    assert progress.seconds_left([*ended, TrialView("r", RUNNING, 1)]) == pytest.approx((3 + 4) * 10.0)
    everything = [*ended, *(TrialView(t, DONE, 4) for t in "cde")]
    assert progress.seconds_left(everything) == 0.0


def test_the_estimate_falls_while_a_long_epoch_trains() -> None:
    """A MiniLM confirmation run: epochs of 10 min. The rest counts the time since the trial's
    last report (or its start) as trained, up to one epoch, so it does not stand still for ten
    minutes at a time."""
    clock = Clock()
    progress = Progress("confirm", expected=1, max_epochs=3, metric="val_rsum", clock=clock)
    progress.on_start("a")
    clock.now += 600.0
    progress.on_result("a", {"epoch": 1, "val_rsum": 70.0, "time_this_iter_s": 600.0}, "")
    running = [TrialView("a", RUNNING, 1)]
    assert progress.seconds_left(running) == pytest.approx(2 * 600.0)
    clock.now += 250.0
    assert progress.seconds_left(running) == pytest.approx(2 * 600.0 - 250.0)
    clock.now += 1000.0  # the epoch takes longer than the last: no less than the last epoch left
    assert progress.seconds_left(running) == pytest.approx(600.0)


def test_a_trial_not_yet_reported_is_timed_from_its_start() -> None:
    clock = Clock()
    progress = Progress("confirm", expected=2, max_epochs=3, metric="val_rsum", slots=2,
                        clock=clock)
    progress.on_result("a", {"epoch": 3, "val_rsum": 70.0, "time_this_iter_s": 600.0}, "")
    progress.on_start("b")  # started, or resumed by a restored Tuner
    clock.now += 100.0
    trials = [TrialView("a", DONE, 3), TrialView("b", RUNNING, 0)]
    assert progress.seconds_left(trials) == pytest.approx(3 * 600.0 - 100.0)
    # A running trial the callback never saw start (the driver began after it): whole epochs.
    assert progress.seconds_left([TrialView("a", DONE, 3), TrialView("c", RUNNING, 0)]) == \
        pytest.approx(3 * 600.0)


def test_a_confirmation_times_each_condition_by_its_own_epochs() -> None:
    """ltd_architectures' confirmation: VSRN's runs done at 45 s an epoch, TERN's at 200 s. At
    the run's mean epoch (VSRN's six and TERN's first two: 84 s), the two epochs each TERN run
    has left took 2m48s instead of 6m40s."""
    progress = Progress("confirm", expected=6, max_epochs=3, metric="val_rsum", slots=2,
                        clock=Clock(), groups={"vsrn": 2, "tern": 2, "tern_dual": 2})
    for trial in ("v1", "v2"):
        for epoch in (1, 2, 3):
            progress.on_result(trial, {"epoch": epoch, "time_this_iter_s": 45.0}, "", "vsrn")
    for trial in ("t1", "t2"):
        progress.on_result(trial, {"epoch": 1, "time_this_iter_s": 200.0}, "", "tern")
    trials = [TrialView("v1", DONE, 3, "vsrn"), TrialView("v2", DONE, 3, "vsrn"),
              TrialView("t1", RUNNING, 1, "tern"), TrialView("t2", RUNNING, 1, "tern")]
    # TERN: 2 epochs left of 200 s on each slot. tern_dual, not measured yet: 2 runs of 3 epochs
    # at the run's mean epoch, (6 x 45 + 2 x 200) / 8 s, after them.
    mean = (6 * 45.0 + 2 * 200.0) / 8
    assert progress.seconds_left(trials) == pytest.approx((2 * 2 * 200.0 + 2 * 3 * mean) / 2)
    assert progress.line(trials).endswith(f"about {_duration(400.0 + 3 * mean)} left")


def test_before_any_epoch_the_rest_is_not_estimated_and_min_mode_keeps_the_lowest() -> None:
    progress = Progress("confirm", expected=2, max_epochs=2, metric="val_loss", mode="min",
                        clock=Clock())
    assert progress.line([TrialView("a", RUNNING)]) == (
        "confirm: 0 done, 1 running, 1 left; 0m00s elapsed, the rest estimated after the first epoch")
    progress.on_result("a", {"epoch": 1, "val_loss": 2.0}, "dual, train.seed=1000")
    progress.on_result("b", {"epoch": 1, "val_loss": 3.0}, "dual, train.seed=1001")
    assert "best val_loss 2.0 (dual, train.seed=1000)" in progress.line([])
    # A trial's latest score counts (the one it is judged on), not its best epoch.
    progress.on_result("a", {"epoch": 2, "val_loss": 4.0}, "dual, train.seed=1000")
    assert "best val_loss 3.0 (dual, train.seed=1001)" in progress.line([])


def tune_config(condition: str, values: dict[str, Any]) -> dict[str, Any]:
    """A trial's Tune config: its TrialSpec (the platform's resolved trial)."""
    return {KEY: TrialSpec.resolve(condition, {}, values)}


@dataclass
class FakeTrial:
    """What ProgressCallback reads of a Tune trial."""

    trial_id: str
    config: dict[str, Any]
    status: str = "PENDING"
    last_result: dict[str, Any] = field(default_factory=dict)


def test_the_callback_writes_a_line_every_interval_without_results_and_at_each_end() -> None:
    clock, said = Clock(), []
    progress = Progress("search lagrangian", expected=3, max_epochs=2, metric="val_rsum",
                        slots=2, clock=clock)
    callback = ProgressCallback(progress, say=said.append, interval=30.0)
    a = FakeTrial("a", tune_config("lagrangian", {"objective.eta": 0.25}), "RUNNING")
    b = FakeTrial("b", tune_config("lagrangian", {"objective.eta": 0.1}), "RUNNING")
    trials = [a, b]
    for trial in trials:
        callback.on_trial_start(iteration=0, trials=trials, trial=trial)
    assert progress.last_seen == {"a": clock.now, "b": clock.now}
    for _ in range(10):  # Tune's loop turns; 29 s pass: nothing yet
        clock.now += 2.9
        callback.on_step_end(iteration=0, trials=trials)
    assert said == []
    clock.now += 1.0  # 30 s without a result: a line
    callback.on_step_end(iteration=0, trials=trials)
    assert said == ["search lagrangian: 0 done, 2 running, 1 left; "
                    "0m30s elapsed, the rest estimated after the first epoch"]
    callback.on_step_end(iteration=0, trials=trials)  # not again before 30 more seconds
    assert len(said) == 1

    a.last_result = {"epoch": 2, "val_rsum": 190.0, "time_this_iter_s": 12.0}
    callback.on_trial_result(iteration=0, trials=trials, trial=a, result=a.last_result)
    callback.on_trial_complete(iteration=0, trials=trials, trial=a)  # Tune: still RUNNING here
    assert said[1] == "  trial a [lagrangian eta=0.25]: 2 epoch(s), val_rsum 190.00 (full budget)"
    assert said[2].startswith("search lagrangian: 1 done, 1 running, 1 left; "
                              "best val_rsum 190.0 (lagrangian eta=0.25); 0m30s elapsed, about ")
    clock.now += 29.0  # the end of a trial restarts the 30 s
    callback.on_step_end(iteration=0, trials=trials)
    assert len(said) == 3
    clock.now += 1.0
    a.status = "TERMINATED"
    callback.on_step_end(iteration=0, trials=trials)
    assert said[3].startswith("search lagrangian: 1 done, 1 running, 1 left; ")


def test_the_epoch_a_restored_trial_reports_again_is_not_timed_again() -> None:
    """A restored trial reports the epoch it continues after again
    (studies.trainable.resume_point), its ``time_this_iter_s`` the seconds the worker took to
    start and restore (0.5 here), not an epoch's: the estimate would fall at every restore. Its
    score still counts; the next epoch is timed."""
    clock = Clock()
    progress = Progress("search lagrangian", expected=1, max_epochs=4, metric="val_rsum", clock=clock)
    callback = ProgressCallback(progress, say=lambda line: None, interval=30.0)
    trial = FakeTrial("a", tune_config("lagrangian", {"objective.eta": 0.25}), "RUNNING",
                      {"epoch": 2, "val_rsum": 150.0, "time_this_iter_s": 60.0})  # restored
    callback.on_trial_start(iteration=0, trials=[trial], trial=trial)
    for epoch, seconds, score in ((2, 0.5, 150.0), (3, 62.0, 170.0)):
        trial.last_result = {"epoch": epoch, "val_rsum": score, "time_this_iter_s": seconds}
        callback.on_trial_result(iteration=0, trials=[trial], trial=trial, result=trial.last_result)
    assert progress.epoch_seconds == {"lagrangian": [62.0]}
    assert progress.best == (170.0, "lagrangian eta=0.25")


def test_the_callback_survives_being_pickled_into_a_tune_experiment(capsys) -> None:
    said: list[str] = []
    progress = Progress("confirm", expected=2, max_epochs=2, metric="val_rsum", clock=Clock())
    callback = ProgressCallback(progress, say=lambda line: said.append(line), interval=0.0)
    restored = pickle.loads(pickle.dumps(callback))  # the lambda and the fake clock stay here
    assert restored.progress.title == "confirm" and restored.progress.expected == 2
    assert restored.say is say_now and restored.progress.clock is not progress.clock
    # A restored Tuner: a trial that had finished counts, with its last result as the best.
    done = FakeTrial("a", tune_config("dual", {"train.seed": 1000}), "TERMINATED",
                     {"epoch": 2, "val_rsum": 201.0})
    restored.on_step_end(iteration=0, trials=[done])
    assert capsys.readouterr().out.startswith(
        "confirm: 1 done, 0 running, 1 left; best val_rsum 201.0 (dual seed=1000); 0m00s elapsed")


def test_in_a_terminal_the_status_is_a_bar_and_the_trial_lines_pass_above_it(capsys) -> None:
    clock = Clock()
    progress = Progress("search lagrangian", expected=2, max_epochs=2, metric="val_rsum", clock=clock)
    callback = ProgressCallback(progress, interval=30.0, bar=True)
    trial = FakeTrial("a", tune_config("lagrangian", {"objective.eta": 0.25}), "RUNNING",
                      {"epoch": 2, "val_rsum": 190.0, "time_this_iter_s": 3.0})
    callback.on_trial_result(iteration=0, trials=[trial], trial=trial, result=trial.last_result)
    clock.now += 1.0  # the bar is refreshed every second
    callback.on_step_end(iteration=0, trials=[trial])
    callback.on_trial_complete(iteration=0, trials=[trial], trial=trial)
    callback.on_experiment_end(trials=[trial])
    out, err = capsys.readouterr()
    assert out.rstrip().splitlines() == [
        "  trial a [lagrangian eta=0.25]: 2 epoch(s), val_rsum 190.00 (full budget)"]
    assert "search lagrangian 1/2 trials" in err and "best val_rsum 190.0 (lagrangian eta=0.25)" in err


def test_a_trial_whose_steps_fell_back_to_eager_ones_is_named_with_the_reason() -> None:
    progress = Progress("search lagrangian", expected=4, max_epochs=4, metric="val_rsum",
                        clock=Clock())
    eager = {"mode": "eager", "reason": "no CUDA", "fell_back": False}  # a CPU trial: as meant
    failed = {"mode": "eager", "reason": "capture failed: operation not permitted",
              "fell_back": True}
    progress.on_result("a", {"epoch": 1, "val_rsum": 150.0, "steps": eager}, "lagrangian eta=0.1")
    assert "eager steps" not in progress.line([TrialView("a", RUNNING, 1)])
    progress.on_result("b", {"epoch": 1, "val_rsum": 140.0, "steps": failed}, "lagrangian eta=0.2")
    line = progress.line([TrialView("a", RUNNING, 1), TrialView("b", RUNNING, 1)])
    assert ("eager steps, not CUDA graphs: lagrangian eta=0.2 (capture failed: operation not "
            "permitted)") in line
