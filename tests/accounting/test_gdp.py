"""GDP formulas against mpmath evaluations of the same closed forms."""

import math

import mpmath
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dptrain.accounting import PrivateSteps, clt_mu, gdp_delta, gdp_epsilon, gdp_mu

mpmath.mp.dps = 50


def mp_gdp_delta(eps, mu):
    eps, mu = mpmath.mpf(eps), mpmath.mpf(mu)
    return mpmath.ncdf(-eps / mu + mu / 2) - mpmath.exp(eps) * mpmath.ncdf(-eps / mu - mu / 2)


@given(
    eps=st.floats(min_value=0.0, max_value=40.0),
    mu=st.floats(min_value=0.05, max_value=8.0),
)
def test_delta_matches_mpmath(eps, mu):
    ref = float(mp_gdp_delta(eps, mu))
    assert gdp_delta(eps, mu) == pytest.approx(ref, rel=1e-9, abs=1e-300)


@given(mu=st.floats(min_value=0.1, max_value=5.0), delta=st.floats(min_value=1e-10, max_value=0.1))
def test_epsilon_inverts_delta(mu, delta):
    eps = gdp_epsilon(delta, mu)
    if eps > 0:
        assert float(mp_gdp_delta(eps, mu)) == pytest.approx(delta, rel=1e-7)
    else:
        assert float(mp_gdp_delta(0, mu)) <= delta


@given(eps=st.floats(min_value=0.05, max_value=20.0), delta=st.floats(1e-10, 0.1))
def test_mu_inverts_delta(eps, delta):
    mu = gdp_mu(eps, delta)
    assert float(mp_gdp_delta(eps, mu)) == pytest.approx(delta, rel=1e-7)


def test_clt_mu_closed_forms():
    q, t, s = 0.01, 1000, 1.3
    assert clt_mu([PrivateSteps(q, s, t)]) == pytest.approx(q * math.sqrt(t * math.expm1(1 / s**2)))
    # Unsampled Gaussian steps compose exactly: sqrt(T) / sigma.
    assert clt_mu([PrivateSteps(1.0, 2.0, 16)]) == pytest.approx(2.0)
    # Segments add in quadrature.
    a, b = PrivateSteps(0.01, 1.0, 100), PrivateSteps(0.05, 2.0, 30)
    assert clt_mu([a, b]) == pytest.approx(math.hypot(clt_mu([a]), clt_mu([b])))


def test_paper_dpfp_value():
    # DP-FP SST-2: mu_tot for (1.73, 1/(2N)), and sigma/C = 0.346 (DESIGN.md).
    n = 67_349
    mu = gdp_mu(1.73, 1 / (2 * n))
    p, tm = 1 / n, 6313 * 32
    sigma = 1 / math.sqrt(math.log1p(mu**2 / (p * p * tm)))
    assert sigma == pytest.approx(0.346, abs=5e-4)
