"""The ltd_bound conditions with the triplet loss (hardest in-batch negative, margin 0.2).

LTD paper Section 5.4 / Table 2: the same experiments with the VSE++ triplet loss as L_con, with
BatchNorm after the projection heads as the PCME / LTD reference does with the triplet loss
(docs/reference-code.md section 1).
"""

from __future__ import annotations

from dataclasses import replace

from studies.catalog import Study
from studies.papers.ltd_bound import (
    BASE,
    CONTRASTIVE,
    DUAL,
    LAGRANGIAN,
    PAPER,
    SMOKE,
    TABLE_1,
    figure_3,
)

STUDY = Study(
    name="ltd_triplet",
    description="the ltd_bound conditions with the triplet loss as L_con",
    base={**BASE, "loss.name": "triplet", "model.head_batchnorm": True},
    space_file="ltd_triplet.yaml",
    conditions=(CONTRASTIVE, DUAL, LAGRANGIAN),
    budget=4,
    seeds=3,
    tables=(TABLE_1,),
    figures=figure_3(),
    smoke=SMOKE,
    debug_condition="lagrangian",
    # LTD paper Section 5.4: the same recipe with the triplet loss (margin 0.2, hardest negative)
    # and BatchNorm after the heads, as the reference does with the triplet loss.
    paper=replace(PAPER, overrides={**PAPER.overrides, "loss.name": "triplet",
                                    "model.head_batchnorm": True},
                  space_file="paper/ltd_triplet.yaml"),
)
