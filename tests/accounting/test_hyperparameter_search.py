import math

import mpmath
import pytest

from dptrain.accounting import (
    PrivacyLedger,
    RDPAccountant,
    composition_of_ledger,
    optimal_composition,
    repeat_and_select,
    search_cost_gupta,
)


def kov_discrete(eps, k):
    """Kairouz-Oh-Viswanath Thm 3.3 for pure eps-DP: pairs ((k-2i) eps, delta_i)."""
    pairs = []
    for i in range(k // 2 + 1):
        delta_i = (
            mpmath.fsum(
                mpmath.binomial(k, j)
                * (mpmath.exp((k - j) * eps) - mpmath.exp((k - 2 * i + j) * eps))
                for j in range(i)
            )
            / (1 + mpmath.exp(eps)) ** k
        )
        pairs.append(((k - 2 * i) * eps, float(delta_i)))
    return pairs


@pytest.mark.parametrize(("eps", "k"), [(0.5, 4), (0.2, 10), (1.0, 7)])
def test_optimal_composition_hits_the_kov_theorem_points(eps, k):
    for eps_total, delta_i in kov_discrete(eps, k):
        if 0 < delta_i < 0.5 and eps_total > 0:
            cost = optimal_composition(eps, 0.0, k, total_delta=delta_i)
            assert cost.epsilon == pytest.approx(eps_total, rel=1e-6)


def test_optimal_composition_of_one_trial_is_the_trial():
    cost = optimal_composition(2.0, 1e-6, 1, total_delta=1e-6 + 1e-12)
    assert cost.epsilon == pytest.approx(2.0, abs=1e-6)
    assert cost.rigorous


def test_optimal_composition_beats_basic_composition_for_many_trials():
    cost = optimal_composition(0.1, 1e-6, 100)
    assert cost.epsilon < 100 * 0.1
    assert cost.delta == pytest.approx(101e-6)


def test_gupta_route_as_in_anil_et_al():
    # Grid search at epsilon 5 with epsilon' = epsilon / 8 stays at epsilon 5.
    cost = search_cost_gupta(5.0, 0.0, 289, epsilon_prime=0.45, validation_size=10_000)
    assert cost.epsilon == 5.0
    assert cost.rigorous
    expected_loss = 4 / (10_000 * 0.45) * math.log(1 / (0.45 * 0.1 / 289))
    assert cost.accuracy_loss_bound == pytest.approx(expected_loss)
    # Without the grid improvement: epsilon + 8 epsilon'.
    assert search_cost_gupta(5.0, 0.0, 289, epsilon_prime=0.45, grid=False).epsilon == 8.6
    # With delta > 0 the theorem does not apply, and the result says so.
    with_delta = search_cost_gupta(5.0, 1e-9, 289)
    assert not with_delta.rigorous
    assert "pure epsilon-DP" in with_delta.note


def test_ledger_routes():
    trial = PrivacyLedger.from_schedule([(0.01, 1000)], 1.0)
    single = RDPAccountant(trial).epsilon(1e-5)
    comp = composition_of_ledger(trial, 10, 1e-5, accountant="rdp")
    rs = repeat_and_select(trial, 10, 1e-5, "poisson")
    log = repeat_and_select(trial, 10, 1e-5, "logarithmic")
    # Selecting costs more than one trial, less than releasing all ten.
    assert single < log.epsilon < rs.epsilon < comp.epsilon
    assert repeat_and_select(trial, 20, 1e-5, "poisson").epsilon > rs.epsilon
    # Composition of K ledgers is the ledger with K times the steps.
    ten = PrivacyLedger.from_schedule([(0.01, 10_000)], 1.0)
    assert comp.epsilon == pytest.approx(RDPAccountant(ten).epsilon(1e-5))
