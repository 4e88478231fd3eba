"""Per-example gradients formed during the backward (streamed modules) against the oracle.

Where the engine instantiates a module's per-example gradients and they are smaller
than its record (LoRA's lora_A / lora_B with r << T, norm layers), it forms them in a
pre-hook on the module's output node as the output gradient g arrives and keeps
neither g nor, outside a checked chunk, the input a (docs/engine.md, "Per-example
gradients formed during the backward"). The first chunk of a layout pattern runs the
self-check, which looks at streamed modules on their per-example gradients; later
chunks take the streamed path alone. Both are tested here against the batch-size-1
oracle, and the memory claim itself: no output gradient of a streamed module is
alive once the backward has moved past it.

T = 16 makes 2 T^2 >= r d for every LoRA matrix of the tiny GPT-2 and Llama (c_fc:
4 x 128), so every one is instantiated, hence streamed.
"""

from __future__ import annotations

import gc
import re
import weakref

import pytest
import torch
from torch import Tensor, nn

pytest.importorskip("transformers")
pytest.importorskip("peft")

from dptrain.clipping import ClippingEngine, UnsupportedModelError
from dptrain.clipping.separation import separating_masks
from tests.clipping import hf_zoo
from tests.clipping.oracle_check import assert_engine_matches_oracle
from tests.clipping.sensitivity import PRIVATE, sensitivity
from tests.clipping.test_hf_families import MODES, B
from tests.clipping.test_peft import CLIPPINGS, _lora, _tolerance

pytestmark = [
    pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to True:UserWarning"),
    # peft 0.21 calls transformers' deprecated is_gradient_checkpointing
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
]

T_STREAM = 16
LORA = re.compile(r"\.lora_[AB]\.default$")


def _losses(case, seed: int = 0):
    return lambda rows: hf_zoo.per_example_losses(case, B, T_STREAM, seed, rows)


def _case(family: str) -> hf_zoo.ZooCase:
    """LoRA on GPT-2 or Llama; "llama-full": the whole tiny Llama trained (its RMSNorms
    stream beside ghost-normed projections, an embedding and a tied head)."""
    if family == "llama-full":
        return hf_zoo.llama()
    case = _lora(family.removesuffix("-checkpointed"))
    if family == "llama-checkpointed":
        case.model.activation_checkpointing_enable({"use_reentrant": False})
        case.model.enable_input_require_grads()
    return case


def _spy_on_slots(monkeypatch, method: str, record) -> None:
    """Call ``record(slots, *args)`` before every ``streaming.Slots.<method>`` call."""
    from dptrain.clipping import streaming

    real = getattr(streaming.Slots, method)

    def spy(self, *args):
        record(self, *args)
        return real(self, *args)

    monkeypatch.setattr(streaming.Slots, method, spy)


def _expected_streamed(family: str, engine: ClippingEngine) -> set[str]:
    names = {u.name for u in engine._uses.values()}
    if family == "llama-full":
        # the RMSNorms, and k/v (32 -> 16: 2 T^2 = d_in d_out, instantiated); q, o and the
        # MLP are ghost-normed and the embedding always is: their g is recorded as before
        return {n for n in names if n.endswith(("norm", "k_proj", "v_proj"))}
    return {n for n in names if LORA.search(n)}


def _check(case, family: str, engine: ClippingEngine, clipping: str = "flat") -> None:
    """``engine`` (as it is: checked chunks seen or not) against the oracle at T_STREAM."""
    tol = _tolerance("llama" if family.startswith("llama") else "gpt2", engine.mode)
    assert_engine_matches_oracle(
        case.model,
        _losses(case),
        B,
        mode=engine.mode,
        clipping=clipping,
        engine=engine,
        tol=tol,
        scale_floor=1e-4 if tol else None,
    )


@pytest.mark.parametrize(("clipping", "mode"), CLIPPINGS)
@pytest.mark.parametrize("family", ["gpt2", "llama", "llama-checkpointed", "llama-full"])
def test_streamed_chunk_after_the_self_check_matches_the_oracle(family, mode, clipping):
    case = _case(family)
    engine = ClippingEngine(case.model, 1.0, mode=mode, clipping=clipping)
    expected = _expected_streamed(family, engine)
    assert expected
    # the first chunk: a new layout pattern, so the self-check runs (on streamed modules too)
    engine.backward(_losses(case, seed=1)(slice(None)))
    assert engine.self_checks == 1
    assert set(engine.streamed) == expected
    case.model.zero_grad(set_to_none=True)
    # the second chunk, same shapes: no check, the streamed path alone
    _check(case, family, engine, clipping)
    assert engine.self_checks == 1
    assert set(engine.streamed) == expected
    engine.detach()


