"""fit(): the schedule, SWA placement, a short run end to end, exact resume, failure on NaN."""

import math
import shutil

import pytest
import torch

from icr.config import from_flat
from icr.errors import ConfigError, TrainingError
from icr.train import EpochReport, find_checkpoint, fit, load_trained
from icr.train.checkpoint import load_checkpoint, save_checkpoint
from icr.train.recipe import (
    build_optimizer,
    load_optimizer_state,
    lr_factor,
    schedule_factor,
    swa_snapshot_steps,
)

TINY = {
    "data.preset": "tiny",
    "model.embed_dim": 32,
    "text.hidden_dim": 32,
    "decoder.hidden_dim": 32,
    "decoder.word_dim": 16,
    "train.batch_size": 16,
    "train.warmup_epochs": 1,
    "train.finetune_epochs": 1,
    "train.swa_bn_batches": 2,
    "train.trajectory_every": 2,
    "eval.batch_size": 64,
}


def tiny(**overrides):
    return from_flat({**TINY, **{k.replace("__", "."): v for k, v in overrides.items()}})


def test_lr_schedule_is_a_cosine_per_phase():
    f = lambda s: lr_factor(s, 10, 2, 3, 0.1)  # noqa: E731
    assert f(0) == 1.0
    assert f(10) == pytest.approx(0.5)  # half-way through the 20 warm-up steps
    assert f(20) == pytest.approx(0.1)  # the fine-tune phase restarts at lr x 0.1 ...
    assert f(35) == pytest.approx(0.05)  # ... and decays along its own cosine
    assert f(49) < f(48) < 0.1
    fine = [f(s) for s in range(20, 50)]
    assert all(a >= b for a, b in zip(fine, fine[1:], strict=False))  # never climbs back


def test_lr_schedule_without_warmup():
    assert lr_factor(0, 10, 0, 2, 0.1) == pytest.approx(0.1)


def test_step_schedule_decays_every_step_epochs_over_the_whole_run():
    """VSE+2AD Sec. 4.1: x0.1 every 15 epochs; the fine-tune phase's factor multiplies on top."""
    f = lambda s, warm=0, ft=1.0: schedule_factor(  # noqa: E731
        s, 10, warm, 25 - warm, ft, schedule="step", step_epochs=15, gamma=0.1)
    assert [f(0), f(149), f(150), f(249)] == pytest.approx([1.0, 1.0, 0.1, 0.1])
    assert f(300) == pytest.approx(0.01)  # epoch 30: two decays
    assert [f(9, warm=1, ft=0.5), f(10, warm=1, ft=0.5)] == pytest.approx([1.0, 0.5])
    assert schedule_factor(7, 10, 2, 3, 0.1) == lr_factor(7, 10, 2, 3, 0.1)  # cosine: the default
    with pytest.raises(ConfigError, match="optim.schedule='linear'"):
        schedule_factor(0, 10, 0, 1, 1.0, schedule="linear")


@pytest.mark.parametrize("name", ["adam", "adamw", "adamp"])
def test_optimisers_step_and_their_state_loads_without_unpickling(name, tmp_path):
    layer = torch.nn.Linear(4, 3)
    opt = build_optimizer(name, layer.parameters(), lr=0.1, weight_decay=0.0)
    before = layer.weight.detach().clone()
    layer(torch.ones(2, 4)).pow(2).sum().backward()
    opt.step()
    assert not torch.equal(before, layer.weight)
    torch.save(opt.state_dict(), tmp_path / "opt.pt")
    opt.load_state_dict(torch.load(tmp_path / "opt.pt", weights_only=True))
    with pytest.raises(ConfigError, match="optim.name='sgd'"):
        build_optimizer("sgd", layer.parameters(), lr=0.1, weight_decay=0.0)


