"""Negative captions for ``L_lang``: one noun of a caption replaced by substitutes.

Every generator masks the same noun of a caption (drawn with the seed, the same for identical
captions) and proposes substitute words for it (Gupta et al., ECCV 2020, Sec. 2.4). Generators are
registered by name in :data:`NEGATIVE_GENERATORS`:

- ``context`` (the paper's context-preserving negatives): a masked LM (:mod:`icr.grounding.mlm`)
  gives its ``mlm_candidates`` (30) most likely nouns ``s'`` of the noun vocabulary at the masked
  word, ``p(s'|c)``; they are re-ranked by ``p(s'|c) / (q(s'|s, c) + 1e-6)``, where ``q`` is the
  LM's probability at the *unmasked* word, which demotes synonyms and hypernyms of the true noun
  (the LM finds them likely even when it sees the true word); the first ``num_negatives`` (25) are
  kept. The true noun itself is never a substitute (the reference relies on the re-ranking alone).
  When the vocabulary has fewer nouns, there are fewer candidates and substitutes: all there are.
- ``random`` (the paper's baseline, Table 2): ``num_negatives`` nouns drawn uniformly without
  replacement from the noun vocabulary, the true noun excluded.
- ``none``: no substitutes, so nothing for ``L_lang`` to contrast: ``L_img`` only. It runs like
  any other generator; the grounding task leaves ``L_lang`` out when no caption has a substitute
  (:attr:`NegativeCaptions.has_substitutes`).

The noun vocabulary is the set of nouns of the training captions, normalised
(:func:`~icr.grounding.mlm.normalise_word`). Negatives are computed once per dataset and cached
(:func:`negative_captions`, a JSON file written atomically). For ``L_lang`` the grounding model needs
the contextual feature of every substitute in its negative caption: :func:`candidate_features`
computes them with the frozen word encoder once and caches them as float16.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from icr.config import GroundingConfig
from icr.data.targets import model_identity
from icr.errors import DataError
from icr.grounding import mlm
from icr.grounding.mlm import MaskedNounModel, normalise_word, replace_word
from icr.grounding.words import DEFAULT_WORD_MODEL, WordEncoder, select_split_words
from icr.io import save_npy_atomic, write_text_atomic
from icr.registry import Registry

logger = logging.getLogger(__name__)

__all__ = [
    "NEGATIVE_GENERATORS",
    "CandidateFeatures",
    "NegativeCaptions",
    "candidate_features",
    "choose_nouns",
    "context_substitutes",
    "negative_captions",
    "noun_positions",
    "noun_vocabulary",
    "random_substitutes",
    "rerank",
]

NEGATIVES_VERSION = 1  # bump when cached negatives change meaning
FEATURES_VERSION = 1

# A generator's options that are ``grounding.*`` fields come from the config section
# (``num_negatives``, ``mlm_candidates``); the rest it names of what :func:`negative_captions`
# offers (``masked_lm``, ``seed``, ``show_progress``).
NEGATIVE_GENERATORS: Registry[Callable[..., list[tuple[str, ...]]]] = Registry(
    "negative generator", section=GroundingConfig, package="icr.grounding"
)


@dataclass(frozen=True)
class NegativeCaptions:
    """The negative captions of every caption of a split.

    Attributes:
        word_index: per caption, the index of the masked noun among its whitespace tokens, -1 when
            the caption has no noun.
        true_words: per caption, the masked noun (normalised), ``""`` when there is none.
        substitutes: per caption, the substitute words, best first (empty when there is no noun).
        generator: the generator's name.
    """

    word_index: np.ndarray
    true_words: tuple[str, ...]
    substitutes: tuple[tuple[str, ...], ...]
    generator: str

    def __len__(self) -> int:
        return len(self.true_words)

    @property
    def has_substitutes(self) -> bool:
        """Some caption has a substitute: there is something for ``L_lang`` to contrast (the
        ``none`` generator proposes nothing, so a run with it trains ``L_img`` only)."""
        return any(self.substitutes)

    def negative_tokens(self, tokens: Sequence[str], caption: int, k: int) -> list[str]:
        """Caption ``caption``'s tokens with its noun replaced by substitute ``k``."""
        return replace_word(tokens, int(self.word_index[caption]), self.substitutes[caption][k])

    def to_json(self) -> str:
        return json.dumps({
            "generator": self.generator,
            "captions": [[int(i), w, list(s)] for i, w, s in
                         zip(self.word_index, self.true_words, self.substitutes, strict=True)],
        })

    @classmethod
    def from_json(cls, text: str) -> NegativeCaptions:
        data = json.loads(text)
        rows = data["captions"]
        return cls(np.array([r[0] for r in rows], dtype=np.int64).reshape(-1),
                   tuple(r[1] for r in rows), tuple(tuple(r[2]) for r in rows),
                   data["generator"])


