"""One-run privacy auditing: an epsilon lower bound from a single training run.

The game (Steinke, Nasr & Jagielski, NeurIPS 2023, "Privacy auditing with one
(1) training run", arXiv:2305.08846): ``m`` canaries, each included in
the training data independently with probability 1/2. After the one run the
auditor scores every canary (higher = more likely included), guesses "in" for
the ``k+`` highest scores and "out" for the ``k-`` lowest, and abstains on the
rest. Of the ``r = k+ + k-`` guesses, ``v`` are correct. A mechanism that is
DP with respect to each canary cannot make ``v`` large with high probability,
so a large ``v`` rejects the claimed guarantee; the largest rejected epsilon is
a lower bound on the true one at the chosen confidence.

Two analyses of the same ``(m, r, v)``:

- ``"steinke2023"``: the (epsilon, delta) bound of Steinke et al. With
  ``q = e^eps / (1 + e^eps)`` (the accuracy of eps-DP randomized response) and
  ``f(u) = P[Binomial(r, q) >= u]``, an eps-DP mechanism has
  ``P[V >= v] <= f(v)`` (their main theorem), and an (eps, delta)-DP one

      P[V >= v] <= f(v) + 2 m delta max_{1 <= i <= v} (f(v - i) - f(v)) / i   (delta term)

  (the approximate-DP theorem, computed as in the paper's ``p_value_DP_audit``
  code). The bound is the largest eps this rejects at level 1 - confidence,
  found by bisection as the paper's ``get_eps_audit`` does.
- ``"mahloujifar2025-gdp"``: the f-DP analysis of Mahloujifar, Melis &
  Chaudhuri (ICML 2025, "Auditing f-differential privacy in one run",
  arXiv:2410.22235) with the Gaussian trade-off functions ``G_mu``: the
  largest mu whose mu-GDP is rejected (their recursion, ``audit_rh_with_cap``,
  see :func:`gdp_audit_rejects`), and the epsilon of mu-GDP at the given delta
  (Dong, Roth & Su, Cor. 2.13). This epsilon is a lower bound on the
  mechanism's epsilon *if* its trade-off curve has the Gaussian shape (the
  analysis hypothesises the f-DP curve family); the mu bound holds without
  that assumption.

Events are kept apart from how they are counted: :func:`guesses_from_scores`
and :func:`count_correct` turn scores into ``(r, v)``; :func:`one_run_p_value`,
:func:`epsilon_lower_bound`, :func:`gdp_audit_rejects` and
:func:`gdp_mu_lower_bound` count them; :func:`one_run_audit` does both and
chooses ``(k+, k-)`` when they are not given.

Choosing ``(k+, k-)`` after seeing which guesses were right is a multiple
comparison: the max over a grid of per-choice bounds, each at level
``1 - confidence``, holds at a lower confidence than claimed. The theorems hold
for guesses fixed before the membership bits are looked at. :func:`one_run_audit`
therefore tests every candidate at level ``(1 - confidence) / G`` (Bonferroni
over the ``G`` candidates, as ``jax_privacy.auditing``'s default threshold
strategy does), so the reported maximum holds at ``confidence``.

Several scores of the same run (:func:`audit_scores`: e.g. the white-box canaries'
sum, per-step and per-tensor scores) and both analyses are ``k`` more tests of one
null; flagging when any rejects is again a multiple comparison, paid the same way:
each test at level ``(1 - confidence) / k`` (and ``/ G`` within it), so that "some
bound exceeds the claim" has probability at most ``1 - confidence`` for a mechanism
that meets it.

:func:`steinke_ceiling` is the largest bound Steinke et al.'s analysis can give for
``m`` canaries at all (every guess right): a claim above it cannot be flagged by that
analysis, whatever the mechanism does.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from scipy import special, stats

from dptrain._checks import check_finite_array, check_in_interval, check_int
from dptrain.accounting.gdp import gdp_epsilon

__all__ = [
    "METHODS",
    "OneRunAudit",
    "audit_scores",
    "count_correct",
    "default_guess_candidates",
    "epsilon_lower_bound",
    "gdp_audit_rejects",
    "gdp_mu_lower_bound",
    "guesses_from_scores",
    "one_run_audit",
    "one_run_p_value",
    "pure_epsilon_all_correct",
    "steinke_ceiling",
]

#: The analyses :func:`one_run_audit` knows, by the name it reports.
METHODS: tuple[str, ...] = ("steinke2023", "mahloujifar2025-gdp")

# Bisection stops when the bracket is this narrow (relative to max(1, upper end)); the
# lower end, a rejected value, is returned, so stopping early only loosens the bound.
_TOL = 1e-10
_MAX_HALVINGS = 200
# Binomial terms farther than this many standard deviations from the mode and from v are
# left out of the p-value's sums (each is below e^-(this^2 / 2) of the ones kept).
_TAIL_SDS = 45.0
# Every rejection set is bounded (even all-correct guesses certify a finite epsilon or mu), so
# doubling always stops; this limit only turns a bug into an error instead of an endless loop.
_MAX_UPPER = 1e6


# -- argument checks ---------------------------------------------------------------------------


def _check_confidence(confidence: object) -> float:
    return check_in_interval("confidence", confidence, 0.0, 1.0)


def _check_audit_delta(delta: object) -> float:
    """delta of the claim under test: [0, 1); 0 is the pure-epsilon case."""
    return check_in_interval("delta", delta, 0.0, 1.0, low_open=False)


def _check_counts(m: object, r: object, v: object) -> tuple[int, int, int]:
    m = check_int("m", m, 2)
    r = check_int("r", r, 1)
    v = check_int("v", v, 0)
    if r > m:
        raise ValueError(f"r={r} is not allowed: the guesses cannot outnumber the m={m} canaries")
    if v > r:
        raise ValueError(f"v={v} is not allowed: the correct guesses cannot outnumber the r={r}")
    return m, r, v


# -- the events: guesses and correct guesses ---------------------------------------------------


def _included_array(included: Iterable[Any]) -> np.ndarray:
    raw = included.detach().cpu().numpy() if hasattr(included, "detach") else included
    arr = np.asarray(list(raw) if not isinstance(raw, np.ndarray) else raw).ravel()
    if arr.dtype != np.bool_:
        if not np.all(np.isin(arr, (0, 1))):
            bad = arr[~np.isin(arr, (0, 1))][:5].tolist()
            raise ValueError(
                f"included holds {bad}: expected booleans or 0/1 (1 = the canary was trained on)"
            )
        arr = arr.astype(np.bool_)
    return arr


def _check_same_length(name_a: str, a: np.ndarray, name_b: str, b: np.ndarray) -> None:
    if a.size != b.size:
        raise ValueError(
            f"{name_a} has {a.size} entries and {name_b} has {b.size}: expected one of each "
            "per canary"
        )


def _check_k(k_plus: object, k_minus: object, m: int) -> tuple[int, int]:
    kp = check_int("k_plus", k_plus, 0)
    km = check_int("k_minus", k_minus, 0)
    if kp + km > m:
        raise ValueError(
            f"k_plus + k_minus = {kp} + {km} = {kp + km} is not allowed: expected at most the "
            f"m={m} canaries (each canary is guessed at most once)"
        )
    if kp + km == 0:
        raise ValueError("k_plus = k_minus = 0 is not allowed: the auditor makes no guess")
    return kp, km


def _ascending_order(scores: np.ndarray, seed: int | None) -> np.ndarray:
    """Indices by increasing score; ties in a seeded random order.

    Breaking ties by canary index would make the guesses depend on how the
    canaries were numbered, which can correlate with membership (e.g. the
    included ones listed first); a random order fixed by ``seed`` cannot.
    """
    tie_keys = np.random.default_rng(seed).permutation(scores.size)
    return np.lexsort((tie_keys, scores))


def guesses_from_scores(
    scores: Iterable[float], k_plus: int, k_minus: int, *, seed: int | None = 0
) -> np.ndarray:
    """The auditor's guesses: +1 ("in") for the ``k_plus`` highest scores, -1 ("out") for
    the ``k_minus`` lowest, 0 (abstain) for the rest (Steinke et al. 2023's guesses
    ``T`` in ``{-1, 0, 1}^m``).

    Higher scores must mean "more likely included" (e.g. minus the loss). Ties
    are broken in a random order fixed by ``seed``, never by position.
    """
    s = check_finite_array("scores", scores)
    kp, km = _check_k(k_plus, k_minus, s.size)
    order = _ascending_order(s, seed)
    guesses = np.zeros(s.size, dtype=np.int8)
    guesses[order[: s.size - kp][:km]] = -1  # the k- lowest
    guesses[order[s.size - kp :]] = 1  # the k+ highest
    return guesses


def count_correct(guesses: Iterable[int], included: Iterable[Any]) -> tuple[int, int]:
    """``(r, v)``: the number of guesses (non-zero entries) and of correct ones.

    A guess +1 is correct when the canary was included, -1 when it was not
    (Steinke et al.: ``V = sum_i max(0, T_i S_i)``).
    """
    g = np.asarray(list(guesses) if not isinstance(guesses, np.ndarray) else guesses).ravel()
    inc = _included_array(included)
    _check_same_length("guesses", g, "included", inc)
    if not np.all(np.isin(g, (-1, 0, 1))):
        raise ValueError("guesses is not allowed: expected entries in {-1, 0, +1}")
    r = int(np.count_nonzero(g))
    v = int(np.count_nonzero((g == 1) & inc) + np.count_nonzero((g == -1) & ~inc))
    return r, v


# -- Steinke, Nasr & Jagielski (2023): the (epsilon, delta) tail bound ----------------------------


def _log_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """log of :func:`one_run_p_value` (checked arguments).

    Every term is a sum of binomial probabilities, taken as log-sum-exp of
    ``binom.logpmf`` rather than as ``sf``/``cdf`` differences: the delta term's
    windows ``P[v - i <= B < v]`` lie in the lower tail when q is small, where
    ``cdf(v-1) - cdf(v-i-1)`` cancels to rounding noise, and for large r the
    upper tail underflows double precision long before log space does.
    """
    if v == 0:
        return 0.0  # P[V >= 0] = 1
    q = float(special.expit(epsilon))  # e^eps / (1 + e^eps), without overflow
    # Only k within _TAIL_SDS standard deviations of [mode, v] can matter: farther terms
    # are below e^-1000 of their neighbours' (the pmf decays at least like a Gaussian
    # beyond the mode), and the windows' max over i is reached before they start.
    # For r = 10^6 this is about 50,000 terms instead of 10^6, per evaluation.
    mode, spread = r * q, _TAIL_SDS * math.sqrt(r * q * (1.0 - q)) + _TAIL_SDS
    lo = max(0, min(v - 1, math.floor(mode - spread)))
    hi = min(r, max(v, math.ceil(mode + spread)))
    log_pmf = stats.binom.logpmf(np.arange(lo, hi + 1), r, q)
    log_f = float(special.logsumexp(log_pmf[v - lo :]))  # log P[B >= v]
    if delta == 0.0:
        return log_f
    # log P[v - i <= B <= v - 1] for i = 1..v - lo, by accumulating from k = v - 1 downwards
    log_windows = np.logaddexp.accumulate(log_pmf[v - 1 - lo :: -1])
    log_alpha = float(np.max(log_windows - np.log(np.arange(1, v - lo + 1))))
    return float(np.logaddexp(log_f, math.log(2.0 * m * delta) + log_alpha))


def one_run_p_value(m: int, r: int, v: int, epsilon: float, delta: float = 0.0) -> float:
    """Upper bound on ``P[V >= v]`` for an (epsilon, delta)-DP mechanism (Steinke et al. 2023).

    With ``q = e^eps / (1 + e^eps)`` and ``f(u) = P[Binomial(r, q) >= u]``:
    ``f(v)`` for delta = 0 (the pure-DP main theorem), and otherwise
    ``f(v) + 2 m delta max_{1<=i<=v} (f(v-i) - f(v)) / i`` (the approximate-DP
    theorem; the max over ``i > v`` adds nothing since ``f(u) = 1`` for
    ``u <= 0``). Capped at 1. This is the p-value of observing ``v`` correct
    of ``r`` guesses on ``m`` canaries under the null "the mechanism is
    (epsilon, delta)-DP".
    """
    m, r, v = _check_counts(m, r, v)
    eps = check_in_interval("epsilon", epsilon, 0.0, math.inf, low_open=False)
    delta = _check_audit_delta(delta)
    return min(1.0, math.exp(_log_p_value(m, r, v, eps, delta)))


def _largest_rejected(rejects: Callable[[float], bool], start: float = 1.0) -> float:
    """sup{x >= 0 : rejects(x)} for a rejection set [0, x*) (the caller checked rejects(0)).

    Doubling finds a non-rejected upper end (Steinke et al.'s ``get_eps_audit``
    steps it by +1; doubling reaches large values in fewer evaluations), then
    bisection keeps ``rejects(lo)`` and ``not rejects(hi)``.
    """
    lo, hi = 0.0, start
    while rejects(hi):
        lo, hi = hi, 2.0 * hi
        if hi > _MAX_UPPER:
            raise RuntimeError(f"the rejection set reaches {lo:g}: no finite bound was found")
    for _ in range(_MAX_HALVINGS):
        if hi - lo <= _TOL * max(1.0, hi):
            break
        mid = 0.5 * (lo + hi)
        if rejects(mid):
            lo = mid
        else:
            hi = mid
    return lo


def _steinke_rejects(
    m: int, r: int, v: int, delta: float, confidence: float
) -> Callable[[float], bool]:
    """eps -> whether (eps, delta)-DP is rejected at level 1 - confidence (checked arguments)."""
    log_beta = math.log1p(-confidence)

    def rejects(eps: float) -> bool:
        return _log_p_value(m, r, v, eps, delta) < log_beta

    return rejects


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, confidence: float) -> float:
    """Steinke et al.'s epsilon lower bound: the largest eps whose (eps, delta)-DP is rejected.

    ``sup{eps >= 0 : one_run_p_value(m, r, v, eps, delta) < 1 - confidence}``,
    0 when even eps = 0 is not rejected. With probability at least
    ``confidence`` over the canaries' inclusion bits, a mechanism that is
    (eps, delta)-DP with respect to each canary gets a bound <= eps, provided
    the ``r`` guesses are fixed before the bits are looked at (see
    :func:`one_run_audit` for choosing them from the data). delta = 0 is the
    pure-epsilon case, where ``m`` plays no role.

    The bisection assumes the p-value increases with eps, as the paper's does.
    The delta term alone need not (it fades as q passes v/r); the tests check
    that the p-value does while it is below 1/2, which is where the crossing
    with any ``1 - confidence < 1/2`` lies.
    """
    m, r, v = _check_counts(m, r, v)
    delta = _check_audit_delta(delta)
    rejects = _steinke_rejects(m, r, v, delta, _check_confidence(confidence))
    return _largest_rejected(rejects) if rejects(0.0) else 0.0


def pure_epsilon_all_correct(r: int, confidence: float) -> float:
    """The pure-eps bound when all ``r`` guesses are correct, in closed form.

    ``P[Binomial(r, q) >= r] = q^r < beta`` for ``q < beta^(1/r)``, so the bound
    is ``logit(beta^(1/r))`` (``beta = 1 - confidence``): the largest epsilon
    ``r`` guesses can ever certify, growing only like ``log(r / log(1/beta))``.
    """
    r = check_int("r", r, 1)
    log_beta = math.log1p(-_check_confidence(confidence))
    log_q = log_beta / r
    # log(q / (1 - q)); negative (nothing certified) when q = beta^(1/r) < 1/2
    return max(0.0, log_q - math.log(-math.expm1(log_q)))


# -- Mahloujifar, Melis & Chaudhuri (2025): the f-DP recursion with Gaussian trade-offs --------


def _fdp_rejects(
    inverse_blow_up: Callable[[float], float], m: int, r: int, v: int, tau: float
) -> bool:
    """Mahloujifar et al.'s test of an f-DP claim from ``v`` correct of ``r`` guesses.

    ``inverse_blow_up`` is the inverse of ``f_bar(x) = 1 - f(x)``. Start from
    ``a_v = tau v / m`` and ``b_v = tau (r - v) / m`` (a probability tau of
    ``v`` correct and ``r - v`` wrong guesses, per canary) and go down
    ``i = v-1, ..., 0``:

        b_i = max(b_{i+1}, f_bar^{-1}(a_{i+1}))
        a_i = a_{i+1} + i / (r - i) * (b_i - b_{i+1})

    The claim is rejected at level tau when ``a_0 + b_0 > r / m``: the mass
    that the f-DP constraint forces exceeds what ``r`` guesses among ``m``
    canaries can carry (``audit_rh_with_cap`` in the paper's algorithm, as in
    Meta's ``privacy_guard`` and DeepMind's ``jax_privacy``; membership is
    their alphabet size k = 2, so the factor ``k - 1`` is 1).

    ``a`` and ``b`` never decrease, so the loop stops as soon as the sum
    passes ``r / m`` (rejected) or ``b`` stops changing (nothing changes after).
    """
    a = tau * v / m
    b = tau * (r - v) / m
    limit = r / m
    for i in range(v - 1, -1, -1):
        b_new = max(b, inverse_blow_up(a))
        if b_new == b:
            break
        a += i / (r - i) * (b_new - b)
        b = b_new
        if a + b > limit:
            return True
    return a + b > limit


def _gaussian_inverse_blow_up(mu: float) -> Callable[[float], float]:
    """``f_bar^{-1}(y) = Phi(Phi^{-1}(y) - mu)`` for the Gaussian trade-off ``G_mu``.

    ``G_mu(x) = Phi(Phi^{-1}(1 - x) - mu)``, the trade-off between N(0, 1) and
    N(mu, 1) (Dong, Roth & Su 2022, Gaussian differential privacy), so
    ``1 - G_mu(x) = Phi(Phi^{-1}(x) + mu)``, whose inverse this is.
    """

    def inverse(y: float) -> float:
        return float(special.ndtr(special.ndtri(y) - mu))

    return inverse


def _gdp_rejects(m: int, r: int, v: int, confidence: float) -> Callable[[float], bool]:
    """mu -> whether mu-GDP is rejected at level 1 - confidence (checked arguments)."""
    tau = 1.0 - confidence

    def rejects(mu: float) -> bool:
        return _fdp_rejects(_gaussian_inverse_blow_up(mu), m, r, v, tau)

    return rejects


def gdp_audit_rejects(m: int, r: int, v: int, mu: float, confidence: float) -> bool:
    """Whether ``v`` correct of ``r`` guesses on ``m`` canaries rejects mu-GDP.

    Mahloujifar, Melis & Chaudhuri (2025)'s recursion (:func:`_fdp_rejects`)
    with the Gaussian trade-off function ``G_mu`` at level
    ``tau = 1 - confidence``. mu = 0 (perfect privacy) is allowed.
    """
    m, r, v = _check_counts(m, r, v)
    mu = check_in_interval("mu", mu, 0.0, math.inf, low_open=False)
    return _gdp_rejects(m, r, v, _check_confidence(confidence))(mu)


def gdp_mu_lower_bound(m: int, r: int, v: int, confidence: float) -> float:
    """The largest mu whose mu-GDP :func:`gdp_audit_rejects` rejects (0 if none).

    Found by bisection on mu, as the epsilon of :func:`epsilon_lower_bound`:
    smaller mu means a trade-off curve closer to the diagonal, which forces
    more mass in the recursion, so the rejected mu form an interval ``[0, mu*)``
    (the tests check this on a grid; the papers' searches assume it too).
    """
    m, r, v = _check_counts(m, r, v)
    rejects = _gdp_rejects(m, r, v, _check_confidence(confidence))
    return _largest_rejected(rejects) if rejects(0.0) else 0.0


# -- the audit: scores in, a bound out ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OneRunAudit:
    """The result of :func:`one_run_audit`.

    ``epsilon`` is the lower bound at ``delta``, holding with probability
    ``confidence`` (over the inclusion bits) for the whole search over
    ``n_candidates`` choices of ``(k_plus, k_minus)`` and the ``tests`` tests of the
    family it belongs to (:func:`audit_scores`; each candidate is tested at level
    ``(1 - confidence) / (n_candidates * tests)``). ``mu`` is the GDP lower bound for
    ``method == "mahloujifar2025-gdp"`` and None otherwise. ``score`` names the score
    the canaries were ranked by ("" when there is one).
    """

    epsilon: float
    method: str
    m: int
    r: int
    v: int
    k_plus: int
    k_minus: int
    confidence: float
    delta: float
    n_candidates: int
    mu: float | None = None
    score: str = ""
    tests: int = 1

    @property
    def accuracy(self) -> float:
        """``v / r``: the share of correct guesses."""
        return self.v / self.r

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def default_guess_candidates(m: int) -> list[tuple[int, int]]:
    """The ``(k_plus, k_minus)`` grid :func:`one_run_audit` searches when none is given.

    Guess counts ``r`` in the 1-2-5 sequence up to ``m`` (and ``m`` itself),
    each one-sided (``(r, 0)``: "in" for the r highest scores, the white-box
    case where included canaries stand out) and two-sided (``(r - r//2, r//2)``).
    About ``6 log10(m)`` candidates: the Bonferroni cost is the log of that in
    the tail, far less than what a good ``r`` gains.
    """
    m = check_int("m", m, 2)
    counts = sorted(
        {c * 10**e for e in range(int(math.log10(m)) + 1) for c in (1, 2, 5) if c * 10**e <= m}
        | {m}
    )
    out: list[tuple[int, int]] = []
    for r in counts:
        out.append((r, 0))
        if r >= 2:
            out.append((r - r // 2, r // 2))
    return out


def one_run_audit(
    scores: Iterable[float],
    included: Iterable[Any],
    delta: float,
    confidence: float,
    k_plus: int | None = None,
    k_minus: int | None = None,
    *,
    method: str = "steinke2023",
    candidates: Sequence[tuple[int, int]] | None = None,
    seed: int | None = 0,
    tests: int = 1,
    score: str = "",
) -> OneRunAudit:
    """Epsilon lower bound from one run: canary scores and inclusion bits in, a bound out.

    Args:
        scores: one score per canary, higher = more likely included (e.g. minus the
            loss, or the alignment of the canary gradient with the update).
        included: one bit per canary (bool or 0/1): whether it was trained on. The
            theorems need each canary included independently with probability 1/2.
        delta: the delta of the claim under test, in [0, 1) (0: pure epsilon; the
            GDP method needs delta > 0 to turn mu into an epsilon).
        confidence: in (0, 1), e.g. 0.95.
        k_plus, k_minus: guess "in" for the ``k_plus`` highest scores and "out" for
            the ``k_minus`` lowest. Give them (one alone means the other is 0) when
            fixed before the audit: one test at level ``1 - confidence``. Left out,
            the best of ``candidates`` is taken, each tested at level
            ``(1 - confidence) / len(candidates)`` (Bonferroni) so that the reported
            maximum still holds at ``confidence``.
        method: ``"steinke2023"`` (:func:`epsilon_lower_bound`) or
            ``"mahloujifar2025-gdp"`` (:func:`gdp_mu_lower_bound`, reported with its
            epsilon at ``delta``).
        candidates: ``(k_plus, k_minus)`` pairs to search; default
            :func:`default_guess_candidates`.
        seed: fixes the random order among tied scores.
        tests: the number of tests in the family this one belongs to (several scores or
            analyses of one run, :func:`audit_scores`): the level is divided by it too
            (Bonferroni), so that the family holds at ``confidence``.
        score: the name of the score, kept in the result.

    Among candidates with the same bound (e.g. all 0), the first is reported.
    """
    s = check_finite_array("scores", scores)
    inc = _included_array(included)
    _check_same_length("scores", s, "included", inc)
    m = s.size
    if m < 2:
        raise ValueError(
            f"m={m} is not allowed: scores and included give {m} canar{'y' if m == 1 else 'ies'}, "
            "expected at least 2"
        )
    delta = _check_audit_delta(delta)
    confidence = _check_confidence(confidence)
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not allowed: expected one of {list(METHODS)}")
    if method == "mahloujifar2025-gdp" and delta == 0.0:
        raise ValueError(
            "delta=0 is not allowed with method='mahloujifar2025-gdp': a Gaussian trade-off "
            "curve has no finite pure epsilon; give delta > 0"
        )

    if k_plus is not None or k_minus is not None:
        if candidates is not None:
            raise ValueError("give either k_plus/k_minus or candidates, not both")
        grid = [_check_k(k_plus or 0, k_minus or 0, m)]
    else:
        grid = (
            default_guess_candidates(m)
            if candidates is None
            else [_check_k(kp, km, m) for kp, km in candidates]
        )
        if not grid:
            raise ValueError("candidates=[] is not allowed: expected at least one (k+, k-)")
    tests = check_int("tests", tests, 1)
    per_test_confidence = 1.0 - (1.0 - confidence) / (len(grid) * tests)

    # v for every candidate from one sort: included counts among the lowest / highest scores
    included_sorted = inc[_ascending_order(s, seed)].astype(np.int64)
    in_below = np.concatenate(([0], np.cumsum(included_sorted)))  # in_below[k]: among k lowest
    n_in = int(in_below[-1])

    def correct(kp: int, km: int) -> int:
        return (n_in - int(in_below[m - kp])) + (km - int(in_below[km]))

    best: tuple[float, int, int, int] | None = None  # (bound, k+, k-, v)
    for kp, km in grid:
        r, v = kp + km, correct(kp, km)
        if method == "steinke2023":
            rejects = _steinke_rejects(m, r, v, delta, per_test_confidence)
        else:
            rejects = _gdp_rejects(m, r, v, per_test_confidence)
        # the rejected values form an interval [0, x*): one that does not reject the best so
        # far cannot beat it, and its search is skipped
        if best is not None and not rejects(best[0]):
            continue
        b = _largest_rejected(rejects) if rejects(0.0) else 0.0
        if best is None or b > best[0]:
            best = (b, kp, km, v)
    assert best is not None
    b, kp, km, v = best
    if method == "steinke2023":
        epsilon, mu = b, None
    else:
        epsilon, mu = gdp_epsilon(delta, b), b
    return OneRunAudit(
        epsilon=epsilon,
        method=method,
        m=m,
        r=kp + km,
        v=v,
        k_plus=kp,
        k_minus=km,
        confidence=confidence,
        delta=delta,
        n_candidates=len(grid),
        mu=mu,
        score=score,
        tests=tests,
    )


def audit_scores(
    scores: Mapping[str, Iterable[float]],
    included: Iterable[Any],
    delta: float,
    confidence: float,
    *,
    methods: Sequence[str] = METHODS,
    tests: int | None = None,
) -> list[OneRunAudit]:
    """Every score under every method, as one family of tests at ``confidence``.

    ``scores`` maps a name to one score per canary (all of the same canaries, whose
    inclusion is ``included``). The family has ``tests`` members (default: the
    ``len(scores) * len(methods)`` audits made here; give more when other audits of
    the same claim are flagged together with these, e.g. a second run), and each is
    tested at level ``(1 - confidence) / tests`` (Bonferroni): the chance that any
    reported bound exceeds the epsilon of a mechanism that meets its claim is at most
    ``1 - confidence``. Returns one :class:`OneRunAudit` per (score, method), scores
    in the given order.
    """
    if not scores:
        raise ValueError("scores={} is not allowed: expected at least one named score")
    for method in methods:
        if method not in METHODS:
            raise ValueError(f"methods holds {method!r}: expected names in {list(METHODS)}")
    if not methods:
        raise ValueError("methods=[] is not allowed: expected at least one of " + str(METHODS))
    inc = _included_array(included)
    n = len(scores) * len(methods)
    tests = n if tests is None else check_int("tests", tests, n)
    return [
        one_run_audit(s, inc, delta, confidence, method=m, tests=tests, score=name)
        for name, s in scores.items()
        for m in methods
    ]


def steinke_ceiling(m: int, delta: float, confidence: float, tests: int = 1) -> float:
    """The largest epsilon Steinke et al.'s analysis can certify with ``m`` canaries.

    The bound grows with the correct guesses, so its largest value is reached when
    every guess is right: the max over the default guess counts ``r`` of the bound
    for ``v = r``, each at the level :func:`one_run_audit` would use
    (``(1 - confidence) / (G * tests)``, ``G`` candidates). A claimed epsilon above
    it cannot be flagged by this analysis whatever the mechanism leaks: with m = 10^6
    and delta = 1e-5 it is 4.22 (the 2 m delta term, 20 there, caps it); it is the
    only analysis valid for a Poisson-sampled run.
    """
    m = check_int("m", m, 2)
    delta = _check_audit_delta(delta)
    tests = check_int("tests", tests, 1)
    grid = default_guess_candidates(m)
    per_test = 1.0 - (1.0 - _check_confidence(confidence)) / (len(grid) * tests)
    best = 0.0
    for r in sorted({kp + km for kp, km in grid}):
        rejects = _steinke_rejects(m, r, r, delta, per_test)
        if rejects(best):  # only a count that beats the best so far is searched
            best = _largest_rejected(rejects, start=max(best, 1.0))
    return best
