"""Tokeniser, vocabulary, caption augmentation and GloVe word vectors."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from icr.data.glove import embedding_matrix, load_glove
from icr.data.types import CaptionedImages
from icr.data.vocab import Vocabulary, augment_caption, tokenize
from icr.errors import ConfigError, DataError


def _split(name: str, captions: list[str]) -> CaptionedImages:
    return CaptionedImages(
        split=name,
        image_ids=("img.png",),
        captions=tuple(captions),
        caption_ids=tuple(range(len(captions))),
        caption_image=np.zeros(len(captions), dtype=np.int64),
    )


TRAIN = _split("train", ["A red circle.", "a red square, left", "A blue circle"])
TEST = _split("test", ["a purple hexagon"])


def test_tokenize_lowercases_and_splits_on_non_alphanumerics():
    assert tokenize("A man's hat, 2 DOGS!") == ["a", "man", "s", "hat", "2", "dogs"]
    assert tokenize("  ") == []


def test_vocabulary_from_train_only():
    vocab = Vocabulary.from_train(TRAIN)
    assert vocab.itos[:4] == ("<pad>", "<start>", "<end>", "<unk>")
    assert vocab.pad_id == 0
    assert "purple" not in vocab
    ids = vocab.encode(TEST.captions[0], add_start_end=False)
    assert ids == [vocab.stoi["a"], vocab.unk_id, vocab.unk_id]
    with pytest.raises(ConfigError, match="training split"):
        Vocabulary.from_train(TEST)


def test_min_count_and_deterministic_order():
    vocab = Vocabulary.build(TRAIN.captions, min_count=2)
    # "a" 3 times, "circle" and "red" twice (ties alphabetical); singletons dropped.
    assert vocab.itos[4:] == ("a", "circle", "red")
    assert vocab.encode("blue circle") == [1, 3, vocab.stoi["circle"], 2]


def test_encode_decode_round_trip(tmp_path):
    vocab = Vocabulary.from_train(TRAIN)
    ids = vocab.encode("A red square, left!")
    assert ids[0] == vocab.start_id and ids[-1] == vocab.end_id
    assert vocab.decode(ids) == "a red square left"
    assert vocab.decode(ids, skip_special=False) == "<start> a red square left <end>"
    assert vocab.decode(vocab.encode("a green square")) == "a <unk> square"

    vocab.save(tmp_path / "vocab.json")
    loaded = Vocabulary.load(tmp_path / "vocab.json")
    assert loaded.itos == vocab.itos and loaded.min_count == vocab.min_count
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="bad.json"):
        Vocabulary.load(tmp_path / "bad.json")


def test_augmentation_identity_at_zero_and_seeded():
    ids = list(range(10, 40))
    assert augment_caption(ids, 3, random.Random(0), p_unk=0.0, p_drop=0.0) == ids

    a = augment_caption(ids, 3, random.Random(7))
    b = augment_caption(ids, 3, random.Random(7))
    assert a == b
    assert a != augment_caption(ids, 3, random.Random(8))
    assert len(a) == 30 - 3  # int(30 * 0.1) tokens deleted
    kept = [i for i in a if i != 3]
    assert kept == sorted(kept) and set(kept) <= set(ids)  # order preserved, no invented tokens
    assert ids == list(range(10, 40))  # input untouched


def test_augmentation_rates():
    rng = random.Random(0)
    ids = list(range(4, 104))
    out = [augment_caption(ids, 3, rng) for _ in range(200)]
    unk_rate = np.mean([t == 3 for o in out for t in o])
    assert 0.07 < unk_rate < 0.13
    assert all(len(o) == 90 for o in out)


def _write_glove(path, rows):
    path.write_text("".join(f"{w} " + " ".join(f"{x:.3f}" for x in v) + "\n" for w, v in rows))


def test_glove_text_file_and_oov(tmp_path):
    glove_file = tmp_path / "tiny.txt"
    _write_glove(glove_file, [("red", [1, 2, 3]), ("circle", [4, 5, 6]), ("a", [0.5, 0.5, 0.5])])
    vectors = load_glove(glove_file, dim=3, cache_dir=tmp_path / "cache")
    assert vectors.dim == 3 and vectors.words == ("red", "circle", "a")
    cached = load_glove(glove_file, dim=3, cache_dir=tmp_path / "cache")  # from the .npy
    np.testing.assert_array_equal(cached.vectors, vectors.vectors)

    vocab = Vocabulary.from_train(TRAIN)
    weight = embedding_matrix(vocab, vectors, 3, torch.Generator().manual_seed(0))
    assert weight.shape == (len(vocab), 3)
    torch.testing.assert_close(weight[vocab.stoi["circle"]], torch.tensor([4.0, 5.0, 6.0]))
    assert torch.all(weight[vocab.pad_id] == 0)
    oov = weight[vocab.stoi["blue"]]
    assert 0 < oov.abs().max() < 1  # small random vector
    again = embedding_matrix(vocab, vectors, 3, torch.Generator().manual_seed(0))
    torch.testing.assert_close(again, weight)  # seeded

    with pytest.raises(ConfigError, match=r"300.*3-d"):
        load_glove(glove_file, dim=300)
    with pytest.raises(ConfigError, match=r"50.*3-d"):
        embedding_matrix(vocab, vectors, 50, torch.Generator())


def test_glove_malformed_file(tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_text("red 1 2 3\ncircle 1 2\n")
    with pytest.raises(DataError, match="bad.txt:2"):
        load_glove(bad)
    with pytest.raises(DataError, match="does not exist"):
        load_glove(tmp_path / "missing.txt")


def test_bundled_glove_6b_50d():
    vectors = load_glove(dim=50)
    assert vectors.dim == 50 and len(vectors.words) == 400_000
    row = vectors.index()["the"]
    # The first values of "the" in Stanford's glove.6B.50d.txt.
    np.testing.assert_allclose(vectors.vectors[row, :3], [0.418, 0.24968, -0.41242], rtol=1e-6)
    vocab = Vocabulary.from_train(TRAIN)
    weight = embedding_matrix(vocab, vectors, 50, torch.Generator().manual_seed(0))
    np.testing.assert_array_equal(
        weight[vocab.stoi["circle"]].numpy(), vectors.vectors[vectors.index()["circle"]]
    )


def test_a_glove_file_is_checked_cheaply_before_anything_starts(tmp_path):
    from icr.data.glove import check_glove_file
    from icr.errors import DataError

    good = tmp_path / "good.txt"
    good.write_text("the 0.1 0.2\nçà 0.3 0.4\n", encoding="utf-8")
    check_glove_file(good)
    check_glove_file(good, head=13)  # a multi-byte character cut at the end of the head is fine
    latin = tmp_path / "latin.txt"
    latin.write_bytes("the 0.1 0.2\nçà 0.3 0.4\n".encode("latin-1"))
    with pytest.raises(DataError, match="latin.txt: not UTF-8 text"):
        check_glove_file(latin)
    words = tmp_path / "words.txt"
    words.write_text("just some words\n")
    with pytest.raises(DataError, match="words.txt:1: expected a word and numbers"):
        check_glove_file(words)