@pytest.mark.parametrize("capturable", [False, True])
def test_adamp_updates_as_its_authors_package_does_without_host_syncs(capturable):
    """icr.train.adamp chooses AdamP's projection on the device; the package (adamp 0.3.0)
    decides on the host. Equal parameters over steps in which each branch is taken: the
    channel-wise projection (a gradient orthogonal to every output channel), the layer-wise one
    (one channel aligned, the layer as a whole nearly orthogonal) and none. ``capturable``: the
    step counts on the device and the learning rate a tensor, as a CUDA graph replays them."""
    import adamp

    from icr.train.adamp import AdamP

    def params():
        g = torch.Generator().manual_seed(1)
        return [torch.nn.Parameter(torch.randn(shape, generator=g))
                for shape in [(6, 5), (4, 3, 2), (7,), (64, 8)]]

    ours, theirs = params(), params()
    lr = torch.tensor(0.01) if capturable else 0.01
    opts = [AdamP(ours, lr=lr, weight_decay=0.1, capturable=capturable),
            adamp.AdamP(theirs, lr=0.01, weight_decay=0.1)]
    g = torch.Generator().manual_seed(2)
    for step in range(12):
        for mine, other in zip(ours, theirs, strict=True):
            grad = torch.randn(mine.shape, generator=g)
            if mine.dim() > 1 and step % 3 != 2:
                w = mine.detach().reshape(mine.shape[0], -1)
                r = grad.reshape(mine.shape[0], -1)
                r = r - w * (r * w).sum(1, keepdim=True) / (w * w).sum(1, keepdim=True)
                if step % 3 == 1:  # one channel along its weights: the layer-wise branch
                    r[0] = w[0] * 1e-3
                grad = r.reshape(mine.shape)
            mine.grad, other.grad = grad.clone(), grad.clone()
        for opt in opts:
            opt.step()
    for mine, other in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine.detach(), other.detach(), atol=1e-6, rtol=1e-6)
    assert opts[0].state_dict()["state"][0].keys() == opts[1].state_dict()["state"][0].keys()
    assert isinstance(opts[0].state[ours[0]]["step"], torch.Tensor) == capturable


def test_a_checkpoint_loads_into_the_optimiser_this_run_built():
    """A run resumed on another device loads a state written by an eager optimiser into a
    capturable one (and the other way): each group keeps its own capture settings, a capturable
    group's step counts become tensors (a number would be frozen into a CUDA graph), and its
    learning-rate tensor stays the one a captured step reads, with the saved value."""
    cpu = torch.device("cpu")
    param = torch.nn.Parameter(torch.randn(4, 3))
    eager = build_optimizer("adamp", [param], 0.1, 0.0, cpu, capturable=False)
    for _ in range(2):
        param.grad = torch.randn(4, 3)
        eager.step()
    eager.param_groups[0]["lr"] = 0.05  # what the schedule had reached
    captured = build_optimizer("adamp", [param], 0.1, 0.0, cpu, capturable=True)
    rate = captured.param_groups[0]["lr"]
    load_optimizer_state(captured, eager.state_dict())
    group, step = captured.param_groups[0], captured.state[param]["step"]
    assert group["capturable"] is True and group["lr"] is rate
    assert float(rate) == pytest.approx(0.05)  # float32
    assert isinstance(step, torch.Tensor) and step.dtype == torch.float32 and float(step) == 2.0
    back = build_optimizer("adam", [param], 0.1, 0.0, cpu, capturable=False)
    saved = back.state_dict()
    saved["param_groups"][0]["capturable"] = True  # as a CUDA run wrote it
    load_optimizer_state(back, saved)
    assert back.param_groups[0]["capturable"] is False


def test_swa_snapshots_span_the_last_tenth():
    assert swa_snapshot_steps(100, 5, 0.1) == {90, 92, 94, 97, 99}
    assert swa_snapshot_steps(3, 5, 0.1) <= {0, 1, 2}


def test_two_epoch_fit_reports_every_epoch(workspace, tmp_path):
    reports: list[tuple[EpochReport, list[str]]] = []
    result = fit(tiny(), lambda r: reports.append((r, sorted(p.name for p in r.checkpoint.iterdir()))),
                 workspace=workspace, run_dir=tmp_path)
    assert [r.epoch for r, _ in reports] == [1, 2]
    assert [r.final for r, _ in reports] == [False, True]
    last, files = reports[-1][0].metrics, reports[-1][1]
    assert {"state.pt", "best_model.pt"} <= set(files)
    for key in ("val_rsum", "val_i2t_R_at_1", "val_t2i_R_at_10", "val_i2t_rprec",
                "val_t2i_nDCG_at_25", "train_loss", "train_L_con", "lr", "test_rsum"):
        assert key in last and math.isfinite(last[key]), key
    assert "test_rsum" not in reports[0][0].metrics  # test is evaluated once, at the end
    assert result.test is not None and result.test["rsum"] == last["test_rsum"]
    assert 0 <= last["val_rsum"] <= 600


