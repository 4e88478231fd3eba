"""Multi-process data-parallel DP training on ``torch.distributed``, noise added once per step.

    ctx = init_distributed()                        # torchrun's environment, or one process
    model = GPT(cfg).to(ctx.device)
    private = make_private_distributed(model, torch.optim.AdamW(model.parameters()), data,
                                       batch_size=1024, max_grad_norm=1.0, steps=1000,
                                       noise_multiplier=1.0, max_physical_batch_size=32, seed=0)
    if os.path.exists("ckpt.pt"):
        load_checkpoint("ckpt.pt", private)         # model, optimizer, sampler, noise, ledger
    for batch in private.data_loader:               # this rank's share of the logical batch
        private.optimizer.zero_grad()
        for x, y in batch.chunks:
            private.backward(per_example_cross_entropy(model(x.to(ctx.device)), y.to(ctx.device)))
        private.optimizer.step()                    # all-reduce, noise once, step, ledger
        save_checkpoint("ckpt.pt", private)         # rank 0 writes; every rank takes part

Launch with ``torchrun --nproc_per_node N script.py`` (or run ``python script.py``:
without torchrun's environment the same code trains in one process), or from
Python with :func:`spawn` (N local processes; the tests use it).

The scheme (see ``docs/distributed.md`` for the argument that it is exact)
--------------------------------------------------------------------------

Sampling. Every rank runs the *same* :class:`~dptrain.data.PoissonBatchSampler`
over the *whole* dataset (same seed on every rank, so the same global Bernoulli
mask at every step), and keeps the positions ``rank, rank + W, rank + 2W, ...``
of the sorted logical batch (:func:`shard_indices`; W = world size). The union
over ranks is therefore exactly the logical batch one process would draw with
that seed: a Poisson sample of rate q of the whole dataset, disjointly split.
Splitting the realised batch by position (rather than by record index) gives
every rank ceil(B/W) or floor(B/W) records, so no rank waits for a luckier one;
the split is a deterministic function of the sampled set and releases nothing.
Each rank cuts its share into physical chunks of ``max_physical_batch_size``.

Clipping. Each rank clips per example with its own
:class:`~dptrain.clipping.ClippingEngine` (book-keeping or ghost mode, phantom
clipping of tied embeddings): ``p.grad`` holds the rank's sum of clipped
per-example gradients. The model is *not* wrapped in
``DistributedDataParallel``: its hooks would all-reduce (and average) the
unclipped gradients of every backward pass. The clipped sums are reduced by
:class:`DistributedDPOptimizer` with ``torch.distributed.all_reduce(SUM)`` on
flattened buckets, once per logical step.

Noise. Rank 0 adds N(0, sigma^2 C^2 I) to its clipped sum *before* the
all-reduce; the other ranks add nothing. The reduced sum is
``sum_r S_r + z = S + z`` with one draw z: std sigma*C, not sqrt(W) sigma*C.
Why rank 0 rather than "every rank adds the same shared-seed noise after the
all-reduce":

- the noise exists on one rank only, so nothing depends on W generators
  producing bit-identical numbers (not guaranteed across CPU instruction sets
  or GPU models); if they differed under the shared-seed scheme, the ranks'
  models would depend on several independent noise draws of the same sum, and
  the accountant's "one Gaussian draw per step" would no longer describe the
  training;
- every rank receives the same reduced buffer from the collective, so the
  parameters stay identical by construction;
- the exact un-noised global sum never exists in any process;
- the noise generator state, like the ledger, lives on rank 0 and is saved
  with rank 0's checkpoint.

Rank 0 draws the noise exactly as :class:`~dptrain.optim.DPOptimizer` does in
one process (same generator, seed, order and shapes), so W processes and one
process given the same seed produce the same parameters up to float rounding.
Every rank then divides by the expected batch size q N and steps its optimizer.

Ledger and stopping. Every rank records each step in its ledger (the same
(q, sigma) everywhere), but rank 0's is the one that counts: at start every
rank loads rank 0's ledger, rank 0 alone decides whether the budget allows
another step and sends that decision with the gradient all-reduce (one extra
number, no extra collective), so all ranks raise
:class:`~dptrain.optim.PrivacyBudgetExhaustedError` at the same step; rank 0's
ledger is saved in the checkpoint.

No hangs. :func:`init_distributed` sets a timeout (default 60 s) on the process
group, so a collective that a rank never joins fails with an error instead of
waiting forever. :func:`make_private_distributed` checks on every rank before
building anything: each rank's local errors and a fingerprint of its
configuration (batch size, q schedule, sigma or the target, C, seed, modes,
dataset size, model parameter count and layout, optimizer hyper-parameters,
library versions) are all-gathered, and any error or difference is raised on
every rank as :class:`DistributedConfigError`, naming the ranks.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import math
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dptrain._checks import check_int, check_positive
from dptrain.accounting import PrivacyLedger
from dptrain.data.poisson import DPDataLoader, LogicalBatch, PoissonBatchSampler, split_physical
from dptrain.optim import DPOptimizer, PrivacyBudgetExhaustedError, StepMetrics
from dptrain.privacy_engine import PrivateTraining, _PrivateLoader, make_private

__all__ = [
    "CheckpointError",
    "DistributedConfigError",
    "DistributedContext",
    "DistributedDPDataLoader",
    "DistributedDPOptimizer",
    "DistributedRunError",
    "RankBatch",
    "init_distributed",
    "load_checkpoint",
    "make_private_distributed",
    "save_checkpoint",
    "shard_indices",
    "spawn",
]

log = logging.getLogger(__name__)

#: Default timeout of every collective (seconds): long enough for a slow rank
#: to reach the next step, short enough that a dead or misconfigured rank is
#: reported within a minute.
DEFAULT_TIMEOUT_S = 60.0

_CHECKPOINT_VERSION = 1
_CHECKPOINT_KIND = "dptrain-checkpoint"


class DistributedConfigError(ValueError):
    """A rank refused its configuration, or the ranks were not given the same one.

    Raised on *every* rank (after an all-gather), so no rank waits for another.
    """


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read, or the ranks' states differ."""


