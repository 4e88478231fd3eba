"""What a call records and how a backward's records are arranged (records.py)."""

import torch
from torch import nn

from dptrain.clipping import ClippingEngine
from dptrain.clipping.records import AutocastCopies, Use, example_rows
from dptrain.clipping.rules import LinearRule


def test_a_broadcast_output_gradient_is_materialised_for_the_products():
    use = Use("lin", nn.Linear(4, 3), LinearRule())
    a = torch.randn(2, 5, 4)
    g = torch.ones(()).expand(2, 5, 3)  # the backward of a sum over tokens
    _, rows = example_rows(use, a, g, 2)
    assert 0 not in rows.stride() and torch.equal(rows, torch.ones(2, 5, 3))


def test_autocast_copies_are_shared_by_the_modules_reading_one_input():
    copies = AutocastCopies()
    x = torch.randn(2, 3, 4)
    assert copies.of(x) is x  # autocast off: the input itself
    with torch.autocast("cpu", dtype=torch.bfloat16):
        first, second = copies.of(x), copies.of(x)
        assert first is second and first.dtype == torch.bfloat16
        assert torch.equal(first, x.to(torch.bfloat16))
        x.add_(1.0)  # a new version of the tensor is a new input
        assert copies.of(x) is not first


def test_linear_records_under_autocast_are_the_bf16_inputs_autocast_multiplied():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    engine = ClippingEngine(model, 1.0)
    x = torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x)
    recorded = [c.a for use in engine._uses.values() for c in use.calls]
    assert [a.dtype for a in recorded] == [torch.bfloat16, torch.bfloat16]
    assert torch.equal(recorded[0], x.to(torch.bfloat16))
    engine.detach()
