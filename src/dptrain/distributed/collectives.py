"""Collectives over the ranks of a process group, usable without one.

- Objects: :func:`_all_gather_object` and :func:`_broadcast_object` (rank 0's
  object) return at once in one process; :func:`_raise_on_every_rank`
  all-gathers every rank's local error and fingerprint and raises the same
  error on every rank, so that no rank waits in a later collective for a rank
  that has already failed.
- Tensors: :func:`_flat_collective` runs one asynchronous collective per
  flattened bucket of tensors of one device and dtype (the optimizer's
  all-reduce, :func:`_broadcast_module_state`'s broadcast).

Internal to :mod:`dptrain.distributed` and :mod:`dptrain.checkpoint`: no public names.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dptrain.distributed.context import DistributedConfigError, _rank_and_world


def _src(group: Any) -> int:
    """The global rank of the group's rank 0 (the source of broadcasts)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def _all_gather_object(obj: Any, group: Any) -> list[Any]:
    _, world = _rank_and_world(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _broadcast_object(obj: Any, group: Any) -> Any:
    """Rank 0's ``obj`` on every rank."""
    _, world = _rank_and_world(group)
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=_src(group), group=group)
    return box[0]


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _raise_on_every_rank(
    what: str,
    local_error: BaseException | None,
    fingerprint: dict[str, str],
    group: Any,
    payload: Any = None,
    error_type: type[Exception] = DistributedConfigError,
) -> list[Any]:
    """All-gather (error, fingerprint, payload); raise the same error on every rank if needed.

    Returns every rank's payload when no rank failed and the fingerprints agree.
    """
    mine = (None if local_error is None else _describe(local_error), fingerprint, payload)
    gathered = _all_gather_object(mine, group)
    failed: dict[str, list[int]] = {}
    for r, (err, _, _) in enumerate(gathered):
        if err is not None:
            failed.setdefault(err, []).append(r)
    if failed:
        parts = [f"{_ranks(rs, len(gathered))}: {err}" for err, rs in failed.items()]
        raise error_type(f"{what} failed on " + "; ".join(parts)) from local_error
    diffs = []
    for key in sorted({k for _, fp, _ in gathered for k in fp}):
        values = [fp.get(key, "<missing>") for _, fp, _ in gathered]
        if len(set(values)) > 1:
            diffs.append(f"{key}: " + ", ".join(f"rank {r}={v}" for r, v in enumerate(values)))
    if diffs:
        raise error_type(
            f"{what}: the ranks differ (every rank must be started with the same "
            "configuration and state): " + "; ".join(diffs)
        )
    return [p for _, _, p in gathered]


def _ranks(ranks: list[int], world: int) -> str:
    if len(ranks) == world and world > 1:
        return "every rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _buckets(tensors: Sequence[Tensor], cap_bytes: int) -> list[list[Tensor]]:
    """Consecutive tensors of one device and dtype, at most ``cap_bytes`` a bucket."""
    groups: dict[tuple[torch.device, torch.dtype], list[list[Tensor]]] = {}
    sizes: dict[tuple[torch.device, torch.dtype], int] = {}
    for t in tensors:
        if t.numel() == 0:
            continue
        key = (t.device, t.dtype)
        nbytes = t.numel() * t.element_size()
        if key not in groups or (sizes[key] + nbytes > cap_bytes and groups[key][-1]):
            groups.setdefault(key, []).append([])
            sizes[key] = 0
        groups[key][-1].append(t)
        sizes[key] += nbytes
    return [b for bs in groups.values() for b in bs]


def _flat_collective(
    tensors: Sequence[Tensor], cap_bytes: int, run: Callable[[Tensor], Any]
) -> None:
    """Run an async collective on each flattened bucket, then copy the results back."""
    pending = []
    for bucket in _buckets(tensors, cap_bytes):
        flat = torch.cat([t.detach().reshape(-1) for t in bucket])
        pending.append((run(flat), flat, bucket))
    for work, flat, bucket in pending:
        work.wait()
        offset = 0
        with torch.no_grad():
            for t in bucket:
                n = t.numel()
                t.copy_(flat[offset : offset + n].view_as(t))
                offset += n


def _broadcast_module_state(
    model: nn.Module, group: Any, cap_bytes: int, parameters: bool = True
) -> None:
    """Give every rank rank 0's parameters (unless ``parameters=False``: a sharded model's
    ranks each hold their own shard) and buffers (as DDP does at construction)."""
    _, world = _rank_and_world(group)
    if world == 1:
        return
    tensors = [p.data for p in model.parameters()] if parameters else []
    tensors += [b for b in model.buffers()]
    src = _src(group)
    _flat_collective(
        tensors, cap_bytes, lambda flat: dist.broadcast(flat, src=src, group=group, async_op=True)
    )
