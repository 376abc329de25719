"""Adaptive pooling and the adaptive objective: pooling x objective, with convergence curves.

Zhang et al., "Improving Visual-Semantic Embedding with Adaptive Pooling and Optimization
Objective" (Zhang et al., EACL 2023), the ablation of Table 4: the pooling of
both towers (max, mean, GPO of VSE-infinity, AdPool) crossed with the objective (the hardest
negative triplet of VSE++, or AdOpt: a dynamically sized group of hard negatives). The image tower
is a per-region MLP over the region features, the caption tower a bi-GRU whose two directions are
averaged per word, each pooled by the same pooling (``image.pooling``, ``text.pooling``).

Searched per condition: the learning rate, and AdOpt's margin. The report holds the table (R@1/5/10
both ways, rsum; mean ± std over seeds), an ensemble row for the best condition (its confirmation
runs' similarity matrices averaged, as the paper's ensembles; logged as its own MLflow run), the
validation rsum per epoch per condition (convergence) and AdOpt's K over training. Recipes are
scaled to the embedded benchmark and 2 CPU cores (3 epochs, 128-d embeddings).
"""

from __future__ import annotations

from studies.catalog import Condition, Recipe, Study
from studies.figures import Figure, metric_per_epoch, series_per_condition
from studies.tables import Column, Table

BASE = {
    "data.dataset": "shapes", "data.preset": "default", "data.features": "regions",
    "image.encoder": "region_tokens", "image.hidden_dim": 256, "image.output_dim": 128,
    "text.encoder": "gru_tokens", "text.hidden_dim": 128,
    "model.embed_dim": 128, "optim.name": "adam", "optim.finetune_lr_factor": 1.0,
    "train.warmup_epochs": 0, "train.finetune_epochs": 3, "train.swa": False, "eval.test": False,
}

POOLINGS = {"max": "max", "mean": "mean", "gpo": "GPO", "adpool": "AdPool"}
OBJECTIVES = {
    "triplet_sh": ("triplet SH", {"loss.name": "triplet", "loss.margin": 0.2}),
    "adopt": ("AdOpt", {"loss.name": "adopt", "loss.tau": 0.05}),
}

CONDITIONS = tuple(
    Condition(f"{pool}_{obj}", f"{pool_label} + {obj_label}",
              {"image.pooling": pool, "text.pooling": pool, **obj_keys})
    for pool, pool_label in POOLINGS.items()
    for obj, (obj_label, obj_keys) in OBJECTIVES.items()
)

TABLE = Table(
    "table", "Pooling x objective (the paper's Table 4 ablation)",
    (*(Column(f"test_{d}_R_at_{k}", f"R@{k}", d) for d in ("i2t", "t2i") for k in (1, 5, 10)),
     Column("test_rsum", "rsum")),
    baseline="max_triplet_sh",
    caption="test split, best-validation checkpoint; all values in %",
)

# The paper's recipe (--recipe paper) on a SCAN/BUTD precomputed folder of COCO or Flickr30k.
# VSE+2AD paper (Zhang et al., EACL 2023) Section 4.1 "Implementation
# details" and Appendix B "Basic settings" (docs/reference-code.md section 3).
PAPER_BASE = {
    "data.dataset": "precomp", "data.features": "regions",
    "image.encoder": "region_tokens",  # Appendix B: BUTD regions mapped by an MLP
    "image.hidden_dim": 1024, "image.output_dim": 1024,  # "into 1024 as the same as text"
    "text.encoder": "gru_tokens",  # BiGRU over 300-d words, the two directions averaged
    "text.word_dim": 300, "text.hidden_dim": 1024, "text.glove": "none",
    "model.embed_dim": 1024,  # Section 4.1: "The dimension of the shared embedding space is 1024"
    "optim.name": "adam",  # "We use the Adam optimizer
    "train.batch_size": 128,  # with a mini-batch size of 128
    "train.warmup_epochs": 0,
    "train.finetune_epochs": 25,  # and train our models with 25 epochs.
    "optim.lr": 5e-4,  # The learning rate is set to 5e-4
    "optim.schedule": "step",  # with a decaying factor of 10% for every 15 epochs"
    "optim.step_epochs": 15,
    "optim.step_gamma": 0.1,
    "optim.finetune_lr_factor": 1.0,
    "optim.grad_clip": 2.0,  # VSE-infinity's code
    "text.bert_lr_factor": 0.1,  # Appendix B: pre-trained modules at 10% of the lr
    "train.swa": False,
    "eval.test": False,
}
PAPER_OBJECTIVES = {  # Appendix B: "The margin alpha for hard triplet loss is set to 0.2 and the
    # tau used in InfoNCE is 0.05"; AdOpt adds margin 0.2. The hard triplet loss is
    # VSE-infinity's, trained as its code trains it: 1 epoch on all negatives first
    # (vse_mean_warmup_epochs 1 in its published commands).
    "triplet_sh": {"loss.margin": 0.2, "loss.warmup_epochs": 1},
    "adopt": {"loss.margin": 0.2, "loss.tau": 0.05},
}
PAPER = Recipe(
    "paper", "VSE+2AD paper Section 4.1 and Appendix B; vse_2ad code", PAPER_BASE,
    conditions={f"{pool}_{obj}": PAPER_OBJECTIVES[obj] for pool in POOLINGS for obj in OBJECTIVES},
    space_file="paper/fixed.yaml", seeds=3, early_stopping=False, datasets=("precomp",),
    requires={"data.precomp_dir": "a SCAN/BUTD folder of COCO or Flickr30k"},
    notes=("the paper reports one run per setting; 3 seeds here for the table's tests",
           "the reference divides the lr by 10 every epoch after 15 and selects on test "
           "(docs/reference-code.md, section 3): not copied; one step at 15, selection on validation",
           "the BiGRU's word embeddings start at random (the paper does not name GloVe)"),
)

STUDY = Study(
    name="pooling_objective",
    description="max / mean / GPO / AdPool pooling x triplet SH / AdOpt, with an ensemble",
    base=BASE,
    space_file="pooling_objective.yaml",
    conditions=CONDITIONS,
    budget=3,
    startup_trials=3,
    seeds=3,
    reduction_factor=3,
    tables=(TABLE,),
    figures=(
        Figure("val_rsum_per_epoch", "convergence: validation rsum per epoch",
               metric_per_epoch()),
        Figure("k_per_step", "AdOpt: hard negatives K per step (confirmation runs)",
               series_per_condition("K", ylabel="K (negatives per query)")),
    ),
    ensemble=True,
    smoke={"data.preset": "tiny", "train.finetune_epochs": 1, "train.batch_size": 16,
           "train.trajectory_every": 1},
    smoke_budget=1,
    smoke_seeds=2,
    debug_condition="adpool_adopt",
    paper=PAPER,
)