@pytest.mark.parametrize("family", ["gpt2", "llama-full"])
def test_streamed_gradients_formed_in_their_slots_match_the_oracle(family, monkeypatch):
    """As on CUDA (streaming.SLOT_DEVICES), every streamed module but the backward's first
    forms its per-example gradients in its slot of the shared buffer, with no copy; the
    engine still matches the oracle."""
    from dptrain.clipping import streaming

    monkeypatch.setattr(streaming, "SLOT_DEVICES", {"cpu", "cuda"})
    in_place = []
    _spy_on_slots(
        monkeypatch,
        "hold",
        lambda slots, use, grads: in_place.extend(
            v is slots.offered.get((use, k)) for k, v in grads.items()
        ),
    )
    case = _case(family)
    engine = ClippingEngine(case.model, 1.0, mode="book_keeping")
    engine.backward(_losses(case, seed=1)(slice(None)))  # the checked chunk
    case.model.zero_grad(set_to_none=True)
    in_place.clear()
    engine.backward(_losses(case, seed=2)(slice(None)))  # streamed alone
    # the first streamed module of the backward (one parameter: a norm's or a lora_B's
    # weight) allocates the buffer and is copied into it
    assert in_place.count(False) == 1 and in_place.count(True) >= 8
    case.model.zero_grad(set_to_none=True)
    _check(case, family, engine)
    engine.detach()


class _Tanhs(nn.Module):
    """Linear layers with biases between tanhs: at T 16, d 8, every one streams."""

    def __init__(self, layers: int = 3, d: int = 8):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x: Tensor) -> Tensor:  # (B, T, d) -> (B, T, d)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def test_a_streamed_parameter_frozen_between_steps_gets_no_slot_and_no_gradient(monkeypatch):
    """A bias frozen after two steps of a streamed layer: the next backward lays out no
    slot for it, gives it no gradient and matches the oracle over what still trains."""
    held = []
    _spy_on_slots(monkeypatch, "hold", lambda slots, use, grads: held.append(slots))
    torch.manual_seed(0)
    model = _Tanhs().double()
    x = torch.randn(B, T_STREAM, 8, dtype=torch.float64)

    def losses(rows: slice) -> Tensor:
        return model(x[rows]).pow(2).mean((1, 2))

    engine = ClippingEngine(model, 1.0, mode="book_keeping")
    for seed in range(2):  # the checked chunk, then the streamed path alone
        engine.backward(losses(slice(None)) * (1 + seed))
        model.zero_grad(set_to_none=True)
    assert set(engine.streamed) == {f"layers.{i}" for i in range(3)}
    model.layers[1].bias.requires_grad_(False)
    held.clear()
    engine.backward(losses(slice(None)))
    model.zero_grad(set_to_none=True)
    slots = {(u.name, name) for u, name in held[-1].slots}
    assert ("layers.1", "bias") not in slots and ("layers.1", "weight") in slots
    assert_engine_matches_oracle(model, losses, B, mode="book_keeping", engine=engine)
    assert model.layers[1].bias.grad is None
    engine.detach()


