"""``fit``: the training loop of the LTD paper, and ``evaluate``.

The seam between the research library and the study platform (DESIGN.md): ``fit(config,
reporter, resume_from)`` trains one configuration and calls ``reporter(metrics, checkpoint_dir)``
exactly once per epoch, after validation. The debug mode passes a reporter that prints; the Ray
trainable passes one that calls ``ray.tune.report``.

The recipe (LTD paper Section 4.3, REFERENCE_NOTES section 1):

- a warm-up phase with the image backbone and the word embeddings frozen, then a fine-tune phase
  with everything trained at ``lr x finetune_lr_factor``; a cosine schedule inside each phase, as
  a pure function of the step (the reference stepped its fine-tune scheduler with the absolute
  epoch, so the lr climbed back from 0 to the warm-up lr: not copied);
- gradient clipping (after unscaling once: the reference unscaled fp16 gradients twice);
- per-epoch SWA: the weights at ``swa_snapshots`` evenly spaced steps over the last
  ``swa_fraction`` of the epoch are averaged (``torch.optim.swa_utils.AveragedModel``) and swapped
  in at the end of the epoch, then the BatchNorm statistics are recomputed (``update_bn``);
- AMP on CUDA only; caption augmentation and random erasing; validation every epoch; the best
  checkpoint by validation rsum; the test split evaluated once, at the end, on the best checkpoint.

Determinism: every source of randomness of an epoch is seeded from ``(train.seed, epoch)``, and the
checkpoint written after each epoch holds the model, the optimiser, the schedule, the Lagrange
multiplier, the history and the RNG states, so a resumed run gives the metrics of an uninterrupted
one. Between epochs no SWA average is pending (it is swapped in at each epoch's end), so the SWA
state a checkpoint needs is the swapped-in weights themselves.
"""

from __future__ import annotations

import copy
import csv
import functools
import logging
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, update_bn
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from icr.config import ExperimentConfig, to_flat
from icr.data.pipeline import (
    PairDataset,
    PreparedData,
    collate_pairs,
    encode_split_captions,
    image_input,
    pad_sequences,
    prepare_data,
)
from icr.errors import ConfigError, TrainingError
from icr.losses import cosine_reconstruction_loss, loss_from_config, token_nll_loss
from icr.metrics import retrieval_metrics
from icr.models.build import build_decoder, build_dual_encoder
from icr.objectives import Objective, build_objective
from icr.seeding import derive_seed, rng_state, seed_everything, set_rng_state
from icr.workspace import Workspace

log = logging.getLogger(__name__)

Reporter = Callable[[dict[str, float], Path | None], None]

STATE_FILE = "state.pt"
BEST_FILE = "best_model.pt"
TRAJECTORY_FILE = "trajectory.csv"
TRAJECTORY_FIELDS = ("step", "epoch", "loss", "L_con", "L_rec", "lambda")


@dataclass
class FitResult:
    best_epoch: int  # 1-based epoch of the best validation rsum
    best_val: dict[str, float]
    test: dict[str, float] | None
    history: list[dict[str, float]] = field(repr=False)
    checkpoint_dir: Path


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"train.device={name} but CUDA is not available; use train.device=cpu")
    return torch.device(name)


def lr_factor(
    step: int, steps_per_epoch: int, warmup_epochs: int, finetune_epochs: int, finetune_factor: float
) -> float:
    """Multiplier of the base lr at optimiser step ``step``: a cosine per phase.

    Warm-up steps go from 1 down to 0 along half a cosine; the fine-tune phase restarts at
    ``finetune_factor`` and decays the same way.
    """
    warm = warmup_epochs * steps_per_epoch
    if step < warm:
        return 0.5 * (1.0 + math.cos(math.pi * step / warm))
    tune = max(finetune_epochs * steps_per_epoch, 1)
    progress = min((step - warm) / tune, 1.0)
    return finetune_factor * 0.5 * (1.0 + math.cos(math.pi * progress))


def swa_snapshot_steps(steps: int, snapshots: int, fraction: float) -> set[int]:
    """The 0-based steps of an epoch at which SWA takes a snapshot: evenly over its last part."""
    window = max(int(round(steps * fraction)), min(snapshots, steps), 1)
    return {int(s) for s in np.linspace(steps - window, steps - 1, snapshots).round()}


