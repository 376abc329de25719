"""Image-caption retrieval metrics from a similarity matrix: pure, vectorised, chunked over queries.

Protocol (docs/reference-code.md, sections 1, 2 and 5; LTD paper, section 4.3 "Evaluation metrics"):

- i2t: an image query; its positives are its captions (``caption_image`` is the ground truth, never
  the diagonal). The rank of the query is the best rank among its positives.
- t2i: a caption query; its one positive is its image.
- Recall@k (percent): share of queries whose rank is at most k; ``rsum`` is the sum of the recalls;
  ``{i2t,t2i}_avg_recall`` the mean of a direction's recalls (the metric-learning paper's Table 1).
- medr / meanr: median / mean rank, ranks from 1. The median follows VSE++ (``floor(median) + 1`` of
  0-based ranks, i.e. ``floor(median)`` of 1-based ranks, which differs from the plain median only
  when the number of queries is even and the two middle ranks differ by an odd number).
- R-precision (percent): with R positives, the share of the top R candidates that are positives
  (Chun et al. 2021, as used in Table 1 of the LTD paper). i2t uses R = the image's captions (5).
  Plain t2i R-precision is not reported: with R = 1 it is R@1 again (the LTD table leaves it "-").
- mAP@5 (percent), i2t, in two normalisations, identical when every positive is in the top 5
  and different otherwise (one hit at rank 3 of 5 positives: 1/3 against 1/15):

  - ``i2t_mAP_at_5``: the mean, over the positives found in the top 5, of P@rank (their order
    among the hits over their rank), 0 when none is found. This is what the ECIR code of the
    metric-learning-losses paper computes (``shared/evaluation/utils.py``, ``average_precision``)
    and so what its Table 1 reports (e.g. 0.41 at i2t R@1 30.8): use it to compare with that paper.
  - ``i2t_mAPnorm_at_5``: AP@5 = sum_{k<=5} P@k * rel_k / min(5, #positives), the textbook
    truncated AP, which also charges for the positives missing from the top 5 (the ECIR value
    rewards a model that finds one positive at rank 1 and no other with a perfect 1.0). Use it
    for comparisons within this project.
- nDCG@25 (percent), t2i, graded relevance (TERN protocol, Messina et al. 2021): gains 2^rel - 1,
  discount log2(rank + 1), ideal DCG from the 25 largest relevances of the query's row, 0 when the
  ideal is 0.
- CxC (Parekh et al. 2021): positives extended with the CxC annotations; a hit if any positive is in
  the top k; R-precision with R = the number of positives.
- ECCV Caption (Chun et al., ECCV 2022) over the same extended positives: mAP@R (Musgrave et al.
  2020), ``cxc_{d}_mAP_at_R`` = the mean over queries of (1/R) sum_{r<=R} P@r * rel_r with R = the
  query's number of positives; its R-Precision and R@1 are ``cxc_{d}_rprec`` and
  ``cxc_{d}_R_at_1`` (the same definitions). Equal to the ``eccv-caption`` package's
  ``compute_eccv_metrics`` given the rankings in this module's order.

Every value except the ranks is in percent (0-100), also R-precision, mAP@5 and nDCG, which the
papers print as fractions: divide by 100 to compare with their tables.

Ties. Ranks follow one total order of the candidates: by score, descending; at equal scores
negatives come before positives (the pessimistic rank: 1 + the number of negatives scoring at least
as high), and positives among themselves by candidate index (which no metric depends on). Pessimistic
rather than optimistic (VSE++ counts strictly higher scores or leaves ties to argsort) so that a
collapsed encoder, whose similarities are all equal, scores R@k = 0 instead of 100 and cannot win a
hyperparameter search. nDCG has no positives: its order is by score, descending, then by candidate
index. Both orders are deterministic, on any device.

Memory: ``sims`` is never copied whole. Queries are processed ``chunk_size`` at a time; the
largest temporaries are a few ``(chunk_size, N_candidates)`` tensors (for t2i with nDCG or CxC,
the chunk's columns of ``sims`` transposed into rows). Everything stays on ``sims.device``.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

MAP_DEPTH = 5  # mAP@5, i2t
NDCG_DEPTH = 25  # nDCG@25, t2i
TRANSPOSE_WIDTH = 128  # columns of sims transposed at once for t2i (see _column_chunks)


def retrieval_metrics(
    sims: torch.Tensor,
    caption_image: torch.Tensor,
    *,
    ks: tuple[int, ...] = (1, 5, 10),
    relevance: torch.Tensor | np.ndarray | None = None,
    extended_i2t: Sequence[Sequence[int]] | None = None,
    extended_t2i: Sequence[Sequence[int]] | None = None,
    chunk_size: int = 1024,
) -> dict[str, float]:
    """All retrieval metrics of one evaluation split (see the module docstring for the protocol).

    Args:
        sims: similarity of every image to every caption, higher is more similar; finite.
        caption_image: index of each caption's image.
        ks: the k of Recall@k.
        relevance: graded relevance of every image to every caption query, for t2i nDCG@25.
        extended_i2t: per image, extra positive caption indices (CxC); its own captions stay
            positives.
        extended_t2i: per caption, extra positive image indices (CxC); its own image stays positive.
        chunk_size: queries per chunk; bounds memory, does not change the result.

    Returns:
        ``i2t_R_at_{k}``, ``t2i_R_at_{k}`` for k in ``ks``, ``rsum``, ``i2t_medr``, ``i2t_meanr``,
        ``t2i_medr``, ``t2i_meanr``, ``i2t_rprec``, ``i2t_mAP_at_5``, ``i2t_mAPnorm_at_5``;
        with ``relevance``
        ``t2i_nDCG_at_25``; with ``extended_i2t`` ``cxc_i2t_R_at_{k}``, ``cxc_i2t_rprec`` and
        ``cxc_i2t_mAP_at_R``; with ``extended_t2i`` the same for ``cxc_t2i_``.

    Shapes:
        sims: ``(N_img, N_cap)``; caption_image: ``(N_cap,)`` int; relevance: ``(N_cap, N_img)``;
        ``len(extended_i2t) == N_img``; ``len(extended_t2i) == N_cap``.

    References:
        LTD paper (Bleeker & de Rijke), section 4.3 and Table 1; Faghri et al. 2018 (VSE++) for the
        Recall@k / medr protocol; Messina et al. 2021 (TERN) for nDCG; Parekh et al. 2021 (CxC);
        Chun et al. 2022 (ECCV Caption) for mAP@R over extended positives.

    Raises:
        ValueError: mismatched shapes, an image without captions, an index out of range, or a
            non-finite similarity (a diverged model must not score R@1 = 100).
    """
    _check_inputs(sims, caption_image, ks, relevance, extended_i2t, extended_t2i, chunk_size)
    n_img, n_cap = sims.shape
    device = sims.device
    caption_image = caption_image.to(device=device, dtype=torch.long)  # (N_cap,)
    own_captions = group_captions(caption_image, n_img)  # (N_img, P)
    own_image = caption_image[:, None]  # (N_cap, 1)

    cxc_i2t = None if extended_i2t is None else merge_positives(own_captions, extended_i2t)
    cxc_t2i = None if extended_t2i is None else merge_positives(own_image, extended_t2i)
    # Without nDCG or CxC, t2i needs no top-k: its ranks are counted on the row chunks, caption j
    # ranking its image at the number of images scoring at least as high (negatives first on ties).
    t2i_by_columns = relevance is not None or cxc_t2i is not None
    own_image_scores = sims[caption_image, torch.arange(n_cap, device=device)]  # (N_cap,)
    i2t = _scan(
        _row_chunks(sims, chunk_size), own_captions, None,
        own_depth=max(MAP_DEPTH, own_captions.shape[1]), cxc_stats=cxc_i2t,
        candidate_thresholds=None if t2i_by_columns else own_image_scores,
    )  # fmt: skip
    if t2i_by_columns:
        t2i = _scan(
            _column_chunks(sims, chunk_size), own_image, None,
            own_depth=0, cxc_stats=cxc_t2i, relevance=relevance,
        )  # fmt: skip
    else:
        t2i = {"best": i2t.pop("candidate_counts").long()}  # (N_cap,)

    metrics = recall_at_k(i2t["best"], ks, prefix="i2t_") | recall_at_k(t2i["best"], ks, "t2i_")
    metrics["rsum"] = sum(metrics.values())
    for d in ("i2t", "t2i"):  # the "average recall" of the metric-learning paper's Table 1
        metrics[f"{d}_avg_recall"] = sum(metrics[f"{d}_R_at_{k}"] for k in ks) / len(ks)
    metrics |= rank_summary(i2t["best"], prefix="i2t_") | rank_summary(t2i["best"], "t2i_")
    i2t_counts = (own_captions >= 0).sum(1)  # (N_img,)
    metrics["i2t_rprec"] = _percent(r_precision(i2t["ranks"], i2t_counts))
    ap_hits = average_precision_of_hits(i2t["ranks"], MAP_DEPTH)  # (N_img,)
    metrics[f"i2t_mAP_at_{MAP_DEPTH}"] = _percent(ap_hits)
    ap_norm = average_precision_at_k(i2t["ranks"], i2t_counts, MAP_DEPTH)  # (N_img,)
    metrics[f"i2t_mAPnorm_at_{MAP_DEPTH}"] = _percent(ap_norm)
    if relevance is not None:
        metrics[f"t2i_nDCG_at_{NDCG_DEPTH}"] = _percent(t2i["ndcg"])
    for direction, positives, scan in (("i2t", cxc_i2t, i2t), ("t2i", cxc_t2i, t2i)):
        if positives is not None:
            prefix = f"cxc_{direction}_"
            metrics |= recall_at_k(scan["cxc_best"], ks, prefix=prefix)
            metrics[f"{prefix}rprec"] = _percent(scan["cxc_rprec"])
            metrics[f"{prefix}mAP_at_R"] = _percent(scan["cxc_map_at_r"])
    return metrics


def cxc_query_stats(
    scores: torch.Tensor, positives: torch.Tensor, top_values: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank of the best positive and R-precision (R = number of positives) of each query.

    Made for CxC, where a vague caption can be true of hundreds of images, without sorting the
    candidates or comparing positives pairwise. In the module's order (score descending,
    negatives before positives on ties):

    - the best positive, of score m, ranks ``1 + #{scores >= m} - #{positives scoring m}``;
    - with t the R-th largest score, the top R holds every candidate above t and the first
      ``R - #{scores > t}`` of those scoring t, negatives first, so its positives number
      ``#{positives above t} + max(0, R - #{scores > t} - #{negatives scoring t})``.

    The counts are read off the largest ``max R + 1`` scores, and counted over all scores only
    for the queries where that window does not settle them (a best positive deeper than the
    window, or ties at t running past it).

    Args:
        scores: similarity of each query to every candidate; finite.
        positives: candidate indices, -1 padded, no repeats, at least one per query.
        top_values: ``scores.topk(K).values`` when the caller has it, used if K > max R.

    Shapes:
        scores: ``(B, N)``; positives: ``(B, P)``; top_values: ``(B, K)``; returns best ``(B,)``
        int64 ranks from 1 and R-precision ``(B,)`` float64 in [0, 1].
    """
    valid = positives >= 0  # (B, P)
    pos_scores = scores.gather(1, positives.clamp(min=0))  # (B, P)
    num_positives = valid.sum(dim=1)  # (B,) = R
    window = min(int(num_positives.max()) + 1, scores.shape[1])
    if top_values is None or top_values.shape[1] < window:
        top_values = scores.topk(window, dim=1).values  # (B, K)

    best_score = pos_scores.masked_fill(~valid, -math.inf).amax(dim=1, keepdim=True)  # (B, 1)
    ties_at_best = (valid & (pos_scores == best_score)).sum(dim=1)  # (B,)
    best = 1 + _count_at_least(scores, top_values, best_score) - ties_at_best  # (B,)

    cut = top_values.gather(1, (num_positives - 1)[:, None])  # (B, 1) t, the R-th largest score
    above = (top_values > cut).sum(dim=1)  # (B,) every score above t is in the window
    positives_above = (valid & (pos_scores > cut)).sum(dim=1)  # (B,)
    positives_at = (valid & (pos_scores == cut)).sum(dim=1)  # (B,)
    negatives_at = _count_at_least(scores, top_values, cut) - above - positives_at  # (B,)
    found = positives_above + (num_positives - above - negatives_at).clamp(min=0)  # (B,)
    return best, found.double() / num_positives


