"""A masked language model over the noun vocabulary, for context-preserving negative captions.

The paper scores substitute nouns with BERT's masked-LM head: ``p(s'|c)`` with the noun masked and
``q(s'|s, c)`` with the caption unmasked (Gupta et al., ECCV 2020, Sec. 2.4). No masked-LM head
ships offline here (the bundled MiniLM is an encoder only), so two sources are offered, both
behind :class:`MaskedNounModel` (probabilities over the noun vocabulary at one word of a caption):

- ``"head"`` (default): :class:`NounHead`, a small head (Linear, GELU, LayerNorm, then a decoder
  over the noun vocabulary initialised from the encoder's input embeddings, as BERT ties its
  decoder to them) on the last hidden states of the frozen word encoder
  (:class:`~icr.grounding.words.WordEncoder`), trained on masked-noun prediction of the training
  captions with BERT's recipe: of the training positions 80% are masked, 10% replaced by a random
  noun, 10% left unchanged, so that the head also gives a distribution at unmasked words. It is
  trained once and cached on disk, keyed by the captions, their nouns, the encoder's identity and
  the head's options.
- a local folder of any ``transformers`` masked LM (``AutoModelForMaskedLM``, local files only):
  :class:`PretrainedMaskedLM`. As in the reference, it scores one word piece: nouns that are not a
  single piece of its vocabulary cannot be proposed and are left out (with a warning).

A word of a caption is a whitespace token; its punctuation (``"circle."``) is split off before it
is masked or encoded (:func:`split_affixes`), and its state is the mean over its word pieces.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from icr.data.targets import model_identity
from icr.errors import ConfigError
from icr.grounding.words import DEFAULT_WORD_MODEL, WordEncoder
from icr.io import write_atomic

logger = logging.getLogger(__name__)

__all__ = [
    "HEAD_SOURCE",
    "HeadMaskedLM",
    "MaskedNounModel",
    "NounHead",
    "PretrainedMaskedLM",
    "StateMemo",
    "load_masked_noun_model",
    "normalise_word",
    "replace_word",
    "split_affixes",
    "train_noun_head",
    "word_states",
]

HEAD_SOURCE = "head"
HEAD_VERSION = 1  # bump when a cached head changes meaning
_AFFIXES = re.compile(r"^([^0-9A-Za-z]*)(.*?)([^0-9A-Za-z]*)$", re.DOTALL)


# ------------------------------------------------------------------------------------- words


def split_affixes(token: str) -> tuple[str, str, str]:
    """``(leading punctuation, word, trailing punctuation)`` of a whitespace token."""
    match = _AFFIXES.match(token)
    assert match is not None  # the pattern matches every string
    return match.group(1), match.group(2), match.group(3)


def normalise_word(token: str) -> str:
    """The vocabulary form of a token: without its punctuation, lower-cased (``"Circle." -> "circle"``)."""
    return split_affixes(token)[1].lower()


def replace_word(tokens: Sequence[str], index: int, word: str) -> list[str]:
    """``tokens`` with the word of token ``index`` replaced, its punctuation and capital kept."""
    prefix, core, suffix = split_affixes(tokens[index])
    if core[:1].isupper():
        word = word[:1].upper() + word[1:]
    out = list(tokens)
    out[index] = prefix + word + suffix
    return out


def _split_target(tokens: Sequence[str], index: int, core: str | None) -> tuple[list[str], int]:
    """Words for the tokenizer with token ``index`` split into its affixes; the core's position."""
    prefix, word, suffix = split_affixes(tokens[index])
    parts = [p for p in (prefix, core if core is not None else word, suffix) if p]
    return [*tokens[:index], *parts, *tokens[index + 1:]], index + (1 if prefix else 0)


