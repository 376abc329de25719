"""The image-caption retrieval task: its training state and the steps that change it.

The recipe (LTD paper Section 4.3, docs/reference-code.md section 1; :mod:`icr.train.recipe`):

- a warm-up phase with the image backbone and the word embeddings frozen, then a fine-tune phase
  at ``lr x finetune_lr_factor``, a cosine schedule in each;
- gradient clipping (after unscaling once: the reference unscaled fp16 gradients twice);
- per-epoch SWA: the weights at ``swa_snapshots`` evenly spaced steps over the last
  ``swa_fraction`` of the epoch are averaged (``torch.optim.swa_utils.AveragedModel``) and swapped
  in at the end of the epoch, then the BatchNorm statistics are recomputed (``update_bn``);
- AMP on CUDA only (:mod:`icr.train.device`); caption augmentation and random erasing;
- batches as slices of an epoch planned at once, the data on the device when it fits
  (:mod:`icr.data.batches`); no host synchronisation inside a step (:mod:`icr.train.step_log`);
- on CUDA each step replayed as a CUDA graph (``train.cuda_graphs``, :mod:`icr.train.graphs`):
  static-shape batches and model paths, a capturable optimiser, the learning rate a device tensor.

Determinism: every source of randomness of an epoch is seeded from ``(train.seed, epoch)``; the
state holds the model, the optimiser, the schedule and the objective (the multiplier), so a resumed
run gives the metrics of an uninterrupted one. Between epochs no SWA average is pending (it is
swapped in at each epoch's end), so the swapped-in weights are the whole SWA state.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn
from tqdm.auto import tqdm

from icr.analysis.cocos import COCOS_COUNTERS, build_counter
from icr.config import ExperimentConfig, used_keys, used_values
from icr.context import Capability, Embedder, Embeddings, InitialEmbeddings
from icr.data.batches import Batch, TrainingBatches
from icr.data.features import cached_backbone_features
from icr.data.glove import check_glove_file
from icr.data.images import ImageStore, SplitImages, place_images
from icr.data.pipeline import PreparedData
from icr.data.sampler import steps_per_epoch
from icr.errors import ConfigError, step_errors
from icr.losses import ContrastiveLoss, config_options, loss_from_config, warmup_from_config
from icr.losses.contrastive import split_output
from icr.models.build import build_decoder, build_dual_encoder, check_inputs
from icr.models.recurrent import use_static_shapes
from icr.objectives import Objective, ObjectiveOutput, build_objective
from icr.seeding import derive_seed, seed_everything
from icr.train.device import Precision
from icr.train.evaluation import embed_split, split_metrics
from icr.train.graphs import GraphedStep
from icr.train.recipe import (
    build_optimizer,
    load_optimizer_state,
    schedule_factor,
    swa_snapshot_steps,
)
from icr.train.retrieval_data import RetrievalInputs, check_data, prepare_data
from icr.train.seam import StepModes
from icr.train.step_log import StepLog
from icr.train.tasks import TASKS, Prepared
from icr.train.timing import StepTimer
from icr.workspace import Workspace

log = logging.getLogger(__name__)


class _BatchForward(nn.Module):
    """Adapter so ``torch.optim.swa_utils.update_bn`` can run the two-input dual encoder."""

    def __init__(self, encoder: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.encoder, self.device = encoder, device

    def forward(self, batch: dict[str, torch.Tensor]) -> Any:
        return self.encoder(
            batch["images"].to(self.device), batch["tokens"].to(self.device), batch["lengths"]
        )


class RetrievalTask:
    """A dual encoder (and optionally a decoder) trained with a contrastive loss and an objective."""

    selection_metric = "rsum"

    def __init__(
        self, config: ExperimentConfig, data: PreparedData, device: torch.device,
        cache: Path | None = None, static_shapes: bool | None = None,
    ) -> None:
        """``static_shapes``: static-shape batches and model paths (default: when the steps are
        captured as CUDA graphs, :func:`why_eager`; a CPU test asks for them)."""
        self.config, self.device, self.cache = config, device, cache
        self.precision = Precision.of(config.train.amp, device, config.train.amp_dtype)
        self.eager_reason = why_eager(config, device, self.precision)
        self.graphs = not self.eager_reason
        self.static_shapes = self.graphs if static_shapes is None else static_shapes
        # the keys an error inside a step names, with their values (the loss's own options)
        self.step_keys = used_values(config, ("loss.", "objective.", "optim."))
        self.prepared = data  # as prepared (pixels), before any cached backbone features
        self.epochs = config.epochs
        images = data.images["train"]
        region_dim = None if images.pixels else images.item_shape[-1]
        target_dim = None if data.targets is None else data.targets.shape[1]
        self.encoder = build_dual_encoder(config, len(data.vocab), data.word_vectors, region_dim)
        if cache is not None and frozen_cnn(config):
            data = self._use_cached_features(data, cache)
        self.data = data
        decoder = build_decoder(config, len(data.vocab), target_dim)
        self.net = nn.ModuleDict({"encoder": self.encoder})
        if decoder is not None:
            self.net["decoder"] = decoder
        self.net.to(device)
        use_static_shapes(self.net, self.static_shapes)
        self.loss_fn = loss_from_config(config.loss)
        self.warmup_loss_fn = warmup_from_config(config.loss)  # None: no warm-up epochs
        self.objective: Objective = build_objective(config.objective).to(device)
        if self.objective.uses_reconstruction and decoder is None:
            raise ConfigError(
                f"objective.name={config.objective.name} needs a decoder: set decoder.name=ltd or itd"
            )
        self.stores, self.captions = self._place_inputs(data)
        self.train_batches = self._training_batches(data)
        self.steps_per_epoch = self._steps_per_epoch()
        self.optimizer = self._build_optimizer()
        o = config.optim
        schedule = functools.partial(
            schedule_factor, steps_per_epoch=self.steps_per_epoch,
            warmup_epochs=config.train.warmup_epochs, finetune_epochs=config.train.finetune_epochs,
            finetune_factor=o.finetune_lr_factor, schedule=o.schedule, step_epochs=o.step_epochs,
            gamma=o.step_gamma,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.scaler = self.precision.scaler()
        self.step_runner = GraphedStep(self._step, enabled=self.graphs,
                                       on_failed_capture=self.objective.discard_pending,
                                       eager_reason=self.eager_reason)
        self._loss_fn = self.loss_fn  # the epoch's L_con (train_step sets it)
        self.global_step = 0
        self._rows: list[dict[str, float]] = []
        self.cocos = live_cocos(config) if config.train.live_cocos else None

    # -- construction -----------------------------------------------------------------------

    def _steps_per_epoch(self) -> int:
        t = self.config.train
        steps = len(self.train_batches)
        return min(steps, t.max_steps_per_epoch) if t.max_steps_per_epoch else steps

    def _place_inputs(self, data: PreparedData
                      ) -> tuple[dict[str, ImageStore], dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """Every split's images where the budget allows (the training split first), and every
        evaluation split's clean caption ids on the device (lengths on the CPU)."""
        budget = self.config.data.device_budget_gb * 2**30
        stores = place_images(data.images, self.device, budget)
        captions = {}
        for split in ("val", "test"):
            tokens, lengths = data.tables[split].clean()
            captions[split] = (tokens.to(self.device), lengths)
        return stores, captions

    def _training_batches(self, data: PreparedData) -> TrainingBatches:
        """The training split's batches, its latent targets on the device if they still fit."""
        c, t = self.config, self.config.train
        train = data.splits["train"]
        targets = data.targets
        if targets is not None:
            used = sum(s.images.nbytes for s in self.stores.values() if s.resident)
            fits = used + targets.nbytes <= c.data.device_budget_gb * 2**30
            if fits:  # a copy: the cache file stays read-only
                targets = torch.from_numpy(np.array(targets, dtype=np.float32)).to(self.device)
        return TrainingBatches(
            images=self.stores["train"], caption_image=train.caption_image,
            captions=data.tables["train"], clean=data.vocab_table,
            targets=targets, sampler=t.sampler, batch_size=t.batch_size, epoch_unit=t.epoch_unit,
            seed=t.seed, unk_prob=c.text.unk_prob, delete_prob=c.text.delete_prob,
            random_erasing=c.image.random_erasing, normalize=data.pixels, device=self.device,
            static_shapes=self.static_shapes,
        )

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """One parameter group, plus one for a pretrained backbone with its own lr factor (BERT)."""
        o = self.config.optim
        groups = []
        for module in (self.encoder.image_encoder, self.encoder.caption_encoder):
            factor = getattr(module, "backbone_lr_factor", 1.0)
            if factor != 1.0:
                groups.append({"params": list(module.backbone_parameters()), "lr": o.lr * factor})
        special = {id(p) for g in groups for p in g["params"]}
        rest = [p for p in self.net.parameters() if id(p) not in special]
        return build_optimizer(o.name, [{"params": rest}, *groups], o.lr, o.weight_decay,
                               self.device, capturable=self.graphs)

    def _use_cached_features(self, data: PreparedData, cache: Path) -> PreparedData:
        """A CNN frozen for the whole run on un-augmented images gives every epoch the same
        features: compute them once (cached on disk), on the training device, and train the
        heads on them (VSE++)."""
        cnn = self.encoder.image_encoder  # moved to the run's device to compute
        features = {
            split: SplitImages(cached_backbone_features(
                cnn, images.array, data.pixels, cache / "features", self.config.image.encoder,
                device=self.device).numpy())
            for split, images in data.images.items()
        }  # split -> (N, D)
        self.encoder.image_encoder = PrecomputedFeatures(cnn.output_dim)
        log.info("frozen %s: training on its cached features", self.config.image.encoder)
        return dataclasses.replace(data, images=features)

    # -- training ---------------------------------------------------------------------------

    def in_warmup(self, epoch: int) -> bool:
        return epoch < self.config.train.warmup_epochs

    def batches(self, epoch: int, steps: int | None = None) -> Iterator[Batch]:
        """The batches of ``epoch``: pairs, or whole images with their captions
        (``train.sampler``); at most ``steps`` of them."""
        return self.train_batches.epoch(epoch, steps)

    def train_epoch(self, epoch: int, progress: bool = False, timer: StepTimer | None = None
                    ) -> dict[str, float]:
        """One epoch of training, SWA swapped in at its end; returns the mean loss terms. A
        ``timer`` is told each step's end (:mod:`icr.train.timing`)."""
        t = self.config.train
        torch.manual_seed(derive_seed(t.seed, epoch, 1))
        self.encoder.set_backbone_trainable(not self.in_warmup(epoch))
        if self.config.image.frozen:
            self.encoder.image_encoder.set_backbone_trainable(False)
        self.net.train()
        self._loss_fn = self.loss_for_epoch(epoch)
        key = self._step_key()  # read from the model once: nothing above changes in the epoch
        snapshots = swa_snapshot_steps(self.steps_per_epoch, t.swa_snapshots, t.swa_fraction)
        averaged = AveragedModel(self.net, use_buffers=False) if t.swa else None
        record = StepLog(epoch, "lower optim.lr or check the data")
        bar = tqdm(self.batches(epoch, self.steps_per_epoch), total=self.steps_per_epoch,
                   desc=f"epoch {epoch + 1}/{self.epochs}", disable=not progress, leave=False)
        for step, batch in enumerate(bar):
            with step_errors(epoch=epoch, step=step, keys=self.step_keys):
                out = self.train_step(batch, epoch, step, key)
            row = self.global_step if self.global_step % t.trajectory_every == 0 else None
            record.add(out.loss, out.terms, row_step=row,
                       extra=self._cocos(out) if row is not None else None)
            if timer is not None:
                timer.step()
            if averaged is not None and step in snapshots:
                averaged.update_parameters(self.net)
            if progress and step % 25 == 0:  # reads the GPU: only with a progress bar
                bar.set_postfix({k: f"{float(v):.3f}" for k, v in out.terms.items()})
        means = record.means(exclude=("lambda",))  # lambda: recorded per step and per epoch
        self._rows.extend(record.rows())
        if averaged is not None:
            self._swap_in(averaged, epoch)
        return means

    def _cocos(self, out: StepOutput) -> Any:
        """The live COCOS counts of a step, computed when its trajectory row is read."""
        if self.cocos is None:
            return None
        sims, ids = out.sims.detach().float(), out.image_index
        return lambda: self.cocos(sims, ids)

    def loss_for_epoch(self, epoch: int) -> ContrastiveLoss:
        """L_con of ``epoch`` (0-based): the loss's warm-up form for ``loss.warmup_epochs``
        epochs (the triplet loss: all negatives before the hardest), then the loss itself."""
        if self.warmup_loss_fn is not None and epoch < self.config.loss.warmup_epochs:
            return self.warmup_loss_fn
        return self.loss_fn

    def train_step(self, batch: Batch, epoch: int, step: int, key: tuple | None = None
                   ) -> StepOutput:
        """One optimiser step on ``batch``; nothing in it waits for the device. On CUDA the
        step is a replay of a CUDA graph (:mod:`icr.train.graphs`); the learning rate moves
        after it, on the host's schedule, into the tensor the next replay reads. ``key``: the
        step's :meth:`_step_key` where the caller has it (:meth:`train_epoch`, once an epoch:
        reading it walks every parameter and module), else read here."""
        self._loss_fn = self.loss_for_epoch(epoch)
        out = self.step_runner(self._step_key() if key is None else key, self.step_inputs(batch))
        self.scheduler.step()
        self.global_step += 1
        terms = {name[len(_TERM):]: v for name, v in out.items() if name.startswith(_TERM)}
        return StepOutput(out["loss"], terms, out["sims"], batch["image_index"])

    def _step_key(self) -> tuple:
        """What a step computes besides its inputs: which parameters train (a frozen backbone,
        frozen word embeddings), which modules are in training mode (a frozen BERT's dropout is
        off) and the loss's form (a warm-up form in its first epochs)."""
        return (tuple(p.requires_grad for p in self.net.parameters()),
                tuple(m.training for m in self.net.modules()),
                self._loss_fn is self.warmup_loss_fn)

    def step_inputs(self, batch: Batch) -> Batch:
        """The tensors :meth:`loss_of` reads, on the device (host lengths stay for packed RNNs)."""
        return {name: batch[name].to(self.device, non_blocking=True)
                if name not in ("lengths", "clean_lengths") else batch[name]
                for name in batch}

    def loss_of(self, batch: Batch) -> tuple[ObjectiveOutput, dict[str, torch.Tensor], torch.Tensor]:
        """The forward pass of a step: the objective's output, the loss's logged terms and the
        similarities ``(B, B)`` (positives on the diagonal), with ``self._loss_fn`` as L_con."""
        with self.precision.autocast(cache=not self.step_runner.enabled):
            img, cap = self.encoder(batch["images"], batch["tokens"], batch["lengths"])  # (B, D)
            sims = img @ cap.t()  # (B, B), positives on the diagonal
            l_con, loss_logs = split_output(self._loss_fn(sims.float(), batch["image_index"]))
            l_rec = self.net["decoder"].loss(cap, batch) if "decoder" in self.net else None
            return self.objective(l_con, l_rec), loss_logs, sims

    def _step(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Forward, backward and every update of a step (what a CUDA graph records)."""
        out, loss_logs, sims = self.loss_of(batch)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(out.loss).backward()
        if self.config.optim.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.net.parameters(), self.config.optim.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.objective.step()
        terms = {f"{_TERM}{k}": v.detach() for k, v in {**out.logs, **loss_logs}.items()}
        return {"loss": out.loss.detach(), "sims": sims.detach(), **terms}

    def take_trajectory(self) -> list[dict[str, float]]:
        rows, self._rows = self._rows, []
        return rows

    def step_modes(self) -> StepModes:
        """How the steps since the last call ran: captured or eager, and why."""
        return self.step_runner.take_modes()

    def _swap_in(self, averaged: AveragedModel, epoch: int) -> None:
        """Copy the SWA average into the model and recompute BatchNorm statistics."""
        with torch.no_grad():
            for live, avg in zip(self.net.parameters(), averaged.module.parameters(), strict=True):
                live.copy_(avg)
        self.net.train()
        # update_bn resets every BatchNorm it sees; a frozen backbone keeps its statistics.
        frozen = [m for m in self.net.modules()
                  if isinstance(m, nn.modules.batchnorm._BatchNorm) and not m.training]
        saved = [copy.deepcopy(m.state_dict()) for m in frozen]
        batches = self.batches(epoch, self.config.train.swa_bn_batches)
        update_bn(((b,) for b in batches), _BatchForward(self.encoder, self.device))
        for module, state in zip(frozen, saved, strict=True):
            module.load_state_dict(state)

    # -- evaluation -------------------------------------------------------------------------

    def embed_split(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Image (N_img, D) and caption (N_cap, D) embeddings of a split."""
        if split in self.captions:
            tokens, lengths = self.captions[split]
        else:  # the training split (probes, COCOS): its clean ids, made when asked
            tokens, lengths = self.data.tables[split].clean()
        return embed_split(self.encoder, self.stores[split], tokens.to(self.device), lengths,
                           normalize=self.data.pixels, batch_size=self.config.eval.batch_size)

    def evaluate(self, split: str) -> dict[str, float]:
        return split_metrics(self.embed_split(split), self.data, split)

    def initial_embedder(self) -> Embedder:
        """:meth:`embed_split` of this model at its initialisation: a new task built from the
        run's seed exactly as ``fit`` built this one (the probes' ``init`` reference)."""
        seed_everything(self.config.train.seed)
        return RetrievalTask(self.config, self.prepared, self.device, self.cache).embed_split

    def capabilities(self) -> tuple[Capability, ...]:
        return (Embeddings(self.embed_split), InitialEmbeddings(self.initial_embedder),
                RetrievalInputs(self.prepared), *self.prepared.source.capabilities())

    def metrics(self) -> dict[str, float]:
        return {"lr": float(self.optimizer.param_groups[0]["lr"]), **self.objective.metrics()}

    def eval(self) -> None:
        self.net.eval()

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "net": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "objective": self.objective.state_dict(),
            "global_step": self.global_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.objective.load_state_dict(state["objective"])
        self.global_step = state["global_step"]
        self.step_runner.reset()  # the optimiser's and objective's state tensors are new

    def model_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()}

    def load_model_state(self, state: dict[str, torch.Tensor]) -> None:
        self.net.load_state_dict(state)


