"""Training steps a CUDA graph can record: GraphedStep's bookkeeping, every registered loss and
every architecture's static-shape forward pass and loss (no graph break under torch._dynamo), a
handful of shapes an epoch, and the same loss and gradients as the eager step at exact shapes."""

from __future__ import annotations

import importlib
import logging
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from icr.config import LossConfig, from_flat
from icr.losses import LOSSES, loss_from_config
from icr.train.graphs import GraphedStep
from icr.train.retrieval import RetrievalTask
from icr.train.seam import StepModes
from icr.train.tasks import build_task

CPU = torch.device("cpu")

# -- GraphedStep, with a stand-in for torch.cuda.CUDAGraph ----------------------------------------


class Recording:
    """A CUDA graph on the CPU: the step recorded into it (:func:`recorded`) is re-run on the
    graph's input tensors at each replay, its results written into the graph's output tensors."""

    active: Recording | None = None

    def __init__(self) -> None:
        self.replays, self.step, self.inputs, self.outputs = 0, None, None, None

    def replay(self) -> None:
        self.replays += 1
        for name, value in self.step(self.inputs).items():
            self.outputs[name].copy_(value)

    def pool(self) -> str:
        return "pool"


@contextmanager
def record(graph: Recording, pool: object = None, capture_error_mode: str = "global"):
    # the prefetch thread pins and copies while a step is captured: only the capturing thread
    # may be held to the capture's rules (a global capture failed with it on an H200)
    assert capture_error_mode == "thread_local"
    Recording.active = graph
    try:
        yield
    finally:
        Recording.active = None


def recorded(step):
    """``step``, which registers itself (and its tensors) with the graph being recorded."""

    def run(inputs):
        out = step(inputs)
        if Recording.active is not None:
            graph = Recording.active
            graph.step, graph.inputs, graph.outputs = step, inputs, out
        return out

    return run


def _double(inputs):
    return {"y": inputs["x"] * 2}


def _runner(step=_double, **kwargs) -> tuple[GraphedStep, list[Recording]]:
    graphs: list[Recording] = []

    def new_graph() -> Recording:
        graphs.append(Recording())
        return graphs[-1]

    runner = GraphedStep(recorded(step), enabled=True, new_graph=new_graph, capture=record,
                         **kwargs)
    return runner, graphs


def test_a_shape_is_captured_after_its_warm_up_and_replayed_on_new_values():
    runner, graphs = _runner(warmup=2)
    for value in range(6):
        out = runner("key", {"x": torch.full((3,), float(value))})
        assert torch.equal(out["y"], torch.full((3,), 2.0 * value))
    assert (runner.eager_calls, runner.captured, len(graphs)) == (2, 1, 1)
    assert graphs[0].replays == 4  # the capture records; the step of its batch is a replay


def test_each_key_and_shape_gets_its_own_graph_and_outputs_are_copies():
    runner, graphs = _runner(warmup=0)
    first = runner("a", {"x": torch.ones(3)})
    runner("a", {"x": torch.full((3,), 5.0)})
    assert torch.equal(first["y"], torch.full((3,), 2.0))  # not overwritten by the next replay
    runner("a", {"x": torch.ones(4)})
    runner("b", {"x": torch.ones(3)})
    assert runner.captured == 3 and [g.replays for g in graphs] == [2, 1, 1]


def test_graphs_of_one_input_shape_read_one_input_tensor():
    """Graphs never run at once: two keys at one shape share their input tensor (a batch of
    images is held once, not once per graph), and each replay still sees its own values."""
    runner, graphs = _runner(warmup=0)
    runner("a", {"x": torch.ones(3)})
    runner("b", {"x": torch.ones(3)})
    runner("b", {"x": torch.ones(4)})
    assert graphs[0].inputs["x"] is graphs[1].inputs["x"]
    assert graphs[2].inputs["x"] is not graphs[0].inputs["x"]
    assert torch.equal(runner("a", {"x": torch.full((3,), 4.0)})["y"], torch.full((3,), 8.0))
    assert torch.equal(runner("b", {"x": torch.full((3,), 5.0)})["y"], torch.full((3,), 10.0))


def test_shapes_beyond_max_graphs_run_eagerly():
    runner, graphs = _runner(warmup=0, max_graphs=1)
    runner("a", {"x": torch.ones(3)})
    out = runner("a", {"x": torch.ones(4)})
    assert torch.equal(out["y"], torch.full((4,), 2.0))
    assert (runner.captured, runner.eager_calls) == (1, 1)


