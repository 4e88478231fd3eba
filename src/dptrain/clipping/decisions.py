"""Where the engine decides which rows of a chunk are whose, and what must be checked.

Every fact the per-example bound rests on is one of three kinds (docs/engine.md,
"Deciding which rows are examples"); :class:`RowDecisions` keeps what is known
across chunks and says, for each chunk, what must be established on it:

1. *Structure*, proven once: a recorded call's layout pattern (rows, blocks of
   rows, a shared table; which dimensions equal the chunk size) and the graph's
   signature (counts of operation types outside the recorded calls). A chunk
   with a pattern or signature not seen before runs the full check
   (:mod:`dptrain.clipping.self_check`, :mod:`dptrain.clipping.independence`).
2. *Data*, established on every chunk: calls whose rows the data decide (a row
   count other than B or B times the root input's positions, an input selected
   by index values, or a call seen so before), and the selections by index in
   the losses' graph, whose selected tensors are rows-checked on every chunk
   (:func:`dptrain.clipping.self_check.frontier`).
3. The checks themselves live in their own modules; this one only decides which
   to run.
"""

from __future__ import annotations

import math
from collections import Counter

from torch import Tensor
from torch.utils._pytree import tree_flatten

from dptrain.clipping import self_check
from dptrain.clipping.errors import UnsupportedModelError
from dptrain.clipping.graph_check import SELECTIONS, interior
from dptrain.clipping.layout import ROWS, SHARED, example_layout, layout_pattern

__all__ = ["RowDecisions", "structural_row_counts"]


def structural_row_counts(b: int, root_shape: tuple[int, ...]) -> set[int]:
    """Row counts whose example layout follows from structure: b, and b times the
    positions of the root input's leading dimensions (tokens flattened to (B * T, d))."""
    return {b * math.prod(root_shape[1:j]) for j in range(1, len(root_shape) + 1)}


