"""Errors a user can cause.

Each carries one line that names the culprit and the fix. Entry points catch :class:`UserError`,
print the message and exit with code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's input (config, files, command line), reported in one line."""


class ConfigError(UserError, ValueError):
    """An unknown config key or an invalid value."""


class DataError(UserError):
    """A missing or malformed data file; the message names the file and the problem."""


class TrainingError(UserError):
    """A run that cannot go on, e.g. a non-finite loss."""
