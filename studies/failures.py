"""A failed trial, as the driver sees it: its one-line cause, and whether its training raised it.

Tune hands the driver the error that ended a trial as an exception whose cause chain holds the
worker's own exception (Ray's ``RayTaskError`` keeps it as ``.cause``, Python's chaining as
``__cause__``), or as the text of the trial's error file. :func:`causes` walks that chain once
for both questions asked of it: :func:`error_line` (the innermost cause, for the run's ``error``
tag, the status lines and the report) and :func:`failed_in_training` (an exception that
:func:`studies.trainable.run_trial` marked as raised by ``fit``).

Imports neither Ray nor MLflow nor torch: the trainable (in the worker), the tracker and the
Tuners (on the driver) all read it.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from icr.errors import message_lines

FAILED_IN_TRAINING = "icr_failed_in_training"  # set on an exception that fit raised
MAX_CHARS = 500  # a longer cause is cut: it is one line of a status line, a tag and a report


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
