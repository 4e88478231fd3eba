"""Modules without a written rule (replayed per example) and nn.MultiheadAttention.

Against the batch-size-1 oracle in both modes, with the sensitivity test, and
the refusals the exact check must produce where a replay cannot be exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.clipping import ClippingEngine, UnsupportedModelError
from dptrain.clipping.independence import UnsupportedInputsWarning
from dptrain.clipping.replay import MultiheadAttentionRule, ReplayRule
from tests.clipping.oracle_check import assert_engine_matches_oracle
from tests.clipping.sensitivity import PRIVATE, REFUSED, sensitivity

MODES = ["book_keeping", "ghost"]
CLIPPINGS = ["flat", "automatic", "per_layer"]
D, T = 4, 5


def _ids(b, t=T, vocab=11, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


class Patches(nn.Module):
    """ViT-style: a class token and a position table, raw parameters used by broadcasting,
    and a layer scale; owns a Linear that is called as a module (clipped by its own rule)."""

    def __init__(self, d=D, t=T):
        super().__init__()
        self.proj = nn.Linear(3, d)
        self.cls = nn.Parameter(torch.randn(1, 1, d))
        self.pos = nn.Parameter(torch.randn(1, t + 1, d))
        self.gamma = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):  # x (B, T, 3)
        h = self.proj(x)  # (B, T, d)
        h = torch.cat([self.cls.expand(x.shape[0], -1, -1), h], 1)  # (B, T + 1, d)
        return (h + self.pos) * self.gamma


class PatchClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = Patches()
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.embed(x)).mean(1))


def _features(b, seed=0):
    return torch.randn(b, T, 3, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _class_losses(model, x, y):
    return F.cross_entropy(model(x), y, reduction="none")


@pytest.mark.parametrize("clipping", CLIPPINGS)
@pytest.mark.parametrize("mode", MODES)
def test_raw_parameters_are_replayed_exactly(mode, clipping):
    if clipping == "per_layer" and mode == "ghost":
        pytest.skip("per-layer clipping needs book-keeping")
    torch.manual_seed(0)
    model = PatchClassifier().double()
    x, y = _features(4), torch.tensor([0, 1, 1, 0])
    assert_engine_matches_oracle(
        model, lambda rows: _class_losses(model, x[rows], y[rows]), 4, mode=mode, clipping=clipping
    )
    engine = ClippingEngine(model, 1.0)
    assert isinstance(engine._uses[model.embed].rule, ReplayRule)
    assert engine._uses[model.embed].rule.param_names == ("cls", "pos", "gamma")
    engine.detach()


class Attention(nn.Module):
    """Token embedding -> nn.MultiheadAttention -> per-token head."""

    def __init__(self, batch_first: bool, vocab=11, heads=2):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Embedding(vocab, D)
        self.attn = nn.MultiheadAttention(D, heads, batch_first=batch_first)
        self.head = nn.Linear(D, vocab)

    def forward(self, ids, key_padding_mask=None, attn_mask=None):
        h = self.emb(ids)  # (B, T, d)
        if not self.batch_first:
            h = h.transpose(0, 1)  # (T, B, d)
        out, _ = self.attn(h, h, h, key_padding_mask=key_padding_mask, attn_mask=attn_mask)
        if not self.batch_first:
            out = out.transpose(0, 1)
        return self.head(out)  # (B, T, vocab)


def _token_losses(logits, ids):
    return F.cross_entropy(logits.transpose(1, 2), ids, reduction="none").sum(1)


def _masks(kind, b):
    if kind == "none":
        return {}
    if kind == "padding":
        pad = torch.zeros(b, T, dtype=torch.bool)
        pad[1, -2:] = True
        return {"key_padding_mask": pad}
    if kind == "causal":
        return {"attn_mask": torch.triu(torch.ones(T, T, dtype=torch.bool), 1)}
    # per example and head: (B * heads, T, T) additive
    g = torch.Generator().manual_seed(1)
    return {"attn_mask": torch.randn(b * 2, T, T, generator=g, dtype=torch.float64)}


@pytest.mark.parametrize("masks", ["none", "padding", "causal", "per-example"])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mode", MODES)
def test_multihead_attention_matches_the_oracle(mode, batch_first, masks):
    torch.manual_seed(0)
    model = Attention(batch_first).double()
    b = 3
    ids, kw = _ids(b), _masks(masks, b)

    def losses_of(rows):
        sliced = {
            k: (v[rows] if k == "key_padding_mask" else v[rows.start * 2 : rows.stop * 2])
            if v.dim() == 3 or k == "key_padding_mask"
            else v
            for k, v in kw.items()
        }
        return _token_losses(model(ids[rows], **sliced), ids[rows])

    # (B * heads, T, T) masks are not split into examples: the independence check replaces
    # examples inside the chunk, which keeps every shape, so it needs no split either
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedInputsWarning)
        assert_engine_matches_oracle(model, losses_of, b, mode=mode)


def test_multihead_attention_rule_covers_its_output_projection():
    model = Attention(True)
    engine = ClippingEngine(model, 1.0)
    rule = engine._uses[model.attn].rule
    assert isinstance(rule, MultiheadAttentionRule)
    assert rule.param_names == (
        "in_proj_weight",
        "in_proj_bias",
        "out_proj.weight",
        "out_proj.bias",
    )
    assert model.attn.out_proj not in engine._uses  # used by attn's code, never called
    assert "attn.out_proj.weight" in engine.parameter_names
    engine.detach()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b", [3, T])  # time-first with T = B: the sizes coincide
def test_time_first_attention_keeps_one_record_within_c(mode, b):
    torch.manual_seed(0)
    model = Attention(batch_first=False).double()
    ids = _ids(b)
    outcome = sensitivity(
        model, lambda: _token_losses(model(ids), ids), 1, max_grad_norm=0.1, mode=mode
    )[0]
    assert outcome == PRIVATE


@pytest.mark.parametrize("mode", MODES)
def test_replayed_raw_parameters_keep_one_record_within_c(mode):
    torch.manual_seed(0)
    model = PatchClassifier().double()
    for b in (3, T + 1):  # T + 1 rows of the position table: a coincidence with B
        x, y = _features(b), torch.arange(b) % 2
        outcome = sensitivity(
            model, lambda x=x, y=y: _class_losses(model, x, y), 1, max_grad_norm=0.1, mode=mode
        )[0]
        assert outcome == PRIVATE


class CentredScale(nn.Module):
    """A raw parameter applied after centring over the batch: mixes the examples."""

    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(D))

    def forward(self, h):
        return (h - h.mean(0)) * self.gamma


class NoisyScale(nn.Module):
    """A raw parameter behind dropout: a replay draws another mask."""

    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(D))

    def forward(self, h):
        return F.dropout(h * self.gamma, 0.5, self.training)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("inner", "refusal"),
    [
        # the centred input of the next layer differs when an example runs alone: the
        # independence check names that layer before any gradient is formed
        (CentredScale, r"^module 1 \(Linear\): the input of its call 0 for example \d+ changed"),
        # dropout draws a new mask on replay: the completeness check names the parameter
        (NoisyScale, r"^parameter 0\.gamma: .* 0 \(NoisyScale\)"),
    ],
)
def test_a_module_the_replay_cannot_reproduce_is_refused_by_name(mode, inner, refusal):
    # First in the model, so no trainable layer before it sees mixed rows.
    torch.manual_seed(0)
    model = nn.Sequential(inner(), nn.Linear(D, 1)).double()
    x = torch.randn(4, D, dtype=torch.float64)
    engine = ClippingEngine(model, 1.0, mode=mode)
    with pytest.raises(UnsupportedModelError, match=refusal):
        engine.backward(model(x)[:, 0])
    engine.detach()
    assert sensitivity(model, lambda: model(x)[:, 0], 1, max_grad_norm=0.1, mode=mode)[0] == REFUSED


def test_mixing_between_trainable_layers_is_refused_at_the_next_one():
    # (the rows check would refuse module 0 too; the independence check runs first)
    model = nn.Sequential(nn.Linear(3, D), CentredScale(), nn.Linear(D, 1)).double()
    engine = ClippingEngine(model, 1.0)
    with pytest.raises(UnsupportedModelError, match=r"^module 2 \(Linear\): the input of its"):
        engine.backward(model(torch.randn(4, 3, dtype=torch.float64))[:, 0])
    engine.detach()


def test_a_module_returning_a_tuple_is_refused_with_the_reason():
    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(D))

        def forward(self, h):
            return h * self.w, h

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.pair = Pair()

        def forward(self, h):
            return self.pair(h)[0].sum(1)

    model = Model()
    engine = ClippingEngine(model, 1.0)
    with pytest.raises(UnsupportedModelError, match=r"pair\.w \(Pair, in MulBackward0; .*tuple"):
        engine.backward(model(torch.randn(3, D)))
    engine.detach()
