"""The graph walk behind the parameter-use check (dptrain.clipping.graph_check)."""

import torch

from dptrain.clipping.graph_check import interior, parameter_uses


def _chain(n: int):
    """y = ((w * x) + 1) * 2 ... : n nodes in a line above the use of ``w``."""
    w = torch.nn.Parameter(torch.randn(3))
    y = w * torch.randn(3)
    for i in range(n):
        y = y + 1 if i % 2 else y * 2
    return w, y.sum()


def test_walk_reaches_every_node_of_a_long_chain():
    # PyTorch 2.11 frees a node's Python wrapper once nothing references it and may
    # give its id to the next node's wrapper; a walk keeping ids alone then took most
    # nodes for seen ones and stopped after three (zero norms, no gradient, on 2.11).
    w, loss = _chain(60)
    uses, reentrant, seen, others = parameter_uses([loss.grad_fn], {id(w)})
    assert len(seen) == 62  # sum, 60 chain nodes, the use of w
    assert [type(n).__name__ for n in uses[id(w)]] == ["MulBackward0"]
    assert reentrant == []
    assert others == []  # no other leaf needs a gradient


def test_interior_holds_the_nodes_it_names():
    _, loss = _chain(40)
    inside = interior(loss.grad_fn, [])
    assert len(inside) == 42
    assert all(id(node) == key for key, node in inside.items())
