"""Low-precision records: float32 products, and clipped sums scaled without rounding.

The reference is float64 arithmetic on the same bf16 values (every bf16 is exact in
float64, so the float64 result is the exact value the float32 kernels approximate)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dptrain.clipping.tensor_cores as tc
from dptrain.clipping.rules import LinearRule
from dptrain.clipping.tensor_cores import (
    bmm_f32,
    flops_emulated,
    mm_f32,
    one_gemm_sums,
    round_down_bf16,
    rounding_bound,
    scaled_cross,
    scaled_split,
    split_bf16,
)


@given(st.floats(min_value=1e-30, max_value=1.0, allow_subnormal=False))
def test_factors_round_down_to_bf16_within_one_part_in_128(c):
    c32 = torch.tensor([c], dtype=torch.float32)
    r = round_down_bf16(c32)
    assert r <= c32
    assert r >= c32 * (1 - 2**-7)
    assert torch.equal(r.to(torch.bfloat16).float(), r)  # representable in bf16


def test_a_factor_of_one_is_kept_exactly():
    assert torch.equal(round_down_bf16(torch.ones(3)), torch.ones(3))


@pytest.mark.parametrize("seed", range(5))
def test_scaled_bf16_rows_split_into_two_bf16_parts_exactly(seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(8, 16, 32, generator=gen) * 10.0 ** torch.randint(-6, 6, (8, 1, 1))).bfloat16()
    c = torch.rand(8, generator=gen)
    scaled = x.double() * round_down_bf16(c).double()[:, None, None]
    (one,) = scaled_split(x, c)  # off CUDA: one float32 tensor
    assert torch.equal(one.double(), scaled)  # 8 x 8 significant bits: exact in float32
    hi, minus_lo = split_bf16(x, round_down_bf16(c)[:, None, None])  # as on CUDA
    assert hi.dtype == minus_lo.dtype == torch.bfloat16
    assert torch.equal(hi.double() - minus_lo.double(), scaled)
    assert torch.equal(hi, one.bfloat16())  # hi: the product rounded to nearest
    assert minus_lo.count_nonzero() > 0  # the second part is needed


def _cancelling_record(b=4, t=255, d_in=8, d_out=8, seed=0):
    """Tokens whose gradients cancel: in each triple of tokens the inputs are equal and
    the output gradients sum to (about) zero, so the per-example gradient a^T g is far
    smaller than the sum of its tokens' terms, which is where rounding c g costs most."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(b, t // 3, 1, d_in, generator=gen).expand(-1, -1, 3, -1).reshape(b, t, d_in)
    g = torch.randn(b, t // 3, 3, d_out, generator=gen).bfloat16().float()
    g[:, :, 2] = -(g[:, :, 0] + g[:, :, 1])
    return a.bfloat16(), g.reshape(b, t, d_out).bfloat16()


def _exact(a, g, c):
    """sum_i c_i a_i^T g_i in float64 on the same bf16 values, and sum_i c_i |a_i|^T |g_i|
    (the scale of float32 accumulation's error: Higham's gamma_n bound)."""
    c = c.double()[:, None, None]
    want = torch.einsum("btp,btd->pd", c * g.double(), a.double())
    scale = torch.einsum("btp,btd->pd", c * g.double().abs(), a.double().abs())
    return want, scale


def test_the_clipped_sum_of_a_bf16_record_is_the_rounded_down_factors_times_the_exact_sum():
    a, g = _cancelling_record()
    module = torch.nn.Linear(8, 8, bias=False)
    c = torch.tensor([0.3, 0.71, 0.9999, 1.0])
    got = LinearRule().clipped_sum(module, a, g, c)["weight"]
    want, scale = _exact(a, g, round_down_bf16(c))
    n = a.shape[0] * a.shape[1]  # float32 additions per entry
    gamma = n * 2**-24 / (1 - n * 2**-24)
    assert got.dtype == torch.float32
    assert ((got.double() - want).abs() <= gamma * scale).all()


@pytest.mark.parametrize("seed", range(3))
def test_rounding_the_scaled_rows_to_bf16_would_break_the_bound(seed):
    # Why scaled_split: with c g rounded to bf16 (what a bf16 GEMM on c * g does), one
    # example's contribution exceeds c ||a^T g|| by far more than float32 rounding.
    a, g = _cancelling_record(b=1, seed=seed)
    c = torch.tensor([0.3])
    exact = _exact(a, g, c)[0].norm()
    rounded = (g.float() * c).bfloat16()
    naive = _exact(a, rounded, torch.ones(1))[0].norm()
    assert naive > exact * 1.05
    hi, minus_lo = split_bf16(g, round_down_bf16(c)[:, None, None])
    ours = _exact(a, hi, torch.ones(1))[0] - _exact(a, minus_lo, torch.ones(1))[0]
    assert ours.norm() <= exact  # factor rounded down, products exact


def test_bf16_products_equal_float64_ones_up_to_float32_accumulation():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 40, 24, generator=gen).bfloat16()
    y = torch.randn(3, 24, 40, generator=gen).bfloat16()
    want = torch.bmm(x.double(), y.double())
    got = bmm_f32(x, y)
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-5)
    got2 = mm_f32(x[0], y[0])
    assert got2.dtype == torch.float32
    assert torch.allclose(got2.double(), want[0], rtol=1e-6, atol=1e-5)