# -------------------------------------------------------------------------------- the nouns


def noun_positions(captions: Sequence[str]) -> list[list[int]]:
    """Per caption, the whitespace-token indices of its nouns (TextBlob tags, as the word
    selection of :mod:`icr.grounding.words`, without its cap of six words)."""
    words = select_split_words(captions, max_words=None)
    return [[int(i) for j, i in enumerate(row) if i >= 0 and words.is_noun(c, j)]
            for c, row in enumerate(words.word_index)]


def noun_vocabulary(token_lists: Sequence[Sequence[str]],
                    positions: Sequence[Sequence[int]]) -> tuple[str, ...]:
    """The sorted, normalised nouns at ``positions`` (the training captions' nouns)."""
    words = {normalise_word(tokens[p]) for tokens, pos in zip(token_lists, positions, strict=True)
             for p in pos}
    return tuple(sorted(w for w in words if w))


def choose_nouns(token_lists: Sequence[Sequence[str]], positions: Sequence[Sequence[int]],
                 seed: int) -> np.ndarray:
    """The masked noun of each caption, drawn uniformly from its nouns (Sec. 2.4: "we randomly
    select s from the noun words"); -1 when there is none.

    The draw depends on ``seed`` and the caption's text only, so identical captions mask the
    same noun (and share their negatives).
    """
    chosen = np.full(len(token_lists), -1, dtype=np.int64)  # (C,)
    for c, (tokens, pos) in enumerate(zip(token_lists, positions, strict=True)):
        if pos:
            text = hashlib.sha256(" ".join(tokens).encode("utf-8")).digest()
            rng = np.random.default_rng([seed, int.from_bytes(text[:8], "little")])
            chosen[c] = pos[int(rng.integers(len(pos)))]
    return chosen


# ---------------------------------------------------------------------------- generators


def rerank(masked: torch.Tensor, unmasked: torch.Tensor, exclude: torch.Tensor,
           num_candidates: int, num_negatives: int) -> torch.Tensor:
    """Indices of the kept substitutes: the top ``num_candidates`` by ``p(s'|c)``, re-ranked by
    ``p(s'|c) / (q(s'|s, c) + 1e-6)``, the first ``num_negatives`` (Sec. 2.4 of the paper).

    Args:
        masked: ``p(s'|c)``, the LM's probabilities at the masked word.
        unmasked: ``q(s'|s, c)``, at the unmasked word.
        exclude: the nouns that can never be substitutes (the true noun).
        num_candidates, num_negatives: 30 and 25 in the paper; capped by the vocabulary.

    Shapes:
        masked, unmasked ``(N, V)``, exclude ``(N, V)`` bool -> ``(N, min(num_negatives,
        num_candidates, V - 1))``; columns are best first.
    """
    vocab = masked.shape[1]
    n_candidates = min(num_candidates, vocab - 1)
    n_keep = min(num_negatives, n_candidates)
    p = masked.masked_fill(exclude, -1.0)  # the true noun sorts last, never kept
    candidates = p.topk(n_candidates, dim=1).indices  # (N, n_candidates)
    score = masked.gather(1, candidates) / (unmasked.gather(1, candidates) + 1e-6)
    order = score.topk(n_keep, dim=1).indices  # (N, n_keep)
    return candidates.gather(1, order)


