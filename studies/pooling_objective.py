"""Adaptive pooling and the adaptive objective: pooling x objective, with convergence curves.

Zhang et al., "Improving Visual-Semantic Embedding with Adaptive Pooling and Optimization
Objective" (papers/vse-adaptive-pooling-and-objective.txt), the ablation of Table 4: the pooling of
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

from studies.catalog import Condition, Study
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
    "table", "Pooling x objective on the embedded benchmark (the paper's Table 4 ablation)",
    (*(Column(f"test_{d}_R_at_{k}", f"R@{k}", d) for d in ("i2t", "t2i") for k in (1, 5, 10)),
     Column("test_rsum", "rsum")),
    baseline="max_triplet_sh",
    caption="test split, best-validation checkpoint; all values in %",
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
)
