"""The experiment configuration: one typed tree, one flat vocabulary.

``ExperimentConfig`` is a tree of frozen dataclasses. Dotted flat keys (``objective.eta``,
``loss.name``) are the single vocabulary of search-space files, trial configs, the command line
(``--set loss.tau=0.07``), MLflow params and report tables. :func:`to_flat` and :func:`from_flat`
round-trip exactly; an unknown key or an invalid value raises :class:`~icr.errors.ConfigError`
naming the key and what is allowed.

Every field is declared with :func:`_field`: a default, a one-line help text, and optionally the
allowed choices or a numeric range. The help text is what ``python -m studies.run --keys`` prints.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from icr.errors import ConfigError
from icr.registry import resolve

Scalar = bool | int | float | str

# What the tensors a number goes into can hold: a float key becomes a float32 tensor (a
# multiplier, a temperature, a learning rate applied to float32 weights) and torch refuses a
# larger one inside the step ("value cannot be converted to type float without overflow"); an
# int key goes into an int64 one (seeds, sizes). Every key's domain is cut to its dtype's range
# (:func:`key_specs`), so such a value is refused with the key's name before anything runs.
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # torch.iinfo(torch.int64)
_HOLDS: dict[type, tuple[float, float]] = {float: (-FLOAT32_MAX, FLOAT32_MAX),
                                          int: (INT64_MIN, INT64_MAX)}


def _field(
    default: Scalar,
    help: str,
    *,
    choices: tuple[Scalar, ...] | None = None,
    registry: str | None = None,
    many: bool = False,
    low: float | None = None,
    high: float | None = None,
    path: tuple[str, ...] | None = None,
    form: tuple[str, str] | None = None,
    remote: bool = False,
) -> Any:
    """A config field: its default, help line and domain.

    ``registry`` ("module:NAME") makes the allowed values the names registered there (read when
    first needed, so a new component needs no edit here); ``many`` allows a comma-separated list
    of them ('' = none). ``low`` and ``high`` bound a number; a number's domain never reaches
    past what its tensor's dtype holds (``_HOLDS``), bounds given or not. ``path`` marks a local file or folder: the value must exist unless it is
    '' or one of the names listed (e.g. a bundled model), which :func:`check_paths` verifies on
    the driver before anything starts; with ``remote`` it may also be a URI (``s3://...``), a
    folder that each node copies into its cache (:mod:`icr.data.remote`). ``form`` (a regular
    expression the whole value must match, and how to say it) constrains a structured string.
    """
    meta = {"help": help, "choices": choices, "registry": registry, "many": many, "low": low,
            "high": high, "path": path, "form": form, "remote": remote}
    return dataclasses.field(default=default, metadata=meta)


# data.splits: "auto", or comma-separated role=name pairs naming the {name}_ims.npy files
SPLITS_FORM = (r"auto|(?:(?:train|val|test)=[\w.-]+)(?:,(?:train|val|test)=[\w.-]+)*",
               "auto, or comma-separated role=name pairs, role train, val or test (val=dev,test=test)")

_REG = {
    "task": "icr.train.tasks:TASKS",
    "dataset": "icr.data.datasets:DATASETS",
    "image": "icr.models.image:IMAGE_ENCODERS",
    "text": "icr.models.text:TEXT_ENCODERS",
    "pooling": "icr.models.pooling:POOLINGS",
    "loss": "icr.losses.contrastive:LOSSES",
    "decoder": "icr.models.decoders:DECODERS",
    "objective": "icr.objectives:OBJECTIVES",
    "analysis": "icr.analysis:ANALYSES",
    "grounding_model": "icr.grounding.model:GROUNDING_MODELS",
    "negatives": "icr.grounding.negatives:NEGATIVE_GENERATORS",
}


@dataclass(frozen=True)
class TaskConfig:
    name: str = _field("retrieval", "what is trained", registry=_REG["task"])


@dataclass(frozen=True)
class DataConfig:
    dataset: str = _field(
        "shapes",
        "shapes = embedded benchmark; karpathy = split JSON + images; precomp = SCAN/BUTD folder",
        registry=_REG["dataset"],
    )
    features: str = _field(
        "pixels", "image input: pixels (CNN) or regions (precomputed region features)",
        choices=("pixels", "regions"),
    )
    preset: str = _field("default", "embedded benchmark size (default-2048: the default with BUTD's "
                         "2048-d region features, for GPUs; large, xlarge: 4x, 12x the default's "
                         "training images)",
                         choices=("tiny", "small", "default", "default-2048", "large", "xlarge"))
    seed: int = _field(0, "embedded benchmark generation seed", low=0)
    root: str = _field("", "dataset folder; '' = <workspace>/data/shapes-<preset>-<seed>")
    karpathy_json: str = _field("", "Karpathy split JSON (dataset=karpathy)", path=())
    image_root: str = _field("", "image folder of the Karpathy JSON (dataset=karpathy)", path=())
    precomp_dir: str = _field("", "SCAN/BUTD folder with {split}_ims.npy ('' = the benchmark's "
                              "own), or its URI (s3://BUCKET/PREFIX), copied once per node",
                              path=(), remote=True)
    splits: str = _field(
        "auto", "precomp file splits per role: auto (train; dev, else val; testall, else test) or "
        "role=name pairs, e.g. val=dev,test=test", form=SPLITS_FORM)
    entities_dir: str = _field("", "Flickr30K Entities folder (Sentences/, Annotations/, "
                               "{split}.txt) for grounding on karpathy or precomp data", path=())
    cxc_val: str = _field("", "CxC sits CSV for validation ('' = the benchmark's own, if any)",
                          path=())
    cxc_test: str = _field("", "CxC sits CSV for test ('' = the benchmark's own, if any)", path=())
    cxc_min_score: float = _field(3.0, "CxC agg_score at or above which a pair is positive", low=0, high=5)
    relevance: str = _field(
        "auto", "nDCG relevance: auto (the matrix the dataset ships, else rouge), semantic, "
        "rouge, none, or a path to an .npy matrix", path=("auto", "semantic", "rouge", "none")
    )
    image_size: int = _field(64, "images are resized to this square size", low=16)
    device_budget_gb: float = _field(
        8.0, "image inputs, captions and targets are held on the training device when they take "
        "at most this many GB; beyond, in host memory (memory-mapped, gathered per batch)", low=0)


@dataclass(frozen=True)
class TextConfig:
    encoder: str = _field("gru", "caption encoder", registry=_REG["text"])
    glove: str = _field("glove-6b-50d", "word vectors: glove-6b-50d (bundled), a GloVe file, or none",
                        path=("glove-6b-50d", "none"))
    word_dim: int = _field(50, "word embedding size (must match the GloVe file)", low=1)
    hidden_dim: int = _field(512, "GRU units per direction; the token size of gru_tokens/bert", low=1)
    bidirectional: bool = _field(True, "GRU reads both directions (VSE++: false)")
    pooling: str = _field("max", "pooling of the token encoders (gru_tokens, bert)",
                          registry=_REG["pooling"])
    bert_path: str = _field("", "BERT-architecture model folder ('' = the bundled MiniLM)", path=())
    bert_lr_factor: float = _field(0.1, "the transformer's lr = optim.lr x this (VSE+2AD: 0.1)",
                                   low=0)
    bert_layers: int = _field(0, "tern: use the BERT's first N layers (0 = all; TERN: 6 of "
                              "BERT-base)", low=0)
    vocab_min_count: int = _field(1, "training-split count a word needs to enter the vocabulary", low=1)
    max_len: int = _field(40, "captions are cut to this many tokens", low=2)
    unk_prob: float = _field(0.1, "augmentation: probability a token becomes <unk>", low=0, high=1)
    delete_prob: float = _field(0.1, "augmentation: fraction of tokens deleted", low=0, high=1)


@dataclass(frozen=True)
class ImageConfig:
    encoder: str = _field(
        "small_cnn", "image encoder (region encoders need data.features=regions)",
        registry=_REG["image"],
    )
    hidden_dim: int = _field(512, "region encoders: MLP hidden size", low=1)
    pooling: str = _field("max", "pooling of the token encoders (region_tokens)",
                          registry=_REG["pooling"])
    gcn_layers: int = _field(4, "VSRN: graph reasoning layers over the regions", low=0)
    transformer_layers: int = _field(4, "tern: transformer layers over the regions (TERN: 4)",
                                     low=0)
    transformer_dim: int = _field(2048, "tern: width of the region transformer layers (TERN: "
                                  "2048, the BUTD feature size)", low=1)
    output_dim: int = _field(256, "small_cnn / regions: size of the image vector", low=1)
    pretrained: bool = _field(False, "load ImageNet weights from a local file or the torch cache")
    frozen: bool = _field(False, "keep the image backbone frozen for the whole run (VSE++: only "
                          "its projection trains; its features are then computed once)")
    weights_path: str = _field("", "local weights file for a pretrained backbone", path=())
    random_erasing: float = _field(0.2, "probability of random erasing on training images", low=0, high=1)


@dataclass(frozen=True)
class ModelConfig:
    embed_dim: int = _field(1024, "joint embedding size", low=1)
    head_hidden: int = _field(0, "hidden size of the projection heads; 0 = one linear layer", low=0)
    head_batchnorm: bool = _field(
        False, "BatchNorm1d after each projection head (the PCME/LTD triplet baseline; VSRN)"
    )
    shared_layers: int = _field(2, "tern: transformer layers on top of both encoders, one set of "
                                "weights for the image and caption streams (TERN: 2)", low=0)
    shared_dim: int = _field(1024, "tern: width of the shared layers; regions and wordpieces are "
                             "projected to it (TERN: 1024)", low=1)
    transformer_heads: int = _field(4, "tern: attention heads of every transformer layer (TERN: 4)",
                                    low=1)
    transformer_ff_dim: int = _field(2048, "tern: feed-forward size of every transformer layer "
                                     "(TERN: 2048)", low=1)
    transformer_dropout: float = _field(0.1, "tern: dropout in every transformer layer (TERN: 0.1)",
                                        low=0, high=1)


@dataclass(frozen=True)
class LossConfig:
    name: str = _field("infonce", "contrastive loss L_con", registry=_REG["loss"])
    tau: float = _field(0.05, "InfoNCE temperature (LTD paper Eq. 1)", low=1e-4, high=10)
    margin: float = _field(0.2, "triplet margin alpha", low=0, high=10)
    warmup_epochs: int = _field(0, "epochs trained with the loss's warm-up form first (triplet: "
                                "all negatives before the hardest; VSE-infinity's "
                                "vse_mean_warmup_epochs)", low=0)


@dataclass(frozen=True)
class DecoderConfig:
    name: str = _field("none", "reconstruction: none, ltd (latent target) or itd (input tokens)",
                       registry=_REG["decoder"])
    hidden_dim: int = _field(1024, "LTD MLP / ITD GRU hidden size", low=1)
    target_model: str = _field(
        "all-MiniLM-L6-v2", "sentence-transformers model for LTD targets: the bundled "
        "all-MiniLM-L6-v2 or a local folder",
        path=("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2")
    )
    word_dim: int = _field(300, "ITD decoder word embedding size", low=1)


@dataclass(frozen=True)
class ObjectiveConfig:
    name: str = _field("contrastive", "Eq. 1 / Eq. 7 (dual) / Eq. 9 (lagrangian)",
                       registry=_REG["objective"])
    beta: float = _field(1.0, "dual-loss weight of L_rec (Eq. 7)", low=0)
    eta: float = _field(0.15, "bound on L_rec of the constraint (Eq. 8)", low=1e-6)
    lambda_init: float = _field(1.0, "initial Lagrange multiplier", low=0)
    lambda_max: float = _field(100.0, "multiplier is projected into [0, lambda_max]", low=0)
    lambda_lr: float = _field(5e-3, "SGD ascent learning rate of the multiplier", low=0)
    lambda_momentum: float = _field(0.9, "SGD momentum of the multiplier", low=0, high=1)
    lambda_dampening: float = _field(0.9, "SGD dampening of the multiplier", low=0, high=1)


@dataclass(frozen=True)
class GroundingConfig:
    model: str = _field("word_region", "phrase grounding model", registry=_REG["grounding_model"])
    word_model: str = _field(
        "all-MiniLM-L6-v2", "frozen encoder of the caption words: the bundled MiniLM or a folder",
        path=("all-MiniLM-L6-v2",),
    )
    word_pooling: str = _field("pieces", "a word's features: its word pieces, or their mean",
                               choices=("pieces", "mean"))
    max_words: int = _field(6, "nouns and adjectives used per training caption", low=1)
    max_regions: int = _field(0, "regions per image (0 = all)", low=0)
    box_convention: str = _field(
        "infoground", "boxes in IoU and pointing: infoground (+1-pixel areas, centre strictly "
        "inside, as info-ground evaluates) or continuous", choices=("infoground", "continuous"),
    )
    key_dim: int = _field(384, "size of the word and region keys and values", low=1)
    negatives: str = _field("context", "negative captions of L_lang (none: L_img only)",
                            registry=_REG["negatives"])
    num_negatives: int = _field(25, "substitutes per masked noun kept for L_lang", low=1)
    mlm_candidates: int = _field(30, "the masked LM's proposals before re-ranking", low=1)
    mlm_path: str = _field("", "masked LM folder ('' = train a head on the training captions)",
                           path=())
    img_weight: float = _field(1.0, "weight of L_img", low=0)
    lang_weight: float = _field(1.0, "weight of L_lang", low=0)


@dataclass(frozen=True)
class OptimConfig:
    name: str = _field("adamw", "optimiser (adamp: the LTD reference's)",
                       choices=("adam", "adamw", "adamp"))
    lr: float = _field(2e-4, "learning rate of the warm-up phase", low=0)
    weight_decay: float = _field(0.0, "weight decay", low=0)
    grad_clip: float = _field(2.0, "max gradient norm; 0 = no clipping", low=0)
    finetune_lr_factor: float = _field(0.1, "fine-tune phase lr = lr x this", low=0)
    schedule: str = _field("cosine", "lr schedule: cosine in each phase (LTD) or step (x "
                           "step_gamma every step_epochs: VSE++, VSRN, VSE+2AD)",
                           choices=("cosine", "step"))
    step_epochs: int = _field(15, "step schedule: epochs between lr decays", low=1)
    step_gamma: float = _field(0.1, "step schedule: the lr is multiplied by this at each decay",
                               low=0, high=1)


@dataclass(frozen=True)
class TrainConfig:
    seed: int = _field(0, "seed of weights, sampling and augmentation", low=0)
    batch_size: int = _field(128, "pairs per batch (images per batch with train.sampler=images)",
                             low=2)
    sampler: str = _field("pairs", "batches of image-caption pairs, or of whole images with all "
                          "their captions (SmoothAP)", choices=("pairs", "images"))
    epoch_unit: str = _field("captions", "an epoch passes over every caption, or every image, once",
                             choices=("captions", "images"))
    live_cocos: bool = _field(False, "record the loss's COCOS counts in the trajectory (cheap)")
    warmup_epochs: int = _field(3, "epochs with the backbone and word embeddings frozen", low=0)
    finetune_epochs: int = _field(3, "epochs with everything trained at lr x finetune_lr_factor",
                                  low=0)
    swa: bool = _field(True, "average 5 snapshots of each epoch's last 10% (SWA)")
    swa_snapshots: int = _field(5, "snapshots averaged per epoch", low=1)
    swa_fraction: float = _field(0.1, "fraction of each epoch the snapshots span", low=0, high=1)
    swa_bn_batches: int = _field(20, "batches used to refresh BatchNorm statistics after SWA", low=1)
    amp: bool = _field(True, "mixed precision on CUDA (ignored on CPU): autocast in "
                       "train.amp_dtype")
    amp_dtype: str = _field("auto", "autocast type: auto (bfloat16 where the GPU supports it, "
                            "else float16 with loss scaling), bfloat16 or float16",
                            choices=("auto", "bfloat16", "float16"))
    deterministic: bool = _field(True, "CUDA: deterministic kernels, cuDNN autotuner off (same "
                                 "numbers on a rerun); false: cudnn.benchmark on (faster)")
    cuda_graphs: bool = _field(True, "CUDA: capture each training step as a CUDA graph (captions "
                               "padded to a few lengths); false: eager steps at exact shapes")
    device: str = _field("auto", "auto, cpu, cuda or cuda:N")
    trajectory_every: int = _field(10, "log lambda / L_rec / L_con every this many steps", low=1)
    max_steps_per_epoch: int = _field(0, "cut epochs short (debugging); 0 = full epochs", low=0)


@dataclass(frozen=True)
class EvalConfig:
    batch_size: int = _field(256, "encoding batch size at evaluation", low=1)
    test: bool = _field(True, "evaluate the best checkpoint on test once, at the end")
    analyses: str = _field(
        "", "analyses of the best checkpoint after training, comma-separated ('' = none)",
        registry=_REG["analysis"], many=True,
    )


@dataclass(frozen=True)
class ExperimentConfig:
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    text: TextConfig = dataclasses.field(default_factory=TextConfig)
    image: ImageConfig = dataclasses.field(default_factory=ImageConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    decoder: DecoderConfig = dataclasses.field(default_factory=DecoderConfig)
    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)
    grounding: GroundingConfig = dataclasses.field(default_factory=GroundingConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    @property
    def epochs(self) -> int:
        return self.train.warmup_epochs + self.train.finetune_epochs


# ---------------------------------------------------------------------------------------------
# The flat vocabulary


@dataclass(frozen=True)
class KeySpec:
    """What one dotted key accepts."""

    key: str
    type: type
    default: Scalar
    help: str
    fixed_choices: tuple[Scalar, ...] | None
    registry: str | None  # "module:NAME" of the registry whose names are the choices
    many: bool  # a comma-separated list of choices
    low: float | None
    high: float | None
    path: tuple[str, ...] | None  # a local file or folder, unless '' or one of these names
    form: tuple[str, str] | None = None  # (regular expression, how to say it) of a string
    remote: bool = False  # a path that may also be a URI, copied into each node's cache

    @property
    def choices(self) -> tuple[Scalar, ...] | None:
        """The allowed values (a registry's names are read when first asked for)."""
        if self.registry is not None:
            return tuple(resolve(self.registry).names())
        return self.fixed_choices

    def describe(self) -> str:
        if self.choices is not None:
            text = "one of " + ", ".join(map(str, self.choices))
            return f"a comma-separated list of {text[7:]} ('' = none)" if self.many else text
        if self.form is not None:
            return self.form[1]
        kind = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
        text = kind[self.type]
        if self.low is not None and self.high is not None:
            text += f" in [{_bound(self.low)}, {_bound(self.high)}]"
            if self.type is float and FLOAT32_MAX in (abs(self.low), abs(self.high)):
                text += " (float32)"
        return text


def _bound(value: float) -> str:
    """A bound as messages print it: float32's limit to 7 digits, which round inward (a value
    typed as printed is accepted); any other bound as given."""
    return f"{value:.7g}" if abs(value) == FLOAT32_MAX else str(value)


def _resolved_type(cls: type, name: str) -> type:
    hint = typing.get_type_hints(cls)[name]
    if isinstance(hint, types.UnionType):  # pragma: no cover - no optional fields today
        raise TypeError(f"{cls.__name__}.{name}: optional fields are not part of the vocabulary")
    return hint


def key_specs(cls: type = ExperimentConfig) -> dict[str, KeySpec]:
    """Every dotted key of the config tree with its type, default, help and domain."""
    specs: dict[str, KeySpec] = {}
    for section in dataclasses.fields(cls):
        section_cls = _resolved_type(cls, section.name)
        for f in dataclasses.fields(section_cls):
            key = f"{section.name}.{f.name}"
            meta = f.metadata
            kind = _resolved_type(section_cls, f.name)
            low, high = meta["low"], meta["high"]
            if kind in _HOLDS:  # never past what the number's tensor holds
                least, most = _HOLDS[kind]
                low = least if low is None else max(low, least)
                high = most if high is None else min(high, most)
            specs[key] = KeySpec(
                key, kind, f.default, meta["help"], meta["choices"], meta["registry"],
                meta["many"], low, high, meta["path"], meta["form"], meta["remote"],
            )
    return specs


_SPECS = key_specs()


def to_flat(config: ExperimentConfig) -> dict[str, Scalar]:
    """The config as ``{"section.field": value}``, every key present."""
    return {
        f"{section.name}.{f.name}": getattr(getattr(config, section.name), f.name)
        for section in dataclasses.fields(config)
        for f in dataclasses.fields(getattr(config, section.name))
    }


def from_flat(
    flat: Mapping[str, Any], base: ExperimentConfig | None = None
) -> ExperimentConfig:
    """Build a config from dotted keys, on top of ``base`` (defaults when ``None``).

    Values may be typed (from YAML or Ray) or strings (from the command line); both are parsed
    and validated. Raises ConfigError naming the first bad key and what it allows.
    """
    values = to_flat(base or ExperimentConfig())
    for key, raw in flat.items():
        values[key] = parse_value(key, raw)
    sections: dict[str, dict[str, Scalar]] = {}
    for key, value in values.items():
        section, name = key.split(".", 1)
        sections.setdefault(section, {})[name] = value
    hints = typing.get_type_hints(ExperimentConfig)
    return ExperimentConfig(**{s: hints[s](**kw) for s, kw in sections.items()})


def parse_value(key: str, raw: Any) -> Scalar:
    """Parse and validate one value for ``key``; raises ConfigError."""
    spec = _SPECS.get(key)
    if spec is None:
        close = difflib.get_close_matches(key, _SPECS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else "; see `python -m studies.run --keys`"
        raise ConfigError(f"unknown config key {key!r}{hint}")
    value = _coerce(spec, raw)
    choices = spec.choices
    if choices is not None:
        items = split_list(value) if spec.many else [value]
        if any(item not in choices for item in items):
            raise ConfigError(f"{key}={raw!r} is not allowed; {key} is {spec.describe()}")
        if spec.many:
            value = ",".join(items)
    if spec.form is not None and not re.fullmatch(spec.form[0], str(value)):
        raise ConfigError(f"{key}={raw!r} is invalid; {key} is {spec.describe()}")
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    too_low = numeric and spec.low is not None and value < spec.low
    too_high = numeric and spec.high is not None and value > spec.high
    if too_low or too_high:
        raise ConfigError(f"{key}={raw!r} is out of range; {key} is {spec.describe()}")
    return value


def _coerce(spec: KeySpec, raw: Any) -> Scalar:
    bad = ConfigError(f"{spec.key}={raw!r} is invalid; {spec.key} is {spec.describe()}")
    if spec.type is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "false", "1", "0", "yes", "no"):
            return raw.lower() in ("true", "1", "yes")
        raise bad
    if spec.type is int:
        if isinstance(raw, bool):
            raise bad
        if isinstance(raw, int):
            return raw
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        if isinstance(raw, str):
            try:
                return int(raw)
            except ValueError:
                raise bad from None
        raise bad
    if spec.type is float:
        if isinstance(raw, bool):
            raise bad
        try:
            value = float(raw)
        except (TypeError, ValueError):
            raise bad from None
        if value != value or value in (float("inf"), float("-inf")):
            raise bad
        return value
    if not isinstance(raw, str):
        raise bad
    return raw


def split_list(value: Scalar) -> list[str]:
    """The items of a comma-separated list value (``eval.analyses``); '' is the empty list."""
    return [item.strip() for item in str(value).split(",") if item.strip()]


def used_keys(config: ExperimentConfig) -> list[str]:
    """The dotted keys this configuration depends on, in vocabulary order.

    A key that some registered component reads (its builder takes it, or it is registered with
    ``reads=``) is used only when a chosen component reads it: ``loss.tau`` by ``loss.name=infonce``,
    not by ``triplet``; ``objective.eta`` only by ``objective.name=lagrangian``. A component may claim
    a whole section (``reads=("grounding.*",)``): the section is then used only when it is chosen.
    The choice keys themselves follow the same rule, so the chain task -> encoder -> pooling
    resolves to a fixed point. MLflow records exactly these keys; the report compares runs on them.
    """
    flat = to_flat(config)
    registries = {k: resolve(s.registry) for k, s in _SPECS.items() if s.registry}
    reads = {(k, n): set(r.reads(n)) for k, r in registries.items() for n in r.names()}
    owned = {key for keys in reads.values() for key in keys if not key.endswith(".*")}
    claimed = {key[:-2] for keys in reads.values() for key in keys if key.endswith(".*")}
    chosen: set[tuple[str, str]] = set()
    while True:
        wanted = set().union(*(reads[c] for c in chosen)) if chosen else set()
        sections = {k.split(".")[0] for k in _SPECS} - claimed | {
            key[:-2] for key in wanted if key.endswith(".*")
        }
        active = [k for k in _SPECS
                  if k.split(".")[0] in sections and (k not in owned or k in wanted)]
        now = {(k, n) for k in active if k in registries
               for n in (split_list(flat[k]) if _SPECS[k].many else [flat[k]])}
        if now == chosen:
            return active
        chosen = now


def used_values(config: ExperimentConfig, prefixes: tuple[str, ...]) -> dict[str, Scalar]:
    """The keys this configuration uses (:func:`used_keys`) that start with one of ``prefixes``,
    with their values: what an error raised inside a training step names
    (:func:`icr.errors.step_errors`)."""
    flat = to_flat(config)
    return {key: flat[key] for key in used_keys(config) if key.startswith(prefixes)}


def is_uri(value: object) -> bool:
    """``value`` names a location by URI (``s3://bucket/prefix``, ``file:///data``), not a path."""
    return "://" in str(value)


def local_paths(config: ExperimentConfig) -> dict[str, Path]:
    """The local files and folders the configuration uses: key -> path (a key left '' or
    naming a bundled asset is none, and so is a URI where the key takes one:
    :func:`remote_paths`)."""
    flat = to_flat(config)
    return {key: Path(str(flat[key])).expanduser() for key in used_keys(config)
            if _SPECS[key].path is not None and flat[key] != "" and flat[key] not in _SPECS[key].path
            and key not in remote_paths(config)}


def remote_paths(config: ExperimentConfig) -> dict[str, str]:
    """The URIs the configuration uses where a key takes one (``data.precomp_dir=s3://...``):
    key -> URI, each a folder every node copies into its cache (:mod:`icr.data.remote`)."""
    flat = to_flat(config)
    return {key: str(flat[key]) for key in used_keys(config)
            if _SPECS[key].remote and is_uri(flat[key])}


def check_paths(config: ExperimentConfig) -> None:
    """Every local file or folder the configuration uses exists; ConfigError naming the first
    key that names a missing one (checked on the driver, before anything starts)."""
    flat = to_flat(config)
    for key, path in local_paths(config).items():
        if not path.exists():
            named = f" or one of {', '.join(_SPECS[key].path)}" if _SPECS[key].path else ""
            raise ConfigError(f"{key}={flat[key]}: no such file or folder; give a local path{named}")


def parse_overrides(items: list[str]) -> dict[str, str]:
    """``["loss.tau=0.07", ...]`` -> ``{"loss.tau": "0.07"}``; raises ConfigError on bad syntax."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. loss.tau=0.07)")
        out[key.strip()] = value.strip()
    return out
