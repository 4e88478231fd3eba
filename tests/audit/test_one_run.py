"""One-run auditing: tail bounds, epsilon / mu searches, guesses, the audit and bad input.

References are independent of the implementation: the binomial tails and the
delta term summed term by term in mpmath (the delta term's max over every
i = 1..m, as the theorem states it, not the implementation's i <= v); the
Mahloujifar et al. recursion written out in mpmath without the early exits;
and exact sizes of the tests under mechanisms whose output distribution is
known (randomized response, where the number of correct guesses is exactly
binomial; randomized response that reveals a canary with probability delta).
"""

from __future__ import annotations

import itertools
import math

import mpmath
import numpy as np
import pytest
from scipy import special, stats

from dptrain.accounting.gdp import gdp_epsilon
from dptrain.audit import (
    METHODS,
    OneRunAudit,
    audit_scores,
    count_correct,
    default_guess_candidates,
    epsilon_lower_bound,
    gdp_audit_rejects,
    gdp_mu_lower_bound,
    guesses_from_scores,
    one_run_audit,
    one_run_p_value,
    pure_epsilon_all_correct,
    steinke_ceiling,
)

mpmath.mp.dps = 50


# -- references ------------------------------------------------------------------------------


def mp_p_value(m: int, r: int, v: int, eps: float, delta: float) -> mpmath.mpf:
    """Steinke et al.'s bound, brute force: f(u) = P[Bin(r, q) >= u] summed term by term."""
    q = mpmath.e ** mpmath.mpf(eps) / (1 + mpmath.e ** mpmath.mpf(eps))
    pmf = [mpmath.binomial(r, k) * q**k * (1 - q) ** (r - k) for k in range(r + 1)]

    def f(u: int) -> mpmath.mpf:
        return mpmath.fsum(pmf[max(u, 0) :])

    value = f(v)
    if delta > 0:
        value += 2 * m * mpmath.mpf(delta) * max((f(v - i) - f(v)) / i for i in range(1, m + 1))
    return min(value, mpmath.mpf(1))


def mp_gdp_rejects(m: int, r: int, v: int, mu: float, tau: float) -> bool:
    """Mahloujifar et al.'s recursion with G_mu, every step, in mpmath."""
    mu = mpmath.mpf(mu)

    def inverse(y: mpmath.mpf) -> mpmath.mpf:  # Phi(Phi^{-1}(y) - mu); saturates at y = 1
        return mpmath.ncdf(mpmath.sqrt(2) * mpmath.erfinv(2 * min(y, 1) - 1) - mu)

    a = [mpmath.mpf(0)] * (v + 1)
    b = [mpmath.mpf(0)] * (v + 1)
    a[v] = mpmath.mpf(tau) * v / m
    b[v] = mpmath.mpf(tau) * (r - v) / m
    for i in range(v - 1, -1, -1):
        b[i] = max(b[i + 1], inverse(a[i + 1]))
        a[i] = a[i + 1] + mpmath.mpf(i) / (r - i) * (b[i] - b[i + 1])
    return a[0] + b[0] > mpmath.mpf(r) / m


def exact_size(r: int, q: float, rejects) -> float:
    """P[rejects(V)] for V ~ Binomial(r, q): the exact type-I error of a test on V."""
    return float(sum(stats.binom.pmf(v, r, q) for v in range(r + 1) if rejects(v)))


# -- Steinke et al.: the tail bound against mpmath ----------------------------------------------


@pytest.mark.parametrize(
    ("m", "r", "v", "eps", "delta"),
    [
        (10, 10, 7, 0.3, 0.0),
        (10, 6, 6, 1.0, 0.01),
        (50, 20, 15, 0.5, 1e-3),
        (50, 20, 3, 0.5, 1e-3),  # below chance: p near 1
        (200, 200, 190, 0.1, 0.0),  # far tail, ~1e-45
        (200, 150, 140, 0.2, 1e-5),  # tiny tail plus the delta term
        (100, 40, 30, 2.5, 1e-4),
        (30, 30, 0, 1.0, 0.1),
    ],
)
def test_p_value_matches_mpmath(m, r, v, eps, delta):
    ref = mp_p_value(m, r, v, eps, delta)
    got = one_run_p_value(m, r, v, eps, delta)
    assert got == pytest.approx(float(ref), rel=1e-9, abs=1e-300)


