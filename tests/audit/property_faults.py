"""Broken mechanisms for testing the property checks (test code only: never reachable from
dptrain). Each is a context manager patching one piece of dptrain the way a bug would, the
accountant's figures (ledger q and sigma, the optimizer's C) left as they were:

- ``same_noise()``: every step draws the same noise (the generator restarts each step);
- ``noise_missing_half()``: every other tensor gets no noise (its clipped sum / (q N) alone);
- ``noise_without_c()``: the noise std is sigma, not sigma C;
- ``sampler_rate_times(k)``: the sampler draws records at k q while reporting q;
- ``fixed_size_batches()``: batches of exactly round(q N) records, shuffled without
  replacement, reported as Poisson-sampled at q;
- ``clipping_at(k)``: the engine clips at k C while the noise is calibrated to C;
- ``realised_divisor()``: the noised sum is divided by the realised batch size, not q N
  (the fault one white-box run cannot see).

Clipping off, a ledger that misses steps, noise divided by 4 and rows that are not records
come from :mod:`tests.audit.faults`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from dptrain import privacy_engine
from dptrain.clipping import ClippingEngine
from dptrain.clipping.functions import flat_factors
from dptrain.data.poisson import PoissonBatchSampler
from dptrain.optim import DPOptimizer
from tests.audit.faults import clipping_off, ledger_records_half, noise_divided_by, rows_mixed


@contextlib.contextmanager
def same_noise() -> Iterator[None]:
    original = DPOptimizer.add_noise
    first: dict[int, dict] = {}

    def add_noise(self, loss_scale: float = 1.0):
        states = first.setdefault(id(self), {})
        for device, gen in self._generators.items():
            if device in states:
                gen.set_state(states[device])
            else:
                states[device] = gen.get_state()
        return original(self, loss_scale)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DPOptimizer, "add_noise", add_noise)
        yield


@contextlib.contextmanager
def noise_missing_half() -> Iterator[None]:
    original = DPOptimizer.add_noise

    def add_noise(self, loss_scale: float = 1.0):
        params = [p for p in self.params() if p.requires_grad]
        bare = {id(p): self.clipped_sum(p).clone() for p in params[1::2]}
        metrics = original(self, loss_scale)
        for p in params[1::2]:
            p.grad = (bare[id(p)] / (loss_scale * self.expected_batch_size)).to(p.dtype)
        return metrics

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DPOptimizer, "add_noise", add_noise)
        yield


@contextlib.contextmanager
def noise_without_c() -> Iterator[None]:
    original = DPOptimizer.add_noise

    def add_noise(self, loss_scale: float = 1.0):
        c = self.max_grad_norm
        self.max_grad_norm = 1.0
        try:
            return original(self, loss_scale)
        finally:
            self.max_grad_norm = c

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DPOptimizer, "add_noise", add_noise)
        yield


@contextlib.contextmanager
def sampler_rate_times(k: float) -> Iterator[None]:
    def _draw(self):
        step = self.steps_drawn
        q = self.sample_rate_at(step)
        u = torch.rand(self.dataset_size, generator=self.generator, dtype=torch.float64)
        indices = torch.nonzero(u < min(1.0, k * q)).flatten().tolist()
        self._steps_drawn = step + 1
        return step, q, indices

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PoissonBatchSampler, "_draw", _draw)
        yield


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
def clipping_at(k: float) -> Iterator[None]:
    def clip_factors(self, norms, loss_scale: float = 1.0):
        return flat_factors(norms, k * self.max_grad_norm * loss_scale)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ClippingEngine, "clip_factors", clip_factors)
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
    "same noise every step": (same_noise, "noise independent across steps"),
    "noise missing from half the tensors": (noise_missing_half, "per-tensor noise std"),
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
