"""What a caption encoder reads: token ids from the training vocabulary, or wordpieces.

A caption encoder registers the input it reads (``TEXT_ENCODERS.register(..., input=...)``):
``vocab`` (word ids of the training split's vocabulary, ``<start>``/``<end>`` around them: the
GRU encoders) or ``wordpiece`` (the ids of the encoder's own tokenizer, ``[CLS]``/``[SEP]``
around them: BERT). Both give the clean ids of a caption and its augmented training ids, the
caption augmentation of PCME and the LTD reference (LTD paper Section 4.3): each word replaced
by the unknown token with ``unk_prob``, then ``int(n * delete_prob)`` of the caption's ``n``
words deleted; for wordpieces the same is done to the words before they are split. Id 0 is
padding in both.

Training reads whole splits at once: :meth:`VocabInput.table` / :meth:`WordpieceInput.table`
tokenise every caption of a split once into a :class:`CaptionTable`, and
:meth:`CaptionTable.augmented` augments all of them in a few tensor operations (the training
batches of an epoch are then slices, :mod:`icr.data.batches`). ``ids`` and ``augmented`` of one
caption are the same operations written out for a single caption: the reference the table is
tested against.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor

from icr.data.vocab import Vocabulary, augment_caption
from icr.errors import ConfigError
from icr.io import save_npy_atomic


class CaptionInput(Protocol):
    """Turns caption strings into the id sequences a caption encoder reads."""

    def ids(self, caption: str) -> torch.Tensor:
        """Clean ids (with the begin/end markers), int64."""

    def augmented(self, caption: str, rng: random.Random) -> torch.Tensor:
        """Training ids after word dropout, drawn from ``rng`` only."""

    @property
    def markers(self) -> tuple[int, int, int, int]:
        """``(begin, end, unk, max_pieces)`` of its tables."""

    def table(self, captions: list[str] | tuple[str, ...]) -> CaptionTable:
        """Every caption tokenised once, for clean and augmented ids of a whole split."""

    def key(self) -> str:
        """What the ids depend on besides the captions (for a cache of its tables)."""


@dataclass(frozen=True)
class CaptionTable:
    """The captions of a split as the units augmentation acts on: words made of pieces.

    A vocabulary id is a word of one piece; a wordpiece tokenizer splits a word into one or more
    pieces. Augmentation replaces or deletes whole words; the encoder reads pieces, at most
    ``max_pieces`` of them between the begin and end markers (what is beyond is cut after
    augmentation, as a tokenizer's truncation does).

    Attributes:
        pieces: ``(C, P)`` int64 piece ids, 0-padded, without the markers.
        piece_word: ``(C, P)`` int64, the word (0-based) of each piece; -1 at padding.
        num_words: ``(C,)`` int64, words per caption.
        begin, end, unk: the marker ids and the unknown token's id.
        max_pieces: pieces kept between the markers.
    """

    pieces: Tensor
    piece_word: Tensor
    num_words: Tensor
    begin: int
    end: int
    unk: int
    max_pieces: int

    def __len__(self) -> int:
        return len(self.num_words)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.pieces, self.piece_word,
                                                          self.num_words))

    def rows(self, index: Tensor) -> CaptionTable:
        """The captions ``index`` (``(n,)`` int64), as a table of their own."""
        return dataclasses.replace(self, pieces=self.pieces.index_select(0, index),
                                   piece_word=self.piece_word.index_select(0, index),
                                   num_words=self.num_words.index_select(0, index))

    def clean(self) -> tuple[Tensor, Tensor]:
        """Every caption's clean ids with its markers, right-padded with 0.

        Shapes: returns ``(C, T)`` int64 ids and ``(C,)`` int64 lengths (markers included).
        """
        keep = self.piece_word >= 0  # (C, P)
        return _wrap(self.pieces, keep.sum(1), self.begin, self.end, self.max_pieces)

    def augmented(
        self, generator: torch.Generator, unk_prob: float, delete_prob: float
    ) -> tuple[Tensor, Tensor]:
        """Every caption's training ids after word dropout, drawn from ``generator`` only.

        Shapes: returns ``(C, T)`` int64 ids and ``(C,)`` int64 lengths (markers included).
        """
        width = int(self.num_words.max()) if len(self) else 0
        shape = (len(self), width)
        u_unk = torch.rand(shape, generator=generator)  # (C, W)
        u_delete = torch.rand(shape, generator=generator)  # (C, W)
        pieces, count = word_dropout(self.pieces, self.piece_word, self.num_words, u_unk,
                                     u_delete, unk_id=self.unk, unk_prob=unk_prob,
                                     delete_prob=delete_prob)
        return _wrap(pieces, count, self.begin, self.end, self.max_pieces)


def save_table(path: Path, table: CaptionTable) -> None:
    """One ``.npy`` file (written atomically): ``[num_words | pieces | piece_word]`` per row."""
    array = torch.cat([table.num_words[:, None], table.pieces, table.piece_word], dim=1)
    save_npy_atomic(path, array.numpy())


def load_table(path: Path, begin: int, end: int, unk: int, max_pieces: int) -> CaptionTable:
    """A table saved by :func:`save_table`, memory-mapped (the trials of a machine share it)."""
    array = np.load(path, mmap_mode="r")  # (C, 1 + 2 P)
    width = (array.shape[1] - 1) // 2
    with warnings.catch_warnings():  # a read-only map: the table's tensors are never written
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        rows = torch.from_numpy(array)
    return CaptionTable(rows[:, 1 : 1 + width], rows[:, 1 + width :], rows[:, 0], begin, end,
                        unk, max_pieces)


def word_dropout(
    pieces: Tensor, piece_word: Tensor, num_words: Tensor, u_unk: Tensor, u_delete: Tensor, *,
    unk_id: int, unk_prob: float, delete_prob: float,
) -> tuple[Tensor, Tensor]:
    """:func:`~icr.data.vocab.augment_caption` on every caption at once, from given uniforms.

    A word becomes ``unk_id`` (one piece, whatever its length) where ``u_unk < unk_prob``; then
    the ``int(n * delete_prob)`` words of smallest ``u_delete`` are deleted (a uniformly drawn
    subset of that size). The kept pieces move to the front, in order.

    Shapes:
        pieces, piece_word ``(C, P)``; num_words ``(C,)``; u_unk, u_delete ``(C, W)`` with
        ``W >= max(num_words)``; returns ``(C, P)`` pieces (0-padded) and ``(C,)`` counts.
    """
    width = u_unk.shape[1]
    valid_word = torch.arange(width)[None, :] < num_words[:, None]  # (C, W)
    unk_word = (u_unk < unk_prob) & valid_word  # (C, W)
    # int(n * p) as Python computes it: the product in double precision, then floored
    deletions = torch.floor(num_words.double() * delete_prob).long()  # (C,)
    keys = u_delete.masked_fill(~valid_word, 2.0)  # (C, W): padding sorts last
    rank = keys.argsort(dim=1, stable=True).argsort(dim=1)  # (C, W)
    deleted = rank < deletions[:, None]  # (C, W)
    valid = piece_word >= 0  # (C, P)
    word = piece_word.clamp(min=0)  # (C, P)
    first = valid.clone()  # the first piece of its word
    first[:, 1:] &= piece_word[:, 1:] != piece_word[:, :-1]
    piece_unk = unk_word.gather(1, word) & valid  # (C, P)
    keep = valid & ~deleted.gather(1, word) & (~piece_unk | first)  # (C, P)
    ids = torch.where(piece_unk, torch.full_like(pieces, unk_id), pieces)  # (C, P)
    order = torch.sort((~keep).to(torch.uint8), dim=1, stable=True).indices  # kept first
    count = keep.sum(1)  # (C,)
    packed = ids.gather(1, order)  # (C, P)
    packed = packed.masked_fill(torch.arange(packed.shape[1])[None, :] >= count[:, None], 0)
    return packed, count


def _wrap(pieces: Tensor, count: Tensor, begin: int, end: int, max_pieces: int
          ) -> tuple[Tensor, Tensor]:
    """``begin``, the first ``min(count, max_pieces)`` pieces, ``end``; right-padded with 0.

    Shapes: pieces ``(C, P)`` (kept pieces first), count ``(C,)``; returns ``(C, T)``, ``(C,)``.
    """
    n = count.clamp(max=max_pieces)  # (C,)
    body_width = int(n.max()) if len(n) else 0
    body = pieces[:, :body_width]
    positions = torch.arange(body_width + 2)[None, :]  # (1, T)
    tokens = torch.cat([torch.full((len(n), 1), begin, dtype=torch.long), body,
                        torch.zeros(len(n), 1, dtype=torch.long)], dim=1)  # (C, T)
    tokens = tokens.masked_fill(positions > n[:, None], 0)
    tokens = torch.where(positions == (n + 1)[:, None], torch.full_like(tokens, end), tokens)
    return tokens, n + 2


def _table(words: list[list[list[int]]], begin: int, end: int, unk: int, max_pieces: int
           ) -> CaptionTable:
    """A :class:`CaptionTable` from each caption's words, each a list of piece ids."""
    num_words = np.array([len(w) for w in words], dtype=np.int64)
    lengths = [sum(len(p) for p in w) for w in words]
    width = max(lengths, default=0)
    pieces = np.zeros((len(words), width), dtype=np.int64)
    piece_word = np.full((len(words), width), -1, dtype=np.int64)
    for c, caption in enumerate(words):
        flat = [(i, p) for i, word in enumerate(caption) for p in word]
        if flat:
            piece_word[c, : len(flat)], pieces[c, : len(flat)] = zip(*flat, strict=True)
    return CaptionTable(torch.from_numpy(pieces), torch.from_numpy(piece_word),
                        torch.from_numpy(num_words), begin, end, unk, max_pieces)


class VocabInput:
    """Word ids of the training vocabulary between ``<start>`` and ``<end>``, cut to ``max_len``."""

    @property
    def markers(self) -> tuple[int, int, int, int]:
        """``(begin, end, unk, max_pieces)`` of its tables."""
        v = self.vocab
        return v.start_id, v.end_id, v.unk_id, self.max_len - 2

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

    def key(self) -> str:
        words = hashlib.sha256("\n".join(self.vocab.itos).encode()).hexdigest()[:16]
        return f"vocab-{words}-{self.max_len}"

    def table(self, captions: list[str] | tuple[str, ...]) -> CaptionTable:
        """Words cut to ``max_len - 2`` before augmentation, as :meth:`augmented` does."""
        words = [[[i] for i in self._words(c)] for c in captions]
        return _table(words, *self.markers)


class WordpieceInput:
    """The ids of a transformers tokenizer (``[CLS] ... [SEP]``), at most ``max_len`` of them."""

    @property
    def markers(self) -> tuple[int, int, int, int]:
        """``(begin, end, unk, max_pieces)`` of its tables."""
        tok = self.tokenizer
        return tok.cls_token_id, tok.sep_token_id, tok.unk_token_id, self.max_len - 2

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

    def key(self) -> str:
        tok = self.tokenizer
        vocab = sorted(tok.get_vocab().items())
        digest = hashlib.sha256(repr(vocab).encode()).hexdigest()[:16]
        return f"wordpiece-{type(tok).__name__}-{digest}-{self.max_len}"

    def table(self, captions: list[str] | tuple[str, ...]) -> CaptionTable:
        """Each whitespace word split into wordpieces on its own (a WordPiece tokenizer splits
        words independently of their neighbours; checked on the first captions)."""
        tok = self.tokenizer
        split = [c.split() for c in captions]
        distinct = sorted({w for words in split for w in words})
        encoded = tok(distinct, add_special_tokens=False)["input_ids"] if distinct else []
        pieces = dict(zip(distinct, encoded, strict=True))
        table = _table([[pieces[w] for w in words] for words in split], *self.markers)
        self._check(captions[:64], table)
        return table

    def _check(self, captions: list[str] | tuple[str, ...], table: CaptionTable) -> None:
        tokens, lengths = table.clean()
        for c, caption in enumerate(captions):
            if not torch.equal(tokens[c, : lengths[c]], self.ids(caption)):
                raise ConfigError(
                    f"the tokenizer of text.bert_path splits words depending on their neighbours "
                    f"(caption {caption!r}); use a WordPiece (BERT-architecture) tokenizer"
                )