def _encode_at(
    tokenizer: Any,
    run: Callable[[dict[str, Tensor]], Tensor],
    token_lists: Sequence[Sequence[str]],
    positions: Sequence[int],
    *,
    mask: bool,
    reduce: str,
    batch_size: int,
    max_length: int,
    device: torch.device,
    show_progress: bool,
    desc: str,
) -> Tensor:
    """``run``'s output at word ``positions[n]`` of caption ``n`` (mean or first of its pieces).

    Captions are batched by length (less padding); the result is in input order, on the CPU.
    """
    order = sorted(range(len(token_lists)), key=lambda n: len(token_lists[n]))
    rows: list[Tensor | None] = [None] * len(order)
    starts = range(0, len(order), batch_size)
    for start in tqdm(starts, desc=desc, disable=not show_progress, leave=False):
        chunk = order[start:start + batch_size]
        words, cores = zip(*(
            _split_target(token_lists[n], positions[n], tokenizer.mask_token if mask else None)
            for n in chunk
        ), strict=True)
        enc = tokenizer([list(w) for w in words], is_split_into_words=True, truncation=True,
                        max_length=max_length, padding=True, return_tensors="pt")
        inputs = {k: v.to(device) for k, v in enc.items()}
        with torch.inference_mode():
            out = run(inputs).float()  # (B, T, X)
        for b, n in enumerate(chunk):
            pieces = [p for p, w in enumerate(enc.word_ids(b)) if w == cores[b]]
            if not pieces:
                raise ValueError(f"word {positions[n]} of caption {' '.join(token_lists[n])!r} "
                                 f"has no word piece (truncated at {max_length}?)")
            selected = out[b, pieces[:1] if reduce == "first" else pieces]  # (P, X)
            rows[n] = selected.mean(dim=0).cpu()  # (X,)
    width = rows[0].shape[0] if rows else 0
    return torch.stack(rows) if rows else torch.zeros(0, width)  # (N, X)


StateMemo = dict[tuple[tuple[str, ...], int, bool], Tensor]


def word_states(
    encoder: WordEncoder,
    token_lists: Sequence[Sequence[str]],
    positions: Sequence[int],
    *,
    mask: bool = False,
    batch_size: int = 128,
    show_progress: bool = False,
    desc: str = "word states",
    memo: StateMemo | None = None,
) -> Tensor:
    """Last-layer states of the frozen encoder at one word of each caption, the mean of its pieces.

    With ``mask=True`` the word (not its punctuation) is replaced by the tokenizer's mask token.
    Identical inputs are encoded once; ``memo`` maps ``(tokens, position, mask)`` to states
    computed before, which are not encoded again, and receives the new ones.

    Shapes:
        ``N`` token lists and positions -> ``(N, D)`` float32 on the CPU.
    """
    keys = [(tuple(t), int(p), mask) for t, p in zip(token_lists, positions, strict=True)]
    known = memo if memo is not None else {}
    todo = list(dict.fromkeys(key for key in keys if key not in known))  # distinct, in order
    fresh = _encode_at(
        encoder.tokenizer, lambda inputs: encoder.model(**inputs).last_hidden_state,
        [key[0] for key in todo], [key[1] for key in todo], mask=mask, reduce="mean",
        batch_size=batch_size, max_length=encoder.max_length, device=encoder.device,
        show_progress=show_progress, desc=desc,
    )  # (N_todo, D)
    found = dict(zip(todo, fresh, strict=True))
    if memo is not None:
        memo.update(found)
    if not keys:
        return fresh
    return torch.stack([found[key] if key in found else known[key] for key in keys])  # (N, D)


# ----------------------------------------------------------------------------- the interface


class MaskedNounModel(Protocol):
    """Probabilities over a noun vocabulary at one word of each caption.

    Attributes:
        nouns: the nouns it can propose, in the order of the probability columns.
        identity: what a cache of its outputs must record about it.
    """

    nouns: tuple[str, ...]
    identity: str

    def probabilities(
        self,
        token_lists: Sequence[Sequence[str]],
        positions: Sequence[int],
        *,
        masked: bool,
        batch_size: int = 128,
        show_progress: bool = False,
    ) -> Tensor:
        """``p(noun | caption)`` at word ``positions[n]``, masked (``p(s'|c)``) or not
        (``q(s'|s, c)``): ``(N, len(nouns))``, rows summing to one."""
        ...


# ------------------------------------------------------------------------------ trained head


