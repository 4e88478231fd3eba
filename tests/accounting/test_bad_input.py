"""Each bad argument raises an error naming the argument, its value and what is allowed."""

import re

import pytest

from dptrain.accounting import (
    PLDAccountant,
    PrivacyLedger,
    calibrate_dpfp,
    calibrate_noise,
    make_accountant,
    optimal_composition,
    repeat_and_select,
    search_cost_gupta,
    steps_from_epochs,
)

LEDGER = PrivacyLedger.from_schedule([(0.01, 10)], 1.0)


def raises(message):
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


@pytest.mark.parametrize("eps", [0, -1.5])
def test_target_epsilon_not_positive(eps):
    with raises(f"target_epsilon={eps!r} is not allowed: expected a number > 0"):
        calibrate_noise(eps, 1e-5, sample_rate=0.01, steps=10)
    with raises(f"target_epsilon={eps!r} is not allowed: expected a number > 0"):
        calibrate_dpfp(eps, 1e-5, sample_rate=0.01, steps=10, micro_batches=2, clip=1.0)


@pytest.mark.parametrize("delta", [0, 1, 1.5, -1e-5])
def test_delta_outside_open_unit_interval(delta):
    message = f"delta={delta!r} is outside the allowed range (0, 1)"
    with raises(message):
        PLDAccountant(LEDGER).epsilon(delta)
    with raises(message):
        make_accountant("gdp", LEDGER).epsilon(delta)
    with raises(message):
        calibrate_noise(1.0, delta, sample_rate=0.01, steps=10)


@pytest.mark.parametrize("q", [0, -0.1, 1.5])
def test_sample_rate_outside_zero_one(q):
    with raises(f"sample_rate={q!r} is outside the allowed range (0, 1]"):
        PrivacyLedger().record(q, 1.0)
    with raises(f"sample_rate={q!r} is outside the allowed range (0, 1]"):
        calibrate_noise(1.0, 1e-5, sample_rate=q, steps=10)


@pytest.mark.parametrize("sigma", [0, -1.0])
def test_noise_multiplier_not_positive(sigma):
    with raises(f"noise_multiplier={sigma!r} is not allowed: expected a number > 0"):
        PrivacyLedger().record(0.1, sigma)


def test_non_finite_values():
    with raises("noise_multiplier=nan is not allowed: expected a finite real number"):
        PrivacyLedger().record(0.1, float("nan"))
    with raises("delta='1e-5' is not allowed: expected a finite real number"):
        PLDAccountant(LEDGER).epsilon("1e-5")


def test_negative_steps():
    with raises("steps=-5 is not allowed: expected an integer >= 1"):
        calibrate_noise(1.0, 1e-5, sample_rate=0.01, steps=-5)
    with raises("steps=-5 is not allowed: expected an integer >= 0"):
        PrivacyLedger.from_schedule([(0.1, -5)], 1.0)
    with raises("count=-5 is not allowed: expected an integer >= 1"):
        PrivacyLedger().record(0.1, 1.0, count=-5)
    with raises("steps=2.5 is not allowed: expected an integer >= 1"):
        calibrate_noise(1.0, 1e-5, sample_rate=0.01, steps=2.5)


def test_unreachable_targets():
    with pytest.raises(
        ValueError,
        match=r"^target_epsilon=1e-06 is unreachable: even noise_multiplier=10000 gives epsilon "
        r"[0-9.e-]+ under pld; allowed: targets met with a noise multiplier in \[0\.05, 10000\.0\]$",
    ):
        calibrate_noise(1e-6, 1e-10, sample_rate=1.0, steps=1_000_000)
    with pytest.raises(
        ValueError,
        match=r"^target_epsilon=1000\.0 is met with less noise than noise_multiplier=0\.05 under "
        r"gdp \(epsilon [0-9.]+ there\): the allowed noise multipliers are \[0\.05, 10000\.0\]",
    ):
        calibrate_noise(1000.0, 0.5, sample_rate=1.0, steps=1, accountant="gdp")


def test_unknown_accountant():
    with raises("accountant='moments' is not known: expected one of ['gdp', 'pld', 'rdp']"):
        make_accountant("moments", LEDGER)
    with raises("accountant='moments' is not known: expected one of ['gdp', 'pld', 'rdp']"):
        calibrate_noise(1.0, 1e-5, sample_rate=0.01, steps=10, accountant="moments")


def test_schedule_and_rate_are_exclusive_and_required():
    with raises("schedule= is given together with sample_rate=/steps=: give one or the other"):
        calibrate_noise(1.0, 1e-5, sample_rate=0.1, schedule=[(0.1, 10)])
    with raises("sample_rate=0.1, steps=None: give both, or a schedule="):
        calibrate_noise(1.0, 1e-5, sample_rate=0.1)
    with raises("schedule=[(0.1, 0)] has no steps: expected at least one step"):
        calibrate_noise(1.0, 1e-5, schedule=[(0.1, 0)])


def test_too_few_epochs():
    with raises(
        "epochs=0.001 is too few: at sample_rate=0.01 it gives 0 steps (expected epochs >= 0.01)"
    ):
        steps_from_epochs(0.001, 0.01)


def test_search_cost_arguments():
    with raises("epsilon_prime=0.625 is outside the allowed range (0, 0.5)"):
        search_cost_gupta(5.0, 0.0, 10, epsilon_prime=0.625)
    with raises("trials=0 is not allowed: expected an integer >= 1"):
        optimal_composition(1.0, 1e-6, 0)
    with pytest.raises(ValueError, match=r"^total_delta=1e-06 is unreachable: K=10 trials"):
        optimal_composition(1.0, 1e-6, 10, total_delta=1e-6)
    with raises(
        "distribution='uniform' is not known: expected one of ['geometric', 'logarithmic', 'poisson']"
    ):
        repeat_and_select(LEDGER, 10, 1e-5, "uniform")
    with raises("mean_trials=0.5 is not allowed: expected a number >= 1"):
        repeat_and_select(LEDGER, 0.5, 1e-5)