@pytest.mark.parametrize("family", ["gpt2", "llama-full"])
def test_slots_in_many_chunks_match_the_oracle_and_keep_one_record_within_c(family, monkeypatch):
    """One slot per chunk (``_CHUNK_BYTES`` 1): the buffers are allocated one by one as the
    backward reaches them, formed in place (as on CUDA) and summed one product each; the
    engine still matches the oracle, and one example moves the sum by at most C. With
    the layers CUDA would instantiate (rules.SIZE_RULE_DEVICES), the Llama's q and o stream
    too (32 x 32 = T (32 + 32) at T 16: a tie, instantiated and streamed)."""
    from dptrain.clipping import rules, streaming

    monkeypatch.setattr(streaming, "_CHUNK_BYTES", 1)
    monkeypatch.setattr(streaming, "_CHUNKS", 1 << 20)
    monkeypatch.setattr(streaming, "SLOT_DEVICES", {"cpu", "cuda"})
    monkeypatch.setattr(rules, "SIZE_RULE_DEVICES", {"cpu", "cuda"})
    allocated = []
    _spy_on_slots(monkeypatch, "_allocate", lambda slots, i, like: allocated.append(i))
    case = _case(family)
    engine = ClippingEngine(case.model, 1.0, mode="book_keeping")
    engine.backward(_losses(case, seed=1)(slice(None)))  # the checked chunk
    case.model.zero_grad(set_to_none=True)
    if family == "llama-full":
        assert {n.rsplit(".", 1)[-1] for n in engine.streamed} >= {"q_proj", "o_proj"}
    allocated.clear()
    engine.backward(_losses(case, seed=2)(slice(None)))
    assert len(allocated) == len(set(allocated)) > 8  # each chunk once, many chunks
    case.model.zero_grad(set_to_none=True)
    _check(case, family, engine)
    engine.detach()
    losses = _losses(case, seed=3)
    outcome, _ = sensitivity(
        case.model, lambda: losses(slice(None)), 1, max_grad_norm=0.01, slack=1e-9
    )
    assert outcome == PRIVATE


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_checked_chunk_with_streamed_modules_matches_the_oracle(family, mode):
    """The first chunk: streamed, and its self-check reads per-example gradients."""
    case = _case(family)
    engine = ClippingEngine(case.model, 1.0, mode=mode)
    _check(case, family, engine)
    assert engine.self_checks == 1
    assert set(engine.streamed) == _expected_streamed(family, engine)
    engine.detach()


def _module(model: nn.Module, pattern: str) -> nn.Module:
    names = [n for n, _ in model.named_modules() if re.search(pattern, n)]
    return model.get_submodule(names[0])


@pytest.mark.parametrize("norm_method", ["auto", "ghost"])
@pytest.mark.parametrize("checked", [True, False], ids=["checked-chunk", "later-chunk"])
@pytest.mark.parametrize("mode", MODES)
def test_streamed_output_gradient_is_not_held(mode, checked, norm_method):
    """The last layer's down_proj.lora_B gets its output gradient g (B, T, d) early in the
    backward; by the time the first layer's q_proj.lora_B gets its own (among the last),
    nothing may hold that g any more (a weak reference to it is dead), and the engine
    has let the recorded input go too, on a checked chunk as well (the check's subset
    backwards run first, each letting g go once its parameters are compared). norm_method="ghost"
    makes the LoRA matrices ghost-normed, hence recorded and held: there the weak
    reference stays alive, which shows the test would see a held g."""
    case = _lora("llama")
    model = case.model
    engine = ClippingEngine(model, 1.0, mode=mode, norm_method=norm_method)
    if not checked:
        engine.backward(_losses(case, seed=1)(slice(None)))
        model.zero_grad(set_to_none=True)
    late = _module(model, r"layers\.1\.mlp\.down_proj\.lora_B\.default$")
    early = _module(model, r"layers\.0\.self_attn\.q_proj\.lora_B\.default$")
    nodes = {}
    handles = [
        m.register_forward_hook(lambda m, _a, out: nodes.__setitem__(m, out.grad_fn))
        for m in (late, early)
    ]
    losses = _losses(case)(slice(None))
    for h in handles:
        h.remove()
    late_call = engine._uses[late].calls[0]
    refs: list[weakref.ref] = []
    seen: list[tuple[bool, bool]] = []

    def at_late(grad_outputs):
        refs.append(weakref.ref(grad_outputs[0]))

    def at_early(grad_outputs):  # in every backward: the check's subsets come first
        gc.collect()
        seen.append((refs[-1]() is None, late_call.a is None))

    nodes[late].register_prehook(at_late)
    nodes[early].register_prehook(at_early)
    engine.backward(losses)
    streams = norm_method == "auto"
    assert (engine._uses[late].name in engine.streamed) == streams
    # the engine's own backward: after the check's, one per subset, on a checked chunk
    own = len(separating_masks(B)) if checked else 0
    if checked:  # the check lets g go once late's parameters are compared, and keeps a
        assert all(g for g, _ in seen[:own]) and not any(a for _, a in seen[:own])
    g_dropped, a_dropped = seen[own]
    assert g_dropped == streams
    assert a_dropped == streams
    engine.detach()


