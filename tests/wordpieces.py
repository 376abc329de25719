"""Wordpiece inputs of a batch of captions, as the BERT encoders' tests build them by hand.

The platform's own captions reach a BERT encoder through :class:`icr.data.captions.WordpieceInput`
(one table per split); a test of an encoder alone needs a padded batch of a few captions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor


def bert_inputs(captions: Sequence[str], tokenizer: Any, max_len: int) -> dict[str, Tensor]:
    """Wordpiece ids of a batch of captions, ``[CLS] ... [SEP]``, right-padded.

    Returns ``input_ids`` (B, T) int64, ``attention_mask`` (B, T) bool and ``lengths`` (B,) int64,
    the number of real wordpieces including ``[CLS]`` and ``[SEP]``, at most ``max_len``.
    :class:`icr.models.tokens.BertTokenEncoder` takes ``(input_ids, lengths)``.
    """
    if tokenizer.padding_side != "right":
        raise ValueError("bert_inputs needs a right-padding tokenizer (see load_bert_tokenizer)")
    enc = tokenizer(
        list(captions), padding=True, truncation=True, max_length=max_len, return_tensors="pt"
    )
    mask = enc["attention_mask"].bool()  # (B, T)
    return {"input_ids": enc["input_ids"], "attention_mask": mask, "lengths": mask.sum(dim=1)}
