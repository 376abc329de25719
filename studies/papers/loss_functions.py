"""Do lessons from metric learning generalise to ICR? Four losses on VSE++ and VSRN, with COCOS.

Bleeker & de Rijke, "Do Lessons from Metric Learning Generalize to Image-Caption Retrieval?"
(Bleeker & de Rijke, ECIR 2022), Table 1 and section 4: the triplet loss over all
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
128-d embeddings; every loss gets the same number of epochs. ``--recipe paper`` is the paper's
(30 epochs, SmoothAP 150, five runs each).
"""

from __future__ import annotations

from studies.catalog import Condition, Recipe, Study
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
    "table1", "Metric-learning losses (the paper's Table 1 layout)",
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

# The paper's recipe (--recipe paper) on COCO or Flickr30k: a Karpathy split JSON with its images
# (VSE++ trains on pixels) and the SCAN/BUTD regions of the same images (VSRN), given with
# data.precomp_dir. Values from the metric-learning paper (Bleeker & de Rijke, ECIR 2022)
# Section 4 and the ECIR reproducibility code (docs/reference-code.md, section 2).
PAPER_COMMON = {
    "data.dataset": "karpathy",
    "optim.name": "adam",
    "optim.lr": 2e-4,  # Section 4: "We start with a learning rate of 0.0002
    "optim.schedule": "step",  # and after 15 epochs we lower the learning rate to 0.00002"
    "optim.step_epochs": 15,
    "optim.step_gamma": 0.1,
    "optim.grad_clip": 2.0,  # VSE++ / VSRN code: grad_clip 2
    "optim.finetune_lr_factor": 1.0,
    "train.batch_size": 128,  # Section 4: "a batch size of 128"
    "train.warmup_epochs": 0,
    "train.finetune_epochs": 30,  # Section 4: "Each method is trained for 30 epochs"
    "train.swa": False,
    "text.encoder": "gru",
    "text.bidirectional": False,  # VSE++ / VSRN: a uni-directional GRU
    "text.glove": "none",  # over randomly initialised word embeddings
    "text.word_dim": 300,
    "text.unk_prob": 0.0,
    "text.delete_prob": 0.0,
    "train.live_cocos": True,
    "eval.test": False,
}
PAPER_ARCHITECTURES = {
    "vsepp": {
        "data.features": "pixels", "data.image_size": 224,
        "image.encoder": "resnet50",  # Section 4: ResNet50 instead of ResNet152
        "image.pretrained": True,
        "image.frozen": True,  # "we do not apply additional fine-tuning of the image encoder"
        "image.random_erasing": 0.0,
        "model.embed_dim": 1024, "text.hidden_dim": 1024,  # VSE++: 1024-d GRU and space
        "model.head_batchnorm": False,
    },
    "vsrn": {
        "data.features": "regions", "image.encoder": "vsrn",
        "image.output_dim": 2048, "model.embed_dim": 2048, "text.hidden_dim": 2048,  # VSRN: 2048
        "image.gcn_layers": 4,  # VSRN's 4 reasoning layers
        "model.head_batchnorm": True,  # VSRN's BatchNorm after the GRU
    },
}
PAPER_LOSSES = {  # Section 2: each loss at the value of its original work
    "triplet_all": {"loss.margin": 0.2},
    "triplet_sh": {"loss.margin": 0.2},
    "ntxent": {"loss.tau": 0.1},
    # SmoothAP: tau 0.01; batches of whole images with all 5 captions, so "we have to increase the
    # amount of training epochs k times": 150 epochs, the lr step at 75 (docs/reference-code.md, section 2).
    "smoothap": {"loss.tau": 0.01, "train.batch_size": 26, "train.finetune_epochs": 150,
                 "optim.step_epochs": 75},
}
PAPER = Recipe(
    "paper", "metric-learning paper Section 4; ECIR reproducibility code", PAPER_COMMON,
    conditions={f"{arch}_{loss}": {**PAPER_ARCHITECTURES[arch], **PAPER_LOSSES[loss]}
                for arch in ARCHITECTURES for loss in LOSSES},
    space_file="paper/fixed.yaml", seeds=5,  # Section 4: "we run each experiment five times"
    early_stopping=False, datasets=("karpathy",),
    requires={"data.karpathy_json": "the Karpathy split JSON of COCO or Flickr30k",
              "data.precomp_dir": "SCAN/BUTD regions of the same images (VSRN)",
              "image.weights_path": "ResNet-50 ImageNet weights (VSE++)"},
    notes=("SmoothAP batches: 26 images with their 5 captions (130 captions), the nearest to the "
           "128 pairs of the other losses; the paper does not state it",
           "VSRN on Flickr30k steps the lr at epoch 10: --set optim.step_epochs=10 (not SmoothAP)",
           "VSRN's similarity is one model's, not the original's two-model ensemble (Section 4)"),
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
    paper=PAPER,
)
