"""DistributedDPOptimizer: one noise draw of std sigma*C per step; rank 0's budget stops all."""

from __future__ import annotations

import math

import torch
from torch import nn

from dptrain.optim import DPOptimizer
from tests.distributed.two_ranks import NOISE_BATCH, NOISE_C, NOISE_SIGMA


def test_all_reduced_noise_has_std_sigma_c(two_ranks):
    """Sample std of 120,000 noise coordinates is sigma*C, not sqrt(2) sigma*C."""
    _, results = two_ranks
    noise0, noise1 = (r["noise"]["noise"] for r in results)
    assert torch.equal(noise0, noise1)
    n = noise0.numel()
    ratio = float(noise0.var() / (NOISE_SIGMA * NOISE_C) ** 2)
    # var/(sigma C)^2 ~ chi2(n-1)/(n-1): std sqrt(2/n) ~ 0.004; 5 standard deviations.
    assert abs(ratio - 1) < 5 * math.sqrt(2 / n)
    assert abs(float(noise0.mean())) < 5 * NOISE_SIGMA * NOISE_C / math.sqrt(n)
    # ... and it is exactly the noise one process draws with the same seed.
    w = nn.Parameter(torch.zeros(400, 300, dtype=torch.float64))
    opt = DPOptimizer(
        torch.optim.SGD([w], lr=1.0),
        noise_multiplier=NOISE_SIGMA,
        max_grad_norm=NOISE_C,
        expected_batch_size=1.0,
        sample_rate=0.25,
        seed=11,
    )
    w.grad = torch.zeros_like(w)
    opt.add_noise()
    assert torch.allclose(noise0, w.grad.flatten(), rtol=1e-12, atol=1e-12)


def test_bf16_parameters_get_float32_noise_cast_after(two_ranks):
    """Zero clipped sums on a bf16 Linear: p.grad is rank 0's float32 noise / q N, cast to
    bf16 after, on both ranks, as one process makes it with the same seed."""
    _, results = two_ranks
    grad0, grad1 = (r["noise"]["grad16"] for r in results)
    assert grad0.dtype == torch.bfloat16 and torch.equal(grad0, grad1)
    w = nn.Parameter(torch.zeros(20, 30, dtype=torch.bfloat16))
    opt = DPOptimizer(
        torch.optim.SGD([w], lr=0.0),
        noise_multiplier=NOISE_SIGMA,
        max_grad_norm=NOISE_C,
        expected_batch_size=NOISE_BATCH,
        sample_rate=0.25,
        seed=11,
    )
    opt.add_noise()
    want = torch.empty(20, 30).normal_(
        0.0, NOISE_SIGMA * NOISE_C, generator=torch.Generator().manual_seed(11)
    )
    assert torch.equal(w.grad, (want / NOISE_BATCH).to(torch.bfloat16))
    assert torch.equal(grad0, w.grad)
    assert float(grad0.float().std()) > 0


def test_budget_stop_is_rank_0s_and_every_rank_stops(two_ranks):
    _, results = two_ranks
    for r in results:
        assert "rank 0 stopped every rank" in r["noise"]["stopped"]
        assert r["noise"]["steps_taken"] == 1
