"""Full-ranking metrics for next-item prediction: rank of the target, HIT@k, NDCG@k, MRR.

The target is ranked against the WHOLE catalogue (items ``1..n_items``), not
against a sample of negatives: sampled metrics are known to be inconsistent
with the full ranking (Krichene & Rendle 2020), and DPFormer reports full
ranking. Column 0 of the score matrix is padding and is never a candidate.

Ties are ranked pessimistically: the target's rank is ``1 +`` the number of
OTHER candidates scoring at least as high as the target. A model that gives
every item the same score therefore ranks every target last, so a collapsed
(e.g. noise-dominated) model gets no credit for ties; an optimistic rule would
rank it first and report a perfect score.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

from dptrain._checks import check_int

__all__ = ["hit_at_k", "mrr", "ndcg_at_k", "ranking_metrics", "target_ranks"]


def target_ranks(scores: Tensor, targets: Tensor, exclude: Tensor | None = None) -> Tensor:
    """1-based rank of each target among the candidate items (pessimistic ties).

    Args:
        scores: ``(N, n_items + 1)`` real scores; column 0 (padding) is ignored.
            ``-inf`` is allowed (it ranks below everything else); NaN is refused.
        targets: ``(N,)`` integer target ids in ``1..n_items``.
        exclude: optional ``(N, n_items + 1)`` bool: items that are not candidates
            for that row (e.g. already seen ones). The target itself stays a
            candidate even when it is marked.

    Returns:
        ``(N,)`` long: ``1 + #{candidates v != target : scores[v] >= scores[target]}``,
        so ranks run from 1 to the number of candidates.
    """
    if not isinstance(scores, Tensor) or scores.dim() != 2 or scores.shape[1] < 2:
        shape = tuple(scores.shape) if isinstance(scores, Tensor) else type(scores).__name__
        raise ValueError(
            f"scores with shape {shape} is not allowed: expected a 2-D tensor (N, n_items + 1) "
            "with n_items >= 1"
        )
    if scores.is_complex() or scores.dtype == torch.bool:
        raise ValueError(f"scores with dtype {scores.dtype} is not allowed: expected real scores")
    n, width = scores.shape
    if not isinstance(targets, Tensor) or tuple(targets.shape) != (n,):
        shape = tuple(targets.shape) if isinstance(targets, Tensor) else type(targets).__name__
        raise ValueError(f"targets with shape {shape} is not allowed: expected ({n},)")
    if targets.is_floating_point() or targets.is_complex() or targets.dtype == torch.bool:
        raise ValueError(f"targets with dtype {targets.dtype} is not allowed: expected integers")
    if n and (targets.min() < 1 or targets.max() > width - 1):
        bad = targets[(targets < 1) | (targets > width - 1)][0].item()
        raise ValueError(
            f"targets contains {bad}, which is not allowed: expected item ids in 1..{width - 1} "
            "(0 is padding)"
        )
    if torch.isnan(scores).any():
        raise ValueError("scores contains NaN, which is not allowed: expected real numbers")
    if exclude is not None and (
        not isinstance(exclude, Tensor)
        or exclude.dtype != torch.bool
        or tuple(exclude.shape) != (n, width)
    ):
        what = (
            f"shape {tuple(exclude.shape)} and dtype {exclude.dtype}"
            if isinstance(exclude, Tensor)
            else type(exclude).__name__
        )
        raise ValueError(
            f"exclude with {what} is not allowed: expected a bool tensor ({n}, {width})"
        )

    targets = targets.to(device=scores.device, dtype=torch.long)
    rows = torch.arange(n, device=scores.device)
    target_score = scores[rows, targets].unsqueeze(1)
    beats = scores >= target_score
    beats[:, 0] = False  # padding is never a candidate
    if exclude is not None:
        beats &= ~exclude.to(scores.device)
    beats[rows, targets] = False  # the target does not compete with itself
    return 1 + beats.sum(dim=1)


def _check_ranks(ranks: Tensor) -> Tensor:
    if not isinstance(ranks, Tensor) or ranks.dim() != 1 or ranks.numel() == 0:
        shape = tuple(ranks.shape) if isinstance(ranks, Tensor) else type(ranks).__name__
        raise ValueError(
            f"ranks with shape {shape} is not allowed: expected a non-empty 1-D tensor "
            "(from target_ranks)"
        )
    if ranks.is_floating_point() or ranks.is_complex() or ranks.dtype == torch.bool:
        raise ValueError(f"ranks with dtype {ranks.dtype} is not allowed: expected integers")
    if ranks.min() < 1:
        raise ValueError(
            f"ranks contains {ranks.min().item()}, which is not allowed: expected ranks >= 1"
        )
    return ranks.to(torch.float64)


def hit_at_k(ranks: Tensor, k: int) -> float:
    """HIT@k (recall@k with one relevant item): share of targets ranked within the top k."""
    k = check_int("k", k, minimum=1)
    r = _check_ranks(ranks)
    return (r <= k).to(torch.float64).mean().item()


def ndcg_at_k(ranks: Tensor, k: int) -> float:
    """NDCG@k with one relevant item: mean of ``1 / log2(rank + 1)`` if rank <= k, else 0."""
    k = check_int("k", k, minimum=1)
    r = _check_ranks(ranks)
    gain = torch.where(r <= k, 1.0 / torch.log2(r + 1.0), torch.zeros_like(r))
    return gain.mean().item()


def mrr(ranks: Tensor) -> float:
    """Mean reciprocal rank over all targets (no cut-off)."""
    return (1.0 / _check_ranks(ranks)).mean().item()


def ranking_metrics(ranks: Tensor, ks: Iterable[int] = (10,)) -> dict[str, float]:
    """``{"ndcg@k": ..., "hit@k": ...}`` for every k in ``ks``, plus ``"mrr"``."""
    if isinstance(ks, int):
        ks = (ks,)
    ks = [check_int(f"ks[{i}]", k, minimum=1) for i, k in enumerate(ks)]
    if not ks:
        raise ValueError("ks=() is not allowed: expected at least one cut-off k >= 1")
    _check_ranks(ranks)
    out: dict[str, float] = {}
    for k in ks:
        out[f"ndcg@{k}"] = ndcg_at_k(ranks, k)
        out[f"hit@{k}"] = hit_at_k(ranks, k)
    out["mrr"] = mrr(ranks)
    return out
