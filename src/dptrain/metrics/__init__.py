"""Evaluation metrics.

:mod:`dptrain.metrics.ranking`: full-catalogue ranking of a held-out next item
(HIT@k, NDCG@k, MRR) for sequential recommendation and next-word prediction.
"""

from dptrain.metrics.ranking import hit_at_k, mrr, ndcg_at_k, ranking_metrics, target_ranks

__all__ = ["hit_at_k", "mrr", "ndcg_at_k", "ranking_metrics", "target_ranks"]
