"""Running the independent runs of an experiment grid, in this process or in several."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any, TypeVar

C = TypeVar("C")


def run_all(
    train: Callable[[C], dict[str, Any]],
    configs: Sequence[C],
    workers: int,
    bar: Any,
    describe: Callable[[C], dict[str, Any]],
) -> list[dict[str, Any]]:
    """``[train(c) for c in configs]``, in order, with ``workers`` spawned processes if > 1.

    ``bar`` (a tqdm bar) advances by one per finished run; ``describe(c)`` is shown
    as its postfix while run ``c`` trains in this process.
    """
    if workers == 1:
        results = []
        for config in configs:
            bar.set_postfix(**describe(config))
            results.append(train(config))
            bar.update(1)
        return results
    # Spawned processes: each run is independent; the order of results is the grid's.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        futures = [pool.submit(train, c) for c in configs]
        for _ in as_completed(futures):
            bar.update(1)
        return [f.result() for f in futures]
