"""The driver's stop signals: Ctrl-C, SIGTERM and SIGHUP end a study the same way.

Importing this module imports neither Ray nor MLflow (``--list`` and ``--keys`` use it).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
from collections.abc import Iterator, Sequence
from typing import Any

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(Exception):
    """The driver was interrupted (Ctrl-C, SIGTERM, SIGHUP); the run can be continued."""


class StudyIncomplete(Exception):
    """A phase ended without every run it planned, for a reason other than a run's own training
    (a lost worker, say); the message says which, in one line. The run can be continued."""


class StopSignals:
    """Within the block, SIGINT, SIGTERM and SIGHUP stop the driver as Ctrl-C does, and are
    remembered (:attr:`received`).

    SIGTERM and SIGHUP run whichever SIGINT handler is active: Ray Tune's (it stops the
    experiment and saves its state) while a Tuner runs, else this block's, which raises
    KeyboardInterrupt (also when SIGINT was ignored, as in a background job). Whatever a stop
    signal leads to (KeyboardInterrupt, Tune returning early, an error of a library that was
    interrupted), the entry point that holds the block sees ``received`` and ends with
    "interrupted". ``ray.init`` installs its own SIGTERM handler: :func:`handlers_kept` puts
    this one back. Main thread only; the previous handlers come back on exit; blocks nest.

    A handler runs wherever the main thread is: inside a weakref callback, a ``__del__`` or a
    library's fork handler, Python reports its KeyboardInterrupt as "Exception ignored in ..."
    with a traceback, and drops it. Within the block that report is left out
    (``sys.unraisablehook``) for a stop signal received: the signal is remembered, and
    :meth:`check` raises it again where it counts.
    """

    def __init__(self) -> None:
        self.received: int | None = None  # the first stop signal, if any
        self._previous: dict[int, Any] = {}
        self._outer: StopSignals | None = None  # the block this one is nested in
        self._unraisable: Any = None  # the hook this block replaced

    def __enter__(self) -> StopSignals:
        self._previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        outer = getattr(self._previous[signal.SIGTERM], "__self__", None)
        self._outer = outer if isinstance(outer, StopSignals) else None
        if self._previous[signal.SIGINT] in _PLAIN_CTRL_C or self._outer is not None:
            signal.signal(signal.SIGINT, self._ctrl_c)  # another's own handler (Tune's) stays
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, self._as_ctrl_c)
        self._unraisable, sys.unraisablehook = sys.unraisablehook, self._unraisable_hook
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        sys.unraisablehook = self._unraisable

    def _unraisable_hook(self, unraisable: Any) -> None:
        if self.received and isinstance(unraisable.exc_value, KeyboardInterrupt):
            log.info("a stop signal came inside %r; the study stops at its next check",
                     unraisable.object)
            return
        self._unraisable(unraisable)

    def check(self) -> None:
        """Raise KeyboardInterrupt if a stop signal came: the one its handler raised can be lost
        (raised where Python ignores exceptions, e.g. in a fork handler of a library)."""
        if self.received:
            raise KeyboardInterrupt

    def note(self, signum: int) -> None:
        """Remember a stop signal that another handler took (Tune's, for SIGINT)."""
        self.received = self.received or signum
        if self._outer is not None:
            self._outer.note(signum)

    def _ctrl_c(self, signum: int, frame: Any) -> None:
        self.note(signum)
        raise KeyboardInterrupt

    def _as_ctrl_c(self, signum: int, frame: Any) -> None:
        self.note(signum)
        log.info("received %s: stopping as on Ctrl-C", signal.Signals(signum).name)
        on_ctrl_c = signal.getsignal(signal.SIGINT)
        if not callable(on_ctrl_c):
            raise KeyboardInterrupt
        on_ctrl_c(signal.SIGINT, frame)


_PLAIN_CTRL_C = (signal.default_int_handler, signal.SIG_DFL, signal.SIG_IGN, None)


@contextlib.contextmanager
def stop_signals_ignored() -> Iterator[None]:
    """Within the block, the stop signals are ignored (and lost); the handlers come back after."""
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def handlers_kept(signals: Sequence[int] = STOP_SIGNALS) -> Iterator[None]:
    """Run a call that installs its own stop-signal handlers (``ray.init`` sets SIGTERM to
    ``sys.exit``) and put the previous ones back after it; a SIGTERM that such a handler turned
    into ``SystemExit`` inside the call comes out as KeyboardInterrupt."""
    previous = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    except SystemExit as exc:
        if exc.code == signal.SIGTERM and _is_handled(previous):
            raise KeyboardInterrupt from None
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _is_handled(previous: dict[int, Any]) -> bool:
    return callable(previous.get(signal.SIGTERM)) and previous[signal.SIGTERM] not in (
        signal.SIG_DFL, signal.SIG_IGN)