class _BatchForward(nn.Module):
    """Adapter so ``torch.optim.swa_utils.update_bn`` can run the two-input dual encoder."""

    def __init__(self, encoder: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.encoder, self.device = encoder, device

    def forward(self, batch: dict[str, torch.Tensor]) -> Any:
        return self.encoder(
            batch["images"].to(self.device), batch["tokens"].to(self.device), batch["lengths"]
        )


class Trainer:
    """The state of one training run and the steps that change it."""

    def __init__(self, config: ExperimentConfig, data: PreparedData, device: torch.device) -> None:
        self.config, self.data, self.device = config, data, device
        vocab_size = len(data.vocab)
        target_dim = None if data.targets is None else data.targets.shape[1]
        images = data.images["train"]
        region_dim = images.shape[-1] if images.dtype != torch.uint8 else None
        self.encoder = build_dual_encoder(config, vocab_size, data.word_vectors, region_dim)
        decoder = build_decoder(config, vocab_size, target_dim)
        self.net = nn.ModuleDict({"encoder": self.encoder})
        if decoder is not None:
            self.net["decoder"] = decoder
        self.net.to(device)
        self.loss_fn = loss_from_config(config.loss)
        self.objective: Objective = build_objective(config.objective)
        if self.objective.uses_reconstruction and decoder is None:
            raise ConfigError(
                f"objective.name={config.objective.name} needs a decoder: set decoder.name=ltd or itd"
            )
        self.dataset = PairDataset(
            data.splits["train"], data.images["train"], data.vocab, max_len=config.text.max_len,
            unk_prob=config.text.unk_prob, delete_prob=config.text.delete_prob,
            random_erasing=config.image.random_erasing, targets=data.targets, seed=config.train.seed,
        )
        self.steps_per_epoch = self._steps_per_epoch()
        self.optimizer = self._build_optimizer()
        schedule = functools.partial(
            lr_factor, steps_per_epoch=self.steps_per_epoch,
            warmup_epochs=config.train.warmup_epochs, finetune_epochs=config.train.finetune_epochs,
            finetune_factor=config.optim.finetune_lr_factor,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule)
        self.amp = config.train.amp and device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp)
        self.epoch = 0  # epochs completed
        self.global_step = 0
        self.best_rsum = -math.inf
        self.best_epoch = 0
        self.best_state: dict[str, torch.Tensor] | None = None
        self.history: list[dict[str, float]] = []
        self.trajectory: list[dict[str, float]] = []

    # -- construction -----------------------------------------------------------------------

    def _steps_per_epoch(self) -> int:
        steps = len(self.dataset) // self.config.train.batch_size
        if steps == 0:
            raise ConfigError(
                f"train.batch_size={self.config.train.batch_size} exceeds the "
                f"{len(self.dataset)} training captions; lower train.batch_size"
            )
        cap = self.config.train.max_steps_per_epoch
        return min(steps, cap) if cap else steps

    def _build_optimizer(self) -> torch.optim.Optimizer:
        o = self.config.optim
        cls = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[o.name]
        return cls(self.net.parameters(), lr=o.lr, weight_decay=o.weight_decay)

    # -- training ---------------------------------------------------------------------------

    def in_warmup(self, epoch: int) -> bool:
        return epoch < self.config.train.warmup_epochs

    def loader(self, epoch: int, shuffle: bool = True) -> DataLoader:
        self.dataset.set_epoch(epoch)
        generator = torch.Generator().manual_seed(derive_seed(self.config.train.seed, epoch, 2))
        return DataLoader(
            self.dataset, batch_size=self.config.train.batch_size, shuffle=shuffle, drop_last=True,
            collate_fn=collate_pairs, num_workers=self.config.data.num_workers, generator=generator,
        )

    def train_epoch(self, epoch: int, progress: bool = False) -> dict[str, float]:
        """One epoch of training, SWA swapped in at its end; returns the mean loss components."""
        t = self.config.train
        torch.manual_seed(derive_seed(t.seed, epoch, 1))
        self.encoder.set_backbone_trainable(not self.in_warmup(epoch))
        self.net.train()
        snapshots = swa_snapshot_steps(self.steps_per_epoch, t.swa_snapshots, t.swa_fraction)
        averaged = AveragedModel(self.net, use_buffers=False) if t.swa else None
        sums: dict[str, torch.Tensor] = {}
        batches = _take(self.loader(epoch), self.steps_per_epoch)
        bar = tqdm(batches, total=self.steps_per_epoch, desc=f"epoch {epoch + 1}/{self.config.epochs}",
                   disable=not progress, leave=False)
        for step, batch in enumerate(bar):
            logs = self.train_step(batch, epoch, step)
            for k, v in logs.items():
                sums[k] = sums.get(k, 0.0) + v
            if averaged is not None and step in snapshots:
                averaged.update_parameters(self.net)
            if progress and step % 10 == 0:
                bar.set_postfix({k: f"{float(v):.3f}" for k, v in logs.items()})
        if averaged is not None:
            self._swap_in(averaged, epoch)
        return {f"train_{k}": float(v) / self.steps_per_epoch for k, v in sums.items()}

    def train_step(self, batch: dict[str, torch.Tensor], epoch: int, step: int) -> dict[str, torch.Tensor]:
        dev = self.device
        images = batch["images"].to(dev, non_blocking=True)
        tokens, lengths = batch["tokens"].to(dev), batch["lengths"]
        autocast = torch.autocast("cuda", dtype=torch.float16) if self.amp else nullcontext()
        with autocast:
            img, cap = self.encoder(images, tokens, lengths)  # (B, D), (B, D)
            sims = img @ cap.t()  # (B, B), positives on the diagonal
            l_con = self.loss_fn(sims.float(), batch["image_index"].to(dev))
            l_rec = self.reconstruction_loss(cap, batch)
            out = self.objective(l_con, l_rec)
        if not torch.isfinite(out.loss):
            parts = ", ".join(f"{k}={float(v):.4g}" for k, v in out.logs.items())
            raise TrainingError(
                f"non-finite loss at epoch {epoch + 1}, step {step + 1} ({parts}); "
                "lower optim.lr or check the data"
            )
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(out.loss).backward()
        if self.config.optim.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.net.parameters(), self.config.optim.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.objective.step()
        self.global_step += 1
        if self.global_step % self.config.train.trajectory_every == 0:
            self._record_trajectory(epoch, out.logs)
        return out.logs

    def reconstruction_loss(self, captions: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """L_rec of the decoder: LTD cosine loss (Eq. 6) or ITD token NLL (Eq. 4)."""
        if "decoder" not in self.net:
            return None
        decoder = self.net["decoder"]
        if self.config.decoder.name == "ltd":
            recon = decoder(captions)  # (B, D_target)
            return cosine_reconstruction_loss(recon.float(), batch["targets"].to(self.device))
        tokens = batch["clean_tokens"][:, 1:].to(self.device)  # (B, T-1): predict after <start>
        logits = decoder(captions, tokens)  # (B, T-1, V)
        return token_nll_loss(logits.float(), tokens, pad_index=self.data.vocab.pad_id)

    def _record_trajectory(self, epoch: int, logs: dict[str, torch.Tensor]) -> None:
        row = {"step": self.global_step, "epoch": epoch + 1}
        row.update({k: float(logs[k]) if k in logs else math.nan for k in TRAJECTORY_FIELDS[2:]})
        self.trajectory.append(row)

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
        batches = _take(self.loader(epoch), self.config.train.swa_bn_batches)
        update_bn(((b,) for b in batches), _BatchForward(self.encoder, self.device))
        for module, state in zip(frozen, saved, strict=True):
            module.load_state_dict(state)

    # -- evaluation -------------------------------------------------------------------------

    @torch.no_grad()
    def embed_split(self, split_name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Image (N_img, D) and caption (N_cap, D) embeddings of an evaluation split."""
        self.net.eval()
        bs, split = self.config.eval.batch_size, self.data.splits[split_name]
        images = self.data.images[split_name]
        img = torch.cat([
            self.encoder.encode_images(image_input(images, i, i + bs).to(self.device))
            for i in range(0, len(images), bs)
        ])
        ids = encode_split_captions(split, self.data.vocab, self.config.text.max_len)
        caps = []
        for i in range(0, len(ids), bs):
            tokens, lengths = pad_sequences(ids[i : i + bs])
            caps.append(self.encoder.encode_captions(tokens.to(self.device), lengths))
        return img.float(), torch.cat(caps).float()

    def evaluate(self, split_name: str) -> dict[str, float]:
        """Every retrieval metric of a split (R@k, rsum, ranks, R-precision, mAP@5, nDCG, CxC)."""
        img, cap = self.embed_split(split_name)
        assets = self.data.eval_assets[split_name]
        split = self.data.splits[split_name]
        return retrieval_metrics(
            img @ cap.t(), torch.as_tensor(split.caption_image, device=img.device),
            relevance=assets.relevance, extended_i2t=assets.extended_i2t,
            extended_t2i=assets.extended_t2i,
        )

    # -- checkpoints ------------------------------------------------------------------------

    def remember_if_best(self, val: dict[str, float], epoch: int) -> None:
        if val["rsum"] > self.best_rsum:
            self.best_rsum, self.best_epoch = val["rsum"], epoch + 1
            self.best_state = {k: v.detach().cpu().clone() for k, v in self.net.state_dict().items()}

    def save(self, directory: Path) -> Path:
        """Write a self-contained checkpoint to ``directory``, replacing the previous one.

        The new checkpoint is written beside it, the old one moved aside, the new one moved in,
        and only then the old one deleted: at every instant one complete checkpoint exists, which
        :func:`find_checkpoint` finds.
        """
        tmp, old = (directory.with_name(directory.name + suffix) for suffix in (".tmp", ".old"))
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save(self.state_dict(), tmp / STATE_FILE)
        if self.best_state is not None:
            torch.save(self.best_state, tmp / BEST_FILE)
        write_trajectory(tmp / TRAJECTORY_FILE, self.trajectory)
        if (directory / STATE_FILE).exists():
            shutil.rmtree(old, ignore_errors=True)
            directory.rename(old)
        else:
            shutil.rmtree(directory, ignore_errors=True)
        tmp.rename(directory)
        shutil.rmtree(old, ignore_errors=True)
        return directory

    def state_dict(self) -> dict[str, Any]:
        return {
            "config": to_flat(self.config),
            "net": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "objective": self.objective.state_dict(),
            "epoch": self.epoch,
            "global_step": self.global_step,
            "best_rsum": self.best_rsum,
            "best_epoch": self.best_epoch,
            "history": self.history,
            "trajectory": self.trajectory,
            "rng": rng_state(),
        }

    def load(self, directory: Path) -> None:
        """Restore a checkpoint written by :meth:`save` (same config required)."""
        found = find_checkpoint(directory)
        if found is None:
            raise ConfigError(f"{Path(directory) / STATE_FILE}: no checkpoint to resume from")
        directory, path = found, found / STATE_FILE
        state = torch.load(path, map_location="cpu", weights_only=False)
        if state["config"] != to_flat(self.config):
            diff = sorted(k for k, v in to_flat(self.config).items() if state["config"].get(k) != v)
            raise ConfigError(f"{path} was written with another config (differs in {', '.join(diff)})")
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.objective.load_state_dict(state["objective"])
        for key in ("epoch", "global_step", "best_rsum", "best_epoch", "history", "trajectory"):
            setattr(self, key, state[key])
        best = Path(directory) / BEST_FILE
        self.best_state = torch.load(best, map_location="cpu") if best.exists() else None
        set_rng_state(state["rng"])


def find_checkpoint(directory: Path | str) -> Path | None:
    """The complete checkpoint :meth:`Trainer.save` left at ``directory``, or ``None``.

    That is ``directory`` itself, or, after an interruption between the two renames of a save,
    the previous checkpoint moved aside to ``directory.old``.
    """
    directory = Path(directory)
    for candidate in (directory, directory.with_name(directory.name + ".old")):
        if (candidate / STATE_FILE).exists():
            return candidate
    return None


def _take(iterable: Iterable, n: int) -> Iterator:
    for i, item in enumerate(iterable):
        if i >= n:
            return
        yield item


def write_trajectory(path: Path, rows: list[dict[str, float]]) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=TRAJECTORY_FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def fit(
    config: ExperimentConfig,
    reporter: Reporter | None = None,
    resume_from: Path | str | None = None,
    *,
    workspace: Workspace | Path | str | None = None,
    run_dir: Path | str | None = None,
    progress: bool = False,
) -> FitResult:
    """Train ``config``; call ``reporter(metrics, checkpoint_dir)`` once per epoch.

    Args:
        config: the experiment.
        reporter: receives the epoch's metrics (``epoch``, ``val_*``, ``train_*``, ``lambda``,
            ``lr``, ``epoch_time_s``; ``test_*`` on the last epoch when ``eval.test``) and the
            directory of the epoch's checkpoint, which the next epoch overwrites.
        resume_from: a checkpoint directory written by an earlier call with the same config.
        workspace: where data and caches live (default: ``ICR_WORKSPACE`` or ``./workspace``).
        run_dir: where checkpoints are written (default: a temporary directory).
        progress: show tqdm progress bars.
    """
    ws = workspace if isinstance(workspace, Workspace) else Workspace.resolve(workspace)
    device = resolve_device(config.train.device)
    seed_everything(config.train.seed)
    data = prepare_data(config, ws, device)
    trainer = Trainer(config, data, device)
    if resume_from is not None:
        trainer.load(Path(resume_from))
        log.info("resumed from %s after epoch %d", resume_from, trainer.epoch)
    own_dir = run_dir is None
    root = Path(tempfile.mkdtemp(prefix="icr-fit-")) if own_dir else Path(run_dir)
    checkpoint = root / "checkpoint"
    test: dict[str, float] | None = None
    for epoch in range(trainer.epoch, config.epochs):
        start = time.perf_counter()
        metrics: dict[str, float] = {"epoch": epoch + 1}
        metrics.update(trainer.train_epoch(epoch, progress))
        val = trainer.evaluate("val")
        trainer.remember_if_best(val, epoch)
        metrics.update({f"val_{k}": v for k, v in val.items()})
        metrics["lr"] = trainer.optimizer.param_groups[0]["lr"]
        if hasattr(trainer.objective, "lambda_value"):
            metrics["lambda"] = trainer.objective.lambda_value
        trainer.epoch = epoch + 1
        if trainer.epoch == config.epochs and config.eval.test:
            test = evaluate_best(trainer, "test")
            metrics.update({f"test_{k}": v for k, v in test.items()})
        metrics["epoch_time_s"] = time.perf_counter() - start
        trainer.history.append(metrics)
        trainer.save(checkpoint)
        if reporter is not None:
            reporter(metrics, checkpoint)
    if test is None and config.eval.test and trainer.history:  # resumed after the last epoch
        test = {k[5:]: v for k, v in trainer.history[-1].items() if k.startswith("test_")} or None
    best_val = next((h for h in trainer.history if h["epoch"] == trainer.best_epoch), {})
    return FitResult(
        best_epoch=trainer.best_epoch,
        best_val={k[4:]: v for k, v in best_val.items() if k.startswith("val_")},
        test=test,
        history=trainer.history,
        checkpoint_dir=checkpoint,
    )


def evaluate_best(trainer: Trainer, split: str) -> dict[str, float]:
    """Evaluate the best-validation weights on ``split`` (the live weights are restored after)."""
    if trainer.best_state is None:
        return trainer.evaluate(split)
    live = {k: v.detach().clone() for k, v in trainer.net.state_dict().items()}
    trainer.net.load_state_dict(trainer.best_state)
    try:
        return trainer.evaluate(split)
    finally:
        trainer.net.load_state_dict(live)


def restore(
    config: ExperimentConfig,
    checkpoint_dir: Path | str,
    *,
    workspace: Workspace | Path | str | None = None,
    best: bool = True,
) -> Trainer:
    """A :class:`Trainer` in the state of a checkpoint, holding the best-validation weights by
    default: for analyses of a trained model (``trainer.embed_split("test")``, probes, COCOS).
    """
    ws = workspace if isinstance(workspace, Workspace) else Workspace.resolve(workspace)
    device = resolve_device(config.train.device)
    trainer = Trainer(config, prepare_data(config, ws, device), device)
    trainer.load(Path(checkpoint_dir))
    if best and trainer.best_state is not None:
        trainer.net.load_state_dict(trainer.best_state)
    trainer.net.eval()
    return trainer