class DistributedRunError(RuntimeError):
    """Some processes started by :func:`spawn` failed.

    Attributes:
        errors: rank -> "ExceptionType: message" (with the traceback after a newline).
        results: rank -> return value, for the ranks that returned.
    """

    def __init__(self, message: str, errors: dict[int, str], results: dict[int, Any]):
        super().__init__(message)
        self.errors = errors
        self.results = results


# -- process groups ------------------------------------------------------------------------


@dataclass(frozen=True)
class DistributedContext:
    """Where this process stands: its rank, the world size and its device."""

    rank: int
    world_size: int
    local_rank: int
    backend: str | None
    """``gloo``/``nccl``, or None for one process without a process group."""
    device: torch.device

    @property
    def is_main(self) -> bool:
        """True on rank 0 (the rank that logs, holds the ledger and writes checkpoints)."""
        return self.rank == 0


def _env_int(name: str, default: int, minimum: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ValueError(
            f"environment variable {name}={raw!r} is not allowed: expected an integer >= {minimum}"
        )
    return value


def init_distributed(
    backend: str | None = None, timeout: float = DEFAULT_TIMEOUT_S
) -> DistributedContext:
    """Join the process group described by torchrun's environment; one process without it.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and
    ``MASTER_PORT`` (set by ``torchrun`` and by :func:`spawn`). Without
    ``WORLD_SIZE`` no process group is created and the context says rank 0 of
    1, so a training script runs unchanged with or without torchrun. If the
    default process group already exists, it is described, not re-created.

    Args:
        backend: ``"gloo"`` (CPU) or ``"nccl"`` (CUDA); default nccl when CUDA
            is available, else gloo. With nccl the process uses ``cuda:LOCAL_RANK``.
        timeout: seconds any collective may wait for the other ranks before it
            fails (also the rendezvous timeout): a dead or misconfigured rank
            gives an error, never a hang.
    """
    timeout = check_positive("timeout", timeout)
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of PyTorch")
    if dist.is_initialized():
        backend = str(dist.get_backend())
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = _env_int("LOCAL_RANK", rank, 0)
        return DistributedContext(
            rank, world, local_rank, backend, _device_for(backend, local_rank)
        )
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend={backend!r} is not allowed: expected 'gloo' or 'nccl'")
    if backend == "nccl" and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ValueError("backend='nccl' is not allowed here: CUDA or NCCL is not available")
    if "WORLD_SIZE" not in os.environ:
        return DistributedContext(0, 1, 0, None, _device_for(backend, 0))
    world = _env_int("WORLD_SIZE", 1, 1)
    rank = _env_int("RANK", 0, 0)
    local_rank = _env_int("LOCAL_RANK", rank, 0)
    if rank >= world:
        raise ValueError(f"RANK={rank} is not allowed: expected an integer < WORLD_SIZE={world}")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if name not in os.environ:
            raise ValueError(
                f"environment variable {name} is not set: launch with torchrun (or "
                "dptrain.distributed.spawn), which sets it"
            )
    device = _device_for(backend, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
    )
    if rank == 0:
        log.info("process group: %s, world size %d, timeout %gs", backend, world, timeout)
    return DistributedContext(rank, world, local_rank, backend, device)


def _device_for(backend: str, local_rank: int) -> torch.device:
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _rank_and_world(group: Any = None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise ValueError(f"group={group!r} is not allowed: no process group is initialised")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


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


# -- flattened collectives -----------------------------------------------------------------


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


def _broadcast_module_state(model: nn.Module, group: Any, cap_bytes: int) -> None:
    """Give every rank rank 0's parameters and buffers (as DDP does at construction)."""
    _, world = _rank_and_world(group)
    if world == 1:
        return
    tensors = [p.data for p in model.parameters()] + [b for b in model.buffers()]
    src = _src(group)
    _flat_collective(
        tensors, cap_bytes, lambda flat: dist.broadcast(flat, src=src, group=group, async_op=True)
    )


# -- sampling ------------------------------------------------------------------------------


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
            base, max_physical_batch_size, global_physical_batch_size, rank, world_size, group
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
    ) -> DistributedDPDataLoader:
        """Shard an existing :class:`~dptrain.data.DPDataLoader` (its sampler is shared, not copied).

        Without a chunk size, each rank uses ceil(loader's chunk size / W).
        """
        self = cls.__new__(cls)
        self._init_from(
            loader, max_physical_batch_size, global_physical_batch_size, rank, world_size, group
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

    @property
    def seed(self) -> int | None:
        """The shared sampling seed."""
        return self.sampler.seed

    def expected_batch_size(self, step: int) -> float:
        """Mean size of the whole logical batch at ``step``: q N (over all ranks)."""
        return self.sampler.sample_rate_at(step) * self.dataset_size

    def __iter__(self) -> Iterator[RankBatch]:
        for indices in self.sampler:  # the global batch, the same on every rank
            step = self.sampler.steps_drawn - 1
            mine = shard_indices(indices, self.rank, self.world_size)
            chunks = [
                self.collate_fn([self.dataset[i] for i in chunk])
                for chunk in split_physical(mine, self.max_physical_batch_size)
            ]
            yield RankBatch(
                chunks=chunks,
                size=len(mine),
                sample_rate=self.sampler.sample_rate_at(step),
                step=step,
                global_size=len(indices),
                rank=self.rank,
                world_size=self.world_size,
            )

    def __len__(self) -> int:
        return len(self.sampler)

    def state_dict(self) -> dict[str, Any]:
        """The global sampler's state (the same on every rank; independent of W)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict` (from any world size): the same batches follow."""
        self.sampler.load_state_dict(state)


# -- the optimizer -------------------------------------------------------------------------


class DistributedDPOptimizer(DPOptimizer):
    """:class:`~dptrain.optim.DPOptimizer` over W processes: all-reduce, noise once on rank 0.

    ``step()`` on every rank, after every rank's engine has added its clipped
    sums into ``p.grad``:

    1. rank 0 checks the budget (``max_steps``, its ledger) and, if a step is
       allowed, adds N(0, sigma^2 C^2 K^2) to its ``p.grad`` (K: loss scale),
       drawn as the one-process optimizer draws it;
    2. all ranks all-reduce (SUM) the gradients in flattened buckets, with
       rank 0's stop flag alongside; if rank 0 said stop, every rank raises
       :class:`~dptrain.optim.PrivacyBudgetExhaustedError`;
    3. every rank divides by K q N, steps the wrapped optimizer and records the
       step in its ledger (rank 0's ledger is the one checkpoints keep).

    With W = 1 this is exactly :class:`~dptrain.optim.DPOptimizer`.

    Args:
        optimizer, noise_multiplier, max_grad_norm, expected_batch_size,
        sample_rate, ledger, max_steps: as for DPOptimizer (``max_steps`` is
            read on rank 0 only).
        seed: the noise seed (rank 0 draws the noise). Give every rank the same
            value; with W > 1 an integer is required.
        group: the process group (default: the default group).
        bucket_cap_mb: size of the flattened all-reduce buckets.
        engine: the clipping engine, as for DPOptimizer (gradients checked before the step).

    ``last_metrics`` is exact on rank 0 (the clipped-sum norm is recovered by
    redrawing the noise from the generator state it started from); on the
    other ranks, which never see the noise, its norms are NaN.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        sample_rate: float,
        ledger: PrivacyLedger | None = None,
        seed: int | None = None,
        max_steps: int | None = None,
        group: Any = None,
        bucket_cap_mb: float = 25.0,
        engine: Any = None,
    ):
        self.rank, self.world_size = _rank_and_world(group)
        if self.world_size > 1 and (
            seed is None or isinstance(seed, bool) or not isinstance(seed, int)
        ):
            raise ValueError(
                f"seed={seed!r} is not allowed with world_size={self.world_size}: expected an "
                "integer, the same on every rank (make_private_distributed shares rank 0's)"
            )
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            sample_rate=sample_rate,
            ledger=ledger,
            seed=seed,
            max_steps=max_steps,
            engine=engine,
        )
        self.group = group
        self.bucket_cap_bytes = int(check_positive("bucket_cap_mb", bucket_cap_mb) * 2**20)

    def all_reduce_clipped_sums(self) -> None:
        """Refused with W > 1: call :meth:`step`, which reduces and adds the noise once."""
        if self.world_size > 1:
            raise RuntimeError(
                "all_reduce_clipped_sums() is not allowed on its own with world_size > 1: call "
                "step(), which adds the noise on rank 0 before the all-reduce"
            )

    def add_noise(self, loss_scale: float = 1.0) -> StepMetrics:
        """Refused with W > 1 (noise on every rank would be sqrt(W) too much): call :meth:`step`."""
        if self.world_size > 1:
            raise RuntimeError(
                "add_noise() is not allowed on its own with world_size > 1: every rank would add "
                "noise; call step(), which adds it once"
            )
        return super().add_noise(loss_scale)

    def step(self, closure=None, loss_scale: float = 1.0) -> StepMetrics:  # type: ignore[override]
        """All-reduce the clipped sums with rank 0's noise, step every rank, record the step."""
        if self.world_size == 1:
            return super().step(closure, loss_scale)
        if closure is not None:
            raise ValueError(
                "closure= is not supported: a DP step must not re-evaluate the loss on the batch"
            )
        k = check_positive("loss_scale", loss_scale)
        self.check_clipped_gradients()
        params = [p for p in self.params() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        device = params[0].device if params else torch.device("cpu")
        stop = self.rank == 0 and self.max_steps is not None and self.steps_taken >= self.max_steps
        std = self.noise_multiplier * self.max_grad_norm * k
        start_states: dict[torch.device, Tensor] = {}
        noise_sq = math.nan
        if self.rank == 0 and not stop:
            noise_sq = 0.0
            for p in params:
                gen = self._generator_for(p.device)
                start_states.setdefault(p.device, gen.get_state())
                noise = torch.empty_like(p).normal_(0.0, std, generator=gen)
                noise_sq += _sq_norm(noise)
                p.grad.add_(noise)
        # Rank 0's decision rides in the first gradient bucket (same device and dtype).
        dtype = params[0].dtype if params else torch.float32
        flag = torch.tensor([1.0 if stop else 0.0], dtype=dtype, device=device)
        group = self.group
        grads = [p.grad for p in params]
        _flat_collective(
            [flag, *grads],
            self.bucket_cap_bytes,
            lambda flat: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True),
        )
        if float(flag) != 0.0:
            # The reduced sums hold every rank's un-noised data: drop them.
            self.original_optimizer.zero_grad(set_to_none=True)
            raise PrivacyBudgetExhaustedError(
                f"the privacy budget allows {self.max_steps} steps and all are taken; rank 0 "
                f"stopped every rank (epsilon is computed from rank 0's ledger: {self.ledger!r})"
            )
        signal_sq = math.nan
        if self.rank == 0:
            signal_sq = self._signal_sq(params, start_states, std)
        for p in params:
            p.grad.div_(k * self.expected_batch_size)
        self.original_optimizer.step()
        self.ledger.record(self.sample_rate, self.noise_multiplier)
        metrics = StepMetrics(
            step=self.steps_taken,
            sample_rate=self.sample_rate,
            noise_multiplier=self.noise_multiplier,
            clipped_sum_norm=math.sqrt(max(signal_sq, 0.0)) / k
            if not math.isnan(signal_sq)
            else math.nan,
            noise_norm=math.sqrt(noise_sq) / k if not math.isnan(noise_sq) else math.nan,
        )
        self.steps_taken += 1
        self.last_metrics = metrics
        return metrics

    def _signal_sq(
        self, params: list[nn.Parameter], start_states: dict[torch.device, Tensor], std: float
    ) -> float:
        """||reduced sum - noise||^2, redrawing the noise from the states it started from."""
        gens = {}
        for d, state in start_states.items():
            g = torch.Generator(device=d)
            g.set_state(state)
            gens[d] = g
        total = 0.0
        for p in params:
            noise = torch.empty_like(p).normal_(0.0, std, generator=gens[p.device])
            total += _sq_norm(p.grad.detach() - noise)
        return total

    def load_state_dict(self, state: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a DPOptimizer state; CUDA noise generators follow this rank's CUDA device."""
        cuda = [p.device for p in self.params() if p.device.type == "cuda"]
        gens = {}
        for key, gen_state in state["generators"].items():
            if torch.device(key).type == "cuda" and cuda:
                key = str(cuda[0])
            gens[key] = gen_state
        super().load_state_dict({**state, "generators": gens})

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", rank={self.rank}, world_size={self.world_size})"


def _sq_norm(t: Tensor) -> float:
    t = t.detach()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return float(torch.linalg.vector_norm(t)) ** 2


# -- make_private over several processes -------------------------------------------------------


def _short(text: str, limit: int = 120) -> str:
    if len(text) <= limit:
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_layout(model: nn.Module) -> tuple[int, str]:
    """(trainable parameter count, digest of every parameter's and buffer's name/shape/dtype)."""
    h = hashlib.sha256()
    count = 0
    for name, p in model.named_parameters():
        h.update(f"p {name} {tuple(p.shape)} {p.dtype} {p.requires_grad};".encode())
        if p.requires_grad:
            count += p.numel()
    for name, b in model.named_buffers():
        h.update(f"b {name} {tuple(b.shape)} {b.dtype};".encode())
    return count, h.hexdigest()[:16]


def _optimizer_summary(optimizer: torch.optim.Optimizer) -> str:
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"n_params": len(g["params"])}
        for g in optimizer.param_groups
    ]
    return _short(f"{type(optimizer).__name__}{groups!r}")


def _config_fingerprint(
    model: nn.Module, optimizer: torch.optim.Optimizer, data: Any, settings: dict[str, Any]
) -> dict[str, str]:
    """What every rank must agree on, as strings (compared for equality)."""
    import dptrain

    fp = {}
    for key, value in settings.items():
        if key == "batch_size" and callable(value):
            steps = settings.get("steps")
            if isinstance(steps, int) and steps > 0:
                sizes = [value(t) for t in range(steps)]
                fp[key] = _short(f"schedule {sizes!r}")
            else:
                fp[key] = "schedule"
        else:
            fp[key] = _short(repr(value))
    dataset = getattr(data, "dataset", data)
    fp["dataset_size"] = repr(len(dataset))
    count, layout = _model_layout(model)
    fp["model_parameters"] = repr(count)
    fp["model_layout"] = layout
    fp["optimizer"] = _optimizer_summary(optimizer)
    fp["versions"] = f"torch {torch.__version__}, dptrain {dptrain.__version__}"
    return fp


def make_private_distributed(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Any,
    *,
    batch_size: int | Callable[[int], int],
    max_grad_norm: float,
    epochs: float | None = None,
    steps: int | None = None,
    target_epsilon: float | None = None,
    target_delta: float | None = None,
    noise_multiplier: float | None = None,
    clipping: str = "flat",
    mode: str = "book_keeping",
    norm_method: str = "auto",
    accountant: str = "pld",
    max_physical_batch_size: int | None = None,
    global_physical_batch_size: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    seed: int | None = None,
    privacy_unit: str = "example",
    ledger: PrivacyLedger | None = None,
    group: Any = None,
    bucket_cap_mb: float = 25.0,
) -> PrivateTraining:
    """:func:`~dptrain.make_private` for each of W processes: call it on every rank alike.

    The arguments are :func:`~dptrain.make_private`'s, with:

    Args:
        batch_size: the expected size B of the whole logical batch (all ranks
            together), or a schedule step -> B; q = B / N.
        max_physical_batch_size: most records one rank puts through the model
            at once (default: ceil(B / W)); or
        global_physical_batch_size: the same over all ranks together; it must
            be a multiple of W (each rank takes its W-th part), so that a
            configuration written for one process keeps its chunking.
        seed: the sampling and noise seed; None: rank 0 draws one from the OS
            and every rank uses it (logged on rank 0).
        ledger: continue this ledger (read on rank 0; every rank gets a copy).
        group: the process group (default: the default group; none: one process).
        bucket_cap_mb: size of the flattened all-reduce buckets.

    Before building anything every rank's configuration is checked against
    the others' (:class:`DistributedConfigError` on every rank if a rank
    refuses its arguments or they differ); then rank 0's parameters and
    buffers are broadcast to all ranks. The model is not wrapped in DDP.

    Returns the :class:`~dptrain.PrivateTraining` of this rank, whose
    ``optimizer`` is a :class:`DistributedDPOptimizer` and whose
    ``data_loader`` yields this rank's :class:`RankBatch` es.
    """
    rank, world = _rank_and_world(group)
    what = "make_private_distributed"
    settings = {
        "batch_size": batch_size,
        "max_grad_norm": max_grad_norm,
        "epochs": epochs,
        "steps": steps,
        "target_epsilon": target_epsilon,
        "target_delta": target_delta,
        "noise_multiplier": noise_multiplier,
        "clipping": clipping,
        "mode": mode,
        "norm_method": norm_method,
        "accountant": accountant,
        "max_physical_batch_size": max_physical_batch_size,
        "global_physical_batch_size": global_physical_batch_size,
        "seed": seed,
        "privacy_unit": privacy_unit,
        "bucket_cap_mb": bucket_cap_mb,
    }
    # 1. Agree on the configuration, the seed and the ledger (one all-gather).
    local_error: BaseException | None = None
    fingerprint: dict[str, str] = {}
    chunk: int | None = None
    try:
        chunk = _per_rank_chunk(max_physical_batch_size, global_physical_batch_size, world)
        fingerprint = _config_fingerprint(model, optimizer, data, settings)
    except Exception as exc:
        local_error = exc
    proposal = None
    if rank == 0:
        drawn = seed if seed is not None else torch.Generator().seed()
        ledger0 = ledger if ledger is not None else PrivacyLedger(privacy_unit=privacy_unit)
        proposal = (drawn, ledger0.state_dict())
    payloads = _raise_on_every_rank(what, local_error, fingerprint, group, proposal)
    shared_seed, ledger_state = payloads[0]
    if seed is None and rank == 0:
        log.info("sampling and noise seed %d (drawn from the OS on rank 0)", shared_seed)
    local_ledger = ledger if ledger is not None else PrivacyLedger(privacy_unit=privacy_unit)
    local_ledger.load_state_dict(ledger_state)

    # 2. Build locally; any failure is raised on every rank.
    local_error = None
    private: PrivateTraining | None = None
    result: PrivateTraining | None = None
    resolved: dict[str, str] = {}
    try:
        private = make_private(
            model,
            optimizer,
            data,
            batch_size=batch_size,
            max_grad_norm=max_grad_norm,
            epochs=epochs,
            steps=steps,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            noise_multiplier=noise_multiplier,
            clipping=clipping,
            mode=mode,
            norm_method=norm_method,
            accountant=accountant,
            max_physical_batch_size=chunk,
            collate_fn=collate_fn,
            seed=shared_seed,
            privacy_unit=privacy_unit,
            ledger=local_ledger,
        )
        base_opt = private.optimizer
        loader = DistributedDPDataLoader.from_loader(
            private.data_loader.loader, max_physical_batch_size=chunk, group=group
        )
        dp_optimizer = DistributedDPOptimizer(
            base_opt.original_optimizer,
            noise_multiplier=base_opt.noise_multiplier,
            max_grad_norm=base_opt.max_grad_norm,
            expected_batch_size=base_opt.expected_batch_size,
            sample_rate=base_opt.sample_rate,
            ledger=local_ledger,
            seed=shared_seed,
            max_steps=base_opt.max_steps,
            group=group,
            bucket_cap_mb=bucket_cap_mb,
            engine=private.engine,
        )
        result = PrivateTraining(
            model=model,
            optimizer=dp_optimizer,
            data_loader=_PrivateLoader(loader, dp_optimizer),  # type: ignore[arg-type]
            engine=private.engine,
            ledger=local_ledger,
            noise_multiplier=private.noise_multiplier,
            target_delta=private.target_delta,
            accountant=private.accountant,
            steps=private.steps,
        )
        resolved = {
            "noise_multiplier (resolved)": repr(private.noise_multiplier),
            "steps (resolved)": repr(private.steps),
            "sample_rate (first step)": repr(base_opt.sample_rate),
            "max_steps": repr(base_opt.max_steps),
        }
    except Exception as exc:
        local_error = exc
        if private is not None:
            private.engine.detach()
    try:
        _raise_on_every_rank(what, local_error, resolved, group)
    except DistributedConfigError:
        if private is not None and local_error is None:
            private.engine.detach()
        raise
    assert result is not None
    # 3. Start from rank 0's parameters.
    _broadcast_module_state(model, group, dp_optimizer.bucket_cap_bytes)
    if rank == 0:
        log.info(
            "private training on %d process(es): sigma=%.4g, C=%g, q=%.4g, %d steps, "
            "%d records per chunk per rank",
            world,
            result.noise_multiplier,
            max_grad_norm,
            dp_optimizer.sample_rate,
            result.steps,
            result.data_loader.loader.max_physical_batch_size,
        )
    return result


# -- checkpoints -------------------------------------------------------------------------------


def _digest(obj: Any, h: Any = None) -> str:
    """A stable digest of nested dicts/lists/tensors/scalars (tensor bytes included)."""
    top = h is None
    h = hashlib.sha256() if h is None else h
    if isinstance(obj, Tensor):
        t = obj.detach().reshape(-1).cpu().contiguous()
        h.update(f"T{t.dtype}{t.numel()}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _digest(obj[key], h)
        h.update(b"}")
    elif isinstance(obj, list | tuple):
        h.update(b"[")
        for item in obj:
            _digest(item, h)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())
    return h.hexdigest()[:16] if top else ""


def _sampler_of(private: PrivateTraining) -> PoissonBatchSampler:
    return private.data_loader.loader.sampler


def _run_config(private: PrivateTraining) -> dict[str, Any]:
    """What a resumed run must share with the run that saved the checkpoint."""
    sampler = _sampler_of(private)
    rates = [sampler.sample_rate_at(t) for t in range(sampler.steps)]
    return {
        "dataset_size": sampler.dataset_size,
        "steps": sampler.steps,
        "sample_rates": _short(repr(rates), limit=80),
        "noise_multiplier": private.optimizer.noise_multiplier,
        "max_grad_norm": private.optimizer.max_grad_norm,
        "privacy_unit": private.ledger.privacy_unit,
    }


def _rng_state() -> dict[str, Any]:
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def save_checkpoint(
    path: str | os.PathLike,
    private: PrivateTraining,
    *,
    extra: dict[str, Any] | None = None,
    group: Any = None,
) -> None:
    """Save the whole training state to ``path``; call between steps, on every rank.

    Saved (by rank 0, atomically: a temporary file renamed over ``path``):
    the model, the optimizer (wrapped optimizer's state, steps taken, noise seed
    and generator state, rank 0's ledger), the sampler (generator state, steps
    drawn), every rank's torch RNG state (dropout), the run's configuration and
    ``extra`` (e.g. an LR scheduler's ``state_dict()``; plain types and tensors).
    Works for :func:`make_private` and :func:`make_private_distributed`.

    The ranks first compare digests of their model, optimizer state, ledger and
    sampler: if they differ, no file is written and :class:`CheckpointError`
    is raised on every rank.
    """
    rank, world = _rank_and_world(group)
    local_error: BaseException | None = None
    parts: dict[str, str] = {}
    try:
        opt = private.optimizer
        sampler = _sampler_of(private)
        if sampler.steps_drawn != opt.steps_taken:
            raise ValueError(
                f"save_checkpoint was called in the middle of a step: the sampler has drawn "
                f"{sampler.steps_drawn} batches and the optimizer has taken {opt.steps_taken} "
                "steps; save between steps (after optimizer.step())"
            )
        parts = {
            "model": _digest(private.model.state_dict()),
            "optimizer": _digest(opt.original_optimizer.state_dict()),
            "ledger": _digest(private.ledger.state_dict()),
            "steps_taken": repr(opt.steps_taken),
            "sampler": _digest(sampler.state_dict()),
        }
    except Exception as exc:
        local_error = exc
    rng_states = _raise_on_every_rank(
        "save_checkpoint", local_error, parts, group, _rng_state(), error_type=CheckpointError
    )
    status = None
    if rank == 0:
        try:
            state = {
                "kind": _CHECKPOINT_KIND,
                "format_version": _CHECKPOINT_VERSION,
                "world_size": world,
                "step": private.optimizer.steps_taken,
                "config": _run_config(private),
                "model": private.model.state_dict(),
                "optimizer": private.optimizer.state_dict(),
                "sampler": _sampler_of(private).state_dict(),
                "ledger": private.ledger.state_dict(),
                "rng": rng_states,
                "extra": {} if extra is None else extra,
            }
            _atomic_save(state, Path(path))
        except Exception as exc:
            status = f"could not write checkpoint path={str(path)!r}: {_describe(exc)}"
            log.error("%s", status)
    status = _broadcast_object(status, group)
    if status is not None:
        raise CheckpointError(f"rank 0 {status}")


def _atomic_save(state: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    with contextlib.suppress(OSError):  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(
    path: str | os.PathLike, private: PrivateTraining, *, group: Any = None
) -> dict[str, Any]:
    """Restore a :func:`save_checkpoint` into ``private``; call on every rank; returns ``extra``.

    Rank 0 reads the file and broadcasts it (no shared file system needed).
    ``private`` must come from the same configuration (same dataset size,
    steps, sample rates, sigma, C, privacy unit), else
    :class:`DistributedConfigError` on every rank; the world size may differ
    (sampling and noise do not depend on it), only the per-rank RNG states
    used by dropout are then not restored. The restored ledger continues: a
    crash never resets the budget.
    """
    rank, _ = _rank_and_world(group)
    loaded: tuple[str | None, dict[str, Any] | None] = (None, None)
    if rank == 0:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or state.get("kind") != _CHECKPOINT_KIND:
                raise ValueError("not a dptrain checkpoint (no kind='dptrain-checkpoint')")
            version = state.get("format_version")
            if version != _CHECKPOINT_VERSION:
                raise ValueError(
                    f"format_version={version!r} is not supported: expected {_CHECKPOINT_VERSION}"
                )
            loaded = (None, state)
        except Exception as exc:
            loaded = (f"could not read checkpoint path={str(path)!r}: {_describe(exc)}", None)
    error, state = _broadcast_object(loaded, group)
    if error is not None or state is None:
        raise CheckpointError(f"rank 0 {error}")
    saved, current = state["config"], _run_config(private)
    diffs = [
        f"{k}={saved.get(k)!r} in the checkpoint, {current[k]!r} in this run"
        for k in current
        if saved.get(k) != current[k]
    ]
    if diffs:
        raise DistributedConfigError(
            f"checkpoint path={str(path)!r} does not match this run (a resumed run must use "
            "the configuration it was saved with): " + "; ".join(diffs)
        )
    private.model.load_state_dict(state["model"])
    private.optimizer.load_state_dict(state["optimizer"])
    private.data_loader.load_state_dict(state["sampler"])
    rank_now, world_now = _rank_and_world(group)
    if state["world_size"] == world_now:
        rng = state["rng"][rank_now]
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    elif rank_now == 0:
        log.warning(
            "checkpoint saved with %d process(es), resumed with %d: sampling and noise continue "
            "exactly; dropout's random streams do not",
            state["world_size"],
            world_now,
        )
    if rank_now == 0:
        log.info("resumed from %s at step %d (%r)", path, state["step"], private.ledger)
    return state.get("extra", {})


# -- local launcher ----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn_entry(
    rank: int,
    world: int,
    port: int,
    backend: str,
    timeout: float,
    threads: int | None,
    fn: Callable[..., Any],
    args: tuple,
    results: Any,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        init_distributed(backend, timeout)
        value = fn(*args)
        message = (rank, True, pickle.dumps(value))
    except BaseException as exc:
        message = (rank, False, _describe(exc) + "\n" + traceback.format_exc())
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    results.put(message)


def spawn(
    fn: Callable[..., Any],
    nprocs: int,
    args: tuple = (),
    *,
    backend: str = "gloo",
    timeout: float = DEFAULT_TIMEOUT_S,
    join_timeout: float | None = None,
    num_threads: int | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` fresh local processes that form one process group.

    Each process gets torchrun's environment variables (a free local port),
    joins the group with :func:`init_distributed` (``backend``, ``timeout``),
    runs ``fn`` and leaves the group. ``fn`` and ``args`` must be picklable
    (a module-level function). Returns the ranks' return values, in rank order.

    Every rank's failure is reported, not only the first: if any rank raised
    (or died), :class:`DistributedRunError` lists each rank's error. A rank
    stuck in a collective fails after ``timeout``; ``join_timeout`` (seconds)
    additionally bounds the whole run (processes still alive are terminated).
    ``num_threads``: torch threads per process (default: CPU cores / nprocs).
    """
    nprocs = check_int("nprocs", nprocs, 1)
    timeout = check_positive("timeout", timeout)
    if join_timeout is not None:
        join_timeout = check_positive("join_timeout", join_timeout)
    threads = num_threads if num_threads is not None else max(1, (os.cpu_count() or 1) // nprocs)
    threads = check_int("num_threads", threads, 1)
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_spawn_entry,
            args=(rank, nprocs, port, backend, timeout, threads, fn, args, results),
            daemon=False,
        )
        for rank in range(nprocs)
    ]
    for p in procs:
        p.start()
    deadline = None if join_timeout is None else time.monotonic() + join_timeout
    values: dict[int, Any] = {}
    errors: dict[int, str] = {}
    dead_since: dict[int, float] = {}
    try:
        while len(values) + len(errors) < nprocs:
            try:
                rank, ok, payload = results.get(timeout=0.1)
            except queue.Empty:
                now = time.monotonic()
                for r, p in enumerate(procs):
                    if r in values or r in errors or p.is_alive():
                        continue
                    # A process that reported has flushed its message before exiting;
                    # allow a moment for it to arrive before calling the rank dead.
                    if now - dead_since.setdefault(r, now) > 2.0:
                        errors[r] = f"exited with code {p.exitcode} without reporting"
                if deadline is not None and now > deadline:
                    for r in range(nprocs):
                        if r not in values and r not in errors:
                            errors[r] = f"still running after join_timeout={join_timeout}s"
                    break
                continue
            if ok:
                values[rank] = pickle.loads(payload)
            else:
                errors[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=5.0)
            if p.is_alive():
                p.terminate()
                p.join()
    if errors:
        summary = "; ".join(
            f"rank {r}: {errors[r].splitlines()[0] if errors[r] else ''}" for r in sorted(errors)
        )
        raise DistributedRunError(
            f"{len(errors)} of {nprocs} processes failed: {summary}", errors, values
        )
    return [values[r] for r in range(nprocs)]
