"""The local launcher: :func:`spawn` runs a function in N fresh processes that form one group.

Each process gets torchrun's environment (a free local port) and joins with
:func:`~dptrain.distributed.init_distributed`; every rank's failure is
reported, not only the first (the tests use it).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from dptrain._checks import check_int, check_positive
from dptrain.distributed.collectives import _describe
from dptrain.distributed.context import DEFAULT_TIMEOUT_S, init_distributed

__all__ = ["DistributedRunError", "spawn"]


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