@pytest.mark.parametrize(
    ("m", "r", "v", "delta", "confidence"),
    [
        (20, 10, 10, 0.0, 0.95),
        (60, 40, 33, 1e-3, 0.95),
        (100, 50, 45, 1e-5, 0.99),
        (100, 80, 60, 0.0, 0.9),
        (40, 40, 36, 0.01, 0.95),
    ],
)
def test_epsilon_bound_is_the_mpmath_crossing(m, r, v, delta, confidence):
    """The bound rejects (p < beta) and a hair above it does not, by the mpmath p-value."""
    beta = 1 - confidence
    eps = epsilon_lower_bound(m, r, v, delta, confidence)
    assert eps > 0
    assert mp_p_value(m, r, v, eps, delta) < beta
    assert mp_p_value(m, r, v, eps + 1e-7, delta) >= beta


@pytest.mark.parametrize("r", [1, 10, 100, 1000, 20_000])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.999])
def test_all_correct_approaches_but_never_exceeds_the_closed_form(r, confidence):
    limit = pure_epsilon_all_correct(r, confidence)
    # 0 when q = beta^(1/r) < 1/2: one guess at 90% certifies nothing
    closed_form = max(0.0, special.logit((1 - confidence) ** (1 / r)))
    assert limit == pytest.approx(closed_form, rel=1e-12)
    m = max(r, 2)
    pure = epsilon_lower_bound(m, r, r, 0.0, confidence)
    assert limit - 1e-8 <= pure <= limit
    # delta > 0 pays for it, less the smaller delta
    bounds = [epsilon_lower_bound(m, r, r, d, confidence) for d in (1e-3, 1e-6, 1e-12)]
    assert all(b <= limit for b in bounds)
    assert bounds == sorted(bounds)
    assert bounds[-1] == pytest.approx(limit, rel=1e-5)


def test_all_correct_grows_only_logarithmically():
    """m = r canaries all guessed right: the bound keeps rising, by ~log(10) per decade."""
    bounds = [epsilon_lower_bound(r, r, r, 1e-5, 0.95) for r in (100, 1000, 10_000)]
    assert bounds == sorted(bounds)
    steps = np.diff(bounds)
    assert np.all(steps > 0.8 * math.log(10)) and np.all(steps < 1.2 * math.log(10))