def test_emulated_tensor_core_flops_are_counted_only_when_asked():
    x = torch.randn(2, 4, 8).bfloat16()
    flops_emulated(reset=True, on=False)
    bmm_f32(x, x.transpose(1, 2))
    assert flops_emulated() == (0, 0)
    flops_emulated(reset=True, on=True)
    try:
        bmm_f32(x, x.transpose(1, 2))
        bmm_f32(x.float(), x.float().transpose(1, 2))  # float32 operands: not emulated
        assert flops_emulated(reset=True) == (2 * 2 * 4 * 8 * 4, 0)
        scaled_cross(x, x, torch.rand(2), scale_x=True)  # two bf16 GEMMs on CUDA, one here
        one = 2 * 2 * 4 * 8 * 8
        assert flops_emulated() == (2 * one, one)
    finally:
        flops_emulated(reset=True, on=False)


def _integer_record(b=4, t=16, d_in=8, d_out=8, seed=0):
    """A record on which float32 accumulation is exact in any order: a and g are integers
    in [-7, 7], the rounded factors are multiples of 2^-9, so every term c'_i a g is a
    multiple of 2^-9 and every partial sum, of any order or grouping, is at most
    sum |terms| <= 4 * 16 * 7 * 7 < 2^12 in size: at most 21 significant bits, exact in
    float32 (with two bits to spare where a tensor core's adder aligns to the largest
    term and truncates below its 24th bit). But c'_i a and c'_i g have up to 11
    significant bits: rounding either to bf16 (8) would change the sum."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randint(-7, 8, (b, t, d_in), generator=gen).bfloat16()
    g = torch.randint(-7, 8, (b, t, d_out), generator=gen).bfloat16()
    return a, g


_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", [*_DEVICES, "cpu-two-parts"])
def test_the_clipped_sum_is_exact_where_float32_accumulation_is(device, monkeypatch):
    # A verdict that holds for every kernel order: the exact value, bit for bit.
    # "cpu-two-parts": CUDA's arithmetic (split_bf16's two bf16 parts, two GEMMs, their
    # difference) run on the CPU.
    if device == "cpu-two-parts":
        device = "cpu"
        monkeypatch.setattr(
            tc, "scaled_split", lambda x, f: tc.split_bf16(x, tc._rounded_rows(f, x))
        )
    a, g = _integer_record()
    c = torch.tensor([0.3, 0.71, 0.9999, 1.0])
    module = torch.nn.Linear(8, 8, bias=False).to(device)
    got = LinearRule().clipped_sum(module, a.to(device), g.to(device), c.to(device))["weight"]
    want, _ = _exact(a, g, round_down_bf16(c))
    assert got.dtype == torch.float32
    assert torch.equal(got.cpu().double(), want)
    # The data tell a scaled operand rounded to bf16 from the split, whichever is scaled.
    c_rows = round_down_bf16(c)[:, None, None]
    assert not torch.equal(_exact(a, (g.float() * c_rows).bfloat16(), torch.ones(4))[0], want)
    assert not torch.equal(_exact((a.float() * c_rows).bfloat16(), g, torch.ones(4))[0], want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_float32_output_gemms_are_within_float32_accumulation_of_the_exact_values():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, 48, generator=gen).bfloat16()
    y = torch.randn(3, 48, 64, generator=gen).bfloat16()
    got = bmm_f32(x.cuda(), y.cuda()).cpu()
    assert got.dtype == torch.float32
    exact = torch.bmm(x.double(), y.double())
    scale = torch.bmm(x.double().abs(), y.double().abs())
    n = x.shape[2]
    assert ((got.double() - exact).abs() <= n * 2**-24 / (1 - n * 2**-24) * scale).all()
    # Written into a slot of a larger buffer (streamed per-example gradients): the same
    # values, in place, by the out= form (which this torch must have: a fallback copy
    # would cost a launch per streamed parameter and step)
    buffer = torch.zeros(3, 64 * 64 + 10, device="cuda")
    slot = buffer[:, 5 : 5 + 64 * 64].view(3, 64, 64)
    assert bmm_f32(x.cuda(), y.cuda(), out=slot) is slot
    assert tc._OUT_DTYPE == {"ok": True, "into": True}
    assert ((slot.cpu().double() - exact).abs() <= n * 2**-24 / (1 - n * 2**-24) * scale).all()
    assert buffer[:, :5].count_nonzero() == 0 and buffer[:, -5:].count_nonzero() == 0
    # The cancelling record, summed as two bf16 GEMMs (hi, lo) on tensor cores: the
    # clipped sum within Higham's bound of the exact one, as on the CPU. (It is not
    # within 1e-6 of the CPU's float32 GEMM, as this test asserted before the GPU session
    # of 2026-11-27: the two sum in different orders, and cancellation makes that visible.)
    a, g = _cancelling_record()
    c = torch.tensor([0.3, 0.71, 0.9999, 1.0])
    module = torch.nn.Linear(8, 8, bias=False).cuda()
    on_gpu = LinearRule().clipped_sum(module, a.cuda(), g.cuda(), c.cuda())["weight"].cpu()
    want, scale = _exact(a, g, round_down_bf16(c))
    n = a.shape[0] * a.shape[1] + 1  # and the add of the two GEMMs' results
    gamma = n * 2**-24 / (1 - n * 2**-24)
    assert ((on_gpu.double() - want).abs() <= gamma * scale).all()


def test_a_torch_without_float32_output_gemms_falls_back_to_float32(monkeypatch):
    # As if on CUDA with a torch whose mm/bmm lack out_dtype (here: the CPU's, which raise).

    monkeypatch.setattr(tc, "tensor_cores", lambda *tensors: True)
    monkeypatch.setitem(tc._OUT_DTYPE, "ok", True)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, 4, generator=gen).bfloat16()
    got = tc.bmm_f32(x, x.transpose(1, 2))
    assert got.dtype == torch.float32 and not tc._OUT_DTYPE["ok"]
    assert torch.allclose(got.double(), torch.bmm(x.double(), x.double().transpose(1, 2)))


def test_clipped_sum_reads_the_factors_as_they_are_now():
    """The factors' rounding is kept between the layers of a step (one rounding a step),
    but factors changed in place, or new factors, are rounded again."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 5, generator=gen).bfloat16()
    c = torch.rand(4, generator=gen)
    (first,) = scaled_split(x, c)
    c.mul_(0.5)
    (second,) = scaled_split(x, c)
    want = x.double() * round_down_bf16(c).double()[:, None, None]
    assert torch.equal(second.double(), want)
    assert torch.equal(second.double(), first.double() * 0.5)  # halving is exact
    (two_d,) = scaled_split(x[:, 0], c)  # another shape: factors broadcast to it
    assert torch.equal(two_d.double(), want[:, 0])