class NounHead(nn.Module):
    """BERT's masked-LM head shape (transform + decoder) with a decoder over the noun vocabulary.

    Args:
        hidden_dim: size of the encoder's hidden states.
        num_nouns: size of the noun vocabulary.
        noun_embeddings: optional ``(num_nouns, hidden_dim)`` initial decoder weights (the mean
            input embedding of each noun's word pieces); copied, then trained.

    Shapes:
        hidden ``(N, hidden_dim)`` -> logits ``(N, num_nouns)``.
    """

    def __init__(self, hidden_dim: int, num_nouns: int, noun_embeddings: Tensor | None = None
                 ) -> None:
        super().__init__()
        self.transform = nn.Sequential(
            nn.Linear(hidden_dim, hidden_dim), nn.GELU(), nn.LayerNorm(hidden_dim)
        )
        self.decoder = nn.Linear(hidden_dim, num_nouns)
        if noun_embeddings is not None:
            with torch.no_grad():
                self.decoder.weight.copy_(noun_embeddings)
                self.decoder.bias.zero_()

    def forward(self, hidden: Tensor) -> Tensor:
        return self.decoder(self.transform(hidden))  # (N, V)


class HeadMaskedLM:
    """A frozen :class:`WordEncoder` with a trained :class:`NounHead`: a :class:`MaskedNounModel`."""

    def __init__(self, encoder: WordEncoder, head: NounHead, nouns: Sequence[str],
                 identity: str, memo: StateMemo | None = None) -> None:
        self.encoder = encoder
        self.head = head.to(encoder.device).eval()
        self.nouns = tuple(nouns)
        self.identity = identity
        self.memo = memo  # states computed while training the head, not encoded again

    def probabilities(self, token_lists: Sequence[Sequence[str]], positions: Sequence[int], *,
                      masked: bool, batch_size: int = 128, show_progress: bool = False) -> Tensor:
        states = word_states(self.encoder, token_lists, positions, mask=masked,
                             batch_size=batch_size, show_progress=show_progress,
                             desc="masked LM" if masked else "unmasked LM",
                             memo=self.memo)  # (N, D)
        with torch.inference_mode():
            logits = self.head(states.to(self.encoder.device))  # (N, V)
        return torch.softmax(logits.float(), dim=-1).cpu()


def _noun_embeddings(encoder: WordEncoder, nouns: Sequence[str]) -> Tensor | None:
    """Mean input embedding of each noun's word pieces, or ``None`` if the sizes do not match."""
    table = encoder.model.get_input_embeddings().weight.detach()  # (vocab, E)
    if table.shape[1] != encoder.dim:
        return None
    rows = []
    for noun in nouns:
        ids = encoder.tokenizer(noun, add_special_tokens=False)["input_ids"]
        rows.append(table[ids].mean(dim=0) if ids else table.new_zeros(table.shape[1]))
    return torch.stack(rows).float().cpu()  # (V, E)


def _training_examples(
    encoder: WordEncoder,
    token_lists: Sequence[Sequence[str]],
    positions: Sequence[int],
    nouns: Sequence[str],
    rng: np.random.Generator,
    batch_size: int,
    show_progress: bool,
    memo: StateMemo | None,
) -> tuple[Tensor, Tensor]:
    """Hidden states and noun targets: BERT's 80% masked, 10% random noun, 10% unchanged."""
    index = {noun: v for v, noun in enumerate(nouns)}
    picks = [c for c, p in enumerate(positions)
             if p >= 0 and normalise_word(token_lists[c][p]) in index]
    if not picks:
        raise ConfigError("the masked-LM head needs training captions with nouns; none was found")
    tokens = [token_lists[c] for c in picks]
    where = [int(positions[c]) for c in picks]
    targets = torch.tensor([index[normalise_word(t[p])] for t, p in
                            zip(tokens, where, strict=True)])  # (N,)
    n_extra = max(1, round(len(picks) / 8))  # 10% each beside the 80% masked
    unchanged = rng.choice(len(picks), size=min(n_extra, len(picks)), replace=False)
    replaced = rng.choice(len(picks), size=min(n_extra, len(picks)), replace=False)
    swapped = [replace_word(tokens[n], where[n], nouns[int(rng.integers(len(nouns)))])
               for n in replaced]
    kwargs = {"batch_size": batch_size, "show_progress": show_progress}
    states = [
        word_states(encoder, tokens, where, mask=True, desc="head: masked", memo=memo, **kwargs),
        word_states(encoder, [tokens[n] for n in unchanged], [where[n] for n in unchanged],
                    desc="head: unchanged", memo=memo, **kwargs),
        word_states(encoder, swapped, [where[n] for n in replaced], desc="head: random",
                    **kwargs),
    ]
    labels = torch.cat([targets, targets[unchanged], targets[replaced]])
    return torch.cat(states), labels  # (N, D), (N,)


