"""Errors a user can cause.

Each carries one line that names the culprit and the fix. Entry points catch :class:`UserError`,
print the message and exit with code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping


class UserError(Exception):
    """A mistake in the user's input (config, files, command line), reported in one line."""


class ConfigError(UserError, ValueError):
    """An unknown config key or an invalid value."""


class DataError(UserError):
    """A missing or malformed data file; the message names the file and the problem."""


class TrainingError(UserError):
    """A run that cannot go on, e.g. a non-finite loss."""


def step_error(error: Exception, *, epoch: int, step: int, keys: Mapping[str, object]
               ) -> TrainingError:
    """``error``, raised inside training step ``step`` of ``epoch`` (both 0-based), as one line
    that says where, what, and the values of the config keys of the components the step ran
    (``keys``): a bare torch message names neither the step nor the setting behind it.

    The new error carries ``error``'s traceback (the step's frames down to where it was raised)
    and is meant to be raised ``from None``: the innermost exception of its chain, it is the line
    a study records for the failed trial.
    """
    lines = message_lines(str(error))
    what = f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__
    values = ", ".join(f"{key}={value}" for key, value in keys.items())
    settings = f" with {values}; check those values" if values else ""
    return TrainingError(f"the training step failed at epoch {epoch + 1}, step {step + 1} "
                         f"({what}){settings}").with_traceback(error.__traceback__)


@contextlib.contextmanager
def step_errors(*, epoch: int, step: int, keys: Mapping[str, object]) -> Iterator[None]:
    """Around training step ``step`` of ``epoch``: a :class:`UserError` goes through as it is,
    any other error comes out as :func:`step_error` makes it."""
    try:
        yield
    except UserError:
        raise
    except Exception as error:
        raise step_error(error, epoch=epoch, step=step, keys=keys) from None


def message_lines(text: str) -> list[str]:
    """The lines of an error message (or of a log) that hold something, stripped."""
    return [line.strip() for line in text.splitlines() if line.strip()]