_TERM = "term:"  # the prefix of a logged term among a step's outputs


def why_eager(config: ExperimentConfig, device: torch.device, precision: Precision) -> str:
    """Why a run's steps are not captured as CUDA graphs; empty when they are (on CUDA with
    ``train.cuda_graphs``, unless float16 needs loss scaling: the scaler skips steps on the
    host's word)."""
    if device.type != "cuda":
        return "no CUDA"
    if not config.train.cuda_graphs:
        return "train.cuda_graphs=false"
    if precision.scales_loss:
        log.info("train.cuda_graphs: float16 with loss scaling is not captured; eager steps")
        return "float16 with loss scaling"
    return ""


class StepOutput(NamedTuple):
    """What a training step computed: the loss and its logged terms (0-d tensors, on the
    device), the batch's similarities and image indices (for COCOS counts)."""

    loss: torch.Tensor
    terms: dict[str, torch.Tensor]
    sims: torch.Tensor  # (B, B)
    image_index: torch.Tensor  # (B,)


class PrecomputedFeatures(nn.Module):
    """Stands in for a frozen backbone whose features were computed once: (B, D) -> (B, D)."""

    def __init__(self, output_dim: int) -> None:
        super().__init__()
        self.output_dim = output_dim

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features

    def set_backbone_trainable(self, flag: bool) -> None:
        """The backbone stays frozen by construction (see :func:`frozen_cnn`)."""


