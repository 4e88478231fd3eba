"""Where the engine keeps the clipped sums it forms: ``p.grad``, and nothing else.

Between the engine's backward and the optimizer's step, ``p.grad`` must hold the
engine's clipped sum and nothing else: a plain ``loss.backward()``, a gradient
left from the last step or a write by other code would reach the optimizer
unclipped. :class:`GradStore` remembers which tensor (and which version of it)
it left in each ``p.grad``, so that any other write is seen.

A float16/bfloat16 parameter's sum is accumulated in float32 beside its
``p.grad`` (which gets it rounded): summing in the parameter's dtype rounds
every partial sum, and one record then moved the noised sum by C plus the
rounding (1.0005 C at B 64, tests/clipping/test_mixed_precision.py). The
optimizer noises the float32 sum and casts after (:meth:`GradStore.clipped_sum`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor, nn

from dptrain.clipping.precision import LOW_PRECISION  # parameters whose sums stay float32

__all__ = ["LOW_PRECISION", "GradStore", "ParameterSharding"]


class ParameterSharding(Protocol):
    """A model whose parameters are sharded across ranks (FSDP2), as the engine sees it:
    the parameter the optimizer holds is a shard; autograd's graph holds another tensor
    (:class:`dptrain.distributed.fsdp.FSDPSharding`). Its store (a subclass of
    :class:`GradStore`) reduces each clipped sum over the ranks into the shard."""

    def graph_parameter(self, p: Tensor) -> Tensor:
        """The tensor autograd's graph holds for parameter ``p`` (``p`` if unsharded)."""

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (a collective: every rank calls it)."""


class GradStore:
    """The clipped sums of a model's parameters, in ``p.grad`` (and float32 beside it)."""

    def __init__(self) -> None:
        # p.grad as the store left it: (id, version) per parameter id, checked at the step.
        self._marks: dict[int, tuple[int, int]] = {}
        # A float16/bfloat16 parameter's clipped sum in float32, by parameter id, with the
        # rounded copy written to p.grad beside it (valid while p.grad is that copy).
        self._float32_sums: dict[int, tuple[Tensor, Tensor]] = {}

    def add(self, p: nn.Parameter, grad: Tensor) -> None:
        """p.grad += grad (in float32 beside a float16/bfloat16 p.grad)."""
        if p.dtype not in LOW_PRECISION:
            grad = grad.to(p.dtype)
            if p.grad is None:
                # the param's own strides (a transposed Conv1D sum is not), as torch's
                # gradient layout contract asks: avoids slow paths and a warning downstream
                p.grad = grad if grad.stride() == p.stride() else grad.contiguous()
            else:
                p.grad.add_(grad)
            return
        held = self.clipped_sum(p)
        if held is None:  # p's strides (as above), in float32
            total = torch.empty_like(p, dtype=torch.float32).copy_(grad)
        elif held.dtype != torch.float32:  # a rounded sum only (written before this store's
            total = held.float().add_(grad)  # float32 sum existed): kept, as it is
        else:
            total = held.add_(grad.to(torch.float32))
        rounded = torch.empty_like(p)  # p's strides, as above
        rounded.copy_(total)
        p.grad = rounded
        self._float32_sums[id(p)] = (total, rounded)

    def flush(self) -> None:
        """Complete the additions made since the last flush (the engine calls it after
        each chunk's sums, before :meth:`mark`): nothing to do here, where each
        :meth:`add` is complete; a store that batches its additions does them now."""

    def mark(self, params: list[nn.Parameter]) -> None:
        """Remember each ``p.grad`` as the store leaves it."""
        for p in params:
            if p.grad is not None:
                self._marks[id(p)] = (id(p.grad), p.grad._version)

    def wrote(self, p: nn.Parameter) -> bool:
        """Whether ``p.grad`` is the tensor the store last left there, unchanged since."""
        return p.grad is not None and self._marks.get(id(p)) == (id(p.grad), p.grad._version)

    def clipped_sum(self, p: nn.Parameter) -> Tensor | None:
        """The clipped sum accumulated for ``p`` since its ``p.grad`` was last cleared:
        ``p.grad`` itself, or, for a float16/bfloat16 parameter, the float32 sum of which
        ``p.grad`` is the rounded copy; None where ``p.grad`` is None.

        The float32 sum is returned only while ``p.grad`` is the copy the store wrote
        (same tensor, same version); otherwise it is dropped and ``p.grad`` is returned.
        """
        if p.grad is None:
            self._float32_sums.pop(id(p), None)
            return None
        held = self._float32_sums.get(id(p))
        if held is not None and held[1] is p.grad and self.wrote(p):
            return held[0]
        self._float32_sums.pop(id(p), None)
        return p.grad