class RowDecisions:
    """What is known about a model's rows, and what each chunk must establish."""

    def __init__(self) -> None:
        self.verified: set[tuple] = set()
        """Layout patterns checked in full, per (module, call index)."""
        self.graphs: set[tuple] = set()
        """Graph signatures checked in full."""
        self.by_data: set[tuple[str, int]] = set()
        """(module, call index) whose rows the data decide: rows-checked on every chunk."""
        self.selections: list = []
        """The last losses' graph's selections by index outside the recorded calls."""
        self.signature: tuple = ()
        """The last losses' graph's operation counts outside the recorded calls."""
        self.sizes_by_data = False
        """Whether the last losses' graph selects rows by index anywhere (routing), so
        that the sizes of some products inside the model depend on the data."""

    # -- what the graph shows ---------------------------------------------------------

    def read_graph(self, seen: dict[int, object], interiors: set[int]) -> None:
        """Take the selections and signature of a losses' graph (``seen``: its nodes by id;
        ``interiors``: the ids of nodes inside recorded calls, which their rules handle:
        a replay re-runs the module's own routing per example)."""
        # one pass over the graph's nodes for both (it is the step's largest Python loop)
        outside: Counter = Counter()
        picked = []
        any_selection = False
        for k, n in seen.items():
            name = type(n).__name__
            selects = name in SELECTIONS
            any_selection |= selects
            if k not in interiors:
                outside[name] += 1
                if selects:
                    picked.append(n)
        self.selections = picked
        self.sizes_by_data = any_selection
        # A chunk whose graph differs (a branch taken at random or by the data, which may
        # mix examples where the checked chunk did not) is checked again in full.
        self.signature = tuple(sorted(outside.items()))

    # -- layouts and patterns ---------------------------------------------------------

    def layouts(
        self, active: list, live: dict, b: int, root_shape: tuple[int, ...]
    ) -> tuple[set[tuple], list[tuple]]:
        """Check every call has an example layout; return the patterns not yet checked in
        full, and the calls whose rows the data decide (rows-checked on every chunk)."""
        new = set()
        by_data: list[tuple] = []
        structural = structural_row_counts(b, root_shape)
        for use in active:
            for call in live[use]:
                layout = _layout_of(use, call, b)
                if b < 2:
                    continue
                pattern = (
                    use.name,
                    call.index,
                    *layout_pattern(layout, tuple(call.a.shape), call.out_shape, b),
                    _inputs_pattern(call.inputs, b),
                )
                if pattern not in self.verified:
                    new.add(pattern)
                if layout != SHARED and self.rows_by_data(use, call, structural):
                    by_data.append((use, call))
        return new, by_data

    def needs_full_check(self, new_patterns: set[tuple], b: int) -> bool:
        """Whether this chunk runs the full check: a new pattern or a new graph."""
        return b > 1 and (bool(new_patterns) or self.signature not in self.graphs)

    def checked(self, new_patterns: set[tuple]) -> None:
        """The full check passed on this chunk: its patterns and graph are proven."""
        self.verified |= new_patterns
        self.graphs.add(self.signature)

    # -- rows the data decide ---------------------------------------------------------

    def rows_by_data(self, use, call, structural: set[int]) -> bool:
        """Whether which rows of ``call`` are whose may change from chunk to chunk.

        The rows of a call are fixed by structure when there are b of them, or b blocks
        of as many rows as the root input has positions (tokens flattened to (B * T, d)).
        Any other count (tokens selected by their labels, routed tokens), an input made by
        a selection that depends on values (``h[mask]``, gather, index_select), or a call
        seen so once before, is decided again on every chunk: its count may coincide
        with b on one chunk and hold other counts per example on the next (``structural``:
        :func:`structural_row_counts` of the chunk).
        """
        key = (use.name, call.index)
        if key in self.by_data:
            return True
        selected = any(type(n).__name__ in SELECTIONS for n in call.in_nodes if n is not None)
        if call.out_shape[0] in structural and not selected:
            return False
        self.by_data.add(key)
        return True

    def below_selections(
        self, losses: Tensor, live: dict, by_data: list, b: int, root_shape: tuple[int, ...]
    ) -> list[tuple]:
        """Decide the selections in the losses' graph on this chunk; return the calls
        below those whose rows could not be decided where they are.

        A selection by index values (``logits[arange(B), last]``, ``loss_rows[mask]``,
        ``index_add`` of token losses into examples) decides which rows reach which
        example anew on every chunk. Where the tensor it selects from has one row (or
        a block of T rows) per example, the gradient reaching that tensor is rows-checked
        exactly (:func:`dptrain.clipping.self_check.frontier`: backwards that stop there,
        near the loss); below it, the graph is the one checked on a new pattern. Where it
        does not (token losses of selected tokens, N rows for b examples), every recorded
        call below the selection is rows-checked itself.
        """
        if not self.selections:
            return []
        structural = structural_row_counts(b, root_shape)
        undecided = self_check.frontier(losses, self.selections, structural)
        if not undecided:
            return []
        under: dict[int, object] = {}
        for node in undecided:
            under.update(interior(node, ()))
        have = {id(c) for _, c in by_data}
        return [
            (u, c)
            for u, calls in live.items()
            for c in calls
            if id(c.edge.node) in under and id(c) not in have and c.expanded_to is None
        ]


def _layout_of(use, call, b: int) -> str:
    """The call's example layout for ``b`` examples; refuses a call that has none."""
    layout = example_layout(tuple(call.a.shape), call.out_shape, b, call.expanded_to)
    if layout not in (None, ROWS) and getattr(use.rule, "raw_layout", False):
        raise UnsupportedModelError(
            f"module {use.name} ({type(use.module).__name__}) was called on an input "
            f"of shape {tuple(call.a.shape)} for {b} per-example losses: its rule "
            "needs one input row per example (B, C, *spatial); pass the examples "
            "along the first dimension"
        )
    if layout is None:
        raise UnsupportedModelError(
            f"module {use.name} ({type(use.module).__name__}) produced an output of "
            f"shape {call.out_shape} for {b} per-example losses: its first dimension "
            "is not the batch size, so its per-example gradients would be mixed (if "
            "the model takes its inputs in an unusual container, pass input_ids= or "
            "a tensor as the first argument)"
        )
    return layout


def _inputs_pattern(inputs: tuple | None, b: int) -> tuple:
    """Which dimensions of a replayed call's tensor inputs equal b (part of its pattern)."""
    if inputs is None:
        return ()
    flat = tree_flatten(inputs)[0]
    return tuple(tuple(s == b for s in t.shape) for t in flat if isinstance(t, Tensor))
