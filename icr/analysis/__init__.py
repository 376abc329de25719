"""Analyses of a trained model, run by ``fit`` after training on the best checkpoint.

``eval.analyses`` names them (comma-separated). Each is registered in :data:`ANALYSES` as a builder
``(task=...) -> run``: building checks, before any training, that the task and its data allow the
analysis (a probe needs the embedded benchmark's ground truth), and ``run(out_dir)`` returns the
analysis' numbers (``dict[str, float]``, keys prefixed with the analysis' name) after writing any
files to ``out_dir``. ``fit`` puts both in the last epoch's report, so they land in the run's MLflow
record. A new analysis is one module here with one ``@ANALYSES.register(name)`` builder.
"""

from icr.registry import Registry

ANALYSES: Registry = Registry("analysis", package="icr.analysis")

__all__ = ["ANALYSES"]
