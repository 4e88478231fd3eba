"""Broken mechanisms for testing the property checks (test code only: never reachable from
dptrain). Each is a context manager patching one piece of dptrain the way a bug would, the
accountant's figures (ledger q and sigma, the optimizer's C) left as they were:

- ``fixed_size_batches()``: batches of exactly round(q N) records, shuffled without
  replacement, reported as Poisson-sampled at q;
- ``realised_divisor()``: the noised sum is divided by the realised batch size, not q N
  (the fault one white-box run cannot see).

The others (the same noise every step, noise missing from half the tensors, noise std
without C, a sampler at k q, clipping at k C or off, a ledger that misses steps, noise
divided by 4, rows that are not records) are the one-run audit's, from
:mod:`tests.audit.faults`: both audits are tested against the same broken code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from dptrain import privacy_engine
from dptrain.data.poisson import PoissonBatchSampler
from tests.audit.faults import (
    clipping_at,
    clipping_off,
    ledger_records_half,
    noise_divided_by,
    noise_on_half_the_tensors,
    noise_without_c,
    rows_mixed,
    same_noise_each_step,
    sampler_rate_times,
)


@contextlib.contextmanager
def fixed_size_batches() -> Iterator[None]:
    def _draw(self):
        step = self.steps_drawn
        q = self.sample_rate_at(step)
        order = torch.randperm(self.dataset_size, generator=self.generator)
        indices = sorted(order[: round(q * self.dataset_size)].tolist())
        self._steps_drawn = step + 1
        return step, q, indices

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PoissonBatchSampler, "_draw", _draw)
        yield


@contextlib.contextmanager
def realised_divisor() -> Iterator[None]:
    # the loader make_private returns tells the optimizer each step's q; here it also sets
    # the divisor to the batch it just drew
    cls = privacy_engine._PrivateLoader
    original = cls.__iter__

    def iterate(self):
        for batch in original(self):
            self.optimizer.expected_batch_size = max(batch.size, 1)
            yield batch

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cls, "__iter__", iterate)
        yield


#: fault -> (context manager, the check that must flag it)
FAULTS = {
    "same noise every step": (same_noise_each_step, "noise independent across steps"),
    "noise missing from half the tensors": (noise_on_half_the_tensors, "per-tensor noise std"),
    "noise std without C": (noise_without_c, "per-tensor noise std"),
    "noise / 4": (lambda: noise_divided_by(4.0), "per-tensor noise std"),
    "sampler at 4q reporting q": (lambda: sampler_rate_times(4.0), "batch sizes"),
    "fixed-size shuffled batches": (fixed_size_batches, "batch sizes"),
    "clipping off": (clipping_off, "one record moves"),
    "clipping at 2C": (lambda: clipping_at(2.0), "one record moves"),
    "ledger misses every other step": (ledger_records_half, "ledger steps"),
    "divisor = realised batch size": (realised_divisor, "per-tensor noise std"),
}

__all__ = ["FAULTS", "rows_mixed"]