def test_shapes_warming_up_together_capture_no_more_than_max_graphs():
    runner, graphs = _runner(warmup=1, max_graphs=1)
    runner("a", {"x": torch.ones(3)})  # both shapes warm up before either is captured
    runner("a", {"x": torch.ones(4)})
    runner("a", {"x": torch.ones(3)})  # captured
    out = runner("a", {"x": torch.ones(4)})  # the limit is reached: eager
    assert torch.equal(out["y"], torch.full((4,), 2.0))
    assert (runner.captured, len(graphs), runner.eager_calls) == (1, 1, 3)


def test_after_a_reset_a_shape_warms_up_and_is_captured_again():
    """A checkpoint loaded into the model's, optimiser's or objective's state replaces the
    tensors a graph reads: the task resets its graphs."""
    runner, graphs = _runner(warmup=1)
    for _ in range(2):
        runner("a", {"x": torch.ones(3)})
    runner.reset()
    for _ in range(2):
        runner("a", {"x": torch.ones(3)})
    assert (runner.captured, len(graphs), runner.eager_calls) == (1, 2, 2)


def test_a_step_that_cannot_be_captured_runs_eagerly_and_says_why(caplog):
    def fussy(inputs):
        if Recording.active is not None:
            raise RuntimeError("operation not permitted when stream is capturing")
        return _double(inputs)

    discarded = []
    runner, _ = _runner(fussy, warmup=1, on_failed_capture=lambda: discarded.append(1))
    with caplog.at_level(logging.WARNING, logger="icr.train.graphs"):
        outs = [runner("a", {"x": torch.full((2,), float(v))})["y"] for v in range(3)]
    assert [o.tolist() for o in outs] == [[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]]
    assert not runner.enabled and runner.captured == 0 and discarded == [1]
    assert "cannot be captured as a CUDA graph (operation not permitted" in caplog.text


def test_disabled_steps_never_make_a_graph():
    runner, graphs = _runner(warmup=0)
    runner.enabled = False
    runner("a", {"x": torch.ones(2)})
    assert graphs == [] and runner.eager_calls == 1


# -- every architecture's static-shape step -------------------------------------------------------

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY = {"data.preset": "tiny", "train.batch_size": 8, "eval.batch_size": 16,
        "model.embed_dim": 16, "text.hidden_dim": 16, "image.hidden_dim": 16,
        "image.output_dim": 16, "image.gcn_layers": 1, "decoder.hidden_dim": 16,
        "decoder.word_dim": 8, "image.transformer_dim": 16, "image.transformer_layers": 1,
        "model.shared_dim": 16, "model.shared_layers": 1, "model.transformer_heads": 2,
        "model.transformer_ff_dim": 32, "text.bert_layers": 1, "train.device": "cpu",
        "train.swa": False}


