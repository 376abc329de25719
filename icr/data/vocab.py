"""Caption tokenisation, the word vocabulary, and caption augmentation.

The vocabulary is built from the training split only: the LTD reference builds it from all captions,
test ones included, which leaks test words into training (docs/reference-code.md, section 1).
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from icr.data.types import CaptionedImages
from icr.errors import ConfigError, DataError

logger = logging.getLogger(__name__)

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)  # ids 0, 1, 2, 3

# A token is a maximal run of letters and digits (any script); everything else separates tokens.
_TOKEN = re.compile(r"[^\W_]+")


def tokenize(text: str) -> list[str]:
    """Lower-case ``text`` and split it on every character that is not a letter or a digit.

    Punctuation is dropped and contractions split (``"A man's hat."`` -> ``["a", "man", "s",
    "hat"]``). This is simpler than the NLTK tokeniser of the reference code and needs no data
    files; GloVe 6B is lower-cased, so lower-casing loses nothing there.
    """
    return _TOKEN.findall(text.lower())


class Vocabulary:
    """A word <-> id map with ``<pad>`` = 0, ``<start>`` = 1, ``<end>`` = 2, ``<unk>`` = 3.

    Words follow the specials by decreasing training count, ties alphabetically, so the same
    captions always give the same ids.
    """

    def __init__(self, words: Sequence[str], min_count: int = 1) -> None:
        clash = set(words) & set(SPECIALS)
        if clash:
            raise ConfigError(f"vocabulary words {sorted(clash)} collide with the special tokens")
        self.itos: tuple[str, ...] = SPECIALS + tuple(words)
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(self.itos)}
        if len(self.stoi) != len(self.itos):
            raise ConfigError("vocabulary words must be unique")
        self.min_count = min_count

    @classmethod
    def build(cls, captions: Iterable[str], min_count: int = 1) -> Vocabulary:
        """Keep every token seen at least ``min_count`` times in ``captions``."""
        if min_count < 1:
            raise ConfigError(f"min_count must be >= 1, got {min_count}")
        counts = Counter(tok for caption in captions for tok in tokenize(caption))
        kept = sorted(
            (w for w, c in counts.items() if c >= min_count), key=lambda w: (-counts[w], w)
        )
        vocab = cls(kept, min_count)
        logger.info(
            "vocabulary: %d of %d distinct words seen >= %d times",
            len(kept),
            len(counts),
            min_count,
        )
        return vocab

    @classmethod
    def from_train(cls, split: CaptionedImages, min_count: int = 1) -> Vocabulary:
        """Build from a training split; any other split raises, to keep test words out."""
        if split.split != "train":
            raise ConfigError(
                f"the vocabulary is built from the training split only, got split {split.split!r}"
            )
        return cls.build(split.captions, min_count)

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, word: str) -> bool:
        return word in self.stoi

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def start_id(self) -> int:
        return 1

    @property
    def end_id(self) -> int:
        return 2

    @property
    def unk_id(self) -> int:
        return 3

    def encode(self, text: str, add_start_end: bool = True) -> list[int]:
        """Token ids of ``text``; unknown words map to ``<unk>``."""
        ids = [self.stoi.get(tok, 3) for tok in tokenize(text)]
        return [1, *ids, 2] if add_start_end else ids

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """The words of ``ids`` joined by spaces; ``<unk>`` is kept, other specials dropped."""
        words = (self.itos[int(i)] for i in ids)
        if skip_special:
            words = (w for w in words if w not in (PAD, START, END))
        return " ".join(words)

    def save(self, path: Path) -> None:
        """Write the vocabulary as JSON (``{"min_count": ..., "words": [...]}``, specials excluded)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"min_count": self.min_count, "words": list(self.itos[len(SPECIALS) :])}
        path.write_text(json.dumps(payload, ensure_ascii=False), encoding="utf-8")

    @classmethod
    def load(cls, path: Path) -> Vocabulary:
        try:
            payload = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls(payload["words"], payload.get("min_count", 1))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise DataError(f"cannot read vocabulary {path}: {err}") from err


def augment_caption(
    ids: Sequence[int],
    unk_id: int,
    rng: random.Random,
    p_unk: float = 0.1,
    p_drop: float = 0.1,
) -> list[int]:
    """Word dropout for training captions, as in PCME and the LTD reference.

    Each token is replaced by ``unk_id`` with probability ``p_unk``; then ``int(len(ids) * p_drop)``
    tokens, at positions drawn uniformly without replacement, are deleted (so a caption shorter than
    ten tokens loses none at the default 0.1).

    Args:
        ids: the caption's word ids, without ``<start>``/``<end>`` (add them afterwards).
        unk_id: the id of ``<unk>``.
        rng: the only source of randomness (seed it per worker).
        p_unk: probability of replacing a token by ``<unk>``.
        p_drop: fraction of tokens deleted.

    Returns:
        A new list; ``ids`` is not modified.
    """
    out = [unk_id if rng.random() < p_unk else i for i in ids]
    for _ in range(int(len(out) * p_drop)):
        out.pop(rng.randrange(len(out)))
    return out
