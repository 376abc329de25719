"""A failed trial, as the driver sees it: its one-line cause, and whether its training raised it.

Tune hands the driver the error that ended a trial as an exception whose cause chain holds the
worker's own exception (Ray's ``RayTaskError`` keeps it as ``.cause``, Python's chaining as
``__cause__``), or as the text of the trial's error file. :func:`causes` walks that chain once
for the questions asked of it: :func:`error_line` (the innermost cause, for the run's ``error``
tag, the status lines and the report), :func:`failed_in_training` (an exception that
:func:`studies.trainable.run_trial` marked as raised by ``fit``) and :func:`node_cannot_read`
(a trial whose node could not read its data or the study's storage: the study stops, no retry).

A study whose every run failed in its own training ends with :class:`EveryRunFailed`.

Imports neither Ray nor MLflow nor torch: the trainable (in the worker), the tracker and the
Tuners (on the driver) all read it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from icr.errors import UserError, message_lines

FAILED_IN_TRAINING = "icr_failed_in_training"  # set on an exception that fit raised
MAX_CHARS = 500  # a longer cause is cut: it is one line of a status line, a tag and a report


class NodeCannotRead(UserError):
    """A trial's node cannot read a file or folder the trial needs (its data, the study's Tune
    storage); the message names the node, the path and the fix. Not the trial's failure, and
    not one a retry mends: the study stops (:class:`studies.trainable.StopWhenUnreadable`)."""


class EveryRunFailed(Exception):
    """Every run a study planned failed in its own training; the message says so in one line
    (the report, written, lists the errors)."""


def causes(error: BaseException) -> Iterator[BaseException]:
    """``error``, then each exception it was caused by, outermost first; each once."""
    seen: set[int] = set()
    current: object = error
    while isinstance(current, BaseException) and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = getattr(current, "cause", None) or current.__cause__


def failed_in_training(error: BaseException | None) -> bool:
    """Whether the error that ended a trial (as Tune gives it on the driver) was raised by its
    training (``fit``: a non-finite loss, a config that cannot train, a bug in a model) rather
    than around it (a lost worker or node, Tune restoring it, storage): only the former is the
    trial's own failure, which a report states; the others are retried."""
    if error is None:
        return False
    return any(getattr(cause, FAILED_IN_TRAINING, False) for cause in causes(error))


def node_cannot_read(error: BaseException | None) -> NodeCannotRead | None:
    """The :class:`NodeCannotRead` that ended a trial (as Tune gives its error on the driver),
    if that is what ended it."""
    if error is None:
        return None
    # the innermost: Ray's RayTaskError(NodeCannotRead) is one too, its message a traceback
    found = [c for c in causes(error) if isinstance(c, NodeCannotRead)]
    return found[-1] if found else None


def error_line(error: BaseException | str | None) -> str:
    """The one-line cause of a failed trial: the innermost exception's last line (Tune gives
    the error as an exception, or as the text of its error file)."""
    if not error:
        return "the trial failed without an error (its worker was lost?)"
    if isinstance(error, str):
        lines = message_lines(error)
        return re.sub(r"^(?:\w+\.)+(\w+: )", r"\1", lines[-1])[:MAX_CHARS]
    *_, cause = causes(error)
    lines = message_lines(str(cause))
    text = lines[-1] if lines else type(cause).__name__
    if ": " not in text[:60]:
        text = f"{type(cause).__name__}: {text}"
    return text[:MAX_CHARS]
