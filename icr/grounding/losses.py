"""The two contrastive losses of phrase grounding: ``L_img`` (Eq. 8) and ``L_lang`` (Eq. 9).

Both are pure functions of compatibility logits computed by a grounding model
(:mod:`icr.grounding.model`): ``L_img`` contrasts a word's own image with the other images of the
batch, ``L_lang`` contrasts the true noun of a caption with substitute nouns in the same context
(negative captions, :mod:`icr.grounding.negatives`), both against the caption's own image.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["image_infonce_loss", "language_infonce_loss"]


def image_infonce_loss(
    logits: Tensor,
    word_mask: Tensor,
    targets: Tensor | None = None,
    image_ids: Tensor | None = None,
) -> Tensor:
    """``L_img``: per word, InfoNCE over the batch's images, one direction (image retrieval).

    For word ``w`` of caption ``c`` the candidates are the caption's own image ``targets[c]`` and
    the batch's other images; the loss is ``-log softmax_i logits[c, i, w]`` at the own image. It is
    averaged over the caption's valid words, then over the captions that have at least one valid
    word. Images whose ``image_ids`` equal that of the own image (another copy of it in the batch)
    are left out of the denominator: they are not negatives.

    Differences from the info-ground reference code (docs/reference-code.md section 4): a caption with
    no valid word is left out of the batch mean (the reference counts it, shrinking the loss), and
    the per-caption mean over words replaces Eq. 8's sum, as in the reference.

    Args:
        logits: compatibility of every caption's words with every image
            (:meth:`~icr.grounding.model.WordRegionAttention.forward`).
        word_mask: which words are real (nouns and adjectives; padding is ``False``).
        targets: index of each caption's own image among the ``B_i`` images; ``None`` means
            caption ``c`` belongs to image ``c`` (needs ``B_c == B_i``).
        image_ids: dataset id of each of the batch's images, or ``None`` when all differ.

    Shapes:
        logits ``(B_c, B_i, W)``, word_mask ``(B_c, W)``, targets ``(B_c,)``, image_ids ``(B_i,)``;
        returns a scalar (zero, still attached to the graph, when no caption has a valid word).

    References:
        Eq. 8 of Gupta et al., "Contrastive Learning for Weakly Supervised Phrase Grounding",
        ECCV 2020; the InfoNCE bound of Eqs. 2-3 (van den Oord et al., 2018).
    """
    n_captions, n_images, _ = logits.shape
    device = logits.device
    if targets is None:
        if n_captions != n_images:
            raise ValueError(f"targets are needed when B_c={n_captions} != B_i={n_images}")
        targets = torch.arange(n_captions, device=device)  # (B_c,)
    targets = targets.to(device)
    if image_ids is None:
        keep = torch.ones(n_captions, n_images, dtype=torch.bool, device=device)  # (B_c, B_i)
    else:
        image_ids = image_ids.to(device)
        keep = image_ids[None, :] != image_ids[targets][:, None]  # (B_c, B_i) negatives
    keep[torch.arange(n_captions, device=device), targets] = True
    masked = _full_precision(logits).masked_fill(~keep[:, :, None], float("-inf"))  # (B_c, B_i, W)
    positive = masked.gather(1, targets.view(-1, 1, 1).expand(-1, 1, masked.shape[2]))[:, 0]
    per_word = torch.logsumexp(masked, dim=1) - positive  # (B_c, W) -log softmax at own image
    return _mean_over_valid_words(per_word, word_mask)


def _full_precision(x: Tensor) -> Tensor:
    """Half-precision logits (AMP) are promoted to float32 before the log-sum-exp."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _mean_over_valid_words(per_word: Tensor, word_mask: Tensor) -> Tensor:
    """Mean over each caption's valid words, then over captions with at least one valid word."""
    word_mask = word_mask.to(per_word.device)
    counts = word_mask.sum(dim=1)  # (B_c,)
    per_word = per_word.masked_fill(~word_mask, 0.0)  # (B_c, W)
    has_words = counts > 0  # (B_c,)
    per_caption = per_word.sum(dim=1) / counts.clamp(min=1)  # (B_c,)
    n_valid = has_words.sum()
    return (per_caption * has_words).sum() / n_valid.clamp(min=1)


def language_infonce_loss(
    logits: Tensor, valid: Tensor, candidate_mask: Tensor | None = None
) -> Tensor:
    """``L_lang``: softmax over the true noun and its substitutes, the true noun as the target.

    ``logits[b, 0]`` is the compatibility of caption ``b``'s image with the contextual feature of
    its masked noun in the true caption, ``logits[b, k]`` (``k >= 1``) with the feature of the
    ``k``-th substitute at that position in the negative caption. The loss is the cross-entropy
    with target 0, averaged over the captions that have a masked noun (``valid``).

    Args:
        logits: candidate compatibilities, true noun first
            (e.g. :meth:`~icr.grounding.model.WordRegionAttention.paired` on the candidates'
            features against the caption's own image).
        valid: which captions have a masked noun; the others do not count.
        candidate_mask: which candidates exist (a caption can have fewer than ``K`` substitutes
            when the noun vocabulary is small); ``None`` means all. Column 0 is always taken.

    Shapes:
        logits ``(B, 1 + K)``, valid ``(B,)`` bool, candidate_mask ``(B, 1 + K)`` bool; returns a
        scalar (zero, still attached to the graph, when no caption is valid).

    References:
        Eq. 9 of Gupta et al., ECCV 2020.
    """
    valid = valid.to(logits.device)
    rows = _full_precision(logits)[valid]  # (B_valid, 1 + K): invalid rows never enter the graph
    if candidate_mask is not None:
        absent = ~candidate_mask.to(logits.device)[valid]  # (B_valid, 1 + K)
        absent[:, 0] = False  # the true noun is always a candidate
        rows = rows.masked_fill(absent, float("-inf"))
    if rows.shape[0] == 0:
        return logits.sum() * 0.0
    return (torch.logsumexp(rows, dim=1) - rows[:, 0]).mean()