@NEGATIVE_GENERATORS.register("context", reads=("grounding.mlm_path",))
def context_substitutes(
    token_lists: Sequence[Sequence[str]],
    word_index: np.ndarray,
    nouns: Sequence[str],
    *,
    masked_lm: Callable[[], MaskedNounModel],
    num_negatives: int = 25,
    mlm_candidates: int = 30,
    batch_size: int = 128,
    show_progress: bool = True,
) -> list[tuple[str, ...]]:
    """Context-preserving substitutes (module docstring) for the noun ``word_index[c]`` of each
    caption; ``masked_lm`` is called once to get the LM (so a cache hit never loads it)."""
    rows = [c for c in range(len(token_lists)) if word_index[c] >= 0]
    if not rows:
        return [()] * len(token_lists)
    model = masked_lm()
    tokens = [token_lists[c] for c in rows]
    positions = [int(word_index[c]) for c in rows]
    p = model.probabilities(tokens, positions, masked=True, batch_size=batch_size,
                            show_progress=show_progress)  # (N, V)
    q = model.probabilities(tokens, positions, masked=False, batch_size=batch_size,
                            show_progress=show_progress)  # (N, V)
    column = {noun: v for v, noun in enumerate(model.nouns)}
    exclude = torch.zeros_like(p, dtype=torch.bool)  # (N, V)
    for n, (t, pos) in enumerate(zip(tokens, positions, strict=True)):
        if normalise_word(t[pos]) in column:
            exclude[n, column[normalise_word(t[pos])]] = True
    kept = rerank(p, q, exclude, mlm_candidates, num_negatives).tolist()
    out: list[tuple[str, ...]] = [()] * len(token_lists)
    for n, c in enumerate(rows):
        out[c] = tuple(model.nouns[v] for v in kept[n])
    return out


@NEGATIVE_GENERATORS.register("random")
def random_substitutes(
    token_lists: Sequence[Sequence[str]],
    word_index: np.ndarray,
    nouns: Sequence[str],
    *,
    num_negatives: int = 25,
    seed: int = 0,
) -> list[tuple[str, ...]]:
    """Nouns drawn uniformly without replacement from the vocabulary, the true noun excluded."""
    rng = np.random.default_rng(seed)
    out: list[tuple[str, ...]] = []
    for tokens, index in zip(token_lists, word_index, strict=True):
        if index < 0:
            out.append(())
            continue
        pool = [n for n in nouns if n != normalise_word(tokens[int(index)])]
        picks = rng.choice(len(pool), size=min(num_negatives, len(pool)), replace=False)
        out.append(tuple(pool[int(i)] for i in picks))
    return out


@NEGATIVE_GENERATORS.register("none")
def no_substitutes(token_lists: Sequence[Sequence[str]], word_index: np.ndarray,
                   nouns: Sequence[str]) -> list[tuple[str, ...]]:
    """No negative captions: ``L_lang`` is off and only ``L_img`` trains (Table 2, first rows)."""
    return [()] * len(token_lists)


# ------------------------------------------------------------------------------ the cache


def _digest(header: dict[str, Any], rows: Sequence[str]) -> str:
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    for row in rows:
        digest.update(b"\0" + row.encode("utf-8"))
    digest.update(f"|{len(rows)}".encode())
    return digest.hexdigest()


