"""ConvRule and GroupNormRule (raw layout) against the batch-size-1 oracle.

Each module is run alone with the per-example loss L_i = <out_i, R_i>, so the
gradient of sum_i L_i w.r.t. the output is exactly R: the rule gets (a, g) =
(raw input, R), as an engine honouring ``raw_layout`` hands them over.
Tolerances are the oracle harness's (float64 1e-10, float32 1e-5, relative to the
largest reference value), except that a ghost norm's error is measured against the
size of the terms it adds up (see :func:`gram_scale`).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from dptrain.clipping import (
    ClippingEngine,
    UnsupportedModelError,
    oracle_clipped_sum,
    oracle_per_example_grads,
)
from dptrain.clipping.conv_rules import ConvRule, GroupNormRule
from dptrain.clipping.rules import RULES, find_rule
from tests.clipping.oracle_check import (
    SCALE_FLOOR,
    TOLERANCE,
    assert_engine_matches_oracle,
    relative_error,
)
from tests.clipping.sensitivity import PRIVATE, sensitivity

DTYPES = [torch.float64, torch.float32]
CONVS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
FEW = settings(max_examples=12, deadline=None)
pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same':UserWarning")


@st.composite
def conv_cases(draw, dim: int):
    """A small random convolution and input shape whose output is non-empty."""
    groups_kind = draw(st.sampled_from(["one", "two", "depthwise"]))
    if groups_kind == "depthwise":
        groups = draw(st.integers(1, 3))
        c_in, c_out = groups, groups * draw(st.integers(1, 2))
    else:
        groups = 1 if groups_kind == "one" else 2
        c_in, c_out = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 3))
    k = draw(st.tuples(*[st.integers(1, 3)] * dim))
    dilation = draw(st.tuples(*[st.integers(1, 2)] * dim))
    padding = draw(st.sampled_from(["int", "tuple", "same", "valid"]))
    stride = (1,) * dim if padding == "same" else draw(st.tuples(*[st.integers(1, 2)] * dim))
    if padding == "int":
        padding = draw(st.integers(0, 2))
    elif padding == "tuple":
        padding = draw(st.tuples(*[st.integers(0, 2)] * dim))
    mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"]))
    spatial = []
    for i in range(dim):
        span = dilation[i] * (k[i] - 1) + 1
        if padding == "valid":
            pad = 0
        elif padding == "same":
            pad = span - 1  # at most this on either side (and this much in all)
        else:
            pad = padding if isinstance(padding, int) else padding[i]
        low = max(span - 2 * pad, pad + 1)  # non-empty output; reflect needs pad < size
        spatial.append(low + draw(st.integers(0, 3 if dim < 3 else 1)))
    return {
        "conv": dict(
            in_channels=c_in,
            out_channels=c_out,
            kernel_size=k,
            stride=stride,
            padding=padding,
            dilation=dilation,
            groups=groups,
            bias=draw(st.booleans()),
            padding_mode=mode,
        ),
        "spatial": tuple(spatial),
        "batch": draw(st.sampled_from([0, 1, 3])),
        "seed": draw(st.integers(0, 2**16)),
    }


def make_conv(case, dim, dtype) -> nn.Module:
    torch.manual_seed(case["seed"])
    conv = CONVS[dim](**case["conv"]).to(dtype)
    if conv.bias is not None:
        with torch.no_grad():
            conv.bias.normal_()
    return conv


def oracle_and_inputs(module, inputs: list[Tensor], dtype):
    """Per-example grads for L_i = sum_c <module(x_c)_i, R_c,i> over calls c, and the
    raw (a, g) = (x_c, R_c) per call.

    The oracle runs in float64 on the same values (a copy of the module), cast back to
    ``dtype``: PyTorch's own float32 GroupNorm backward is off by up to ~2e-5 where a
    group's values are close, more than the rule (which recomputes xhat) is.
    """
    with torch.no_grad():
        rs = [torch.randn_like(module(x)) for x in inputs]
    ref = copy.deepcopy(module).to(torch.float64)
    ref_inputs = [x.to(torch.float64) for x in inputs]
    ref_rs = [r.to(torch.float64) for r in rs]

    def loss(i):
        pairs = zip(ref_inputs, ref_rs, strict=True)
        return sum((ref(x[i : i + 1]) * r[i : i + 1]).sum() for x, r in pairs)

    grads = oracle_per_example_grads(ref, loss, inputs[0].shape[0])
    return {n: v.to(dtype) for n, v in grads.items()}, list(zip(inputs, rs, strict=True))


def assert_close(got: dict[str, Tensor], want: dict[str, Tensor], dtype, what: str) -> None:
    assert set(got) == set(want), what
    for name in want:
        assert got[name].shape == want[name].shape, f"{what} {name}"
        if want[name].numel() == 0:
            continue
        err = relative_error(got[name], want[name])
        assert err <= TOLERANCE[dtype], f"{what} {name}: relative error {err:.2e}"


def gram_scale(rule, module, calls) -> Tensor:
    """(B,) sum over groups of (sum_t ||a_t|| ||g_t||)^2: the size of the terms the ghost
    norm sum_{t,s} <a_t, a_s> <g_t, g_s> adds up, so its rounding error is a few ulps of
    this (not of the norm, which can be much smaller by cancellation)."""
    A = torch.cat([rule.unfold(module, a, g)[0] for a, g in calls], 1)
    G = torch.cat([rule.unfold(module, a, g)[1] for a, g in calls], 1)
    groups = getattr(module, "groups", 1)
    b, t = A.shape[:2]
    a_norms = A.reshape(b, t, groups, A.shape[2] // groups).norm(dim=-1)
    g_norms = G.reshape(b, t, groups, G.shape[2] // groups).norm(dim=-1)
    return (a_norms * g_norms).sum(1).pow(2).sum(1)


def assert_norms_close(got, want_sq, ghost, scale, dtype) -> None:
    """Instantiated squared norms as ``relative_error``; ghost norms relative to their own
    rounding scale (:func:`gram_scale`) where that exceeds the norm."""
    assert set(got) == set(want_sq)
    for name, want in want_sq.items():
        assert got[name].shape == want.shape, name
        if want.numel() == 0:
            continue
        err = relative_error(got[name], want)
        if ghost and name == "weight":
            floor = max(want.abs().max().item(), scale.max().item(), SCALE_FLOOR[dtype])
            err = (got[name] - want).abs().max().item() / floor
        assert err <= TOLERANCE[dtype], f"norms ghost={ghost} {name}: relative error {err:.2e}"


def check_rule(rule, module, grads, calls, dtype, ghost_options=(False, True)) -> None:
    """per_example, norms_sq (each method) and clipped_sum, raw (one call) or unfolded."""
    b = calls[0][0].shape[0]
    want_sq = {n: v.flatten(1).pow(2).sum(1) for n, v in grads.items()}
    factors = torch.rand(b, dtype=dtype) + 0.1
    want_sum = (
        oracle_clipped_sum(grads, factors)
        if b
        else {n: v.new_zeros(v.shape[1:]) for n, v in grads.items()}
    )
    if len(calls) == 1:
        a, g = calls[0]
        assert rule.prepare(module, a) is a
        assert_close(rule.per_example(module, a, g), grads, dtype, "per_example")
        for ghost in ghost_options:
            got = rule.norms_sq(module, a, g, ghost)
            assert_norms_close(got, want_sq, ghost, gram_scale(rule, module, calls), dtype)
        assert_close(rule.clipped_sum(module, a, g, factors), want_sum, dtype, "clipped_sum")
    unfolded = [rule.unfold(module, a, g) for a, g in calls]
    A = torch.cat([u[0] for u in unfolded], 1)
    G = torch.cat([u[1] for u in unfolded], 1)
    assert_close(rule.per_example_unfolded(module, A, G), grads, dtype, "per_example (unfolded)")
    for ghost in ghost_options:
        got = rule.norms_sq_unfolded(module, A, G, ghost)
        assert_norms_close(got, want_sq, ghost, gram_scale(rule, module, calls), dtype)
    got = rule.clipped_sum_unfolded(module, A, G, factors)
    assert_close(got, want_sum, dtype, "clipped_sum (unfolded)")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [1, 2, 3])
@FEW
@given(case=st.data())
def test_conv_matches_oracle(dtype, dim, case):
    case = case.draw(conv_cases(dim))
    conv = make_conv(case, dim, dtype)
    rule = find_rule(conv)
    assert isinstance(rule, ConvRule) and rule.check(conv) is None
    x = torch.randn(case["batch"], conv.in_channels, *case["spatial"], dtype=dtype)
    grads, calls = oracle_and_inputs(conv, [x], dtype)
    check_rule(rule, conv, grads, calls, dtype)


@pytest.mark.parametrize("dim", [1, 2])
@FEW
@given(case=st.data(), extra=st.integers(0, 3))
def test_conv_several_calls_concatenate_along_positions(dim, case, extra):
    """Two calls of one conv on inputs of different sizes: unfold, cat along L."""
    case = case.draw(conv_cases(dim))
    dtype = torch.float64
    conv = make_conv(case, dim, dtype)
    b = case["batch"]
    x1 = torch.randn(b, conv.in_channels, *case["spatial"], dtype=dtype)
    x2 = torch.randn(b, conv.in_channels, *[s + extra for s in case["spatial"]], dtype=dtype)
    grads, calls = oracle_and_inputs(conv, [x1, x2], dtype)
    check_rule(RULES[type(conv)], conv, grads, calls, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("frozen", ["weight", "bias"])
def test_conv_frozen_parameters_are_skipped(dtype, frozen):
    torch.manual_seed(1)
    conv = nn.Conv2d(4, 6, 3, padding=1, groups=2).to(dtype)
    getattr(conv, frozen).requires_grad_(False)
    x = torch.randn(3, 4, 5, 4, dtype=dtype)
    grads, calls = oracle_and_inputs(conv, [x], dtype)
    assert frozen not in grads
    check_rule(ConvRule(), conv, grads, calls, dtype)


@pytest.mark.parametrize("kind", ["asymmetric-same", "long"])
def test_conv_special_geometries(kind):
    """'same' with an even kernel (asymmetric zero padding) in every method, and more
    than 64 positions (the blocked Gram path of the ghost norm)."""
    torch.manual_seed(2)
    dtype = torch.float64
    if kind == "asymmetric-same":
        conv = nn.Conv2d(3, 4, (2, 4), padding="same", dilation=(1, 3)).to(dtype)
        x = torch.randn(3, 3, 5, 7, dtype=dtype)
    else:
        conv = nn.Conv1d(3, 5, 3, stride=1, padding=2, groups=1).to(dtype)
        x = torch.randn(2, 3, 69, dtype=dtype)
    grads, calls = oracle_and_inputs(conv, [x], dtype)
    check_rule(ConvRule(), conv, grads, calls, dtype)


def test_conv_ghost_is_cheaper_rule():
    """Per group, 2 L^2 < d_in_g d_out_g, as LinearRule."""
    rule = ConvRule()
    big = nn.Conv2d(64, 64, 3, padding=1)  # d_in_g = 576, d_out_g = 64
    small_l = torch.zeros(1, 64, 8, 8), torch.zeros(1, 64, 8, 8)  # L = 64: 8192 < 36864
    assert rule.ghost_is_cheaper(big, *small_l)
    large_l = torch.zeros(1, 64, 32, 32), torch.zeros(1, 64, 32, 32)  # L = 1024
    assert not rule.ghost_is_cheaper(big, *large_l)
    depthwise = nn.Conv2d(64, 64, 3, padding=1, groups=64)  # d_in_g = 9, d_out_g = 1
    assert not rule.ghost_is_cheaper(depthwise, torch.zeros(1, 64, 2, 2), torch.zeros(1, 64, 2, 2))
    for m, (a, g) in [(big, small_l), (big, large_l)]:
        assert rule.ghost_is_cheaper_unfolded(m, *rule.unfold(m, a, g)) == rule.ghost_is_cheaper(
            m, a, g
        )


def test_conv_check_reasons():
    rule = ConvRule()
    for mode in ["zeros", "reflect", "replicate", "circular"]:
        assert rule.check(nn.Conv2d(2, 2, 3, padding=1, padding_mode=mode)) is None
    odd = nn.Conv2d(2, 2, 3, padding=1)
    odd.padding_mode = "mirror"  # not a mode PyTorch's constructor accepts
    assert "padding_mode='mirror'" in rule.check(odd)
    assert "transposed" in rule.check(nn.ConvTranspose2d(2, 2, 3))
    assert GroupNormRule().check(nn.GroupNorm(2, 4)) is None


def test_conv_refuses_a_gradient_in_token_layout():
    """g reshaped to (B, T, -1) (an engine ignoring raw_layout) is refused, not misread."""
    conv = nn.Conv2d(4, 6, 3)
    rule = ConvRule()
    a = torch.randn(2, 4, 6, 6)
    g = torch.randn(2, 6, 4, 4)
    with pytest.raises(ValueError, match="raw_layout"):
        rule.per_example(conv, a, g.reshape(2, 4, -1))  # as engine: g.reshape(b, a.shape[1], -1)
    with pytest.raises(ValueError, match="raw_layout"):
        rule.clipped_sum(conv, a, g.flatten(2).transpose(1, 2), torch.ones(2))


@pytest.mark.parametrize("dtype", DTYPES)
@FEW
@given(
    groups=st.integers(1, 3),
    per_group=st.integers(1, 3),
    spatial=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    batch=st.sampled_from([0, 1, 3]),
    affine=st.sampled_from(["both", "no-bias", "no-weight"]),
    seed=st.integers(0, 2**16),
)
def test_group_norm_matches_oracle(dtype, groups, per_group, spatial, batch, affine, seed):
    torch.manual_seed(seed)
    c = groups * per_group
    if per_group * math.prod(spatial) == 1:
        spatial = [*spatial, 2]  # a group of one value normalises to 0
    gn = nn.GroupNorm(groups, c, eps=1e-5).to(dtype)
    with torch.no_grad():  # non-trivial affine parameters
        gn.weight.add_(torch.randn_like(gn.weight) * 0.3)
        gn.bias.normal_()
    if affine == "no-bias":
        gn.bias.requires_grad_(False)
    elif affine == "no-weight":
        gn.weight.requires_grad_(False)
    rule = find_rule(gn)
    assert isinstance(rule, GroupNormRule)
    x = torch.randn(batch, c, *spatial, dtype=dtype) * 2 + 0.5
    grads, calls = oracle_and_inputs(gn, [x], dtype)
    check_rule(rule, gn, grads, calls, dtype)
    # several calls concatenate along positions
    x2 = torch.randn(batch, c, *[s + 1 for s in spatial], dtype=dtype)
    grads, calls = oracle_and_inputs(gn, [x, x2], dtype)
    check_rule(rule, gn, grads, calls, dtype)


def test_empty_batch_gives_empty_norms_and_zero_sums():
    for module, x in [
        (nn.Conv2d(4, 6, 3, padding=1, padding_mode="reflect", groups=2), torch.randn(0, 4, 5, 5)),
        (nn.Conv1d(2, 3, 2, padding="same", padding_mode="circular"), torch.randn(0, 2, 5)),
        (nn.GroupNorm(2, 4), torch.randn(0, 4, 3)),
    ]:
        rule = find_rule(module)
        g = torch.zeros_like(module(x))
        for ghost in (False, True):
            for v in rule.norms_sq(module, x, g, ghost).values():
                assert v.shape == (0,)
        sums = rule.clipped_sum(module, x, g, torch.zeros(0))
        assert set(sums) == {"weight", "bias"}
        for name, v in sums.items():
            assert v.shape == getattr(module, name).shape and not v.any()


def test_registry_has_exact_types_only():
    assert isinstance(RULES[nn.Conv1d], ConvRule)
    assert isinstance(RULES[nn.Conv2d], ConvRule)
    assert isinstance(RULES[nn.Conv3d], ConvRule)
    assert isinstance(RULES[nn.GroupNorm], GroupNormRule)
    assert all(getattr(RULES[t], "raw_layout", False) for t in CONVS.values())

    class MyConv(nn.Conv2d):
        pass

    assert find_rule(MyConv(1, 1, 1)) is None


# -- through the engine ----------------------------------------------------------------


class SmallCNN(nn.Module):
    """Conv2d -> GroupNorm -> a second conv applied twice (one weight, two calls) -> head."""

    def __init__(self, c_in=3, classes=3):
        super().__init__()
        self.conv = nn.Conv2d(c_in, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.shared = nn.Conv2d(4, 4, 3, padding="same", padding_mode="reflect", groups=2)
        self.head = nn.Linear(4, classes)

    def forward(self, x):  # x (B, C, H, W)
        h = torch.relu(self.norm(self.conv(x)))
        h = self.shared(torch.tanh(self.shared(h)))
        return self.head(h.mean((2, 3)))


def _images(b, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, c, 5, 5, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("clipping", ["flat", "automatic", "per_layer"])
@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
def test_cnn_through_the_engine_matches_the_oracle(mode, clipping):
    if clipping == "per_layer" and mode == "ghost":
        pytest.skip("per-layer clipping needs book-keeping")
    torch.manual_seed(0)
    model = SmallCNN().double()
    x, y = _images(4), torch.tensor([0, 2, 1, 0])

    def losses_of(rows):
        return F.cross_entropy(model(x[rows]), y[rows], reduction="none")

    assert_engine_matches_oracle(model, losses_of, 4, mode=mode, clipping=clipping)


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
def test_cnn_keeps_one_record_within_c_when_channels_equal_the_chunk(mode):
    torch.manual_seed(0)
    model = SmallCNN(c_in=4).double()
    x = _images(4, c=4)  # B = C_in = 4
    y = torch.tensor([0, 2, 1, 0])
    outcome = sensitivity(
        model,
        lambda: F.cross_entropy(model(x), y, reduction="none"),
        1,
        max_grad_norm=0.1,
        mode=mode,
    )[0]
    assert outcome == PRIVATE


def test_conv_on_example_blocks_is_refused_by_name():
    class Blocks(nn.Module):  # two images per example stacked along dim 0
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(2, 2, 1)

        def forward(self, x):  # x (B, 2, 2, L) -> conv on (2B, 2, L)
            return self.conv(x.flatten(0, 1)).reshape(x.shape[0], -1).sum(1)

    model = Blocks()
    engine = ClippingEngine(model, 1.0)
    with pytest.raises(UnsupportedModelError, match=r"^module conv \(Conv1d\) was called on an"):
        engine.backward(model(torch.randn(3, 2, 2, 4)))
    engine.detach()
