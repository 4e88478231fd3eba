"""Figures derived from (q, sigma, C, B) that users of the papers ask for.

- Effective noise multiplier sigma_eff = sigma / q = sigma N / B (Li et al.
  2022, §3.1 "Fixed update steps"): at a fixed number of steps it controls the
  signal-to-noise ratio of the averaged private gradient.
- Noise std of the averaged gradient: the privatized gradient is
  (sum of clipped gradients + N(0, sigma^2 C^2 I)) / B (Li et al. Alg. 1, line 7),
  so each coordinate carries noise of std sigma C / B = C sigma_eff / N.
"""

from __future__ import annotations

import math

from dptrain._checks import check_int, check_positive, check_sample_rate

__all__ = [
    "averaged_gradient_noise_std",
    "effective_noise_multiplier",
    "sample_rate_from_batch",
    "steps_from_epochs",
]


def effective_noise_multiplier(noise_multiplier: float, sample_rate: float) -> float:
    """sigma / q (Li et al. 2022, §3.1)."""
    return check_positive("noise_multiplier", noise_multiplier) / check_sample_rate(sample_rate)


def averaged_gradient_noise_std(
    noise_multiplier: float, max_grad_norm: float, batch_size: float
) -> float:
    """Per-coordinate std sigma C / B of the noise in the averaged private gradient.

    ``batch_size`` is the expected (logical) batch size q N under Poisson sampling.
    """
    return (
        check_positive("noise_multiplier", noise_multiplier)
        * check_positive("max_grad_norm", max_grad_norm)
        / check_positive("batch_size", batch_size)
    )


def sample_rate_from_batch(batch_size: int, dataset_size: int) -> float:
    """q = B / N for an expected batch size B drawn from N records."""
    b = check_int("batch_size", batch_size, minimum=1)
    n = check_int("dataset_size", dataset_size, minimum=1)
    if b > n:
        raise ValueError(
            f"batch_size={batch_size!r} is not allowed: expected at most "
            f"dataset_size={dataset_size!r}"
        )
    return b / n


def steps_from_epochs(epochs: float, sample_rate: float) -> int:
    """Number of steps in ``epochs`` passes at rate q: floor(epochs / q).

    One epoch is 1/q steps in expectation (N/B); the fraction is dropped, as in
    Li et al.'s loop ``for t in [E * N / B]``.
    """
    e = check_positive("epochs", epochs)
    q = check_sample_rate(sample_rate)
    # The tolerance keeps e.g. 3 / (1/3) from flooring to 8 in floating point.
    steps = math.floor(e / q * (1 + 1e-12))
    if steps < 1:
        raise ValueError(
            f"epochs={epochs!r} is too few: at sample_rate={q:g} it gives 0 steps "
            f"(expected epochs >= {q:g})"
        )
    return steps