class TimeFirst(nn.Module):
    """A LayerNorm and a linear head on time-first (T, B, d) inputs: with T = B the engine
    reads time steps as examples, and every row holds every example's data."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x):  # (T, B, d) -> (B,) losses
        return self.head(self.ln(x)).pow(2).sum((0, 2))


def test_streamed_module_whose_rows_mix_examples_is_refused():
    """The self-check's rows test on a streamed module (on its per-example gradients, g is
    not kept) refuses the time-first LayerNorm by name before any gradient is written."""
    torch.manual_seed(0)
    model = TimeFirst().double()
    engine = ClippingEngine(model, 1.0)
    losses = model(torch.randn(4, 4, 8, dtype=torch.float64))
    with pytest.raises(
        UnsupportedModelError,
        match=re.escape("module ln (LayerNorm): the rows of its input (4, 4, 8) / output")
        + ".*are not one per example",
    ):
        engine.backward(losses)
    assert "ln" in engine.streamed
    assert all(p.grad is None for p in model.parameters())
    engine.detach()


class TwoCalls(nn.Module):
    """One linear layer and one LayerNorm, each called twice per forward (on the tokens
    and on their reversal): streamed per call, summed per module."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.fc = nn.Linear(d, 2)
        self.ln = nn.LayerNorm(2)

    def forward(self, x):  # (B, T, d) -> (B,)
        y = self.ln(self.fc(x)) * self.ln(self.fc(x.flip(1)))
        return y.pow(2).sum((1, 2))


@pytest.mark.parametrize("mode", MODES)
def test_module_called_twice_is_streamed_per_call_and_matches_the_oracle(mode):
    torch.manual_seed(0)
    model = TwoCalls().double()
    x = torch.randn(3, 8, 4, dtype=torch.float64)
    engine = ClippingEngine(model, 1.0, mode=mode)
    engine.backward(model(torch.randn(3, 8, 4, dtype=torch.float64)))  # the checked chunk
    assert set(engine.streamed) == {"fc", "ln"}
    model.zero_grad(set_to_none=True)
    assert_engine_matches_oracle(model, lambda rows: model(x[rows]), 3, mode=mode, engine=engine)
    assert engine.self_checks == 1 and set(engine.streamed) == {"fc", "ln"}
    engine.detach()
    # and on a checked chunk (each call's per-example gradients are checked on their own)
    assert_engine_matches_oracle(model, lambda rows: model(x[rows]), 3, mode=mode)


#: privacy units (user-level DP): examples 0 and 2 are one unit, example 1 another
UNITS = torch.tensor([5, 2, 5])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["gpt2", "llama", "llama-full"])
def test_streamed_modules_with_privacy_units_match_the_oracle(family, mode):
    """units=: a streamed module's per-example gradients, formed during the backward, are
    summed over each unit's examples. With LoRA every clipped module streams, so per-example
    factors there would raise nothing: only the oracle (summed per unit) tells them apart."""
    case = _case(family)
    engine = ClippingEngine(case.model, 1.0, mode=mode)
    engine.backward(_losses(case, seed=1)(slice(None)), units=UNITS)  # the checked chunk
    case.model.zero_grad(set_to_none=True)
    tol = _tolerance("llama" if family.startswith("llama") else "gpt2", mode)
    assert_engine_matches_oracle(
        case.model,
        _losses(case),
        B,
        mode=mode,
        engine=engine,
        units=UNITS,
        tol=tol,
        scale_floor=1e-4 if tol else None,
    )
    assert engine.self_checks == 1
    assert set(engine.streamed) == _expected_streamed(family, engine)
    engine.detach()


@pytest.mark.parametrize("mode", MODES)
def test_one_unit_of_streamed_lora_moves_the_clipped_sum_by_at_most_c(mode):
    """The unit of examples 0 and 2 scaled by lambda up to 1e6 (both clipped): per-example
    clipping of the streamed LoRA gradients would move the sum by up to 2 C."""
    case = _lora("llama")
    kwargs, labels = case.make_batch(B, T_STREAM, 0)

    def losses():
        return case.losses(case.model(**kwargs), labels)

    slack = 1e-6 if _tolerance("llama", mode) else 1e-9
    for unit in (5, 2):
        outcome, _ = sensitivity(
            case.model, losses, unit, max_grad_norm=0.1, mode=mode, slack=slack, units=UNITS
        )
        assert outcome == PRIVATE


