"""Example layouts: which rows of a recorded call belong to which example.

A module's recorded input ``a`` and output gradient ``g`` are read with the
examples along the first dimension, in one of three layouts:

- ``rows``: dimension 0 has one row per example (B, ...), the usual case;
- ``blocks``: dimension 0 has k rows per example, example-major (B * k, ...),
  as when a model flattens its tokens to (B * T, d) before a linear layer;
- ``shared``: a table used by every example (position ids of shape (T,) or
  (1, T)); its output stays as the module returned it, and the rows are read
  where it is broadcast over the batch, (B, T, d), one copy per example
  (:mod:`dptrain.clipping.shared_table`).

Sizes alone cannot tell these apart: a shared table of length B, a time-first
(T, B, d) tensor with T = B, or an operation that mixes the examples all give
a first dimension of B. So a layout read from sizes is only a hypothesis. Its
*pattern* (the layout and which dimensions equal B) is checked exactly the
first time it is seen (:mod:`dptrain.clipping.self_check`), and the model is
refused if the check fails. A pattern that passed stays trusted: the same
module code called with the same pattern of coincidences lays out its rows
the same way. Rows that the data decide (a row count other than B or B times
the root input's positions, an input selected by index values) are not
structure: such calls are rows-checked on every chunk (docs/engine.md,
"Deciding which rows are examples").
"""

from __future__ import annotations

from torch import Tensor
from torch.utils._pytree import tree_map

__all__ = [
    "BLOCKS",
    "LAYOUTS",
    "ROWS",
    "SHARED",
    "example_layout",
    "example_slice",
    "layout_pattern",
]

ROWS = "rows"
BLOCKS = "blocks"
SHARED = "shared"
LAYOUTS = (ROWS, BLOCKS, SHARED)


def example_layout(
    a_shape: tuple[int, ...], out_shape: tuple[int, ...], b: int, expanded_to: int | None
) -> str | None:
    """The layout a call is read with for ``b`` examples, or None if none fits its shapes."""
    if expanded_to is not None:
        return SHARED
    if not a_shape or not out_shape or a_shape[0] != out_shape[0]:
        return None
    if a_shape[0] == b:
        return ROWS
    if b > 0 and a_shape[0] % b == 0:
        return BLOCKS
    return None


def layout_pattern(
    layout: str, a_shape: tuple[int, ...], out_shape: tuple[int, ...], b: int
) -> tuple:
    """What the exact check vouches for: the layout, the ranks, which dimensions equal b."""
    return (
        layout,
        tuple(s == b for s in a_shape),
        tuple(s == b for s in out_shape),
    )


def example_slice(tree, i: int, b: int, rows: int = 1):
    """Example i's part of a call's arguments (nested containers included): every tensor
    with b * rows rows along dimension 0 gives its rows i * rows .. (i + 1) * rows (the
    rows or blocks layout); other values are shared and passed as they are."""

    def one(v):
        if isinstance(v, Tensor) and v.dim() and v.shape[0] == b * rows:
            return v[i * rows : (i + 1) * rows]
        return v

    return tree_map(one, tree)
