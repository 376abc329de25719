"""Metrics: pure functions of similarity matrices and ground-truth maps, returning plain numbers."""

from icr.metrics.retrieval import (
    average_precision_at_k,
    group_captions,
    merge_positives,
    ndcg_at_k,
    ndcg_of_ranking,
    query_ranks,
    r_precision,
    rank_summary,
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
    "query_ranks",
    "r_precision",
    "rank_summary",
    "recall_at_k",
    "retrieval_metrics",
    "stable_topk",
]
