"""Does latent target decoding reduce predictive feature suppression? Probes of every condition.

LTD paper section 1 and Table 1's conditions, measured directly on the embedded benchmark: the
contrastive baseline, LTD as a dual loss (beta 1), LTD as a constraint at eta 0.1 / 0.2 / 0.3 and
ITD as a dual loss (the better of the paper's two ITD variants), each trained with the ltd_bound
recipe over 3 seeds (fixed conditions: nothing is searched). Every confirmation run ends with the
``probe`` analysis (:mod:`icr.analysis.attribute_probes`): linear probes of its frozen test
embeddings for every ground-truth attribute family, image side (does the scene contain the value)
and caption side (does the caption state it), with the input / init / random references. Every
cell of the report is an MLflow metric of a run.
"""

from __future__ import annotations

from dataclasses import replace

from studies.catalog import Condition, Study
from studies.figures import Figure, metric_per_epoch
from studies.papers.ltd_bound import BASE, CONTRASTIVE, DUAL, PAPER, SMOKE
from studies.tables import Column, Table

FAMILIES = ("shape", "colour", "size", "texture", "position", "count", "background")
REFERENCES = (("input (ref)", "probe/", "probe_ref/input/"),
              ("init (ref)", "probe/", "probe_ref/init/"),
              ("random (ref)", "probe/", "probe_ref/random/"))


def ltd(eta: float) -> Condition:
    return Condition(f"ltd_{eta:g}", f"LTD, L_lag (eta={eta:g})",
                     {"objective.name": "lagrangian", "decoder.name": "ltd", "objective.eta": eta})


ITD = Condition("itd", "ITD, L_dual (beta=1)",
                {"objective.name": "dual", "decoder.name": "itd", "objective.beta": 1.0})

RETRIEVAL = Table(
    "retrieval", "Retrieval and the reconstruction constraint",
    (Column("test_rsum", "rsum"), Column("test_i2t_rprec", "R-P i2t"),
     Column("train_L_rec", "L_rec (last epoch)", better=None, unit="", digits=3),
     Column("lambda", "lambda (last epoch)", better=None, unit="", digits=2)),
    baseline="contrastive",
    caption="test split, best-validation checkpoint; L_rec and lambda at the end of training",
)


def probe_table(side: str, question: str) -> Table:
    return Table(
        f"probe_{side}", f"Probe ROC-AUC, {side} side: {question}",
        tuple(Column(f"probe/{side}/{f}", f, unit="", digits=3) for f in FAMILIES),
        baseline="contrastive", references=REFERENCES,
        caption="test split, linear probes of the frozen best-checkpoint embeddings fitted on "
                "the training split; mean over the family's values",
    )


STUDY = Study(
    name="ltd_probe",
    description="which attributes each objective keeps: linear probes of the trained embeddings",
    base=BASE,
    space_file="ltd_probe.yaml",
    conditions=(CONTRASTIVE, DUAL, ltd(0.1), ltd(0.2), ltd(0.3), ITD),
    seeds=3,
    analyses=("probe",),
    tables=(RETRIEVAL, probe_table("image", "does the scene contain the value"),
            probe_table("caption", "does the caption state the value")),
    figures=(Figure("val_rsum_per_epoch", "validation rsum per epoch", metric_per_epoch()),),
    smoke={**SMOKE, "train.batch_size": 32},
    debug_condition="ltd_0.1",
    # The probes need every image's attributes, which only the embedded benchmark records: the
    # LTD paper's model and training (ltd_bound's paper recipe) on the benchmark's images.
    paper=replace(
        PAPER, overrides={**PAPER.overrides, "data.dataset": "shapes", "data.preset": "default",
                          "data.image_size": 96, "decoder.word_dim": 300,
                          "decoder.hidden_dim": 1024},
        space_file="ltd_probe.yaml", datasets=("shapes",),
        requires={k: v for k, v in PAPER.requires.items() if k != "data.karpathy_json"},
        notes=("the probes need each image's attributes, which only the embedded benchmark "
               "records: the LTD recipe is trained on its 96 x 96 images (data.image_size 96)",)),
)
