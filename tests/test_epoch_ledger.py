"""The one rule that keeps an epoch from being recorded twice (studies.trials.EpochLedger),
which MLflow's recorder, Tune's result files and the searcher each follow."""

import pytest

from studies.trials import EpochLedger


def test_a_store_takes_each_epoch_above_the_last_it_holds_once() -> None:
    ledger = EpochLedger()
    ledger.open("run", 2)  # the store holds epochs 1 and 2
    assert [ledger.admit("run", e) for e in (1, 2, 3, 3, 4, 2)] == [
        False, False, True, False, True, False]


def test_a_store_that_holds_nothing_takes_the_first_epoch() -> None:
    ledger = EpochLedger()
    ledger.open("file", float("-inf"))
    ledger.open("mlflow", 0)  # MLflow's last step of a run without records
    assert ledger.admit("file", 1) and ledger.admit("mlflow", 1)


def test_each_key_is_kept_apart_and_a_closed_one_is_read_again() -> None:
    ledger = EpochLedger()
    ledger.open("a", 3)
    ledger.open("b", 0)
    assert ledger.admit("b", 1) and not ledger.admit("a", 3)
    ledger.close("a")
    assert not ledger.knows("a") and ledger.knows("b")
    ledger.open("a", 1)  # the store, read again, holds less (a file copied back from storage)
    assert ledger.admit("a", 2)
    with pytest.raises(KeyError):
        ledger.admit("c", 1)  # a store that was never asked cannot be assumed empty
