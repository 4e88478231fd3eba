"""Where this process stands in the process group, and the configuration error every rank raises.

:func:`init_distributed` joins the group that torchrun's environment (or
:func:`~dptrain.distributed.spawn`) describes, with a timeout on every
collective, or describes one process without a group; :func:`_rank_and_world`
answers (0, 1) without a group, so the same code runs in one process.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dptrain._checks import check_positive

__all__ = ["DEFAULT_TIMEOUT_S", "DistributedConfigError", "DistributedContext", "init_distributed"]

log = logging.getLogger(__name__)

#: Default timeout of every collective (seconds): long enough for a slow rank
#: to reach the next step, short enough that a dead or misconfigured rank is
#: reported within a minute.
DEFAULT_TIMEOUT_S = 60.0


class DistributedConfigError(ValueError):
    """A rank refused its configuration, or the ranks were not given the same one.

    Raised on *every* rank (after an all-gather), so no rank waits for another.
    """


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
    ``MASTER_PORT`` (set by ``torchrun`` and by
    :func:`~dptrain.distributed.spawn`). Without ``WORLD_SIZE`` no process
    group is created and the context says rank 0 of 1, so a training script
    runs unchanged with or without torchrun. If the default process group
    already exists, it is described, not re-created.

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
