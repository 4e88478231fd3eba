"""The privacy cost of hyperparameter search.

Trying K settings on private data and releasing the best model spends more
privacy than one training run. Three routes, from the loosest assumptions to
the tightest numbers:

``composition`` (rigorous, any (epsilon, delta)-DP trials, fixed K)
    Release all K trials (the best one is post-processing). With only
    (epsilon, delta) known per trial, the optimal composition theorem of
    Kairouz, Oh & Viswanath (2015, Thm. 3.3; Murtagh & Vadhan 2016) is exact:
    the worst case is K-fold randomized response, whose privacy loss takes the
    values (K - 2l) epsilon with binomial weights, so

        delta_K(eps_tot) = 1 - (1 - delta)^K (1 - E[(1 - exp(eps_tot - L))_+]).

    When the trials are dptrain runs with a ledger, :func:`composition_of_ledger`
    composes the K ledgers with an accountant (PLD by default), which is tighter.

``repeat_and_select`` (rigorous, a ledger per trial, random K)
    Papernot & Steinke (ICLR 2022, "Hyperparameter tuning with Renyi DP",
    Thm. 2 and 6): run a *random* number of trials (Poisson, geometric,
    logarithmic or truncated negative binomial with mean K) and release only
    the best; its cost is a small additive term on the trial's RDP, computed by
    ``dp_accounting``'s ``RepeatAndSelectDpEvent`` under the RDP accountant.

``gupta`` (Anil et al. 2021 §4.3, pure DP only)
    Theorem 10.2 of Gupta et al. (2010) as applied by Anil et al. with the grid
    search improvement of Abadi et al. (2016, App. G): a selection mechanism
    that calls the trials a random number of times is (epsilon + 8 epsilon')-DP,
    or max(epsilon, 8 epsilon')-DP for a grid, for epsilon' in (0, 1/2), and with
    probability 1 - kappa loses at most 4 / (n_val epsilon') ln(K / (epsilon' kappa))
    of validation accuracy. The theorem is for pure epsilon-DP trials; with
    delta > 0 it does not bound the delta, and the result says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
from scipy.optimize import brentq
from scipy.special import gammaln

from dptrain._checks import (
    check_delta,
    check_in_interval,
    check_int,
    check_positive,
    check_real_at_least,
)
from dptrain.accounting.accountants import (
    DEFAULT_RDP_ORDERS,
    ledger_to_dp_event,
    make_accountant,
)
from dptrain.accounting.ledger import PrivacyLedger

__all__ = [
    "REPETITION_DISTRIBUTIONS",
    "SearchCost",
    "composition_of_ledger",
    "optimal_composition",
    "repeat_and_select",
    "search_cost_gupta",
]

#: Distributions of the number of trials for :func:`repeat_and_select`, as the
#: ``shape`` of dp_accounting's RepeatAndSelectDpEvent.
REPETITION_DISTRIBUTIONS = {"poisson": math.inf, "geometric": 1.0, "logarithmic": 0.0}


@dataclass(frozen=True)
class SearchCost:
    """(epsilon, delta) of a hyperparameter search that releases its best trial."""

    method: str
    epsilon: float
    delta: float
    trials: float
    """K, or the mean number of trials for a random-K route."""
    rigorous: bool
    """False where the theorem's assumptions do not hold (see ``note``)."""
    reference: str
    note: str = ""
    accuracy_loss_bound: float | None = None
    """gupta route: validation-accuracy loss bound that holds w.p. 1 - kappa."""


def search_cost_gupta(
    epsilon: float,
    delta: float,
    trials: int,
    *,
    epsilon_prime: float | None = None,
    grid: bool = True,
    validation_size: int | None = None,
    kappa: float = 0.1,
) -> SearchCost:
    """Anil et al. (2021) §4.3: Gupta et al. (2010) Thm. 10.2, Abadi et al. App. G.

    ``epsilon_prime`` defaults to min(epsilon / 8, 0.499), the largest value that
    leaves a grid search at ``epsilon`` (Anil et al. use 5 / 8 with epsilon = 5,
    although the theorem asks for epsilon' < 1/2).
    """
    eps = check_positive("epsilon", epsilon)
    delta = check_in_interval("delta", delta, 0.0, 1.0, low_open=False)
    k = check_int("trials", trials, minimum=1)
    if epsilon_prime is None:
        epsilon_prime = min(eps / 8.0, 0.499)
    eps_p = check_in_interval("epsilon_prime", epsilon_prime, 0.0, 0.5)
    kappa = check_in_interval("kappa", kappa, 0.0, 1.0)
    total = max(eps, 8 * eps_p) if grid else eps + 8 * eps_p
    loss = None
    if validation_size is not None:
        n_val = check_int("validation_size", validation_size, minimum=1)
        loss = 4.0 / (n_val * eps_p) * math.log(k / (eps_p * kappa))
    note = (
        "theorem for pure epsilon-DP trials; with delta > 0 the delta of the search is "
        "not bounded by it"
        if delta > 0
        else ""
    )
    return SearchCost(
        method="gupta",
        epsilon=total,
        delta=delta,
        trials=k,
        rigorous=delta == 0,
        reference="Gupta et al. 2010 Thm 10.2 via Anil et al. 2021 §4.3 (grid: Abadi et al. 2016 App. G)",
        note=note,
        accuracy_loss_bound=loss,
    )


