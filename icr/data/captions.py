"""What a caption encoder reads: token ids from the training vocabulary, or wordpieces.

A caption encoder registers the input it reads (``TEXT_ENCODERS.register(..., input=...)``):
``vocab`` (word ids of the training split's vocabulary, ``<start>``/``<end>`` around them: the
GRU encoders) or ``wordpiece`` (the ids of the encoder's own tokenizer, ``[CLS]``/``[SEP]``
around them: BERT). Both give the clean ids of a caption and its augmented training ids
(REFERENCE_NOTES section 1: each word replaced by the unknown token with ``unk_prob``, a fraction
``delete_prob`` of the words deleted; for wordpieces the same is done to the words before they
are split). Id 0 is padding in both.
"""

from __future__ import annotations

import random
from typing import Any, Protocol

import torch

from icr.data.vocab import Vocabulary, augment_caption


class CaptionInput(Protocol):
    """Turns caption strings into the id sequences a caption encoder reads."""

    def ids(self, caption: str) -> torch.Tensor:
        """Clean ids (with the begin/end markers), int64."""

    def augmented(self, caption: str, rng: random.Random) -> torch.Tensor:
        """Training ids after word dropout, drawn from ``rng`` only."""


class VocabInput:
    """Word ids of the training vocabulary between ``<start>`` and ``<end>``, cut to ``max_len``."""

    def __init__(self, vocab: Vocabulary, max_len: int, unk_prob: float, delete_prob: float) -> None:
        self.vocab, self.max_len = vocab, max_len
        self.unk_prob, self.delete_prob = unk_prob, delete_prob

    def _words(self, caption: str) -> list[int]:
        return self.vocab.encode(caption, add_start_end=False)[: self.max_len - 2]

    def _wrap(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([self.vocab.start_id, *ids, self.vocab.end_id], dtype=torch.long)

    def ids(self, caption: str) -> torch.Tensor:
        return self._wrap(self._words(caption))

    def augmented(self, caption: str, rng: random.Random) -> torch.Tensor:
        ids = augment_caption(self._words(caption), self.vocab.unk_id, rng, self.unk_prob,
                              self.delete_prob)
        return self._wrap(ids)


class WordpieceInput:
    """The ids of a transformers tokenizer (``[CLS] ... [SEP]``), at most ``max_len`` of them."""

    def __init__(self, tokenizer: Any, max_len: int, unk_prob: float, delete_prob: float) -> None:
        if tokenizer.pad_token_id != 0:
            raise ValueError(f"the tokenizer pads with id {tokenizer.pad_token_id}; 0 expected")
        self.tokenizer, self.max_len = tokenizer, max_len
        self.unk_prob, self.delete_prob = unk_prob, delete_prob

    def ids(self, caption: str) -> torch.Tensor:
        ids = self.tokenizer(caption, truncation=True, max_length=self.max_len)["input_ids"]
        return torch.tensor(ids, dtype=torch.long)

    def augmented(self, caption: str, rng: random.Random) -> torch.Tensor:
        words = augment_caption(caption.split(), self.tokenizer.unk_token, rng, self.unk_prob,
                                self.delete_prob)
        return self.ids(" ".join(words))
