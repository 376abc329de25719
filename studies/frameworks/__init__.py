"""Where the platform touches a framework's internals: one adapter module per framework.

Ray, Ray Tune, Optuna and MLflow are used through their public APIs everywhere else in the
project (``tests/test_frameworks.py`` finds no private access outside this package). What
cannot be done that way (a private module, a private attribute, a file name or a log line of
one version) lives in :mod:`.ray`, :mod:`.tune`, :mod:`.optuna` or :mod:`.mlflow`, each with the
version it was tested against; a touch that no longer finds what it reached for raises
:class:`FrameworkChanged`, one line naming the installed and the tested version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from icr.errors import UserError


class FrameworkChanged(UserError):
    """The installed framework is not the one an adapter was written for, and it matters: an
    internal it relies on is gone, or a store is at another schema."""


@contextlib.contextmanager
def reaching(framework: str, installed: str, tested: str, what: str) -> Iterator[None]:
    """Reach for an internal (``what``: its name): a module or an attribute that is gone becomes
    :class:`FrameworkChanged` instead of a traceback deep inside the platform."""
    try:
        yield
    except (ImportError, AttributeError) as exc:
        raise FrameworkChanged(
            f"{framework} {installed} is installed, but studies/frameworks/{framework}.py was "
            f"written for {framework} {tested} and {what} has changed; install "
            f"{framework}=={tested} (as constraints.txt locks it) or update that adapter") from exc
