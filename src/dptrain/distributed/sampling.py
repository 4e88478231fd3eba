"""Each rank's share of the Poisson-sampled logical batches of the whole dataset.

Every rank draws the same global mask (same seed) and keeps the positions
``rank, rank + W, ...`` of the sorted batch (:func:`shard_indices`): the union
over ranks is the batch one process would draw, split disjointly into shares
whose sizes differ by at most one. A secure sampler (``secure_mode``: the OS's
CSPRNG, no seed) cannot be drawn alike on every rank: rank 0 draws each global
batch and broadcasts it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dptrain._checks import check_int
from dptrain.data.poisson import (
    ChunkUnits,
    DPDataLoader,
    LogicalBatch,
    PoissonBatchSampler,
    order_for_chunks,
    pack_units,
    split_physical,
)
from dptrain.distributed.collectives import _broadcast_object
from dptrain.distributed.context import _rank_and_world

__all__ = ["DistributedDPDataLoader", "RankBatch", "equal_chunk_sizes", "shard_indices"]


def shard_indices(indices: Sequence[int], rank: int, world_size: int) -> list[int]:
    """This rank's share of a logical batch: positions ``rank, rank + W, ...`` of ``indices``.

    The shares of ranks 0..W-1 are disjoint, their union is ``indices``, and
    their sizes differ by at most one.
    """
    world_size = check_int("world_size", world_size, 1)
    rank = check_int("rank", rank, 0)
    if rank >= world_size:
        raise ValueError(
            f"rank={rank!r} is not allowed: expected an integer < world_size={world_size}"
        )
    return list(indices[rank::world_size])


def _per_rank_chunk(
    max_physical_batch_size: int | None, global_physical_batch_size: int | None, world_size: int
) -> int | None:
    """The per-rank chunk size from exactly one of the two ways of giving it (or None)."""
    if max_physical_batch_size is not None and global_physical_batch_size is not None:
        raise ValueError(
            f"max_physical_batch_size={max_physical_batch_size!r} and global_physical_batch_size="
            f"{global_physical_batch_size!r} are both given: pass at most one (per rank or in all)"
        )
    if global_physical_batch_size is not None:
        total = check_int("global_physical_batch_size", global_physical_batch_size, 1)
        if total % world_size != 0:
            raise ValueError(
                f"global_physical_batch_size={total!r} is not allowed: expected a multiple of "
                f"world_size={world_size} (each rank processes global_physical_batch_size / "
                "world_size records at a time); or give max_physical_batch_size per rank"
            )
        return total // world_size
    if max_physical_batch_size is not None:
        return check_int("max_physical_batch_size", max_physical_batch_size, 1)
    return None


@dataclass
class RankBatch(LogicalBatch):
    """One rank's share of a logical batch.

    ``chunks`` and ``size`` are this rank's; ``global_size`` is the size of the
    whole logical batch (the union over ranks), ``sample_rate`` and ``step`` are
    the logical batch's.
    """

    global_size: int
    rank: int
    world_size: int
    padding: list[int] | None = None
    """With equal chunks (a sharded model): per chunk, how many rows at its end are
    padding (copies of a record whose losses :meth:`~dptrain.PrivateTraining.backward`
    multiplies by 0, so their gradient is exactly zero); None otherwise."""


def equal_chunk_sizes(global_size: int, world_size: int, max_physical_batch_size: int) -> list[int]:
    """The chunk sizes every rank runs when all ranks must run the same passes (FSDP: each
    forward gathers parameters from all ranks): the largest share, ceil(B / W), cut into
    the fewest chunks of at most ``max_physical_batch_size``, sizes differing by at most 1.
    A function of B, W and the chunk size alone, so every rank computes the same list."""
    share = -(-global_size // world_size)
    k = -(-share // max_physical_batch_size)
    return [share // k + (j < share % k) for j in range(k)]


class DistributedDPDataLoader:
    """This rank's share of Poisson-sampled logical batches of the whole dataset.

    Every rank must be built with the same ``seed``: each draws the same global
    Poisson mask (:class:`~dptrain.data.PoissonBatchSampler` over all N
    records) and keeps :func:`shard_indices` of it. The state (generator and
    steps drawn) is the global sampler's, so it does not depend on the world
    size: a checkpoint saved with W processes resumes with any number.

    Args:
        dataset: map-style, ``len()`` and ``dataset[i]``; every rank has all of it.
        sample_rate: q in (0, 1], or a schedule ``step -> q``.
        steps: number of logical batches.
        max_physical_batch_size: most records per chunk on this rank; or
        global_physical_batch_size: most records per chunk over all ranks
            together (must be a multiple of the world size).
        collate_fn: default ``torch.utils.data.default_collate``.
        seed: the shared sampling seed (an integer; the same on every rank).
        rank, world_size: default: from ``group`` (the default process group).
    """

    def __init__(
        self,
        dataset: Any,
        sample_rate: float | Callable[[int], float],
        steps: int,
        max_physical_batch_size: int | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        *,
        seed: int,
        global_physical_batch_size: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        group: Any = None,
        equal_chunks: bool = False,
    ):
        if seed is None or isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(
                f"seed={seed!r} is not allowed: expected an integer, the same on every rank "
                "(every rank must draw the same global Poisson mask)"
            )
        if max_physical_batch_size is None and global_physical_batch_size is None:
            raise ValueError(
                "max_physical_batch_size=None and global_physical_batch_size=None: give one "
                "(records per chunk on each rank, or over all ranks together)"
            )
        base = DPDataLoader(dataset, sample_rate, steps, 1, collate_fn, seed=seed)
        self._init_from(
            base,
            max_physical_batch_size,
            global_physical_batch_size,
            rank,
            world_size,
            group,
            equal_chunks,
        )

    @classmethod
    def from_loader(
        cls,
        loader: DPDataLoader,
        *,
        max_physical_batch_size: int | None = None,
        global_physical_batch_size: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        group: Any = None,
        equal_chunks: bool = False,
    ) -> DistributedDPDataLoader:
        """Shard an existing :class:`~dptrain.data.DPDataLoader` (its sampler is shared, not copied).

        Without a chunk size, each rank uses ceil(loader's chunk size / W).
        """
        self = cls.__new__(cls)
        self._init_from(
            loader,
            max_physical_batch_size,
            global_physical_batch_size,
            rank,
            world_size,
            group,
            equal_chunks,
        )
        return self

    def _init_from(
        self,
        loader: DPDataLoader,
        max_physical_batch_size: int | None,
        global_physical_batch_size: int | None,
        rank: int | None,
        world_size: int | None,
        group: Any,
        equal_chunks: bool = False,
    ) -> None:
        if (rank is None) != (world_size is None):
            raise ValueError(
                f"rank={rank!r}, world_size={world_size!r}: give both or neither "
                "(neither: from the process group)"
            )
        if rank is None or world_size is None:
            rank, world_size = _rank_and_world(group)
        self.world_size = check_int("world_size", world_size, 1)
        self.rank = check_int("rank", rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(
                f"rank={rank!r} is not allowed: expected an integer < world_size={world_size}"
            )
        chunk = _per_rank_chunk(
            max_physical_batch_size, global_physical_batch_size, self.world_size
        )
        if chunk is None:
            chunk = math.ceil(loader.max_physical_batch_size / self.world_size)
        self.max_physical_batch_size = chunk
        self.dataset = loader.dataset
        self.dataset_size = loader.dataset_size
        self.collate_fn = loader.collate_fn
        self.sampler: PoissonBatchSampler = loader.sampler
        # user-level DP: the sampler draws units (users), each rank takes whole units
        self.unit_members = getattr(loader, "unit_members", None)
        self.equal_chunks = equal_chunks
        self.chunk_key = getattr(loader, "chunk_key", None)
        self.group = group

    @property
    def seed(self) -> int | None:
        """The shared sampling seed."""
        return self.sampler.seed

    def expected_batch_size(self, step: int) -> float:
        """Mean size of the whole logical batch at ``step``: q N (over all ranks)."""
        return self.sampler.sample_rate_at(step) * self.dataset_size

    def _global_batches(self) -> Iterator[tuple[int, list[int]]]:
        """(step, the global batch's indices), the same on every rank."""
        if not (self.sampler.secure and self.world_size > 1):
            for indices in self.sampler:  # the same seed: every rank draws the same mask
                yield self.sampler.steps_drawn - 1, indices
            return
        # Secure sampling has no seed to share: rank 0 draws from the OS's CSPRNG and
        # broadcasts the batch (one broadcast per step; the other ranks draw nothing).
        mine = iter(self.sampler) if self.rank == 0 else None
        while True:
            drawn = None
            if mine is not None:
                indices = next(mine, None)
                if indices is not None:
                    drawn = (self.sampler.steps_drawn - 1, indices)
            drawn = _broadcast_object(drawn, self.group)
            if drawn is None:
                return
            if mine is None:  # keep the step count (checkpoints, resumes) as rank 0's
                state = self.sampler.state_dict()
                state["steps_drawn"] = drawn[0] + 1
                self.sampler.load_state_dict(state)
            yield drawn

    def __iter__(self) -> Iterator[RankBatch]:
        for step, indices in self._global_batches():
            mine = order_for_chunks(
                shard_indices(indices, self.rank, self.world_size),
                self.chunk_key,
                self.unit_members,
            )
            q = self.sampler.sample_rate_at(step)
            if self.equal_chunks and self.unit_members is not None:
                yield self._equal_unit_chunks(indices, mine, q, step)
                continue
            if self.equal_chunks:
                yield self._equal_chunks(indices, mine, q, step)
                continue
            if self.unit_members is None:
                chunks = [
                    self.collate_fn([self.dataset[i] for i in chunk])
                    for chunk in split_physical(mine, self.max_physical_batch_size)
                ]
                yield RankBatch(
                    chunks=chunks,
                    size=len(mine),
                    sample_rate=q,
                    step=step,
                    global_size=len(indices),
                    rank=self.rank,
                    world_size=self.world_size,
                )
                continue
            # whole users per rank, packed into this rank's chunks (a user's records never
            # straddle ranks, so each rank clips its users' sums exactly)
            packed = pack_units([self.unit_members[u] for u in mine], self.max_physical_batch_size)
            yield RankBatch(
                chunks=[self.collate_fn([self.dataset[i] for i in recs]) for recs, _ in packed],
                size=sum(len(recs) for recs, _ in packed),
                sample_rate=q,
                step=step,
                global_size=sum(len(self.unit_members[u]) for u in indices),
                rank=self.rank,
                world_size=self.world_size,
                units=[units for _, units in packed],
                num_units=len(mine),
            )

    def _equal_chunks(self, indices, mine: list[int], q: float, step: int) -> RankBatch:
        """This rank's share in :func:`equal_chunk_sizes` chunks, the last rows of a short
        share padded with copies of the batch's first record (masked in the backward)."""
        sizes = equal_chunk_sizes(len(indices), self.world_size, self.max_physical_batch_size)
        chunks, padding, at = [], [], 0
        for size in sizes:
            rows = list(mine[at : at + size])
            at += len(rows)
            padding.append(size - len(rows))
            rows += [indices[0]] * (size - len(rows))
            chunks.append(self.collate_fn([self.dataset[i] for i in rows]))
        return RankBatch(
            chunks=chunks,
            size=len(mine),
            sample_rate=q,
            step=step,
            global_size=len(indices),
            rank=self.rank,
            world_size=self.world_size,
            padding=padding,
        )

    def _equal_unit_chunks(self, indices, mine: list[int], q: float, step: int) -> RankBatch:
        """User-level DP on a sharded model: every rank packs its users as without
        sharding (:func:`~dptrain.data.pack_units`) and knows every other rank's packing
        (the same global batch), so all run the same passes in the same order:

        1. the chunks of whole users: the largest number any rank has, each of the
           largest size any rank has at that position. A shorter chunk ends in padding
           rows (copies of a record of the batch's first user), one unit of their own,
           the chunk's last;
        2. the users larger than a chunk, one slot each: slot m holds each rank's m-th
           such user, in the largest number of parts any rank's user at m has, each part
           of the largest size at its position. A user with fewer parts, or a shorter
           part, is padded with copies of its own first record (so its gradient is a
           function of its records alone), and a rank without an m-th large user runs
           padding only, as one unit of its own. Every rank thus accumulates one unit
           over the slot's parts (``add_to_unit``) and clips it at the same last part.

        Padding rows' losses are multiplied by 0 (:meth:`~dptrain.PrivateTraining.backward`):
        their gradient is exactly zero.
        """
        members = self.unit_members
        assert members is not None

        def packing(rank: int) -> tuple[list, list[list]]:
            share = order_for_chunks(
                shard_indices(indices, rank, self.world_size), self.chunk_key, members
            )
            whole, large = [], []
            for recs, unit in pack_units([members[u] for u in share], self.max_physical_batch_size):
                if unit.parts == 1:
                    whole.append((recs, unit))
                elif unit.part == 0:
                    large.append([recs])
                else:
                    large[-1].append(recs)
            return whole, large

        packs = [packing(r) for r in range(self.world_size)]
        filler = members[indices[0]][0] if len(indices) else 0
        pad_unit = len(mine)  # the padding rows' unit: an index no user of this batch has
        chunks, units, padding = [], [], []

        def emit(recs: list[int], pad: int, fill: int, unit: ChunkUnits) -> None:
            chunks.append(self.collate_fn([self.dataset[i] for i in [*recs, *[fill] * pad]]))
            units.append(unit)
            padding.append(pad)

        whole = [p[0] for p in packs]
        for j in range(max(len(w) for w in whole)):
            size = max(len(w[j][0]) if j < len(w) else 0 for w in whole)
            recs, unit = whole[self.rank][j] if j < len(whole[self.rank]) else ([], None)
            ids = unit.ids if unit is not None else torch.zeros(0, dtype=torch.long)
            pad = size - len(recs)
            ids = torch.cat([ids, torch.full((pad,), pad_unit, dtype=torch.long)])
            emit(recs, pad, filler, ChunkUnits(ids))
        large = [p[1] for p in packs]
        for m in range(max(len(g) for g in large)):
            slot = [g[m] if m < len(g) else [] for g in large]
            parts = max(len(user) for user in slot)
            user = slot[self.rank]
            fill = user[0][0] if user else filler
            for k in range(parts):
                size = max(len(u[k]) if k < len(u) else 0 for u in slot)
                recs = user[k] if k < len(user) else []
                ids = torch.full((size,), pad_unit if not user else m, dtype=torch.long)
                emit(recs, size - len(recs), fill, ChunkUnits(ids, k, parts))
        return RankBatch(
            chunks=chunks,
            size=sum(len(members[u]) for u in mine),
            sample_rate=q,
            step=step,
            global_size=sum(len(members[u]) for u in indices),
            rank=self.rank,
            world_size=self.world_size,
            units=units,
            num_units=len(mine),
            padding=padding,
        )

    def __len__(self) -> int:
        return len(self.sampler)

    def state_dict(self) -> dict[str, Any]:
        """The global sampler's state (the same on every rank; independent of W)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (from any world size): the same batches follow."""
        self.sampler.load_state_dict(state)