def map_at_r(
    scores: torch.Tensor, positives: torch.Tensor, top_values: torch.Tensor | None = None
) -> torch.Tensor:
    """mAP@R of each query: (1/R) sum_{r<=R} P@r * rel_r, R = its number of positives.

    In the module's order (score descending, negatives before positives on ties), the m-th
    positive by score, of score s_m, ranks ``r_m = #{negatives scoring >= s_m} + m`` (positives
    tied with it fill consecutive places, and their order among themselves does not change the
    sum), and it adds P@r_m = m / r_m when r_m <= R. The counts come from the K = max R + P
    largest scores by binary search, without sorting the candidates or comparing positives
    pairwise: where a count reaches K, r_m > R and the positive adds nothing.

    Args:
        scores: similarity of each query to every candidate; finite.
        positives: candidate indices, -1 padded, no repeats, at least one per query.
        top_values: ``scores.topk(K).values`` when the caller has it, used if K >= max R + P.

    Shapes:
        scores: ``(B, N)``; positives: ``(B, P)``; top_values: ``(B, K)``; returns ``(B,)``
        float64 in [0, 1].

    References:
        Musgrave et al., "A Metric Learning Reality Check", ECCV 2020 (mAP@R); Chun et al.,
        "ECCV Caption", ECCV 2022 (its ``eccv_caption._metrics.compute_eccv_metrics``).
    """
    valid = positives >= 0  # (B, P)
    num_positives = valid.sum(dim=1)  # (B,) = R
    width = positives.shape[1]
    window = min(int(num_positives.max()) + width, scores.shape[1])
    if top_values is None or top_values.shape[1] < window:
        top_values = scores.topk(window, dim=1).values  # (B, K)
    pos_scores = scores.gather(1, positives.clamp(min=0)).masked_fill(~valid, -math.inf)
    descending = pos_scores.sort(dim=1, descending=True).values  # (B, P), padding last
    ascending = (-descending).contiguous()  # (B, P) searchable: -s ascending
    at_least = torch.searchsorted((-top_values).contiguous(), ascending, right=True)  # (B, P)
    positives_at_least = torch.searchsorted(ascending, ascending, right=True)  # (B, P)
    m = torch.arange(1, width + 1, device=scores.device)  # (P,)
    rank = at_least - positives_at_least + m  # (B, P) r_m
    counted = (m <= num_positives[:, None]) & (rank <= num_positives[:, None])  # (B, P)
    precision = torch.where(counted, m.double() / rank.double(), 0.0)  # (B, P)
    return precision.sum(dim=1) / num_positives.double()


