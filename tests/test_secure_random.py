"""Noise and uniforms from os.urandom: the right distribution, from the right source."""

import math

import pytest
import torch
from scipy import stats

import dptrain.secure_random as secure_random
from dptrain.secure_random import secure_normal, secure_uniform


def test_uniforms_are_on_the_53_bit_grid_in_zero_one():
    u = secure_uniform(100_000)
    assert u.dtype == torch.float64 and u.shape == (100_000,)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert torch.equal(u * 2.0**53, torch.round(u * 2.0**53))  # k * 2**-53, k an integer
    assert stats.kstest(u.numpy(), "uniform").pvalue > 1e-4
    assert secure_uniform(0).shape == (0,)


def test_normal_has_the_asked_std_and_shape_and_is_gaussian():
    z = secure_normal((300, 1000), 2.5, dtype=torch.float32)
    assert z.shape == (300, 1000) and z.dtype == torch.float32
    assert float(z.std()) == pytest.approx(2.5, rel=0.01)
    assert abs(float(z.mean())) < 0.02
    assert stats.kstest(z.flatten().double().numpy() / 2.5, "norm").pvalue > 1e-4
    assert torch.equal(secure_normal((3,), 0.0), torch.zeros(3))


def test_every_bit_comes_from_os_urandom(monkeypatch):
    """Fixed bytes in, the same noise out: os.urandom is the only source (no torch
    generator, no seed), and a coordinate costs 4 draws of 8 bytes."""
    calls = []

    def fixed(n):
        calls.append(n)
        return bytes((7 * i + 3) % 256 for i in range(n))

    monkeypatch.setattr(secure_random.os, "urandom", fixed)
    torch.manual_seed(0)
    first = secure_normal((5, 4), 1.0)
    torch.manual_seed(1)
    assert torch.equal(first, secure_normal((5, 4), 1.0))
    assert calls == [8 * 4 * 20, 8 * 4 * 20]


@pytest.mark.parametrize(("std", "message"), [(-1.0, "std=-1.0"), (math.inf, "std=inf")])
def test_bad_std_is_refused(std, message):
    with pytest.raises(ValueError, match=message):
        secure_normal((2,), std)