def _assert_sums_and_norms(slots, grads: dict, c: Tensor) -> None:
    """Each held parameter's weighted sum and squared norms against float64: float32
    accumulation of b products in any order, within b u of their magnitudes' sum (a
    relative bound on the sum itself fails where the products cancel); the squares do not
    cancel."""
    sums, norms = slots.weighted_sums(c), slots.squared_norms()
    for u, g in grads.items():
        for k, v in g.items():
            want = torch.einsum("b,b...->...", c.double(), v.double())
            scale = torch.einsum("b,b...->...", c.double(), v.double().abs())
            err = (sums[(u, k)].double() - want).abs()
            assert (err <= len(c) * 2**-24 * scale).all(), (u.name, k)
            want_sq = v.double().flatten(1).pow(2).sum(1)
            torch.testing.assert_close(norms[(u, k)].double(), want_sq, rtol=1e-6, atol=0)


@pytest.mark.parametrize("run", [1 << 22, 8])
def test_streamed_buffer_gives_each_parameters_weighted_sum_and_norms(run, monkeypatch):
    """Slots: one (b, total) buffer; its weighted sums (one product) and squared norms
    (one reduction per run of equal-sized slots; ``run`` 8: one slot per run) are each
    streamed parameter's own, and a slot replaced out of place is not read."""
    from dptrain.clipping import streaming
    from dptrain.clipping.records import Use
    from dptrain.clipping.rules import LinearRule, NormLayerRule
    from dptrain.clipping.streaming import Slots

    monkeypatch.setattr(streaming, "_NORM_RUN", run)
    b = 5
    lin, norm = nn.Linear(3, 4), nn.LayerNorm(4)
    uses = [Use("lin", lin, LinearRule()), Use("norm", norm, NormLayerRule())]
    slots = Slots(uses, b)
    # three slots of 4 entries (lin.bias, norm.weight, norm.bias) share a run unless
    # the run is capped
    assert len(slots.runs) == (2 if run > b * 12 else 4)
    gen = torch.Generator().manual_seed(0)
    grads = {
        uses[0]: {"weight": torch.randn(b, 4, 3, generator=gen), "bias": torch.randn(b, 4)},
        uses[1]: {"weight": torch.randn(b, 4, generator=gen), "bias": torch.randn(b, 4)},
    }
    held = {u: slots.hold(u, g) for u, g in grads.items()}
    for u, g in grads.items():
        for k, v in g.items():
            assert slots.holds(u, k, held[u][k]) and torch.equal(held[u][k], v)
    _assert_sums_and_norms(slots, grads, torch.rand(b, generator=gen))
    # a checked chunk replaces a module's gradients out of place: no longer the slot's
    assert not slots.holds(uses[0], "weight", held[uses[0]]["weight"] + 1)


@pytest.mark.parametrize("chunk_bytes", [1, 1 << 40])
def test_slot_buffers_are_allocated_as_the_backward_reaches_them(chunk_bytes, monkeypatch):
    """Slots in chunks (``chunk_bytes`` 1: one slot per buffer; 2^40: one buffer):
    laid out in the backward's order (the forward's last module first), each buffer
    allocated when its first slot is filled, so that the slots of modules the backward
    has not reached hold no memory; sums and norms are each parameter's own either way."""
    from dptrain.clipping import streaming
    from dptrain.clipping.records import Use
    from dptrain.clipping.rules import LinearRule
    from dptrain.clipping.streaming import Slots

    monkeypatch.setattr(streaming, "_CHUNK_BYTES", chunk_bytes)
    b = 3
    layers = [nn.Linear(4, 5), nn.Linear(5, 6), nn.Linear(6, 4)]
    uses = [Use(f"l{i}", m, LinearRule()) for i, m in enumerate(layers)]  # forward order
    slots = Slots(uses, b)
    gen = torch.Generator().manual_seed(0)
    grads = {
        u: {
            "weight": torch.randn(b, *u.module.weight.shape, generator=gen),
            "bias": torch.randn(b, u.module.bias.shape[0], generator=gen),
        }
        for u in uses
    }
    allocated = []
    for u in reversed(uses):  # as the backward reaches them
        slots.hold(u, grads[u])
        allocated.append(sum(buf is not None for buf in slots.buffers))
    assert allocated == ([2, 4, 6] if chunk_bytes == 1 else [1, 1, 1])
    if chunk_bytes == 1:  # the last module's weight makes the first buffer
        first = slots.buffers[0]
        assert first.shape == (b, 4 * 6)
        assert slots.blocks[(uses[2], "weight")].data_ptr() == first.data_ptr()
    _assert_sums_and_norms(slots, grads, torch.rand(b, generator=gen))


