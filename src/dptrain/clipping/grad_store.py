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
        # what add() left for the flush, by parameter id: (p, its float32 sum, a tensor
        # to copy into the sum or add to it, "copy" / "add" / None)
        self._pending: dict[int, tuple[nn.Parameter, Tensor, Tensor | None, str | None]] = {}

    def add(self, p: nn.Parameter, grad: Tensor) -> None:
        """p.grad += grad (in float32 beside a float16/bfloat16 p.grad).

        The store takes ``grad``: the caller must neither use nor change it afterwards (a
        float32 sum in p's layout becomes the held sum itself, with no copy; another is
        read at the flush). For a float16/bfloat16 parameter the work is done at
        :meth:`flush`, for all of a chunk's parameters at once."""
        if p.dtype not in LOW_PRECISION:
            grad = grad.to(p.dtype)
            if p.grad is None:
                # the param's own strides (a transposed Conv1D sum is not), as torch's
                # gradient layout contract asks: avoids slow paths and a warning downstream
                p.grad = grad if grad.stride() == p.stride() else grad.contiguous()
            else:
                p.grad.add_(grad)
            return
        pending = self._pending.get(id(p))
        if pending is not None:  # a second sum for p before the flush: done now
            self._complete(pending)
            pending[1].add_(grad.to(torch.float32))
            self._pending[id(p)] = (p, pending[1], None, None)
            return
        held = self.clipped_sum(p)
        if held is None:
            if (
                grad.dtype == torch.float32
                and grad.device == p.device
                and grad._base is None
                and grad.stride() == p.stride()
                and not grad.requires_grad
            ):  # the caller's fresh sum, in p's layout: kept as it is
                self._pending[id(p)] = (p, grad, None, None)
            else:  # copied into p's strides, in float32, at the flush
                self._pending[id(p)] = (p, torch.empty_like(p, dtype=torch.float32), grad, "copy")
        elif held.dtype != torch.float32:  # a rounded sum only (written before this store's
            self._pending[id(p)] = (p, held.float().add_(grad), None, None)  # float32 sum)
        else:  # added at the flush
            self._pending[id(p)] = (p, held, grad, "add")

    @staticmethod
    def _complete(entry: tuple) -> None:
        _, total, src, op = entry
        if op == "copy":
            total.copy_(src)
        elif op == "add":
            total.add_(src.to(torch.float32))

    def flush(self) -> None:
        """Complete the additions made since the last flush (the engine calls it after
        each chunk's sums, before :meth:`mark`): the copies and additions into the
        float32 sums, then each float16/bfloat16 ``p.grad`` as the rounded copy of its
        sum, each as one ``_foreach_`` operation for all parameters (a few kernel
        launches rather than up to three per parameter)."""
        if not self._pending:
            return
        items = list(self._pending.values())
        self._pending.clear()
        copies = [(total, src) for _, total, src, op in items if op == "copy"]
        if copies:  # copy_ casts
            torch._foreach_copy_([t for t, _ in copies], [src for _, src in copies])
        adds = [(total, src) for _, total, src, op in items if op == "add"]
        if adds:
            torch._foreach_add_([t for t, _ in adds], [src.to(torch.float32) for _, src in adds])
        rounded = [torch.empty_like(p) for p, *_ in items]  # p's strides, as above
        torch._foreach_copy_(rounded, [total for _, total, *_ in items])
        for (p, total, *_), r in zip(items, rounded, strict=True):
            p.grad = r
            self._float32_sums[id(p)] = (total, r)

    def release(self) -> None:
        """Forget the float32 sums (the optimizer has noised them and cast the result into
        ``p.grad``): held until the next step's sums otherwise, they and their rounded
        copies would stay alive through its forward and backward (4 + 2 bytes per bf16
        parameter)."""
        self._float32_sums.clear()

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
