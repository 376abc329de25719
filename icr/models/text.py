"""Caption encoders: token ids -> one vector per caption."""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from icr.config import TextConfig
from icr.errors import ConfigError
from icr.models.recurrent import StaticShapes, run_gru
from icr.registry import Registry

logger = logging.getLogger(__name__)

__all__ = ["GRUCaptionEncoder", "TEXT_ENCODERS"]

# Builders take the text.* fields they use and the context: vocab_size, word_vectors (GloVe rows
# aligned with the vocabulary, or None).
TEXT_ENCODERS: Registry = Registry("caption encoder", section=TextConfig, package="icr.models")

_MERGES = ("concat", "mean")


class GRUCaptionEncoder(nn.Module, StaticShapes):
    """Word embeddings and a (bi-)GRU; the caption vector is the GRU's final hidden state.

    The summary is the last layer's ``h_n`` of a GRU run over the real tokens only, so padding is
    never read: the forward direction's state after the last valid token and the backward
    direction's state after reading back to the first token. The GRU runs over a packed sequence,
    or at the batch's static shape with the lengths on the device
    (:mod:`icr.models.recurrent`): the same states. The two are concatenated (``merge="concat"``,
    ``output_dim = 2 * hidden_dim``, the 1024-d caption feature of the PCME / LTD baseline) or
    averaged (``merge="mean"``, ``output_dim = hidden_dim``, as in VSE-infinity).

    This deliberately differs from the PCME / LTD reference (docs/reference-code.md section 1), which
    takes the GRU *output* at the last valid token: there the backward direction has read one token.

    Args:
        vocab_size: number of token ids; id 0 is padding.
        embed_dim: word embedding size (300 for GloVe 840B; 50 for the offline GloVe 6B 50d).
        hidden_dim: GRU units per direction.
        num_layers: stacked GRU layers.
        bidirectional: run a backward direction too.
        pretrained_embeddings: optional (vocab_size, embed_dim) tensor to initialise the embeddings
            (e.g. GloVe vectors aligned with the vocabulary); copied, not shared.
        dropout: dropout on the word embeddings and, when ``num_layers > 1``, between GRU layers.
        merge: how the two directions are combined, ``"concat"`` or ``"mean"``.

    Shapes:
        tokens (B, T) int64 padded with 0, lengths (B,) with 1 <= length <= T -> (B, output_dim).
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int = 300,
        hidden_dim: int = 512,
        num_layers: int = 1,
        bidirectional: bool = True,
        pretrained_embeddings: Tensor | None = None,
        dropout: float = 0.0,
        merge: str = "concat",
    ) -> None:
        super().__init__()
        if merge not in _MERGES:
            raise ConfigError(f"text merge {merge!r} is unknown; valid: {', '.join(_MERGES)}")
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        if pretrained_embeddings is not None:
            if tuple(pretrained_embeddings.shape) != (vocab_size, embed_dim):
                raise ConfigError(
                    f"pretrained embeddings have shape {tuple(pretrained_embeddings.shape)}, "
                    f"expected (vocab_size, embed_dim) = ({vocab_size}, {embed_dim}); "
                    "set text.word_dim to the vectors' size"
                )
            with torch.no_grad():
                self.embed.weight.copy_(pretrained_embeddings)
        self.dropout = nn.Dropout(dropout)
        self.gru = nn.GRU(
            embed_dim,
            hidden_dim,
            num_layers=num_layers,
            batch_first=True,
            bidirectional=bidirectional,
            dropout=dropout if num_layers > 1 else 0.0,
        )
        self.num_layers = num_layers
        self.num_directions = 2 if bidirectional else 1
        self.hidden_dim = hidden_dim
        self.merge = merge
        self.output_dim = hidden_dim * (self.num_directions if merge == "concat" else 1)

    def forward(self, tokens: Tensor, lengths: Tensor) -> Tensor:
        batch = tokens.shape[0]
        emb = self.dropout(self.embed(tokens))  # (B, T, E)
        # (dirs, B, H): forward after the last token, backward after the first
        _, final = run_gru(self.gru, emb, lengths, static=self.static_shapes)
        if self.merge == "mean":
            return final.mean(dim=0)  # (B, H)
        return final.transpose(0, 1).reshape(batch, -1)  # (B, dirs * H)

    def set_embeddings_trainable(self, flag: bool) -> None:
        """Freeze (``False``) or unfreeze (``True``) the word embeddings."""
        self.embed.weight.requires_grad_(flag)


@TEXT_ENCODERS.register("gru", reads=("text.glove", "text.vocab_min_count"), input="vocab")
def gru(
    *, word_dim: int, hidden_dim: int, bidirectional: bool, vocab_size: int,
    word_vectors: Tensor | None = None,
) -> GRUCaptionEncoder:
    """Word embeddings (GloVe-initialised unless ``text.glove=none``) and a GRU's final state:
    the bi-GRU of the PCME / LTD baseline, or with ``text.bidirectional=false`` the VSE++ GRU."""
    return GRUCaptionEncoder(vocab_size, embed_dim=word_dim, hidden_dim=hidden_dim,
                             bidirectional=bidirectional, pretrained_embeddings=word_vectors)
