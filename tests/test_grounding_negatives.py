"""Negative captions and the masked LM: re-ranking, random substitutes, caching, candidate
features; a tiny BERT built from a config and a tiny tokenizer in tmp_path (nothing downloaded)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from icr.config import GroundingConfig
from icr.errors import ConfigError, DataError
from icr.grounding import mlm
from icr.grounding.mlm import (
    PretrainedMaskedLM,
    normalise_word,
    replace_word,
    split_affixes,
    train_noun_head,
    word_states,
)
from icr.grounding.negatives import (
    NEGATIVE_GENERATORS,
    NegativeCaptions,
    candidate_features,
    choose_nouns,
    context_substitutes,
    negative_captions,
    noun_vocabulary,
    random_substitutes,
    rerank,
)
from icr.grounding.words import WordEncoder

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "an", "red", "blue", "green",
         "circle", "square", "star", "box", "cross", "on", "the", "left", "right", "is", "big",
         "rh", "##omb", "##us", ".", ","]
NOUNS = ("box", "circle", "cross", "square", "star")
COLOUR_OF = {"circle": "red", "square": "blue", "star": "green"}  # the colour says the shape


def _tiny_bert(kind: str):
    from transformers import BertConfig, BertForMaskedLM, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(VOCAB), hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=32,
                        initializer_range=0.5)  # large weights: states depend on context
    return (BertModel if kind == "encoder" else BertForMaskedLM)(config).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import BertTokenizer

    return BertTokenizer(vocab={w: i for i, w in enumerate(VOCAB)})


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return WordEncoder(tokenizer, _tiny_bert("encoder"), identity="tiny-bert")


@pytest.fixture(scope="module")
def mlm_folder(tmp_path_factory, tokenizer):
    folder = tmp_path_factory.mktemp("tiny-mlm")
    _tiny_bert("mlm").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def _captions(n: int = 40) -> list[str]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        noun = sorted(COLOUR_OF)[int(rng.integers(len(COLOUR_OF)))]
        side = "left" if i % 2 else "right"
        out.append(f"A {COLOUR_OF[noun]} {noun} on the {side}.")
    return out


class FakeLM:
    """A masked LM with fixed probabilities per (masked?) call, for the generator's plumbing."""

    identity = "fake"

    def __init__(self, nouns, p, q):
        self.nouns, self.p, self.q = tuple(nouns), torch.tensor(p), torch.tensor(q)

    def probabilities(self, token_lists, positions, *, masked, batch_size=128,
                      show_progress=False):
        row = self.p if masked else self.q
        return row.expand(len(token_lists), -1).clone()


# ------------------------------------------------------------------------------ words


def test_affixes_and_replacement_keep_punctuation_and_capitals():
    assert split_affixes("circle.") == ("", "circle", ".")
    assert split_affixes('"Box",') == ('"', "Box", '",')
    assert normalise_word("Circle.") == "circle"
    assert replace_word(["A", "red", "circle."], 2, "star") == ["A", "red", "star."]
    assert replace_word(["Circles", "!"], 0, "stars") == ["Stars", "!"]


def test_word_states_mask_only_the_word_and_average_its_pieces(encoder):
    hidden, word_ids = encoder.encode([["a", "red", "[MASK]", "."]])
    masked = word_states(encoder, [["a", "red", "circle."]], [2], mask=True)
    torch.testing.assert_close(masked[0], hidden[0, word_ids[0].index(2)])
    hidden, word_ids = encoder.encode([["a", "rhombus", "."]])
    pieces = [p for p, w in enumerate(word_ids[0]) if w == 1]
    assert len(pieces) == 3  # rh ##omb ##us
    states = word_states(encoder, [["a", "rhombus."]], [1])
    torch.testing.assert_close(states[0], hidden[0, pieces].mean(0))


# ------------------------------------------------------------------------------ re-ranking


def test_rerank_drops_a_candidate_as_likely_unmasked_as_masked():
    # columns: circle (the true noun), square, box, star, cross
    p = torch.tensor([[0.40, 0.25, 0.20, 0.10, 0.05]])
    q = torch.tensor([[0.70, 0.01, 0.20, 0.01, 0.08]])  # box: q = p, a synonym of the true noun
    exclude = torch.tensor([[True, False, False, False, False]])
    # scores: square 25, box 1, star 10, cross 0.625 -> keep square, star; box is dropped
    assert rerank(p, q, exclude, num_candidates=4, num_negatives=2).tolist() == [[1, 3]]
    # only the top-2 by p are candidates: square, box -> box is kept for lack of others
    assert rerank(p, q, exclude, num_candidates=2, num_negatives=2).tolist() == [[1, 2]]
    # more wanted than the vocabulary holds: all but the true noun, never the true noun
    kept = rerank(p, q, exclude, num_candidates=30, num_negatives=25)
    assert sorted(kept[0].tolist()) == [1, 2, 3, 4]