def train_noun_head(
    encoder: WordEncoder,
    token_lists: Sequence[Sequence[str]],
    positions: Sequence[int],
    nouns: Sequence[str],
    *,
    epochs: int = 10,
    lr: float = 1e-3,
    batch_size: int = 256,
    seed: int = 0,
    encode_batch_size: int = 128,
    show_progress: bool = True,
    memo: StateMemo | None = None,
) -> NounHead:
    """Train a :class:`NounHead` on masked-noun prediction of the training captions.

    The training positions are one noun per caption: the nouns the negative captions mask
    (:func:`icr.grounding.negatives.choose_nouns`), so the masked states computed here serve the
    scoring too (``memo``). On the embedded benchmark this also gave better negatives than
    training on other nouns of the same captions (fewer synonyms and hypernyms kept). The frozen
    encoder's states are computed once; the head is then trained with Adam and cross-entropy over
    ``nouns``.

    Args:
        encoder: the frozen word encoder.
        token_lists: the training captions as whitespace tokens.
        positions: per caption, the token index of its training noun, -1 for none.
        nouns: the noun vocabulary (normalised words, :func:`normalise_word`).
        epochs, lr, batch_size: the head's optimisation.
        seed: draws the 10% / 10% subsets and the initialisation.
        encode_batch_size: captions per encoder forward pass.
        show_progress: tqdm bars over encoding and epochs.
        memo: receives the encoder states computed here (:func:`word_states`).
    """
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    states, labels = _training_examples(encoder, token_lists, positions, nouns, rng,
                                        encode_batch_size, show_progress, memo)
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    head = NounHead(encoder.dim, len(nouns), _noun_embeddings(encoder, nouns))
    optimizer = torch.optim.Adam(head.parameters(), lr=lr)
    head.train()
    for _ in tqdm(range(epochs), desc="masked-LM head", disable=not show_progress):
        for batch in torch.randperm(len(labels), generator=generator).split(batch_size):
            loss = nn.functional.cross_entropy(head(states[batch]), labels[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    head.eval()
    with torch.no_grad():
        accuracy = (head(states).argmax(dim=1) == labels).float().mean().item()
    logger.info("masked-LM head: %d examples, %d nouns, final loss %.3f, accuracy %.3f, %.0f s",
                len(labels), len(nouns), loss.item(), accuracy, time.perf_counter() - start)
    return head


# --------------------------------------------------------------------- pretrained masked LM


class PretrainedMaskedLM:
    """A ``transformers`` masked LM restricted to the nouns that are one piece of its vocabulary.

    ``p`` at a masked word is read at the mask token, ``q`` at an unmasked word at its first piece
    (the reference's convention); the softmax is over the kept nouns only.
    """

    def __init__(self, tokenizer: Any, model: nn.Module, nouns: Sequence[str], identity: str,
                 device: str | torch.device = "cpu") -> None:
        self.tokenizer = tokenizer
        self.model = model.to(device).eval().requires_grad_(False)
        self.device = torch.device(device)
        self.identity = identity
        self.max_length = min(int(getattr(tokenizer, "model_max_length", 512) or 512), 512)
        ids = {noun: tokenizer(noun, add_special_tokens=False)["input_ids"] for noun in nouns}
        dropped = sorted(noun for noun, i in ids.items() if len(i) != 1)
        if dropped:
            logger.warning("masked LM %s: %d nouns are not one word piece and cannot be proposed: "
                           "%s", identity, len(dropped), ", ".join(dropped[:20]))
        self.nouns = tuple(noun for noun in nouns if len(ids[noun]) == 1)
        self.noun_ids = torch.tensor([ids[noun][0] for noun in self.nouns], dtype=torch.long)

    @classmethod
    def load(cls, path: str, nouns: Sequence[str], device: str | None = None
             ) -> PretrainedMaskedLM:
        """Load a masked LM and its tokenizer from a local folder; :class:`ConfigError` if absent."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        # lazy: keeps transformers off runs without a masked LM; imported after the flags above
        from transformers import AutoModelForMaskedLM, AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = AutoModelForMaskedLM.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ConfigError(f"cannot load a masked language model from {path!r} "
                              f"({type(err).__name__}); set grounding.mlm to a local "
                              f"transformers masked-LM folder or to {HEAD_SOURCE!r}") from err
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(tokenizer, model, nouns, model_identity(path), device)

    def probabilities(self, token_lists: Sequence[Sequence[str]], positions: Sequence[int], *,
                      masked: bool, batch_size: int = 128, show_progress: bool = False) -> Tensor:
        noun_ids = self.noun_ids.to(self.device)

        def noun_logits(inputs: dict[str, Tensor]) -> Tensor:
            return self.model(**inputs).logits[..., noun_ids]  # (B, T, V)

        logits = _encode_at(self.tokenizer, noun_logits, token_lists, positions, mask=masked,
                            reduce="first", batch_size=batch_size, max_length=self.max_length,
                            device=self.device, show_progress=show_progress, desc="masked LM")
        return torch.softmax(logits, dim=-1)  # (N, V)


# ---------------------------------------------------------------------------------- loading


def _head_key(encoder_id: str, token_lists: Sequence[Sequence[str]], positions: Sequence[int],
              nouns: Sequence[str], options: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    digest.update(json.dumps({"encoder": encoder_id, "nouns": list(nouns), "options": options,
                              "version": HEAD_VERSION}, sort_keys=True).encode())
    for tokens, position in zip(token_lists, positions, strict=True):
        digest.update(("\0" + " ".join(tokens) + "\1" + str(int(position))).encode())
    return digest.hexdigest()


def load_masked_noun_model(
    source: str,
    nouns: Sequence[str],
    token_lists: Sequence[Sequence[str]],
    positions: Sequence[int],
    cache_dir: str | Path | None,
    *,
    word_model: str = DEFAULT_WORD_MODEL,
    epochs: int = 10,
    lr: float = 1e-3,
    seed: int = 0,
    device: str | None = None,
    show_progress: bool = True,
    encoder: WordEncoder | None = None,
) -> MaskedNounModel:
    """The masked LM of ``source``: ``"head"`` (trained on the captions, cached) or a local folder.

    Args:
        source: ``"head"`` or the path of a ``transformers`` masked LM.
        nouns: the noun vocabulary (normalised words).
        token_lists, positions: the training captions and the token index of the noun of each
            that the head learns to predict (-1 for none; :func:`train_noun_head`).
        cache_dir: folder of the head cache (``None``: train without caching).
        word_model: the frozen encoder under the head (the bundled MiniLM's name or a folder).
        epochs, lr, seed: the head's training (:func:`train_noun_head`).
        device: ``cuda``, ``cpu``, ...; ``None`` picks CUDA when available.
        show_progress: tqdm bars.
        encoder: an already loaded word encoder (``word_model`` is then only its cache name).
    """
    if source != HEAD_SOURCE:
        return PretrainedMaskedLM.load(source, nouns, device)
    encoder = encoder or WordEncoder.load(word_model, device)
    options = {"epochs": epochs, "lr": lr, "seed": seed}
    key = _head_key(encoder.identity, token_lists, positions, nouns, options)
    identity = f"head:{key[:20]}"
    path = Path(cache_dir) / f"mlm_head_{key[:20]}.pt" if cache_dir is not None else None
    if path is not None and path.is_file():
        state = torch.load(path, map_location="cpu", weights_only=True)
        if list(state["nouns"]) == list(nouns):
            head = NounHead(encoder.dim, len(nouns))
            head.load_state_dict(state["head"])
            logger.info("masked-LM head: cache hit %s", path)
            return HeadMaskedLM(encoder, head, nouns, identity)
        logger.warning("masked-LM head: %s was trained for other nouns; retraining", path)
    memo: StateMemo = {}
    head = train_noun_head(encoder, token_lists, positions, nouns, epochs=epochs, lr=lr,
                           seed=seed, show_progress=show_progress, memo=memo)
    if path is not None:
        state = {"head": head.state_dict(), "nouns": list(nouns), "encoder": encoder.identity}
        write_atomic(path, lambda f: torch.save(state, f))
        logger.info("masked-LM head written to %s", path)
    return HeadMaskedLM(encoder, head, nouns, identity, memo)