@pytest.mark.parametrize("decoder", ["ltd", "itd"])
def test_lagrangian_fit_reports_lambda_and_trajectory(workspace, tmp_path, decoder):
    config = tiny(decoder__name=decoder, objective__name="lagrangian", objective__eta=0.05,
                  eval__test=False)
    reports: list[EpochReport] = []
    result = fit(config, reports.append, workspace=workspace, run_dir=tmp_path)
    metrics = reports[-1].metrics
    assert 0.0 <= metrics["lambda"] <= 100.0 and "train_L_rec" in metrics
    assert "train_lambda" not in metrics  # lambda is the multiplier's state, not a loss term
    rows = [row for r in reports for row in r.trajectory]
    assert len(rows) >= 2 and rows == result.trajectory
    assert all(set(row) == {"step", "epoch", "loss", "L_con", "L_rec", "lambda"} for row in rows)
    steps = [row["step"] for row in rows]
    assert steps == sorted(set(steps))  # each step reported once, in order


def test_contrastive_trajectory_has_no_placeholder_columns(workspace, tmp_path):
    reports: list[EpochReport] = []
    fit(tiny(eval__test=False, train__finetune_epochs=0), reports.append, workspace=workspace,
        run_dir=tmp_path)
    rows = [row for r in reports for row in r.trajectory]
    assert rows and all(set(row) == {"step", "epoch", "loss", "L_con"} for row in rows)


@pytest.mark.slow  # end-to-end: make test-all and CI run it
def test_resume_gives_the_metrics_of_an_uninterrupted_run(workspace, tmp_path):
    config = tiny(decoder__name="ltd", objective__name="lagrangian", objective__eta=0.1)
    saved = tmp_path / "after-epoch-1"

    def keep_first(report):
        if report.epoch == 1:
            shutil.copytree(report.checkpoint, saved)

    full = fit(config, keep_first, workspace=workspace, run_dir=tmp_path / "a")
    resumed = fit(config, resume_from=saved, workspace=workspace, run_dir=tmp_path / "b")
    a, b = full.history[-1], resumed.history[-1]
    for key in a:
        if key not in ("epoch_time_s", "epoch_cpu_s"):
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-6), key
    assert full.test == pytest.approx(resumed.test)
    assert [r["step"] for r in resumed.trajectory] == [r["step"] for r in full.trajectory]


def test_a_save_interrupted_between_its_renames_leaves_a_checkpoint(workspace, tmp_path):
    config = tiny(train__finetune_epochs=0, eval__test=False)
    checkpoint = fit(config, workspace=workspace, run_dir=tmp_path).checkpoint_dir
    # The crash: the old checkpoint moved aside, the new one not yet moved in.
    checkpoint.rename(tmp_path / "checkpoint.old")
    (tmp_path / "checkpoint.tmp").mkdir()
    assert find_checkpoint(checkpoint) == tmp_path / "checkpoint.old"
    task = load_trained(config, checkpoint, workspace=workspace)  # falls back to it
    assert task.evaluate("val")["rsum"] >= 0
    found, state, best = load_checkpoint(checkpoint)
    assert state["loop"]["epoch"] == 1 and best is not None
    save_checkpoint(checkpoint, state, best)
    assert find_checkpoint(checkpoint) == checkpoint
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    assert find_checkpoint(tmp_path / "nothing-here") is None


def test_resume_with_another_config_is_refused(workspace, tmp_path):
    saved = tmp_path / "ckpt"
    fit(tiny(train__finetune_epochs=0, eval__test=False),
        lambda r: shutil.copytree(r.checkpoint, saved), workspace=workspace, run_dir=tmp_path / "a")
    with pytest.raises(ConfigError, match="another config"):
        fit(tiny(loss__tau=0.1), resume_from=saved, workspace=workspace, run_dir=tmp_path / "b")


def test_resume_from_another_code_version_is_refused_in_one_line(workspace, tmp_path):
    # The same config, other module names: what a checkpoint written before a refactor holds.
    config = tiny(train__finetune_epochs=0, eval__test=False)
    saved = tmp_path / "ckpt"
    fit(config, lambda r: shutil.copytree(r.checkpoint, saved), workspace=workspace,
        run_dir=tmp_path / "a")
    found, state, best = load_checkpoint(saved)
    state["task"]["net"]["encoder.image_encoder.norm.weight"] = torch.ones(3)
    save_checkpoint(saved, state, best)
    with pytest.raises(ConfigError, match=r"does not fit this version of the model "
                                          r"\(keys encoder\.image_encoder\.norm\.weight\)"):
        fit(config, resume_from=saved, workspace=workspace, run_dir=tmp_path / "b")


