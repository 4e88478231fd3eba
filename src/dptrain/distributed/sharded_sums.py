"""Clipped sums of an FSDP2-sharded model: reduced over the ranks into each rank's shard.

Each rank's engine forms, one parameter at a time, the full-shape clipped sum of
its own examples (sum_i c_i grad_i from its records). :meth:`ShardedGradStore.add`
reduces it over all ranks straight into the parameter's sharded layout (a
reduce-scatter for FSDP's ``Shard(0)``: ``DTensor`` redistribution from
``Partial`` to the parameter's placements), so no rank holds more than one
parameter's full-shape sum at a time, and accumulates the shard in float32 over
the chunks of the logical batch. ``p.grad`` holds the shard (a ``DTensor``,
rounded to p's dtype); the optimizer noises the float32 shard and casts after.

Why this bounds sensitivity as in one process: the reduced shard is the same
coordinates of sum_r S_r = S, the sum of every example's clipped gradient over
all ranks (float32 addition in the collective's order), and one example lives
on one rank, in one row of one chunk.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial

from dptrain.clipping.grad_store import LOW_PRECISION, GradStore

__all__ = ["ShardedGradStore"]


def _sum_dtype(p: Tensor) -> torch.dtype:
    """The dtype a parameter's clipped sum is reduced and noised in: at least float32."""
    return torch.float32 if p.dtype in LOW_PRECISION else p.dtype


class ShardedGradStore(GradStore):
    """:class:`~dptrain.clipping.grad_store.GradStore` for sharded (``DTensor``) parameters."""

    def __init__(self) -> None:
        super().__init__()
        # p's reduced shard in _sum_dtype(p), by parameter id, with the p.grad written beside it
        self._shards: dict[int, tuple[DTensor, DTensor]] = {}

    def add(self, p: nn.Parameter, grad: Tensor | None) -> None:
        """Reduce this rank's full-shape sum ``grad`` (None: zeros) over the ranks into
        p's shard and add it to the shard held. A collective: every rank calls it for
        every parameter, in the same order."""
        if not isinstance(p, DTensor):
            raise TypeError(
                f"parameter of shape {tuple(p.shape)} is not sharded (a plain tensor under "
                "FSDP2): shard every module that holds trainable parameters, e.g. "
                "fully_shard(model) after the decoder layers"
            )
        dtype = _sum_dtype(p)
        local = p.to_local()
        if grad is None:
            full = torch.zeros(p.shape, dtype=dtype, device=local.device)
        else:
            full = grad.detach().to(device=local.device, dtype=dtype).contiguous()
        mesh = p.device_mesh
        partial = DTensor.from_local(full, mesh, [Partial()] * mesh.ndim, run_check=False)
        shard = partial.redistribute(mesh, p.placements)
        held = self.clipped_sum(p)
        if held is not None and held.dtype != dtype:
            held = held.to(dtype)  # a rounded p.grad without this store's sum: kept, promoted
        total = shard if held is None else held.add_(shard)
        rounded = total if total.dtype == p.dtype else total.to(p.dtype)
        p.grad = rounded
        self._shards[id(p)] = (total, rounded)

    def clipped_sum(self, p: nn.Parameter) -> Tensor | None:
        """The reduced shard accumulated for ``p`` (in at least float32) while ``p.grad``
        is the copy this store wrote; else ``p.grad`` (None where it is None)."""
        if p.grad is None:
            self._shards.pop(id(p), None)
            return None
        held = self._shards.get(id(p))
        if held is not None and held[1] is p.grad and self.wrote(p):
            return held[0]
        self._shards.pop(id(p), None)
        return p.grad
