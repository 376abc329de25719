"""The one line of an error raised inside a training step (icr.errors.step_error)."""

from __future__ import annotations

import traceback

import pytest

from icr.errors import TrainingError, UserError, step_error


def _raise_inside() -> None:
    raise RuntimeError("value cannot be converted\nto type float without overflow")


def test_a_step_error_names_where_what_and_the_keys_and_keeps_the_steps_frames():
    with pytest.raises(TrainingError) as caught:
        try:
            _raise_inside()
        except RuntimeError as error:
            raise step_error(error, epoch=2, step=0, keys={"objective.lambda_max": 1e39,
                                                           "loss.name": "infonce"}) from None
    assert str(caught.value) == (
        "the training step failed at epoch 3, step 1 (RuntimeError: value cannot be converted) "
        "with objective.lambda_max=1e+39, loss.name=infonce; check those values")
    assert isinstance(caught.value, UserError) and caught.value.__cause__ is None
    assert caught.value.__suppress_context__  # one error, not 'during handling ... another'
    assert "_raise_inside" in [f.name for f in traceback.extract_tb(caught.value.__traceback__)]


def test_a_step_error_without_keys_or_message():
    assert str(step_error(MemoryError(), epoch=0, step=4, keys={})) == (
        "the training step failed at epoch 1, step 5 (MemoryError)")