def _gpu_trial():
    """benchmarks/gpu_trial.py: its architectures are what a GPU trial trains."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module("gpu_trial")


GPU_TRIAL = _gpu_trial()


def _task(arch: str, workspace, static: bool):
    config = from_flat({**GPU_TRIAL.arch_config(arch), **TINY})
    built = build_task(config, workspace, CPU)  # prepares the data and its caches
    torch.manual_seed(0)  # the same weights on both paths; static: as a CUDA trial builds it
    task = RetrievalTask(config, built.prepared, CPU, built.cache, static_shapes=static)
    task.encoder.set_backbone_trainable(True)
    if config.image.frozen:
        task.encoder.image_encoder.set_backbone_trainable(False)
    task.net.train()
    return task


@pytest.mark.parametrize("name", LOSSES.names())
def test_every_registered_loss_traces_without_a_graph_break(name):
    """Any loss a study names may run in a captured step: none reads the batch on the host,
    even with two captions of one image in the batch (SmoothAP folds them at fixed shapes)."""
    import torch._dynamo

    loss = loss_from_config(LossConfig(name=name))
    sims = torch.randn(8, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
    image_ids = torch.tensor([0, 1, 2, 2, 3, 4, 5, 6])
    torch.compiler.reset()
    explanation = torch._dynamo.explain(loss)(sims, image_ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.parametrize("arch", GPU_TRIAL.ARCHS)
def test_the_static_step_traces_without_a_graph_break(arch, workspace):
    """A graph break is where dynamo meets what a CUDA graph cannot record: a host read of a
    device value, a shape or branch that depends on one, a packed sequence."""
    import torch._dynamo

    task = _task(arch, workspace, static=True)
    inputs = task.step_inputs(next(task.batches(0)))
    torch.compiler.reset()
    with torch._dynamo.config.patch(allow_rnn=True):
        explanation = torch._dynamo.explain(task.loss_of)(inputs)
    reasons = [str(b.reason).splitlines()[0] for b in explanation.break_reasons]
    assert explanation.graph_break_count == 0, reasons


@pytest.mark.parametrize("arch", GPU_TRIAL.ARCHS)
def test_an_epoch_of_static_batches_has_a_handful_of_shapes(arch, workspace):
    task = _task(arch, workspace, static=True)
    shapes = {tuple((k, tuple(v.shape)) for k, v in task.step_inputs(b).items())
              for b in task.batches(0)}
    exact = {tuple(b["tokens"].shape) for b in _task(arch, workspace, static=False).batches(0)}
    assert len(shapes) <= 5 and len(shapes) < len(exact), (shapes, exact)
    assert all(v.device == CPU for b in task.batches(0) for v in task.step_inputs(b).values())


@pytest.mark.parametrize("arch", GPU_TRIAL.ARCHS)
def test_the_static_step_has_the_eager_step_s_loss_and_gradients(arch, workspace):
    """Padding to a static shape changes no value: the loss and every gradient of a step on the
    same batch are those of the step at the batch's exact shapes (the packed path)."""
    results = []
    for static in (False, True):
        task = _task(arch, workspace, static)
        batch = task.step_inputs(next(task.batches(0)))
        task.net.eval()  # no dropout: the two runs draw different masks
        task._loss_fn = task.loss_fn
        out, _, _ = task.loss_of(batch)
        task.net.zero_grad()
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in task.net.named_parameters() if p.grad is not None}
        results.append((out.loss.detach(), grads))
    (loss, grads), (static_loss, static_grads) = results
    torch.testing.assert_close(static_loss, loss, atol=1e-5, rtol=1e-4)
    assert static_grads.keys() == grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(static_grads[name], grad, atol=1e-5, rtol=1e-3, msg=name)


def test_a_step_s_graph_is_kept_under_what_the_step_computes(workspace):
    """Freezing the backbone (the warm-up epochs), a module's mode or the loss's form changes
    the computation a graph recorded: each is part of the key; the same state, the same key."""
    task = _task("tern", workspace, static=True)
    trained = task._step_key()
    task.encoder.set_backbone_trainable(False)  # BERT frozen: no gradients, dropout off
    frozen = task._step_key()
    task.encoder.set_backbone_trainable(True)
    assert frozen != trained and task._step_key() == trained
    task.net.eval()
    assert task._step_key() != trained
    task.net.train()
    task._loss_fn = task.warmup_loss_fn = object()  # a loss's warm-up form
    assert task._step_key() != trained


# -- what a run says of its steps (StepModes) ----------------------------------------------------


def test_the_modes_count_each_epoch_s_replays_and_eager_steps_and_name_the_shapes():
    runner, _ = _runner(warmup=2)
    for _ in range(4):
        runner("a", {"x": torch.ones(3), "y": torch.ones(2, 5)})
    runner("a", {"x": torch.ones(3), "y": torch.ones(2, 7)})  # a new shape: an eager warm-up
    modes = runner.take_modes()
    assert (modes.mode, modes.captured, modes.eager) == ("captured", 2, 3)
    assert modes.shapes == ("x 3, y 2x5",) and not modes.fell_back and modes.reason == ""
    runner("a", {"x": torch.ones(3), "y": torch.ones(2, 7)})
    runner("a", {"x": torch.ones(3), "y": torch.ones(2, 7)})  # captured: its first replay
    runner("a", {"x": torch.ones(3), "y": torch.ones(2, 5)})
    modes = runner.take_modes()  # counts since the last call; the shapes that tell graphs apart
    assert (modes.captured, modes.eager) == (2, 1) and modes.shapes == ("y 2x5", "y 2x7")


def test_shapes_beyond_the_graphs_kept_make_the_run_partly_eager_and_say_why():
    runner, _ = _runner(warmup=0, max_graphs=1)
    runner("a", {"x": torch.ones(2)})
    runner("a", {"x": torch.ones(3)})
    modes = runner.take_modes()
    assert (modes.mode, modes.captured, modes.eager, modes.fell_back) == ("partly eager", 1, 1, True)
    assert modes.reason.startswith("more than 1 input shapes")