def test_one_gemm_sum_of_a_bf16_record_stays_within_its_rounding_bound():
    # sum_rounding="bounded": c' g rounded to bf16 once, one GEMM. Each example's
    # contribution moves from c'_i a_i^T g_i by at most c'_i times rounding_bound.
    a, g = _cancelling_record()
    module = torch.nn.Linear(8, 8, bias=False)
    c = torch.tensor([0.3, 0.71, 0.9999, 1.0])
    bound = LinearRule().rounding_bound(module, a, g)["weight"]
    cr = round_down_bf16(c)
    moved = []
    for i in range(4):
        with one_gemm_sums():
            got = LinearRule().clipped_sum(module, a[i : i + 1], g[i : i + 1], c[i : i + 1])
        want, scale = _exact(a[i : i + 1], g[i : i + 1], cr[i : i + 1])
        n = a.shape[1]
        gamma = n * 2**-24 / (1 - n * 2**-24)  # float32 accumulation, as in the exact path
        dist = float((got["weight"].double() - want).norm())
        assert dist <= float(cr[i]) * float(bound[i]) + float(gamma * scale.norm())
        moved.append(dist / float(want.norm()))
    # The rounding is real (not float32 noise) where the factor is below 1, and none is
    # left where it is 1 (c' g = g: nothing to round).
    assert min(moved[:3]) > 1e-3
    assert moved[3] < 1e-5
    # Outside one_gemm_sums the same call is exact: the bound is only ever used where
    # the engine clipped with it.
    got = LinearRule().clipped_sum(module, a, g, c)["weight"]
    want, scale = _exact(a, g, cr)
    n = a.shape[0] * a.shape[1]
    assert ((got.double() - want).abs() <= n * 2**-23 * scale).all()


