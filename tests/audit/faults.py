"""Broken mechanisms for testing the audits (test code only: never reachable from dptrain).

Each is a context manager that patches one piece of dptrain the way a bug would:

- ``noise_divided_by(k)``: the optimizer adds noise of std sigma C / k, the ledger
  still records sigma;
- ``clipping_off()``: every clip factor is 1 (examples and canaries go in unclipped);
- ``ledger_records_half()``: the ledger records every other step only;
- ``rows_mixed()``: the engine reads every token as an example of its own (the
  shape-coincidence bug: rows that are not examples), with its exact checks off, as
  the engine before the independence and self-checks was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from dptrain.accounting import PrivacyLedger
from dptrain.clipping import ClippingEngine, independence, self_check
from dptrain.clipping import engine as engine_module
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


FAULTS = {
    "noise/4": lambda: noise_divided_by(4.0),
    "clipping off": clipping_off,
    "ledger half": ledger_records_half,
    "rows mixed": rows_mixed,
}
