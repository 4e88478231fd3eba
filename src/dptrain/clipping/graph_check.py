"""Every gradient path into a clipped parameter must pass through a recorded module call.

The engine gets each example's gradient from what a module's forward records
(its inputs and where its output enters the autograd graph). If a clipped
parameter also enters the computation elsewhere (``y = x + self.fc.bias`` in a
parent's forward, a tied head written in the loss code, a penalty on the
weights added to the per-example losses), the gradient through that use never
reaches a recorded output: book-keeping would drop it and a second backward
(ghost mode) would add it unclipped. Neither is acceptable.

This is checked on the autograd graph of the losses themselves, so it covers
the model's forward, the loss code and anything else up to the point where the
clipped sum is formed, at the cost of one walk over the graph (no backward):

- the *interior* of a recorded call is the set of graph nodes reachable from
  its output node without passing through one of its inputs' nodes: the
  operations the module's own forward performed;
- a parameter's uses are the nodes whose next functions include its
  ``AccumulateGrad`` node; each use must lie in the interior of a call of a
  module that owns the parameter.

The walk also refuses reentrant activation checkpointing
(``torch.utils.checkpoint(..., use_reentrant=True)``): its recomputation runs a
nested backward that accumulates unclipped gradients into ``p.grad`` and hides
the parameters from this graph.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor
from torch._C import _FunctionBase as _PYTHON_NODE  # a custom autograd.Function's node
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = [
    "REENTRANT_CHECKPOINT_NODE",
    "SELECTIONS",
    "grad_node",
    "interior",
    "output_edge",
    "parameter_uses",
]

#: The autograd node of ``torch.utils.checkpoint.CheckpointFunction`` (reentrant mode).
REENTRANT_CHECKPOINT_NODE = "CheckpointFunctionBackward"

#: Autograd nodes of operations that pick or place rows by index values, which may
#: depend on the data (a boolean mask of labels, computed positions, routing): which
#: rows of their input reach which rows of their output may change from chunk to chunk.
SELECTIONS = frozenset(
    {
        "IndexBackward0",
        "UnsafeIndexBackward0",
        "IndexSelectBackward0",
        "GatherBackward0",
        "MaskedSelectBackward0",
        "TakeBackward0",
        "IndexAddBackward0",
        "IndexPutBackward0",
        "UnsafeIndexPutBackward0",
        "IndexCopyBackward0",
        "IndexFillBackward0",
        "ScatterBackward0",
        "ScatterBackward1",
        "ScatterAddBackward0",
        "ScatterReduceBackward0",
        "MaskedScatterBackward0",
        "PutBackward0",
        "SortBackward0",
        "TopkBackward0",
    }
)


def interior(
    output_node, stop_nodes: Iterable, into: dict[int, object] | None = None
) -> dict[int, object]:
    """The graph nodes from ``output_node`` down to (excluding) ``stop_nodes``, by id.

    ``stop_nodes`` are the nodes of the call's tensor inputs; leaves (the
    ``AccumulateGrad`` nodes of parameters) end the walk as well. The nodes are
    held in the returned dict: an id names a node only while its Python wrapper
    is alive (see :func:`parameter_uses`). ``into``: a dict to add them to (the
    interiors of several calls of one module), returned.
    """
    seen: dict[int, object] = {} if into is None else into
    if output_node is None:
        return seen
    stop = {id(n): n for n in stop_nodes if n is not None}  # held: their ids stay theirs
    # a node reached from another call's walk into the same ``into`` is walked again:
    # that call's stops may have cut it short of this one's
    mine: set[int] = set()
    stack = [output_node]
    pop, push = stack.pop, stack.append
    while stack:
        node = pop()
        k = id(node)
        if k in mine or k in stop:
            continue
        mine.add(k)
        seen[k] = node
        for nxt, _ in node.next_functions:
            if nxt is not None and id(nxt) not in mine and not hasattr(nxt, "variable"):
                push(nxt)
    return seen


def parameter_uses(
    roots: Iterable, watched: set[int]
) -> tuple[dict[int, list], list[str], dict[int, object], list]:
    """Walk the graph below ``roots``.

    Returns ({parameter id: [nodes that use it]} for the parameters in
    ``watched``, [names of reentrant-checkpoint nodes found], {id: node} of all
    nodes seen, the ``AccumulateGrad`` nodes of the other leaves that need a gradient).

    Nodes are kept by id *and* held: some PyTorch versions (2.11, not 2.13) free a
    node's Python wrapper when the last reference to it goes and hand out a new
    one on the next access, so an id kept without its wrapper can be reused by
    another node's wrapper; a walk that kept ids alone skipped most of the graph.
    """
    uses: dict[int, list] = {}
    reentrant: list[str] = []
    seen: dict[int, object] = {}
    others: dict[int, object] = {}
    stack = [r for r in roots if r is not None]
    pop, push = stack.pop, stack.append  # the walk visits every node of the step's graph
    while stack:
        node = pop()
        k = id(node)
        if k in seen:
            continue
        seen[k] = node
        if type(node).__name__ == REENTRANT_CHECKPOINT_NODE:
            reentrant.append(REENTRANT_CHECKPOINT_NODE)
        for nxt, _ in node.next_functions:
            if nxt is None or id(nxt) in seen:
                continue
            variable = getattr(nxt, "variable", None)
            if variable is None:
                push(nxt)
            elif id(variable) in watched:  # AccumulateGrad: a leaf tensor
                uses.setdefault(id(variable), []).append(node)
            else:
                others[id(nxt)] = nxt
    return uses, reentrant, seen, list(others.values())


def output_edge(t: Tensor) -> GradientEdge:
    """``get_gradient_edge(t)`` for a tensor that needs a gradient, without its Python
    work where ``t``'s node is one of autograd's own (it runs once per recorded call;
    a custom Function's node, or a leaf's accumulator, takes the general path)."""
    node = t.grad_fn
    if node is not None and not isinstance(node, _PYTHON_NODE):
        return GradientEdge(node, t.output_nr)
    return get_gradient_edge(t)


def grad_node(t: Tensor):
    """The node where ``t``'s gradient enters the graph (None if it needs none)."""
    if not t.requires_grad:
        return None
    return t.grad_fn if t.grad_fn is not None else get_gradient_edge(t).node
