"""Contrastive phrase grounding: do context-preserving negative captions beat random ones?

Gupta et al., "Contrastive Learning for Weakly Supervised Phrase Grounding" (ECCV 2020;
papers/contrastive-phrase-grounding.txt): word-region attention learned from image-caption pairs
alone, by InfoNCE over the in-batch images (L_img) and, in the key idea, over a caption's true noun
and substitutes a language model proposes for its context (L_lang). Three conditions: L_img only,
+ L_lang with random substitutes, + L_lang with context-preserving ones (a masked-noun head over
the frozen MiniLM, trained on the training captions; re-ranked to drop synonyms and hypernyms).

Evaluated as on Flickr30K Entities (Recall@1/5/10 of the phrase's top regions at IoU >= 0.5, and
pointing accuracy), the best epoch chosen on validation pointing accuracy. The confirmation runs
measure what no peer with real data can: how many of the run's negative captions are true
negatives, judged against the benchmark's scenes (``negative_quality``), and draw a few test
images with each phrase's top region (``grounding_examples``). Scaled to the embedded benchmark
and 2 CPU cores: 4 epochs, 5 substitutes per masked noun (the paper: 25), the learning rate and
the L_lang weight searched; the benchmark has 8 regions per image, so R@10 is trivially reached
and R@1 and pointing are the informative columns.

The masked LM's candidate pool is scaled to the benchmark's noun vocabulary too: the paper takes
the LM's 30 most likely nouns out of thousands, but the embedded benchmark's training captions
have 39 nouns, so 30 candidates are nearly all of them and the generator is random in all but
name. Measured against the scenes (``benchmarks/negative_generators.py``, 5 substitutes of the
training captions): with 30 candidates 18.0 % of the substituted captions are true negatives and
13.0 % false negatives (random: 18.6 % / 12.0 %); with 10 candidates 28.2 % / 22.6 %, and the
re-ranking then drops a quarter of the false negatives that the LM's top 5 alone keep (30.1 %).
So ``grounding.mlm_candidates`` is 10 here, chosen on negative quality, not on grounding scores.
"""

from __future__ import annotations

from studies.catalog import Condition, Study
from studies.figures import Figure, metric_per_epoch, series_per_condition
from studies.tables import Column, Table

BASE = {
    "task.name": "grounding", "data.dataset": "shapes", "data.preset": "default",
    "grounding.num_negatives": 5, "grounding.mlm_candidates": 10,
    "optim.name": "adam", "optim.grad_clip": 0.0, "train.batch_size": 50,
    "train.warmup_epochs": 0, "train.finetune_epochs": 4, "train.trajectory_every": 20,
    "eval.test": False,
}

TABLE = Table(
    "table", "Phrase grounding with negative captions (test, the Flickr30K Entities protocol)",
    (Column("test_R_at_1", "R@1"), Column("test_R_at_5", "R@5"), Column("test_R_at_10", "R@10"),
     Column("test_pointing", "pointing"),
     Column("negatives/true_negative", "true neg.", "negative captions", better=None, unit="",
            digits=3),
     Column("negatives/false_negative", "false neg.", "negative captions", better=None,
            unit="", digits=3)),
    baseline="img_only",
    caption="best-validation checkpoint (pointing accuracy); R@k and pointing in %; negative "
            "captions: the share of the run's substituted training captions that are false of "
            "their image (true negatives) or still true (false negatives), the rest unjudged",
)

STUDY = Study(
    name="grounding_negatives",
    description="L_img only vs + L_lang with random vs context-preserving negative captions",
    base=BASE,
    space_file="grounding_negatives.yaml",
    conditions=(
        Condition("img_only", "L_img only", {"grounding.negatives": "none"}),
        Condition("lang_random", "L_img + L_lang, random negatives",
                  {"grounding.negatives": "random"}),
        Condition("lang_context", "L_img + L_lang, context-preserving negatives",
                  {"grounding.negatives": "context"}),
    ),
    metric="val_pointing",
    budget=4,
    startup_trials=4,
    seeds=3,
    reduction_factor=3,
    tables=(TABLE,),
    figures=(
        Figure("val_pointing_per_epoch", "validation pointing accuracy per epoch",
               metric_per_epoch("val_pointing", "validation pointing accuracy (%)")),
        Figure("l_lang_per_step", "L_lang during training (confirmation runs)",
               series_per_condition("L_lang", ylabel="L_lang")),
    ),
    analyses=("negative_quality", "tagger_accuracy", "grounding_examples"),
    smoke={"data.preset": "tiny", "train.finetune_epochs": 2, "train.batch_size": 16,
           "train.trajectory_every": 1, "grounding.mlm_candidates": 10},
    smoke_budget=1,
    smoke_seeds=2,
    debug_condition="lang_context",
)
