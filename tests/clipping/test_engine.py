"""ClippingEngine behaviour beyond the oracle checks: what it keeps alive between
the forward pass and its backward."""

import gc
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from dptrain.clipping import ClippingEngine


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
