"""ClippingEngine behaviour beyond the per-rule oracle checks: what it keeps alive
between the forward pass and its backward, and parameters frozen after it is built."""

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.clipping import (
    ClippingEngine,
    flat_factors,
    oracle_clipped_sum,
    oracle_norms,
    oracle_per_example_grads,
)


def test_module_outputs_are_not_kept_alive_until_the_backward():
    # Cross-entropy saves its log-softmax, not the logits: non-private training
    # frees the (B, T, vocab) logits once the loss is formed, and so must the engine.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 11))
    engine = ClippingEngine(model, 1.0)
    ids = torch.randint(0, 11, (3, 5))
    logits = model(ids)
    logits_ref = weakref.ref(logits)
    losses = F.cross_entropy(logits.transpose(1, 2), ids, reduction="none").sum(1)
    del logits
    gc.collect()
    assert logits_ref() is None, "the engine keeps the module output alive"

    stats = engine.backward(losses)

    # The gradients still reach the output layer through the graph.
    assert stats.norms.shape == (3,) and bool((stats.norms > 0).all())
    assert model[1].weight.grad is not None and model[1].weight.grad.abs().sum() > 0


def test_layers_frozen_after_the_engine_is_built_are_skipped():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    engine = ClippingEngine(model, 0.5)
    model[0].requires_grad_(False)
    x = torch.randn(5, 3, dtype=torch.float64)
    grads = oracle_per_example_grads(model, lambda i: model(x[i : i + 1]).pow(2).sum(), 5)
    norms = oracle_norms(grads)
    engine.clear()  # forget the oracle's forward passes

    stats = engine.backward(model(x).pow(2).sum(1))

    assert model[0].weight.grad is None and model[0].bias.grad is None
    assert torch.allclose(stats.norms, norms, rtol=1e-10, atol=0)
    want = oracle_clipped_sum(grads, flat_factors(norms, 0.5))
    assert torch.allclose(model[2].weight.grad, want["2.weight"], rtol=1e-10, atol=1e-12)
    assert torch.allclose(model[2].bias.grad, want["2.bias"], rtol=1e-10, atol=1e-12)


FROZEN = {
    "a weight, its bias trained": lambda m: m[2].weight,
    "a middle layer": lambda m: m[2],
    "the last layer's bias": lambda m: m[4].bias,
}


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
@pytest.mark.parametrize("frozen", list(FROZEN))
def test_parameters_frozen_between_steps_get_no_gradient_and_the_rest_match_the_oracle(
    mode, frozen
):
    """Freezing some parameters after the engine has run (gradual unfreezing in reverse,
    a layer frozen mid-training): the next backward, on the same b (no check) and on a
    new one (the self-check runs), gives them no gradient, clips the others as the
    oracle does over the trainable parameters, and one record moves their sum by at most
    C; a privacy unit spanning two chunks takes no gradient of them either. (A frozen
    parameter of a module with another trainable one made the norms, the ghost backward
    and add_to_unit fail before.)"""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)
    ).double()
    x = torch.randn(6, 3, dtype=torch.float64)
    engine = ClippingEngine(model, 0.5, mode=mode)
    engine.backward(model(x).pow(2).sum(1))  # the checked chunk, everything trainable
    model.zero_grad(set_to_none=True)
    FROZEN[frozen](model).requires_grad_(False)
    names = {n for n, p in model.named_parameters() if not p.requires_grad}
    for b in (6, 4):  # the layout seen (no check), then a new b (the self-check runs)
        grads = oracle_per_example_grads(model, lambda i: model(x[i : i + 1]).pow(2).sum(), b)
        norms = oracle_norms(grads)
        engine.clear()  # forget the oracle's forward passes
        stats = engine.backward(model(x[:b]).pow(2).sum(1))
        assert torch.allclose(stats.norms, norms, rtol=1e-10, atol=0)
        want = oracle_clipped_sum(grads, flat_factors(norms, 0.5))
        for n, p in model.named_parameters():
            if n in names:
                assert p.grad is None, n
            else:
                assert torch.allclose(p.grad, want[n], rtol=1e-10, atol=1e-12), n
        model.zero_grad(set_to_none=True)
    sums = []
    for lam in (0.0, 1.0, 1e3, 1e6):  # example 0's loss scaled
        scale = torch.ones(6, dtype=torch.float64)
        scale[0] = lam
        engine.backward(model(x).pow(2).sum(1) * scale)
        sums.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad]))
        model.zero_grad(set_to_none=True)
    worst = max(float((s - t).norm()) for s in sums for t in sums)
    assert worst <= 0.5 * (1 + 1e-9)
    # a privacy unit over two chunks: its summed gradient, without the frozen ones
    engine.add_to_unit(model(x[:3]).pow(2).sum(1))
    engine.add_to_unit(model(x[3:]).pow(2).sum(1))
    engine.close_unit()
    unit = torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])
    assert all(p.grad is None for n, p in model.named_parameters() if n in names)
    assert float(unit.norm()) <= 0.5 * (1 + 1e-9)
    engine.detach()
