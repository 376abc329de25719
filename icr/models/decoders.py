"""Caption decoders used as reconstruction regularisers: latent target (LTD) and input tokens (ITD).

Both take the L2-normalised caption embedding; neither is used at evaluation time.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


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