def test_rounding_bound_is_u_times_the_sum_of_token_norm_products():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 7, 5, generator=gen).bfloat16()
    y = torch.randn(3, 7, 4, generator=gen).bfloat16()
    want = 2**-8 * (x.double().norm(dim=-1) * y.double().norm(dim=-1)).sum(1)
    assert torch.allclose(rounding_bound(x, y).double(), want, rtol=1e-6)
    assert LinearRule().rounding_bound(torch.nn.Linear(5, 4), x.float(), y.float()) == {}


def test_one_gemm_sums_count_one_tensor_core_gemm():
    x = torch.randn(2, 4, 8).bfloat16()
    flops_emulated(reset=True, on=True)
    try:
        with one_gemm_sums():
            scaled_cross(x, x, torch.rand(2), scale_x=True)
        assert flops_emulated() == (2 * 2 * 4 * 8 * 8, 0)
    finally:
        flops_emulated(reset=True, on=False)


def test_rounding_bounds_of_layers_sharing_an_input_read_its_norms_once(monkeypatch):

    gen = torch.Generator().manual_seed(4)
    a = torch.randn(2, 5, 6, generator=gen).bfloat16()
    g1, g2 = (torch.randn(2, 5, 3, generator=gen).bfloat16() for _ in range(2))
    alone = [rounding_bound(a, g) for g in (g1, g2)]
    calls = []
    real = torch.linalg.vector_norm

    def counted(x, *args, **kwargs):
        calls.append(x)
        return real(x, *args, **kwargs)

    monkeypatch.setattr(torch.linalg, "vector_norm", counted)
    with tc.row_norm_cache():
        shared = [rounding_bound(a, g) for g in (g1, g2)]
        a.add_(1)  # changed in place: its norms are read again
        rounding_bound(a, g1)
    assert all(torch.equal(x, y) for x, y in zip(alone, shared, strict=True))
    # each output gradient's norms, the shared input's once (until it changes)
    assert [id(x) for x in calls] == [id(x) for x in (g1, a, g2, g1, a)]


def test_a_split_is_made_once_for_the_same_rows_and_factors_within_split_cache():
    from dptrain.clipping.tensor_cores import has_split, split_cache

    x = torch.randn(2, 5, 8).bfloat16()
    c = torch.rand(2)
    held: dict = {}
    assert scaled_split(x, c) is not scaled_split(x, c)  # no cache outside a block
    with split_cache(held):
        first = scaled_split(x, c)
        assert has_split(x, c) and scaled_split(x, c) is first
        assert not has_split(x, torch.rand(2))  # other factors
        x.mul_(2)  # an in-place change: a new version, a new split
        assert not has_split(x, c)
        again = scaled_split(x, c)
        assert again is not first
        assert torch.equal(
            again[0].double(), x.double() * round_down_bf16(c).double()[:, None, None]
        )
    assert not has_split(x, c)  # outside the block: not consulted
    held.clear()


def test_layers_reading_one_input_share_its_split_and_get_their_exact_sums():
    # q, k and v read one input; k and v (narrower outputs) scale it too once q has split
    # it, and each sum is still the rounded-down factors times the exact sum.
    from dptrain.clipping.tensor_cores import split_cache

    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-7, 8, (4, 16, 8), generator=gen).bfloat16()
    c = torch.tensor([0.3, 0.71, 0.9999, 1.0])
    mods = [torch.nn.Linear(8, d, bias=False) for d in (8, 4, 4)]
    gs = [torch.randint(-7, 8, (4, 16, m.out_features), generator=gen).bfloat16() for m in mods]
    calls = []

    real = tc._scaled_rows
    held: dict = {}
    try:
        tc._scaled_rows = lambda x, f: (calls.append(x.shape[-1]), real(x, f))[1]
        with split_cache(held):
            got = [
                LinearRule().clipped_sum(m, a, g, c)["weight"]
                for m, g in zip(mods, gs, strict=True)
            ]
    finally:
        tc._scaled_rows = real
        held.clear()
    assert calls == [8]  # one split, of the shared input
    for w, g in zip(got, gs, strict=True):
        want, _ = _exact(a, g, round_down_bf16(c))
        assert torch.equal(w.double(), want)
