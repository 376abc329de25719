"""Reconstruction losses of the caption decoders: latent target (LTD) and input tokens (ITD)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def cosine_reconstruction_loss(reconstruction: Tensor, target: Tensor, eps: float = 1e-8) -> Tensor:
    """Mean over the batch of the cosine distance ``1 - cos(reconstruction, target)``.

    Args:
        reconstruction: decoder outputs (unnormalised; the cosine normalises them).
        target: latent targets, e.g. sentence-transformers embeddings of the captions.
        eps: lower bound on the norms, so a zero vector gives cosine 0 instead of NaN.

    Shapes:
        reconstruction, target: ``(B, D_target)``; returns a scalar in ``[0, 2]``.

    References:
        Eq. 6 of the LTD paper (Bleeker et al.), averaged over the batch.
    """
    if reconstruction.shape != target.shape:
        raise ValueError(
            f"reconstruction {tuple(reconstruction.shape)} and target {tuple(target.shape)} differ"
        )
    target = target.to(reconstruction.dtype)
    cos = F.cosine_similarity(reconstruction, target, dim=-1, eps=eps)  # (B,)
    return (1.0 - cos).mean()


def token_nll_loss(logits: Tensor, tokens: Tensor, pad_index: int = 0) -> Tensor:
    """Negative log-likelihood of the caption tokens, summed over valid tokens, divided by ``B``.

    The log-softmax runs over the vocabulary axis; the LTD reference runs it over the time axis,
    which is a bug this function does not copy. Positions where ``tokens == pad_index`` are ignored.

    Args:
        logits: decoder scores, ``logits[b, t]`` predicting ``tokens[b, t]`` (teacher forcing).
        tokens: target token ids, padded with ``pad_index`` after the last valid token.
        pad_index: id of the padding token.

    Shapes:
        logits: ``(B, T, V)``; tokens: ``(B, T)`` int64; returns a scalar.

    References:
        Eq. 4 of the LTD paper (Bleeker et al.), summed over tokens and averaged over captions.
    """
    if logits.shape[:2] != tokens.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match tokens {tuple(tokens.shape)}")
    log_probs = F.log_softmax(logits, dim=-1)  # (B, T, V), over the vocabulary
    nll = F.nll_loss(
        log_probs.flatten(0, 1), tokens.flatten(), ignore_index=pad_index, reduction="sum"
    )
    return nll / tokens.shape[0]
