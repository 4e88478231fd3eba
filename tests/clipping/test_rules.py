"""Every layer rule, both clipping modes and both norm methods, against the oracle."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from tests.clipping.oracle_check import assert_engine_matches_oracle

MODES = ["book_keeping", "ghost"]
NORM_METHODS = ["ghost", "instantiate"]
DTYPES = [torch.float64, torch.float32]

shapes = st.fixed_dictionaries(
    {
        "batch": st.integers(0, 4),
        "tokens": st.integers(1, 5),
        "d_in": st.integers(1, 6),
        "d_out": st.integers(1, 6),
        "seed": st.integers(0, 2**16),
    }
)


class Head(nn.Module):
    """layer -> tanh -> fixed random readout: a nonlinear per-example loss."""

    def __init__(self, layer: nn.Module, d_out: int, seq: bool):
        super().__init__()
        self.layer = layer
        self.register_buffer("readout", torch.randn(d_out))
        self.seq = seq

    def forward(self, x):
        y = torch.tanh(self.layer(x)) @ self.readout
        return y.sum(1) if self.seq else y


def run(layer, inputs, d_out, seq, mode, norm_method, dtype, clipping="flat"):
    model = Head(layer, d_out, seq).to(dtype)
    if inputs.is_floating_point():
        inputs = inputs.to(dtype)

    def losses_of(sl):
        return model(inputs[sl]) ** 2

    assert_engine_matches_oracle(
        model,
        losses_of,
        inputs.shape[0],
        mode=mode,
        norm_method=norm_method,
        dtype=dtype,
        clipping=clipping,
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm_method", NORM_METHODS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@given(s=shapes)
def test_linear_on_sequences(mode, norm_method, dtype, bias, s):
    torch.manual_seed(s["seed"])
    layer = nn.Linear(s["d_in"], s["d_out"], bias=bias)
    x = torch.randn(s["batch"], s["tokens"], s["d_in"])
    run(layer, x, s["d_out"], True, mode, norm_method, dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@given(s=shapes)
def test_linear_on_vectors(mode, dtype, s):
    torch.manual_seed(s["seed"])
    layer = nn.Linear(s["d_in"], s["d_out"])
    x = torch.randn(s["batch"], s["d_in"])
    run(layer, x, s["d_out"], False, mode, "auto", dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("padding_idx", [None, 0])
@given(s=shapes, vocab=st.integers(2, 7))
def test_embedding(mode, dtype, padding_idx, s, vocab):
    torch.manual_seed(s["seed"])
    layer = nn.Embedding(vocab, s["d_out"], padding_idx=padding_idx)
    ids = torch.randint(0, vocab, (s["batch"], s["tokens"]))  # repeats and padding occur
    run(layer, ids, s["d_out"], True, mode, "auto", dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["layernorm", "layernorm-no-bias", "rmsnorm"])
@given(s=shapes)
def test_norm_layers(mode, dtype, kind, s):
    torch.manual_seed(s["seed"])
    d = s["d_in"] + 1  # a norm over one feature is constant
    if kind == "rmsnorm":
        layer = nn.RMSNorm(d, eps=1e-6)
    else:
        layer = nn.LayerNorm(d, bias=kind == "layernorm")
    with torch.no_grad():  # non-trivial affine parameters
        for p in layer.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(s["batch"], s["tokens"], d) * 2 + 0.5
    run(layer, x, d, True, mode, "auto", dtype)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm_method", NORM_METHODS)
@given(s=shapes)
def test_hf_conv1d(mode, norm_method, s):
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(s["seed"])
    layer = conv1d(s["d_out"], s["d_in"])  # Conv1D(nf=out, nx=in)
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(s["batch"], s["tokens"], s["d_in"])
    run(layer, x, s["d_out"], True, mode, norm_method, torch.float64)


def test_frozen_parameters_are_skipped():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    layer.bias.requires_grad_(False)
    x = torch.randn(5, 2, 4)
    run(layer, x, 3, True, "book_keeping", "auto", torch.float64)
    assert layer.bias.grad is None


@pytest.mark.parametrize("tokens", [64, 71])  # the blocked Gram path, even and odd splits
@pytest.mark.parametrize("mode", MODES)
def test_linear_long_sequences_use_blocked_gram(tokens, mode):
    torch.manual_seed(tokens)
    layer = nn.Linear(5, 4)
    x = torch.randn(3, tokens, 5)
    run(layer, x, 4, True, mode, "ghost", torch.float64)


def _gram_inner_reference(x, y):
    x, y = x.double(), y.double()
    return ((x @ x.transpose(1, 2)) * (y @ y.transpose(1, 2))).sum((1, 2))


@pytest.mark.parametrize(
    "layout",
    [
        "short",  # below the blocked size: one Gram matrix
        "even",  # both diagonal blocks from one batched product on the (2B, T/2, d) view
        "odd",  # halves of different lengths: three products
        "strided",  # (B, T, d) that is no (2B, T/2, d) view: three products
        "bf16",  # float32 products of bf16 records (tensor_cores.py)
    ],
)
def test_ghost_norm_gram_blocks_give_the_whole_gram_inner_product(layout):
    from dptrain.clipping.rules import gram_cache, gram_inner

    gen = torch.Generator().manual_seed(0)
    t = {"short": 10, "odd": 71}.get(layout, 64)
    x = torch.randn(3, t, 5, generator=gen)
    y = torch.randn(3, t, 4, generator=gen)
    if layout == "strided":  # every other example of a larger batch
        x = torch.randn(6, t, 5, generator=gen)[::2]
        assert x.stride(0) != t * x.stride(1)
    if layout == "bf16":
        x, y = x.bfloat16(), y.bfloat16()
    want = _gram_inner_reference(x, y)
    tol = 1e-5 if layout == "bf16" else 1e-6
    torch.testing.assert_close(gram_inner(x, y).double(), want, rtol=tol, atol=0)
    with gram_cache():  # the cached blocks of x are the same blocks
        gram_inner(x, y)
        torch.testing.assert_close(gram_inner(x, y).double(), want, rtol=tol, atol=0)


def test_weighted_sum_is_sum_of_scaled_per_example_gradients_including_empty_batches():
    from dptrain.clipping.rules import weighted_sum

    gen = torch.Generator().manual_seed(0)
    grads = {"w": torch.randn(4, 3, 2, generator=gen), "b": torch.randn(4, generator=gen)}
    c = torch.rand(4, generator=gen)
    got = weighted_sum(grads, c)
    for k, v in grads.items():
        want = (v.double() * c.double().view(-1, *[1] * (v.dim() - 1))).sum(0)
        assert got[k].shape == v.shape[1:]
        torch.testing.assert_close(got[k].double(), want, rtol=1e-6, atol=1e-7)
    empty = weighted_sum({"w": torch.zeros(0, 3, 0)}, torch.zeros(0))["w"]
    assert empty.shape == (3, 0)


def test_a_module_fully_shard_made_a_unit_keeps_its_types_rule():
    # fully_shard swaps a module's class for FSDP<Type> (bases FSDPModule, <Type>; no
    # forward of its own): accelerate does so with the embedding, final norm and head
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    from dptrain.clipping.rules import RULES, find_rule

    sharded_type = type("FSDPEmbedding", (fsdp.FSDPModule, nn.Embedding), {})
    module = nn.Embedding(5, 3)
    module.__class__ = sharded_type
    assert find_rule(module) is RULES[nn.Embedding]

    # a subclass that brings its own forward is not the same computation: no rule
    class Scaled(fsdp.FSDPModule, nn.Embedding):
        def forward(self, x):
            return 2 * super().forward(x)

    module.__class__ = Scaled
    assert find_rule(module) is None


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_rmsnorm_neutral_forward_matches_functional_call_runs_no_hooks_and_restores(family):
    # The rule takes n(x) from the module's own forward with the neutral weight, swapped
    # into _parameters (functional_call's swap without its Python work): the same tensor
    # bit for bit, no hook of the module runs, and the weight is back even if forward raises.
    transformers = pytest.importorskip("transformers")
    from dptrain.clipping.rules import find_rule

    norm_cls = {
        "llama": transformers.models.llama.modeling_llama.LlamaRMSNorm,
        "gemma": transformers.models.gemma.modeling_gemma.GemmaRMSNorm,
    }[family]
    norm = norm_cls(6)
    with torch.no_grad():
        norm.weight.normal_()
    rule = find_rule(norm)
    x = torch.randn(3, 4, 6, dtype=torch.float64).to(torch.bfloat16)
    neutral = torch.full((6,), 1.0 - rule.offset, dtype=x.dtype)
    with torch.no_grad():
        want = torch.func.functional_call(norm, {"weight": neutral}, (x,)).to(x.dtype)
    calls = []
    norm.register_forward_hook(lambda *args: calls.append("hook"))
    weight = norm.weight
    got = rule._normalised(norm, x)
    assert torch.equal(got, want) and got.dtype == x.dtype
    assert calls == [] and norm.weight is weight

    def broken(_x):
        raise RuntimeError("forward failed")

    norm.forward = broken
    with pytest.raises(RuntimeError, match="forward failed"):
        rule._normalised(norm, x)
    assert norm.weight is weight


def test_rmsnorm_with_a_parametrized_weight_takes_the_general_path():
    # a weight computed on access is not in _parameters: functional_call handles it
    transformers = pytest.importorskip("transformers")
    from torch.nn.utils import parametrize

    from dptrain.clipping.rules import RMSNormRule

    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(5)

    class Doubled(nn.Module):
        def forward(self, w):
            return 2 * w

        def right_inverse(self, w):  # functional_call sets the weight through it
            return w / 2

    parametrize.register_parametrization(norm, "weight", Doubled())
    assert "weight" not in norm._parameters
    x = torch.randn(2, 3, 5)
    got = RMSNormRule()._normalised(norm, x)
    variance = x.pow(2).mean(-1, keepdim=True)
    torch.testing.assert_close(got, x * torch.rsqrt(variance + norm.variance_epsilon))