def frozen_cnn(config: ExperimentConfig) -> bool:
    """The image CNN is frozen for the whole run (``image.frozen``) and sees un-augmented pixels,
    so its features can be computed once."""
    return (config.data.features == "pixels" and config.image.frozen
            and config.image.random_erasing == 0)


def check_retrieval(config: ExperimentConfig) -> None:
    """The image encoder reads what data.features gives; a GloVe file given is readable; warm-up
    epochs only for a loss with a warm-up form."""
    check_inputs(config)
    warmup_from_config(config.loss)
    if "text.glove" in used_keys(config) and config.text.glove not in ("glove-6b-50d", "none"):
        check_glove_file(Path(config.text.glove))


def prepare_retrieval(config: ExperimentConfig, workspace: Workspace) -> Prepared:
    """The data of a retrieval run, cached (dataset, vocabulary, targets, relevance)."""
    data = prepare_data(config, workspace)
    train = data.splits["train"]
    return Prepared(data.fingerprint, train.num_captions, train.num_images, data.source.root,
                    data.source.notes)


def fits_retrieval(config: ExperimentConfig, data: Prepared) -> None:
    """An epoch of ``train.batch_size`` has at least one batch (what :class:`RetrievalTask`
    computes first)."""
    t = config.train
    steps_per_epoch(data.train_captions, data.train_images, t.batch_size, t.sampler, t.epoch_unit)


