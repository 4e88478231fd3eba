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


def test_interiors_gathered_into_one_dict_are_the_union_of_each_calls():
    # The first call's walk stops at h's node, below k's; the second call has no stop
    # there. Its walk must go on through k's node, which the first already put in the
    # dict, down to h's.
    x = torch.randn(3, requires_grad=True)
    h = x * 2
    k = h * 3
    first, second = k + 1, k.exp()
    one, two = interior(first.grad_fn, [h.grad_fn]), interior(second.grad_fn, [])
    assert h.grad_fn not in one.values() and h.grad_fn in two.values()
    both = interior(second.grad_fn, [], into=interior(first.grad_fn, [h.grad_fn]))
    assert set(both) == set(one) | set(two)


def test_output_edge_is_get_gradient_edge():
    from torch.autograd.graph import get_gradient_edge

    from dptrain.clipping.graph_check import output_edge

    class Twice(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    leaf = torch.randn(2, 3, requires_grad=True)
    a, b = (leaf * 3).unbind(0)  # autograd's own node, outputs 0 and 1
    custom = Twice.apply(leaf)  # a Python node: the general path (it keeps the graph alive)
    for t in (a, b, leaf, custom):
        got, want = output_edge(t), get_gradient_edge(t)
        assert got.node is want.node and got.output_nr == want.output_nr
    assert output_edge(b).output_nr == 1
