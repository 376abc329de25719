"""Analyses declare the task kind and the capabilities they need; tasks and datasets declare what
they provide; the check refuses a mismatch in one line before anything starts, and the retrieval
analyses (attribute probes, COCOS) run end to end on a tiny fit with what their task provides."""

from __future__ import annotations

import math

import pytest
import torch

from icr.analysis import ANALYSES
from icr.analysis.cocos import COCOS_COUNTERS
from icr.config import from_flat
from icr.context import Capability, Embeddings, InitialEmbeddings, Scenes, TaskContext
from icr.data.datasets import DATASETS
from icr.errors import ConfigError
from icr.losses import LOSSES
from icr.train.analyses import check_analyses
from icr.train.retrieval_data import RetrievalInputs
from icr.train.tasks import TASKS

TINY = {
    "data.preset": "tiny", "model.embed_dim": 32, "text.hidden_dim": 32, "train.batch_size": 16,
    "train.warmup_epochs": 1, "train.finetune_epochs": 1, "train.swa_bn_batches": 2,
    "train.trajectory_every": 2, "eval.batch_size": 64, "train.device": "cpu",
}


def _provided_somewhere(capability: type[Capability], task: str) -> bool:
    return capability in TASKS.meta(task)["provides"] or any(
        capability in DATASETS.meta(d).get("provides", ()) for d in DATASETS)


@pytest.mark.parametrize("name", ANALYSES.names())
def test_every_analysis_declares_its_task_and_needs_and_runs_on_its_default(name):
    meta = ANALYSES.meta(name)
    assert meta["task"] in TASKS
    assert meta["needs"] and all(issubclass(n, Capability) for n in meta["needs"])
    assert all(_provided_somewhere(n, meta["task"]) for n in meta["needs"])
    check_analyses(from_flat({"task.name": meta["task"]}), [name])  # the embedded benchmark


@pytest.mark.parametrize("name", TASKS.names())
def test_every_task_declares_what_it_provides(name):
    provides = TASKS.meta(name)["provides"]
    assert provides and all(issubclass(c, Capability) for c in provides)


def _other_task(task: str) -> str:
    return next(t for t in TASKS.names() if t != task)


@pytest.mark.parametrize("name", ANALYSES.names())
def test_an_analysis_on_another_task_is_refused_in_one_line(name):
    task = ANALYSES.meta(name)["task"]
    other = _other_task(task)
    with pytest.raises(ConfigError) as info:
        check_analyses(from_flat({"task.name": other}), [name])
    message = str(info.value)
    assert message == (f"eval.analyses={name} runs on a {task} task, but this condition trains "
                       f"task.name={other}; drop {name} or use task.name={task}")


def test_cocos_on_grounding_and_negative_quality_on_retrieval_are_refused():
    with pytest.raises(ConfigError, match=r"^eval.analyses=cocos runs on a retrieval task, but "
                                          r"this condition trains task.name=grounding; drop cocos"):
        check_analyses(from_flat({"task.name": "grounding", "eval.analyses": "cocos"}))
    with pytest.raises(ConfigError, match=r"^eval.analyses=negative_quality runs on a grounding "
                                          r"task, but this condition trains task.name=retrieval"):
        check_analyses(from_flat({}), ["negative_quality"])


def test_an_analysis_needing_what_the_dataset_lacks_names_the_datasets_that_have_it():
    lacking = [d for d in DATASETS if Scenes not in DATASETS.meta(d).get("provides", ())]
    having = [d for d in DATASETS if Scenes in DATASETS.meta(d).get("provides", ())]
    config = from_flat({"data.dataset": lacking[0], "data.precomp_dir": "/data/precomp",
                        "data.karpathy_json": "/data/dataset.json"})
    with pytest.raises(ConfigError) as info:
        check_analyses(config, ["probe"])
    message = str(info.value)
    assert message.startswith(f"eval.analyses=probe needs Scenes (the embedded benchmark's ground "
                              f"truth, scenes.json), which task.name=retrieval with "
                              f"data.dataset={lacking[0]} does not provide; use data.dataset=")
    assert all(f"data.dataset={d}" in message for d in having) and "\n" not in message


def test_cocos_needs_a_counter_of_the_runs_loss():
    without = [n for n in LOSSES.names() if n not in COCOS_COUNTERS]
    if not without:
        pytest.skip("every registered loss has a COCOS counter")
    with pytest.raises(ConfigError, match=f"loss.name={without[0]} has none; use one of "):
        check_analyses(from_flat({"loss.name": without[0]}), ["cocos"])


def test_an_analysis_reads_only_what_it_declared():
    context = TaskContext.of("retrieval", from_flat({}), [Embeddings(lambda split: (None, None))])
    restricted = context.only("probe", [Embeddings, Scenes])
    assert restricted.get(Embeddings).embed("test") == (None, None)
    with pytest.raises(TypeError, match="reads RetrievalInputs without declaring it"):
        restricted.get(RetrievalInputs)
    with pytest.raises(ConfigError, match=r"^eval.analyses=probe needs Scenes .*which this "
                                          r"retrieval run's task and data lack; give data"):
        restricted.get(Scenes)


# ------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def fitted(workspace, tmp_path_factory):
    from icr.train import fit

    config = from_flat({**TINY, "eval.analyses": "probe,cocos"})
    reports = []
    fit(config, reports.append, workspace=workspace, run_dir=tmp_path_factory.mktemp("run"))
    return reports[-1]


def test_probe_and_cocos_run_on_the_best_checkpoint(fitted):
    metrics = fitted.metrics
    probes = [k for k in metrics if k.startswith("probe/")]
    assert {k.split("/")[1] for k in probes} == {"image", "caption"}
    for ref in ("input", "init", "random"):
        assert any(k.startswith(f"probe_ref/{ref}/") for k in metrics), ref
    assert all(0.0 <= metrics[k] <= 1.0 for k in probes)  # ROC-AUCs
    assert "artifacts/probe/probe_values.csv" in fitted.artifacts
    assert metrics["cocos/batches"] >= 1
    for d in ("i2t", "t2i"):
        assert math.isfinite(metrics[f"cocos/{d}_contributing_all_mean"])


def test_the_init_reference_is_the_model_fit_starts_from(workspace):
    """The probes' ``init`` embeddings: the model rebuilt from the run's seed equals the one a
    run of that config starts from, before any training."""
    from icr.seeding import seed_everything
    from icr.train.tasks import build_task

    config = from_flat(TINY)
    seed_everything(config.train.seed)
    task = build_task(config, workspace, torch.device("cpu"))
    before = task.embed_split("test")
    task.train_epoch(0)
    trained = task.embed_split("test")
    offered = {type(c): c for c in task.capabilities()}
    assert set(TASKS.meta("retrieval")["provides"]) <= set(offered) and Scenes in offered
    rebuilt = offered[InitialEmbeddings].build()("test")
    for a, b, c in zip(before, rebuilt, trained, strict=True):
        torch.testing.assert_close(a, b)
        assert not torch.allclose(b, c)  # the trained model is another one
    current = offered[Embeddings].embed("test")  # the live weights, not a rebuilt model
    for a, b in zip(current, trained, strict=True):
        torch.testing.assert_close(a, b)