def negative_captions(
    section: GroundingConfig,
    captions: Sequence[str],
    positions: Sequence[Sequence[int]],
    cache_dir: str | Path | None,
    *,
    seed: int = 0,
    mlm_epochs: int = 10,
    mlm_lr: float = 1e-3,
    device: str | None = None,
    show_progress: bool = True,
    encoder: WordEncoder | None = None,
) -> NegativeCaptions:
    """The negative captions of ``captions`` from the generator ``section.negatives``, computed
    once and cached.

    The generator takes its options from ``section`` (``grounding.num_negatives``, and for
    ``context`` ``grounding.mlm_candidates``: :data:`NEGATIVE_GENERATORS` reads them), and what it
    names of the masked LM (built from ``grounding.mlm_path`` or a head trained here on the
    captions over ``grounding.word_model``), the seed and the progress flag; the cache key holds
    exactly what it takes.

    Args:
        section: the grounding config (``icr.config.GroundingConfig``).
        captions: the captions (whitespace-tokenised text); their nouns are the vocabulary of
            substitutes and the masked-LM head's training data.
        positions: per caption, the token indices of its nouns (:func:`noun_positions`).
        cache_dir: folder of the cache; ``None`` computes without caching.
        seed: which noun is masked; the random generator's draws; the masked-LM head's training.
        mlm_epochs, mlm_lr: the head's training (:func:`~icr.grounding.mlm.train_noun_head`).
        device: ``cuda``, ``cpu``, ...; ``None`` picks CUDA when available.
        show_progress: tqdm bars.
        encoder: an already loaded word encoder for the head.
    """
    generator, mlm_source = section.negatives, section.mlm_path or mlm.HEAD_SOURCE
    token_lists = [c.split() for c in captions]
    nouns = noun_vocabulary(token_lists, positions)
    if len(nouns) < 2:
        raise DataError(f"negative captions need at least 2 nouns in the vocabulary, found "
                        f"{len(nouns)}: {list(nouns)}; check the captions and their tags")
    word_index = choose_nouns(token_lists, positions, seed)

    def load_lm() -> MaskedNounModel:
        # the head learns to predict the nouns that the negatives mask
        return mlm.load_masked_noun_model(
            mlm_source, nouns, token_lists, word_index, cache_dir, word_model=section.word_model,
            epochs=mlm_epochs, lr=mlm_lr, seed=seed, device=device,
            show_progress=show_progress, encoder=encoder)

    kwargs = NEGATIVE_GENERATORS.arguments(generator, section, masked_lm=load_lm, seed=seed,
                                           show_progress=show_progress)
    header = {k: v for k, v in kwargs.items() if k not in ("masked_lm", "show_progress")}
    header.update(generator=generator, nouns=list(nouns), seed=seed, version=NEGATIVES_VERSION)
    if "masked_lm" in kwargs:
        header.update(_lm_header(mlm_source, section.word_model, encoder, mlm_epochs, mlm_lr,
                                 token_lists, positions))
    rows = [f"{c}\1{list(p)}" for c, p in zip(captions, positions, strict=True)]
    path = _negatives_path(cache_dir, generator, _digest(header, rows))
    if path is not None and path.is_file():
        cached = NegativeCaptions.from_json(path.read_text(encoding="utf-8"))
        if len(cached) == len(captions):
            logger.info("negative captions: cache hit %s", path)
            return cached
    substitutes = NEGATIVE_GENERATORS.get(generator)(token_lists, word_index, nouns, **kwargs)
    true_words = tuple(normalise_word(t[i]) if i >= 0 else "" for t, i in
                       zip(token_lists, word_index, strict=True))
    result = NegativeCaptions(word_index, true_words, tuple(substitutes), generator)
    if path is not None:
        write_text_atomic(path, result.to_json())
        logger.info("negative captions (%s, %d captions) written to %s", generator,
                    len(captions), path)
    return result


def _lm_header(source: str, word_model: str, encoder: WordEncoder | None, epochs: int, lr: float,
               token_lists: Sequence[Sequence[str]], positions: Sequence[Sequence[int]]
               ) -> dict[str, Any]:
    """What the masked LM's outputs depend on, for the negatives' cache key."""
    if source != mlm.HEAD_SOURCE:
        return {"mlm": model_identity(source)}
    data = _digest({}, [" ".join(t) + "|" + str(list(p)) for t, p in
                        zip(token_lists, positions, strict=True)])
    return {"mlm": source, "word_model": _model_id(word_model, encoder), "epochs": epochs,
            "lr": lr, "mlm_data": data}


def _model_id(word_model: str, encoder: WordEncoder | None) -> str:
    if encoder is not None:
        return encoder.identity

    return model_identity(word_model)


def _negatives_path(cache_dir: str | Path | None, generator: str, key: str) -> Path | None:
    if cache_dir is None:
        return None
    return Path(cache_dir) / f"negatives_{generator}_{key[:20]}.json"


# -------------------------------------------------------------------- candidate features


@dataclass(frozen=True)
class CandidateFeatures:
    """Contextual features of the true noun and its substitutes, for ``L_lang``.

    Attributes:
        features: ``[c, 0]`` the frozen encoder's state at caption ``c``'s masked noun,
            ``[c, k]`` (``k >= 1``) at substitute ``k - 1`` in its negative caption: the mean of
            the word's pieces (punctuation split off), last layer; float16, zero where absent.
        mask: which candidates exist; ``mask[:, 0]`` says which captions have a masked noun.

    Shapes:
        features ``(C, 1 + K, D)``, mask ``(C, 1 + K)`` bool.
    """

    features: np.ndarray
    mask: np.ndarray


