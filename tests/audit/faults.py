"""Broken mechanisms for testing the audits (test code only: never reachable from dptrain).

Each is a context manager that patches one piece of dptrain the way a bug would:

- ``noise_divided_by(k)``: the optimizer adds noise of std sigma C / k, the ledger
  still records sigma;
- ``clipping_off()``: every clip factor is 1 (examples and canaries go in unclipped);
- ``ledger_records_half()``: the ledger records every other step only;
- ``rows_mixed()``: the engine reads every token as an example of its own (the
  shape-coincidence bug: rows that are not examples), with its exact checks off, as
  the engine before the independence and self-checks was.

The held-out breaks of issue 29 (none of them written with the audit in mind):

- ``same_noise_each_step()``: the noise drawn at the first step is added again at every
  step (a generator reseeded every step);
- ``noise_on_half_the_tensors()``: every other parameter tensor gets no noise;
- ``clipping_at(2.0)``: examples are clipped at 2 C, the noise is for C;
- ``noise_without_c()``: the noise std is sigma, not sigma C;
- ``clipping_off()`` (above): with canaries of norm above C (the default now);
- ``per_batch_clipping()``: one clip factor for the whole chunk, from the norm of its
  stacked gradients against C times its size (the averaged gradient clipped to C, as
  ``clip_grad_norm_`` on a mean loss does), instead of one per example;
- ``sampler_rate_times(4.0)``: the sampler draws at 4 q and reports q.

And classes of our own:

- ``noise_on_even_steps_only()``: odd steps are not noised;
- ``noise_on_the_mean()``: the noise is added after dividing by the batch size (its std
  divided by q N);
- ``ledger_sigma_times(2.0)``: the ledger (and so the accountant) is told twice the sigma
  the noise had;
- ``each_example_twice()``: every clipped example is counted twice in the sum
  (sensitivity 2 C).

Each patch uses the public methods of the piece it breaks (``DPOptimizer.add_noise``,
``clipped_sum``, ``ClippingEngine.clip_factors``, ``PoissonBatchSampler.sample_rate_at``)
except ``rows_mixed``, which needs the engine's row bookkeeping.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from dptrain.accounting import PrivacyLedger
from dptrain.clipping import ClippingEngine, independence, self_check
from dptrain.clipping import engine as engine_module
from dptrain.clipping.functions import flat_factors
from dptrain.data.poisson import PoissonBatchSampler
from dptrain.optim import DPOptimizer


@contextlib.contextmanager
def noise_divided_by(k: float) -> Iterator[None]:
    original = DPOptimizer.add_noise

    def add_noise(self, loss_scale: float = 1.0):
        sigma = self.noise_multiplier
        self.noise_multiplier = sigma / k
        try:
            return original(self, loss_scale)
        finally:
            self.noise_multiplier = sigma

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DPOptimizer, "add_noise", add_noise)
        yield


@contextlib.contextmanager
def clipping_off() -> Iterator[None]:
    def clip_factors(self, norms, loss_scale: float = 1.0):
        return norms.new_ones(norms.shape)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ClippingEngine, "clip_factors", clip_factors)
        yield


@contextlib.contextmanager
def ledger_records_half() -> Iterator[None]:
    # Only the optimizer's steps are dropped (calibration builds ledgers of its own).
    original = DPOptimizer.step

    def step(self, *args, **kwargs):
        if self.steps_taken % 2 == 0:
            return original(self, *args, **kwargs)
        ledger = self.ledger
        self.ledger = PrivacyLedger(privacy_unit=ledger.privacy_unit)  # recorded, then lost
        try:
            return original(self, *args, **kwargs)
        finally:
            self.ledger = ledger

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DPOptimizer, "step", step)
        yield


@contextlib.contextmanager
def rows_mixed() -> Iterator[None]:
    original = engine_module.build_records

    def build_records(*args, **kwargs):
        records, views = original(*args, **kwargs)
        mixed = {
            use: (a.reshape(-1, 1, *a.shape[2:]), g.reshape(-1, 1, *g.shape[2:]))
            for use, (a, g) in records.items()
        }
        return mixed, views

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_module, "build_records", build_records)
        mp.setattr(self_check, "run", lambda *args, **kwargs: None)
        mp.setattr(independence, "run", lambda *args, **kwargs: None)
        yield


@contextlib.contextmanager
def _patched_noise(change) -> Iterator[None]:
    """Patch ``DPOptimizer.add_noise`` so that the noise it adds is ``change(opt, i, p, z)``
    instead of ``z`` (the noise it drew for parameter ``i``; both in units of the clipped
    sum). The clipped sums are read before the original adds its noise and the published
    gradient rewritten from them: p.grad = (sum + change) / (K q N)."""
    original = DPOptimizer.add_noise

    def add_noise(self, loss_scale: float = 1.0):
        params = [p for p in self.params() if p.requires_grad]
        before = [self.clipped_sum(p).detach().clone() for p in params]
        metrics = original(self, loss_scale)
        divisor = loss_scale * self.expected_batch_size
        for i, (p, s) in enumerate(zip(params, before, strict=True)):
            noise = p.grad.detach().to(s.dtype) * divisor - s
            p.grad = ((s + change(self, i, p, noise)) / divisor).to(p.dtype)
        return metrics

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DPOptimizer, "add_noise", add_noise)
        yield


def same_noise_each_step():
    first: dict[int, torch.Tensor] = {}
    return _patched_noise(lambda opt, i, p, z: first.setdefault(id(p), z))


def noise_on_half_the_tensors():
    return _patched_noise(lambda opt, i, p, z: z if i % 2 == 0 else torch.zeros_like(z))


def noise_without_c():
    return _patched_noise(lambda opt, i, p, z: z / opt.max_grad_norm)


def noise_on_even_steps_only():
    return _patched_noise(lambda opt, i, p, z: z if opt.steps_taken % 2 == 0 else 0 * z)


def noise_on_the_mean():
    return _patched_noise(lambda opt, i, p, z: z / opt.expected_batch_size)


@contextlib.contextmanager
def _patched_factors(factors) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ClippingEngine, "clip_factors", factors)
        yield


def clipping_at(multiple: float):
    def clip_factors(self, norms, loss_scale: float = 1.0):
        return flat_factors(norms, multiple * self.max_grad_norm * loss_scale)

    return _patched_factors(clip_factors)


def per_batch_clipping():
    def clip_factors(self, norms, loss_scale: float = 1.0):
        threshold = self.max_grad_norm * loss_scale * norms.numel()
        return flat_factors(norms.norm().reshape(1), threshold).expand(norms.shape)

    return _patched_factors(clip_factors)


def each_example_twice():
    original = ClippingEngine.clip_factors

    def clip_factors(self, norms, loss_scale: float = 1.0):
        return 2.0 * original(self, norms, loss_scale)

    return _patched_factors(clip_factors)


@contextlib.contextmanager
def sampler_rate_times(k: float) -> Iterator[None]:
    original = PoissonBatchSampler._draw

    def _draw(self):
        told = self.sample_rate_at
        self.sample_rate_at = lambda step: min(1.0, k * told(step))
        try:
            step, _, indices = original(self)
        finally:
            del self.sample_rate_at
        return step, told(step), indices

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(PoissonBatchSampler, "_draw", _draw)
        yield


@contextlib.contextmanager
def ledger_sigma_times(k: float) -> Iterator[None]:
    # the optimizer's noise multiplier is k sigma while it steps (the ledger records that)
    # and sigma while it draws the noise; calibration's own ledgers are untouched
    step, add_noise = DPOptimizer.step, DPOptimizer.add_noise

    def scaled(method, factor):
        def call(self, *args, **kwargs):
            sigma = self.noise_multiplier
            self.noise_multiplier = factor * sigma
            try:
                return method(self, *args, **kwargs)
            finally:
                self.noise_multiplier = sigma

        return call

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(DPOptimizer, "step", scaled(step, k))
        mp.setattr(DPOptimizer, "add_noise", scaled(add_noise, 1.0 / k))
        yield


FAULTS = {
    "noise/4": lambda: noise_divided_by(4.0),
    "noise/2": lambda: noise_divided_by(2.0),
    "clipping off": clipping_off,
    "ledger half": ledger_records_half,
    "rows mixed": rows_mixed,
    "same noise each step": same_noise_each_step,
    "noise on half the tensors": noise_on_half_the_tensors,
    "clipping at 2C": lambda: clipping_at(2.0),
    "noise std without C": noise_without_c,
    "per-batch clipping": per_batch_clipping,
    "sampler at 4q": lambda: sampler_rate_times(4.0),
    "noise on even steps only": noise_on_even_steps_only,
    "noise on the mean": noise_on_the_mean,
    "ledger told 2 sigma": lambda: ledger_sigma_times(2.0),
    "each example twice": each_example_twice,
}
