"""ROUGE-L relevance (TERN protocol): hand-computed cases, a brute-force oracle, the cache."""

from __future__ import annotations

import random

import numpy as np
import pytest

from icr.errors import DataError
from icr.metrics import relevance
from icr.metrics.relevance import cached_relevance, lcs_matrix, rouge_l_relevance

B2 = 1.2**2


def _lcs(a: list, b: list) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = (
                table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
            )
    return table[-1][-1]


def _rouge_l(query: str, refs: list[str], beta: float = 1.2) -> float:
    """pycocoevalcap's Rouge.calc_score, with 0 for empty token lists."""
    q = query.lower().split()
    precisions, recalls = [], []
    for ref in refs:
        r = ref.lower().split()
        lcs = _lcs(q, r)
        precisions.append(lcs / len(q) if q else 0.0)
        recalls.append(lcs / len(r) if r else 0.0)
    p, rec = max(precisions), max(recalls)
    if p == 0 or rec == 0:
        return 0.0
    return (1 + beta**2) * p * rec / (rec + beta**2 * p)


def test_hand_computed_scores():
    queries = ["a red circle", "A dog runs on the grass", "blue square", "A Red Circle"]
    images = [
        ["a red square", "the red circle is big"],
        ["dog runs", "a cat sits on the mat by the grass"],
    ]
    scores = rouge_l_relevance(queries, images)
    # "a red circle" (3 tokens) vs image 0:
    #   "a red square":          LCS = 2 ("a red"),      P = 2/3, R = 2/3
    #   "the red circle is big": LCS = 2 ("red circle"), P = 2/3, R = 2/5
    #   P = 2/3, R = 2/3 -> F = 2.44 * 4/9 / (2/3 * 2.44) = 2/3
    assert scores[0, 0] == pytest.approx(2 / 3, abs=1e-6)
    # "a dog runs on the grass" (6 tokens) vs image 1, P and R from different references:
    #   "dog runs":                           LCS = 2,                       P = 2/6, R = 2/2
    #   "a cat sits on the mat by the grass": LCS = 4 ("a on the grass"),    P = 4/6, R = 4/9
    #   P = 2/3, R = 1 -> F = 2.44 * 2/3 / (1 + 1.44 * 2/3) = 1.626667 / 1.96 = 0.829932
    assert scores[1, 1] == pytest.approx(0.829932, abs=1e-6)
    # "blue square" vs image 0: "a red square" LCS = 1, P = 1/2, R = 1/3; the other ref LCS = 0
    #   F = 2.44 * 1/6 / (1/3 + 1.44 / 2) = 0.406667 / 1.053333 = 0.386076
    assert scores[2, 0] == pytest.approx(0.386076, abs=1e-6)
    # No shared token with image 1.
    assert scores[2, 1] == 0.0
    # Lower-casing: same tokens as the first query.
    assert scores[3, 0] == scores[0, 0]


def test_own_image_scores_one():
    images = [["a red circle"], ["a blue square"]]
    queries = ["a green triangle", "a blue square"]
    scores = rouge_l_relevance(queries, images, query_image=[0, 1])
    assert scores[0, 0] == 1.0  # no overlap beyond "a", still its own image
    assert scores[1, 1] == 1.0
    assert 0.0 < scores[0, 1] < 1.0


@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force(seed, monkeypatch):
    if seed >= 3:  # several query chunks and several bit-parallel blocks per chunk
        monkeypatch.setattr(relevance, "_QUERY_CHUNK", 5)
        monkeypatch.setattr(relevance, "_BLOCK_ELEMENTS", 40)
    rng = random.Random(seed)
    words = ["a", "b", "c", "d", "e", "f", "g"]

    def caption(max_len: int) -> str:
        return " ".join(rng.choice(words) for _ in range(rng.randint(0, max_len)))

    long = seed % 2 == 1  # some captions beyond 64 tokens take the plain-DP path
    queries = [caption(80 if long and k == 0 else 14) for k in range(12)]
    images = [
        [caption(80 if long and j == 1 else 14) for _ in range(rng.randint(1, 5))] for j in range(7)
    ]
    own = [rng.randrange(7) for _ in queries]
    expected = np.array([[_rouge_l(q, refs) for refs in images] for q in queries])
    expected[np.arange(len(queries)), own] = 1.0
    scores = rouge_l_relevance(queries, images, query_image=own)
    assert scores.dtype == np.float32 and scores.shape == (12, 7)
    np.testing.assert_allclose(scores, expected, atol=1e-6)


def test_lcs_matrix_word_boundary():
    rng = np.random.default_rng(0)
    queries = [list(rng.integers(0, 3, n)) for n in (1, 63, 64, 65, 100)]
    refs = [list(rng.integers(0, 3, n)) for n in (0, 1, 10, 64, 70)]
    got = lcs_matrix(queries, refs, vocab_size=3)
    expected = [[_lcs(q, r) for r in refs] for q in queries]
    np.testing.assert_array_equal(got, expected)


def test_no_images():
    assert rouge_l_relevance(["a b"], []).shape == (1, 0)


def test_bad_inputs_raise():
    with pytest.raises(DataError, match="image 1"):
        rouge_l_relevance(["a b"], [["a"], []])
    with pytest.raises(DataError, match="query_image"):
        rouge_l_relevance(["a b", "c"], [["a"]], query_image=[0])


def test_cache_hit_and_key(tmp_path, monkeypatch):
    images = [["a red circle", "a circle"], ["a blue square"]]
    queries = ["a red circle", "a blue square"]
    first = cached_relevance(queries, images, [0, 1], tmp_path)
    assert len(list(tmp_path.glob("rouge_l_*.npy"))) == 1
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind

    def fail(*args, **kwargs):
        raise AssertionError("recomputed on a cache hit")

    monkeypatch.setattr(relevance, "rouge_l_relevance", fail)
    np.testing.assert_array_equal(cached_relevance(queries, images, [0, 1], tmp_path), first)
    monkeypatch.undo()
    cached_relevance(queries, images, None, tmp_path)
    cached_relevance(["a red square", "a blue square"], images, [0, 1], tmp_path)
    assert len(list(tmp_path.glob("rouge_l_*.npy"))) == 3