def test_a_failed_capture_makes_the_run_eager_and_its_modes_carry_the_error():
    def fussy(inputs):
        if Recording.active is not None:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        return _double(inputs)

    runner, _ = _runner(fussy, warmup=1)
    for _ in range(3):
        runner("a", {"x": torch.ones(2)})
    modes = runner.take_modes()
    assert (modes.mode, modes.captured, modes.eager, modes.fell_back) == ("eager", 0, 3, True)
    assert modes.reason == "capture failed: operation not permitted when stream is capturing"


def test_a_step_never_meant_to_be_captured_is_eager_without_a_fallback():
    runner = GraphedStep(_double, enabled=False, eager_reason="no CUDA")
    runner("a", {"x": torch.ones(2)})
    assert runner.take_modes() == StepModes("eager", 0, 1, (), "no CUDA", False)


# -- replay equals eager over a run's schedule --------------------------------------------------

REPLAY = {**TINY, "train.swa": True, "train.swa_bn_batches": 2, "train.warmup_epochs": 2,
          "train.finetune_epochs": 2, "optim.grad_clip": 0.5, "optim.finetune_lr_factor": 0.1,
          "optim.name": "adamp"}  # adamp: torch's capturable Adam runs on CUDA alone


def _state_tensors(task) -> list[torch.Tensor]:
    """Every tensor a training step changes: weights and buffers, the optimisers' states and
    learning rates, the objective's (the Lagrange multiplier and its optimiser)."""
    found: list[torch.Tensor] = []

    def walk(value) -> None:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif isinstance(value, list | tuple):
            for item in value:
                walk(item)

    optimizers = [task.optimizer]
    modules = [task.net]
    multiplier = getattr(task.objective, "multiplier", None)
    if multiplier is not None:
        modules.append(multiplier)
        optimizers.append(multiplier.optimizer)
    for module in modules:
        found += [*module.parameters(), *module.buffers()]
    for optimizer in optimizers:
        walk(list(optimizer.state.values()))
        walk([group["lr"] for group in optimizer.param_groups])
    return found


def _capture_without_running(task):
    """torch.cuda.graph on the CPU: the step runs (to make its output tensors) and everything it
    changed is put back, as a capture records without running; the graph (:class:`Recording`)
    then re-runs the step at each replay."""

    @contextmanager
    def capture(graph, pool=None, capture_error_mode="global"):
        tensors = _state_tensors(task)
        saved, rng = [t.detach().clone() for t in tensors], torch.get_rng_state()
        with record(graph, pool, capture_error_mode):
            yield
        with torch.no_grad():
            for tensor, value in zip(tensors, saved, strict=True):
                tensor.copy_(value)
        torch.set_rng_state(rng)

    return capture


def _replay_task(workspace, device: torch.device, graphs: bool, monkeypatch):
    """ltd_bound's step (L_lag, the LTD decoder; AdamP, the LTD reference's) on the tiny
    preset, static shapes; with ``graphs`` its steps go through GraphedStep: CUDA graphs on
    CUDA, the stand-in on the CPU."""
    import icr.train.retrieval as retrieval

    flat = {**GPU_TRIAL.arch_config("ltd_bound"), **REPLAY, "train.device": device.type,
            "train.cuda_graphs": graphs, "train.deterministic": True}
    config = from_flat(flat)
    built = build_task(config, workspace, device)
    torch.manual_seed(0)
    with monkeypatch.context() as patch:
        if graphs and device.type == "cpu":  # the optimisers as a captured run builds them
            patch.setattr(retrieval, "why_eager", lambda *args: "")
        task = RetrievalTask(config, built.prepared, device, built.cache, static_shapes=True)
    if graphs and device.type == "cpu":
        task.step_runner = GraphedStep(recorded(task._step), enabled=True, new_graph=Recording,
                                       capture=_capture_without_running(task),
                                       on_failed_capture=task.objective.discard_pending)
    return task


def _train(task) -> tuple[list, list, list]:
    means, rows, lrs = [], [], []
    for epoch in range(task.epochs):
        means.append(task.train_epoch(epoch))
        rows += task.take_trajectory()
        lrs.append(task.metrics())
    return means, rows, lrs


