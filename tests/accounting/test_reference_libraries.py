"""dptrain's accountants against a second library on a grid, within 1%.

- PLD vs Microsoft's prv_accountant (Gopi, Lee & Wutschitz 2021): an
  independent numerical composition (PRV, not dp_accounting's PLD).
- RDP vs Opacus's RDP analysis (its own implementation of Mironov et al. 2019),
  at the same orders so the comparison tests the composition and conversion.
- GDP vs Opacus's GDP CLT (Bu et al. 2020).
"""

import pytest

from dptrain.accounting import (
    DEFAULT_RDP_ORDERS,
    GDPAccountant,
    PLDAccountant,
    PrivacyLedger,
    RDPAccountant,
)

prv_accountant = pytest.importorskip("prv_accountant")
opacus_rdp = pytest.importorskip("opacus.accountants.analysis.rdp")
opacus_gdp = pytest.importorskip("opacus.accountants.analysis.gdp")

GRID = [
    # (q, sigma, steps, delta)
    (256 / 60_000, 1.1, 10_000, 1e-5),
    (0.01, 0.8, 1_000, 1e-5),
    (0.05, 1.5, 2_000, 1e-6),
    (0.001, 0.7, 30_000, 1e-5),
    (0.1, 3.0, 500, 1e-5),
    (1 / 67_349, 0.4344, 202_016, 1 / (2 * 67_349)),  # DP-FP SST-2, PLD-calibrated
]
# prv_accountant needs ~40 s for the 202,016 SST-2 steps: run that case with -m slow.
PRV_GRID = [*GRID[:-1], pytest.param(*GRID[-1], marks=pytest.mark.slow)]


def ledger(q, sigma, steps):
    return PrivacyLedger.from_schedule([(q, steps)], sigma)


@pytest.mark.parametrize(("q", "sigma", "steps", "delta"), PRV_GRID)
def test_pld_matches_prv_accountant(q, sigma, steps, delta):
    mech = prv_accountant.PoissonSubsampledGaussianMechanism(
        noise_multiplier=sigma, sampling_probability=q
    )
    prv = prv_accountant.PRVAccountant(
        prvs=mech, max_self_compositions=steps, eps_error=0.005, delta_error=delta / 1000
    )
    low, estimate, _high = prv.compute_epsilon(delta=delta, num_self_compositions=[steps])
    ours = PLDAccountant(ledger(q, sigma, steps)).epsilon(delta)
    assert ours == pytest.approx(estimate, rel=0.01)
    assert ours >= low * 0.999  # a pessimistic PLD never falls below the PRV lower bound


@pytest.mark.parametrize(("q", "sigma", "steps", "delta"), GRID)
def test_rdp_matches_opacus(q, sigma, steps, delta):
    orders = list(DEFAULT_RDP_ORDERS)
    rdp = opacus_rdp.compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=orders)
    theirs, _ = opacus_rdp.get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    ours = RDPAccountant(ledger(q, sigma, steps)).epsilon(delta)
    assert ours == pytest.approx(float(theirs), rel=0.01)


@pytest.mark.parametrize(("q", "sigma", "steps", "delta"), GRID)
def test_gdp_matches_opacus(q, sigma, steps, delta):
    theirs = opacus_gdp.compute_eps_poisson(
        steps=steps, noise_multiplier=sigma, sample_rate=q, delta=delta
    )
    ours = GDPAccountant(ledger(q, sigma, steps)).epsilon(delta)
    assert ours == pytest.approx(theirs, rel=0.01)
