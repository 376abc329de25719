"""The loss as a searched dimension: one search over triplet, triplet SH and NT-Xent together.

A search space may choose among components (``loss.name: {choice: [...]}``) with keys that only
some of them use (``loss.margin`` for the triplet losses, ``loss.tau`` for NT-Xent). Each trial
samples the loss first and then only the keys its configuration uses (the searcher's
define-by-run space, :class:`studies.space.ConditionalSpace`), so a triplet trial records no
``loss.tau`` and TPE models each loss's own hyper-parameter from that loss's trials only. The
recipe is ltd_bound's (region features, 1 + 3 epochs) with the triplet losses' BatchNorm heads.
"""

from __future__ import annotations

from studies.catalog import Condition, Recipe, Study
from studies.figures import Figure, metric_per_epoch, metric_vs_value
from studies.papers.loss_functions import PAPER as LOSSES_PAPER
from studies.papers.loss_functions import PAPER_ARCHITECTURES
from studies.papers.ltd_bound import BASE, SMOKE

STUDY = Study(
    name="loss_search",
    description="the contrastive loss searched among triplet, triplet SH and NT-Xent",
    base={**BASE, "model.head_batchnorm": True},
    space_file="loss_search.yaml",
    conditions=(Condition("searched", "loss searched", {"decoder.name": "none",
                                                        "objective.name": "contrastive"}),),
    budget=9,
    startup_trials=4,
    seeds=2,
    figures=(Figure("val_rsum_per_epoch", "validation rsum per epoch", metric_per_epoch()),
             Figure("best_val_rsum_vs_loss", "best validation rsum per loss (search trials)",
                    metric_vs_value("val_rsum", "loss.name", "searched"))),
    smoke=SMOKE,
    smoke_budget=3,
    smoke_seeds=1,
    # The metric-learning paper's VSE++ recipe, every loss at its original work's value (margin
    # 0.2, NT-Xent's tau 0.1: Section 2), each trained once to the end; the best is confirmed.
    paper=Recipe(
        "paper", "metric-learning paper Sections 2 and 4 (VSE++)",
        {**LOSSES_PAPER.overrides, **PAPER_ARCHITECTURES["vsepp"], "loss.margin": 0.2,
         "loss.tau": 0.1},
        space_file="paper/loss_search.yaml", seeds=5, early_stopping=False,
        datasets=LOSSES_PAPER.datasets,
        requires={k: v for k, v in LOSSES_PAPER.requires.items() if k != "data.precomp_dir"},
        notes=("the paper trains each loss separately (loss_functions); a search over the loss "
               "is this platform's, on the paper's VSE++ recipe",)),
)
