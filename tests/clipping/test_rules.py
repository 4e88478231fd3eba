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
        "whole",  # a device that forms whole Grams at any length (CUDA: fewer launches)
    ],
)
def test_ghost_norm_gram_blocks_give_the_whole_gram_inner_product(layout, monkeypatch):
    from dptrain.clipping import rules
    from dptrain.clipping.rules import gram_cache, gram_inner

    products = []
    real_bmm = rules.bmm_f32
    monkeypatch.setattr(rules, "bmm_f32", lambda x, y: products.append(1) or real_bmm(x, y))
    if layout == "whole":
        monkeypatch.setattr(rules, "HALF_GRAM_DEVICES", set())
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
    # products per operand: one whole Gram, two for the joint halves, else three
    per_operand = {"short": 1, "whole": 1, "odd": 3, "strided": 3}.get(layout, 2)
    assert len(products) == 2 * per_operand
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


def _registered_rmsnorms():
    """(class, rule) for every RMSNorm type registered by name whose package imports."""
    import importlib

    from dptrain.clipping.rules import RULES_BY_NAME, RMSNormRule

    out = []
    for name, rule in RULES_BY_NAME.items():
        if not isinstance(rule, RMSNormRule):
            continue
        module_name, cls = name.rsplit(".", 1)
        try:
            out.append(
                pytest.param(getattr(importlib.import_module(module_name), cls), rule, id=cls)
            )
        except (ImportError, AttributeError):
            continue
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("norm_cls", "rule"), _registered_rmsnorms())
def test_rmsnorm_rule_normalises_as_the_module_does(norm_cls, rule, dtype):
    # The rule repeats each family's operations for n(x) instead of calling its forward:
    # bit for bit the module's output under the neutral weight (ones; Gemma's zeros),
    # once cast to the module's output dtype, in float32, float64 and bf16 models. eps
    # 0.25 makes reading the wrong attribute show; every registered family is here.
    pytest.importorskip("transformers")
    norm = norm_cls(6, eps=0.25).to(dtype)
    with torch.no_grad():
        norm.weight.fill_(1.0 - rule.offset)
    assert rule.check(norm) is None
    x = (torch.randn(3, 4, 6, dtype=torch.float64) * torch.tensor([1e-3, 1, 30])[:, None, None]).to(
        dtype
    )
    with torch.no_grad():
        want = norm(x)
    got = rule.normalised(norm, x)
    assert got.dtype in (torch.float32, torch.float64)
    assert torch.equal(got.to(want.dtype), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize(("norm_cls", "rule"), _registered_rmsnorms())
def test_rmsnorm_saved_operand_is_what_autograd_multiplies_by(norm_cls, rule, dtype):
    # The streamed path reads n(x) from the output's node (saved_operand) instead of
    # normalising again. Where the family's last product is weight * n(x) the node's
    # saved operand gives each example's gradient as autograd forms it, a batch-size-1
    # backward per example; elsewhere (Gemma's (1 + w)) there is none and the record is
    # used. Under autocast too (the norm is computed in float32, the mul is not cast).
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    norm = norm_cls(6, eps=0.25).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(6))
    x = torch.randn(3, 4, 6, dtype=dtype)
    y = norm(x)
    saved = rule.saved_operand(norm, y.grad_fn)
    if rule.offset:  # (1 + w) * n(x): no product with the weight itself
        assert saved is None
        return
    assert saved is not None and saved.shape == y.shape
    g = torch.randn(y.shape, dtype=dtype)
    got = rule.per_example_from_saved(norm, saved, g, {})["weight"]
    for i in range(3):  # the oracle: example i's gradient alone, from autograd
        (want,) = torch.autograd.grad(norm(x[i : i + 1]), norm.weight, g[i : i + 1])
        # autograd sums the (1, T, d) products in the parameter's dtype; the rule in float32
        tol = {torch.bfloat16: 2e-2, torch.float32: 1e-6, torch.float64: 1e-12}[dtype]
        torch.testing.assert_close(got[i].to(dtype), want, rtol=tol, atol=tol)
    # the same gradients as from the record, within the rounding of n(x) to the model's dtype
    ref = rule.per_example(norm, x, g)["weight"]
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-6, torch.float64: 1e-6}[dtype]
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    # a graph without the weight's own product: no operand
    assert rule.saved_operand(norm, (y * 2).grad_fn) is None
    assert rule.saved_operand(norm, (x.requires_grad_() * norm.weight).grad_fn) is None


def test_rmsnorm_rule_refuses_a_replaced_forward():
    # the rule repeats the family's shipped forward; a patched one (on the class or the
    # instance) is refused with the patch's name, and a fully_shard unit (a subclass
    # without a forward of its own) is not
    transformers = pytest.importorskip("transformers")
    from dptrain.clipping.rules import find_rule

    llama = transformers.models.llama.modeling_llama
    norm = llama.LlamaRMSNorm(4)
    rule = find_rule(norm)
    assert rule.check(norm) is None
    unit = type("FSDPLlamaRMSNorm", (llama.LlamaRMSNorm,), {})(4)
    assert rule.check(unit) is None

    def fused(self, x):
        return x

    norm.forward = fused.__get__(norm)
    assert "replaced by" in rule.check(norm) and "fused" in rule.check(norm)
    del norm.forward
    try:
        llama.LlamaRMSNorm.forward, shipped = fused, llama.LlamaRMSNorm.forward
        assert "fused" in rule.check(norm)
    finally:
        llama.LlamaRMSNorm.forward = shipped
    assert rule.check(norm) is None


