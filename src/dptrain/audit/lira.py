"""Membership inference: the likelihood-ratio attack (LiRA) and the loss-threshold baseline.

Carlini, Chien, Nasr, Song, Terzis & Tramer, "Membership Inference Attacks From
First Principles" (IEEE S&P 2022, arXiv:2112.03570). Membership inference is a
hypothesis test (their Sec. IV, Eq. 1): was the target example ``(x, y)`` in
the training set of the model ``f``? The most powerful test of a fixed size is
the likelihood ratio (Neyman-Pearson)

    Lambda(f; x, y) = p(f | Q_in(x, y)) / p(f | Q_out(x, y)),

where ``Q_in`` / ``Q_out`` are the distributions of models trained on data sets
that do / do not hold ``(x, y)``. LiRA estimates it from *shadow models*
trained on random halves of a data pool, one scalar per model and example:

- the statistic is the logit-scaled confidence of the true label
  ``phi = log(p / (1 - p))``, ``p = softmax(f(x))_y`` (Sec. IV): the
  confidence itself piles up near 0 and 1, its logit is close to Gaussian
  across shadow models. From the logits ``z`` it is
  ``phi = z_y - logsumexp_{y' != y} z_{y'}`` (:func:`logit_confidence`),
  finite where ``p`` rounds to 1;
- **online** LiRA (Sec. IV, Algorithm 1): fit ``N(mu_in, s_in^2)`` to the
  statistics of the shadows that trained on the example and
  ``N(mu_out, s_out^2)`` to those that did not, and score the target's
  statistic by the log of the ratio of the two densities (:func:`lira_online`).
  With few shadows the per-example variances are noisy; the paper then uses one
  *global* variance for all examples (its "fixed variance" variant, better
  below about 64 shadows in its ablation on the number of shadow models):
  ``global_variance=True``;
- **offline** LiRA (Sec. IV, the offline variant): only OUT shadows (they can be trained before
  the targets are known); a one-sided test of "the target's statistic is
  larger than an OUT model's": ``Lambda = 1 - P[Z > phi] = Phi((phi - mu_out)
  / s_out)`` with ``Z ~ N(mu_out, s_out^2)`` (:func:`lira_offline`);
- the **loss threshold** (Yeom, Giacomelli, Fredrikson & Jha, CSF 2018; the
  "LOSS" baseline of Carlini et al.): one global threshold on the
  target's loss, no shadows (:func:`loss_scores`). A global threshold on
  ``phi`` ranks examples the same way (phi is decreasing in the loss).

Evaluation (Sec. III): the ROC curve of the scores against the true
membership, read at low false-positive rates: the true-positive rate at
0.1% and 1% FPR, where an attack that confidently identifies *some* members
stands out from one that is right on average. :func:`roc_curve` is exact (every
distinct score is a threshold; tied scores move together), :func:`tpr_at_fpr`
reads it without interpolation (the largest TPR at an FPR at most the target),
:func:`roc_auc` is its area (the Mann-Whitney statistic) and
:func:`balanced_accuracy` the paper's "accuracy" (the best threshold's mean of
TPR and TNR). :func:`dp_tpr_bound` is what (epsilon, delta)-DP allows at each
FPR (Kairouz, Oh & Viswanath 2015): a measured point above it means the
guarantee does not hold (up to sampling error: the point is an estimate).

Shapes: shadow statistics are ``(S, n)``, one row per shadow model and one
column per example; ``shadow_in`` is the ``(S, n)`` membership of each example
in each shadow's training set. Scores are higher for "more likely a member".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from scipy import special

from dptrain._checks import check_in_interval, check_real

__all__ = [
    "DEFAULT_FPRS",
    "AttackMetrics",
    "attack_metrics",
    "balanced_accuracy",
    "dp_tpr_bound",
    "lira_leave_one_out",
    "lira_offline",
    "lira_online",
    "logit_confidence",
    "loss_scores",
    "plot_roc",
    "roc_auc",
    "roc_curve",
    "tpr_at_fpr",
]

#: The false-positive rates the paper reads its ROC curves at (0.1% and 1%).
DEFAULT_FPRS: tuple[float, ...] = (0.001, 0.01)

# A variance estimate of exactly 0 (every shadow gave the same statistic, e.g. a confidence
# saturated in float64) would make the density ratio 0/0; this floor keeps the score finite
# and very large in magnitude, which is what such a clean separation deserves.
_MIN_VARIANCE = 1e-12


# -- inputs --------------------------------------------------------------------------------------


def _float_array(name: str, values: Any) -> np.ndarray:
    raw = values.detach().cpu().numpy() if hasattr(values, "detach") else values
    arr = np.asarray(raw, dtype=np.float64)
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} is not allowed: it holds NaN or infinite values")
    return arr


def _bool_array(name: str, values: Any) -> np.ndarray:
    raw = values.detach().cpu().numpy() if hasattr(values, "detach") else values
    arr = np.asarray(raw)
    if arr.dtype != np.bool_:
        if arr.size and not np.all(np.isin(arr, (0, 1))):
            bad = arr[~np.isin(arr, (0, 1))].ravel()[:5].tolist()
            raise ValueError(f"{name} holds {bad}: expected booleans or 0/1 (1 = a member)")
        arr = arr.astype(np.bool_)
    return arr


def _check_scores_members(scores: Any, members: Any) -> tuple[np.ndarray, np.ndarray]:
    s = _float_array("scores", scores).ravel()
    m = _bool_array("members", members).ravel()
    if s.size != m.size:
        raise ValueError(
            f"scores has {s.size} entries and members has {m.size}: expected one of each per "
            "(model, example) pair"
        )
    n_in = int(m.sum())
    if n_in == 0 or n_in == m.size:
        raise ValueError(
            f"members holds {n_in} members of {m.size}: a ROC curve needs at least one member "
            "and one non-member"
        )
    return s, m


def _check_fpr(fpr: object) -> float:
    return check_in_interval("fpr", fpr, 0.0, 1.0)


# -- the statistic -------------------------------------------------------------------------------


def logit_confidence(logits: Any, labels: Any) -> np.ndarray:
    """``phi = log(p / (1 - p))`` of the true label's softmax probability, in float64.

    Carlini et al. (Sec. IV) fit Gaussians to this logit-scaled confidence.
    Computed as ``z_y - logsumexp_{y' != y} z_{y'}`` (``p / (1 - p)`` is
    ``exp(z_y) / sum_{y' != y} exp(z_{y'})``), which stays finite and exact where
    ``p`` rounds to 1 or 0; for two classes it is ``z_y - z_other``.

    Args:
        logits: ``(..., K)`` scores (numpy or torch), ``K >= 2`` classes.
        labels: ``(...)`` true labels in ``0..K-1``.
    Returns:
        ``(...)`` float64 array.
    """
    z = _float_array("logits", logits)
    if z.ndim < 1 or z.shape[-1] < 2:
        raise ValueError(
            f"logits has shape {z.shape}: expected (..., K) with K >= 2 classes in the last axis"
        )
    raw = labels.detach().cpu().numpy() if hasattr(labels, "detach") else labels
    y = np.asarray(raw)
    if y.shape != z.shape[:-1]:
        raise ValueError(
            f"labels has shape {y.shape} and logits {z.shape}: expected labels of shape "
            f"{z.shape[:-1]}, one per row of logits"
        )
    if y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= z.shape[-1]):
        raise ValueError(
            f"labels holds values outside 0..{z.shape[-1] - 1} (or non-integers): expected "
            "class ids"
        )
    y = y.astype(np.int64)[..., None]
    z_true = np.take_along_axis(z, y, axis=-1)[..., 0]
    others = z.copy()
    np.put_along_axis(others, y, -np.inf, axis=-1)
    return z_true - special.logsumexp(others, axis=-1)


def loss_scores(logits: Any, labels: Any) -> np.ndarray:
    """Minus the cross-entropy loss of the true label: the loss-threshold attack's scores.

    Yeom et al. (2018) guess "member" when the loss is below a threshold; as a
    score (higher = member) that is ``-loss = z_y - logsumexp_{y'} z_{y'}``
    (float64, stable). One threshold for every example: no shadow models.
    """
    z = _float_array("logits", logits)
    phi = logit_confidence(z, labels)  # checks the shapes and labels
    # log p = -log(1 + exp(-phi)): the same ranking as phi, on the loss scale
    return -np.logaddexp(0.0, -phi)


# -- the attacks ---------------------------------------------------------------------------------


def _check_shadows(
    target: Any, shadow_stats: Any, shadow_in: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    x = _float_array("target", target)
    if x.ndim != 1:
        raise ValueError(f"target has shape {x.shape}: expected (n,), one statistic per example")
    s = _float_array("shadow_stats", shadow_stats)
    keep = _bool_array("shadow_in", shadow_in)
    if s.ndim != 2 or s.shape[1] != x.size:
        raise ValueError(
            f"shadow_stats has shape {s.shape} and target {x.shape}: expected (S, {x.size}), "
            "one row per shadow model"
        )
    if keep.shape != s.shape:
        raise ValueError(
            f"shadow_in has shape {keep.shape} and shadow_stats {s.shape}: expected the same "
            "shape (the membership of each example in each shadow)"
        )
    return x, s, keep


def _check_counts(keep: np.ndarray, side: str, minimum: int) -> np.ndarray:
    counts = keep.sum(axis=0)
    few = np.flatnonzero(counts < minimum)
    if few.size:
        raise ValueError(
            f"example {int(few[0])} has {int(counts[few[0]])} {side} shadow model(s) "
            f"({few.size} example(s) have fewer than {minimum}): expected at least {minimum} "
            f"{side} shadows per example to fit a Gaussian (train more shadow models)"
        )
    return counts


def _gaussian_fit(
    s: np.ndarray, mask: np.ndarray, counts: np.ndarray, global_variance: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Per-example mean and variance of the masked statistics (unbiased, ddof = 1).

    The global variance pools the within-example squared deviations over every
    example (``sum (phi - mu_example)^2 / sum (count - 1)``), so the spread
    *between* examples' means, which the per-example means already model, does
    not inflate it.
    """
    total = np.where(mask, s, 0.0).sum(axis=0)
    mean = total / counts
    sq_dev = np.where(mask, (s - mean) ** 2, 0.0).sum(axis=0)
    if global_variance:
        var = np.full(mean.shape, sq_dev.sum() / (counts - 1).sum())
    else:
        var = sq_dev / (counts - 1)
    return mean, np.maximum(var, _MIN_VARIANCE)


