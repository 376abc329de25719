"""The study catalog, search-space files, plans, selection, resources and cluster.yaml (no Ray)."""

from __future__ import annotations

import ast
import functools
import json
import logging
from pathlib import Path

import pytest
import yaml

from icr.config import from_flat, key_specs, to_flat, used_keys
from icr.errors import ConfigError, UserError
from studies.catalog import SEARCH_SPACES, Condition, Study, all_studies, get_study
from studies.connection import Cluster
from studies.pipeline import Backend, prepare_data
from studies.plan import Options, StudyPlan
from studies.samplers import SpreadThenTPESampler
from studies.searcher import StudySearcher
from studies.select import select_winner
from studies.space import ConditionalSpace, load_space
from studies.storage import check_storage
from studies.trials import KEY, TrialSpec
from studies.tuning import TrialRecord

from fakes import fake_prepare

ROOT = Path(__file__).resolve().parent.parent
STUDIES = sorted(all_studies())


@pytest.mark.parametrize("name", STUDIES)
@pytest.mark.parametrize("smoke", [False, True])
def test_every_condition_config_round_trips(name: str, smoke: bool) -> None:
    plan = StudyPlan.build(get_study(name), Options(smoke=smoke))
    for condition in plan.conditions:
        config = condition.config
        assert from_flat(to_flat(config)) == config == from_flat(condition.flat)
        assert config.eval.test is False  # search trials never see the test split
    assert plan.max_epochs == plan.conditions[0].config.epochs
    assert plan.debug_config(None).objective.name in ("lagrangian", "dual", "contrastive")


@pytest.mark.parametrize("name", STUDIES)
def test_the_driver_prepares_every_asset_a_condition_reads(name: str, tmp_path: Path) -> None:
    """Each condition's trials find their data ready: the driver prepares one configuration per
    distinct set of used data keys. ltd_bound's baseline and its LTD conditions share every data
    file but the latent targets, which only a decoder reads; prepared once for the baseline, the
    first two LTD trials each encoded all 20,000 captions with MiniLM on one core (164 s for a
    first epoch of 21 s)."""
    plan = StudyPlan.build(get_study(name), Options(workspace=str(tmp_path)))
    prepared = []

    def prepare(config, workspace):
        prepared.append(config)
        return fake_prepare(config, workspace)

    prepare_data(plan, Backend(prepare=prepare), say=lambda line: None)

    def reads(config) -> set[str]:
        used = set(used_keys(config))
        return {k for k in ("decoder.target_model", "text.glove", "text.encoder") if k in used}

    for condition in plan.conditions:
        assert any(reads(condition.config) <= reads(p) for p in prepared), condition.name
    if name == "ltd_bound":
        assert [p.decoder.name for p in prepared] == ["none", "ltd"]


