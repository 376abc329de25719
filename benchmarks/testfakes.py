"""The platform's test fakes (``tests/fakes.py``: a fake ``fit`` and a small study) for benchmarks
that run the real pipeline without real training.

They live with the tests, not in the product package; this puts that folder on ``sys.path`` and
on the ``PYTHONPATH`` that the Ray workers a benchmark starts inherit, then imports them.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parent.parent / "tests"


def load(name: str = "fakes") -> ModuleType:
    """The module ``tests/<name>.py``: ``fakes`` (``FakeFit``, ``fake_prepare``, ``fake_study``),
    ``servers`` (``loopback_server``)."""
    folder = str(TESTS)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if folder not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [folder, *paths]))
    return importlib.import_module(name)
