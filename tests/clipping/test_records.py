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


class _SharedInput(nn.Module):
    """Three linear layers reading one float32 input, as q, k and v read a norm's output."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.q, self.k, self.v = nn.Linear(16, 8), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x):
        h = self.norm(x)
        return self.q(h).sum(-1) * self.k(h).sum(-1) + self.v(h).pow(2).sum(-1)


def test_linear_layers_under_autocast_share_the_recorded_copy_with_the_same_gradients():
    """Under autocast each linear layer would cast its float32 input itself, and its
    product would save that cast: three copies of one input for q, k and v, and the
    record a fourth. The engine hands them the shared copy it records instead: one copy
    is alive after the forward, and the losses and every gradient (the input's too: each
    layer's cast back to float32 on its own node, as autocast's) are bit for bit those of
    the model without the engine."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):  # the bf16 casts' storages still alive
        def __init__(self):
            super().__init__()
            self.alive: set[int] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16:
                storage = out.untyped_storage()
                self.alive.add(storage.data_ptr())
                weakref.finalize(storage, self.alive.discard, storage.data_ptr())
            return out

    import weakref

    torch.manual_seed(0)
    model = _SharedInput()
    x = torch.randn(5, 7, 16, requires_grad=True)
    got = {}
    for attached in (False, True):
        engine = ClippingEngine(model, 1.0) if attached else None
        with Copies() as mode, torch.autocast("cpu", dtype=torch.bfloat16):
            losses = model(x).sum(-1)
        alive = len(mode.alive)
        params = [x, *model.parameters()]
        grads = torch.autograd.grad(losses.sum(), params)
        got[attached] = (losses, grads, alive)
        if engine is not None:
            linear = [u for u in engine._uses.values() if isinstance(u.module, nn.Linear)]
            recorded = {c.a.data_ptr() for u in linear for c in u.calls}
            assert len(recorded) == 1  # q, k and v record the one copy
            engine.detach()
    assert torch.equal(got[True][0], got[False][0])
    for with_engine, without in zip(got[True][1], got[False][1], strict=True):
        assert torch.equal(with_engine, without)
    # alive after the forward: autocast's weight casts (one per layer, both runs) and the
    # input's copies: three without the engine, one with it
    assert got[False][2] - got[True][2] == 2