def test_non_finite_loss_stops_the_trial(workspace, tmp_path, monkeypatch):
    import icr.train.retrieval

    real = icr.train.retrieval.loss_from_config
    monkeypatch.setattr(icr.train.retrieval, "loss_from_config",
                        lambda section: lambda sims, ids: real(section)(sims, ids) * torch.nan)
    with pytest.raises(TrainingError, match="non-finite loss at epoch 1, step 1"):
        fit(tiny(), workspace=workspace, run_dir=tmp_path)


def test_objective_needing_a_decoder_is_a_config_error(workspace, tmp_path):
    with pytest.raises(ConfigError, match="decoder.name=ltd"):
        fit(tiny(objective__name="dual"), workspace=workspace, run_dir=tmp_path)


def test_checkpoints_load_without_unpickling_code(workspace, tmp_path):
    """A checkpoint holds tensors, numbers and containers only: weights_only=True reads it."""
    fit(tiny(train__finetune_epochs=0, eval__test=False, decoder__name="ltd",
             objective__name="lagrangian"), workspace=workspace, run_dir=tmp_path)
    state = torch.load(tmp_path / "checkpoint" / "state.pt", weights_only=True)
    assert state["loop"]["epoch"] == 1 and "multiplier" in state["task"]["objective"]


def test_a_triplet_run_trains_its_warmup_epochs_on_all_negatives(workspace):
    """The task's L_con per epoch: the warm-up form for loss.warmup_epochs epochs, then the loss."""
    from icr.losses import triplet_all_loss, triplet_loss
    from icr.train.retrieval import retrieval

    task = retrieval(tiny(loss__name="triplet", loss__margin=0.3, loss__warmup_epochs=1),
                     workspace, torch.device("cpu"))
    sims = torch.randn(5, 5, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(task.loss_for_epoch(0)(sims), triplet_all_loss(sims, margin=0.3))
    torch.testing.assert_close(task.loss_for_epoch(1)(sims), triplet_loss(sims, margin=0.3))


def test_an_error_inside_a_step_names_the_step_and_the_keys_of_its_loss_and_objective(workspace):
    """A value past the up-front checks (1e39 is refused by the config now; set here on the
    dataclass directly) made every trial fail with torch's bare message at the multiplier's
    clamp; the error names the epoch, the step and the loss's and objective's settings."""
    import dataclasses
    import traceback

    from icr.train.retrieval import retrieval

    config = tiny(decoder__name="itd", objective__name="lagrangian", train__finetune_epochs=0)
    objective = dataclasses.replace(config.objective, lambda_init=1e39, lambda_max=1e39)
    task = retrieval(dataclasses.replace(config, objective=objective), workspace,
                     torch.device("cpu"))
    expected = (r"^the training step failed at epoch 1, step 1 \(RuntimeError: value cannot be "
                r"converted to type float without overflow\) with loss.name=infonce, "
                r"loss.tau=0.05, objective.name=lagrangian, objective.eta=0.15, "
                r"objective.lambda_init=1e\+39, objective.lambda_max=1e\+39, "
                r"objective.lambda_lr=0.005, .*, optim.name=adamw, optim.lr=0.0002, .*; check "
                r"those values$")
    with pytest.raises(TrainingError, match=expected) as caught:
        task.train_epoch(0)
    assert caught.value.__cause__ is None  # the innermost error: what a study records
    frames = [frame.name for frame in traceback.extract_tb(caught.value.__traceback__)]
    # the step's frames are kept, down to the multiplier's projection that raised
    assert frames.index("train_epoch") < frames.index("train_step") and frames[-1] == "step"


def test_a_config_error_inside_a_step_is_not_rewrapped(workspace, monkeypatch):
    from icr.train.retrieval import retrieval

    task = retrieval(tiny(train__finetune_epochs=0), workspace, torch.device("cpu"))

    def refuse(*args):
        raise ConfigError("objective.name=dual needs a decoder")

    monkeypatch.setattr(task, "train_step", refuse)
    with pytest.raises(ConfigError, match="^objective.name=dual needs a decoder$"):
        task.train_epoch(0)
