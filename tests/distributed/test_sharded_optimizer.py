"""ShardedDPOptimizer's keyed noise, in one process (no process group: plain tensors).

The multi-process behaviour (each rank keeping its shard's coordinates of one draw)
is tested in tests/distributed/test_fsdp.py; here, what the keys are."""

from __future__ import annotations

import pytest
import torch

from dptrain.distributed.sharded_optimizer import ShardedDPOptimizer, keyed_noise, noise_seed

SIGMA, C, EB, SEED = 2.0, 0.5, 8.0, 21


def _step_noise(opt: ShardedDPOptimizer, p: torch.nn.Parameter) -> torch.Tensor:
    """The noise of one step with a zero clipped sum: -(p1 - p0) * E[B] (SGD, lr 1)."""
    before = p.detach().clone()
    p.grad = torch.zeros_like(p)
    opt.step()
    return (before - p.detach()) * EB


def _optimizer(p: torch.nn.Parameter, **kw) -> ShardedDPOptimizer:
    return ShardedDPOptimizer(
        torch.optim.SGD([p], lr=1.0),
        noise_multiplier=SIGMA,
        max_grad_norm=C,
        expected_batch_size=EB,
        sample_rate=0.1,
        names={id(p): "layer.weight"},
        **kw,
    )


def test_each_step_draws_its_own_key():
    p = torch.nn.Parameter(torch.zeros(40, 30))
    opt = _optimizer(p, seed=SEED)
    draws = [_step_noise(opt, p) for _ in range(3)]
    for t, z in enumerate(draws):
        gen = torch.Generator().manual_seed(noise_seed(SEED, t, "layer.weight"))
        expected = torch.empty(40, 30).normal_(0.0, SIGMA * C, generator=gen)
        torch.testing.assert_close(z, expected, rtol=0, atol=1e-5)
    # steps never share a stream: no two draws are correlated
    for a in range(3):
        for b in range(a + 1, 3):
            r = torch.corrcoef(torch.stack([draws[a].flatten(), draws[b].flatten()]))[0, 1]
            assert abs(float(r)) < 0.15
    assert opt.ledger.num_steps == 3


def test_a_continued_ledger_continues_the_keys():
    """Two steps, then a new optimizer on the same ledger: its first step is key 2, not 0."""
    p = torch.nn.Parameter(torch.zeros(10))
    first = _optimizer(p, seed=SEED)
    _step_noise(first, p)
    _step_noise(first, p)
    again = _optimizer(p, seed=SEED, ledger=first.ledger)
    z = _step_noise(again, p)
    gen = torch.Generator().manual_seed(noise_seed(SEED, 2, "layer.weight"))
    torch.testing.assert_close(z, torch.empty(10).normal_(0.0, SIGMA * C, generator=gen))


def test_seed_is_required_and_names_cover_the_parameters():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match=r"seed=None is not allowed for a sharded model"):
        _optimizer(p, seed=None)
    with pytest.raises(ValueError, match=r"names= lacks parameters of shapes \[\(4,\)\]"):
        ShardedDPOptimizer(
            torch.optim.SGD([p, torch.nn.Parameter(torch.zeros(4))], lr=1.0),
            noise_multiplier=SIGMA,
            max_grad_norm=C,
            expected_batch_size=EB,
            sample_rate=0.1,
            names={id(p): "a"},
            seed=SEED,
        )


def test_secure_mode_draws_unkeyed_noise_of_the_right_scale():
    p = torch.nn.Parameter(torch.zeros(200, 50))
    z = _step_noise(_optimizer(p, secure_mode=True), p)
    assert abs(float(z.std()) / (SIGMA * C) - 1) < 0.05
    gen = torch.Generator().manual_seed(noise_seed(SEED, 0, "layer.weight"))
    keyed = torch.empty(200, 50).normal_(0.0, SIGMA * C, generator=gen)
    assert not torch.allclose(z, keyed)


def test_any_range_of_the_keyed_noise_is_the_same_slice_of_the_whole(monkeypatch):
    """Blocks of NOISE_BLOCK coordinates, each with its own key: a rank drawing its shard's
    range gets exactly those coordinates of the whole draw, whatever the range."""
    from dptrain.distributed import sharded_optimizer

    monkeypatch.setattr(sharded_optimizer, "NOISE_BLOCK", 7)
    whole = keyed_noise(SEED, 3, "w", 50, 0, 50, 2.0)
    for a, b in [(0, 7), (3, 20), (14, 50), (49, 50), (10, 10), (6, 8)]:
        assert torch.equal(keyed_noise(SEED, 3, "w", 50, a, b, 2.0), whole[a:b]), (a, b)
    # block j is the stream of key j: not a copy of another block or step
    gen = torch.Generator().manual_seed(noise_seed(SEED, 3, "w", 2))
    assert torch.equal(whole[14:21], torch.empty(7).normal_(0.0, 2.0, generator=gen))
    assert not torch.equal(whole[0:7], whole[7:14])
    assert not torch.equal(whole, keyed_noise(SEED, 4, "w", 50, 0, 50, 2.0))
    with pytest.raises(ValueError, match=r"start=5, stop=51: expected 0 <= start <= stop <= 50"):
        keyed_noise(SEED, 3, "w", 50, 5, 51, 2.0)
    # the optimizer's noise on an unsharded parameter is the keyed draw
    p = torch.nn.Parameter(torch.zeros(5, 10))
    z = _step_noise(_optimizer(p, seed=SEED), p)
    want = keyed_noise(SEED, 0, "layer.weight", 50, 0, 50, SIGMA * C).view(5, 10)
    torch.testing.assert_close(z, want, rtol=0, atol=1e-5)