def candidate_features(
    captions: Sequence[str],
    negatives: NegativeCaptions,
    cache_dir: str | Path | None,
    *,
    num_negatives: int | None = None,
    model: str = DEFAULT_WORD_MODEL,
    batch_size: int = 128,
    device: str | None = None,
    show_progress: bool = True,
    encoder: WordEncoder | None = None,
) -> CandidateFeatures:
    """The features of each caption's true noun and its first ``num_negatives`` substitutes.

    Every (negative) caption is encoded whole; identical token sequences are encoded once. The
    cost is one encoder pass per distinct caption and substitute: on the default embedded
    benchmark (20,000 training captions, MiniLM on 2 shared CPU cores) ``num_negatives=5`` took
    97,000 passes, about 13 minutes, and 92 MB of float16; 25 substitutes cost about five times
    that. ``L_lang`` uses the first (best ranked) substitutes.

    Args:
        captions: the captions the negatives were made for.
        negatives: their negatives (:func:`negative_captions`).
        cache_dir: folder of the cache; ``None`` computes without caching.
        num_negatives: substitutes used (the first ones, best first); ``None``: all of them.
        model: the word encoder; the same as for the grounding model's word features.
        batch_size: captions per encoder pass.
        device: ``cuda``, ``cpu``, ...; ``None`` picks CUDA when available.
        show_progress: a tqdm bar over batches.
        encoder: an already loaded encoder (``model`` is then only its cache name).
    """
    if len(captions) != len(negatives):
        raise ValueError(f"{len(captions)} captions but {len(negatives)} rows of negatives")
    width = max((len(s) for s in negatives.substitutes), default=0)
    k = width if num_negatives is None else min(num_negatives, width)
    token_lists = [c.split() for c in captions]
    header = {"model": _model_id(model, encoder), "k": k, "version": FEATURES_VERSION}
    rows = [f"{c}\1{i}\1{' '.join(s[:k])}" for c, i, s in
            zip(captions, negatives.word_index, negatives.substitutes, strict=True)]
    paths = _feature_paths(cache_dir, _digest(header, rows))
    if paths is not None:
        cached = _read_features(*paths, len(captions))
        if cached is not None:
            logger.info("candidate features: cache hit %s %s", paths[0], cached.features.shape)
            return cached
    encoder = encoder or WordEncoder.load(model, device)
    result = _compute_features(encoder, token_lists, negatives, k, batch_size, show_progress)
    if paths is not None:
        save_npy_atomic(paths[0], result.features)
        save_npy_atomic(paths[1], result.mask)  # written last: its presence marks a whole entry
        logger.info("candidate features %s written to %s", result.features.shape, paths[0])
    return result


def _compute_features(encoder: WordEncoder, token_lists: list[list[str]],
                      negatives: NegativeCaptions, k: int, batch_size: int,
                      show_progress: bool) -> CandidateFeatures:
    mask = np.zeros((len(token_lists), 1 + k), dtype=bool)  # (C, 1 + K)
    slots: dict[tuple[tuple[str, ...], int], list[tuple[int, int]]] = {}
    for c, tokens in enumerate(token_lists):
        index = int(negatives.word_index[c])
        if index < 0:
            continue
        variants = [tokens] + [negatives.negative_tokens(tokens, c, j)
                               for j in range(min(k, len(negatives.substitutes[c])))]
        for j, variant in enumerate(variants):
            slots.setdefault((tuple(variant), index), []).append((c, j))
            mask[c, j] = True
    unique = list(slots)
    logger.info("candidate features: %d encoder passes for %d candidates", len(unique),
                int(mask.sum()))
    start = time.perf_counter()
    states = mlm.word_states(encoder, [list(t) for t, _ in unique], [i for _, i in unique],
                             batch_size=batch_size, show_progress=show_progress,
                             desc="candidate features")  # (U, D)
    features = np.zeros((*mask.shape, encoder.dim), dtype=np.float16)  # (C, 1 + K, D)
    values = states.numpy().astype(np.float16)
    for u, key in enumerate(unique):
        for c, j in slots[key]:
            features[c, j] = values[u]
    logger.info("candidate features: %s in %.0f s", features.shape, time.perf_counter() - start)
    return CandidateFeatures(features, mask)


def _feature_paths(cache_dir: str | Path | None, key: str) -> tuple[Path, Path] | None:
    if cache_dir is None:
        return None
    stem = Path(cache_dir) / f"negfeatures_{key[:20]}"
    return Path(f"{stem}.npy"), Path(f"{stem}.mask.npy")


def _read_features(features_path: Path, mask_path: Path, num_captions: int
                   ) -> CandidateFeatures | None:
    if not (features_path.is_file() and mask_path.is_file()):
        return None
    try:
        features = np.load(features_path, mmap_mode="r")
        mask = np.load(mask_path)
    except (ValueError, OSError) as err:
        logger.warning("candidate features: unreadable cache %s (%s); recomputing",
                       features_path, err)
        return None
    if features.shape[0] != num_captions or mask.shape != features.shape[:2]:
        return None
    return CandidateFeatures(features, mask)