@pytest.mark.parametrize("path", sorted(SEARCH_SPACES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_space_file_parses_to_known_keys(path: Path) -> None:
    space = load_space(path)
    specs = key_specs()
    sections = [space.common, *space.per_condition.values()]
    for section in sections:
        assert set(section.fixed) <= set(specs) and set(section.domains) <= set(specs)
        for domain in section.domains.values():
            from_flat({domain.key: domain.midpoint()})


def test_every_space_file_belongs_to_a_study() -> None:
    used = {get_study(n).space_path.name for n in STUDIES}
    assert used == {p.name for p in SEARCH_SPACES.glob("*.yaml")}


def test_ltd_bound_searches_eta_over_the_paper_range() -> None:
    plan = StudyPlan.build(get_study("ltd_bound"), Options())
    eta = plan.condition("lagrangian").domains["objective.eta"]
    assert (eta.kind, eta.values) == ("uniform", (0.05, 0.3))
    # Its quasi-random start covers the range: both ends of Figure 3 are sampled.
    from optuna.distributions import FloatDistribution

    from studies.samplers import spread_point

    study = get_study("ltd_bound")
    sampler = SpreadThenTPESampler(study.startup_trials, 0, ("objective.eta",))
    points = [spread_point(sampler._point(n, 0), FloatDistribution(0.05, 0.3))
              for n in range(study.startup_trials)]
    assert min(points) == 0.05 and max(points) > 0.25 and study.budget > study.startup_trials
    assert not plan.condition("contrastive").domains
    assert plan.condition("dual").flat["objective.beta"] == 1.0
    itd = StudyPlan.build(get_study("ltd_itd"), Options()).condition("itd_lagrangian")
    assert itd.domains["objective.eta"].values == (0.5, 6.0)
    triplet = StudyPlan.build(get_study("ltd_triplet"), Options())
    assert all(c.config.loss.name == "triplet" for c in triplet.conditions)


@pytest.mark.parametrize(
    ("body", "culprit"),
    [
        ("space:\n  loss.tauu: 0.1\n", "loss.tauu"),
        ("space:\n  loss.tau: abc\n", "loss.tau"),
        ("space:\n  loss.tau: {gauss: [0, 1]}\n", "loss.tau"),
        ("space:\n  loss.tau: {uniform: [0.2, 0.1]}\n", "loss.tau"),
        ("space:\n  loss.tau: {loguniform: [0.0, 0.1]}\n", "loss.tau"),
        ("space:\n  loss.tau: {int: [1, 3]}\n", "loss.tau"),
        ("space:\n  train.batch_size: {uniform: [16, 64]}\n", "train.batch_size"),
        ("space:\n  loss.name: {choice: [infonce, hinge]}\n", "loss.name"),
        ("space:\n  loss.tau: [0.1, 0.2]\n", "loss.tau"),
        ("conditions:\n  nope:\n    loss.tau: 0.1\n", "nope"),
        ("space: [1, 2\n", "YAML"),
        ("spaces:\n  loss.tau: 0.1\n", "space"),
    ],
)
def test_bad_space_file_names_file_and_key(tmp_path: Path, body: str, culprit: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(ConfigError) as info:
        load_space(path, ("contrastive", "lagrangian"))
    message = str(info.value)
    assert str(path) in message and culprit in message and "\n" not in message


def _study(tmp_path: Path, space: str, **kw) -> Study:
    (tmp_path / "s.yaml").write_text(space)
    conditions = kw.pop("conditions", (Condition("lag", "L", {"objective.name": "lagrangian"}),))
    return Study("t", "test", {"train.warmup_epochs": 1, "train.finetune_epochs": 1},
                 str(tmp_path / "s.yaml"), conditions, **kw)


def test_a_condition_cannot_fix_a_searched_key(tmp_path: Path) -> None:
    study = _study(tmp_path, "conditions:\n  lag:\n    objective.name: {choice: [dual]}\n")
    with pytest.raises(ConfigError, match="objective.name is searched"):
        StudyPlan.build(study, Options())


def test_set_pins_a_searched_key_and_overrides_win(tmp_path: Path) -> None:
    study = _study(tmp_path, "space:\n  loss.tau: {uniform: [0.02, 0.1]}\n  loss.margin: 0.3\n")
    plan = StudyPlan.build(study, Options(overrides={"loss.tau": "0.07", "loss.margin": "0.4"}))
    lag = plan.condition("lag")
    assert lag.domains == {} and lag.flat["loss.tau"] == 0.07 and lag.flat["loss.margin"] == 0.4
    with pytest.raises(ConfigError, match="loss.tau"):
        StudyPlan.build(study, Options(overrides={"loss.tau": "-1"}))


def test_an_analysis_that_cannot_run_on_a_condition_stops_the_plan(tmp_path: Path) -> None:
    study = _study(tmp_path, "space:\n  optim.lr: {loguniform: [1.0e-4, 1.0e-3]}\n",
                   analyses=("cocos",), conditions=(Condition("g", "G", {"task.name": "grounding"}),))
    with pytest.raises(ConfigError) as info:
        StudyPlan.build(study, Options())
    assert str(info.value) == ("eval.analyses=cocos runs on a retrieval task, but this condition "
                               "trains task.name=grounding; drop cocos or use task.name=retrieval")


def test_a_searched_choice_an_analysis_cannot_run_on_stops_the_plan(tmp_path: Path) -> None:
    from icr.analysis.cocos import COCOS_COUNTERS
    from icr.losses import LOSSES

    without = [n for n in LOSSES.names() if n not in COCOS_COUNTERS]
    if not without:
        pytest.skip("every registered loss has a COCOS counter")
    space = f"space:\n  loss.name: {{choice: [{COCOS_COUNTERS.names()[0]}, {without[0]}]}}\n"
    study = _study(tmp_path, space, analyses=("cocos",), conditions=(Condition("c", "C", {}),))
    with pytest.raises(ConfigError, match=f"^eval.analyses=cocos needs a COCOS counter of the "
                                          f"run's loss, and loss.name={without[0]} has none"):
        StudyPlan.build(study, Options())


def test_unknown_study_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match="ltd_bound"):
        get_study("ltd_boudn")


def test_a_trial_samples_only_the_keys_its_choices_use() -> None:
    import optuna

    from studies.space import Domain

    space = ConditionalSpace({"train.batch_size": 16}, (
        Domain("loss.tau", "loguniform", (0.01, 0.2)), Domain("loss.margin", "uniform", (0.1, 0.3)),
        Domain("loss.name", "choice", ("triplet", "infonce")),
        Domain("train.warmup_epochs", "int", (1, 3)),
    ))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(12):
        trial = study.ask()
        space(trial)
        params = trial.params
        name = params["loss.name"]
        seen.add(name)
        assert ("loss.margin" in params) == (name == "triplet")
        assert ("loss.tau" in params) == (name == "infonce")
        assert params["train.warmup_epochs"] in (1, 2, 3)  # int ends included
        assert 0.01 <= params.get("loss.tau", 0.1) <= 0.2
    assert seen == {"triplet", "infonce"}


def test_optuna_is_told_pruned_for_asha_stopped_trials(tmp_path: Path) -> None:
    """ASHA-stopped trials are PRUNED in Optuna (not COMPLETE with their early score), failed
    ones FAIL; each suggestion is the trial resolved once, with the value Optuna drew."""
    import optuna

    from studies.space import Domain

    log = tmp_path / "optuna.csv"
    base = {"objective.name": "lagrangian", "decoder.name": "ltd"}
    space = ConditionalSpace(base, (Domain("objective.eta", "uniform", (0.05, 0.3)),))
    searcher = StudySearcher(
        space, functools.partial(TrialSpec.resolve, "lag", base), metric="val_rsum", mode="max",
        sampler=optuna.samplers.RandomSampler(seed=0), max_t=4, log_path=str(log))
    for trial_id in ("a", "b", "c", "d"):
        spec = searcher.suggest(trial_id)[KEY]
        assert spec.condition == "lag" and 0.05 <= spec.config.objective.eta <= 0.3
        assert spec.params["objective.eta"] == spec.values["objective.eta"]
    searcher.on_trial_result("a", {"val_rsum": 80.0, "epoch": 1})
    searcher.on_trial_complete("a", {"val_rsum": 100.0, "epoch": 2})  # stopped by ASHA
    searcher.on_trial_complete("b", {"val_rsum": 250.0, "epoch": 4})  # ran the full budget
    searcher.on_trial_complete("c", None, error=True)
    searcher.on_trial_complete("d", {"val_rsum": 90.0, "epoch": 3}, error=True)
    trials = searcher.study.get_trials(deepcopy=False)
    assert {t.number: t.state.name for t in trials} == {0: "PRUNED", 1: "COMPLETE", 2: "FAIL", 3: "FAIL"}
    assert trials[1].value == 250.0 and trials[0].intermediate_values == {1: 80.0}
    assert "PRUNED" in log.read_text() and "COMPLETE" in log.read_text()


def test_a_result_reported_again_is_told_to_optuna_once(tmp_path: Path) -> None:
    """A restored trial reports the epoch it continues after again
    (studies.trainable.resume_point): Optuna keeps the first value, and says nothing (it warned
    "The reported value is ignored because this `step=1` is already reported"), also when the
    searcher itself was restored from its saved state (the values it told are Optuna's)."""
    import warnings

    import optuna

    from studies.space import Domain

    base = {"objective.name": "lagrangian", "decoder.name": "ltd"}
    space = ConditionalSpace(base, (Domain("objective.eta", "uniform", (0.05, 0.3)),))
    searcher = StudySearcher(space, functools.partial(TrialSpec.resolve, "lag", base),
                             metric="val_rsum", mode="max", max_t=4,
                             sampler=optuna.samplers.RandomSampler(seed=0))
    searcher.suggest("a")
    searcher.on_trial_result("a", {"val_rsum": 80.0, "epoch": 1})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        searcher.on_trial_result("a", {"val_rsum": 80.0, "epoch": 1})
        searcher.on_trial_result("a", {"val_rsum": 90.0, "epoch": 2})
    assert searcher.study.get_trials(deepcopy=False)[0].intermediate_values == {1: 80.0, 2: 90.0}
    searcher.save(str(tmp_path / "searcher.json"))
    restored = StudySearcher(space, functools.partial(TrialSpec.resolve, "lag", base),
                             metric="val_rsum", mode="max", max_t=4,
                             sampler=optuna.samplers.RandomSampler(seed=0))
    restored.restore(str(tmp_path / "searcher.json"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        restored.on_trial_result("a", {"val_rsum": 91.0, "epoch": 2})
        restored.on_trial_result("a", {"val_rsum": 95.0, "epoch": 3})
    assert restored.study.get_trials(deepcopy=False)[0].intermediate_values == {
        1: 80.0, 2: 90.0, 3: 95.0}


def test_the_searcher_is_saved_and_restored_with_its_trials(tmp_path: Path, monkeypatch) -> None:
    """What Tuner.restore needs: a restored searcher knows the trials asked and told so far.
    Neither study prints Optuna's "A new study created" line (the status line says what is
    searched)."""
    import optuna

    from studies.space import Domain

    lines: list[str] = []
    said = logging.Handler()
    said.emit = lambda record: lines.append(record.getMessage())
    monkeypatch.setattr(logging.getLogger("optuna"), "handlers", [said])  # Optuna's own logger
    base = {"objective.name": "lagrangian", "decoder.name": "ltd"}
    space = ConditionalSpace(base, (Domain("objective.eta", "uniform", (0.05, 0.3)),))
    make = functools.partial(StudySearcher, space, functools.partial(TrialSpec.resolve, "lag", base),
                             metric="val_rsum", mode="max", max_t=4)
    searcher = make(sampler=optuna.samplers.RandomSampler(seed=0))
    running = searcher.suggest("a")[KEY]
    searcher.suggest("b")
    searcher.on_trial_complete("b", {"val_rsum": 250.0, "epoch": 4})
    searcher.save(str(tmp_path / "searcher.pkl"))
    restored = make(sampler=optuna.samplers.RandomSampler(seed=1))
    restored.restore(str(tmp_path / "searcher.pkl"))
    assert restored.suggest("a")[KEY] == running  # the trial that was running keeps its values
    restored.on_trial_complete("a", {"val_rsum": 200.0, "epoch": 4})
    assert [t.state.name for t in restored.study.get_trials()] == ["COMPLETE", "COMPLETE"]
    assert not [line for line in lines if "A new study" in line]


class Planted:
    """Unpickled, it makes a folder: what a stranger could put in a searcher state on storage."""

    def __init__(self, flag: Path) -> None:
        self.flag = flag

    def __reduce__(self):
        import os

        return os.mkdir, (str(self.flag),)


def test_a_searcher_state_is_read_as_data_never_executed(tmp_path: Path) -> None:
    """The searcher's state was read back with pickle.load from the study's storage, which may
    be a shared bucket: a file put there ran its code in the driver."""
    import pickle

    import optuna

    from studies.space import Domain

    base = {"objective.name": "lagrangian", "decoder.name": "ltd"}
    space = ConditionalSpace(base, (Domain("objective.eta", "uniform", (0.05, 0.3)),))
    searcher = StudySearcher(space, functools.partial(TrialSpec.resolve, "lag", base),
                             metric="val_rsum", mode="max", max_t=4,
                             sampler=optuna.samplers.RandomSampler(seed=0))
    state = tmp_path / "searcher-state.pkl"
    flag = tmp_path / "executed"
    state.write_bytes(pickle.dumps(Planted(flag)))
    with pytest.raises(UserError) as error:
        searcher.restore(str(state))
    assert not flag.exists()
    message = str(error.value)
    assert "\n" not in message and str(state) in message and "--fresh" in message
    searcher.suggest("a")
    searcher.save(str(state))
    assert json.loads(state.read_text())["tune_trials"] == {"a": 0}  # data, as it says


def _record(tid: str, score: float, epochs: int, error: bool = False) -> TrialRecord:
    eta = score / 1000 if score == score else 0.2  # a NaN score (a diverged trial) drew 0.2
    spec = TrialSpec.resolve("lag", {}, {"objective.eta": eta})
    return TrialRecord(tid, spec, {"val_rsum": score, "epoch": epochs},
                       "TrainingError: boom" if error else "")


def test_selection_ignores_stopped_and_failed_trials() -> None:
    records = [_record("a", 300, 2), _record("b", 200, 4), _record("c", 250, 4),
               _record("d", 400, 4, error=True), _record("e", float("nan"), 4)]
    winner = select_winner(records, "val_rsum", "max", max_epochs=4)
    assert winner is not None and winner.trial_id == "c" and winner.sampled == {"objective.eta": 0.25}
    assert select_winner(records, "val_rsum", "min", 4).trial_id == "b"
    assert select_winner(records[:1], "val_rsum", "max", 4) is None


def test_one_gpu_per_trial_when_the_cluster_has_gpus() -> None:
    gpu = Cluster("a", None, cpus=16, gpus=4, nodes=2, started_here=False)
    assert gpu.trial_resources() == {"cpu": 4, "gpu": 1} and gpu.concurrency({"cpu": 4, "gpu": 1}) == 4
    assert "one GPU" in gpu.describe(gpu.trial_resources())
    cpu = Cluster("a", None, cpus=2, gpus=0, nodes=1, started_here=True)
    assert cpu.trial_resources() == {"cpu": 1} and cpu.concurrency(cpu.trial_resources()) == 2
    assert "CPU-only" in cpu.describe(cpu.trial_resources())


MOUNTS = "/dev/sda1 / ext4 rw 0 0\nnfs:/export /mnt/shared nfs4 rw 0 0\n"


def test_multi_node_storage_must_be_shared() -> None:
    check_storage("/home/me/workspace/ray", nodes=1, mounts=MOUNTS)
    check_storage("s3://bucket/ray", nodes=3, mounts=MOUNTS)
    check_storage("gs://bucket/ray", nodes=3, mounts=MOUNTS)
    check_storage("/mnt/shared/ray", nodes=3, mounts=MOUNTS)
    with pytest.raises(UserError, match="local disk .ext4.*s3://"):
        check_storage("/home/me/workspace/ray", nodes=3, mounts=MOUNTS)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_ray_meets_icr_only_where_work_runs_in_a_ray_worker() -> None:
    """A trial (the trainable) and an ensemble's evaluation (a Ray task) run icr code in Ray's
    workers; every other platform module keeps the two apart (icr's errors and its workspace's
    layout, a path and the store's URI, are no work of icr's)."""
    meeting = []
    for path in sorted((ROOT / "studies").glob("*.py")):
        names = _imports(path)
        uses_ray = any(n == "ray" or n.startswith("ray.") for n in names)
        uses_icr = any(n.startswith("icr") and n not in ("icr.errors", "icr.workspace")
                       for n in names)
        if uses_ray and uses_icr:
            meeting.append(path.name)
    assert meeting == ["ensembles.py", "trainable.py"]


def test_cluster_yaml_follows_rays_schema() -> None:
    import jsonschema
    import ray.autoscaler

    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    jsonschema.validate(config, schema)
    types = config["available_node_types"]
    assert types[config["head_node_type"]]["resources"].get("GPU", 0) == 0
    assert any(t["resources"].get("GPU", 0) >= 1 for t in types.values())
    text = (ROOT / "cluster.yaml").read_text()
    assert "ICR_WORKSPACE" in text and "MLFLOW_TRACKING_URI" in text and config["docker"]["image"]
