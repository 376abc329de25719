"""Do lessons from metric learning generalise to ICR? Four losses on VSE++ and VSRN, with COCOS.

Bleeker & de Rijke, "Do Lessons from Metric Learning Generalize to Image-Caption Retrieval?"
(papers/metric-learning-losses-for-icr.txt), Table 1 and section 4: the triplet loss over all
negatives, the triplet loss with the hardest negative (SH, VSE++), NT-Xent (the symmetric InfoNCE
at tau 0.1: the same loss as the LTD baseline, another preset) and SmoothAP (tau 0.01, batches of
whole images with all their captions), each on two architectures:

- VSE++: a pretrained CNN kept frozen (EfficientNet-Lite0 with its ImageNet weights, the offline
  stand-in for ResNet-50; its features are computed once and cached), only its projection
  trained, and a uni-directional GRU over randomly initialised word embeddings;
- VSRN: region features -> fc -> 4 graph reasoning layers -> GRU over the regions -> BatchNorm ->
  L2, with the same caption GRU (the caption-generation branch removed, as the paper did).

Per condition the loss's own hyper-parameter is searched around the paper's value (the margin
alpha, or tau); the confirmation runs end with the ``cocos`` analysis (COCOS over the training set
with the best checkpoint, batches of 128) and record COCOS every logged step during training
(``train.live_cocos``). Recipes are scaled to the embedded benchmark and 2 CPU cores: 3 epochs,
128-d embeddings; every loss gets the same number of epochs (the paper trains SmoothAP 5x longer:
set ``train.finetune_epochs`` of the SmoothAP conditions to reproduce that).
"""

from __future__ import annotations

from studies.catalog import Condition, Study
from studies.figures import Figure, metric_per_epoch, series_per_condition
from studies.tables import Column, Table

BASE = {
    "data.dataset": "shapes", "data.preset": "default",
    "text.encoder": "gru", "text.bidirectional": False, "text.glove": "none",
    "text.word_dim": 64, "text.hidden_dim": 128,
    "model.embed_dim": 128, "optim.name": "adam", "optim.lr": 1e-3,
    "optim.finetune_lr_factor": 1.0, "train.warmup_epochs": 0, "train.finetune_epochs": 3,
    "train.swa": False, "train.live_cocos": True, "eval.test": False,
}

ARCHITECTURES = {
    "vsepp": ("VSE++", {
        "data.features": "pixels", "image.encoder": "efficientnet_lite0", "image.pretrained": True,
        "image.frozen": True, "image.random_erasing": 0.0, "model.head_batchnorm": False,
    }),
    "vsrn": ("VSRN", {
        "data.features": "regions", "image.encoder": "vsrn", "image.output_dim": 128,
        "image.gcn_layers": 4, "model.head_batchnorm": True,
    }),
}

# The margin and tau are searched (search_spaces/loss_functions.yaml) around the paper's values.
LOSSES = {
    "triplet_all": ("Triplet loss", {"loss.name": "triplet_all"}),
    "triplet_sh": ("Triplet loss SH", {"loss.name": "triplet"}),
    "ntxent": ("NT-Xent", {"loss.name": "infonce"}),
    # 26 images x their 5 captions: about the 128 pairs of the other losses' batches.
    "smoothap": ("SmoothAP", {"loss.name": "smoothap", "train.sampler": "images",
                              "train.batch_size": 26}),
}

CONDITIONS = tuple(
    Condition(f"{arch}_{loss}", f"{arch_label}, {loss_label}", {**arch_keys, **loss_keys})
    for arch, (arch_label, arch_keys) in ARCHITECTURES.items()
    for loss, (loss_label, loss_keys) in LOSSES.items()
)


def _recall_columns(direction: str) -> tuple[Column, ...]:
    return (*(Column(f"test_{direction}_R_at_{k}", f"R@{k}", direction) for k in (1, 5, 10)),
            Column(f"test_{direction}_avg_recall", "avg R", direction))


TABLE_1 = Table(
    "table1", "Metric-learning losses on the embedded benchmark (the paper's Table 1 layout)",
    (*_recall_columns("i2t"),
     Column("test_i2t_mAP_at_5", "mAP@5", "i2t", unit="", digits=2, scale=0.01),
     *_recall_columns("t2i"), Column("test_rsum", "rsum")),
    baseline="vsepp_triplet_sh",
    caption="test split, best-validation checkpoint; R@k and rsum in %, mAP@5 as a fraction "
            "(the paper's code: mean precision over the hits in the top 5)",
)


def _cocos_columns(direction: str) -> tuple[Column, ...]:
    return (Column(f"cocos/{direction}_contributing_mean", "C^q", direction, better=None, unit="",
                   digits=2),
            Column(f"cocos/{direction}_contributing_all_mean", "C^q (all)", direction, better=None,
                   unit="", digits=2),
            Column(f"cocos/{direction}_zero_queries_mean", "C^0", direction, better=None, unit="",
                   digits=2))


COCOS_TABLE = Table(
    "cocos", "COCOS: samples contributing to the gradient (section 4)",
    (*_cocos_columns("i2t"), *_cocos_columns("t2i")), test=None,
    caption="training set, best checkpoint, batches of 128 pairs (SmoothAP: 128 images with their "
            "captions); C^q: contributing candidates per query that has any, over those queries "
            "(a batch with none counts 0, as in the paper's notebooks) and over all; C^0: "
            "queries with none; means over batches",
)

STUDY = Study(
    name="loss_functions",
    description="triplet, triplet SH, NT-Xent and SmoothAP on VSE++ and VSRN, with COCOS",
    base=BASE,
    space_file="loss_functions.yaml",
    conditions=CONDITIONS,
    budget=3,
    startup_trials=3,
    seeds=3,
    grace_period=1,
    reduction_factor=3,
    tables=(TABLE_1, COCOS_TABLE),
    figures=(
        Figure("cocos_i2t_per_step", "COCOS during training: contributing candidates per "
               "image query (confirmation runs)",
               series_per_condition("cocos_i2t_contributing", ylabel="C^q, i2t")),
        Figure("cocos_t2i_per_step", "COCOS during training: contributing candidates per "
               "caption query (confirmation runs)",
               series_per_condition("cocos_t2i_contributing", ylabel="C^q, t2i")),
        Figure("val_rsum_per_epoch", "validation rsum per epoch", metric_per_epoch()),
    ),
    analyses=("cocos",),
    smoke={"data.preset": "tiny", "train.finetune_epochs": 1, "train.batch_size": 16,
           "train.trajectory_every": 1, "image.gcn_layers": 1},
    smoke_budget=1,
    smoke_seeds=1,
    debug_condition="vsrn_triplet_sh",
)
