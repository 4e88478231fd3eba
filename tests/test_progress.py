"""The plan printed before training and the epsilon curve behind the progress bar."""

from __future__ import annotations

import pytest

from dptrain.accounting import PrivacyLedger, make_accountant
from dptrain.progress import EpsilonBar, EpsilonCurve, delta_warning, plan_text


def _epsilon(schedule, t, delta, accountant="pld"):
    ledger = PrivacyLedger()
    for q, sigma, k in schedule:
        take = min(k, t)
        if take:
            ledger.record(q, sigma, take)
        t -= take
    options = {"value_discretization_interval": 1e-3} if accountant == "pld" else {}
    return make_accountant(accountant, ledger, **options).epsilon(delta)


@pytest.mark.parametrize("accountant", ["pld", "rdp"])
def test_curve_is_exact_at_its_steps_and_never_below_what_was_spent(accountant):
    """A growing batch (two rates): the curve equals the accountant at its evaluated steps
    and is an upper bound in between (epsilon grows with the steps)."""
    schedule = [(0.02, 1.1, 30), (0.05, 1.1, 90)]
    curve = EpsilonCurve(schedule, 1e-5, accountant, points=8)
    assert curve.steps == 120 and len(curve.grid) <= 8 + 5
    assert curve(0) == 0.0
    for t in (1, 2, 17, 30, 31, 64, 119, 120):
        spent = _epsilon(schedule, t, 1e-5, accountant)
        assert curve(t) >= spent - 1e-9, t
        if t in curve.grid:
            assert curve(t) == pytest.approx(spent, rel=1e-9)
    assert curve(120) == pytest.approx(_epsilon(schedule, 120, 1e-5, accountant))
    with pytest.raises(ValueError, match="step=121 is not allowed"):
        curve(121)


def test_curve_evaluates_each_step_once():
    curve = EpsilonCurve([(0.1, 1.0, 1000)], 1e-5, "pld", points=10)
    calls = []
    real = curve._epsilon_at
    curve._epsilon_at = lambda t: calls.append(t) or real(t)
    for t in range(1, 1001):
        curve(t)
    assert sorted(calls) == curve.grid and len(calls) <= 15


def test_plan_names_every_figure_and_warns_of_a_delta_above_one_over_n():
    text = plan_text(
        units=270,
        unit="record",
        sample_rate=64 / 270,
        expected_batch=64,
        steps=4,
        noise_multiplier=1.234,
        max_grad_norm=1.0,
        clipping="flat",
        delta=1e-5,
        delta_rule="min(1e-5,1/(10N))",
        accountant="pld",
        target_epsilon=8.0,
    )
    for piece in ("270 records", "0.237", "expected batch 64", "1.234", "clipping C", "1e-05"):
        assert piece in text
    assert "min(1e-5,1/(10N))" in text and "pld" in text and "target epsilon  8" in text
    assert "WARNING" not in text
    assert delta_warning(1 / 270, 270) is not None and delta_warning(1e-5, 270) is None
    assert "delta=0.02 is not below 1/N = 1/54 users" in delta_warning(0.02, 54, "user")
    assert delta_warning(0.01, 54, "user") is None  # 1/(2N)-like: below 1/N


def test_the_bar_shows_the_epsilon_spent_after_every_step_beside_other_figures():
    import io

    curve = EpsilonCurve([(0.1, 1.0, 6)], 1e-5, "rdp")
    out = io.StringIO()
    bar = EpsilonBar(total=3, file=out, curve=curve, events_per_step=2, mininterval=0)
    shown = []
    for step in range(1, 4):
        bar.update(1)
        shown.append(bar.postfix)
        if step == 2:
            bar.set_postfix(loss="0.5")  # another figure: epsilon stays
    bar.close()
    assert shown[0] == f"eps=<={curve(2):.2f}" and shown[1] == f"eps=<={curve(4):.2f}"
    assert shown[2] == f"eps=<={curve(6):.2f}, loss=0.5"
    assert curve(2) < curve(4) < curve(6)


def test_a_disabled_bar_evaluates_no_epsilon():
    curve = EpsilonCurve([(0.1, 1.0, 6)], 1e-5, "rdp")
    bar = EpsilonBar(total=3, disable=True, curve=curve)
    bar.update(1)
    bar.close()
    assert curve._values == {}