def _randomized_response_delta(eps_total: float, epsilon: float, trials: int) -> float:
    """delta(eps_total) of K-fold composition of (epsilon, 0) randomized response."""
    ls = np.arange(trials + 1)
    # log P(l "flips") under the first distribution, p = e^eps / (1 + e^eps).
    log_p = -np.logaddexp(0.0, -epsilon)
    log_1mp = -np.logaddexp(0.0, epsilon)
    log_w = (
        gammaln(trials + 1)
        - gammaln(ls + 1)
        - gammaln(trials - ls + 1)
        + (trials - ls) * log_p
        + ls * log_1mp
    )
    loss = (trials - 2 * ls) * epsilon
    mask = loss > eps_total
    if not mask.any():
        return 0.0
    terms = np.exp(log_w[mask]) * -np.expm1(eps_total - loss[mask])
    return float(terms.sum())


def optimal_composition(
    epsilon: float, delta: float, trials: int, total_delta: float | None = None
) -> SearchCost:
    """Smallest epsilon of K adaptively composed (epsilon, delta)-DP trials at ``total_delta``.

    Kairouz, Oh & Viswanath (2015), Thm. 3.3 (exact for the class of
    (epsilon, delta)-DP mechanisms). ``total_delta`` defaults to (K + 1) delta:
    K delta is the floor the trials' own deltas impose, plus delta of slack.
    """
    eps = check_positive("epsilon", epsilon)
    delta = check_in_interval("delta", delta, 0.0, 1.0, low_open=False)
    k = check_int("trials", trials, minimum=1)
    if total_delta is None:
        total_delta = min((k + 1) * delta, 0.5) if delta > 0 else 1e-6
    total_delta = check_delta(total_delta, "total_delta")
    floor = -math.expm1(k * math.log1p(-delta))  # 1 - (1 - delta)^K
    if total_delta <= floor:
        raise ValueError(
            f"total_delta={total_delta!r} is unreachable: K={k} trials with delta={delta!r} "
            f"already give delta >= {floor:.4g}; allowed: total_delta in ({floor:.4g}, 1)"
        )
    # Remaining budget for the randomized-response part.
    rr_delta = 1.0 - (1.0 - total_delta) / (1.0 - delta) ** k
    if _randomized_response_delta(0.0, eps, k) <= rr_delta:
        total = 0.0
    else:
        total = brentq(
            lambda e: _randomized_response_delta(e, eps, k) - rr_delta,
            0.0,
            k * eps,
            xtol=1e-12,
        )
        # brentq may land a hair below the root; step up until the delta fits.
        while _randomized_response_delta(total, eps, k) > rr_delta:
            total = math.nextafter(total, math.inf) + 1e-12 * max(total, 1.0)
    return SearchCost(
        method="composition",
        epsilon=float(total),
        delta=total_delta,
        trials=k,
        rigorous=True,
        reference="Kairouz, Oh & Viswanath 2015 Thm 3.3 (optimal composition)",
        note="releases all K trials; selecting the best is post-processing",
    )


def composition_of_ledger(
    ledger: PrivacyLedger, trials: int, delta: float, accountant: str = "pld"
) -> SearchCost:
    """K trials that each ran the steps in ``ledger``, composed by ``accountant``."""
    k = check_int("trials", trials, minimum=1)
    delta = check_delta(delta)
    combined = PrivacyLedger(privacy_unit=ledger.privacy_unit)
    for s in ledger.segments:
        combined.record(s.sample_rate, s.noise_multiplier, s.count * k)
    acc = make_accountant(accountant, combined)
    return SearchCost(
        method=f"composition-{accountant}",
        epsilon=acc.epsilon(delta),
        delta=delta,
        trials=k,
        rigorous=not acc.approximate,
        reference=f"composition of K ledgers under the {accountant} accountant",
        note="releases all K trials; selecting the best is post-processing"
        + ("; GDP CLT: approximate" if acc.approximate else ""),
    )


def repeat_and_select(
    ledger: PrivacyLedger,
    mean_trials: float,
    delta: float,
    distribution: str = "poisson",
    orders: tuple[float, ...] = DEFAULT_RDP_ORDERS,
) -> SearchCost:
    """Papernot & Steinke (2022): random number of trials, release only the best.

    ``distribution`` is that of the number of trials: ``poisson`` (Thm. 6),
    ``geometric`` or ``logarithmic`` (Thm. 2, truncated negative binomial),
    each with mean ``mean_trials``. RDP accountant of ``dp_accounting``.
    """
    if distribution not in REPETITION_DISTRIBUTIONS:
        raise ValueError(
            f"distribution={distribution!r} is not known: expected one of "
            f"{sorted(REPETITION_DISTRIBUTIONS)}"
        )
    mean = check_real_at_least("mean_trials", mean_trials, 1.0)
    delta = check_delta(delta)
    if ledger.num_steps == 0:
        raise ValueError("ledger has no steps: a trial must record its private steps")
    acc = rdp_privacy_accountant.RdpAccountant(orders=list(orders))
    acc.compose(
        dp_event.RepeatAndSelectDpEvent(
            ledger_to_dp_event(ledger), mean, REPETITION_DISTRIBUTIONS[distribution]
        )
    )
    return SearchCost(
        method=f"repeat-and-select-{distribution}",
        epsilon=float(acc.get_epsilon(delta)),
        delta=delta,
        trials=mean,
        rigorous=True,
        reference="Papernot & Steinke 2022 (RDP), dp_accounting RepeatAndSelectDpEvent",
        note=f"number of trials drawn at random ({distribution}, mean {mean:g}); "
        "only the best trial is released",
    )
