"""The white-box one-run audit catches broken mechanisms and never flags a correct run.

Setting (the self-test's white-box run, stated in docs/audit.md): full-batch DP-GD (q = 1,
every step observed) of a d x d linear softmax classifier held in 4 weight tensors, on 64
random examples, 10 steps, C = 4, delta = 1e-5, one Dirac canary of norm 10 C per weight
(d = 1000: 10^6), 95% confidence for the whole family of tests: 3 scores (sum, per-step,
per-tensor) x 2 analyses, and the self-test's 2 black-box tests, 8 in all (Bonferroni).
Each canary's mechanism is then exactly sqrt(T)/sigma-GDP, so the Gaussian f-DP analysis
(Mahloujifar et al. 2025) is valid here, beside Steinke et al.'s (epsilon, delta) bound.

The default run holds a fast subset (d = 300: 9 x 10^4 canaries, where the faults that
separate the canaries completely are flagged too); the full setting, the three seeds at
epsilon 1, 3, 8 and the faults that need 10^6 canaries are ``slow``.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from torch import nn

from dptrain.audit import SCORES, GradientCanaries, audit_scores
from dptrain.recipes.audit_one_run import load_one_run_config, whitebox_run
from tests.audit import faults

DELTA = 1e-5
D = 1000  # the classifier is D x D: 10^6 weights
SMALL = 300
GDP = "mahloujifar2025-gdp"
TESTS = 8  # the self-test's family: 6 white-box tests and 2 black-box ones


def audited_run(epsilon, *, fault=None, d=D, seed=0, **kw):
    """(claimed epsilon (None for sigma near 0), canaries) of the self-test's white-box run
    with ``kw`` changed, under ``fault`` (a name of tests.audit.faults.FAULTS)."""
    overrides = [f"{k}={v}" for k, v in kw.items()]
    cfg = load_one_run_config(
        None,
        ["mode=whitebox", f"epsilon={epsilon or 1.0}", f"width={d}", f"seed={seed}", *overrides],
    )
    with faults.FAULTS[fault]() if fault else contextlib.nullcontext():
        return whitebox_run(cfg, progress=False)


def bounds(canaries, tests=TESTS):
    """{(score, method): epsilon lower bound}, as the self-test reports them."""
    found = audit_scores(
        {k: v.numpy() for k, v in canaries.score_by_name.items()},
        canaries.included.numpy(),
        DELTA,
        0.95,
        methods=canaries.methods(),
        tests=tests,
    )
    return {(a.score, a.method): a.epsilon for a in found}


def assert_not_flagged(claimed, canaries):
    found = bounds(canaries)
    assert len(found) == 6
    assert max(found.values()) <= claimed, found


def assert_flagged(claimed, canaries, by=None):
    """Flagged: some bound above the claim; with ``by``, by that score's."""
    found = bounds(canaries)
    over = {k: v for k, v in found.items() if v > claimed}
    assert over, (claimed, found)
    if by is not None:
        assert any(score == by for score, _ in over), (by, claimed, found)


# -- correct runs ------------------------------------------------------------------------------


def test_a_correct_run_is_not_flagged_fast():
    claimed, canaries = audited_run(8.0, d=SMALL)
    assert_not_flagged(claimed, canaries)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("epsilon", [1.0, 3.0, 8.0])
def test_a_correct_run_is_never_flagged(epsilon, seed):
    claimed, canaries = audited_run(epsilon, seed=seed)
    assert_not_flagged(claimed, canaries)
    if epsilon == 8.0:  # power: the Gaussian analysis certifies more than half the claim
        assert bounds(canaries)[("sum", GDP)] >= claimed / 2


def test_scores_agree_on_a_correct_full_batch_run():
    # q = 1, the same noise variance at every step and tensor: the per-step and per-tensor
    # likelihood ratios are increasing functions of the sum, so they rank canaries alike
    _, canaries = audited_run(8.0, d=SMALL)
    s = {k: v.numpy() for k, v in canaries.score_by_name.items()}
    for name in ("per-step", "per-tensor"):
        assert np.corrcoef(s["sum"], s[name])[0, 1] > 0.999
    sigma_c = canaries.noise_std[0]  # the pooled estimate is sigma C
    assert all(abs(x / sigma_c - 1) < 0.02 for x in canaries.noise_std)


# -- the held-out breaks of issue 29 and classes of our own ------------------------------------

# (fault, the score that must see it): faults that separate the canaries completely are
# flagged from 9 x 10^4 canaries; "clipping at 2C" lets canaries in at twice the claim's
# sensitivity, as noise / 2 does, which needs 10^6 (docs/audit.md)
FAST = [
    ("same noise each step", "sum"),
    ("noise on half the tensors", "per-tensor"),
    ("noise std without C", None),
    ("clipping off", None),
    ("noise on even steps only", "per-step"),
]
FULL = [
    ("noise on the mean", None),
    ("noise/4", None),
    ("noise/2", None),
    ("clipping at 2C", None),
    ("ledger told 2 sigma", None),
    ("each example twice", None),
]


