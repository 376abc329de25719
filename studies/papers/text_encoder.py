"""The caption encoder as a searched dimension: a bi-GRU over words or a BERT-architecture encoder.

The VSE+2AD paper (Zhang et al., EACL 2023) reports both a BiGRU and a
BERT-base text backbone; offline, the BERT-architecture encoder is the bundled MiniLM
(``text.bert_path`` takes any local folder), fine-tuned at a tenth of the learning rate
(``text.bert_lr_factor``, the paper's Appendix B). Both towers use AdPool and the objective is
AdOpt, the paper's best; everything else is the pooling_objective recipe. One condition searches
``text.encoder`` itself (with the learning rate), so the searcher compares the two encoders; the
two fixed conditions confirm each over seeds.
"""

from __future__ import annotations

from dataclasses import replace

from studies.catalog import Condition, Study
from studies.figures import Figure, metric_per_epoch
from studies.papers.pooling_objective import BASE, PAPER, PAPER_BASE, TABLE

COMMON = {**BASE, "image.pooling": "adpool", "text.pooling": "adpool", "loss.name": "adopt",
          "loss.margin": 0.2}

STUDY = Study(
    name="text_encoder",
    description="bi-GRU vs BERT-architecture caption encoder (AdPool, AdOpt)",
    base=COMMON,
    space_file="text_encoder.yaml",
    conditions=(
        Condition("gru", "bi-GRU (directions averaged)", {"text.encoder": "gru_tokens"}),
        Condition("bert", "MiniLM (BERT architecture)", {"text.encoder": "bert"}),
        Condition("searched", "text encoder searched", {}),
    ),
    budget=3,
    startup_trials=3,
    seeds=2,
    reduction_factor=3,
    tables=(replace(TABLE, baseline="gru", title="Caption encoders"),),
    figures=(Figure("val_rsum_per_epoch", "validation rsum per epoch", metric_per_epoch()),),
    smoke={"data.preset": "tiny", "train.finetune_epochs": 1, "train.batch_size": 16},
    smoke_budget=1,
    smoke_seeds=1,
    debug_condition="bert",
    # pooling_objective's paper recipe with AdPool and AdOpt; the BERT condition loads BERT-base
    # from text.bert_path (Appendix B: the pre-trained module at 10% of the lr).
    paper=replace(
        PAPER, overrides={**PAPER_BASE, "image.pooling": "adpool", "text.pooling": "adpool",
                          "loss.name": "adopt", "loss.margin": 0.2, "loss.tau": 0.05},
        conditions={}, space_file="paper/text_encoder.yaml",
        requires={**PAPER.requires, "text.bert_path": "bert-base-uncased (the BERT condition)"}),
)
