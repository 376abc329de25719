"""A driver killed at the instant its search's last trial ended, then run again.

The last trial of the search is one that ASHA stopped: a search of two trials, the better one
(eta 0.17, the fake fit's best) drawn first and the other held by the fake fit before its first
epoch until the first has run its budget, so that ASHA stops the second at its first rung. The
driver is SIGKILLed as soon as it prints ``search lagrangian: 2 done, 0 running, 0 left``, before
Tune saved its state with that trial ended. The same command then runs the study to its end:
exit code 0 with no ``interrupted`` line, every run FINISHED once, no epoch trained or recorded
twice (the chaos test's checks, :func:`test_studies_chaos.check_instant`).

Under load the kill can also land while Ray copies Tune's saved state to the storage, and cut the
trials' state (``experiment_state-*.json``) short: Tune's restore of it fails and restarts the
search with one trial of two (exit 1, "Tune returned with 1 of 2 trial(s) ... not ended", seen
once in CI). The second case cuts it so; the rerun starts the search over
(:func:`studies.frameworks.tune.saved_by_tune`) and the study ends as in the first.

The campaign's helpers (a driver in its own process on its own private Ray instance, the fit's
records, the checks) are those of ``tests/test_studies_chaos.py``; the storage is given with
``--storage`` (a folder here; ``tests/test_storage.py`` runs the same on S3).
"""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
from test_studies_chaos import (
    Campaign,
    ChaosStudy,
    DriverRun,
    Instant,
    check_instant,
    fit_calls,
    recorded_epochs,
    wait_for_no_leftovers,
)

DRIVER = """
import signal
signal.signal(signal.SIGINT, signal.SIG_DFL)  # as `python -m studies.run` (studies/run.py) does
import os, sys
from dataclasses import replace
from pathlib import Path
from fakes import FakeFit, fake_prepare, fake_study
from studies.pipeline import Backend
from studies.run import leave, main
if __name__ == "__main__":
    folder = Path(os.environ["ICR_CHAOS_STUDY_DIR"])
    study = replace(fake_study(folder, budget=2, conditions=("lagrangian",)), name="ended")
    (folder / "space.yaml").write_text(SPACE)  # the better eta drawn first (Sobol: low end)
    fit = FakeFit(epoch_seconds=0.3, record_dir=os.environ["ICR_CHAOS_RECORDS"],
                  gate=os.environ["ICR_GATE"], hold_after=0, hold_on=HELD)
    leave(main(sys.argv[1:], backend=Backend(fit, fake_prepare), extra_studies={"ended": study}))
"""
SPACE = """
space:
  loss.tau: 0.05
conditions:
  lagrangian:
    objective.eta: {uniform: [0.17, 0.4]}
"""
SEARCH_ENDED = re.compile(r"^search lagrangian: 2 done, 0 running, 0 left")
FIRST_ENDED = re.compile(r"^  trial \w+ \[lagrangian eta=0\.17\]: 2 epoch\(s\), .*\(full budget\)$")


def held_eta() -> float:
    """The second trial's eta: the middle of the domain (the second point of the sampler's
    unscrambled Sobol sequence), as the driver draws it."""
    from optuna.distributions import FloatDistribution

    from studies.samplers import spread_point

    return spread_point(0.5, FloatDistribution(0.17, 0.4))


class AtSearchEnd(Campaign):
    """Holds the second trial until the first ran its budget, and signals the driver when the
    search's last trial ended."""

    def __init__(self, study: ChaosStudy, root: Path, gate: Path) -> None:
        super().__init__(study, root, seed=0)
        self.gate = gate

    def _due(self, run: DriverRun, instant: Instant, before, reached) -> bool:
        lines = [line for _, line in run.lines]
        if any(FIRST_ENDED.match(line) for line in lines):
            (self.gate / "go").touch()
        return any(SEARCH_ENDED.match(line) for line in lines)


ENDED = ChaosStudy(
    ("ended", "--seeds", "2", "--set", "train.warmup_epochs=1", "train.finetune_epochs=1"),
    "ended", {"lagrangian": 2}, ("lagrangian",), 2, 2, ("table1.md", "trials.csv"), True)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("cut", [False, True], ids=["as-left", "trials-state-cut-short"])
def test_a_rerun_whose_trials_all_ended_goes_on_to_the_next_phase(tmp_path: Path, monkeypatch,
                                                                   cut: bool) -> None:
    gate = tmp_path / "gate"
    gate.mkdir()
    monkeypatch.setenv("ICR_GATE", str(gate))
    (tmp_path / "driver.py").write_text(
        DRIVER.replace("SPACE)", f"{SPACE!r})").replace("HELD)", f"((\"objective.eta\", {held_eta()!r}),))"))
    campaign = AtSearchEnd(ENDED, tmp_path, gate)
    try:
        killed = campaign.run(tmp_path / "records-0", Instant("search", signal.SIGKILL, 0.0))
        assert killed.signalled and killed.rc == -signal.SIGKILL, killed.text[-3000:]
        assert any("(stopped by ASHA)" in line for _, line in killed.lines), killed.text[-3000:]
        run_dir, state = campaign.state_of(set())
        assert state["phase"] == "search"
        held = [recorded_epochs(campaign.workspace / "mlflow.db", state["parent_run_id"])]
        if cut:  # as a kill during Ray's copy of the trials' state leaves it
            (trials,) = (run_dir / "search-lagrangian").glob("experiment_state-*.json")
            trials.write_bytes(trials.read_bytes()[: trials.stat().st_size // 2])

        rerun = campaign.run(tmp_path / "records-1")
        assert rerun.rc == 0, rerun.text[-3000:]
        calls = [fit_calls(tmp_path / "records-0"), fit_calls(tmp_path / "records-1")]
        check_instant(campaign, set(), [killed, rerun], calls, held, None)
        assert not wait_for_no_leftovers(campaign)
    finally:
        campaign.clean()


def test_a_phase_has_ended_when_tune_holds_every_trial_ended_done_or_not() -> None:
    """Tune's trials TERMINATED or ERROR decide, not a last result marked ``done``; Tune
    returning with a trial not ended (no stop signal: that raised before) is an error, exit 1,
    never "interrupted"."""
    from types import SimpleNamespace

    from studies.signals import StudyIncomplete
    from studies.tuning import check_ended

    class Grid(SimpleNamespace):  # what check_ended reads of a ResultGrid
        def __len__(self) -> int:
            return len(self.statuses)

    def grid(*statuses: str) -> Grid:
        return Grid(num_terminated=statuses.count("TERMINATED"),
                    num_errors=statuses.count("ERROR"), statuses=statuses)

    check_ended(grid("TERMINATED", "ERROR"), 2, "search lagrangian")
    with pytest.raises(StudyIncomplete, match=r"^Tune returned with 1 of 2 trial\(s\) of search "
                       r"lagrangian not ended; run the same command again to continue them$"):
        check_ended(grid("TERMINATED", "RUNNING"), 2, "search lagrangian")
    with pytest.raises(StudyIncomplete, match=r"with 1 of 2 trial\(s\) of confirm not ended"):
        check_ended(grid("TERMINATED"), 2, "confirm")
