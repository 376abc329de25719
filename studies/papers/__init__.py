"""The catalog of studies: one module per study, each declaring ``STUDY = Study(...)``.

A study module declares what a paper compares (its conditions), on which recipe (the embedded
benchmark's, the smoke test's and the paper's own), what is searched (a file in
``search_spaces/``) and what its report holds (tables, figures, analyses); the platform
(:mod:`studies`) finds the modules here by scanning this package (:func:`studies.catalog.all_studies`)
and knows nothing specific to any paper. A new paper is its components, registered in ``icr``,
plus one module here.
"""
