"""The noise step's tensor work in blocks (dptrain.noise): the layout of the draws, what is
added, and the sums handed to p.grad. The reference for each draw is a plain ``normal_`` of
the block's size from a generator with the same seed."""

import pytest
import torch
from torch import nn

from dptrain.noise import add_noise_, divide_and_publish, noise_blocks


def _gen(seed=0):
    g = torch.Generator().manual_seed(seed)
    return lambda device: g


def test_blocks_follow_parameter_order_and_are_cut_by_size_dtype_and_device():
    sums = [torch.zeros(3, 4), torch.zeros(5), torch.zeros(20), torch.zeros(2, dtype=torch.float64)]
    got = [
        (block, [tuple(v.shape) for v in views])
        for block, views in noise_blocks(sums, 1.0, _gen(), block_numel=17)
    ]
    # 12 + 5 = 17 fit; 20 is larger than a block: alone; float64 is another block
    assert got == [([0, 1], [(3, 4), (5,)]), ([2], [(20,)]), ([3], [(2,)])]


def test_each_block_is_one_draw_of_its_size_from_the_generator_in_turn():
    sums = [torch.zeros(3, 4), torch.zeros(5), torch.zeros(20)]
    got = [
        torch.cat([v.flatten() for v in views])
        for _, views in noise_blocks(sums, 2.0, _gen(7), block_numel=17)
    ]
    ref = torch.Generator().manual_seed(7)
    want = [
        torch.empty(17).normal_(0.0, 2.0, generator=ref),
        torch.empty(20).normal_(0.0, 2.0, generator=ref),
    ]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_noise_is_added_in_place_and_its_norm_per_block_returned():
    sums = [torch.ones(40, 30), torch.full((7,), 3.0), torch.full((2, 3), -1.0)]
    before = [s.clone() for s in sums]
    norms = add_noise_(sums, 0.5, _gen(1), block_numel=100)
    ref = torch.Generator().manual_seed(1)
    z0 = torch.empty(1200).normal_(0.0, 0.5, generator=ref).view(40, 30)
    z12 = torch.empty(13).normal_(0.0, 0.5, generator=ref)  # 7 + 6 elements: one block
    z1, z2 = z12[:7], z12[7:].view(2, 3)
    for s, b, z in zip(sums, before, (z0, z1, z2), strict=True):
        assert torch.equal(s, b + z)
    assert len(norms) == 2
    torch.testing.assert_close(torch.stack(norms), torch.stack([z0.norm(), z12.norm()]))


def test_the_draws_have_the_asked_std_and_no_coordinate_is_left_out():
    sums = [torch.zeros(300, 100), torch.zeros(1000), torch.zeros(50, 40)]
    add_noise_(sums, 3.0, _gen(2), block_numel=4096)
    flat = torch.cat([s.flatten() for s in sums])
    assert (flat != 0).all()
    # 33,000 draws: the sample std is within 2% of 3 (its own std is ~0.4% of it)
    assert float(flat.std()) == pytest.approx(3.0, rel=0.02)
    assert abs(float(flat.mean())) < 0.1


def test_a_block_size_below_one_is_refused():
    with pytest.raises(ValueError, match="block_numel=0"):
        next(noise_blocks([torch.zeros(2)], 1.0, _gen(), block_numel=0))


def test_sums_are_divided_and_low_precision_parameters_get_the_cast_after():
    w32 = nn.Parameter(torch.zeros(3, 2))
    w16 = nn.Parameter(torch.zeros(3, 2, dtype=torch.bfloat16))
    w32.grad = torch.full((3, 2), 3.0)
    s16 = torch.full((3, 2), 1.0117)  # the engine's float32 sum: not a bf16 value
    divide_and_publish([w32, w16], [w32.grad, s16], 3.0)
    assert torch.equal(w32.grad, torch.full((3, 2), 1.0))
    assert w16.grad.dtype == torch.bfloat16
    after = (torch.full((3, 2), 1.0117) / 3.0).to(torch.bfloat16)
    before = (torch.full((3, 2), 1.0117).to(torch.bfloat16).float() / 3.0).to(torch.bfloat16)
    assert not torch.equal(after, before)  # the data tell the two orders apart
    assert torch.equal(w16.grad, after)


def test_the_total_norm_is_the_norm_of_all_the_tensors_together():
    from dptrain.noise import total_norm

    parts = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    want = float(torch.cat([p.flatten() for p in parts]).double().norm())
    assert total_norm([p.norm() for p in parts]) == pytest.approx(want, rel=1e-7)
    assert total_norm([]) == 0.0


def test_total_norms_read_every_group_at_once_as_total_norm_would():
    from dptrain.noise import total_norm, total_norms

    gen = torch.Generator().manual_seed(0)
    a = [torch.randn(5, generator=gen).norm() for _ in range(3)]
    b = [torch.randn(7, generator=gen).norm()]
    assert total_norms(a, [], b) == (total_norm(a), 0.0, total_norm(b))
    want = float(torch.stack(a).double().norm())
    assert total_norms(a)[0] == pytest.approx(want, rel=1e-12)
    assert total_norms([], []) == (0.0, 0.0)
    assert total_norms() == ()
