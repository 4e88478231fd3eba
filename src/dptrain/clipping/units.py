"""Privacy units of several examples: a user's records clipped as one sum.

With user-level DP (``privacy_unit="user"``) the quantity whose norm is bounded
by C is a unit's gradient, the sum of its examples' gradients,

    grad_u = sum_{i in u} grad_i,    clipped sum = sum_u c_u grad_u.

Every layer rule is a sum over tokens of per-token terms built from one row of
``a`` and ``g`` (rules.py), so a unit's gradient is the rule applied to its
examples' tokens concatenated: row u of the regrouped record holds the tokens
of every example of unit u, one after the other. Ghost norms then include the
cross terms between a unit's examples, ||sum_i G_i||^2 = sum_{i,j} <G_i, G_j>,
as they must. Units have different numbers of examples; the shorter ones are
padded with zero rows of ``a`` and ``g``, which add nothing to any rule's sum
(a zero output gradient multiplies every term).

A unit whose examples do not fit in one physical chunk is not regrouped: its
chunks are accumulated unclipped and clipped once at its last chunk
(:meth:`ClippingEngine.add_to_unit`, :meth:`ClippingEngine.close_unit`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["UnitIndex", "unit_index"]


@dataclass(frozen=True)
class UnitIndex:
    """Which examples of a chunk form which unit."""

    inverse: Tensor
    """(B,): the unit (0 .. U - 1) of each example, in order of first appearance."""
    slots: Tensor
    """(U, k): the examples of each unit, padded with B (a zero row) to k, the largest unit."""

    @property
    def num_units(self) -> int:
        return self.slots.shape[0]

    @property
    def trivial(self) -> bool:
        """One example per unit, in the examples' order: regrouping changes nothing."""
        u, k = self.slots.shape
        return k == 1 and bool(
            (self.slots[:, 0] == torch.arange(u, device=self.slots.device)).all()
        )

    def regroup(self, x: Tensor) -> Tensor:
        """(B, T, ...) -> (U, k * T, ...): each unit's examples concatenated along dim 1."""
        if self.trivial:
            return x
        padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
        grouped = padded[self.slots.to(x.device)]  # (U, k, T, ...)
        return grouped.reshape(grouped.shape[0], -1, *x.shape[2:])


def unit_index(units: Tensor, b: int) -> UnitIndex:
    """The units of ``b`` examples from their ids ``units`` (B,) (any integers)."""
    if not isinstance(units, Tensor) or units.shape != (b,) or units.is_floating_point():
        raise ValueError(
            f"units={units!r}: expected an integer tensor of shape ({b},), one unit id per "
            "example of the chunk"
        )
    units = units.cpu()
    # units in order of first appearance (torch.unique sorts its values)
    values, inverse = torch.unique(units, return_inverse=True)
    first = torch.full((len(values),), b, dtype=torch.long).scatter_reduce(
        0, inverse, torch.arange(b), "amin"
    )
    rank = torch.empty_like(first)
    rank[torch.argsort(first)] = torch.arange(len(values))
    inverse = rank[inverse]
    counts = torch.bincount(inverse, minlength=len(values))
    k = int(counts.max()) if b else 0
    order = torch.argsort(inverse, stable=True)
    starts = torch.cumsum(counts, 0) - counts
    slot_of = torch.empty(b, dtype=torch.long)
    slot_of[order] = torch.arange(b) - starts[inverse[order]]
    slots = torch.full((len(values), k), b, dtype=torch.long)
    slots[inverse, slot_of] = torch.arange(b)
    return UnitIndex(inverse=inverse, slots=slots)