@pytest.mark.parametrize("r", [2, 10, 100, 1000])
def test_chance_accuracy_gives_zero(r):
    for v in (r // 2, r // 4):
        assert epsilon_lower_bound(1000, r, v, 1e-5, 0.95) == 0.0
        assert epsilon_lower_bound(1000, r, v, 0.0, 0.95) == 0.0
        assert gdp_mu_lower_bound(1000, r, v, 0.95) == 0.0


def test_monotone_in_correct_guesses_confidence_and_delta():
    m, r = 1000, 100
    by_v = [epsilon_lower_bound(m, r, v, 1e-5, 0.95) for v in range(50, r + 1)]
    assert all(b1 <= b2 for b1, b2 in itertools.pairwise(by_v))
    positive = [b for b in by_v if b > 0]
    assert len(positive) > 20 and all(b1 < b2 for b1, b2 in itertools.pairwise(positive))

    by_conf = [epsilon_lower_bound(m, r, 90, 1e-5, c) for c in (0.5, 0.8, 0.9, 0.95, 0.99, 0.999)]
    assert all(b1 > b2 for b1, b2 in itertools.pairwise(by_conf))

    by_delta = [epsilon_lower_bound(m, r, 90, d, 0.95) for d in (0.0, 1e-8, 1e-5, 1e-4, 1e-3)]
    assert all(b1 >= b2 for b1, b2 in itertools.pairwise(by_delta))
    assert by_delta[0] > by_delta[-1]

    # more canaries at the same (r, v): the delta term 2 m delta grows
    by_m = [epsilon_lower_bound(m_, r, 90, 1e-4, 0.95) for m_ in (100, 1000, 10_000)]
    assert by_m[0] > by_m[1] > by_m[2]


@pytest.mark.parametrize(("m", "r", "v"), [(1000, 100, 90), (100, 30, 20), (10_000, 2000, 1300)])
@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_p_value_increases_with_epsilon_below_one_half(m, r, v, delta):
    """The bisection's assumption: below 1/2, the p-value does not fall as epsilon grows."""
    eps = np.linspace(0.0, 6.0, 601)
    p = np.array([one_run_p_value(m, r, v, e, delta) for e in eps])
    first_half = np.argmax(p >= 0.5) if np.any(p >= 0.5) else p.size
    assert np.all(np.diff(p[:first_half]) >= -1e-15)


# -- Steinke et al.: exact sizes under known mechanisms ------------------------------------------


@pytest.mark.parametrize("eps", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("confidence", [0.9, 0.95])
def test_exact_size_under_randomized_response(eps, confidence):
    """eps-DP randomized response on each canary: V ~ Binomial(r, e^eps / (1 + e^eps)) exactly,
    so P[bound > eps] is computable; it must not exceed 1 - confidence."""
    q = float(special.expit(eps))
    beta = 1 - confidence
    sizes = []
    for r in (10, 50, 200):
        for delta in (0.0, 1e-5):
            size = exact_size(r, q, lambda v, r=r, d=delta: epsilon_lower_bound(1000, r, v, d, confidence) > eps)  # fmt: skip
            assert size <= beta
            sizes.append(size)
    # and the pure bound is tight for this mechanism: some size comes close to beta
    assert max(sizes) > 0.4 * beta


@pytest.mark.parametrize(("m", "r", "eps", "delta"), [(1000, 10, 0.5, 0.01), (300, 20, 1.0, 0.03)])
def test_delta_term_protects_against_revealed_canaries(m, r, eps, delta):
    """(eps, delta)-DP: with probability delta a canary's bit is published outright, else
    eps-randomized response. The auditor guesses the revealed canaries first. The delta
    analysis keeps the size below beta; analysing the same data as pure eps-DP does not."""
    q = float(special.expit(eps))
    beta = 0.05

    def size(analysis_delta: float) -> float:
        total = 0.0
        for revealed in range(m + 1):
            p_rev = stats.binom.pmf(revealed, m, delta)
            if p_rev < 1e-14:
                continue
            k = min(revealed, r)
            for w in range(r - k + 1):  # correct guesses among the randomized-response ones
                if epsilon_lower_bound(m, r, k + w, analysis_delta, 1 - beta) > eps:
                    total += p_rev * stats.binom.pmf(w, r - k, q)
        return total

    assert size(delta) <= beta
    assert size(0.0) > beta


# -- Mahloujifar et al.: the GDP recursion ------------------------------------------------------


@pytest.mark.parametrize(
    ("m", "r", "v", "confidence"),
    [(100, 20, 18, 0.95), (200, 60, 50, 0.9), (1000, 100, 95, 0.95), (50, 50, 50, 0.99)],
)
def test_mu_bound_is_the_mpmath_crossing(m, r, v, confidence):
    mu = gdp_mu_lower_bound(m, r, v, confidence)
    assert mu > 0
    tau = 1 - confidence
    assert mp_gdp_rejects(m, r, v, mu - 1e-7, tau)
    assert not mp_gdp_rejects(m, r, v, mu + 1e-6, tau)


def test_gdp_rejects_matches_mpmath_recursion():
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(60):
        m = int(rng.integers(2, 300))
        r = int(rng.integers(1, min(m, 80) + 1))
        v = int(rng.integers(r // 2, r + 1))
        mu = float(rng.uniform(0.0, 3.0))
        got = gdp_audit_rejects(m, r, v, mu, 0.95)
        below, above = (mp_gdp_rejects(m, r, v, mu * f, 0.05) for f in (1 - 1e-6, 1 + 1e-6))
        if below != above:  # within rounding of the boundary
            continue
        assert got == mp_gdp_rejects(m, r, v, mu, 0.05), (m, r, v, mu)
        checked += 1
    assert checked > 50


def test_gdp_rejection_is_an_interval_in_mu():
    rng = np.random.default_rng(3)
    mus = np.linspace(0.0, 4.0, 81)
    for _ in range(40):
        m = int(rng.integers(10, 500))
        r = int(rng.integers(1, m + 1))
        v = int(rng.integers(r // 2, r + 1))
        rejected = [gdp_audit_rejects(m, r, v, mu, 0.95) for mu in mus]
        assert rejected == sorted(rejected, reverse=True), (m, r, v)


@pytest.mark.parametrize("r", [5, 10, 30, 100])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_gdp_exact_size_when_nothing_leaks(r, confidence):
    """mu = 0: the guesses are independent of the bits, V ~ Binomial(r, 1/2) exactly. The test
    may be no stronger than the exact binomial test, which is Steinke's at eps = 0."""
    beta = 1 - confidence
    gdp_size = exact_size(r, 0.5, lambda v: gdp_audit_rejects(1000, r, v, 0.0, confidence))
    assert gdp_size <= beta
    binomial = exact_size(r, 0.5, lambda v: one_run_p_value(1000, r, v, 0.0) < beta)
    assert gdp_size <= binomial + 1e-15


@pytest.mark.parametrize("eps", [0.5, 1.0, 3.0])
def test_gdp_exact_size_under_randomized_response(eps):
    """eps-randomized response is G_mu-DP for mu = 2 Phi^{-1}(q) (its trade-off curve has its
    corner at (1 - q, 1 - q), and G_mu passes there at that mu)."""
    q = float(special.expit(eps))
    mu_rr = 2 * float(special.ndtri(q))
    for r in (10, 50, 200):
        size = exact_size(r, q, lambda v, r=r: gdp_mu_lower_bound(1000, r, v, 0.95) > mu_rr)
        assert size <= 0.05


def test_gdp_monotone_in_correct_guesses_and_confidence():
    by_v = [gdp_mu_lower_bound(1000, 100, v, 0.95) for v in range(60, 101)]
    assert all(b1 <= b2 for b1, b2 in itertools.pairwise(by_v))
    assert by_v[-1] > by_v[-11] > 0
    by_conf = [gdp_mu_lower_bound(1000, 100, 90, c) for c in (0.8, 0.9, 0.95, 0.99)]
    assert all(b1 > b2 for b1, b2 in itertools.pairwise(by_conf))


# -- the audit: simulated Gaussian mechanism ---------------------------------------------------


def _gaussian_run(mu: float, seed: int, m: int = 1000) -> tuple[np.ndarray, np.ndarray]:
    """One 'training run' of an exactly mu-GDP mechanism: each canary's score is
    N(mu, 1) when included and N(0, 1) when not, canaries included with probability 1/2."""
    rng = np.random.default_rng(seed)
    included = rng.random(m) < 0.5
    return rng.normal(size=m) + mu * included, included


def test_simulated_gaussian_mechanism_bounds_hold_and_have_power():
    mu, delta = 1.0, 1e-5
    true_eps = gdp_epsilon(delta, mu)  # 4.38
    steinke, gdp = [], []
    for seed in range(50):
        scores, included = _gaussian_run(mu, seed)
        steinke.append(one_run_audit(scores, included, delta, 0.95))
        gdp.append(one_run_audit(scores, included, delta, 0.95, method="mahloujifar2025-gdp"))
    # valid: at 95% confidence, at most a few of 50 trials may overshoot (none expected)
    assert sum(a.epsilon > true_eps for a in steinke) <= 5
    assert sum(a.mu > mu for a in gdp) <= 5
    assert sum(a.epsilon > true_eps for a in gdp) <= 5
    # useful: a leak this size is detected, and the GDP analysis is the tighter
    assert np.median([a.epsilon for a in steinke]) > 1.0
    assert np.median([a.mu for a in gdp]) > 0.4
    assert np.median([a.epsilon for a in gdp]) > np.median([a.epsilon for a in steinke])


def test_clearly_non_private_mechanism_is_caught_and_private_one_is_not():
    scores, included = _gaussian_run(6.0, seed=1)
    for method in METHODS:
        assert one_run_audit(scores, included, 1e-5, 0.95, method=method).epsilon > 3.0
    scores, included = _gaussian_run(0.0, seed=1)
    for method in METHODS:
        assert one_run_audit(scores, included, 1e-5, 0.95, method=method).epsilon == 0.0


def test_grid_search_pays_bonferroni():
    scores, included = _gaussian_run(2.0, seed=4)
    res = one_run_audit(scores, included, 1e-5, 0.95)
    grid = default_guess_candidates(1000)
    assert res.n_candidates == len(grid)
    assert (res.k_plus, res.k_minus) in grid
    per_test = 1 - 0.05 / len(grid)
    assert res.epsilon == epsilon_lower_bound(1000, res.r, res.v, 1e-5, per_test)
    # the reported choice, had it been fixed in advance, certifies more
    fixed = one_run_audit(scores, included, 1e-5, 0.95, k_plus=res.k_plus, k_minus=res.k_minus)
    assert fixed.n_candidates == 1 and (fixed.r, fixed.v) == (res.r, res.v)
    assert fixed.epsilon > res.epsilon
    # and the best of the grid tested without correction would claim more still
    uncorrected = max(
        epsilon_lower_bound(1000, kp + km, _v(scores, included, kp, km), 1e-5, 0.95)
        for kp, km in grid
    )
    assert uncorrected >= fixed.epsilon > res.epsilon


def test_several_scores_are_one_family_bonferroni_over_all_tests():
    scores, included = _gaussian_run(2.0, seed=5)
    noisy = scores + np.random.default_rng(0).normal(size=scores.size)
    found = audit_scores({"a": scores, "b": noisy}, included, 1e-5, 0.95)
    assert [(a.score, a.method) for a in found] == [
        ("a", METHODS[0]),
        ("a", METHODS[1]),
        ("b", METHODS[0]),
        ("b", METHODS[1]),
    ]
    for a in found:  # each test at level 0.05 / 4, the grid's G within it
        assert a.tests == 4 and a.confidence == 0.95
        alone = one_run_audit(
            {"a": scores, "b": noisy}[a.score], included, 1e-5, 1 - 0.05 / 4, method=a.method
        )
        assert a.epsilon == alone.epsilon and (a.r, a.v) == (alone.r, alone.v)
    # a larger family (another run's tests) costs each test more, never less
    wider = audit_scores({"a": scores}, included, 1e-5, 0.95, methods=["steinke2023"], tests=8)
    assert wider[0].tests == 8 and wider[0].epsilon <= found[0].epsilon
    with pytest.raises(ValueError, match="tests=1 is not allowed"):
        audit_scores({"a": scores, "b": noisy}, included, 1e-5, 0.95, tests=1)
    with pytest.raises(ValueError, match="methods holds 'lira'"):
        audit_scores({"a": scores}, included, 1e-5, 0.95, methods=["lira"])
    with pytest.raises(ValueError, match=r"scores=\{\} is not allowed"):
        audit_scores({}, included, 1e-5, 0.95)


def test_bonferroni_over_scores_keeps_the_size_when_nothing_leaks():
    """Three independent null scores per run, flagged if any bound is > 0: at most 5% of
    runs, as the correction promises (without it, about 3 x the per-test rate)."""
    rng = np.random.default_rng(7)
    flagged = 0
    runs = 200
    for _ in range(runs):
        included = rng.random(200) < 0.5
        found = audit_scores(
            {k: rng.normal(size=200) for k in "xyz"}, included, 0.0, 0.95, methods=["steinke2023"]
        )
        flagged += any(a.epsilon > 0 for a in found)
    assert flagged / runs <= 0.05 + 2 * math.sqrt(0.05 * 0.95 / runs)


def test_steinke_ceiling_is_the_best_all_correct_bound():
    for m, delta in [(1000, 1e-3), (1000, 1e-5), (20_000, 1e-5)]:
        grid = default_guess_candidates(m)
        per_test = 1 - 0.05 / len(grid)
        brute = max(epsilon_lower_bound(m, kp + km, kp + km, delta, per_test) for kp, km in grid)
        assert steinke_ceiling(m, delta, 0.95) == pytest.approx(brute, abs=1e-8)
    assert steinke_ceiling(1000, 1e-3, 0.95) == 0.0  # the measurement
    # no outcome beats it: perfectly separated canaries come close (their guess counts of
    # the grid are all right only where they do not exceed the ~10^4 included ones)
    included = np.random.default_rng(1).random(20_000) < 0.5
    best = one_run_audit(included.astype(float), included, 1e-5, 0.95)
    ceiling = steinke_ceiling(20_000, 1e-5, 0.95)
    assert 0.9 * ceiling < best.epsilon <= ceiling
    assert steinke_ceiling(20_000, 1e-5, 0.95, tests=6) < steinke_ceiling(20_000, 1e-5, 0.95)


@pytest.mark.slow
def test_steinke_ceiling_at_a_million_canaries():
    # the number: no Poisson-sampled run claiming more than 4.22 can be flagged
    assert steinke_ceiling(10**6, 1e-5, 0.95) == pytest.approx(4.224, abs=1e-3)


@pytest.mark.parametrize(("r", "v"), [(100_000, 60_000), (100_000, 99_000), (300_000, 150_500)])
@pytest.mark.parametrize("eps", [0.1, 1.0, 3.0])
def test_p_value_sums_only_what_matters(r, v, eps):
    """The p-value's sums skip binomial terms far from the mode and v: the full sums agree."""
    m, delta = 10**6, 1e-5
    q = float(special.expit(eps))
    log_pmf = stats.binom.logpmf(np.arange(r + 1), r, q)
    log_f = special.logsumexp(log_pmf[v:])
    windows = np.logaddexp.accumulate(log_pmf[v - 1 :: -1]) - np.log(np.arange(1, v + 1))
    full = min(1.0, math.exp(np.logaddexp(log_f, math.log(2 * m * delta) + windows.max())))
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(full, rel=1e-9, abs=1e-300)


def _v(scores, included, kp, km):
    return count_correct(guesses_from_scores(scores, kp, km), included)[1]


def test_audit_with_fixed_guesses_matches_the_parts():
    scores, included = _gaussian_run(1.5, seed=2, m=300)
    for kp, km in [(30, 0), (0, 30), (20, 20), (300, 0), (150, 150)]:
        r, v = count_correct(guesses_from_scores(scores, kp, km), included)
        res = one_run_audit(scores, included, 1e-5, 0.9, kp, km)
        assert (res.r, res.v, res.m) == (r, v, 300)
        assert res.epsilon == epsilon_lower_bound(300, r, v, 1e-5, 0.9)
        gdp = one_run_audit(scores, included, 1e-5, 0.9, kp, km, method="mahloujifar2025-gdp")
        assert gdp.mu == gdp_mu_lower_bound(300, r, v, 0.9)
        assert gdp.epsilon == gdp_epsilon(1e-5, gdp.mu)
    one_sided = one_run_audit(scores, included, 1e-5, 0.9, k_plus=30)
    assert (one_sided.k_plus, one_sided.k_minus) == (30, 0)


def test_result_is_frozen_and_serialises():
    scores, included = _gaussian_run(1.0, seed=0, m=100)
    res = one_run_audit(scores, included, 0.0, 0.95, k_plus=10, k_minus=10)
    assert isinstance(res, OneRunAudit)
    assert res.method == "steinke2023" and res.mu is None and res.delta == 0.0
    assert res.to_dict()["epsilon"] == res.epsilon
    assert res.accuracy == res.v / res.r
    with pytest.raises(AttributeError):
        res.epsilon = 1.0  # type: ignore[misc]


# -- guesses ---------------------------------------------------------------------------------


def test_guesses_take_the_extremes():
    scores = [0.3, -2.0, 5.0, 1.0, -1.0, 4.0]
    g = guesses_from_scores(scores, 2, 1)
    assert g.tolist() == [0, -1, 1, 0, 0, 1]
    assert count_correct(g, [0, 0, 1, 1, 1, 0]) == (3, 2)
    assert count_correct(g, [True, False, True, False, False, True]) == (3, 3)


def test_ties_are_broken_at_random_not_by_position():
    """Index order would guess 'in' for the first canaries; a seeded random order does not."""
    scores = np.zeros(1000)
    picks = [np.flatnonzero(guesses_from_scores(scores, 100, 0, seed=s) == 1) for s in (0, 1)]
    assert np.mean(picks[0]) == pytest.approx(500, abs=60)
    assert not np.array_equal(picks[0], picks[1])
    assert np.array_equal(picks[0], np.flatnonzero(guesses_from_scores(scores, 100, 0) == 1))


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scores": [1.0], "included": [True]}, r"m=1 is not allowed"),
        ({"confidence": 1.0}, r"confidence=1\.0 is outside the allowed range \(0, 1\)"),
        ({"confidence": 0}, r"confidence=0 is outside the allowed range \(0, 1\)"),
        ({"delta": 1.0}, r"delta=1\.0 is outside the allowed range \[0, 1\)"),
        ({"delta": -1e-5}, r"delta=-1e-05 is outside the allowed range \[0, 1\)"),
        ({"k_plus": 3, "k_minus": 2}, r"k_plus \+ k_minus = 3 \+ 2 = 5 is not allowed.*m=4"),
        ({"k_plus": 0, "k_minus": 0}, r"k_plus = k_minus = 0"),
        ({"k_plus": -1}, r"k_plus=-1 is not allowed"),
        ({"included": [True, False, True]}, r"scores has 4 entries and included has 3"),
        ({"included": [1, 0, 2, 1]}, r"included holds \[2\]"),
        ({"scores": [1.0, math.nan, 0.0, 2.0]}, r"scores is not allowed: it holds NaN"),
        ({"method": "lira"}, r"method='lira' is not allowed: expected one of"),
        ({"method": "mahloujifar2025-gdp", "delta": 0.0}, r"delta=0 is not allowed with"),
        ({"candidates": [(1, 1), (4, 1)]}, r"k_plus \+ k_minus = 4 \+ 1 = 5"),
    ],
)
def test_one_run_audit_bad_input_names_the_argument(kwargs, match):
    args = {
        "scores": [0.1, 0.4, -0.3, 2.0],
        "included": [True, False, False, True],
        "delta": 1e-5,
        "confidence": 0.95,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        one_run_audit(**args)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: epsilon_lower_bound(1, 1, 1, 0.0, 0.95), r"m=1 is not allowed"),
        (lambda: epsilon_lower_bound(10, 11, 5, 0.0, 0.95), r"r=11 is not allowed.*m=10"),
        (lambda: epsilon_lower_bound(10, 5, 6, 0.0, 0.95), r"v=6 is not allowed.*r=5"),
        (lambda: epsilon_lower_bound(10, 5, 4, 0.0, 1.5), r"confidence=1\.5 is outside"),
        (lambda: epsilon_lower_bound(10, 5, 4, 1.0, 0.9), r"delta=1\.0 is outside"),
        (lambda: one_run_p_value(10, 5, 4, -1.0), r"epsilon=-1\.0 is outside"),
        (lambda: gdp_mu_lower_bound(10, 0, 0, 0.95), r"r=0 is not allowed"),
        (lambda: gdp_audit_rejects(10, 5, 4, -0.1, 0.95), r"mu=-0\.1 is outside"),
        (lambda: guesses_from_scores([1.0, 2.0], 2, 1), r"k_plus \+ k_minus = 2 \+ 1 = 3"),
        (lambda: count_correct([1, 0], [True]), r"guesses has 2 entries and included has 1"),
        (lambda: count_correct([2, 0], [True, False]), r"guesses is not allowed"),
    ],
)
def test_parts_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