def test_context_generator_maps_columns_to_nouns_and_skips_captions_without_nouns():
    lm = FakeLM(("circle", "square", "box", "star", "cross"),
                [0.40, 0.25, 0.20, 0.10, 0.05], [0.70, 0.01, 0.20, 0.01, 0.08])
    tokens = [["A", "red", "circle."], ["Two", "things."], ["A", "star", "on", "the", "left."]]
    out = context_substitutes(tokens, np.array([2, -1, 1]), lm.nouns, masked_lm=lambda: lm,
                              num_negatives=2, mlm_candidates=4, show_progress=False)
    assert out[0] == ("square", "star")
    assert out[1] == ()
    # for "star" the true noun is star: candidates circle, square, box, cross
    # scores: circle 0.57, square 25, box 1, cross 0.625 -> square, box
    assert out[2] == ("square", "box")


def test_random_never_returns_the_true_noun():
    captions = _captions(60)
    tokens = [c.split() for c in captions]
    index = np.full(len(tokens), 2)
    out = random_substitutes(tokens, index, NOUNS, num_negatives=10, seed=3)
    for t, subs in zip(tokens, out, strict=True):
        assert normalise_word(t[2]) not in subs
        assert len(subs) == len(set(subs)) == len(NOUNS) - 1  # capped by the vocabulary
        assert set(subs) <= set(NOUNS)
    assert random_substitutes(tokens, index, NOUNS, num_negatives=2, seed=3) == \
        random_substitutes(tokens, index, NOUNS, num_negatives=2, seed=3)
    assert set(NEGATIVE_GENERATORS.names()) >= {"context", "random"}


def test_choose_nouns_is_seeded_by_text():
    tokens = [["a", "red", "circle", "on", "the", "left"]] * 3 + [["nothing", "here"]]
    positions = [[2, 5]] * 3 + [[]]
    chosen = choose_nouns(tokens, positions, seed=0)
    assert chosen[3] == -1
    assert chosen[0] == chosen[1] == chosen[2] and chosen[0] in (2, 5)
    picks = {int(choose_nouns(tokens[:1], positions[:1], seed=s)[0]) for s in range(20)}
    assert picks == {2, 5}


# ------------------------------------------------------------------------------ masked LMs


def test_pretrained_masked_lm_scores_single_piece_nouns_only(mlm_folder):
    lm = PretrainedMaskedLM.load(mlm_folder, ("circle", "rhombus", "square"), device="cpu")
    assert lm.nouns == ("circle", "square")  # rhombus is three pieces
    tokens = [["a", "red", "circle."], ["the", "square", "on", "the", "left."]]
    for masked in (True, False):
        probs = lm.probabilities(tokens, [2, 1], masked=masked)
        assert probs.shape == (2, 2)
        torch.testing.assert_close(probs.sum(1), torch.ones(2))
    with pytest.raises(ConfigError, match="cannot load a masked language model"):
        mlm.load_masked_noun_model(str(mlm_folder) + "-missing", NOUNS, [], [], None)


class BagOfWords(torch.nn.Module):
    """An encoder whose state at a token is its embedding plus the mean embedding of the caption:
    the context is linearly readable at a masked word, so a working head must learn it."""

    def __init__(self, vocab_size: int, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab_size, dim)
        self.config = SimpleNamespace(hidden_size=dim)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed

    def forward(self, input_ids, attention_mask, **_):
        emb = self.embed(input_ids)  # (B, T, D)
        weights = attention_mask[..., None].float()  # (B, T, 1)
        context = (emb * weights).sum(1, keepdim=True) / weights.sum(1, keepdim=True)
        return SimpleNamespace(last_hidden_state=emb + context)


def test_noun_head_learns_the_noun_from_its_context(tokenizer):
    # In the training captions the colour says the shape: masked, the head must follow the colour.
    encoder = WordEncoder(tokenizer, BagOfWords(len(VOCAB)), identity="bag-of-words")
    captions = [c.split() for c in _captions(200)]
    positions = [[2]] * len(captions)
    nouns = noun_vocabulary(captions, positions)
    assert nouns == ("circle", "square", "star")
    head = train_noun_head(encoder, captions, [2] * len(captions), nouns, epochs=30, lr=3e-3,
                           batch_size=16, show_progress=False)
    model = mlm.HeadMaskedLM(encoder, head, nouns, "tiny-head")
    queries = [f"A {colour} box on the left.".split() for colour in ("green", "red", "blue")]
    probs = model.probabilities(queries, [2, 2, 2], masked=True)
    assert [nouns[int(i)] for i in probs.argmax(dim=1)] == ["star", "circle", "square"]
    torch.testing.assert_close(probs.sum(1), torch.ones(3))