def _replay_devices():
    yield pytest.param(CPU, id="cpu-stand-in")
    # on an H200 (torch 2.11, bfloat16 autocast) the weights, logged values, lambda and lr
    # agreed after 100 steps, and AdamP's first moment of one parameter did not: not yet
    # understood (docs/gpu.md)
    yield pytest.param(torch.device("cuda"), id="cuda", marks=[
        pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"),
        pytest.mark.xfail(reason="AdamP's exp_avg of one parameter differed on an H200",
                          strict=False)])


@pytest.mark.slow
@pytest.mark.parametrize("device", _replay_devices())
def test_replayed_steps_train_as_eager_steps_do_over_a_whole_schedule(device, workspace,
                                                                      monkeypatch):
    """100 steps (4 epochs of 25): the warm-up epochs (backbone frozen, the lr's first cosine),
    the fine-tune epochs (everything trained at lr x 0.1, the second cosine), SWA snapshots at
    each epoch's end and gradient clipping, once through GraphedStep and once eagerly: the
    same weights, optimiser state, multiplier and logged values."""
    graphed = _replay_task(workspace, device, True, monkeypatch)
    eager = _replay_task(workspace, device, False, monkeypatch)
    assert graphed.steps_per_epoch * graphed.epochs >= 50
    got, want = _train(graphed), _train(eager)
    modes = graphed.step_modes()
    assert modes.mode == "captured" and modes.captured > modes.eager > 0, modes
    assert eager.step_modes().captured == 0
    tol = {"atol": 1e-5, "rtol": 1e-4} if device.type == "cpu" else {"atol": 2e-3, "rtol": 2e-2}
    for (mean, rows, lrs), (mean_e, rows_e, lrs_e) in [(got, want)]:
        assert [sorted(m) for m in mean] == [sorted(m) for m in mean_e]
        assert [[r["step"] for r in rows]] == [[r["step"] for r in rows_e]]
        torch.testing.assert_close([[m[k] for k in sorted(m)] for m in mean],
                                   [[m[k] for k in sorted(m)] for m in mean_e], **tol)
        torch.testing.assert_close([[r[k] for k in sorted(r)] for r in rows],
                                   [[r[k] for k in sorted(r)] for r in rows_e], **tol)
        torch.testing.assert_close([[m[k] for k in sorted(m)] for m in lrs],
                                   [[m[k] for k in sorted(m)] for m in lrs_e], **tol)
    for (name, value), (_, expected) in zip(graphed.net.state_dict().items(),
                                            eager.net.state_dict().items(), strict=True):
        torch.testing.assert_close(value.float(), expected.float(), **tol,
                                   msg=lambda text, name=name: f"{name}: {text}")
    state = graphed.optimizer.state_dict()["state"]
    for index, expected in eager.optimizer.state_dict()["state"].items():
        for key, value in expected.items():  # a captured run keeps its step counts as tensors
            torch.testing.assert_close(torch.as_tensor(state[index][key]).float().cpu(),
                                       torch.as_tensor(value).float().cpu(), **tol,
                                       msg=lambda text, where=f"{index} {key}": f"{where}: {text}")
    torch.testing.assert_close(graphed.objective.multiplier.value, eager.objective.multiplier.value,
                               **tol)


# The schedule is stepped alone, without the optimizer steps torch expects before it.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step")
def test_the_learning_rate_a_graph_reads_is_filled_in_place_by_the_schedule(workspace,
                                                                            monkeypatch):
    """A captured step reads each group's lr tensor by its memory: every scheduler.step() must
    write the schedule's rate into that same tensor (a scheduler that assigned group["lr"]
    would leave the graphs on the old rate while the logged lr moved)."""
    task = _replay_task(workspace, CPU, True, monkeypatch)
    tensors = [group["lr"] for group in task.optimizer.param_groups]
    assert all(isinstance(t, torch.Tensor) for t in tensors)
    base = [float(t) for t in tensors]
    factor = task.scheduler.lr_lambdas[0]
    for step in range(1, task.steps_per_epoch * task.epochs + 1):
        task.scheduler.step()
        for group, tensor, lr in zip(task.optimizer.param_groups, tensors, base, strict=True):
            assert group["lr"] is tensor, step
            assert float(tensor) == pytest.approx(lr * factor(step), rel=1e-6, abs=1e-12), step


def test_a_run_whose_steps_were_all_warm_ups_says_so():
    runner, _ = _runner(warmup=3)
    runner("a", {"x": torch.ones(2)})
    modes = runner.take_modes()
    assert (modes.mode, modes.captured, modes.eager, modes.fell_back) == ("eager", 0, 1, False)
    assert modes.reason.startswith("warm-up")
