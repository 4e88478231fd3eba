"""Time per training step, measured so that methods can be compared.

What is measured: the wall time of one full training step (forward, loss,
backward, optimizer step) of each method on the same workload in the same
process. Why this way:

- the thread count is fixed (:func:`fix_threads`, default 1): a CPU step's
  time depends on how many cores it gets, and the machine may be shared;
- each method first runs warm-up steps (allocator caches, lazy
  initialisation, Opacus' hooks, autotuning on CUDA) that are not timed;
- the timed steps are interleaved round-robin, one step of every method per
  round, with the starting method rotating each round: slow drift of the
  machine's speed (other load, thermal limits) then hits all methods alike
  instead of whichever happened to run last;
- the summary is the median (robust to a stray slow step) with the
  interquartile range as the spread; ratios are taken to the non-private
  median of the same run;
- on CUDA every step ends with ``torch.cuda.synchronize()`` before the clock
  is read (kernels run asynchronously).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from dptrain.bench.workloads import first_line

__all__ = ["StepTimes", "TimingSummary", "fix_threads", "summarize", "time_round_robin"]


def fix_threads(threads: int) -> int:
    """``torch.set_num_threads(threads)`` after checking it; returns the count set."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads={threads!r} is not allowed: expected an integer >= 1")
    torch.set_num_threads(threads)
    return threads


@dataclass
class TimingSummary:
    """Median and quartiles of the timed steps of one method, in seconds."""

    median_s: float
    q1_s: float
    q3_s: float
    steps: int


def summarize(times: list[float]) -> TimingSummary:
    """Median and interquartile range (inclusive quartiles) of step times."""
    if not times:
        raise ValueError("times=[] is not allowed: expected at least one step time")
    if len(times) == 1:
        return TimingSummary(times[0], times[0], times[0], 1)
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return TimingSummary(statistics.median(times), q1, q3, len(times))


@dataclass
class StepTimes:
    """The result of :func:`time_round_robin`.

    Attributes:
        times: method -> wall times of its timed steps (warm-up excluded).
        errors: method -> the first line of the exception that stopped it.
    """

    times: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)

    def summary(self, method: str) -> TimingSummary | None:
        """The method's summary, or None if it failed or ran no timed step."""
        ts = self.times.get(method)
        return summarize(ts) if ts and method not in self.errors else None


def time_round_robin(
    steps: Mapping[str, Callable[[], None]],
    *,
    warmup: int,
    timed: int,
    synchronize: Callable[[], None] | None = None,
    on_step: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> StepTimes:
    """Run ``warmup + timed`` rounds; each round runs one step of every method.

    The order rotates by one method each round. A method whose step raises is
    recorded with the error and dropped from later rounds. ``synchronize`` is
    called after each step, before the clock stops (CUDA); ``on_step(method)``
    after each step (a progress bar).
    """
    for name, value in (("warmup", warmup), ("timed", timed)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}={value!r} is not allowed: expected an integer >= 0")
    result = StepTimes(times={m: [] for m in steps})
    alive = list(steps)
    for r in range(warmup + timed):
        if not alive:
            break
        k = r % len(alive)
        for m in alive[k:] + alive[:k]:
            start = clock()
            try:
                steps[m]()
                if synchronize is not None:
                    synchronize()
            except Exception as exc:
                result.errors[m] = first_line(exc)
                alive.remove(m)
                continue
            finally:
                if on_step is not None:
                    on_step(m)
            elapsed = clock() - start
            if r >= warmup:
                result.times[m].append(elapsed)
    return result