def test_scoring_reuses_the_states_computed_for_the_head(encoder, monkeypatch):
    captions = [f"{c} {i}".split() for i, c in enumerate(_captions(24))]  # all distinct
    positions = [2] * len(captions)
    encoded = []
    real = mlm._encode_at
    monkeypatch.setattr(mlm, "_encode_at",
                        lambda tok, run, lists, *a, **k: encoded.append(len(lists))
                        or real(tok, run, lists, *a, **k))
    model = mlm.load_masked_noun_model("head", ("circle", "square", "star"), captions, positions,
                                       None, encoder=encoder, epochs=1, show_progress=False)
    assert encoded == [24, 3, 3]  # masked, 10% unchanged, 10% random (at least one each)
    encoded.clear()
    masked = model.probabilities(captions, positions, masked=True)
    unmasked = model.probabilities(captions, positions, masked=False)
    assert encoded == [0, 21]  # the masked states and the 3 unchanged ones are known
    monkeypatch.setattr(model, "memo", None)
    torch.testing.assert_close(model.probabilities(captions, positions, masked=True), masked)
    torch.testing.assert_close(model.probabilities(captions, positions, masked=False), unmasked)


# ------------------------------------------------------------------------------ caching


def test_context_negatives_are_cached_and_a_hit_never_loads_the_model(tmp_path, encoder,
                                                                     monkeypatch):
    captions = _captions(30) + ["Nothing to see"]
    positions = [[2, 5] for _ in captions[:-1]] + [[]]
    section = GroundingConfig(negatives="context", num_negatives=3, mlm_candidates=4)
    kwargs = dict(encoder=encoder, mlm_epochs=2, show_progress=False)
    first = negative_captions(section, captions, positions, tmp_path, **kwargs)
    assert first.word_index[-1] == -1 and first.substitutes[-1] == () and first.true_words[-1] == ""
    for c in range(len(captions) - 1):
        assert first.true_words[c] == normalise_word(captions[c].split()[first.word_index[c]])
        assert first.true_words[c] not in first.substitutes[c]
        assert len(first.substitutes[c]) == 3

    def refuse(*args, **kwargs):
        raise AssertionError("the masked LM was loaded on a cache hit")

    monkeypatch.setattr(mlm, "load_masked_noun_model", refuse)
    second = negative_captions(section, captions, positions, tmp_path, **kwargs)
    assert second.substitutes == first.substitutes
    np.testing.assert_array_equal(second.word_index, first.word_index)
    with pytest.raises(AssertionError, match="cache hit"):  # other options: a miss, recomputed
        negative_captions(dataclasses.replace(section, num_negatives=2), captions, positions,
                          tmp_path, **kwargs)


def test_negative_captions_json_round_trip_and_tokens():
    negatives = NegativeCaptions(np.array([2, -1]), ("circle", ""), (("star", "box"), ()),
                                 "random")
    again = NegativeCaptions.from_json(negatives.to_json())
    assert again.substitutes == negatives.substitutes and again.true_words == negatives.true_words
    np.testing.assert_array_equal(again.word_index, negatives.word_index)
    assert negatives.negative_tokens(["A", "red", "circle."], 0, 1) == ["A", "red", "box."]


def test_too_few_nouns_is_a_data_error(tmp_path):
    with pytest.raises(DataError, match="at least 2 nouns"):
        negative_captions(GroundingConfig(negatives="random"), ["a circle"], [[1]], tmp_path)


def test_candidate_features_match_direct_encoding_and_are_cached(tmp_path, encoder,
                                                                 monkeypatch):
    captions = ["A red circle on the left.", "A red circle on the left.", "A blue box."]
    negatives = NegativeCaptions(np.array([2, 2, -1]), ("circle", "circle", ""),
                                 (("star", "square", "box"), ("star", "square", "box"), ()),
                                 "random")
    calls = []
    real = mlm.word_states
    monkeypatch.setattr(mlm, "word_states",
                        lambda enc, toks, *a, **k: calls.append(len(toks)) or real(enc, toks, *a, **k))
    out = candidate_features(captions, negatives, tmp_path, num_negatives=2, encoder=encoder,
                             show_progress=False)
    assert calls == [3]  # the two identical captions share their 1 + 2 encoder passes
    assert out.features.shape == (3, 3, encoder.dim) and out.features.dtype == np.float16
    np.testing.assert_array_equal(out.mask, [[True] * 3, [True] * 3, [False] * 3])
    expected = real(encoder, [["A", "red", "circle", "on", "the", "left."],
                              ["A", "red", "star", "on", "the", "left."],
                              ["A", "red", "square", "on", "the", "left."]], [2, 2, 2])
    np.testing.assert_allclose(out.features[0].astype(np.float32), expected.numpy(), atol=2e-3)
    np.testing.assert_array_equal(out.features[1], out.features[0])
    assert not out.features[2].any()

    monkeypatch.setattr(mlm, "word_states", lambda *a, **k: pytest.fail("recomputed"))
    monkeypatch.setattr(WordEncoder, "load", lambda *a, **k: pytest.fail("model loaded"))
    again = candidate_features(captions, negatives, tmp_path, num_negatives=2, model="tiny-bert",
                               encoder=encoder, show_progress=False)
    np.testing.assert_array_equal(np.asarray(again.features), out.features)
