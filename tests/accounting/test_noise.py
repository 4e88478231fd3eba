import pytest

from dptrain.accounting import (
    averaged_gradient_noise_std,
    effective_noise_multiplier,
    sample_rate_from_batch,
    steps_from_epochs,
)


def test_effective_noise_multiplier_is_sigma_over_q():
    # Li et al.: sigma_eff = sigma / q = sigma N / B.
    assert effective_noise_multiplier(1.2, 512 / 50_000) == pytest.approx(1.2 * 50_000 / 512)


def test_averaged_gradient_noise_std():
    assert averaged_gradient_noise_std(1.0, 0.1, 1024) == pytest.approx(0.1 / 1024)


def test_epochs_to_steps():
    assert steps_from_epochs(3, 32 / 67_349) == 6313
    assert steps_from_epochs(3, 1 / 3) == 9  # no floating-point floor to 8
    assert sample_rate_from_batch(256, 60_000) == 256 / 60_000