@pytest.mark.parametrize(("fault", "score"), FAST)
def test_a_broken_mechanism_is_flagged_fast(fault, score):
    claimed, canaries = audited_run(8.0, fault=fault, d=SMALL)
    assert_flagged(claimed, canaries, by=score)


@pytest.mark.slow
@pytest.mark.parametrize(("fault", "score"), FAST + FULL)
def test_a_broken_mechanism_is_flagged(fault, score):
    claimed, canaries = audited_run(8.0, fault=fault)
    assert_flagged(claimed, canaries, by=score)


@pytest.mark.slow
def test_each_score_sees_what_the_others_do_not():
    # the per-tensor score is needed for the missing tensors, the per-step one (or the
    # per-tensor one, which also weighs steps) for the missing steps: the sum alone misses both
    claimed, canaries = audited_run(8.0, fault="noise on half the tensors")
    assert bounds(canaries)[("sum", GDP)] <= claimed
    claimed, canaries = audited_run(8.0, fault="noise on even steps only")
    assert bounds(canaries)[("sum", GDP)] <= claimed


@pytest.mark.slow
def test_a_ledger_that_records_half_the_steps_is_flagged():
    # It claims sqrt(1/2) of the true mu, so the audit must be tighter than 0.71 of the
    # truth: one test (the sum score, the Gaussian analysis) at 4 x 10^6 canaries; the
    # default family of 8 tests at 10^6 is not that tight (docs/audit.md).
    claimed, canaries = audited_run(8.0, fault="ledger half", d=2000)
    assert claimed < 5.5  # it did under-count
    assert canaries.audit(DELTA, method=GDP).epsilon > claimed


def test_canaries_at_exactly_c_miss_clipping_off():
    # why the canaries are larger than C by default: at norm C clipping never touches them
    claimed, canaries = audited_run(8.0, fault="clipping off", d=SMALL, canary_norm=1.0, steps=4)
    assert max(bounds(canaries).values()) <= claimed


def test_a_non_private_run_gives_a_large_lower_bound():
    claimed, canaries = audited_run(None, noise_multiplier=1e-3, d=SMALL, steps=4)
    assert claimed is None  # sigma <= 0.1: no claim is computed
    assert bounds(canaries)[("sum", GDP)] > 10  # 10.9 here, within the family of 8 tests
    # Steinke et al.'s (epsilon, delta) bound is capped by its 2 m delta term (4.3 here)
    assert canaries.audit(DELTA).epsilon > 4


def test_poisson_sampled_run_is_not_flagged_and_says_what_it_cannot_see():
    claimed, canaries = audited_run(4.0, d=SMALL, batch_size="16", steps=20, canaries=20_000)
    assert canaries.sampled.max() < 20  # the canaries were sampled like records
    assert canaries.methods() == ("steinke2023",)
    report = canaries.report(claimed, DELTA)
    assert report["status"] == "not flagged" and set(report["lower_bounds"]) == {"steinke2023"}
    assert len(report["audits"]) == len(SCORES)
    assert "Bonferroni over 3 tests" in report["correction"]
    # Steinke et al.'s ceiling with 2 x 10^4 canaries at delta 1e-5 (3.50) is below the claim:
    # this run could not have been flagged, and the report says so
    assert report["ceiling"] < claimed and "cannot flag a claim above" in report["reach"]


def test_report_without_a_claim_says_so():
    _, canaries = audited_run(8.0, d=SMALL, steps=2)
    report = canaries.report(None, DELTA)
    assert report["status"] == "no claim" and not report["flagged"]


def test_signs_flip_between_the_steps_of_a_pair():
    model = nn.Linear(40, 30, bias=False)
    canaries = GradientCanaries(model.parameters(), 100, norm=10.0, seed=3)

    class Opt:  # what before_noise reads of a DPOptimizer
        sample_rate, max_grad_norm = 1.0, 1.0

        class engine:  # noqa: N801 - stands for the optimizer's engine
            @staticmethod
            def clip_factors(norms):
                return torch.ones_like(norms)

        def clipped_sum(self, p):
            return self.sums.setdefault(id(p), torch.zeros_like(p))

    seen = []
    for step in range(4):
        opt = Opt()
        opt.sums = {}
        canaries.steps = step
        canaries.before_noise(opt)
        seen.append(canaries.signs.clone())
    assert torch.equal(seen[1], -seen[0]) and torch.equal(seen[3], -seen[2])
    assert not torch.equal(seen[2], seen[0])  # a new draw for each pair


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


def test_unknown_score_is_named():
    _, canaries = audited_run(8.0, d=SMALL, steps=2)
    with pytest.raises(ValueError, match="score='max' is not allowed"):
        canaries.audit(DELTA, score="max")


def test_several_processes_are_refused_by_name():
    class TwoRanks:  # what GradientCanaries reads of a DistributedDPOptimizer
        audit_hook, world_size = None, 2

    with pytest.raises(ValueError, match="white-box canaries on 2 processes"):
        GradientCanaries(nn.Linear(3, 2).parameters(), 4).attach(TwoRanks())
