"""run_all: the grid's runs in order, in this process or in spawned workers."""

from __future__ import annotations

import pytest

from dptrain.recipes._grid import run_all


class _Bar:
    def __init__(self):
        self.updates, self.postfixes = 0, []

    def update(self, n):
        self.updates += n

    def set_postfix(self, **kw):
        self.postfixes.append(kw)


def _square(config: int) -> dict:
    return {"config": config, "value": config * config}


@pytest.mark.parametrize("workers", [1, 2])
def test_results_in_grid_order(workers):
    bar = _Bar()
    results = run_all(_square, [3, 1, 2], workers, bar, lambda c: {"c": c})
    assert [r["value"] for r in results] == [9, 1, 4]
    assert bar.updates == 3
    assert bar.postfixes == ([{"c": 3}, {"c": 1}, {"c": 2}] if workers == 1 else [])