def _count_at_least(scores: torch.Tensor, top_values: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``#{scores >= threshold}`` per query, from the K largest scores where that count is below
    K (exact: every larger score is among them), over all scores for the other queries.

    Shapes:
        scores: ``(B, N)``; top_values: ``(B, K)``, descending; threshold: ``(B, 1)``;
        returns ``(B,)`` int64.
    """
    count = (top_values >= threshold).sum(dim=1)  # (B,)
    if top_values.shape[1] < scores.shape[1]:
        deeper = (count == top_values.shape[1]).nonzero().squeeze(1)  # (D,)
        if len(deeper):
            count[deeper] = (scores[deeper] >= threshold[deeper]).sum(dim=1)
    return count


def _row_chunks(sims: torch.Tensor, chunk_size: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """i2t queries: views of ``chunk_size`` rows."""
    for start in range(0, sims.shape[0], chunk_size):
        rows = slice(start, start + chunk_size)
        yield rows, sims[rows]  # (B, N_cap)


def _column_chunks(sims: torch.Tensor, chunk_size: int) -> Iterator[tuple[slice, torch.Tensor]]:
    """t2i queries: ``chunk_size`` columns at a time, as the rows of a transposed copy.

    The columns are copied ``TRANSPOSE_WIDTH`` at a time, each narrow block made contiguous and
    then transposed while it is in cache: on 5,000 x 25,000 this takes 0.5 s against 0.9 s for
    transposing 13,000-column blocks and 0.65 s for transposing ``sims`` whole.
    """
    n_img, n_cap = sims.shape
    for start in range(0, n_cap, chunk_size):
        stop = min(start + chunk_size, n_cap)
        chunk = torch.empty(stop - start, n_img, dtype=sims.dtype, device=sims.device)  # (B, N_img)
        for col in range(start, stop, TRANSPOSE_WIDTH):
            end = min(col + TRANSPOSE_WIDTH, stop)
            chunk[col - start : end - start].copy_(sims[:, col:end].contiguous().T)
        yield slice(start, stop), chunk


def _scan(
    chunks: Iterator[tuple[slice, torch.Tensor]],
    own: torch.Tensor,
    cxc: torch.Tensor | None,
    *,
    own_depth: int,
    cxc_depth: int = 0,
    cxc_stats: torch.Tensor | None = None,
    relevance: torch.Tensor | np.ndarray | None = None,
    candidate_thresholds: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Per-query statistics of one direction, one chunk of queries at a time.

    Each chunk is read by one top-k, shared by the rank of the best own positive, the ranks of all
    own positives up to ``own_depth``, of all CxC positives up to ``cxc_depth`` and R, and the
    nDCG ranking; only the queries whose best positive lies deeper are counted in full. With
    ``candidate_thresholds``, one more pass counts per candidate the queries scoring at least its
    threshold (the other direction's ranks).

    Returns:
        ``best`` (Q,); ``ranks`` (Q, P) when ``own_depth`` > 0; ``cxc_ranks`` (Q, P') with
        ``cxc``; ``cxc_best``, ``cxc_rprec``, ``cxc_map_at_r`` (Q,) with ``cxc_stats``; ``ndcg``
        (Q,) with ``relevance``; ``candidate_counts`` (N,) int32 with
        ``candidate_thresholds``.
    """
    parts: dict[str, list[torch.Tensor]] = {}
    counts = None
    if candidate_thresholds is not None:
        counts = torch.zeros_like(candidate_thresholds, dtype=torch.int32)  # (N,)
    depths = [max(own_depth, 1) + own.shape[1], NDCG_DEPTH + 1 if relevance is not None else 0]
    depths += [max(cxc_depth, cxc.shape[1]) + cxc.shape[1]] if cxc is not None else []
    depths += [2 * cxc_stats.shape[1]] if cxc_stats is not None else []  # >= max R + P
    for rows, scores in chunks:  # scores: (B, N)
        top = _checked_topk(scores, min(max(depths), scores.shape[1]))  # (B, K)
        own_pos = _PositiveScores.gather(scores, own[rows])
        out = {"best": own_pos.best_rank(scores, top.values)}
        if own_depth > 0:
            out["ranks"] = own_pos.ranks(top.values, scores.shape[1])
        if cxc is not None:
            cxc_pos = _PositiveScores.gather(scores, cxc[rows])
            out["cxc_ranks"] = cxc_pos.ranks(top.values, scores.shape[1])
        if cxc_stats is not None:
            out["cxc_best"], out["cxc_rprec"] = cxc_query_stats(scores, cxc_stats[rows], top.values)
            out["cxc_map_at_r"] = map_at_r(scores, cxc_stats[rows], top.values)
        if relevance is not None:
            rel = _as_tensor(relevance[rows], scores.device)  # (B, N)
            out["ndcg"] = ndcg_of_ranking(stable_topk(scores, NDCG_DEPTH, top=top), rel)
        if counts is not None:
            counts += (scores >= candidate_thresholds).sum(dim=0, dtype=torch.int32)  # (N,)
        for key, value in out.items():
            parts.setdefault(key, []).append(value)
    result = {key: torch.cat(values) for key, values in parts.items()}
    return result if counts is None else result | {"candidate_counts": counts}


def _checked_topk(scores: torch.Tensor, k: int) -> torch.return_types.topk:
    """``scores.topk(k)``; raises on NaN or +inf, which topk sorts first."""
    top = scores.topk(k, dim=1)  # (B, k)
    if not torch.isfinite(top.values[:, 0]).all():
        raise ValueError("similarity matrix holds NaN or +inf: the model has diverged")
    return top


class _PositiveScores:
    """The positives of a batch of queries and their ties, for ranks in the module's tie order.

    With negatives first among equal scores, the rank of positive p is
    ``1 + #{candidates scoring >= s_p} - #{positives scoring = s_p} + #{positives q < p scoring =
    s_p}`` (the last two terms place p among the positives it ties with, by index).

    Shapes:
        pos_scores: ``(B, P)``; positives: ``(B, P)`` candidate indices, -1 padded, no repeats.
    """

    def __init__(self, pos_scores: torch.Tensor, positives: torch.Tensor) -> None:
        self.valid = positives >= 0  # (B, P)
        self.scores = pos_scores.masked_fill(~self.valid, -math.inf)  # (B, P)
        tied = (self.scores[:, None, :] == self.scores[:, :, None]) & self.valid[:, None, :]
        self.num_tied = tied.sum(dim=2)  # (B, P), counts p itself
        earlier = positives[:, None, :] < positives[:, :, None]  # (B, P, P)
        self.tied_before = (tied & earlier).sum(dim=2)  # (B, P)

    @classmethod
    def gather(cls, scores: torch.Tensor, positives: torch.Tensor) -> _PositiveScores:
        """From the scores of all candidates, ``(B, N)``."""
        return cls(scores.gather(1, positives.clamp(min=0)), positives)

    def best_rank(self, scores: torch.Tensor, top_values: torch.Tensor) -> torch.Tensor:
        """Rank of the best positive, from 1, read off the K largest scores where it lies among
        them and counted over all scores elsewhere.

        Shapes:
            scores: ``(B, N)``; top_values: ``(B, K)``; returns ``(B,)`` int64.
        """
        top_pos, first = self.scores.max(dim=1, keepdim=True)  # (B, 1), lowest index on ties
        at_least = _count_at_least(scores, top_values, top_pos)  # (B,)
        return 1 + at_least - self.num_tied.gather(1, first).squeeze(1)

    def ranks(self, top_values: torch.Tensor, num_candidates: int) -> torch.Tensor:
        """Rank of every positive from the K largest scores; ``inf`` for padding and where the
        count reaches K (then the rank exceeds K - P: every larger score is among the K).

        Shapes:
            top_values: ``(B, K)``; returns ``(B, P)`` float32.
        """
        num_top = top_values.shape[1]
        at_least = (top_values[:, None, :] >= self.scores[:, :, None]).sum(dim=2)  # (B, P)
        exact = self.valid & ((at_least < num_top) | (num_top == num_candidates))
        ranks = (1 + at_least - self.num_tied + self.tied_before).float()  # (B, P)
        return ranks.masked_fill(~exact, math.inf)


def query_ranks(
    scores: torch.Tensor, positives: torch.Tensor, depth: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks of the positives of a batch of queries, in the tie order of the module docstring.

    The rank of every positive is needed only up to ``depth``: it is read off the ``depth + P``
    largest scores (a count below that is exact, since every larger score is among them), so the
    only full pass over the scores is the one for the best positive.

    Args:
        scores: similarity of each query to every candidate; finite.
        positives: positive candidate indices per query, padded with -1, without repeats; at least
            one per query.
        depth: ranks of all positives are exact up to ``depth``.

    Returns:
        ``best`` (rank of the best positive, from 1) and ``ranks`` (``inf`` for padding and, maybe,
        for ranks beyond ``depth``).

    Shapes:
        scores: ``(B, N)``; positives: ``(B, P)``; best: ``(B,)`` int64; ranks: ``(B, P)`` float32.
    """
    out = _scan(iter([(slice(None), scores)]), positives, positives, own_depth=0, cxc_depth=depth)
    return out["best"], out["cxc_ranks"]


def recall_at_k(best: torch.Tensor, ks: Sequence[int], prefix: str = "") -> dict[str, float]:
    """Recall@k in percent: share of queries whose best positive ranks at most k.

    Shapes:
        best: ``(Q,)`` ranks from 1.
    """
    return {f"{prefix}R_at_{k}": _percent(best <= k) for k in ks}


def rank_summary(best: torch.Tensor, prefix: str = "") -> dict[str, float]:
    """Median rank (VSE++ convention, ``floor`` of the median of 1-based ranks) and mean rank.

    Shapes:
        best: ``(Q,)`` ranks from 1.
    """
    ranks = best.detach().cpu().double().numpy()
    return {
        f"{prefix}medr": float(math.floor(np.median(ranks))),
        f"{prefix}meanr": float(ranks.mean()),
    }


def r_precision(ranks: torch.Tensor, num_positives: torch.Tensor) -> torch.Tensor:
    """Per-query R-precision: share of the top R candidates that are positives, R = #positives.

    Args:
        ranks: rank of each positive from 1, exact at least up to R, ``inf`` for padding.
        num_positives: R per query.

    Shapes:
        ranks: ``(Q, P)``; num_positives: ``(Q,)``; returns ``(Q,)`` in [0, 1].
    """
    hits = (ranks <= num_positives[:, None]).sum(dim=1)  # (Q,)
    return hits.double() / num_positives.double()


def average_precision_at_k(
    ranks: torch.Tensor, num_positives: torch.Tensor, k: int
) -> torch.Tensor:
    """Per-query AP@k = sum_{j<=k} P@j * rel_j / min(k, #positives) (truncated AP).

    The positive of the m-th smallest rank r_m contributes P@r_m = m / r_m when r_m <= k.

    Args:
        ranks: rank of each positive from 1, exact at least up to k, ``inf`` for padding.
        num_positives: positives per query (ranks beyond k are ``inf`` too, so they are not
            counted from ``ranks``).
        k: the cut-off.

    Shapes:
        ranks: ``(Q, P)``; num_positives: ``(Q,)``; returns ``(Q,)`` in [0, 1].

    References:
        Manning et al., "Introduction to Information Retrieval", section 8.4 (AP); reported as
        ``i2t_mAPnorm_at_5`` (see the module docstring).
    """
    precision = _precision_at_hits(ranks, k)  # (Q, P)
    return precision.sum(dim=1) / num_positives.clamp(max=k).double()


def average_precision_of_hits(ranks: torch.Tensor, k: int) -> torch.Tensor:
    """Per-query AP@k as the ECIR code of the metric-learning paper computes it.

    The mean, over the positives ranked within k, of P@rank = (order among those hits) / rank;
    0 for a query with no positive in the top k. It divides by the number of hits, not by
    min(k, #positives) as :func:`average_precision_at_k` does.

    Args:
        ranks: rank of each positive from 1, exact at least up to k, ``inf`` for padding.
        k: the cut-off.

    Shapes:
        ranks: ``(Q, P)``; returns ``(Q,)`` in [0, 1].

    References:
        Bleeker & de Rijke, ECIR 2022, Table 1 (mAP@5); their ``shared/evaluation/utils.py``,
        ``average_precision``.
    """
    precision = _precision_at_hits(ranks, k)  # (Q, P)
    hits = (ranks <= k).sum(dim=1)  # (Q,)
    return precision.sum(dim=1) / hits.clamp(min=1).double()


def _precision_at_hits(ranks: torch.Tensor, k: int) -> torch.Tensor:
    """P@r_m = m / r_m for the positive of the m-th smallest rank r_m when r_m <= k, else 0.

    Positives have distinct ranks, so the m-th positive found is the m-th smallest rank.

    Shapes:
        ranks: ``(Q, P)``; returns ``(Q, P)`` float64.
    """
    sorted_ranks = ranks.sort(dim=1).values.double()  # (Q, P)
    position = torch.arange(1, ranks.shape[1] + 1, device=ranks.device, dtype=torch.double)  # (P,)
    return torch.where(sorted_ranks <= k, position / sorted_ranks, 0.0)


def ndcg_at_k(scores: torch.Tensor, relevance: torch.Tensor, k: int) -> torch.Tensor:
    """nDCG@k of each query's ranking by score (descending, then by index: :func:`stable_topk`).

    Shapes:
        scores: ``(B, N)``; relevance: ``(B, N)``; returns ``(B,)`` float64.
    """
    return ndcg_of_ranking(stable_topk(scores, k), relevance)


def ndcg_of_ranking(ranking: torch.Tensor, relevance: torch.Tensor) -> torch.Tensor:
    """nDCG@k of given top-k rankings: their DCG over the DCG of the k largest relevances.

    DCG@k = sum_{r=1..k} (2^rel_r - 1) / log2(r + 1); nDCG = 0 when the ideal DCG is 0.

    Args:
        ranking: the k candidates ranked first for each query, best first.
        relevance: graded relevance of every candidate to each query.

    Shapes:
        ranking: ``(B, k)`` int64; relevance: ``(B, N)``; returns ``(B,)`` float64.

    References:
        Järvelin & Kekäläinen 2002; TERN protocol (docs/reference-code.md, section 5).
    """
    k = ranking.shape[1]
    position = torch.arange(2, k + 2, device=ranking.device, dtype=torch.double)  # (k,)
    discount = 1.0 / torch.log2(position)
    retrieved = relevance.gather(1, ranking).double()  # (B, k)
    ideal = relevance.topk(k, dim=1).values.double()  # (B, k)
    dcg = (torch.exp2(retrieved) - 1) @ discount  # (B,)
    idcg = (torch.exp2(ideal) - 1) @ discount  # (B,)
    return torch.where(idcg > 0, dcg / idcg.clamp(min=1e-300), 0.0)


def stable_topk(
    scores: torch.Tensor, k: int, *, top: torch.return_types.topk | None = None
) -> torch.Tensor:
    """Indices of the k largest scores per row, ordered by score descending, then by index.

    ``torch.topk`` leaves open the order of ties and which tied candidates make the cut. The top k
    are re-sorted by (score, index); rows whose k-th and (k+1)-th largest scores are equal (rare
    with real embeddings) are redone with a full stable sort.

    Args:
        scores: the scores to rank.
        k: how many.
        top: ``scores.topk(m)`` with m > k (or m = N), when the caller has it already.

    Shapes:
        scores: ``(B, N)``; returns ``(B, min(k, N))`` int64.
    """
    k = min(k, scores.shape[1])
    if top is None:
        top = scores.topk(min(k + 1, scores.shape[1]), dim=1)
    values, indices = top.values, top.indices  # (B, m)
    ambiguous = values[:, k] == values[:, k - 1] if values.shape[1] > k else None  # (B,)
    indices, perm = indices[:, :k].sort(dim=1)  # (B, k) by index, then stably by score
    order = values[:, :k].gather(1, perm).sort(dim=1, descending=True, stable=True).indices
    indices = indices.gather(1, order)
    if ambiguous is not None and ambiguous.any():
        rows = ambiguous.nonzero().squeeze(1)
        indices[rows] = scores[rows].sort(dim=1, descending=True, stable=True).indices[:, :k]
    return indices


def group_captions(caption_image: torch.Tensor, num_images: int) -> torch.Tensor:
    """Caption indices of each image, in caption order, padded with -1 to the largest group.

    Shapes:
        caption_image: ``(N_cap,)`` int64; returns ``(N_img, P)`` int64, P = max captions per image.
    """
    counts = torch.bincount(caption_image, minlength=num_images)  # (N_img,)
    if bool((counts == 0).any()):
        missing = int((counts == 0).nonzero()[0])
        raise ValueError(f"image {missing} has no caption in caption_image: every image needs one")
    order = torch.sort(caption_image, stable=True).indices  # (N_cap,) captions grouped by image
    starts = torch.cumsum(counts, 0) - counts  # (N_img,)
    slot = torch.arange(len(order), device=order.device) - starts[caption_image[order]]  # (N_cap,)
    grouped = torch.full((num_images, int(counts.max())), -1, dtype=torch.long, device=order.device)
    grouped[caption_image[order], slot] = order
    return grouped


def merge_positives(own: torch.Tensor, extended: Sequence[Sequence[int]]) -> torch.Tensor:
    """Own positives plus extended ones (CxC), deduplicated, sorted, padded with -1.

    Vectorised over (query, candidate) keys: 30,000 CxC queries take milliseconds, not the
    quarter of a second of a per-query Python loop.

    Shapes:
        own: ``(Q, P)`` int64, -1 padded; ``len(extended) == Q``; returns ``(Q, P')`` int64.
    """
    num_queries = own.shape[0]
    if len(extended) != num_queries:
        raise ValueError(f"extended needs one list per query ({num_queries}), got {len(extended)}")
    lengths = torch.tensor([len(row) for row in extended], dtype=torch.long)  # (Q,)
    flat = torch.tensor(list(itertools.chain.from_iterable(extended)), dtype=torch.long)  # (E,)
    own_rows, own_slots = (own >= 0).nonzero(as_tuple=True)
    queries = torch.cat([own_rows.cpu(), torch.arange(num_queries).repeat_interleave(lengths)])
    candidates = torch.cat([own[own_rows, own_slots].cpu(), flat])
    stride = int(candidates.max()) + 1 if len(candidates) else 1
    keys = torch.unique(queries * stride + candidates)  # sorted: by query, then candidate
    queries, candidates = keys // stride, keys % stride
    counts = torch.bincount(queries, minlength=num_queries)  # (Q,)
    slot = torch.arange(len(keys)) - (torch.cumsum(counts, 0) - counts)[queries]
    merged = torch.full((num_queries, max(int(counts.max()), 1)), -1, dtype=torch.long)
    merged[queries, slot] = candidates
    return merged.to(own.device)


def _as_tensor(x: torch.Tensor | np.ndarray, device: torch.device) -> torch.Tensor:
    """A float32 tensor on ``device`` from a tensor or an array slice."""
    x = torch.from_numpy(np.ascontiguousarray(x)) if isinstance(x, np.ndarray) else x
    return x.to(device=device, dtype=torch.float32)


def _percent(x: torch.Tensor) -> float:
    """Mean of a per-query tensor (bool or fraction) in percent."""
    return 100.0 * float(x.double().mean())


def _check_inputs(
    sims: torch.Tensor,
    caption_image: torch.Tensor,
    ks: Sequence[int],
    relevance: torch.Tensor | np.ndarray | None,
    extended_i2t: Sequence[Sequence[int]] | None,
    extended_t2i: Sequence[Sequence[int]] | None,
    chunk_size: int,
) -> None:
    """Raise a one-line ValueError naming the argument that does not fit."""
    if sims.ndim != 2:
        raise ValueError(f"sims must be (N_img, N_cap), got shape {tuple(sims.shape)}")
    n_img, n_cap = sims.shape
    if tuple(caption_image.shape) != (n_cap,):
        got = tuple(caption_image.shape)
        raise ValueError(f"caption_image must have shape ({n_cap},) like sims' columns, got {got}")
    if caption_image.is_floating_point() or n_cap == 0:
        raise ValueError("caption_image must be a non-empty integer tensor of image indices")
    if int(caption_image.min()) < 0 or int(caption_image.max()) >= n_img:
        raise ValueError(f"caption_image values must lie in [0, {n_img})")
    if not ks or min(ks) < 1 or chunk_size < 1:
        raise ValueError(
            f"ks must be >= 1 and chunk_size >= 1, got ks={ks}, chunk_size={chunk_size}"
        )
    if relevance is not None and tuple(relevance.shape) != (n_cap, n_img):
        got = tuple(relevance.shape)
        raise ValueError(
            f"relevance must have shape (N_cap, N_img) = ({n_cap}, {n_img}), got {got}"
        )
    extended = (
        ("extended_i2t", extended_i2t, n_img, n_cap),
        ("extended_t2i", extended_t2i, n_cap, n_img),
    )
    for name, ext, n_query, n_cand in extended:
        if ext is None:
            continue
        if len(ext) != n_query:
            raise ValueError(f"{name} needs one list per query ({n_query}), got {len(ext)}")
        if any(not 0 <= int(i) < n_cand for row in ext for i in row):
            raise ValueError(f"{name} holds an index outside [0, {n_cand})")
