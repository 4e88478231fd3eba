"""LiRA and the loss threshold: statistic, attacks, ROC metrics and bad input.

References are independent of the implementation: phi from a softmax in
mpmath; the online score from ``scipy.stats.norm.logpdf`` with means and
standard deviations taken example by example in a Python loop; the offline
score from ``scipy.stats.norm.sf``; TPR at FPR and balanced accuracy from a
brute-force sweep over every threshold; the AUC from
``scipy.stats.mannwhitneyu``; the DP bound against the exact trade-off curve
of a Gaussian mechanism whose epsilon comes from the GDP accountant.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch
from scipy import special, stats

from dptrain.accounting.gdp import gdp_epsilon
from dptrain.audit import (
    DEFAULT_FPRS,
    AttackMetrics,
    attack_metrics,
    balanced_accuracy,
    dp_tpr_bound,
    lira_leave_one_out,
    lira_offline,
    lira_online,
    logit_confidence,
    loss_scores,
    plot_roc,
    roc_auc,
    roc_curve,
    tpr_at_fpr,
)

mpmath.mp.dps = 50


def _design(rng: np.random.Generator, models: int, n: int) -> np.ndarray:
    """(models, n) membership, each example IN for exactly half of the models."""
    return rng.random((models, n)).argsort(0).argsort(0) < models // 2


def _with_moments(raw: np.ndarray, mean: float, std: float) -> np.ndarray:
    """``raw`` shifted and scaled to have exactly this sample mean and (ddof=1) std."""
    z = (raw - raw.mean()) / raw.std(ddof=1)
    return mean + std * z


# -- the statistic -------------------------------------------------------------------------------


def _phi_mpmath(z: np.ndarray, y: int) -> float:
    exps = [mpmath.exp(mpmath.mpf(float(v))) for v in z]
    p = exps[y] / mpmath.fsum(exps)
    return float(mpmath.log(p / (1 - p)))


@pytest.mark.parametrize("classes", [2, 3, 10])
def test_logit_confidence_matches_a_high_precision_softmax(classes):
    rng = np.random.default_rng(classes)
    logits = rng.normal(scale=4.0, size=(50, classes))
    logits[0] = 0.0  # all equal: p = 1/K
    logits[1, 0] = 45.0  # p rounds to 1 in float64: the direct formula breaks down
    logits[2, 0] = -45.0
    labels = rng.integers(0, classes, size=50)
    labels[:3] = 0
    got = logit_confidence(logits, labels)
    want = np.array([_phi_mpmath(z, y) for z, y in zip(logits, labels, strict=True)])
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    assert got[0] == pytest.approx(-math.log(classes - 1))


def test_logit_confidence_equals_the_direct_float64_formula_where_it_is_accurate():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(200, 4))
    labels = rng.integers(0, 4, size=200)
    p = special.softmax(logits, axis=1)[np.arange(200), labels]
    np.testing.assert_allclose(logit_confidence(logits, labels), np.log(p / (1 - p)), rtol=1e-9)


def test_logit_confidence_takes_torch_tensors_and_keeps_leading_axes():
    logits = torch.randn(3, 5, 2, dtype=torch.float32)
    labels = torch.randint(0, 2, (3, 5))
    got = logit_confidence(logits, labels)
    assert got.shape == (3, 5) and got.dtype == np.float64
    z = logits.double().numpy()
    y = labels.numpy()
    want = (
        np.take_along_axis(z, y[..., None], -1)[..., 0]
        - np.take_along_axis(z, 1 - y[..., None], -1)[..., 0]
    )
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_loss_scores_are_minus_the_cross_entropy():
    rng = np.random.default_rng(1)
    logits = rng.normal(scale=3.0, size=(100, 3))
    labels = rng.integers(0, 3, size=100)
    ce = torch.nn.functional.cross_entropy(
        torch.from_numpy(logits), torch.from_numpy(labels), reduction="none"
    ).numpy()
    np.testing.assert_allclose(loss_scores(logits, labels), -ce, rtol=1e-12)
    # a global threshold on phi and on the loss rank examples alike
    phi = logit_confidence(logits, labels)
    assert np.array_equal(np.argsort(phi), np.argsort(loss_scores(logits, labels)))


# -- the attacks ---------------------------------------------------------------------------------


def _reference_online(x, s, keep, global_variance=False):
    n = x.size
    mu_in, mu_out, sd_in, sd_out = (np.empty(n) for _ in range(4))
    pooled = {True: [0.0, 0], False: [0.0, 0]}
    for i in range(n):
        for side, mu, sd in ((True, mu_in, sd_in), (False, mu_out, sd_out)):
            vals = s[keep[:, i] == side, i]
            mu[i] = np.mean(vals)
            sd[i] = np.std(vals, ddof=1)
            pooled[side][0] += float(np.sum((vals - mu[i]) ** 2))
            pooled[side][1] += vals.size - 1
    if global_variance:
        sd_in[:] = math.sqrt(pooled[True][0] / pooled[True][1])
        sd_out[:] = math.sqrt(pooled[False][0] / pooled[False][1])
    return stats.norm.logpdf(x, mu_in, sd_in) - stats.norm.logpdf(x, mu_out, sd_out)


@pytest.mark.parametrize("global_variance", [False, True])
def test_online_score_is_the_gaussian_log_likelihood_ratio(global_variance):
    rng = np.random.default_rng(2)
    shadows, n = 12, 40
    keep = rng.random((shadows, n)) < 0.5
    keep[:2], keep[2:4] = True, False  # at least 2 IN and 2 OUT everywhere
    s = rng.normal(size=(shadows, n)) + 2.0 * keep + rng.normal(size=n)
    x = rng.normal(size=n)
    got = lira_online(x, s, keep, global_variance=global_variance)
    want = _reference_online(x, s, keep, global_variance)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-10)


def test_online_score_with_exact_shadow_moments_is_the_true_likelihood_ratio():
    # shadows whose sample moments equal the true ones: LiRA's score is exactly the
    # optimal (Neyman-Pearson) statistic of N(mu_in, s_in) against N(mu_out, s_out)
    rng = np.random.default_rng(3)
    n, half = 30, 8
    mu_in, mu_out = rng.normal(1.0, 1.0, n), rng.normal(-1.0, 1.0, n)
    sd_in, sd_out = rng.uniform(0.5, 2.0, n), rng.uniform(0.5, 2.0, n)
    s = np.empty((2 * half, n))
    keep = np.zeros((2 * half, n), dtype=bool)
    keep[:half] = True
    for i in range(n):
        s[:half, i] = _with_moments(rng.normal(size=half), mu_in[i], sd_in[i])
        s[half:, i] = _with_moments(rng.normal(size=half), mu_out[i], sd_out[i])
    x = rng.normal(size=n) * 2
    want = stats.norm.logpdf(x, mu_in, sd_in) - stats.norm.logpdf(x, mu_out, sd_out)
    np.testing.assert_allclose(lira_online(x, s, keep), want, rtol=1e-9, atol=1e-9)
    # offline: Lambda = 1 - P[Z > x], Z ~ N(mu_out, s_out)
    offline = lira_offline(x, s, keep)
    np.testing.assert_allclose(
        special.ndtr(offline), 1 - stats.norm.sf(x, mu_out, sd_out), rtol=1e-9
    )


def test_offline_score_is_the_one_sided_out_tail():
    rng = np.random.default_rng(4)
    shadows, n = 10, 25
    keep = rng.random((shadows, n)) < 0.5
    keep[:2] = False
    s = rng.normal(size=(shadows, n)) * 3
    x = rng.normal(size=n)
    mu_out = np.array([s[~keep[:, i], i].mean() for i in range(n)])
    sd_out = np.array([s[~keep[:, i], i].std(ddof=1) for i in range(n)])
    got = lira_offline(x, s, keep)
    np.testing.assert_allclose(special.ndtr(got), stats.norm.cdf(x, mu_out, sd_out), rtol=1e-10)
    # IN shadows do not matter to the offline attack
    s_changed = np.where(keep, 1e3, s)
    np.testing.assert_allclose(lira_offline(x, s_changed, keep), got)


def test_online_lira_approaches_the_optimal_test_and_beats_a_global_threshold():
    # per-example Gaussians whose means differ across examples: the optimal test
    # knows them; LiRA estimates them from 64 shadows; a global threshold cannot
    rng = np.random.default_rng(5)
    n, shadows = 4000, 64
    base = rng.normal(0.0, 3.0, n)  # examples differ in how easy they are
    gap = rng.uniform(0.0, 2.0, n)  # and in how much membership moves them
    keep = _design(rng, shadows, n)
    s = base + gap * keep + rng.normal(size=(shadows, n))
    target_in = rng.random(n) < 0.5
    x = base + gap * target_in + rng.normal(size=n)
    optimal = stats.norm.logpdf(x, base + gap, 1) - stats.norm.logpdf(x, base, 1)
    lira = lira_online(x, s, keep, global_variance=True)
    best = tpr_at_fpr(optimal, target_in, 0.01)
    got = tpr_at_fpr(lira, target_in, 0.01)
    assert got > 0.7 * best > 0.05
    assert got <= best + 0.03  # Neyman-Pearson: nothing beats the true ratio (up to noise)
    assert roc_auc(lira, target_in) > roc_auc(x, target_in) + 0.05


def test_leave_one_out_scores_every_model_with_the_others():
    rng = np.random.default_rng(6)
    models, n = 8, 30
    keep = _design(rng, models, n)
    s = rng.normal(size=(models, n)) + keep
    scores, members = lira_leave_one_out(s, keep, balanced=False)
    assert members.dtype == bool and np.array_equal(members, keep)
    for m in (0, 5):
        ref = np.arange(models) != m
        np.testing.assert_allclose(scores[m], lira_online(s[m], s[ref], keep[ref]))
    offline, _ = lira_leave_one_out(s, keep, attack="offline", balanced=False)
    np.testing.assert_allclose(
        offline[3], lira_offline(s[3], s[np.arange(models) != 3], keep[np.arange(models) != 3])
    )


def test_balanced_leave_one_out_removes_the_few_model_bias():
    # no membership signal at all: the AUC must be 0.5 in expectation
    balanced, naive = [], []
    for seed in range(10):
        rng = np.random.default_rng(seed)
        models, n = 6, 500
        keep = _design(rng, models, n)
        s = rng.normal(size=(models, n)) + 3.0 * rng.normal(size=n)
        scores, members = lira_leave_one_out(s, keep, seed=seed)
        balanced.append(roc_auc(scores, members))
        scores, members = lira_leave_one_out(s, keep, balanced=False)
        naive.append(roc_auc(scores, members))
    assert abs(np.mean(balanced) - 0.5) < 0.01
    assert np.mean(naive) < 0.42  # the target's own side estimated from one shadow fewer


def test_balanced_leave_one_out_uses_half_minus_one_shadows_per_side():
    rng = np.random.default_rng(7)
    models, n = 6, 20
    keep = _design(rng, models, n)
    s = rng.normal(size=(models, n))
    # with 6 models each side keeps exactly 2 shadows: any fewer would raise
    scores, _ = lira_leave_one_out(s, keep)
    assert np.all(np.isfinite(scores))
    with pytest.raises(ValueError, match="exactly half"):
        lira_leave_one_out(s, ~keep[:, :1].repeat(n, 1) | keep)


# -- evaluation ----------------------------------------------------------------------------------


def _brute_force_points(scores, members):
    """(fpr, tpr) of 'member iff score >= t' for every t, counted directly."""
    pos, neg = scores[members], scores[~members]
    points = [(0.0, 0.0)]
    for t in np.unique(scores):
        points.append((np.mean(neg >= t), np.mean(pos >= t)))
    return points


def _scores_with_ties(seed: int, n: int = 400):
    rng = np.random.default_rng(seed)
    members = rng.random(n) < 0.4
    scores = np.round(rng.normal(size=n) + 0.8 * members, 1)  # many ties
    return scores, members


@pytest.mark.parametrize("seed", range(5))
def test_tpr_at_fpr_matches_a_brute_force_threshold_sweep(seed):
    scores, members = _scores_with_ties(seed)
    points = _brute_force_points(scores, members)
    n_neg = int((~members).sum())
    targets = [0.001, 0.01, 0.05, 0.1, 0.5, 0.999, 3 / n_neg, 17 / n_neg]
    for target in targets:
        want = max(t for f, t in points if f <= target + 1e-15)
        assert tpr_at_fpr(scores, members, target) == pytest.approx(want, abs=1e-15)
    metrics = attack_metrics(scores, members, targets[:3])
    assert metrics.tpr_at_fpr[0.01] == tpr_at_fpr(scores, members, 0.01)
    best = max((t + 1 - f) / 2 for f, t in points)
    assert balanced_accuracy(scores, members) == pytest.approx(best)
    assert metrics.balanced_accuracy == pytest.approx(best)


@pytest.mark.parametrize("seed", range(5))
def test_auc_is_the_mann_whitney_statistic(seed):
    scores, members = _scores_with_ties(seed)
    u = stats.mannwhitneyu(scores[members], scores[~members]).statistic
    want = u / (members.sum() * (~members).sum())
    assert roc_auc(scores, members) == pytest.approx(want, rel=1e-12)
    assert attack_metrics(scores, members).auc == pytest.approx(want, rel=1e-12)


def test_roc_curve_runs_from_origin_to_one_through_each_distinct_score():
    scores, members = _scores_with_ties(0)
    fpr, tpr, thresholds = roc_curve(scores, members)
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0.0, 0.0, 1.0, 1.0)
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)
    assert thresholds[0] == np.inf and len(thresholds) == len(np.unique(scores)) + 1
    points = _brute_force_points(scores, members)
    np.testing.assert_allclose(sorted(zip(fpr, tpr, strict=True)), sorted(points))


def test_perfect_and_constant_scores():
    members = np.array([True, False] * 50)
    perfect = members.astype(float)
    assert roc_auc(perfect, members) == 1.0
    assert tpr_at_fpr(perfect, members, 0.001) == 1.0
    constant = np.zeros(100)
    assert roc_auc(constant, members) == 0.5
    assert tpr_at_fpr(constant, members, 0.5) == 0.0  # all-or-nothing: FPR 0 or 1


def test_attack_metrics_reports_sizes_and_resolution():
    scores, members = _scores_with_ties(1)
    m = attack_metrics(scores, members)
    assert isinstance(m, AttackMetrics) and set(m.tpr_at_fpr) == set(DEFAULT_FPRS)
    assert m.n_members + m.n_nonmembers == scores.size
    d = m.to_dict()
    assert set(d["tpr_at_fpr"]) == {"0.001", "0.01"}
    assert d["fpr_resolution"] == pytest.approx(1 / m.n_nonmembers)


def test_dp_bound_holds_for_the_gaussian_mechanism_trade_off_curve():
    # the best test against mu-GDP has TPR = Phi(Phi^-1(FPR) + mu); at the accountant's
    # epsilon for delta it must lie under the (epsilon, delta) bound, and touch it
    fpr = np.logspace(-6, 0, 400)[:-1]
    for mu in (0.5, 1.0, 3.0):
        delta = 1e-5
        eps = gdp_epsilon(delta, mu)
        curve = special.ndtr(special.ndtri(fpr) + mu)
        bound = dp_tpr_bound(fpr, eps, delta)
        assert np.all(curve <= bound + 1e-9)
        assert np.min(bound - curve) < 1e-3
    assert dp_tpr_bound(0.01, 0.0, 0.0) == pytest.approx(0.01)  # no leak: TPR <= FPR
    assert dp_tpr_bound(0.001, 1.0, 1e-5) == pytest.approx(math.e * 0.001 + 1e-5)
    # large epsilon: the second constraint, 1 - e^-eps (1 - delta - FPR), binds
    assert dp_tpr_bound(0.5, 8.0, 1e-5) == pytest.approx(1 - math.exp(-8) * (0.5 - 1e-5))


def test_plot_roc_writes_an_image(tmp_path):
    scores, members = _scores_with_ties(2)
    fpr, tpr, _ = roc_curve(scores, members)
    path = plot_roc(
        {"epsilon 1": (fpr, tpr), "non-private": (fpr, tpr**0.5)},
        tmp_path / "sub" / "roc.png",
        title="test",
        bounds={"epsilon 1": (1.0, 1e-5)},
    )
    assert path.is_file() and path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="not curves"):
        plot_roc({"a": (fpr, tpr)}, tmp_path / "x.png", bounds={"b": (1.0, 1e-5)})
    with pytest.raises(ValueError, match="curves"):
        plot_roc({}, tmp_path / "x.png")


# -- bad input -----------------------------------------------------------------------------------


def test_scores_and_members_of_different_lengths_are_named():
    with pytest.raises(ValueError, match="scores has 3 entries and members has 2"):
        tpr_at_fpr([1.0, 2.0, 3.0], [True, False], 0.1)
    with pytest.raises(ValueError, match="at least one member and one non-member"):
        roc_auc([1.0, 2.0], [True, True])
    with pytest.raises(ValueError, match="members holds"):
        roc_auc([1.0, 2.0], [2, 0])
    with pytest.raises(ValueError, match="NaN"):
        roc_auc([1.0, float("nan")], [True, False])


@pytest.mark.parametrize("fpr", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_fpr_outside_the_open_unit_interval_is_named(fpr):
    scores, members = _scores_with_ties(0)
    with pytest.raises(ValueError, match="fpr"):
        tpr_at_fpr(scores, members, fpr)
    with pytest.raises(ValueError, match="fpr"):
        attack_metrics(scores, members, [0.01, fpr])


def test_too_few_in_or_out_shadows_are_named():
    rng = np.random.default_rng(8)
    s = rng.normal(size=(6, 5))
    keep = np.array([[True] * 5] * 3 + [[False] * 5] * 3)
    keep[1, 2] = keep[2, 2] = False  # example 2: one IN shadow
    with pytest.raises(ValueError, match="example 2 has 1 IN shadow"):
        lira_online(np.zeros(5), s, keep)
    keep = np.array([[True] * 5] * 5 + [[False] * 5])  # one OUT shadow everywhere
    with pytest.raises(ValueError, match="example 0 has 1 OUT shadow"):
        lira_online(np.zeros(5), s, keep)
    with pytest.raises(ValueError, match="OUT shadow"):
        lira_offline(np.zeros(5), s, keep)
    lira_offline(np.zeros(5), s, np.zeros((6, 5), dtype=bool))  # OUT only is enough offline


def test_shapes_labels_and_names_are_checked():
    s = np.zeros((4, 3))
    keep = np.array([[True] * 3, [True] * 3, [False] * 3, [False] * 3])
    with pytest.raises(ValueError, match=r"expected \(S, 4\)"):
        lira_online(np.zeros(4), s, keep)
    with pytest.raises(ValueError, match="shadow_in has shape"):
        lira_online(np.zeros(3), s, keep[:3])
    with pytest.raises(ValueError, match="labels holds values outside"):
        logit_confidence(np.zeros((2, 3)), [0, 3])
    with pytest.raises(ValueError, match="K >= 2"):
        logit_confidence(np.zeros((2, 1)), [0, 0])
    with pytest.raises(ValueError, match="labels has shape"):
        logit_confidence(np.zeros((2, 3)), [0, 1, 2])
    with pytest.raises(ValueError, match="attack='both' is not allowed"):
        lira_leave_one_out(np.zeros((6, 3)), np.zeros((6, 3)), attack="both")
    with pytest.raises(ValueError, match="at least 3"):
        lira_leave_one_out(np.zeros((2, 3)), np.array([[1, 0, 1], [0, 1, 0]]))
    with pytest.raises(ValueError, match="epsilon"):
        dp_tpr_bound(0.1, -1.0, 1e-5)
