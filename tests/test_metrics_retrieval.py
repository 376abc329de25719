"""Retrieval metrics: the vectorised, chunked code against a plain per-query loop, and hand cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from icr.metrics import (
    group_captions,
    ndcg_at_k,
    query_ranks,
    retrieval,
    retrieval_metrics,
    stable_topk,
)

KS = (1, 5, 10)


# ---------------------------------------------------------------- the oracle: one query at a time


def _ranking(scores: list[float]) -> list[int]:
    """Candidate indices, best first (tie-free scores)."""
    return sorted(range(len(scores)), key=lambda j: -scores[j])


def _query_stats(order: list[int], positives: set[int]) -> dict[str, float]:
    """Best rank, R-precision and AP@5 of one query, by walking down its ranking.

    ``ap5`` divides by min(5, #positives) (``i2t_mAPnorm_at_5``); ``ap5_hits`` by the number of
    positives in the top 5, 0 without any (the ECIR code, ``i2t_mAP_at_5``).
    """
    best, hits, ap, in_top_r, hits_at_5, ap_r = None, 0, 0.0, 0, 0, 0.0
    for rank, cand in enumerate(order, start=1):
        if cand not in positives:
            continue
        best = rank if best is None else best
        hits += 1
        ap += hits / rank if rank <= 5 else 0.0
        hits_at_5 += rank <= 5
        in_top_r += rank <= len(positives)
        ap_r += hits / rank if rank <= len(positives) else 0.0
    return {
        "best": best,
        "rprec": in_top_r / len(positives),
        "map_r": ap_r / len(positives),
        "ap5": ap / min(5, len(positives)),
        "ap5_hits": ap / hits_at_5 if hits_at_5 else 0.0,
    }


def _ndcg(order: list[int], rel: list[float], k: int = 25) -> float:
    dcg = sum((2 ** rel[c] - 1) / math.log2(r + 1) for r, c in enumerate(order[:k], start=1))
    ideal = sorted(rel, reverse=True)[:k]
    idcg = sum((2**g - 1) / math.log2(r + 1) for r, g in enumerate(ideal, start=1))
    return dcg / idcg if idcg > 0 else 0.0


def _summary(prefix: str, best: list[int], ks: tuple[int, ...]) -> dict[str, float]:
    out = {f"{prefix}R_at_{k}": 100.0 * sum(b <= k for b in best) / len(best) for k in ks}
    return out


def oracle(sims, caption_image, ks=KS, relevance=None, ext_i2t=None, ext_t2i=None):
    """The whole protocol with plain Python loops over queries."""
    s = sims.tolist()
    cap_img = caption_image.tolist()
    n_img, n_cap = len(s), len(cap_img)
    own = [{j for j in range(n_cap) if cap_img[j] == i} for i in range(n_img)]
    i2t = [_query_stats(_ranking(s[i]), own[i]) for i in range(n_img)]
    columns = [[s[i][j] for i in range(n_img)] for j in range(n_cap)]
    t2i = [_query_stats(_ranking(columns[j]), {cap_img[j]}) for j in range(n_cap)]
    out = {}
    for prefix, stats in (("i2t_", i2t), ("t2i_", t2i)):
        best = [q["best"] for q in stats]
        out.update(_summary(prefix, best, ks))
        out[f"{prefix}medr"] = float(math.floor(np.median(best)))
        out[f"{prefix}meanr"] = float(np.mean(best))
    out["rsum"] = sum(out[f"{d}_R_at_{k}"] for d in ("i2t", "t2i") for k in ks)
    for d in ("i2t", "t2i"):
        out[f"{d}_avg_recall"] = sum(out[f"{d}_R_at_{k}"] for k in ks) / len(ks)
    out["i2t_rprec"] = 100.0 * np.mean([q["rprec"] for q in i2t])
    out["i2t_mAP_at_5"] = 100.0 * np.mean([q["ap5_hits"] for q in i2t])
    out["i2t_mAPnorm_at_5"] = 100.0 * np.mean([q["ap5"] for q in i2t])
    if relevance is not None:
        rel = relevance.tolist()
        scores = [_ndcg(_ranking(columns[j]), rel[j]) for j in range(n_cap)]
        out["t2i_nDCG_at_25"] = 100.0 * np.mean(scores)
    if ext_i2t is not None:
        stats = [_query_stats(_ranking(s[i]), own[i] | set(ext_i2t[i])) for i in range(n_img)]
        out.update(_summary("cxc_i2t_", [q["best"] for q in stats], ks))
        out["cxc_i2t_rprec"] = 100.0 * np.mean([q["rprec"] for q in stats])
        out["cxc_i2t_mAP_at_R"] = 100.0 * np.mean([q["map_r"] for q in stats])
    if ext_t2i is not None:
        stats = [
            _query_stats(_ranking(columns[j]), {cap_img[j], *ext_t2i[j]}) for j in range(n_cap)
        ]
        out.update(_summary("cxc_t2i_", [q["best"] for q in stats], ks))
        out["cxc_t2i_rprec"] = 100.0 * np.mean([q["rprec"] for q in stats])
        out["cxc_t2i_mAP_at_R"] = 100.0 * np.mean([q["map_r"] for q in stats])
    return out


# ---------------------------------------------------------------- fixtures


def _random_split(counts: list[int], seed: int, signal: float = 1.5):
    """Tie-free sims (distinct integers) with some signal, and a shuffled caption -> image map.

    ``counts[i]`` captions belong to image i.
    """
    g = torch.Generator().manual_seed(seed)
    n_img = len(counts)
    caption_image = torch.arange(n_img).repeat_interleave(torch.tensor(counts))
    caption_image = caption_image[torch.randperm(len(caption_image), generator=g)]  # (N_cap,)
    match = (caption_image[None, :] == torch.arange(n_img)[:, None]).double()  # (N_img, N_cap)
    raw = torch.randn(match.shape, generator=g, dtype=torch.float64) + signal * match
    sims = raw.flatten().argsort().argsort().reshape(match.shape).float()  # distinct, exact
    return sims, caption_image, g


@pytest.fixture(scope="module")
def split():
    sims, caption_image, g = _random_split([5] * 40, seed=0)
    n_img, n_cap = sims.shape
    rel = torch.rand(n_cap, n_img, generator=g) * (torch.rand(n_cap, n_img, generator=g) < 0.2)
    rel[torch.arange(n_cap), caption_image] = 1.0
    rel[:3] = 0.0  # queries whose ideal DCG is 0
    ext_i2t = [
        torch.randint(n_cap, (int(torch.randint(4, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n_img)
    ]
    ext_t2i = [
        torch.randint(n_img, (int(torch.randint(3, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n_cap)
    ]
    return sims, caption_image, rel.numpy(), ext_i2t, ext_t2i


# ---------------------------------------------------------------- oracle comparisons


def test_matches_loop_oracle_on_every_key(split):
    sims, caption_image, rel, ext_i2t, ext_t2i = split
    got = retrieval_metrics(
        sims, caption_image, relevance=rel, extended_i2t=ext_i2t, extended_t2i=ext_t2i, chunk_size=7
    )
    want = oracle(sims, caption_image, relevance=rel, ext_i2t=ext_i2t, ext_t2i=ext_t2i)
    assert set(got) == set(want)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-9, abs=1e-9), key
    assert 0 < got["i2t_R_at_1"] < 100 and 0 < got["t2i_R_at_1"] < 100  # the oracle test bites


def test_uneven_captions_per_image_match_oracle():
    sims, caption_image, _ = _random_split([8, 1, 2, 3, 6, 5, 4, 7], seed=1)
    got = retrieval_metrics(sims, caption_image, chunk_size=3)
    want = oracle(sims, caption_image)
    for key in want:
        assert got[key] == pytest.approx(want[key], rel=1e-9), key


@pytest.mark.parametrize("chunk_size", [1, 3, 64, 10_000])
def test_chunk_size_does_not_change_the_result(split, chunk_size):
    sims, caption_image, rel, ext_i2t, ext_t2i = split
    kwargs = dict(relevance=rel, extended_i2t=ext_i2t, extended_t2i=ext_t2i)
    reference = retrieval_metrics(sims, caption_image, chunk_size=1024, **kwargs)
    got = retrieval_metrics(sims, caption_image, chunk_size=chunk_size, **kwargs)
    assert set(got) == set(reference)
    for key, value in reference.items():
        if "R_at_" in key or key in ("rsum", "i2t_medr", "t2i_medr", "i2t_meanr", "t2i_meanr"):
            assert got[key] == value, key  # counts of integer ranks: no rounding to differ
        else:  # per-query floats (nDCG, AP) may be summed in another order by another chunking
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_transposing_in_small_blocks_does_not_change_the_result(split, monkeypatch):
    sims, caption_image, rel, ext_i2t, ext_t2i = split
    kwargs = dict(relevance=rel, extended_i2t=ext_i2t, extended_t2i=ext_t2i, chunk_size=16)
    reference = retrieval_metrics(sims, caption_image, **kwargs)
    # chunks of 16 captions transposed 5 at a time: blocks of 5, 5, 5 and 1
    monkeypatch.setattr(retrieval, "TRANSPOSE_WIDTH", 5)
    assert retrieval_metrics(sims, caption_image, **kwargs) == reference


def test_relevance_as_tensor_equals_array(split):
    sims, caption_image, rel, _, _ = split
    a = retrieval_metrics(sims, caption_image, relevance=rel)
    b = retrieval_metrics(sims, caption_image, relevance=torch.from_numpy(rel).double())
    assert a["t2i_nDCG_at_25"] == pytest.approx(b["t2i_nDCG_at_25"], rel=1e-6)


# ---------------------------------------------------------------- hand-computed cases


def test_hand_case_two_images_four_captions():
    # captions 0 and 3 belong to image 1, captions 1 and 2 to image 0
    caption_image = torch.tensor([1, 0, 0, 1])
    sims = torch.tensor([[0.9, 0.8, 0.1, 0.2], [0.3, 0.7, 0.6, 0.5]])
    # image 0: order c0 c1 c3 c2 -> positives at 2, 4; image 1: order c1 c2 c3 c0 -> 3, 4
    # captions: c0 -> image 1 second, c1 -> image 0 first, c2 -> image 0 second, c3 -> first
    m = retrieval_metrics(sims, caption_image, ks=(1, 2, 3))
    assert (m["i2t_R_at_1"], m["i2t_R_at_2"], m["i2t_R_at_3"]) == (0.0, 50.0, 100.0)
    assert (m["t2i_R_at_1"], m["t2i_R_at_2"], m["t2i_R_at_3"]) == (50.0, 100.0, 100.0)
    assert m["rsum"] == 400.0
    assert (m["i2t_medr"], m["i2t_meanr"]) == (2.0, 2.5)  # floor(median(2, 3))
    assert (m["t2i_medr"], m["t2i_meanr"]) == (1.0, 1.5)
    assert m["i2t_rprec"] == pytest.approx(100 * (1 / 2 + 0 / 2) / 2)
    ap0 = (1 / 2 + 2 / 4) / 2  # P@2 and P@4 over min(5, 2) positives = over the 2 hits
    ap1 = (1 / 3 + 2 / 4) / 2
    assert m["i2t_mAP_at_5"] == pytest.approx(100 * (ap0 + ap1) / 2)
    assert m["i2t_mAPnorm_at_5"] == pytest.approx(100 * (ap0 + ap1) / 2)  # all positives found
    assert "t2i_rprec" not in m  # it would be R@1 again


def test_one_hot_perfect_encoder():
    g = torch.Generator().manual_seed(3)
    caption_image = torch.arange(4).repeat_interleave(5)[torch.randperm(20, generator=g)]
    images = torch.eye(4)  # (N_img, D)
    captions = torch.eye(4)[caption_image]  # (N_cap, D)
    m = retrieval_metrics(images @ captions.T, caption_image)
    assert m["rsum"] == 600.0
    assert all(m[f"{d}_R_at_{k}"] == 100.0 for d in ("i2t", "t2i") for k in KS)
    # the 5 positives tie at 1.0 with each other but beat every negative
    assert m["i2t_rprec"] == 100.0 and m["i2t_mAP_at_5"] == m["i2t_mAPnorm_at_5"] == 100.0
    assert m["i2t_medr"] == m["t2i_medr"] == m["i2t_meanr"] == m["t2i_meanr"] == 1.0


def test_ties_rank_positives_after_negatives():
    # a collapsed encoder: every similarity equal
    caption_image = torch.tensor([0, 0, 1, 1, 2, 2])
    m = retrieval_metrics(torch.ones(3, 6), caption_image, ks=(1, 4, 5))
    assert (m["i2t_R_at_1"], m["i2t_R_at_4"], m["i2t_R_at_5"]) == (0.0, 0.0, 100.0)
    assert m["t2i_R_at_1"] == 0.0 and m["t2i_meanr"] == 3.0
    # each image's 2 positives rank 5 and 6: one hit, P@5 = 1/5, over 1 hit or min(5, 2)
    assert m["i2t_rprec"] == 0.0 and m["i2t_mAP_at_5"] == pytest.approx(100 * (1 / 5))
    assert m["i2t_mAPnorm_at_5"] == pytest.approx(100 * (1 / 5) / 2)


def test_map_at_5_normalisations_hand_case():
    # image 0 owns captions 0-4, image 1 captions 5-9; image 0 finds only caption 2 in its top 5
    scores = torch.tensor([[0.1, 0.2, 0.85, 0.3, 0.05, 0.9, 0.95, 0.4, 0.35, 0.33]])
    best, ranks = query_ranks(scores, torch.tensor([[0, 1, 2, 3, 4]]), depth=5)
    assert best.tolist() == [3]  # 0.95, 0.9, then caption 2
    # one hit at rank 3: P@3 = 1/3, over the 1 hit (ECIR code) or over min(5, 5) positives
    assert retrieval.average_precision_of_hits(ranks, 5).item() == pytest.approx(1 / 3)
    assert retrieval.average_precision_at_k(ranks, torch.tensor([5]), 5).item() == pytest.approx(
        1 / 15
    )
    # image 1 ranks its 5 captions first: AP 1 under both
    image1 = torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.9, 0.8, 0.7, 0.6]])
    caption_image = torch.tensor([0] * 5 + [1] * 5)
    m = retrieval_metrics(torch.cat([scores, image1]), caption_image, ks=(1,))
    assert m["i2t_mAP_at_5"] == pytest.approx(100 * (1 / 3 + 1) / 2)  # 66.7
    assert m["i2t_mAPnorm_at_5"] == pytest.approx(100 * (1 / 15 + 1) / 2)  # 53.3


def test_map_at_5_without_hits_is_zero():
    ranks = torch.tensor([[6.0, 9.0, math.inf], [1.0, 7.0, math.inf]])
    got = retrieval.average_precision_of_hits(ranks, 5)
    assert got.tolist() == [0.0, 1.0]  # a single hit at rank 1 scores 1 whatever it missed
    assert retrieval.average_precision_at_k(ranks, torch.tensor([2, 2]), 5).tolist() == [0.0, 0.5]


def test_query_ranks_tie_order():
    scores = torch.tensor([[0.5, 0.9, 0.5, 0.5, 0.1]])
    positives = torch.tensor([[3, 0, -1]])  # positive 0 and 3 tie with negative 2 at 0.5
    best, ranks = query_ranks(scores, positives, depth=5)
    # order: 1 (0.9), 2 (neg, 0.5), 0 (pos, lower index), 3 (pos), 4
    assert best.tolist() == [3]
    assert ranks.tolist() == [[4.0, 3.0, math.inf]]


def test_query_ranks_beyond_depth_are_inf():
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]])
    best, ranks = query_ranks(scores, torch.tensor([[7, 1]]), depth=1)
    assert best.tolist() == [2]
    assert ranks.tolist() == [[math.inf, 2.0]]


def test_ndcg_hand_case():
    scores = torch.tensor([[0.1, 0.9, 0.5, 0.3]])  # ranking: 1, 2, 3, 0
    rel = torch.tensor([[1.0, 0.0, 0.5, 0.25]])
    g = [2**1.0 - 1, 2**0.5 - 1, 2**0.25 - 1]  # gains by relevance, largest first
    dcg = 0 / math.log2(2) + g[1] / math.log2(3) + g[2] / math.log2(4) + g[0] / math.log2(5)
    idcg = g[0] / math.log2(2) + g[1] / math.log2(3) + g[2] / math.log2(4)
    assert ndcg_at_k(scores, rel, k=25).item() == pytest.approx(dcg / idcg)
    # cut-off 2: only the first two retrieved count, against the two best gains
    assert ndcg_at_k(scores, rel, k=2).item() == pytest.approx(
        (g[1] / math.log2(3)) / (g[0] + g[1] / math.log2(3))
    )
    assert ndcg_at_k(scores, torch.zeros(1, 4), k=25).item() == 0.0


def test_stable_topk_breaks_ties_by_index():
    scores = torch.tensor([[1.0, 2.0, 2.0, 0.0, 2.0], [3.0, 1.0, 2.0, 0.0, 5.0]])
    assert stable_topk(scores, 2).tolist() == [[1, 2], [4, 0]]


def test_extended_positives_hand_case():
    caption_image = torch.tensor([1, 0, 0, 1])
    sims = torch.tensor([[0.9, 0.8, 0.1, 0.2], [0.3, 0.7, 0.6, 0.5]])
    # image 0 gains caption 0 (its top) -> hit at 1, positives {0, 1, 2} with R = 3: top 3 = c0 c1 c3
    # caption 1 gains image 1 (already second): R@1 still a hit, R-precision 2/2
    m = retrieval_metrics(
        sims, caption_image, ks=(1,), extended_i2t=[[0], []], extended_t2i=[[], [1], [], [1]]
    )
    assert m["cxc_i2t_R_at_1"] == 50.0  # image 1 still ranks its best positive third
    assert m["cxc_i2t_rprec"] == pytest.approx(100 * (2 / 3 + 0 / 2) / 2)
    assert m["cxc_t2i_R_at_1"] == 50.0  # duplicate own image in extended_t2i[3] is ignored
    assert m["cxc_t2i_rprec"] == pytest.approx(100 * (0 + 2 / 2 + 0 + 1) / 4)
    # mAP@R: image 0 finds positives at 1 and 2 of R = 3 (P@1 = P@2 = 1), image 1 none in its
    # top 2; captions 1 and 3 rank all their positives first, captions 0 and 2 none
    assert m["cxc_i2t_mAP_at_R"] == pytest.approx(100 * ((1 + 1) / 3 + 0) / 2)
    assert m["cxc_t2i_mAP_at_R"] == pytest.approx(100 * (0 + 1 + 0 + 1) / 4)


def test_map_at_r_hand_cases():
    from icr.metrics.retrieval import map_at_r

    # R = 3, ranking 0 (pos), 1, 2 (pos), 3, 4 (pos): (P@1 + P@3) / R = (1 + 2/3) / 3
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5]])
    assert map_at_r(scores, torch.tensor([[4, 0, 2]])).item() == pytest.approx(5 / 9)
    # ties: the negative 2 ranks before the positives 0 and 1 tied with it: ranks 2 and 3, R = 2
    scores = torch.tensor([[0.5, 0.5, 0.5, 0.1], [0.5, 0.5, 0.1, 0.1]])
    got = map_at_r(scores, torch.tensor([[0, 1], [1, -1]]))
    assert got[0].item() == pytest.approx((1 / 2) / 2)
    assert got[1].item() == 0.0  # one positive tied with a negative: rank 2 > R = 1


@pytest.mark.parametrize(
    "sims",
    [
        torch.randn(30, 300, generator=torch.Generator().manual_seed(5)),
        torch.randint(0, 6, (30, 300), generator=torch.Generator().manual_seed(6)).float(),
        torch.ones(30, 300),
    ],
    ids=["tie-free", "many-ties", "constant"],
)
@pytest.mark.parametrize("k", [1, 7, 26, 300])
def test_stable_topk_equals_stable_sort(sims, k):
    want = sims.sort(dim=1, descending=True, stable=True).indices[:, :k]  # by value, then index
    assert torch.equal(stable_topk(sims, k), want)
    assert torch.equal(stable_topk(sims, k, top=sims.topk(min(k + 5, 300), dim=1)), want)


def test_t2i_with_ties_matches_loop_with_stable_order():
    # 4 images with tied scores for every caption: nDCG ranks them by image index on ties
    sims = torch.tensor(
        [[1.0, 0.0, 2.0, 0.3], [1.0, 1.0, 2.0, 0.9], [0.5, 1.0, 2.0, 0.9], [1.0, 1.0, 0.0, 0.1]]
    )
    rel = torch.tensor(
        [[0.0, 1.0, 0.5, 0.2], [0.3, 0.0, 1.0, 0.9], [0.1, 0.2, 0.3, 0.4], [0.5, 0.0, 0.7, 0.0]]
    )
    got = ndcg_at_k(sims.T.contiguous(), rel, k=2)
    order = [[0, 1], [1, 2], [0, 1], [1, 2]]  # stable order of each column, top 2
    ideal = rel.sort(dim=1, descending=True).values[:, :2]
    disc = torch.tensor([1.0, 1 / math.log2(3)])
    want = [
        float(((2 ** rel[j, order[j]] - 1) * disc).sum() / ((2 ** ideal[j] - 1) * disc).sum())
        for j in range(4)
    ]
    assert got.tolist() == pytest.approx(want)
    caption_image = torch.tensor([0, 1, 2, 3])
    m = retrieval_metrics(sims, caption_image, relevance=rel, ks=(1,), chunk_size=1)
    assert m["t2i_nDCG_at_25"] == pytest.approx(
        100 * float(ndcg_at_k(sims.T.contiguous(), rel, k=25).mean())
    )


def test_merge_positives_dedupes_sorts_and_pads():
    from icr.metrics import merge_positives

    own = torch.tensor([[2, 0, -1], [1, -1, -1], [3, -1, -1]])
    merged = merge_positives(own, [[5, 2, 5], [], [0, 9]])
    assert merged.tolist() == [[0, 2, 5], [1, -1, -1], [0, 3, 9]]


def test_group_captions_any_order():
    grouped = group_captions(torch.tensor([2, 0, 2, 1, 0]), 3)
    assert grouped.tolist() == [[1, 4], [3, -1], [0, 2]]


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(caption_image=torch.tensor([0, 0, 0, 0])), "no caption"),
        (dict(caption_image=torch.tensor([0, 1, 2, 1])), r"\[0, 2\)"),
        (dict(caption_image=torch.tensor([0, 1, 1])), "shape"),
        (dict(relevance=np.zeros((2, 4))), "relevance"),
        (dict(extended_t2i=[[0]]), "extended_t2i"),
        (dict(sims=torch.tensor([[0.1, math.nan, 0.3, 0.4], [0.1, 0.2, 0.3, 0.4]])), "NaN"),
    ],
)
def test_bad_inputs_raise_one_line(change, match):
    kwargs = dict(sims=torch.rand(2, 4), caption_image=torch.tensor([0, 1, 0, 1])) | change
    with pytest.raises(ValueError, match=match):
        retrieval_metrics(kwargs.pop("sims"), kwargs.pop("caption_image"), **kwargs)


# ---------------------------------------------------------------- ECCV Caption's own functions


def _eccv(scores: torch.Tensor, positives: list[set[int]]) -> dict[str, float]:
    """mAP@R, R-Precision and R@1 by ``eccv_caption``, on rankings in the module's tie order
    (score descending, negatives before positives, then by index)."""
    from eccv_caption._metrics import compute_eccv_metrics

    ranked = {
        q: sorted(range(scores.shape[1]), key=lambda c: (-scores[q, c].item(), c in pos, c))
        for q, pos in enumerate(positives)
    }
    return compute_eccv_metrics(ranked, {q: sorted(p) for q, p in enumerate(positives)})


@pytest.mark.parametrize("seed", [0, 1])
def test_extended_metrics_equal_eccv_caption(seed):
    """Random similarities (tie-free), random extended positives: every query's mAP@R,
    R-Precision and R@1 as the eccv-caption package computes them, in both directions."""
    pytest.importorskip("eccv_caption")
    g = torch.Generator().manual_seed(seed)
    sims, caption_image, _ = _random_split([5] * 30, seed=seed, signal=2.0)
    sims = sims + torch.rand(sims.shape, generator=g) * 0.5  # still tie-free: integers + < 1
    n_img, n_cap = sims.shape
    ext_i2t = [torch.randint(n_cap, (int(torch.randint(12, (1,), generator=g)),), generator=g)
               .tolist() for _ in range(n_img)]
    ext_t2i = [torch.randint(n_img, (int(torch.randint(6, (1,), generator=g)),), generator=g)
               .tolist() for _ in range(n_cap)]
    got = retrieval_metrics(sims, caption_image, ks=(1,), extended_i2t=ext_i2t,
                            extended_t2i=ext_t2i, chunk_size=9)
    own_i2t = [set((caption_image == i).nonzero().flatten().tolist()) for i in range(n_img)]
    pos_i2t = [own | set(ext) for own, ext in zip(own_i2t, ext_i2t, strict=True)]
    pos_t2i = [{int(caption_image[j]), *ext_t2i[j]} for j in range(n_cap)]
    for d, scores, positives in (("i2t", sims, pos_i2t), ("t2i", sims.T, pos_t2i)):
        want = _eccv(scores, positives)
        assert got[f"cxc_{d}_mAP_at_R"] == pytest.approx(100 * want["eccv_map_at_r"], rel=1e-9)
        assert got[f"cxc_{d}_rprec"] == pytest.approx(100 * want["eccv_rprecision"], rel=1e-9)
        assert got[f"cxc_{d}_R_at_1"] == pytest.approx(100 * want["eccv_r1"], rel=1e-9)
        assert 0 < want["eccv_map_at_r"] < want["eccv_r1"] < 1  # a test that can fail


@pytest.mark.parametrize("levels", [2, 5, None])  # heavy ties, some ties, none
def test_map_at_r_equals_eccv_caption_per_query_with_ties(levels):
    """Ties in control: eccv-caption gets the rankings in the module's tie order, per query,
    with up to 31 positives of 40 candidates (counts past the top-K window included)."""
    pytest.importorskip("eccv_caption")
    from icr.metrics.retrieval import cxc_query_stats, map_at_r

    gen = torch.Generator().manual_seed(4)
    n, queries = 40, 11
    if levels is None:
        scores = torch.rand(queries, n, generator=gen)
    else:
        scores = torch.randint(0, levels, (queries, n), generator=gen).float()
    positives = torch.full((queries, 32), -1)
    for q in range(queries):
        chosen = torch.randperm(n, generator=gen)[: 1 + 3 * q]
        positives[q, : len(chosen)] = chosen
    got = map_at_r(scores, positives)
    best, rprec = cxc_query_stats(scores, positives)
    for q in range(queries):
        pos = {int(p) for p in positives[q] if p >= 0}
        want = _eccv(scores[q : q + 1], [pos])
        assert got[q].item() == pytest.approx(want["eccv_map_at_r"], rel=1e-12, abs=1e-15), q
        assert rprec[q].item() == pytest.approx(want["eccv_rprecision"], rel=1e-12), q
        assert float(best[q] == 1) == want["eccv_r1"], q


@pytest.mark.parametrize("levels", [2, 6, None])  # heavy ties, some ties, none
@pytest.mark.parametrize("window", ["own", "caller", "all"])
def test_cxc_query_stats_with_many_positives_and_ties(levels, window):
    """Vague captions are true of hundreds of images: exact ranks whatever the positive count,
    with ties at the best positive and at the R-th score running past the top-k window."""
    from icr.metrics.retrieval import cxc_query_stats

    gen = torch.Generator().manual_seed(3)
    n = 40
    if levels is None:
        scores = torch.rand(9, n, generator=gen)
    else:
        scores = torch.randint(0, levels, (9, n), generator=gen).float()
    positives = torch.full((9, n), -1)
    for q in range(9):
        chosen = torch.randperm(n, generator=gen)[: 1 + 4 * q]
        positives[q, : len(chosen)] = chosen
    width = int((positives >= 0).sum(1).max()) + 1
    top = {"own": None, "caller": scores.topk(width, dim=1).values, "all": scores.topk(n).values}
    best, rprec = cxc_query_stats(scores, positives, top[window])
    for q in range(9):
        pos = {int(p) for p in positives[q] if p >= 0}
        # negatives before positives among equal scores, then by index
        order = sorted(range(n), key=lambda c: (-scores[q, c].item(), c in pos, c))
        hits = [c in pos for c in order]
        assert best[q] == hits.index(True) + 1
        assert rprec[q] == pytest.approx(sum(hits[: len(pos)]) / len(pos))
