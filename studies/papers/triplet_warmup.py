"""Why the hardest-negative triplet loss (SH) stays at chance on the embedded benchmark.

On the embedded benchmark every condition trained with the VSE++ max-violation triplet loss
(Faghri et al., Eq. 5; the best loss of the metric-learning paper, Table 1, and the baseline of
the VSE+2AD paper, Table 4) ended at a test rsum near chance, on every architecture of
``loss_functions`` and every pooling of ``pooling_objective``, while the same towers learned with
every other loss. Their training loss settled at 2 B alpha (64.4 at B = 128, alpha = 0.25): the
value where every similarity is equal, so every hinge is the margin. The embeddings collapsed
to one point, where the gradient of a max over hinges that are all equal picks an arbitrary
negative and pulls nothing apart. The in-batch false negatives that explained it on the old
benchmark are now at COCO's rate (0.115 per caption in a batch of 128).

VSE-infinity's code trains its max-violation loss after ``vse_mean_warmup_epochs`` (1 in its
published commands) epochs of the sum over all negatives, VSE+2AD's baseline with it. This study
asks whether that warm-up is what the benchmark's SH runs miss: the recipes of
``loss_functions`` (VSE++ and VSRN) and of ``pooling_objective`` (max pooling), each with SH at
the papers' margin 0.2, with and without one warm-up epoch (``loss.warmup_epochs``). It is a
follow-up, designed after those two studies' results, and reported as such.
"""

from __future__ import annotations

from studies.catalog import Condition, Recipe, Study
from studies.figures import Figure, metric_per_epoch
from studies.papers import loss_functions, pooling_objective
from studies.tables import Column, Table

# One epoch of the sum over all negatives, as VSE-infinity's code (vse_mean_warmup_epochs 1).
WARMUP = {"loss.warmup_epochs": 1}
TRIPLET_SH = {"loss.name": "triplet"}
ARCHITECTURES = {  # each architecture with the recipe of the study it comes from
    "vsepp": ("VSE++ (loss_functions)",
              {**loss_functions.BASE, **loss_functions.ARCHITECTURES["vsepp"][1]}),
    "vsrn": ("VSRN (loss_functions)",
             {**loss_functions.BASE, **loss_functions.ARCHITECTURES["vsrn"][1]}),
    "max": ("max pooling (pooling_objective)",
            {**pooling_objective.BASE, "image.pooling": "max", "text.pooling": "max",
             "optim.lr": 1e-3}),
}
CONDITIONS = tuple(
    Condition(f"{arch}{suffix}", f"{label}, triplet SH{text}",
              {**overrides, **TRIPLET_SH, **extra})
    for arch, (label, overrides) in ARCHITECTURES.items()
    for suffix, text, extra in (("", "", {}), ("_warmup", " after 1 epoch on all negatives", WARMUP))
)


def _table(arch: str, label: str) -> Table:
    return Table(
        f"table_{arch}", f"Triplet SH with and without the warm-up: {label}",
        (*(Column(f"test_{d}_R_at_{k}", f"R@{k}", d) for d in ("i2t", "t2i") for k in (1, 5, 10)),
         Column("test_rsum", "rsum"), Column("train_L_con", "final L_con", better="min", unit="",
                                             digits=1)),
        baseline=arch, rows=(arch, f"{arch}_warmup"),
        caption="test split, best-validation checkpoint; R@k and rsum in %; final L_con: the "
                "training loss of the last epoch (2 B alpha = 51.2 at B = 128, alpha = 0.2 is "
                "the collapsed value)",
    )


# The papers' own recipes of the same towers (--recipe paper): VSE++ and VSRN as the
# metric-learning paper trained them (loss_functions), max pooling as VSE+2AD's (pooling_objective),
# each with and without the warm-up.
_PAPER_SOURCES = {
    "vsepp": (loss_functions.PAPER, "vsepp_triplet_sh"),
    "vsrn": (loss_functions.PAPER, "vsrn_triplet_sh"),
    "max": (pooling_objective.PAPER, "max_triplet_sh"),
}
PAPER = Recipe(
    "paper", "loss_functions' and pooling_objective's paper recipes (see those modules)", {},
    conditions={
        f"{arch}{suffix}": {**recipe.overrides, **recipe.conditions[name], "loss.warmup_epochs": 0,
                            **extra}
        for arch, (recipe, name) in _PAPER_SOURCES.items()
        for suffix, extra in (("", {}), ("_warmup", WARMUP))
    },
    space_file="paper/fixed.yaml", seeds=5, early_stopping=False,
    datasets=("karpathy", "precomp"),
    requires={**loss_functions.PAPER.requires, **pooling_objective.PAPER.requires},
    notes=("VSE++ and VSRN train on the Karpathy split (VSRN with its BUTD regions), max pooling on "
           "a SCAN/BUTD folder, as in the two studies",),
)

STUDY = Study(
    name="triplet_warmup",
    description="triplet SH with and without VSE-infinity's warm-up on all negatives (a follow-up)",
    base={"data.dataset": "shapes", "data.preset": "default", "eval.test": False},
    space_file="triplet_warmup.yaml",
    conditions=CONDITIONS,
    seeds=3,
    tables=tuple(_table(arch, label) for arch, (label, _) in ARCHITECTURES.items()),
    figures=(Figure("val_rsum_per_epoch", "validation rsum per epoch", metric_per_epoch()),),
    smoke={"data.preset": "tiny", "train.finetune_epochs": 1, "train.batch_size": 16,
           "image.pretrained": False, "train.trajectory_every": 1},
    smoke_seeds=2,
    debug_condition="vsrn_warmup",
    paper=PAPER,
)
