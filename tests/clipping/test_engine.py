"""ClippingEngine behaviour beyond the per-rule oracle checks: what it keeps alive
between the forward pass and its backward, and parameters frozen after it is built."""

import gc
import weakref

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
