"""Clipped sums of an FSDP2-sharded model: reduced over the ranks into each rank's shard.

Each rank's engine forms, one parameter at a time, the full-shape clipped sum of
its own examples (sum_i c_i grad_i from its records). :meth:`ShardedGradStore.add`
reduces it over all ranks straight into the parameter's sharded layout and
accumulates the shard in float32 over the chunks of the logical batch. ``p.grad``
holds the shard (a ``DTensor``, rounded to p's dtype); the optimizer noises the
float32 shard and casts after.

How the reduction runs. The sums of FSDP's ``Shard(0)`` parameters are gathered
into buckets of at most ``bucket_bytes`` and each bucket is reduced by one flat
``reduce_scatter`` (:meth:`ShardedGradStore.flush`, also called by the engine at
the end of every chunk): rank r's part of the flat buffer is, parameter after
parameter, the rows FSDP gives rank r (``ceil(rows / W)`` each, the last ranks
fewer or none, as ``torch.chunk`` cuts them), so the output is rank r's shards
back to back. One collective per bucket instead of one ``DTensor``
redistribution (``Partial`` to the parameter's placements) per parameter: each
collective has a fixed cost, paid per parameter before. A parameter larger than a
bucket, or in another layout, goes alone through ``DTensor`` redistribution. A rank
holds at most one bucket of full-shape sums (and its flat copy) at a time.

Why this bounds sensitivity as in one process: the reduced shard is the same
coordinates of sum_r S_r = S, the sum of every example's clipped gradient over
all ranks (float32 addition in the collective's order), and one example lives
on one rank, in one row of one chunk.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Shard

from dptrain.clipping.grad_store import LOW_PRECISION, GradStore

__all__ = ["ShardedGradStore", "reduce_scatter_flat"]

#: Default bucket of full-shape sums reduced by one collective (as DDP's 25 MB buckets).
BUCKET_BYTES = 25 * 2**20


def _sum_dtype(p: Tensor) -> torch.dtype:
    """The dtype a parameter's clipped sum is reduced and noised in: at least float32."""
    return torch.float32 if p.dtype in LOW_PRECISION else p.dtype


