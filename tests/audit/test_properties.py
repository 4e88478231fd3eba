"""Property checks (dptrain.audit.properties): each broken mechanism is flagged by the check
meant for it, correct runs at epsilon 1, 3 and 8 (three seeds each) never are, and the
statistical tests have the size they claim.

References are independent of the implementation: sizes are measured by simulation from
numpy's Binomial / Gaussian generators; the faults (tests/audit/property_faults.py) patch
dptrain the way a bug would, with the accountant's figures left as they were.
"""

from __future__ import annotations

import contextlib
import functools
import math

import numpy as np
import pytest
import torch
from torch import nn

from dptrain import make_private
from dptrain.accounting import calibrate_noise_multiplier
from dptrain.audit import PropertyReport, check_properties
from dptrain.audit.properties import (
    DEFAULT_ALPHA,
    batch_size_test,
    independent_streams,
    noise_std_test,
    steps_independent,
)
from dptrain.optim import DPOptimizer
from tests.audit.property_faults import FAULTS, rows_mixed

LEVEL = DEFAULT_ALPHA / 3
DELTA = 1e-5
C = 2.0  # != 1: a noise std computed without C must differ from one with it


@functools.cache
def sigma_for(epsilon: float, q: float, steps: int) -> float:
    """The PLD-calibrated sigma (computed once per setting: calibration is the slow part)."""
    return calibrate_noise_multiplier(epsilon, DELTA, schedule=[(q, steps)], accountant="pld")


def mlp_run(
    epsilon=8.0, seed=0, n=400, batch=40, steps=20, *, sigma=None, model=None, data=None, **kw
):
    """A small MLP (4 tensors) made private with Poisson batches of expected size ``batch``,
    sigma calibrated to (epsilon, 1e-5) over ``steps`` unless ``sigma`` is given."""
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model or nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    if data is None:
        data = torch.utils.data.TensorDataset(
            torch.randn(n, 16, generator=g), torch.randint(0, 8, (n,), generator=g)
        )
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        data,
        batch_size=batch,
        max_grad_norm=C,
        steps=steps,
        noise_multiplier=sigma or sigma_for(epsilon, batch / len(data), steps),
        target_delta=DELTA,
        seed=seed,
        **kw,
    )


def checked(fault=None, **kw) -> PropertyReport:
    with fault() if fault else contextlib.nullcontext():
        private = mlp_run(**kw)
        try:
            return check_properties(private, steps=private.steps)
        finally:
            private.engine.detach()


def flagged_names(report: PropertyReport) -> list[str]:
    return [c.name for c in report.checks if c.flagged]


# -- a real run ---------------------------------------------------------------------------


@pytest.mark.parametrize("epsilon", [1.0, 3.0, 8.0])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_correct_run_is_never_flagged(epsilon, seed):
    report = checked(epsilon=epsilon, seed=seed)
    assert not report.flagged, report.table()
    assert report.complete
    assert report.steps == 20


@pytest.mark.parametrize("name", list(FAULTS))
def test_each_broken_mechanism_is_flagged_by_its_check(name):
    fault, check = FAULTS[name]
    report = checked(fault)
    assert report.flagged, f"{name} not flagged:\n{report.table()}"
    assert any(n.startswith(check) for n in flagged_names(report)), (name, report.table())


def test_rows_that_are_not_records_are_flagged_by_the_sensitivity_probe():
    # a bag of 4 token vectors per record: read per token, one record is clipped 4 times
    class Bag(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(16, 8, bias=False)

        def forward(self, x):
            return self.proj(x).sum(1)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 1, 16, generator=g).expand(400, 4, 16).contiguous()
    data = torch.utils.data.TensorDataset(3 * x, torch.randint(0, 8, (400,), generator=g))
    assert not checked(model=Bag(), data=data, sigma=1.0).flagged
    report = checked(rows_mixed, model=Bag(), data=data, sigma=1.0)
    assert flagged_names(report) == ["one record moves the clipped sum by <= C"], report.table()


def test_restore_leaves_the_run_as_it_was_and_training_draws_new_noise():
    private = mlp_run(steps=30, sigma=1.0)
    weights = [p.detach().clone() for p in private.model.parameters()]
    sampler = private.data_loader.state_dict()
    gen = private.optimizer.state_dict()["generators"]
    report = check_properties(private, steps=5)
    assert report.steps == 5 and not report.flagged
    assert all(torch.equal(w, p) for w, p in zip(weights, private.model.parameters(), strict=True))
    assert private.ledger.num_steps == 0 and private.optimizer.steps_taken == 0
    assert private.data_loader.state_dict()["steps_drawn"] == sampler["steps_drawn"] == 0
    # the noise the checks saw is not drawn again by training
    after = private.optimizer.state_dict()["generators"]
    assert not torch.equal(after["cpu"], gen["cpu"])
    assert len(list(private.data_loader)) == 30
    private.engine.detach()


