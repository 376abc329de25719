"""Input target decoding (ITD) against LTD: ITD as a dual loss and as a constraint.

LTD paper Table 1 rows BL + ITD L_dual (beta = 1) and BL + ITD L_lag (eta = 4 on COCO, 6 on F30k):
the token-level NLL is on another scale than the cosine L_rec of LTD, so eta is searched over the
ITD range 0.5 .. 6 (docs/reference-code.md section 1). The baseline row is shared with ltd_bound.
"""

from __future__ import annotations

from dataclasses import replace

from studies.catalog import Condition, Study
from studies.papers.ltd_bound import BASE, CONTRASTIVE, PAPER, SMOKE, TABLE_1, figure_3

STUDY = Study(
    name="ltd_itd",
    description="ITD as a dual loss and as a constraint (eta over 0.5..6) vs the baseline",
    base=BASE,
    space_file="ltd_itd.yaml",
    conditions=(
        CONTRASTIVE,
        Condition(
            "itd_dual", "BL + ITD, L_dual (beta=1)",
            {"objective.name": "dual", "decoder.name": "itd", "objective.beta": 1.0},
        ),
        Condition(
            "itd_lagrangian", "BL + ITD, L_lag",
            {"objective.name": "lagrangian", "decoder.name": "itd"},
        ),
    ),
    budget=4,
    seeds=3,
    tables=(TABLE_1,),
    figures=figure_3("itd_lagrangian"),
    smoke=SMOKE,
    debug_condition="itd_lagrangian",
    # LTD paper Section 4.3 with the ITD eta grid; the ITD decoder's 300-d words and a GRU of
    # 1024 units (docs/reference-code.md, section 1: GRU(300 -> 1024) initialised with the caption embedding).
    paper=replace(PAPER, overrides={**PAPER.overrides, "decoder.word_dim": 300,
                                    "decoder.hidden_dim": 1024},
                  space_file="paper/ltd_itd.yaml"),
)