def test_chunks_split_a_large_store_and_keep_a_small_one_whole(monkeypatch):
    """At least _CHUNK_BYTES a buffer, at most _CHUNKS buffers per storage dtype."""
    from dptrain.clipping import streaming
    from dptrain.clipping.records import Use
    from dptrain.clipping.rules import LinearRule
    from dptrain.clipping.streaming import Slots

    uses = [Use(f"l{i}", nn.Linear(8, 8, bias=False), LinearRule()) for i in range(40)]
    monkeypatch.setattr(streaming, "_CHUNKS", 32)
    monkeypatch.setattr(streaming, "_CHUNK_BYTES", 1 << 20)  # 40 slots of 2 * 64 * 4 bytes
    assert len(Slots(uses, 2)._chunks) == 1
    monkeypatch.setattr(streaming, "_CHUNK_BYTES", 512)  # one slot each, but at most 32
    assert len(Slots(uses, 2)._chunks) == 20  # 2 slots per chunk of >= 40 * 512 / 32 bytes
    monkeypatch.setattr(streaming, "_CHUNKS", 64)
    assert len(Slots(uses, 2)._chunks) == 40
    bf16 = Slots(uses, 2, stored_as={u: torch.bfloat16 for u in uses[:20]})
    assert [d for d, _ in bf16._chunks] == [None] * 20 + [torch.bfloat16] * 10  # 256 B each


def test_a_bf16_store_rounds_once_and_sums_exact_products(monkeypatch):
    """Slots stored in bf16 (``stored_as``): a float32 gradient is held rounded to nearest;
    its norm is that of the stored values; its weighted sum is sum_i c'_i v_i of the
    stored values with c'_i the factor rounded down to 8 bits (exact products: float64
    agrees to float32 accumulation), the same in column blocks as whole; the float32
    slots beside it are unchanged."""
    from dptrain.clipping import streaming
    from dptrain.clipping.records import Use
    from dptrain.clipping.rules import LinearRule, NormLayerRule
    from dptrain.clipping.streaming import Slots
    from dptrain.clipping.tensor_cores import round_down_bf16

    b = 5
    lin, norm = nn.Linear(6, 7), nn.LayerNorm(7)
    uses = [Use("lin", lin, LinearRule()), Use("norm", norm, NormLayerRule())]
    gen = torch.Generator().manual_seed(0)
    grads = {
        uses[0]: {"weight": torch.randn(b, 7, 6, generator=gen), "bias": torch.randn(b, 7)},
        uses[1]: {"weight": torch.randn(b, 7, generator=gen), "bias": torch.randn(b, 7)},
    }
    c = torch.rand(b, generator=gen) * 3
    got = {}
    for run in (1 << 22, 8):  # whole, and one slot per run and column block
        monkeypatch.setattr(streaming, "_NORM_RUN", run)
        slots = Slots(uses, b, stored_as={uses[0]: torch.bfloat16})
        held = {u: slots.hold(u, g) for u, g in grads.items()}
        held_abs = {(u, k): v.double().abs() for u, g in held.items() for k, v in g.items()}
        assert [buf.dtype for buf in slots.buffers] == [torch.float32, torch.bfloat16]
        got[run] = (slots.weighted_sums(c), slots.squared_norms())
        for u, g in grads.items():
            for k, v in g.items():
                stored = held[u][k]
                assert slots.holds(u, k, stored)
                factor = c
                if u is uses[0]:
                    assert stored.dtype == torch.bfloat16 and torch.equal(stored, v.bfloat16())
                    factor = round_down_bf16(c)
                else:
                    assert torch.equal(stored, v)
                want = torch.einsum("b,b...->...", factor.double(), stored.double())
                # float32 accumulation of b exact products, in any order: within b u of
                # the sum of their magnitudes (a relative bound on the sum itself would
                # fail where the products cancel)
                scale = torch.einsum("b,b...->...", factor.double(), stored.double().abs())
                err = (got[run][0][(u, k)].double() - want).abs()
                assert (err <= b * 2**-24 * scale).all(), (u.name, k)
                want_sq = stored.double().flatten(1).pow(2).sum(1)
                torch.testing.assert_close(got[run][1][(u, k)].double(), want_sq, rtol=1e-6, atol=0)
                assert got[run][0][(u, k)].dtype == torch.float32
    for key, v in got[8][0].items():
        scale = torch.einsum("b,b...->...", c.double(), held_abs[key])
        assert ((v - got[1 << 22][0][key]).double().abs() <= 2 * b * 2**-24 * scale).all()