def test_restore_false_keeps_the_steps_as_training_steps():
    private = mlp_run(steps=30, sigma=1.0)
    check_properties(private, steps=4, restore=False)
    assert private.ledger.num_steps == private.optimizer.steps_taken == 4
    private.engine.detach()


def test_an_audit_hook_already_attached_still_sees_every_step():
    from dptrain.audit import GradientCanaries

    private = mlp_run(sigma=1.0)
    canaries = GradientCanaries(private.model.parameters(), m=20, seed=1).attach(private.optimizer)
    report = check_properties(private, steps=6)
    assert canaries.steps == 6 and private.optimizer.audit_hook is canaries
    assert not report.flagged, report.table()  # canaries are part of the clipped sum
    private.engine.detach()


def test_bad_input_names_the_argument():
    private = mlp_run(sigma=1.0)
    with pytest.raises(ValueError, match="steps=1"):
        check_properties(private, steps=1)
    with pytest.raises(ValueError, match="alpha=0"):
        check_properties(private, alpha=0)
    with pytest.raises(ValueError, match="no 'optimizer'"):
        check_properties(object())
    private.engine.detach()
    records = [{"x": torch.randn(16), "y": 1}] * 10
    as_dicts = mlp_run(data=records, batch=5, steps=3, sigma=1.0)
    with pytest.raises(ValueError, match="loss_fn="):
        check_properties(as_dicts, steps=2)
    as_dicts.engine.detach()


def test_a_loader_with_one_step_left_cannot_be_checked():
    private = mlp_run(steps=1, sigma=1.0)
    with pytest.raises(ValueError, match="1 steps left"):
        check_properties(private, steps=5)
    private.engine.detach()


# -- the statistical tests: their size and power ----------------------------------------------


def test_batch_size_test_has_its_size_under_binomial_sizes():
    rng = np.random.default_rng(0)
    n, q, t, runs = 60, 0.05, 20, 4000  # small N q: the discrete case
    flags = sum(
        batch_size_test(rng.binomial(n, q, t), n, [q] * t, level=0.01, seed=i).flagged
        for i in range(runs)
    )
    # Bonferroni over the 2 tests: at most 0.01; binomial sd of the count at 0.01 is ~6.3
    assert flags <= 0.01 * runs + 4 * math.sqrt(0.01 * runs)


def test_batch_size_test_flags_fixed_sizes_and_another_rate():
    n, q, t = 1000, 0.1, 20
    assert batch_size_test([100] * t, n, [q] * t, LEVEL).flagged
    rng = np.random.default_rng(1)
    assert batch_size_test(rng.binomial(n, 0.4, t), n, [q] * t, LEVEL).flagged
    assert not batch_size_test(rng.binomial(n, q, t), n, [q] * t, LEVEL).flagged
    assert batch_size_test([n + 1] + [100] * (t - 1), n, [q] * t, LEVEL).flagged


def test_noise_std_test_has_its_size_and_sees_a_small_error():
    rng = np.random.default_rng(2)
    std = [0.5, 2.0, 1.0]
    flags = 0
    for _ in range(2000):
        e = {"w": rng.normal(size=(3, 50)) * np.array(std)[:, None], "b": rng.normal(size=(3, 2))}
        e["b"] *= np.array(std)[:, None]
        flags += noise_std_test(e, std, level=0.01).flagged
    assert flags <= 0.01 * 2000 + 4 * math.sqrt(0.01 * 2000)
    big = {"w": rng.normal(size=(20, 65536)) * 0.98}  # 2% too little noise
    assert noise_std_test(big, [1.0] * 20, LEVEL).flagged


def test_steps_independent_has_its_size_and_flags_repeated_noise():
    rng = np.random.default_rng(3)
    flags = sum(
        steps_independent(
            {"w": rng.normal(size=(6, 40)), "b": rng.normal(size=(6, 3))}, 0.01
        ).flagged
        for _ in range(1000)
    )
    assert flags <= 0.01 * 1000 + 4 * math.sqrt(0.01 * 1000)
    z = rng.normal(size=(1, 1000))
    repeated = {"w": np.concatenate([z, rng.normal(size=(8, 1000)), z])}
    assert steps_independent(repeated, LEVEL).flagged


