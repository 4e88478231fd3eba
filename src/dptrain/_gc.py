"""Python's cyclic garbage collector, held off while the engine's backward runs.

The engine's backward allocates thousands of small tracked objects that it drops again
at its end (the Python wrappers of the autograd nodes its graph walks hold, the calls'
records). Each 700 net allocations start a collection; every tenth of those scans the
next generation, and every tenth of those everything the process holds (the model's
modules and parameters included). On a tied Llama at SmolLM2-135M's depth that was about
20 collections per private step and 23-25 ms of its host time on average, in pauses of
up to 270 ms (benchmarks/host_overhead.py; non-private steps: none). Held off, the
collections that follow find the backward's objects already freed by reference counting.
Only garbage in reference cycles waits, and only until the backward returns.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

__all__ = ["collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside the block; the collector's state before it is
    restored after it (also when the block raises; a collector the caller disabled stays
    disabled)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
