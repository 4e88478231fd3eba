"""The white-box one-run audit catches broken mechanisms and never flags a correct run.

Setting (stated in docs/audit.md): full-batch DP-GD (q = 1, every step observed) of a
linear softmax classifier with 10^6 weights on 64 random examples, 10 steps, delta =
1e-5, m = 10^6 Dirac canaries (one per weight; 4 x 10^6 for the ledger fault), 95%
confidence. Each canary's mechanism
is then exactly sqrt(T)/sigma-GDP, so the Gaussian f-DP analysis (Mahloujifar et al.
2025) is valid here, beside Steinke et al.'s (epsilon, delta) bound.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from dptrain.audit import GradientCanaries
from dptrain.recipes.audit_one_run import OneRunAuditConfig, whitebox_run
from tests.audit.faults import clipping_off, ledger_records_half, noise_divided_by

DELTA = 1e-5
D = 1000  # the classifier is D x D: 10^6 weights
GDP = "mahloujifar2025-gdp"


def audited_run(epsilon, *, fault=None, d=D, m=0, canary_norm=0.0, noise_multiplier=0.0, **kw):
    """(claimed epsilon (None for sigma near 0), canaries) of the recipe's white-box run,
    a d x d classifier with one canary per weight unless ``m`` is given."""
    cfg = OneRunAuditConfig(
        epsilon=epsilon or 1.0,
        noise_multiplier=noise_multiplier,
        width=d,
        canaries=m,
        canary_norm=canary_norm or 0.0,
        delta=DELTA,
        **kw,
    )
    with fault() if fault else contextlib.nullcontext():
        return whitebox_run(cfg, progress=False)


@pytest.mark.parametrize("epsilon", [1.0, 3.0, 8.0])
def test_a_correct_run_is_never_flagged(epsilon):
    claimed, canaries = audited_run(epsilon)
    for method in ("steinke2023", GDP):
        assert canaries.audit(DELTA, method=method).epsilon <= claimed


def test_power_at_epsilon_8_is_at_least_half_the_claim():
    claimed, canaries = audited_run(8.0)
    assert canaries.audit(DELTA, method=GDP).epsilon >= claimed / 2


@pytest.mark.parametrize(
    ("name", "fault", "canary_norm"),
    [
        ("noise divided by 4", lambda: noise_divided_by(4.0), None),
        ("noise divided by 2", lambda: noise_divided_by(2.0), None),
        ("clipping off", clipping_off, 10.0),  # canaries of norm 10 C go in uncut
    ],
)
def test_a_broken_mechanism_is_flagged(name, fault, canary_norm):
    claimed, canaries = audited_run(8.0, fault=fault, canary_norm=canary_norm)
    assert canaries.audit(DELTA, method=GDP).epsilon > claimed, name


def test_a_ledger_that_records_half_the_steps_is_flagged():
    # It claims sqrt(1/2) of the true mu, so the audit must be tighter than 0.71 of the
    # truth: 4 x 10^6 canaries (10^6 reach 0.64-0.68 of it; docs/audit.md).
    claimed, canaries = audited_run(8.0, fault=ledger_records_half, d=2000)
    assert claimed < 5.5  # it did under-count
    assert canaries.audit(DELTA, method=GDP).epsilon > claimed


def test_clipping_cuts_large_canaries_in_a_correct_run():
    claimed, canaries = audited_run(8.0, canary_norm=10.0)
    assert canaries.audit(DELTA, method=GDP).epsilon <= claimed


def test_a_non_private_run_gives_a_large_lower_bound():
    _, canaries = audited_run(None, noise_multiplier=1e-3)
    assert canaries.audit(DELTA, method=GDP).epsilon > 10
    # Steinke et al.'s (epsilon, delta) bound is capped by its 2 m delta term (= 20 here)
    assert canaries.audit(DELTA).epsilon > 4


def test_poisson_sampled_run_is_not_flagged():
    claimed, canaries = audited_run(3.0, batch_size="16", steps=20, m=100_000)
    assert canaries.sampled.max() < 20  # the canaries were sampled like records
    assert canaries.audit(DELTA).epsilon <= claimed


def test_bad_input_is_named():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="m=1"):
        GradientCanaries(model.parameters(), 1)
    with pytest.raises(ValueError, match="m=9 is not allowed: the trainable parameters have 8"):
        GradientCanaries(model.parameters(), 9)
    with pytest.raises(ValueError, match="has no audit hook"):
        GradientCanaries(model.parameters(), 4).attach(torch.optim.SGD(model.parameters(), 0.1))
    with pytest.raises(ValueError, match="no step was observed"):
        GradientCanaries(model.parameters(), 4).audit(DELTA)


def test_several_processes_are_refused_by_name():
    class TwoRanks:  # what GradientCanaries reads of a DistributedDPOptimizer
        audit_hook, world_size = None, 2

    with pytest.raises(ValueError, match="white-box canaries on 2 processes"):
        GradientCanaries(nn.Linear(3, 2).parameters(), 4).attach(TwoRanks())
