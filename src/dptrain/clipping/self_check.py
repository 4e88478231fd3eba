"""The engine's exact self-check: rows that belong to one example, rules that add up.

The clipping engine reads example i's gradient from the rows of each recorded
call that its layout gives example i (see :mod:`dptrain.clipping.layout`). That
is right only if no other example's loss reaches those rows and the rules
reconstruct the whole gradient. Both are decided with one backward pass per
subset S_k of a family that separates every ordered pair of examples
(:mod:`dptrain.clipping.separation`: 2 subsets for 2 examples, 6 for 16, 8 for 64),
of the masked loss sum_{i in S_k} L_i:

1. **Rows.** The gradient of every recorded output must be exactly zero on the
   rows of every example outside S_k. Zero times a finite number is zero and a
   sum of zeros is zero in every precision and every order of summation, so the
   verdict does not depend on float32 or bf16, on TF32, or on the order in which
   a GPU kernel accumulates (an earlier form compared a re-weighted backward with
   the plain one within a tolerance, and refused correct Llama models under bf16
   autocast on an H100, where attention's backward accumulates in a different
   order on every run). Any amount of mixing is seen: a row that carries another
   example's loss (a shared table whose length equals the chunk size, a
   time-first tensor with T = B, an operation that mixes the examples, a loss with
   in-batch negatives, rows of selected tokens read with the wrong example) is
   nonzero for the subset that holds that example and not the row's.
2. **Completeness.** For every clipped parameter, the rules' masked sum
   sum_{i in S_k} grad_i (book-keeping from the recorded a and g) must equal
   autograd's gradient of the masked loss. This checks each rule's algebra on the
   module it was given (a registered rule for the wrong type, a generic rule on a
   module it cannot handle) and any gradient path the records miss. Rules and
   autograd sum in different orders, so this comparison has a tolerance by
   dtype; every example lies in some subset, so every row is in some sum.

The subsets depend on the chunk size alone: they carry no data and need no
privacy. Each subset costs one backward on the chunks where a layout pattern is
new, and the rows check alone (:func:`rows`) runs on every chunk for calls whose
rows depend on the data (docs/engine.md, "Deciding which rows are examples").

The check's memory is that of a non-private backward on the retained graph. It runs
before the chunk's own backward, so none of that backward's records exist yet. In
each subset's backward a call's output gradient is captured as it arrives, read when
its module's parameters have their gradients (autograd accumulates a parameter's
gradient after every output that carries it), and let go once every parameter of the
module is compared; autograd's parameter gradients are compared as they form and
dropped, and the rules' sums likewise (an earlier form ran after the chunk's backward
and held all its records, a float32 copy of every gradient and the retained graph at
once: 1.94x the non-private step's tensors at the first step of a 135M Llama, B 4,
T 512).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from dptrain.clipping.errors import UnsupportedModelError
from dptrain.clipping.heap import release_free_memory
from dptrain.clipping.precision import tolerance_dtypes
from dptrain.clipping.separation import separating_masks

if TYPE_CHECKING:  # pragma: no cover
    from dptrain.clipping.check_interface import Sums

__all__ = ["SUM_TOLERANCE", "frontier", "rows", "run"]

#: Relative tolerance of the completeness check: the rules and autograd sum in
#: different orders (and, under autocast, in different precisions). The rows check
#: has none: it asks for exact zeros.
SUM_TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.bfloat16: 5e-2,
    torch.float16: 5e-2,
}


def run(engine: Sums, losses: Tensor, calls, streamed) -> None:
    """Raise :class:`~dptrain.clipping.UnsupportedModelError` if the chunk fails the check.

    ``calls``: every recorded (use, call) the losses depend on; ``streamed``: the uses
    whose per-example gradients the chunk's backward forms as it goes (their sums are
    compared as formed from per-example gradients, as the step forms them). Runs before
    that backward: each subset's backward captures the output gradients it reaches and
    lets them go once their parameters are compared, so the check never holds a chunk's
    records (a gradient per recorded call) beside the graph it retains.
    """
    b = losses.shape[0]
    names = engine.parameters_of({id(u): u for u, _ in calls}.values())
    dtype = (
        torch.float64
        if any(engine.parameter(n).dtype == torch.float64 for n in names)
        else torch.float32
    )
    masks = separating_masks(b).to(losses.device)
    gaps, g_dtypes = [], set()
    for mask in masks:
        gaps.append(
            _subset_backward(
                engine, losses, calls, mask, names, retain=True, compare=(streamed, dtype, g_dtypes)
            )
        )
        # its gradients are freed; returned to the OS before the next pass (heap.py)
        release_free_memory()
    low = any(d in (torch.bfloat16, torch.float16) for d in g_dtypes)
    # float32 on a GPU with TF32 matrix products rounds as float16 does (precision.py)
    tol_dtype_of = tolerance_dtypes(engine.model)
    tol = (
        SUM_TOLERANCE[torch.bfloat16] if low else SUM_TOLERANCE[tol_dtype_of(dtype, losses.device)]
    )
    _check_sums(engine, names, gaps, tol, losses.device)


def rows(engine: Sums, losses: Tensor, calls, *, retain: bool) -> None:
    """The rows check alone, on ``calls`` (every chunk, for calls whose rows depend on
    the data): one backward per subset that runs only down to their modules."""
    b = losses.shape[0]
    names = engine.parameters_of({id(u): u for u, _ in calls}.values())
    masks = separating_masks(b).to(losses.device)
    for k, mask in enumerate(masks):
        _subset_backward(engine, losses, calls, mask, names, retain=retain or k < len(masks) - 1)


def frontier(losses: Tensor, nodes: list, structural: set[int]) -> list:
    """The rows check on the tensors that selection ``nodes`` select from; return the
    nodes whose selected tensor has no example rows (a row count not in ``structural``).

    One backward per subset that stops at those tensors (captured, not run through), so
    it costs what the graph above them costs: little, for selections near the loss.
    """
    b = losses.shape[0]
    edges, owner = [], []
    for node in nodes:
        for nxt, nr in node.next_functions:
            if nxt is not None and not hasattr(nxt, "variable"):
                edges.append(GradientEdge(nxt, nr))
                owner.append(node)
    if not edges:
        return []
    undecided: dict[int, object] = {}
    for mask in separating_masks(b).to(losses.device):
        got = torch.autograd.grad(
            (losses * mask.to(losses.dtype)).sum(), edges, retain_graph=True, allow_unused=True
        )
        for node, g in zip(owner, got, strict=True):
            if g is None or id(node) in undecided:
                continue
            if g.dim() == 0 or g.shape[0] not in structural:
                undecided[id(node)] = node
                continue
            found = _outside_rows(g, mask, b)
            if found is not None:
                i = found[0]
                members = [int(j) for j in mask.nonzero().flatten()]
                raise UnsupportedModelError(
                    f"the input {tuple(g.shape)} of a selection by index "
                    f"({type(node).__name__}) in the losses' graph: the rows of example {i} "
                    f"received gradient from the losses of examples {members} alone. On this "
                    "chunk the selection sends one example's loss to another example's rows "
                    "(per-example losses gathered from the wrong rows, or a pooling that "
                    "picks rows across examples), so clipping cannot bound one example's "
                    "influence. Select each example's rows from its own row of the batch."
                )
    return list(undecided.values())


def _subset_backward(
    engine: Sums, losses, calls, mask: Tensor, names, *, retain: bool, compare=None
) -> dict[str, tuple[float, float, float]]:
    """One backward of sum_{i in mask} L_i: the rows test on every call as its output
    gradient arrives; with ``compare`` = (streamed uses, dtype of the weights, a set
    that collects the output gradients' dtypes), also each parameter's rules' masked sum
    against autograd's, as (max |mine - auto|, max |auto|, max |mine|) by name.

    The output gradients are captured as they arrive and read when their parameters'
    gradients are complete (a parameter's gradient is accumulated after every output
    that carries it); a call's goes once every parameter of its module is compared."""
    b = losses.shape[0]
    edges = [call.edge for _, call in calls]
    by_node: dict[int, list[int]] = {}
    for k, edge in enumerate(edges):
        by_node.setdefault(id(edge.node), []).append(k)
    failures: list[tuple[int, int, float]] = []  # (call, example, relative size)
    captured: dict[int, Tensor] = {}  # call -> its output gradient, examples first

    def rows_hook(node):
        def hook(grad_outputs):
            for k in by_node[id(node)]:
                g, call = grad_outputs[edges[k].output_nr], calls[k][1]
                if g is not None and call.batch_dim:
                    g = g.movedim(call.batch_dim, 0)
                found = _outside_rows(g, mask, b)
                if found is not None:
                    failures.append((k, *found))
                if compare is not None and g is not None:
                    captured[k] = g
                    compare[2].add(g.dtype)

        return hook

    params = {id(engine.parameter(n)): n for n in names}
    seen: dict[str, tuple[float, float, float]] = {}
    sums: dict = {}
    if compare is not None:
        streamed, dtype, _ = compare
        weights = mask.to(dtype)
        owners = {n: {id(u) for u in engine.owners(n)} for n in names}
        calls_of: dict[int, list[int]] = {}  # module -> its calls
        for k, (u, _) in enumerate(calls):
            calls_of.setdefault(id(u), []).append(k)
        pending = dict.fromkeys(calls_of, 0)  # names left to compare, per module
        for n in names:
            for u in owners[n] & pending.keys():
                pending[u] += 1
    built: dict[int, dict] = {}  # a module's record, built once per subset (a replay is B
    # batch-size-1 backwards), until its parameters are compared

    def compared(name: str, auto: Tensor | None) -> None:
        records = {}
        for u in owners[name] & calls_of.keys():
            if u not in built:
                ks = calls_of[u]
                built[u] = engine.records([calls[k] for k in ks], [captured.get(k) for k in ks], b)
            records.update(built[u])
        mine = engine.weighted_sum(name, records, weights, sums, streamed)
        # autograd's own accumulation error is allowed only where autograd gave a gradient
        bound = None if auto is None else engine.accumulation_bound(name, records, weights)
        seen[name] = _gaps(mine, auto, bound)
        del records, mine, bound
        for u in owners[name] & pending.keys():  # compared in full: its record and g go
            pending[u] -= 1
            if pending[u] == 0:
                built.pop(u, None)
                for k in calls_of[u]:
                    captured.pop(k, None)

    def param_hook(p):
        if compare is not None:
            compared(params[id(p)], p.grad)
        p.grad = None  # autograd's gradient is not kept; the engine's is restored below

    if not names:  # nothing recorded reaches a clipped parameter
        return seen
    saved = {n: engine.parameter(n).grad for n in names}
    handles = [
        e.node.register_prehook(rows_hook(e.node)) for e in {id(e.node): e for e in edges}.values()
    ]
    handles += [engine.parameter(n).register_post_accumulate_grad_hook(param_hook) for n in names]
    try:
        for n in names:
            engine.parameter(n).grad = None
        torch.autograd.backward(
            (losses * mask.to(losses.dtype)).sum(),
            inputs=[engine.parameter(n) for n in names],
            retain_graph=retain,
        )
    finally:
        for h in handles:
            h.remove()
        for n, g in saved.items():
            engine.parameter(n).grad = g
    if failures:
        k, i, size = min(failures)  # the first call in the model's order, not the backward's
        use, call = calls[k]
        members = [int(j) for j in mask.nonzero().flatten()]
        raise UnsupportedModelError(
            f"module {use.name} ({type(use.module).__name__}): the rows of its "
            f"{_describe(call, b)} are not one per example: the rows read as example {i}'s "
            f"received gradient from the losses of examples {members} alone, which do not "
            f"include {i} (relative size {size:.2e}; any amount is a leak). Clipping them would "
            "not bound one example's influence. " + _row_causes(call, b)
        )
    if compare is not None:  # parameters autograd gave no gradient: compared with zero
        for name in names:
            if name not in seen:
                compared(name, None)
    return seen


def _check_sums(engine, names, gaps: list[dict], tol: float, device) -> None:
    """Refuse a parameter whose rules' sum is not autograd's (relative, within ``tol``)
    in some subset; ``gaps``: per subset, {name: (max |mine - auto|, max |auto|, max |mine|)}."""
    tol_dtype_of = tolerance_dtypes(engine.model)
    # A parameter whose gradient is zero by symmetry (BERT's key bias: softmax ignores
    # a shift shared by all keys), or whose few examples' gradients cancel in a subset
    # (a LayerNorm over two features), has only rounding noise to compare: its scale is
    # floored at sqrt(tol) times the largest gradient the check saw, in any subset.
    floor = math.sqrt(tol) * max(
        (auto for seen in gaps for _, auto, _ in seen.values()), default=0.0
    )
    for name in names:
        err = max((_relative(*seen[name], floor) for seen in gaps), default=0.0)
        ptol = tol
        if any(u.rule.float32_inside for u in engine.owners(name)):
            ptol = max(tol, SUM_TOLERANCE[tol_dtype_of(torch.float32, device)])
        if err > ptol:
            owners = ", ".join(f"{u.name} ({type(u.module).__name__})" for u in engine.owners(name))
            raise UnsupportedModelError(
                f"parameter {name}: the gradient the engine reconstructs from the recorded "
                f"calls of {owners} differs from autograd's by {err:.2e} (relative). The rule "
                "for this module type does not compute its gradient exactly (a rule registered "
                "for a type it does not fit?), or part of the gradient bypasses the module's "
                "recorded input and output. Register a rule that fits, or freeze the parameter."
            )


def _outside_rows(g: Tensor | None, mask: Tensor, b: int) -> tuple[int, float] | None:
    """(first example outside ``mask`` whose rows of ``g`` (examples first) are not all
    zero, their size relative to g's largest example), or None where all are zero
    (exactly)."""
    if g is None:  # no gradient reached this output: zero everywhere
        return None
    per_example = g.reshape(b, -1)  # rows, blocks (example-major) or an expanded table
    # The largest |entry| of each row is zero exactly when every entry is (a maximum does
    # not round), NaN where one is NaN (NaN != 0: not zero either). One reduction over g,
    # without the copy of the rows left out and the boolean tensor of their entries that
    # indexing first would allocate: this runs while the backward's largest gradient (an
    # LM head's, B x T x vocab) is alive, at the first step's peak.
    if per_example.shape[1] == 0:  # nothing to be nonzero (a maximum of nothing is undefined)
        return None
    largest = torch.linalg.vector_norm(per_example, ord=math.inf, dim=1)
    nonzero = largest[~mask] != 0
    if not bool(nonzero.any()):
        return None
    outside = (~mask).nonzero().flatten()
    i = int(outside[nonzero.nonzero()[0, 0]])
    norms = per_example.double().norm(dim=1)
    top = float(norms.max())
    return i, float(norms[i]) / top if top > 0 else float("inf")


def _row_causes(call, b: int) -> str:
    if call.expanded_to is not None:
        return (
            f"A table shared by all examples was read per example; pass its ids with a "
            f"batch dimension, or change max_physical_batch_size from {b}."
        )
    if call.out_shape[0] != b:
        return (
            f"Its first dimension holds {call.out_shape[0]} rows for {b} examples, read as "
            f"blocks of {call.out_shape[0] // b} consecutive rows per example: rows selected "
            "by the data (tokens with labels, routed tokens) in other numbers per example "
            "are not such blocks. Apply the module to every token (B, T, ...) and select "
            "afterwards, in the loss."
        )
    return (
        "Typical causes: a table shared by all examples whose length equals the chunk size "
        f"({b}; pass its ids with a batch dimension, shape (1, T), or change "
        "max_physical_batch_size), a time-first (T, B, ...) tensor with T = B, an operation "
        "that mixes examples (batch statistics, attention across the batch), or a loss with "
        "in-batch negatives."
    )


def _relative(diff: float, auto: float, mine: float, floor: float) -> float:
    """A gap relative to the larger of the two gradients, floored at ``floor``."""
    scale = max(auto, mine, floor)
    return diff / scale if scale > 0 else 0.0


def _gaps(
    mine: Tensor | None, auto: Tensor | None, allowed: Tensor | None = None
) -> tuple[float, float, float]:
    """(max |mine - auto|, max |auto|, max |mine|), None read as zero. ``allowed``: an
    elementwise bound on autograd's own accumulation error (rules.accumulation_bound),
    taken off each entry's gap before the maximum.

    Worked through in slices of ``_GAP_SLICE`` entries: whole, the casts and differences
    were four float32 copies of the parameter (an embedding's: 450 MB at 135M), alive
    while the check's backward held the records, at the first step's peak. The maxima do
    not round, so the slices change no value.
    """
    if mine is None and auto is None:
        return 0.0, 0.0, 0.0
    ref = auto if auto is not None else mine
    if not ref.numel():
        return 0.0, 0.0, 0.0
    flat_mine = None if mine is None else mine.reshape(-1)
    flat_auto = None if auto is None else auto.reshape(-1)
    flat_allowed = None if allowed is None else allowed.to(ref.device).reshape(-1)
    diff = top_auto = top_mine = 0.0
    for start in range(0, ref.numel(), _GAP_SLICE):
        part = slice(start, start + _GAP_SLICE)
        n = min(_GAP_SLICE, ref.numel() - start)
        m = (
            ref.new_zeros(n)
            if flat_mine is None
            else flat_mine[part].to(ref.dtype)  # compared in the parameter's dtype
        )
        a = ref.new_zeros(n) if flat_auto is None else flat_auto[part]
        if flat_allowed is None:
            gap = (m - a).abs()
        else:  # in float32, so that subtracting the allowance does not round
            gap = ((m.float() - a.float()).abs() - flat_allowed[part]).clamp_min(0)
        diff = _larger(diff, float(gap.max()))
        top_auto = _larger(top_auto, float(a.abs().max()))
        top_mine = _larger(top_mine, float(m.abs().max()))
    return diff, top_auto, top_mine


def _larger(x: float, y: float) -> float:
    """max(x, y) that keeps a NaN of either, as a tensor's max over both slices would."""
    return y if y > x or math.isnan(y) else x


#: Entries of a parameter compared at once by :func:`_gaps` (16 MB of float32).
_GAP_SLICE = 1 << 22


def _describe(call, b: int) -> str:
    if call.expanded_to is not None:
        return f"output (a shared table expanded to {tuple(call.out_shape)})"
    return f"input {call.a_shape} / output {tuple(call.out_shape)} ({b} examples)"
