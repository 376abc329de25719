"""Grounding words: tagging, selection, gold tags, and cached word-piece features of a tiny BERT."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from icr.errors import ConfigError
from icr.grounding.words import (
    SelectedWords,
    WordEncoder,
    gold_tags,
    select_split_words,
    select_words,
    tag_tokens,
    tagger_accuracy,
    word_features,
)

CAPTIONS = (
    "a red circle .",
    "a medium-sized rhombus with dots next to a big red square .",
    "there are two shapes .",
    "a small blue star and a large red circle and a big green square on the left .",
    "it is there .",  # no content word
)
VOCAB = [  # a word-piece vocabulary covering CAPTIONS; "rhombus" is three pieces
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "red", "circle", ".", "medium", "-",
    "sized", "rh", "##omb", "##us", "with", "dots", "next", "to", "big", "square", "there", "are",
    "two", "shapes", "small", "blue", "star", "and", "large", "green", "on", "the", "left", "sq",
    "##uare",
]


def _words(text: str) -> list[str]:
    return text.split()


# ------------------------------------------------------------------------------------ tagging


def test_tags_are_pattern_tagger_tags_one_per_token():
    from textblob.en.taggers import PatternTagger

    tokens = _words("A small red circle next to a big square .")
    tags = tag_tokens(tokens)
    assert tags == [t for _, t in PatternTagger().tag(" ".join(tokens), tokenize=False)]
    assert tags[:4] == ["DT", "JJ", "JJ", "NN"]
    assert len(tag_tokens(["and/or", "a", "man"])) == 3  # a "/" does not split a token
    assert tag_tokens([]) == []


def test_selection_keeps_nouns_before_adjectives_in_caption_order():
    tokens = _words("a1 b2 c3 d4 e5 f6 g7 h8 . i9")
    tags = ["JJ", "NN", "JJ", "NNS", "JJS", "NN", "VB", "NN", "NN", "JJ"]
    assert select_words(tokens, tags, None) == [0, 1, 2, 3, 4, 5, 7, 9]  # "." is no word
    assert select_words(tokens, tags, 6) == [0, 1, 2, 3, 5, 7]  # 4 nouns, the first 2 adjectives
    assert select_words(tokens, tags, 3) == [1, 3, 5]  # nouns first
    assert select_words(tokens[:3], tags[:3], 6) == [0, 1, 2]


def test_select_split_words_pads_and_tags():
    words = select_split_words(CAPTIONS, max_words=3)
    assert words.word_index.shape == (5, 3) and (words.word_index[4] == -1).all()
    assert words.word_index[0].tolist() == [1, 2, -1]  # red, circle
    assert words.tags[0] == ("JJ", "NN")
    assert words.is_noun(0, 1) and not words.is_noun(0, 0)
    assert (words.mask.sum(1) == [len(t) for t in words.tags]).all()
    unlimited = select_split_words(CAPTIONS, max_words=None)
    assert unlimited.word_index.shape[1] == max(len(t) for t in unlimited.tags) > 3
    with pytest.raises(ConfigError):
        select_split_words(CAPTIONS, max_words=0)


# ---------------------------------------------------------------------------------- gold tags


def test_gold_tags_follow_the_grammar():
    tokens = _words("A red circle to the left of a plus sign , plus a striped box with polka dots .")
    assert gold_tags(tokens) == [
        "other", "adjective", "noun", "other", "other", "other", "other", "other", "noun",
        "noun", "other", "other", "other", "adjective", "noun", "other", "noun", "noun", "other",
    ]
    assert gold_tags(_words("a star on the left in the upper part"))[4] == "noun"
    assert gold_tags(_words("a big dog")) == ["other", "adjective", "unknown"]
    assert gold_tags(_words("five items , among them a grey polygon on a pale backdrop")) == [
        "other", "noun", "other", "other", "other", "other", "adjective", "noun", "other", "other",
        "adjective", "noun"]


def test_tagger_accuracy_counts_by_hand():
    # PatternTagger tags "cross" VB and "filled" VBN; everything else here right
    acc = tagger_accuracy(["A red cross .", "A filled circle ."])
    # counted tokens: A red cross A filled circle -> gold content: red cross filled circle
    assert acc["tokens"] == 6 and acc["content_tokens"] == 4 and acc["unknown_tokens"] == 0
    assert acc["content_recall"] == pytest.approx(2 / 4)
    assert acc["content_precision"] == pytest.approx(1.0)
    assert acc["content_accuracy"] == pytest.approx(4 / 6)
    assert acc["noun_adjective_accuracy"] == pytest.approx(1.0)


def test_lexicon_maps_synonyms_hypernyms_and_plurals():
    from icr.data.synthetic.lexicon import SHAPE_CONCEPTS, lexicon

    lex = lexicon()
    assert lex["box"] == lex["squares"] == ("shape", "square")
    assert lex["plus sign"] == ("shape", "cross") and lex["sign"][0] == "compound"
    assert lex["figures"] == ("generic", "figure") and lex["items"] == ("generic", "item")
    assert lex["polygons"] == ("shape", "polygon") and "hexagon" in SHAPE_CONCEPTS["polygon"]
    assert lex["gray"] == lex["grey"] == ("colour", "grey") and lex["backdrop"][0] == "background"
    assert lex["big"] == ("size", "large") and lex["stripes"] == ("texture", "striped")
    assert lex["pale"] == ("tone", "light") and lex["upper"] == ("vpos", "top")


# ------------------------------------------------------------------------------ tiny encoder


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A 2-layer, 16-d BERT and its word-piece vocabulary, saved as a local folder."""
    from transformers import BertConfig, BertModel

    folder = tmp_path_factory.mktemp("tiny-bert")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(VOCAB), hidden_size=16, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=32, max_position_embeddings=64)
    BertModel(config).save_pretrained(folder)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    return str(folder)


