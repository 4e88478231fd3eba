"""dptrain._gc: the collector held off during the engine's backward, and restored."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

from dptrain._gc import collector_paused
from dptrain.clipping import ClippingEngine


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if not was:
        gc.disable()


def test_collector_paused_restores_the_callers_state(collector_on):
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"), collector_paused():
        raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()  # a caller that turned it off keeps it off
    with collector_paused():
        pass
    assert not gc.isenabled()


def test_no_automatic_collection_runs_inside_the_engines_backward(collector_on):
    # Thresholds low enough that the backward's allocations would start collections,
    # and a callback that records those that run inside it.
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    engine = ClippingEngine(model, 1.0)
    x = torch.randn(6, 4)
    inside = {"now": False, "collections": 0}

    def count(phase, info):
        if phase == "start" and inside["now"]:
            inside["collections"] += 1

    backward = engine._backward

    def marked(*args):
        inside["now"] = True
        try:
            return backward(*args)
        finally:
            inside["now"] = False

    engine._backward = marked
    thresholds = gc.get_threshold()
    gc.callbacks.append(count)
    gc.set_threshold(1, 1, 1)
    try:
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            engine.backward(model(x).pow(2).sum(1))
            assert gc.isenabled()
        gc.collect()  # an explicit collection after it still runs
    finally:
        gc.set_threshold(*thresholds)
        gc.callbacks.remove(count)
        engine.detach()
    assert inside["collections"] == 0
    assert all(p.grad is not None for p in model.parameters())
