"""Metrics: pure functions of similarity matrices and ground-truth maps, returning plain numbers."""

from icr.metrics.retrieval import (
    average_precision_at_k,
    group_captions,
    merge_positives,
    ndcg_at_k,
    ndcg_of_ranking,
    ndcg_t2i,
    query_ranks,
    r_precision,
    rank_summary,
    ranks_i2t,
    ranks_t2i,
    recall_at_k,
    retrieval_metrics,
    stable_topk,
)

__all__ = [
    "average_precision_at_k",
    "group_captions",
    "merge_positives",
    "ndcg_at_k",
    "ndcg_of_ranking",
    "ndcg_t2i",
    "query_ranks",
    "r_precision",
    "rank_summary",
    "ranks_i2t",
    "ranks_t2i",
    "recall_at_k",
    "retrieval_metrics",
    "stable_topk",
]
