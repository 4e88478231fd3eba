"""Subsets of a chunk that separate every ordered pair of its examples.

The engine's checks ask, for every ordered pair (j, i) of examples of a chunk,
whether example j reaches what the engine attributes to example i: j's loss
reaching i's gradient rows (the rows check, :mod:`dptrain.clipping.self_check`),
or j's data reaching i's inputs (the independence check,
:mod:`dptrain.clipping.independence`). Both are decided with subsets S of the
chunk: the gradient of sum_{j in S} L_j must be exactly zero on the rows of every
example outside S; the inputs of the examples in S must not change when the
examples outside S are replaced.

A family of subsets decides every ordered pair when for all j != i one subset
holds j and not i. Giving example i the code c_i = {k : i in S_k}, that is: no
code contains another (an antichain). Codes of equal weight never contain one
another, so the m-bit codes of weight floor(m/2), of which there are
C(m, floor(m/2)) (Sperner's theorem: no antichain of subsets of m elements is
larger), decide a chunk of b examples with the least m such that
C(m, floor(m/2)) >= b: 2 subsets for b = 2, 4 for b <= 6, 5 for b <= 10,
6 for b <= 20, 8 for b <= 70, 10 for b <= 252.

An earlier check re-weighted every example's loss by a power of two drawn from
seven values and ran two examples alone: from b = 8 weights repeated, and a model
in which one example read another passed it (issue 26). The family here leaves
no pair out, whatever b, and carries no data (it depends on b alone).
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor

__all__ = ["separating_masks", "subsets_needed"]


def subsets_needed(b: int) -> int:
    """The number of subsets :func:`separating_masks` uses for ``b`` examples (0 for b < 2)."""
    if b < 2:
        return 0
    m = 2
    while math.comb(m, m // 2) < b:
        m += 1
    return m


def separating_masks(b: int) -> Tensor:
    """(m, b) bool: row k is subset S_k; for all j != i some S_k holds j and not i.

    Example i's code is the i-th m-bit set of weight floor(m/2) in lexicographic
    order; an empty (0, b) tensor for b < 2 (no pair to separate).
    """
    m = subsets_needed(b)
    masks = torch.zeros(m, max(b, 0), dtype=torch.bool)
    if m == 0:
        return masks
    for i, code in zip(range(b), itertools.combinations(range(m), m // 2), strict=False):
        masks[list(code), i] = True
    return masks