@pytest.mark.parametrize("b", [6, 64])
@pytest.mark.parametrize("slot_devices", [set(), {"cpu"}])
def test_bf16_streamed_linear_layers_are_kept_in_bf16_and_move_the_sum_by_at_most_c(
    b, slot_devices, monkeypatch
):
    """A Llama with bf16 weights: k and v stream (T 16) and are kept in bf16, the norms
    beside them in float32; formed in their slots (as on CUDA) or copied. One example
    still moves the clipped sum by at most C (its norm is that of the bf16 values summed),
    and the sums stay within bf16's rounding of the float32 store's."""
    from dptrain.clipping import rules, streaming

    monkeypatch.setattr(streaming, "SLOT_DEVICES", slot_devices)
    stores: list = []
    _spy_on_slots(
        monkeypatch, "_allocate", lambda slots, i, like: stores.append(slots._chunks[i][0])
    )
    case = hf_zoo.llama()
    case.model.bfloat16()
    kwargs, labels = case.make_batch(b, T_STREAM, 3)

    def losses():
        return case.losses(case.model(**kwargs), labels)

    outcome, worst = sensitivity(case.model, losses, 1, max_grad_norm=0.01, slack=1e-6)
    assert outcome == PRIVATE and worst > 0.99  # clipped: the bound is reached
    assert set(stores) == {torch.bfloat16, None}
    sums = {}
    for keeps in (True, False):
        monkeypatch.setattr(rules.LinearRule, "keeps_record_precision", keeps)
        engine = ClippingEngine(case.model, 0.01)
        case.model.zero_grad(set_to_none=True)
        engine.backward(losses())
        assert {n.rsplit(".", 1)[-1] for n in engine.streamed} >= {"k_proj", "v_proj"}
        sums[keeps] = {n: engine.clipped_sum(p).clone() for n, p in case.model.named_parameters()}
        engine.detach()
    # every sum moves a little (the norms, hence the factors, read the rounded values);
    # those of k and v by their per-example gradients' rounding
    for name, want in sums[False].items():
        err = float((sums[True][name] - want).norm() / want.norm())
        assert err < 2**-7, name
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            assert err > 0, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forms_a_bf16_slot_in_place():
    """On CUDA a linear layer's per-example gradients on a bf16 record are one bf16 bmm
    into their strided slot of the buffer (nothing else written), within bf16's rounding
    of the exact products' sums."""
    from dptrain.clipping.rules import LinearRule

    gen = torch.Generator().manual_seed(0)
    lin = nn.Linear(64, 32, bias=False).cuda().bfloat16()
    a = torch.randn(3, 50, 64, generator=gen).bfloat16()
    g = torch.randn(3, 50, 32, generator=gen).bfloat16()
    buffer = torch.zeros(3, 10 + 32 * 64, dtype=torch.bfloat16, device="cuda")
    slot = buffer[:, 10:].view(3, 32, 64)
    got = LinearRule().per_example_into(lin, a.cuda(), g.cuda(), {"weight": slot})
    assert got["weight"] is slot
    assert not buffer[:, :10].any()
    exact = torch.einsum("btp,btd->bpd", g.double(), a.double())
    scale = torch.einsum("btp,btd->bpd", g.double().abs(), a.double().abs())
    # one rounding to bf16 (2^-8 relative) after float32 accumulation (50 terms)
    assert ((slot.cpu().double() - exact).abs() <= 2**-8 * exact.abs() + 1e-4 * scale).all()
