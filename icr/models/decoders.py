"""Caption decoders used as reconstruction regularisers: latent target (LTD) and input tokens (ITD).

Both take the L2-normalised caption embedding; neither is used at evaluation time.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from icr.config import DecoderConfig
from icr.losses.reconstruction import cosine_reconstruction_loss, token_nll_loss
from icr.registry import Registry

# Builders take the decoder.* fields they use and the context (embed_dim, vocab_size, target_dim).
DECODERS: Registry = Registry("decoder", section=DecoderConfig, package="icr.models")


class LatentTargetDecoder(nn.Module):
    """Feed-forward decoder from a caption embedding to a latent target (a sentence embedding).

    ``Linear(in, hidden) -> ReLU -> Linear(hidden, hidden) -> ReLU -> Linear(hidden, target)``;
    train it with :func:`icr.losses.cosine_reconstruction_loss`. Linear layers keep their biases,
    as in the reference code (Eq. 5 writes them without).

    Args:
        in_dim: caption embedding size (1024 in the paper).
        hidden_dim: hidden width (1024 in the paper).
        target_dim: latent target size (384 for all-MiniLM-L6-v2, 768 for all-mpnet-base-v2).

    Shapes:
        forward: ``(B, in_dim) -> (B, target_dim)``.

    References:
        Eq. 5 of the LTD paper (Bleeker et al.), section 3.4.1.
    """

    def __init__(self, in_dim: int, hidden_dim: int, target_dim: int) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, hidden_dim),
            nn.ReLU(),
            nn.Linear(hidden_dim, target_dim),
        )

    def forward(self, caption_emb: Tensor) -> Tensor:
        return self.net(caption_emb)  # (B, target_dim)

    def loss(self, caption_emb: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
        """L_rec of Eq. 6: cosine distance of the reconstruction to the batch's latent targets."""
        recon = self(caption_emb)  # (B, D_target)
        return cosine_reconstruction_loss(recon.float(), batch["targets"].to(recon.device))


class InputTargetDecoder(nn.Module):
    """GRU language model conditioned on a caption embedding, reconstructing the caption's tokens.

    Its own word embeddings (trained from scratch) feed a single-layer GRU whose initial hidden
    state is the caption embedding (through a linear projection when ``in_dim != hidden_dim``).
    With teacher forcing, step ``t`` reads token ``t - 1`` (a learned start vector at ``t = 0``)
    and scores token ``t``, so ``logits[:, t]`` predicts ``tokens[:, t]`` and the output lines up
    with :func:`icr.losses.token_nll_loss`. Padding must follow the valid tokens; outputs at padded
    positions are computed but ignored by the loss.

    Args:
        vocab_size: number of token ids.
        embed_dim: word embedding size (300).
        hidden_dim: GRU state size (1024).
        in_dim: caption embedding size; ``None`` means ``hidden_dim`` (no projection).
        pad_index: padding token id (its embedding stays zero).

    Shapes:
        forward: caption_emb ``(B, in_dim)``, tokens ``(B, T)`` -> logits ``(B, T, vocab_size)``.

    References:
        Eq. 4 and section 4.2 ("Input decoding network") of the LTD paper (Bleeker et al.).
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int = 300,
        hidden_dim: int = 1024,
        in_dim: int | None = None,
        pad_index: int = 0,
    ) -> None:
        super().__init__()
        in_dim = hidden_dim if in_dim is None else in_dim
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_index)
        self.start = nn.Parameter(torch.zeros(embed_dim))
        self.init_hidden = nn.Identity() if in_dim == hidden_dim else nn.Linear(in_dim, hidden_dim)
        self.gru = nn.GRU(embed_dim, hidden_dim, num_layers=1, batch_first=True)
        self.out = nn.Linear(hidden_dim, vocab_size)

    def forward(self, caption_emb: Tensor, tokens: Tensor) -> Tensor:
        batch = tokens.shape[0]
        previous = self.embed(tokens[:, :-1])  # (B, T-1, E)
        start = self.start.expand(batch, 1, -1)  # (B, 1, E)
        inputs = torch.cat([start, previous], dim=1)  # (B, T, E), shifted right
        h0 = self.init_hidden(caption_emb).unsqueeze(0)  # (1, B, H)
        states, _ = self.gru(inputs, h0.contiguous())  # (B, T, H)
        return self.out(states)  # (B, T, V)

    def loss(self, caption_emb: Tensor, batch: Mapping[str, Tensor]) -> Tensor:
        """L_rec of Eq. 4: NLL of the clean caption's tokens after ``<start>`` (padding ignored)."""
        tokens = batch["clean_tokens"][:, 1:].to(caption_emb.device)  # (B, T-1)
        logits = self(caption_emb, tokens)  # (B, T-1, V)
        return token_nll_loss(logits.float(), tokens, pad_index=self.embed.padding_idx)


@DECODERS.register("none")
def no_decoder(**context: object) -> None:
    """No reconstruction: the contrastive baseline."""
    return None


@DECODERS.register("ltd", reads=("decoder.target_model",))
def latent_target_decoder(
    *, hidden_dim: int, embed_dim: int, target_dim: int | None, **context: object
) -> LatentTargetDecoder:
    """LTD (Eq. 5): caption embedding -> latent target (``decoder.target_model`` gives the targets)."""
    if target_dim is None:
        raise ValueError("the LTD decoder needs the latent targets' dimension")
    return LatentTargetDecoder(embed_dim, hidden_dim, target_dim)


@DECODERS.register("itd")
def input_target_decoder(
    *, hidden_dim: int, word_dim: int, embed_dim: int, vocab_size: int, **context: object
) -> InputTargetDecoder:
    """ITD (Eq. 4): a GRU language model over the caption's tokens."""
    return InputTargetDecoder(vocab_size, embed_dim=word_dim, hidden_dim=hidden_dim, in_dim=embed_dim)