class ShardedGradStore(GradStore):
    """:class:`~dptrain.clipping.grad_store.GradStore` for sharded (``DTensor``) parameters.

    Args:
        bucket_bytes: most bytes of full-shape sums reduced by one collective (module
            docstring); sums are held until their bucket is full or :meth:`flush`.
    """

    def __init__(self, bucket_bytes: int = BUCKET_BYTES) -> None:
        super().__init__()
        self.bucket_bytes = bucket_bytes
        # p's reduced shard in _sum_dtype(p), by parameter id, with the p.grad written beside it
        self._shards: dict[int, tuple[DTensor, DTensor]] = {}
        # (p, this rank's full-shape sum or None) waiting for the bucket's reduce-scatter
        self._bucket: list[tuple[nn.Parameter, Tensor | None]] = []
        self._bucket_size = 0

    def add(self, p: nn.Parameter, grad: Tensor | None) -> None:
        """Reduce this rank's full-shape sum ``grad`` (None: zeros) over the ranks into
        p's shard and add it to the shard held, now or at the bucket's :meth:`flush`. A
        collective: every rank calls it for every parameter, in the same order."""
        if not isinstance(p, DTensor):
            raise TypeError(
                f"parameter of shape {tuple(p.shape)} is not sharded (a plain tensor under "
                "FSDP2): shard every module that holds trainable parameters, e.g. "
                "fully_shard(model) after the decoder layers"
            )
        dtype = _sum_dtype(p)
        full = None if grad is None else grad.detach().to(dtype=dtype)
        size = p.numel() * torch.empty((), dtype=dtype).element_size()
        if not _row_sharded(p) or size > self.bucket_bytes:
            self.flush()
            self._reduce_alone(p, full)
            return
        if self._bucket and (
            self._bucket_size + size > self.bucket_bytes
            or _sum_dtype(self._bucket[0][0]) != dtype
            or self._bucket[0][0].device_mesh != p.device_mesh
        ):
            self.flush()
        self._bucket.append((p, full))
        self._bucket_size += size

    def flush(self) -> None:
        """Reduce-scatter the bucket's sums in one collective and add each shard."""
        if not self._bucket:
            return
        bucket, self._bucket, self._bucket_size = self._bucket, [], 0
        first = bucket[0][0]
        mesh, dtype = first.device_mesh, _sum_dtype(first)
        world, rank = mesh.size(), mesh.get_local_rank()
        device = first.to_local().device
        layout = []  # (p, its full sum, rows per rank c, numel of a row, offset in a part)
        part = 0
        for p, full in bucket:
            rows = p.shape[0]
            c = -(-rows // world)
            row = math.prod(p.shape[1:])
            layout.append((p, full, c, row, part))
            part += c * row
        flat = torch.zeros(world, part, dtype=dtype, device=device)
        for p, full, c, row, at in layout:
            if full is None:  # zeros: nothing of this rank's
                continue
            src = full.to(device).reshape(-1)
            for r in range(world):
                n = _rows_of(p.shape[0], c, r) * row
                if n:
                    flat[r, at : at + n].copy_(src[r * c * row : r * c * row + n])
        out = torch.empty(part, dtype=dtype, device=device)
        reduce_scatter_flat(out, flat.reshape(-1), mesh.get_group())
        del flat
        for p, _, c, row, at in layout:
            n = _rows_of(p.shape[0], c, rank)
            if tuple(p.to_local().shape) != (n, *p.shape[1:]):
                raise RuntimeError(
                    f"parameter of shape {tuple(p.shape)}: this rank holds a shard of shape "
                    f"{tuple(p.to_local().shape)}, not rows [{rank * c}, {rank * c + n}) as "
                    "Shard(0) cuts them; dptrain's reduction does not know this layout"
                )
            local = out[at : at + n * row].view(n, *p.shape[1:])
            shard = DTensor.from_local(
                local, mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
            self._accumulate(p, shard)

    def _reduce_alone(self, p: nn.Parameter, full: Tensor | None) -> None:
        """One parameter's reduction by ``DTensor`` redistribution (any placements)."""
        dtype = _sum_dtype(p)
        local = p.to_local()
        if full is None:
            full = torch.zeros(p.shape, dtype=dtype, device=local.device)
        full = full.to(local.device).contiguous()
        mesh = p.device_mesh
        partial = DTensor.from_local(full, mesh, [Partial()] * mesh.ndim, run_check=False)
        self._accumulate(p, partial.redistribute(mesh, p.placements))

    def _accumulate(self, p: nn.Parameter, shard: DTensor) -> None:
        """Add the reduced ``shard`` to the one held; p.grad gets it in p's dtype."""
        held = self.clipped_sum(p)
        if held is not None and held.dtype != shard.dtype:
            held = held.to(shard.dtype)  # a rounded p.grad without this store's sum: promoted
        total = shard if held is None else held.add_(shard)
        rounded = total if total.dtype == p.dtype else total.to(p.dtype)
        p.grad = rounded
        self._shards[id(p)] = (total, rounded)

    def release(self) -> None:
        """Forget the reduced shards (the optimizer has noised them: GradStore.release)."""
        super().release()
        self._shards.clear()

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


def reduce_scatter_flat(out: Tensor, flat: Tensor, group: dist.ProcessGroup) -> None:
    """Sum ``flat`` (W x len(out), rank after rank) over the group into each rank's ``out``.

    torch 2.13 names this collective ``reduce_scatter_single`` and deprecates
    ``reduce_scatter_tensor``; torch 2.11 (and every release since 1.13) has only the
    latter. The same collective under either name."""
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    collective(out, flat, group=group)


def _row_sharded(p: DTensor) -> bool:
    """Whether ``p`` is FSDP's usual layout, rows sharded over a 1-D mesh (``Shard(0)``:
    rank r holds rows [r c, r c + n), c = ceil(rows / W), what :meth:`flush` assumes).
    Read from the layout alone, the same on every rank (each then runs the same path)."""
    return p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),) and p.dim() > 0


def _rows_of(rows: int, c: int, rank: int) -> int:
    """Rows of a ``rows``-row tensor that rank ``rank`` holds, in chunks of ``c``."""
    return max(0, min(c, rows - rank * c))