@TASKS.register(
    "retrieval", reads=("image.*", "text.*", "model.*", "loss.*", "decoder.*", "objective.*"),
    prepare=prepare_retrieval, check=check_retrieval, fits=fits_retrieval, check_data=check_data,
    provides=(Embeddings, InitialEmbeddings, RetrievalInputs),
)
def retrieval(config: ExperimentConfig, workspace: Workspace, device: torch.device) -> RetrievalTask:
    """Image-caption retrieval: the dual encoder of the LTD, metric-learning and VSE papers."""
    return RetrievalTask(config, prepare_data(config, workspace, device), device, workspace.cache)


def live_cocos(config: ExperimentConfig) -> Any:
    """The COCOS counter of ``loss.name`` with its options, for the trajectory (section 4 of the
    metric-learning paper, counted on every recorded training batch)."""
    name = config.loss.name
    if name not in COCOS_COUNTERS:
        raise ConfigError(f"train.live_cocos: loss.name={name} has no COCOS counter; "
                          f"use one of {', '.join(COCOS_COUNTERS.names())} or train.live_cocos=false")
    counter = build_counter(name, **config_options(config.loss))
    return lambda sims, ids: {f"cocos_{k}": v for k, v in counter(sims, ids).items()
                              if not math.isnan(v)}

