"""The pieces the recipes share: delta rules, choice checks, the running epsilon."""

import pytest

from dptrain.accounting import PrivacyLedger, make_accountant
from dptrain.recipes._common import DELTA_RULES, check_choice, epsilon_so_far, resolve_delta


def test_delta_rules_are_below_one_over_n():
    assert resolve_delta("1/N^1.1", 1000) == pytest.approx(1000**-1.1)
    assert resolve_delta("1/(2N)", 1000) == pytest.approx(5e-4)
    assert resolve_delta(1e-6, 1000) == 1e-6
    assert all(resolve_delta(rule, 1000) < 1 / 1000 for rule in DELTA_RULES)


def test_check_choice_names_the_argument_and_the_choices():
    check_choice("mode", "ghost", ("ghost", "book_keeping"))
    with pytest.raises(ValueError, match=r"^mode='x' is not allowed: expected one of \['a', 'b'\]"):
        check_choice("mode", "x", ("a", "b"))


def test_epsilon_so_far_is_pessimistic_and_zero_before_any_step():
    ledger = PrivacyLedger()
    assert epsilon_so_far(ledger, 1e-5, "pld") == 0.0
    assert epsilon_so_far(None, 1e-5, "pld") == 0.0
    ledger.record(sample_rate=0.01, noise_multiplier=1.0, count=500)
    exact = make_accountant("pld", ledger).epsilon(1e-5)
    coarse = epsilon_so_far(ledger, 1e-5, "pld")
    assert exact <= coarse <= exact * 1.02
    assert epsilon_so_far(ledger, 1e-5, "rdp") == make_accountant("rdp", ledger).epsilon(1e-5)