def _log_normal_density(x: np.ndarray, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    return -0.5 * ((x - mean) ** 2 / var + np.log(2.0 * math.pi * var))


def _online(
    x: np.ndarray, s: np.ndarray, in_mask: np.ndarray, out_mask: np.ndarray, global_var: bool
) -> np.ndarray:
    mean_in, var_in = _gaussian_fit(s, in_mask, _check_counts(in_mask, "IN", 2), global_var)
    mean_out, var_out = _gaussian_fit(s, out_mask, _check_counts(out_mask, "OUT", 2), global_var)
    return _log_normal_density(x, mean_in, var_in) - _log_normal_density(x, mean_out, var_out)


def _offline(x: np.ndarray, s: np.ndarray, out_mask: np.ndarray, global_var: bool) -> np.ndarray:
    mean_out, var_out = _gaussian_fit(s, out_mask, _check_counts(out_mask, "OUT", 2), global_var)
    return (x - mean_out) / np.sqrt(var_out)


def lira_online(
    target: Any, shadow_stats: Any, shadow_in: Any, *, global_variance: bool = False
) -> np.ndarray:
    """Online LiRA: the log-likelihood ratio of IN and OUT Gaussians, per example.

    Carlini et al., Sec. IV and Algorithm 1: for example ``i``, fit
    ``N(mu_in, s_in^2)`` to the statistics of the shadows that trained on it and
    ``N(mu_out, s_out^2)`` to the others, and score the target model's statistic
    ``x_i`` by ``log N(x_i; mu_in, s_in^2) - log N(x_i; mu_out, s_out^2)``
    (the log of their ``Lambda``; higher = more likely a member). Means are
    sample means, variances unbiased (ddof = 1).

    Args:
        target: ``(n,)`` the target model's statistic per example (e.g.
            :func:`logit_confidence`).
        shadow_stats: ``(S, n)`` the shadow models' statistics on the same examples.
        shadow_in: ``(S, n)`` bool, whether example ``i`` was in shadow ``j``'s
            training set. Every example needs at least 2 IN and 2 OUT shadows.
        global_variance: one IN and one OUT variance for all examples (pooled),
            the paper's choice with few shadow models (below about 64).
    Returns:
        ``(n,)`` float64 log-likelihood ratios.
    """
    x, s, keep = _check_shadows(target, shadow_stats, shadow_in)
    return _online(x, s, keep, ~keep, global_variance)


def lira_offline(
    target: Any, shadow_stats: Any, shadow_in: Any, *, global_variance: bool = False
) -> np.ndarray:
    """Offline LiRA: how far the target's statistic lies above the OUT Gaussian, per example.

    Carlini et al., Sec. IV (offline): with OUT shadows only, a one-sided test,
    ``Lambda = 1 - P[Z > x_i] = Phi(z_i)`` with ``Z ~ N(mu_out, s_out^2)`` and
    ``z_i = (x_i - mu_out) / s_out``. The score returned is ``z_i``: the same
    ranking as ``Phi(z_i)``, without the ties that ``Phi`` rounding to 1 would
    create among clear members. IN shadows (``shadow_in`` true) are ignored, so
    the statistics of a shadow set trained on other data can be passed with
    ``shadow_in`` all false.

    Args: as :func:`lira_online`; every example needs at least 2 OUT shadows.
    Returns:
        ``(n,)`` float64 standardized scores ``z_i``.
    """
    x, s, keep = _check_shadows(target, shadow_stats, shadow_in)
    return _offline(x, s, ~keep, global_variance)


_ATTACKS = ("online", "offline")


def lira_leave_one_out(
    stats: Any,
    keep: Any,
    *,
    attack: str = "online",
    global_variance: bool = False,
    balanced: bool = True,
    seed: int | None = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """Every model in turn as the target, the others as its shadows: ``(scores, members)``.

    The paper's evaluation: train ``M`` models on random halves of a pool (each
    example IN for exactly half of them), attack each model with the other
    models as the reference set, and pool the ``M x n`` (score, membership)
    pairs into one ROC curve.

    ``balanced`` (default) removes a bias of that evaluation with few models: when
    the target holds example ``i``, the other models hold it ``M/2 - 1`` times and
    leave it out ``M/2`` times, and the other way round when it does not, so the
    target's own side is always the one estimated from fewer shadows. Its mean is
    then noisier, the target's statistic lies farther from it on average, and the
    score leans towards the wrong side by about ``1/(M/2 - 1) - 1/(M/2)`` (in units
    of the variance): on statistics without any membership signal, the AUC comes
    out 0.36 with M = 6 and 0.48 with M = 16 instead of 0.5. Balanced, one shadow
    of the *other* side (drawn at random, fixed by ``seed``) is left out per
    example, so every example has ``M/2 - 1`` IN and ``M/2 - 1`` OUT shadows
    whatever the target's membership, as with a target outside the shadow set.

    Args:
        stats: ``(M, n)`` each model's statistic on each pool example.
        keep: ``(M, n)`` bool membership; balanced needs each example IN for exactly
            half of the models.
        attack: ``"online"`` (:func:`lira_online`) or ``"offline"`` (:func:`lira_offline`).
        global_variance: passed on.
        balanced: leave one shadow of the other side out (above); False uses all
            ``M - 1`` others.
        seed: fixes which shadow is left out.
    Returns:
        ``(M, n)`` scores and the ``(M, n)`` membership (``keep`` as a bool array).
    """
    if attack not in _ATTACKS:
        raise ValueError(f"attack={attack!r} is not allowed: expected one of {list(_ATTACKS)}")
    s = _float_array("stats", stats)
    k = _bool_array("keep", keep)
    if s.ndim != 2 or k.shape != s.shape:
        raise ValueError(
            f"stats has shape {s.shape} and keep {k.shape}: expected the same (M, n) shape"
        )
    m_count, n = s.shape
    if m_count < 3:
        raise ValueError(
            f"stats holds {m_count} model(s): expected at least 3 (a target and a reference "
            "set of at least 2)"
        )
    if balanced and np.any(k.sum(axis=0) * 2 != m_count):
        bad = int(np.flatnonzero(k.sum(axis=0) * 2 != m_count)[0])
        raise ValueError(
            f"keep holds example {bad} IN for {int(k[:, bad].sum())} of {m_count} models: "
            "balanced=True expects every example IN for exactly half of the models "
            "(or pass balanced=False)"
        )
    rng = np.random.default_rng(seed)
    scores = np.empty_like(s)
    columns = np.arange(n)
    for m in range(m_count):
        ref = np.arange(m_count) != m
        s_ref, in_ref = s[ref], k[ref]
        use = np.ones_like(in_ref)
        if balanced:
            # a random shadow among those on the other side of the target, per example
            keys = np.where(in_ref != k[m], rng.random(in_ref.shape), -1.0)
            use[keys.argmax(axis=0), columns] = False
        if attack == "online":
            scores[m] = _online(s[m], s_ref, in_ref & use, ~in_ref & use, global_variance)
        else:
            scores[m] = _offline(s[m], s_ref, ~in_ref & use, global_variance)
    return scores, k


# -- evaluation ----------------------------------------------------------------------------------


def roc_curve(scores: Any, members: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The exact ROC curve: ``(fpr, tpr, thresholds)``, from ``(0, 0)`` to ``(1, 1)``.

    Point ``k`` guesses "member" for every score ``>= thresholds[k]``; the
    thresholds are the distinct scores in decreasing order (after ``+inf``, the
    guess "nobody"), so tied scores are always guessed together and every
    achievable (FPR, TPR) of a threshold test is a point of the curve.
    """
    s, m = _check_scores_members(scores, members)
    order = np.argsort(-s, kind="stable")
    s_sorted, m_sorted = s[order], m[order]
    last_of_ties = np.r_[np.flatnonzero(np.diff(s_sorted)), s.size - 1]
    tp = np.cumsum(m_sorted)[last_of_ties]
    fp = np.cumsum(~m_sorted)[last_of_ties]
    fpr = np.r_[0.0, fp / fp[-1]]
    tpr = np.r_[0.0, tp / tp[-1]]
    return fpr, tpr, np.r_[np.inf, s_sorted[last_of_ties]]


def _tpr_at(fpr_curve: np.ndarray, tpr_curve: np.ndarray, target: float) -> float:
    return float(tpr_curve[fpr_curve <= target].max())


def tpr_at_fpr(scores: Any, members: Any, fpr: float) -> float:
    """The largest TPR of a threshold whose FPR is at most ``fpr`` (no interpolation).

    Read off :func:`roc_curve`: an achievable operating point, never a value
    between two thresholds. With ``n`` non-members the FPR moves in steps of
    ``1/n``: below ``1/n`` only the threshold above every non-member counts.
    """
    target = _check_fpr(fpr)
    f, t, _ = roc_curve(scores, members)
    return _tpr_at(f, t, target)


def _auc(f: np.ndarray, t: np.ndarray) -> float:
    return float(np.sum(np.diff(f) * (t[1:] + t[:-1]) / 2.0))


def roc_auc(scores: Any, members: Any) -> float:
    """Area under the exact ROC curve (trapezoids): ``P[score_in > score_out]``, ties 1/2.

    Equals the Mann-Whitney U statistic of the members' scores divided by
    ``n_members x n_nonmembers``.
    """
    f, t, _ = roc_curve(scores, members)
    return _auc(f, t)


def balanced_accuracy(scores: Any, members: Any) -> float:
    """The best threshold's ``(TPR + 1 - FPR) / 2``: the paper's "accuracy" (Sec. III).

    The membership game's accuracy when members and non-members are equally
    likely; 0.5 is chance. It averages over examples, which is why the paper
    reads TPR at low FPR instead.
    """
    f, t, _ = roc_curve(scores, members)
    return float(np.max((t + 1.0 - f) / 2.0))


def dp_tpr_bound(fpr: Any, epsilon: float, delta: float) -> np.ndarray:
    """The largest TPR an (epsilon, delta)-DP mechanism allows at false-positive rate ``fpr``.

    Any test of "member" against "non-member" satisfies ``TPR <= e^eps FPR +
    delta`` and ``1 - TPR >= e^-eps (1 - delta - FPR)`` (Kairouz, Oh &
    Viswanath 2015, the hypothesis-testing view of DP), so the bound is
    ``min(1, e^eps FPR + delta, 1 - e^-eps (1 - delta - FPR))``. Both constraints
    are linear in (FPR, TPR), so they also hold for the average over examples
    that a pooled ROC curve is.
    """
    eps = check_in_interval("epsilon", epsilon, 0.0, math.inf, low_open=False)
    dlt = check_in_interval("delta", delta, 0.0, 1.0, low_open=False)
    f = _float_array("fpr", fpr)
    if np.any((f < 0) | (f > 1)):
        raise ValueError("fpr is not allowed: expected values in [0, 1]")
    first = np.exp(eps) * f + dlt
    second = 1.0 - np.exp(-eps) * (1.0 - dlt - f)
    return np.minimum(1.0, np.minimum(first, second))


@dataclasses.dataclass(frozen=True)
class AttackMetrics:
    """The ROC summary of one attack: what :func:`attack_metrics` returns.

    ``tpr_at_fpr[f]`` is :func:`tpr_at_fpr` at ``f``; ``fpr_resolution`` is
    ``1 / n_nonmembers``, the smallest FPR step (a TPR at an FPR below it rests on
    no false positive at all).
    """

    tpr_at_fpr: dict[float, float]
    auc: float
    balanced_accuracy: float
    n_members: int
    n_nonmembers: int

    @property
    def fpr_resolution(self) -> float:
        return 1.0 / self.n_nonmembers

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the FPRs as strings (``"0.001"``), the resolution included."""
        return {
            "tpr_at_fpr": {f"{f:g}": t for f, t in self.tpr_at_fpr.items()},
            "auc": self.auc,
            "balanced_accuracy": self.balanced_accuracy,
            "n_members": self.n_members,
            "n_nonmembers": self.n_nonmembers,
            "fpr_resolution": self.fpr_resolution,
        }


def attack_metrics(
    scores: Any, members: Any, fprs: Iterable[float] = DEFAULT_FPRS
) -> AttackMetrics:
    """TPR at each of ``fprs``, AUC and balanced accuracy, from one exact ROC curve."""
    targets = [_check_fpr(f) for f in fprs]
    s, m = _check_scores_members(scores, members)
    f, t, _ = roc_curve(s, m)
    return AttackMetrics(
        tpr_at_fpr={target: _tpr_at(f, t, target) for target in targets},
        auc=_auc(f, t),
        balanced_accuracy=float(np.max((t + 1.0 - f) / 2.0)),
        n_members=int(m.sum()),
        n_nonmembers=int((~m).sum()),
    )


def plot_roc(
    curves: Mapping[str, tuple[Any, Any]],
    path: str | Path,
    *,
    title: str | None = None,
    bounds: Mapping[str, tuple[float, float]] | None = None,
    fpr_marks: Sequence[float] = DEFAULT_FPRS,
) -> Path:
    """ROC curves on log-log axes (the paper's Fig. 1 style), saved to ``path``.

    Args:
        curves: label -> ``(fpr, tpr)`` (e.g. from :func:`roc_curve`); one line each.
        path: the image file (PNG, PDF, ... by its suffix).
        title: the figure title.
        bounds: label of a curve -> ``(epsilon, delta)``: :func:`dp_tpr_bound` drawn
            dashed in that curve's colour (what DP allows it).
        fpr_marks: FPRs marked by thin vertical lines (the values the tables read).
    Log axes show what a linear plot hides: the low-FPR corner where a few
    confidently identified members separate an attack from chance (the dotted
    diagonal). Points at FPR or TPR 0 cannot be drawn on log axes; the axes start
    at the smallest non-zero FPR of the curves.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not curves:
        raise ValueError("curves={} is not allowed: expected at least one (fpr, tpr) curve")
    bounds = dict(bounds or {})
    unknown = sorted(set(bounds) - set(curves))
    if unknown:
        raise ValueError(f"bounds names {unknown}, which are not curves: expected {list(curves)}")
    data = {
        k: (_float_array("fpr", f).ravel(), _float_array("tpr", t).ravel())
        for k, (f, t) in curves.items()
    }
    positive = [f[f > 0].min() for f, _ in data.values() if np.any(f > 0)]
    low = min(positive) if positive else 1e-5
    fig, ax = plt.subplots(figsize=(5.2, 4.4))
    grid = np.logspace(math.log10(low), 0, 200)
    ax.plot(grid, grid, ls=":", color="grey", lw=1, label="chance (TPR = FPR)")
    for label, (f, t) in data.items():
        (line,) = ax.plot(f, t, lw=1.5, label=label, drawstyle="steps-post")
        if label in bounds:
            eps, delta = bounds[label]
            ax.plot(
                grid,
                dp_tpr_bound(grid, eps, delta),
                ls="--",
                lw=1,
                color=line.get_color(),
                label=f"DP bound, epsilon {check_real('epsilon', eps):g}",
            )
    for mark in fpr_marks:
        ax.axvline(_check_fpr(mark), color="lightgrey", lw=0.8, zorder=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, 1)
    ax.set_ylim(low, 1.05)
    ax.set_xlabel("false-positive rate")
    ax.set_ylabel("true-positive rate")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, which="both", lw=0.5)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out
