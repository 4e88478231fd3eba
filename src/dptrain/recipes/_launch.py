"""Running a recipe on one process or, under torchrun, on several.

The recipes read torchrun's environment: with ``WORLD_SIZE`` unset or 1 they
run exactly as a plain one-process run (no process group); with
``WORLD_SIZE`` > 1 (``torchrun --nproc_per_node N`` or ``dptrain train
--nproc N``) :func:`launch` joins the process group once, the private
training goes through :func:`~dptrain.distributed.make_private_distributed`,
and only rank 0 writes the run folder and shows the progress bar.

The recipes train on the CPU, so the group is always gloo. Its timeout is
longer than :data:`dptrain.distributed.DEFAULT_TIMEOUT_S`: every rank does
the recipe's setup (data, noise calibration, frozen-encoder features) and
evaluations itself, between two collectives, and on a loaded machine the
ranks can drift apart by more than a minute there. A rank that dies is
noticed sooner anyway: torchrun stops the other workers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["RECIPE_TIMEOUT_S", "Launch", "env_world_size", "launch", "refuse_several_processes"]

#: Timeout (seconds) of the recipes' collectives (see the module docstring).
RECIPE_TIMEOUT_S = 600.0


def env_world_size() -> int:
    """The number of processes torchrun started (``WORLD_SIZE``); 1 without torchrun."""
    raw = os.environ.get("WORLD_SIZE")
    if raw is None or raw.strip() == "":
        return 1
    try:
        world = int(raw)
    except ValueError:
        world = 0
    if world < 1:
        raise ValueError(
            f"environment variable WORLD_SIZE={raw!r} is not allowed: expected an integer >= 1"
        )
    return world


def refuse_several_processes(setting: str, reason: str, world_size: int | None = None) -> None:
    """Raise ``ValueError`` (the same on every rank) if the world size is > 1.

    For the parts of a recipe that run in one process only: under torchrun
    they would otherwise run W independent copies of the same run.
    ``world_size``: default ``WORLD_SIZE`` (:func:`env_world_size`); ``dptrain
    train --nproc N`` checks N before it starts torchrun.
    """
    world = env_world_size() if world_size is None else world_size
    if world > 1:
        raise ValueError(f"{setting} is not allowed with WORLD_SIZE={world}: {reason}")


@dataclass(frozen=True)
class Launch:
    """This process's place in the run: rank 0 of 1 without torchrun."""

    rank: int = 0
    world_size: int = 1
    owns_group: bool = False
    """True when :func:`launch` created the process group (:meth:`close` destroys it)."""

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that writes the run folder and shows the progress bar."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def sum(self, *values: float) -> list[float]:
        """The sums of ``values`` over the ranks (float64); a collective: every rank calls it."""
        if not self.distributed:
            return [float(v) for v in values]
        total = torch.tensor([float(v) for v in values], dtype=torch.float64)
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        return total.tolist()

    def close(self) -> None:
        """Leave the process group if :func:`launch` created it (not a collective)."""
        if self.owns_group and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def launch() -> Launch:
    """Join torchrun's process group (gloo) if ``WORLD_SIZE`` > 1; else a one-process run.

    Call it once, on every rank, before the first collective. An existing
    default group (e.g. from :func:`dptrain.distributed.spawn`) is used, not
    re-created; it must be gloo, since the recipes keep their tensors on the CPU.
    """
    if env_world_size() == 1:
        return Launch()
    from dptrain.distributed import init_distributed

    owns = not (dist.is_available() and dist.is_initialized())
    ctx = init_distributed(backend="gloo", timeout=RECIPE_TIMEOUT_S)
    if ctx.backend != "gloo":
        raise ValueError(
            f"the process group's backend {ctx.backend!r} is not allowed: the recipes train "
            "on the CPU and need 'gloo'"
        )
    return Launch(ctx.rank, ctx.world_size, owns)
