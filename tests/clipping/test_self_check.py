"""The self-check's own memory: what it compares is formed once and let go once compared."""

from __future__ import annotations

import math

import pytest
import torch

from dptrain.clipping import ClippingEngine, self_check
from dptrain.clipping.sums import NormsAndSums
from tests.clipping import hf_zoo


def _whole_gaps(mine, auto, allowed=None):
    """The comparison as one expression over whole tensors (the reference)."""
    ref = auto if auto is not None else mine
    mine = torch.zeros_like(ref) if mine is None else mine.to(ref.dtype)
    auto = torch.zeros_like(ref) if auto is None else auto
    if allowed is None:
        gap = (mine - auto).abs()
    else:
        gap = ((mine.float() - auto.float()).abs() - allowed.view_as(ref)).clamp_min(0)
    return float(gap.max()), float(auto.abs().max()), float(mine.abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_allowed", [False, True])
def test_gaps_in_slices_equal_the_whole_comparison(monkeypatch, dtype, with_allowed):
    monkeypatch.setattr(self_check, "_GAP_SLICE", 7)  # slices that do not divide the size
    gen = torch.Generator().manual_seed(0)
    auto = torch.randn(5, 9, generator=gen).to(dtype)
    mine = (auto.float() + 1e-3 * torch.randn(5, 9, generator=gen)).float()
    mine[3, 4] += 0.5  # one large gap, in a later slice
    allowed = 1e-3 * torch.rand(45, generator=gen) if with_allowed else None
    assert self_check._gaps(mine, auto, allowed) == _whole_gaps(mine, auto, allowed)
    assert self_check._gaps(None, auto) == _whole_gaps(None, auto)
    assert self_check._gaps(mine, None) == _whole_gaps(mine, None)


def test_gaps_in_slices_keep_a_nan_of_any_slice(monkeypatch):
    monkeypatch.setattr(self_check, "_GAP_SLICE", 4)
    auto = torch.ones(12)
    mine = torch.ones(12)
    mine[5] = math.nan  # second slice; the third has larger |mine| entries
    mine[9] = 3.0
    assert all(math.isnan(x) for x in self_check._gaps(mine, auto)[::2])


def test_the_checks_sums_are_let_go_once_compared(monkeypatch):
    """During the self-check's subset backwards, a rule's whole-module sum stays in the
    cache only until its parameters are compared: kept, they added up to a float32 copy
    of every gradient at the first step's peak."""
    left: list[list] = []
    original = NormsAndSums.weighted_sum

    def spy(self, name, records, c, cache, *formed):
        out = original(self, name, records, c, cache, *formed)
        left.append([k for k in cache if isinstance(k, tuple)])
        return out

    monkeypatch.setattr(NormsAndSums, "weighted_sum", spy)
    case = hf_zoo.llama(tied=True)
    model = case.model.float()
    # a bias in one layer: a module with two parameters keeps its sum until both are read
    proj = model.model.layers[0].mlp.down_proj
    proj.bias = torch.nn.Parameter(torch.zeros(proj.out_features))
    engine = ClippingEngine(model, max_grad_norm=1.0, mode="book_keeping")
    kwargs, labels = case.make_batch(4, 6, 0)
    engine.backward(case.losses(model(**kwargs), labels))
    assert engine.self_checks == 1
    assert len(left) > len(list(model.parameters()))  # every parameter, in every subset
    assert max(len(keys) for keys in left) <= 1  # at most the module read halfway
    assert any(len(keys) == 1 for keys in left)  # ... which the bias makes happen
    assert not left[-1]


def test_the_check_holds_each_output_gradient_only_until_its_parameters_are_compared(
    monkeypatch,
):
    """The check runs before the chunk's own backward, and each subset's backward lets a
    call's output gradient go once its module's parameters are compared: at any time it
    holds a few (the tied head's, from the first module reached to the last, and the
    module being compared), never one per recorded call beside the retained graph."""
    import weakref

    from dptrain.clipping import engine as engine_module

    seen: list = []
    alive_counts: list[int] = []
    original = engine_module._CheckView.records

    def spy(self, calls, grads, b):
        seen.extend(weakref.ref(g) for g in grads if g is not None)
        # distinct memory: the residual stream's gradient reaches several modules' outputs
        alive = {r().untyped_storage().data_ptr() for r in seen if r() is not None}
        alive_counts.append(len(alive))
        return original(self, calls, grads, b)

    monkeypatch.setattr(engine_module._CheckView, "records", spy)
    case = hf_zoo.llama(tied=True, num_hidden_layers=6)
    engine = ClippingEngine(case.model, max_grad_norm=1.0)
    kwargs, labels = case.make_batch(4, 6, 0)
    engine.backward(case.losses(case.model(**kwargs), labels))
    assert engine.self_checks == 1
    modules = len(engine._uses)
    assert modules >= 50
    assert len(seen) >= modules  # every module's gradient, in some subset
    assert max(alive_counts) <= 3  # whatever the depth
