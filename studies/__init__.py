"""The study platform: catalog, Ray Tune + ASHA + Optuna search, MLflow tracking, reports.

Layers (docs/architecture.md): ``search_spaces/*.yaml`` say what to search, ``studies`` schedules and records
trials, ``icr`` trains one of them. Only :mod:`studies.trainable` imports both ``ray`` and ``icr``;
a test checks it.

Entry points: ``python -m studies.run NAME`` and ``python -m studies.report NAME``.
"""