def _rank_noise(seed: int, shape=(64, 64)) -> torch.Tensor:
    """The noise one process's DPOptimizer adds to a zero clipped sum with this seed."""
    p = nn.Parameter(torch.zeros(shape))
    opt = DPOptimizer(
        torch.optim.SGD([p], lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=1.0,
        sample_rate=1.0,
        seed=seed,
    )
    p.grad = torch.zeros_like(p)
    opt.add_noise()
    return p.grad.clone()


def test_per_rank_noise_streams_seeded_alike_are_flagged():
    alike = {f"rank {r}": _rank_noise(7) for r in range(4)}
    assert independent_streams(alike).flagged
    apart = {f"rank {r}": _rank_noise(7 + r) for r in range(4)}
    check = independent_streams(apart)
    assert not check.flagged and check.p_value is not None
    with pytest.raises(ValueError, match="at least 2"):
        independent_streams({"rank 0": _rank_noise(7)})


# -- a DPTrainer ------------------------------------------------------------------------------


def _tiny_trainer(output_dir, steps=12):
    pytest.importorskip("transformers")
    from dptrain.hf import DPTrainer, PrivacyArguments
    from tests.hf import tiny

    return DPTrainer(
        model=tiny.llama(),
        args=tiny.training_args(str(output_dir), max_steps=steps),
        train_dataset=tiny.lm_records(80),
        privacy_args=PrivacyArguments(
            noise_multiplier=1.0, target_delta=1e-5, max_grad_norm=C, seed=3
        ),
    )


@pytest.mark.slow  # trains two tiny trainers (~25 s on 2 shared cores)
def test_a_dptrainer_is_checked_through_its_training_step_and_trains_as_if_unchecked(tmp_path):
    checked_trainer = _tiny_trainer(tmp_path / "a")
    report = check_properties(checked_trainer, steps=12)
    assert not report.flagged and report.complete, report.table()
    assert checked_trainer.privacy is None
    checked_trainer.train()
    plain = _tiny_trainer(tmp_path / "b")
    plain.train()
    assert checked_trainer.privacy.ledger == plain.privacy.ledger
    assert checked_trainer.privacy.ledger.num_steps == 12
    # no trace: the same seed gives the same batches and noise as a trainer never checked
    for p, q in zip(checked_trainer.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.slow  # transformers' import and a Llama's clipped steps (~15-40 s shared)
def test_a_dptrainer_with_a_broken_mechanism_is_flagged(tmp_path):
    fault, check = FAULTS["noise std without C"]
    with fault():
        report = check_properties(_tiny_trainer(tmp_path), steps=12)
    assert any(n.startswith(check) for n in flagged_names(report)), report.table()


def test_a_dptrainer_that_trained_is_refused(tmp_path):
    trainer = _tiny_trainer(tmp_path, steps=2)
    trainer.train()
    with pytest.raises(ValueError, match="before train"):
        check_properties(trainer)
    with pytest.raises(ValueError, match="restore=False"):
        check_properties(_tiny_trainer(tmp_path), restore=False)


def test_a_user_level_run_is_checked_per_user():
    # 100 users of 4 records each: users are sampled (N = 100) and clipped as one
    users = [i // 4 for i in range(400)]
    report = checked(sigma=1.0, batch=10, steps=10, user_ids=users)
    assert not report.flagged and report.complete, report.table()
    assert max(report.batch_sizes) <= 100
    report = checked(FAULTS["clipping at 2C"][0], sigma=1.0, batch=10, steps=10, user_ids=users)
    assert flagged_names(report) == ["one record moves the clipped sum by <= C"], report.table()


def test_an_optimizer_that_steps_without_its_hook_does_not_pass_silently(monkeypatch):
    original = DPOptimizer.step

    def step(self, *args, **kwargs):
        hook, self.audit_hook = self.audit_hook, None
        try:
            return original(self, *args, **kwargs)
        finally:
            self.audit_hook = hook

    monkeypatch.setattr(DPOptimizer, "step", step)
    report = checked(sigma=1.0, steps=6)
    assert not report.complete and not report.flagged
    assert [c.status for c in report.checks[:2]] == ["not run", "not run"]
    assert "saw 0 of 6 steps" in report.checks[0].detail
    assert "did not run" in report.table()
