"""Gaussian differential privacy (Dong, Roth & Su 2019/2022) and its CLT.

Pure functions; :class:`dptrain.accounting.accountants.GDPAccountant` wraps them.

A mechanism is mu-GDP when distinguishing neighbours is no easier than telling
N(0, 1) from N(mu, 1). Its (epsilon, delta) curve (Dong et al., Cor. 2.13; DP-FP
paper eq. 3/17; Balle & Wang 2018, Thm. 8 for the Gaussian mechanism) is

    delta(eps; mu) = Phi(-eps/mu + mu/2) - exp(eps) * Phi(-eps/mu - mu/2).

The unsampled Gaussian mechanism with noise multiplier sigma is exactly
(1/sigma)-GDP and mu-GDP composes exactly: mu_tot^2 = sum mu_j^2.
T Poisson-subsampled steps (rate q) have no closed form; the central limit
theorem of Bu et al. (2020) (DP-FP eq. 11/16, Li et al. §A) approximates them by

    mu_tot^2 = sum_j q_j^2 * T_j * (exp(1 / sigma_j^2) - 1).

The CLT is asymptotic and *underestimates* epsilon at finite T (Gopi et al.
2021; in the DP-FP SST-2 setting by about 3.4x), so every figure computed from
it is labelled approximate.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from scipy.optimize import brentq
from scipy.special import log_ndtr

from dptrain._checks import check_delta, check_positive, check_real
from dptrain.accounting.ledger import PrivateSteps

__all__ = ["clt_mu", "gdp_delta", "gdp_epsilon", "gdp_mu"]

# Search limit: at mu = 1e4 delta(eps; mu) ~ 1 for any epsilon below ~1e7.
_MU_MAX_SEARCH = 1e4


def gdp_delta(epsilon: float, mu: float) -> float:
    """delta(epsilon) of a mu-GDP mechanism (Dong et al. 2019, Cor. 2.13).

    Evaluated in log space so that large epsilon does not cancel catastrophically.
    """
    eps = check_real("epsilon", epsilon)
    if eps < 0:
        raise ValueError(f"epsilon={epsilon!r} is not allowed: expected a number >= 0")
    mu = check_real("mu", mu)
    if mu < 0:
        raise ValueError(f"mu={mu!r} is not allowed: expected a number >= 0")
    if mu == 0:
        return 0.0
    log_a = float(log_ndtr(-eps / mu + mu / 2))
    log_b = eps + float(log_ndtr(-eps / mu - mu / 2))
    if log_b >= log_a:  # rounding only: the difference is mathematically > 0
        return 0.0
    return math.exp(log_a) * -math.expm1(log_b - log_a)


def gdp_epsilon(delta: float, mu: float) -> float:
    """Smallest epsilon >= 0 with delta(epsilon; mu) <= delta."""
    delta = check_delta(delta)
    mu = check_real("mu", mu)
    if mu < 0:
        raise ValueError(f"mu={mu!r} is not allowed: expected a number >= 0")
    if gdp_delta(0.0, mu) <= delta:
        return 0.0
    hi = max(1.0, mu * mu)
    while gdp_delta(hi, mu) > delta:
        hi *= 2.0
    return float(brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-12, rtol=1e-12))


def gdp_mu(epsilon: float, delta: float) -> float:
    """The mu for which a mu-GDP mechanism is exactly (epsilon, delta)-DP.

    Step 1 of DP-FP Algorithm 1 ("put (eps, delta) into (3) and compute mu_tot").
    delta(eps; mu) increases with mu, so the root is unique.
    """
    eps = check_positive("epsilon", epsilon)
    delta = check_delta(delta)
    hi = 1.0
    while gdp_delta(eps, hi) < delta:
        hi *= 2.0
        if hi > _MU_MAX_SEARCH:
            raise ValueError(
                f"(epsilon={epsilon!r}, delta={delta!r}) is unreachable for a GDP mechanism "
                f"with mu <= {_MU_MAX_SEARCH:g}"
            )
    return float(brentq(lambda m: gdp_delta(eps, m) - delta, 0.0, hi, xtol=1e-14, rtol=1e-13))


def clt_mu(segments: Iterable[PrivateSteps]) -> float:
    """mu_tot of a sequence of (subsampled) Gaussian steps.

    Sampled segments (q < 1) use the CLT term q^2 T (exp(1/sigma^2) - 1); unsampled
    ones (q = 1) are exactly (sqrt(T)/sigma)-GDP and add T / sigma^2.
    """
    total = 0.0
    for s in segments:
        inv_var = 1.0 / s.noise_multiplier**2
        if s.sample_rate == 1.0:
            total += s.count * inv_var
        elif inv_var > 700.0:  # exp overflows: no meaningful privacy left
            return math.inf
        else:
            total += s.sample_rate**2 * s.count * math.expm1(inv_var)
    return math.sqrt(total)
