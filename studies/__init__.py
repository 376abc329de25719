"""The study platform: catalog, Ray Tune + ASHA + Optuna search, MLflow tracking, reports.

Layers (docs/architecture.md): ``search_spaces/*.yaml`` say what to search, ``studies``
schedules and records trials, ``icr`` trains one of them. ``studies`` reads ``icr``'s configs,
errors and registries; a trial calls ``icr.train.fit`` (:mod:`studies.trainable`, and
:mod:`studies.debug` in-process). ``icr`` imports neither ``studies`` nor Ray, Optuna or MLflow
(``tests/test_boundaries.py``).

Entry points: ``python -m studies.run NAME`` and ``python -m studies.report NAME``.
"""
