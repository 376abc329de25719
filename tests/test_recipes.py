"""Each study's ``paper`` recipe holds the values its paper states (written out here, with the
paper's section), and ``--recipe`` / ``--plan`` / grids / per-condition epochs work.

The expected values are copied from the papers (cited by authors, venue and section)
and the reference code, never from the study modules."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest

from icr.config import used_keys
from icr.errors import UserError
from studies.catalog import all_studies, get_study
from studies.estimate import asha_expected_epochs, plan_costs
from studies.frameworks.optuna import GridOnceSampler
from studies.plan import Options, StudyPlan
from studies.run import main
from studies.space import ConditionalSpace, Domain, grid_points, grid_size, parse_domain

LTD_ETA_GRID = [0.05, 0.1, 0.15, 0.2, 0.25, 0.3]  # LTD Section 4.3
# A Karpathy split JSON of 32 images (30 train), 5 captions each
KARPATHY = [{"filename": f"{i}.jpg", "imgid": i,
             "split": "train" if i < 30 else "val" if i < 31 else "test",
             "sentences": [{"raw": f"a cat {j}", "tokens": ["a", "cat", str(j)], "sentid": 5 * i + j}
                           for j in range(5)]}
            for i in range(32)]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    """Local files standing in for the real assets a paper recipe names (the plan checks that
    they exist, and reads the split JSON and looks for its images)."""
    out = {}
    for key, name in [("data.karpathy_json", "dataset_coco.json"), ("image.weights_path", "r50.pth"),
                      ("text.glove", "glove.840B.300d.txt")]:
        path = tmp_path / name
        text = {"json": json.dumps({"images": KARPATHY}), "txt": "the " + " ".join(["0.1"] * 300) + "\n"}.get(name[-4:].lstrip("."), "x")
        path.write_text(text)
        out[key] = str(path)
    (tmp_path / "images").mkdir()  # the JSON's image folder: --plan checks each file is there
    for image in KARPATHY:
        (tmp_path / "images" / image["filename"]).write_bytes(b"")
    for key in ("data.precomp_dir", "data.entities_dir", "grounding.word_model",
                "grounding.mlm_path", "text.bert_path"):
        folder = tmp_path / key.replace(".", "_")
        folder.mkdir()
        out[key] = str(folder)
    return out


def paper_plan(name: str, files: dict[str, str], tmp_path: Path) -> StudyPlan:
    options = Options(recipe="paper", overrides=files, workspace=str(tmp_path / "ws"))
    return StudyPlan.build(get_study(name), options, strict=False)


def flat(plan: StudyPlan, condition: str) -> dict:
    from icr.config import to_flat
    return to_flat(plan.condition(condition).config)


def test_every_study_has_a_paper_recipe():
    assert {name for name, s in all_studies().items() if s.paper is None} == set()


def test_ltd_bound_paper_recipe(files, tmp_path):
    plan = paper_plan("ltd_bound", files, tmp_path)
    f = flat(plan, "lagrangian")
    # Section 4.3: 30 warm-up + 30 fine-tune epochs, batch 128, cosine, lr 2e-4, tau 0.05, SWA of
    # 5 checkpoints over the last 10 %, lambda from 1 in [0, 100], SGA lr 5e-3, momentum and
    # dampening 0.9. Section 4.2 / reference: ResNet-50, bi-GRU 512 units, 1024-d, AdamP,
    # gradient clip 2, fine-tune at lr x 0.1, random erasing 0.2, 10 % <unk> and deletion.
    expected = {
        "train.warmup_epochs": 30, "train.finetune_epochs": 30, "train.batch_size": 128,
        "optim.schedule": "cosine", "optim.lr": 2e-4, "loss.tau": 0.05, "train.swa": True,
        "train.swa_snapshots": 5, "train.swa_fraction": 0.1, "objective.lambda_init": 1.0,
        "objective.lambda_max": 100.0, "objective.lambda_lr": 5e-3,
        "objective.lambda_momentum": 0.9, "objective.lambda_dampening": 0.9,
        "image.encoder": "resnet50", "image.pretrained": True, "text.bidirectional": True,
        "text.hidden_dim": 512, "text.word_dim": 300, "model.embed_dim": 1024,
        "model.head_hidden": 2048, "optim.name": "adamp", "optim.grad_clip": 2.0,
        "optim.weight_decay": 0.0, "optim.finetune_lr_factor": 0.1, "image.random_erasing": 0.2,
        "text.unk_prob": 0.1, "text.delete_prob": 0.1, "data.dataset": "karpathy",
        "decoder.target_model": "all-MiniLM-L6-v2", "objective.name": "lagrangian",
    }
    assert {k: f[k] for k in expected} == expected
    eta = plan.condition("lagrangian").domains["objective.eta"]
    assert (eta.kind, list(eta.values)) == ("grid", LTD_ETA_GRID)
    assert plan.condition("lagrangian").trials(plan.budget) == 6
    assert not plan.early_stopping  # every eta trained to the end
    assert flat(plan, "dual")["objective.beta"] == 1.0  # Section 4.3: beta = 1


def test_ltd_itd_and_triplet_paper_recipes(files, tmp_path):
    itd = paper_plan("ltd_itd", files, tmp_path)
    eta = itd.condition("itd_lagrangian").domains["objective.eta"]
    assert list(eta.values) == [0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # Section 4.3 (ITD)
    assert flat(itd, "itd_dual")["decoder.hidden_dim"] == 1024  # GRU(300 -> 1024)
    triplet = paper_plan("ltd_triplet", files, tmp_path)
    f = flat(triplet, "lagrangian")
    assert (f["loss.name"], f["loss.margin"], f["model.head_batchnorm"]) == ("triplet", 0.2, True)
    assert list(triplet.condition("lagrangian").domains["objective.eta"].values) == LTD_ETA_GRID
    assert f["train.warmup_epochs"] + f["train.finetune_epochs"] == 60


def test_ltd_probe_paper_recipe_trains_the_ltd_model_on_the_benchmark(files, tmp_path):
    plan = paper_plan("ltd_probe", files, tmp_path)
    f = flat(plan, "ltd_0.1")
    assert f["data.dataset"] == "shapes"  # the probes need the benchmark's attributes
    assert (f["image.encoder"], f["text.hidden_dim"], f["model.embed_dim"]) == ("resnet50", 512, 1024)
    assert f["train.warmup_epochs"] == f["train.finetune_epochs"] == 30


def test_ltd_architectures_paper_recipe(files, tmp_path):
    plan = paper_plan("ltd_architectures", files, tmp_path)
    vsrn, tern = flat(plan, "vsrn_lagrangian"), flat(plan, "tern_lagrangian")
    assert vsrn["data.dataset"] == tern["data.dataset"] == "precomp"  # BUTD regions
    # Section 4.4 (i): VSRN's image embedding 1024-d instead of 2048, the LTD caption encoder;
    # VSRN's 4 reasoning layers, 30 epochs with the lr x 0.1 at 15.
    assert (vsrn["image.output_dim"], vsrn["image.gcn_layers"], vsrn["text.encoder"]) == (1024, 4, "gru")
    assert (vsrn["train.warmup_epochs"], vsrn["train.finetune_epochs"]) == (15, 15)
    assert vsrn["optim.finetune_lr_factor"] == 0.1 and vsrn["optim.lr"] == 2e-4
    # TERN: 4 region layers, 2 shared layers, 4 heads, dropout 0.1, BERT's first 6 layers
    assert (tern["image.transformer_layers"], tern["model.shared_layers"],
            tern["model.transformer_heads"], tern["text.bert_layers"]) == (4, 2, 4, 6)
    assert tern["model.transformer_dropout"] == 0.1
    assert vsrn["loss.tau"] == tern["loss.tau"] == 0.05
    for name in ("vsrn_lagrangian", "tern_lagrangian"):
        assert list(plan.condition(name).domains["objective.eta"].values) == LTD_ETA_GRID


def test_loss_functions_paper_recipe(files, tmp_path):
    plan = paper_plan("loss_functions", files, tmp_path)
    # Section 4: 30 epochs, batch 128, lr 0.0002 lowered to 0.00002 after 15 epochs; five runs;
    # VSE++ with ResNet50, not fine-tuned; SmoothAP k = 5 times the epochs (150, step at 75).
    assert len(plan.seeds) == 5
    for arch in ("vsepp", "vsrn"):
        for loss in ("triplet_all", "triplet_sh", "ntxent"):
            f = flat(plan, f"{arch}_{loss}")
            assert (f["train.batch_size"], f["optim.lr"], f["optim.schedule"], f["optim.step_epochs"],
                    f["optim.step_gamma"]) == (128, 2e-4, "step", 15, 0.1)
            assert plan.condition(f"{arch}_{loss}").config.epochs == 30
        smoothap = flat(plan, f"{arch}_smoothap")
        assert plan.condition(f"{arch}_smoothap").config.epochs == 150
        assert (smoothap["optim.step_epochs"], smoothap["loss.tau"]) == (75, 0.01)
        assert smoothap["train.sampler"] == "images"
        assert flat(plan, f"{arch}_ntxent")["loss.tau"] == 0.1  # NT-Xent tau 0.1
        assert flat(plan, f"{arch}_triplet_sh")["loss.margin"] == 0.2
    vsepp = flat(plan, "vsepp_triplet_sh")
    assert (vsepp["image.encoder"], vsepp["image.frozen"], vsepp["text.bidirectional"]) == (
        "resnet50", True, False)
    assert flat(plan, "vsrn_triplet_sh")["model.embed_dim"] == 2048  # VSRN: 2048
    assert plan.max_epochs == 150
    assert not any(c.domains for c in plan.conditions)  # the original works' values


def test_loss_search_paper_recipe(files, tmp_path):
    plan = paper_plan("loss_search", files, tmp_path)
    domain = plan.condition("searched").domains["loss.name"]
    assert (domain.kind, set(domain.values)) == ("grid", {"triplet", "triplet_all", "infonce"})
    f = flat(plan, "searched")
    assert (f["loss.margin"], f["loss.tau"], f["image.encoder"]) == (0.2, 0.1, "resnet50")


def test_pooling_objective_and_text_encoder_paper_recipes(files, tmp_path):
    plan = paper_plan("pooling_objective", files, tmp_path)
    # Section 4.1: d = 1024, Adam, batch 128, 25 epochs, lr 5e-4 decayed x0.1 every 15 epochs;
    # Appendix B: margin 0.2, tau 0.05, pre-trained modules at 10 % of the lr.
    for name in ("max_triplet_sh", "adpool_adopt", "gpo_adopt"):
        f = flat(plan, name)
        assert (f["model.embed_dim"], f["optim.name"], f["train.batch_size"], f["optim.lr"],
                f["optim.schedule"], f["optim.step_epochs"], f["optim.step_gamma"]) == (
            1024, "adam", 128, 5e-4, "step", 15, 0.1)
        assert plan.condition(name).config.epochs == 25
        assert f["loss.margin"] == 0.2
    assert flat(plan, "adpool_adopt")["loss.tau"] == 0.05
    # VSE-infinity's code: the hard triplet loss after vse_mean_warmup_epochs = 1 on all negatives
    assert flat(plan, "max_triplet_sh")["loss.warmup_epochs"] == 1
    assert "loss.warmup_epochs" not in used_keys(plan.condition("adpool_adopt").config)
    text = paper_plan("text_encoder", files, tmp_path)
    bert = flat(text, "bert")
    assert bert["text.bert_lr_factor"] == 0.1 and bert["text.bert_path"] == files["text.bert_path"]
    assert (bert["loss.name"], bert["text.pooling"]) == ("adopt", "adpool")
    assert set(text.condition("searched").domains["text.encoder"].values) == {"gru_tokens", "bert"}


def test_triplet_warmup_paper_recipe(files, tmp_path):
    """The towers as their studies' paper recipes train them, each with and without the warm-up:
    VSE++ and VSRN as the metric-learning paper (Section 4: Adam 2e-4, 30 epochs, margin 0.2 of
    VSE++), max pooling as VSE+2AD (Section 4.1: 25 epochs at 5e-4)."""
    plan = paper_plan("triplet_warmup", files, tmp_path)
    for arch, (epochs, lr) in {"vsepp": (30, 2e-4), "vsrn": (30, 2e-4), "max": (25, 5e-4)}.items():
        for suffix, warmup in (("", 0), ("_warmup", 1)):
            f = flat(plan, arch + suffix)
            assert (f["loss.name"], f["loss.margin"], f["optim.lr"]) == ("triplet", 0.2, lr)
            assert plan.condition(arch + suffix).config.epochs == epochs
            assert f["loss.warmup_epochs"] == warmup
    assert flat(plan, "vsrn")["image.encoder"] == "vsrn" and flat(plan, "max")["image.pooling"] == "max"


def test_grounding_negatives_paper_recipe(files, tmp_path):
    plan = paper_plan("grounding_negatives", files, tmp_path)
    f = flat(plan, "lang_context")
    # Section 3: Adam, lr 1e-5, batches of 50; Sections 2.4/2.5: 30 masked-LM candidates, 25
    # kept, at most 30 boxes; info-ground: 10 epochs, d = 384, 6 words per caption.
    expected = {"optim.name": "adam", "optim.lr": 1e-5, "train.batch_size": 50,
                "grounding.mlm_candidates": 30, "grounding.num_negatives": 25,
                "grounding.max_regions": 30, "grounding.key_dim": 384, "grounding.max_words": 6,
                "grounding.img_weight": 1.0, "grounding.lang_weight": 1.0}
    assert {k: f[k] for k in expected} == expected
    assert plan.condition("lang_context").config.epochs == 10
    assert plan.analyses == ()  # the embedded benchmark's analyses need its scenes


def test_a_paper_recipe_without_its_files_is_one_line(tmp_path, capsys):
    code = main(["ltd_bound", "--recipe", "paper", "--workspace", str(tmp_path / "ws")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert "data.karpathy_json" in err and "--set data.karpathy_json=PATH" in err
    assert not (tmp_path / "ws" / "mlflow.db").exists()


def test_smoke_flag_and_recipe_are_the_same_and_clash_with_another(tmp_path):
    study = get_study("ltd_bound")
    a = StudyPlan.build(study, Options(smoke=True, workspace=str(tmp_path)))
    b = StudyPlan.build(study, Options(recipe="smoke", workspace=str(tmp_path)))
    assert a.key == b.key == "ltd_bound-smoke"
    assert [c.config for c in a.conditions] == [c.config for c in b.conditions]
    with pytest.raises(UserError, match="--smoke is --recipe smoke"):
        StudyPlan.build(study, Options(smoke=True, recipe="paper", workspace=str(tmp_path)))


def test_the_plan_of_the_paper_recipe_names_its_trials_and_files(files, tmp_path, capsys):
    args = ["ltd_bound", "--recipe", "paper", "--plan", "--workspace", str(tmp_path / "ws"),
            "--set", *(f"{k}={v}" for k, v in files.items()
                       if k in ("data.karpathy_json", "image.weights_path", "text.glove"))]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "recipe paper (LTD paper" in out
    assert "lagrangian: 6 search trial(s) x 60.0 expected epochs + 3 confirmation run(s) x 60" in out
    assert "searched objective.eta: grid of 0.05, 0.1, 0.15, 0.2, 0.25, 0.3" in out
    assert f"needs image.weights_path={files['image.weights_path']}: present" in out
    assert not (tmp_path / "ws" / "mlflow.db").exists()  # --plan runs nothing


def test_the_plan_counts_steps_on_the_papers_datasets_when_the_files_are_absent(tmp_path, capsys):
    """COCO's Karpathy train with restval (566,435 captions) and Flickr30K's (145,000) at the
    recipe's batch of 128; Flickr30K Entities' train (148,915) for grounding at 50."""
    assert main(["ltd_bound", "--recipe", "paper", "--plan", "--workspace", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "4,425 steps/epoch on COCO (Karpathy train + restval) (566,435 training captions)" in out
    assert "1,132 steps/epoch on Flickr30K (Karpathy train) (145,000 training captions)" in out
    assert "? steps/epoch" not in out
    assert main(["grounding_negatives", "--recipe", "paper", "--plan", "--workspace",
                 str(tmp_path)]) == 0
    assert "2,978 steps/epoch on Flickr30K Entities (train) (148,915 training captions)" in (
        capsys.readouterr().out)


@pytest.mark.slow  # end-to-end: make test-all and CI run it
def test_plan_calibrate_times_steps_and_estimates(workspace, capsys):
    """A tiny study's plan with two timed steps per phase gives a positive estimate."""
    args = ["ltd_bound", "--smoke", "--plan", "--calibrate", "2", "--workspace",
            str(workspace.root), "--set", "train.device=cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.count("calibrated:") == 3  # one line per condition
    assert "device-hours" in out and "min of wall time at" in out


def test_asha_expected_epochs_by_hand():
    # 4 epochs, grace 1, r 2: rungs 1, 2; every trial trains 1, half train 1 more, a quarter 2 more
    assert asha_expected_epochs(4, 1, 2) == pytest.approx(1 + 0.5 + 0.5)
    # 9 epochs, grace 1, r 3: rungs 1, 3; 1 + (3 - 1) / 3 + (9 - 3) / 9
    assert asha_expected_epochs(9, 1, 3) == pytest.approx(1 + 2 / 3 + 6 / 9)
    assert asha_expected_epochs(1, 1, 2) == 1.0


def test_plan_costs_count_grid_points_and_confirmations(files, tmp_path):
    plan = paper_plan("ltd_bound", files, tmp_path)
    costs = {c.name: c for c in plan_costs(plan)}
    assert costs["lagrangian"].search_trials == 6 and costs["contrastive"].search_trials == 0
    assert costs["lagrangian"].trial_epochs == 6 * 60 + 3 * 60


def test_grid_domain_parses_and_the_grid_sampler_visits_each_point_once():
    domain = parse_domain("objective.eta", {"grid": LTD_ETA_GRID})
    assert domain == Domain("objective.eta", "grid", tuple(LTD_ETA_GRID))
    assert grid_size({"objective.eta": domain}) == 6
    assert grid_size({"objective.eta": domain, "loss.tau": parse_domain(
        "loss.tau", {"uniform": [0.01, 0.1]})}) is None
    with pytest.raises(Exception, match="each value once"):
        parse_domain("objective.eta", {"grid": [0.1, 0.1]})
    space = ConditionalSpace({"objective.name": "lagrangian", "decoder.name": "ltd"}, (domain,))
    study = optuna.create_study(sampler=GridOnceSampler(grid_points({"objective.eta": domain}),
                                                        seed=0))
    seen = []
    for _ in range(3):  # two trials at a time, told after both were asked (as Tune does)
        trials = [study.ask(), study.ask()]
        for trial in trials:
            space(trial)
            seen.append(trial.params["objective.eta"])
        for trial in trials:
            study.tell(trial, 0.0)
    assert sorted(seen) == LTD_ETA_GRID


def test_karpathy_json_sizes_give_the_steps_of_an_epoch(files, tmp_path):
    plan = paper_plan("ltd_bound", {**files, "train.batch_size": "8"}, tmp_path)
    cost = plan_costs(plan)[0]
    assert (cost.train_captions, cost.steps_per_epoch) == (150, 18)  # 150 // 8