def test_rmsnorm_rule_refuses_a_module_without_its_eps_attribute():
    from dptrain.clipping.rules import RMSNormRule

    class Norm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(4))
            self.epsilon = 1e-6

        def forward(self, x):
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.epsilon)

    reason = RMSNormRule().check(Norm())
    assert "'variance_epsilon'" in reason and "None" in reason
    assert RMSNormRule(eps_attr="epsilon").check(Norm()) is None
    with pytest.raises(ValueError, match="eps_attr='not an attribute'"):
        RMSNormRule(eps_attr="not an attribute")


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rules_form_per_example_gradients_in_the_slot_they_are_given(transposed, dtype):
    # per_example_into writes a streamed module's gradients into its slot of the shared
    # buffer (examples a row apart: any stride between them), saving a copy per slot;
    # the values are per_example's. A slot of another dtype or shape is not written.
    from dptrain.clipping.rules import Conv1DRule, LinearRule, RMSNormRule

    gen = torch.Generator().manual_seed(0)
    b, t, d_in, d_out = 3, 5, 4, 6
    lin = nn.Linear(d_in, d_out)
    rule = Conv1DRule() if transposed else LinearRule()
    if transposed:
        lin.weight = nn.Parameter(lin.weight.detach().T.contiguous())
    a = torch.randn(b, t, d_in, generator=gen).to(dtype)
    g = torch.randn(b, t, d_out, generator=gen).to(dtype)
    shape = tuple(lin.weight.shape)
    buffer = torch.zeros(b, 100)
    out = {
        "weight": buffer[:, 10 : 10 + d_in * d_out].view(b, *shape),
        "bias": buffer[:, 50 : 50 + d_out],
    }
    got = rule.per_example_into(lin, a, g, out)
    want = rule.per_example(lin, a, g)
    for name in ("weight", "bias"):
        assert got[name] is out[name]
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6)
    assert buffer[:, :10].count_nonzero() == 0 and buffer[:, 80:].count_nonzero() == 0
    # not written where it does not fit
    wrong = {
        "weight": torch.zeros(b, *shape, dtype=torch.float64),
        "bias": torch.zeros(b, d_out + 1),
    }
    got = rule.per_example_into(lin, a, g, wrong)
    assert got["weight"] is not wrong["weight"] and got["bias"] is not wrong["bias"]
    assert wrong["weight"].count_nonzero() == 0 and wrong["bias"].count_nonzero() == 0

    transformers = pytest.importorskip("transformers")
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(d_out).to(dtype)
    slot = {"weight": buffer[:, 90:96]}
    got = RMSNormRule().per_example_into(norm, g, a[..., :1].expand(b, t, d_out), slot)
    assert got["weight"] is slot["weight"]
    torch.testing.assert_close(
        got["weight"], RMSNormRule().per_example(norm, g, a[..., :1].expand(b, t, d_out))["weight"]
    )


# -- ghost norm or instantiation (norm_method="auto") -------------------------------------------


def _chooses_ghost(p: int, d: int, t: int, bias: bool = False) -> bool:
    from dptrain.clipping.rules import LinearRule

    lin = nn.Linear(p, d, bias=bias, device="meta")
    return LinearRule().ghost_is_cheaper(lin, torch.empty(2, t, p), torch.empty(2, t, d))


@pytest.mark.parametrize(
    ("p", "d", "t", "on_cpu", "on_cuda"),
    [
        (576, 1536, 512, True, False),  # 135M MLP: 2 T^2 < p d <= T (p + d)
        (576, 576, 512, False, False),  # 135M q: 2 T^2 >= p d, instantiated by both
        (576, 1536, 128, True, True),  # T 128: the gradient is the larger
        (2048, 2048, 512, True, True),  # 1B q
        (2048, 512, 512, True, False),  # 1B k: instantiated on CUDA (docs/engine.md)
        (64, 192, 50, True, False),  # DPFormer's fused qkv
    ],
)
def test_auto_choice_per_device(p, d, t, on_cpu, on_cuda, monkeypatch):
    """CUDA instantiates wherever the gradient is no larger than the record; elsewhere
    Li et al.'s memory rule 2 T^2 < p d (rules.SIZE_RULE_DEVICES), read from the weight's
    device."""
    from dptrain.clipping import rules

    assert _chooses_ghost(p, d, t) is on_cpu  # a meta weight: not a size-rule device
    monkeypatch.setattr(rules, "SIZE_RULE_DEVICES", {"meta"})
    assert _chooses_ghost(p, d, t) is on_cuda


@given(
    p=st.integers(1, 4096),
    d=st.integers(1, 4096),
    t=st.integers(1, 2048),
    bias=st.booleans(),
)
def test_the_size_rule_instantiates_wherever_the_memory_rule_does(p, d, t, bias):
    """The docstring's argument: p d > T (p + d) implies p d > 4 T^2, so the size rule
    ghost-norms only layers the memory rule ghost-norms too (a bias's d entries aside,
    which can only tip a tie towards the ghost norm where the record is the smaller)."""
    from dptrain.clipping import rules

    rules.SIZE_RULE_DEVICES.add("meta")
    try:
        ghost_by_size = _chooses_ghost(p, d, t, bias)
    finally:
        rules.SIZE_RULE_DEVICES.discard("meta")
    ghost_by_memory = 2 * t * t < p * d
    if ghost_by_size and not bias:
        assert ghost_by_memory
    assert ghost_by_size == (p * d + (d if bias else 0) > t * (p + d))