def _oracle(model_dir: str, caption: str, word_index: np.ndarray) -> list[np.ndarray]:
    """Per selected word, its pieces' hidden states from the caption encoded alone."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModel.from_pretrained(model_dir, local_files_only=True).eval()
    enc = tok([caption.split()], is_split_into_words=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**enc).last_hidden_state[0].numpy()  # (T, D)
    ids = enc.word_ids(0)
    return [hidden[[p for p, w in enumerate(ids) if w == t]] for t in word_index if t >= 0]


def test_piece_features_match_the_encoder_caption_by_caption(tiny_model, tmp_path):
    words = select_split_words(CAPTIONS, max_words=6)
    out = word_features(CAPTIONS, words, tmp_path, model=tiny_model, batch_size=3,
                        device="cpu", show_progress=False)
    assert out.features.dtype == np.float16 and out.features.shape[2] == 16
    assert not out.mask[4].any() and not out.features[4].any()  # a caption without words
    for c, caption in enumerate(CAPTIONS):
        expected = _oracle(tiny_model, caption, words.word_index[c])
        slots = out.piece_word[c][out.mask[c]]
        assert slots.tolist() == [j for j, e in enumerate(expected) for _ in range(len(e))]
        if expected:
            np.testing.assert_allclose(out.features[c][out.mask[c]], np.concatenate(expected),
                                       atol=1e-2, rtol=1e-2)
        assert not out.features[c][~out.mask[c]].any()  # padding is zero
    # "rhombus" is three pieces in this vocabulary, one slot
    rhombus = list(words.word_index[1]).index(2)
    assert (out.piece_word[1] == rhombus).sum() == 3


def test_mean_pooling_is_the_mean_of_the_pieces(tiny_model, tmp_path):
    words = select_split_words(CAPTIONS, max_words=6)
    pieces = word_features(CAPTIONS, words, None, model=tiny_model, device="cpu",
                           show_progress=False)
    mean = word_features(CAPTIONS, words, None, model=tiny_model, pooling="mean",
                         device="cpu", show_progress=False)
    for c in range(len(CAPTIONS)):
        n = int(words.mask[c].sum())
        assert mean.piece_word[c][:n].tolist() == list(range(n))
        for j in range(n):
            expected = pieces.features[c][pieces.piece_word[c] == j].astype(np.float32).mean(0)
            np.testing.assert_allclose(mean.features[c, j], expected, atol=2e-3)
    with pytest.raises(ConfigError):
        word_features(CAPTIONS, words, None, model=tiny_model, pooling="max")


def test_cache_hit_skips_the_model_and_keys_on_inputs(tiny_model, tmp_path, monkeypatch):
    words = select_split_words(CAPTIONS, max_words=6)
    first = word_features(CAPTIONS, words, tmp_path, model=tiny_model, device="cpu",
                          show_progress=False)
    assert len(list(tmp_path.glob("words_*.npy"))) == 2  # features and piece slots

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded on a cache hit")

    monkeypatch.setattr(WordEncoder, "load", no_load)
    again = word_features(CAPTIONS, words, tmp_path, model=tiny_model, show_progress=False)
    np.testing.assert_array_equal(again.features, first.features)
    np.testing.assert_array_equal(again.piece_word, first.piece_word)
    fewer = select_split_words(CAPTIONS, max_words=2)
    with pytest.raises(AssertionError, match="cache hit"):  # other words: another key
        word_features(CAPTIONS, fewer, tmp_path, model=tiny_model, show_progress=False)
    with pytest.raises(AssertionError, match="cache hit"):  # other captions: another key
        word_features(CAPTIONS[:3] + ("a red square .",) + CAPTIONS[4:], words, tmp_path,
                      model=tiny_model, show_progress=False)


def test_missing_model_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="local"):
        WordEncoder.load(str(tmp_path / "nowhere"))


def test_selected_words_rows_must_match_captions():
    words = SelectedWords(np.zeros((1, 6), dtype=np.int64), (("NN",),), 6)
    with pytest.raises(ValueError, match="captions"):
        word_features(CAPTIONS, words, None)


# ------------------------------------------------------------------- the embedded benchmark


def test_gold_tags_know_every_word_of_the_benchmark(tmp_path):
    from icr.data.entities import load_entities
    from icr.data.synthetic import generate

    root = generate(tmp_path / "shapes", "tiny", seed=1, workers=1)
    captions = [s.text for im in load_entities(root / "entities", "train") for s in im.sentences]
    acc = tagger_accuracy(captions)
    assert acc["unknown_tokens"] == 0  # the grammar wrote no word gold_tags does not know
    assert acc["content_accuracy"] > 0.8 and acc["noun_adjective_accuracy"] > 0.8
