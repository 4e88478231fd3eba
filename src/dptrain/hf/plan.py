"""The private plan of a DPTrainer run: sample rate, steps and noise, fixed before training.

Everything the accountant needs is decided from ``TrainingArguments``,
``PrivacyArguments`` and the dataset size before the first step:

- units N: records, or users with ``group_by``;
- expected logical batch B = per_device_train_batch_size x gradient_accumulation_steps
  x world_size units; q = B / N (Poisson sampling, each unit independently);
- steps T = ``max_steps`` if set, else floor(num_train_epochs x N / B) (one epoch is
  N / B steps in expectation, :func:`dptrain.accounting.steps_from_epochs`);
- the noise multiplier: given, or calibrated so that T steps at rate q meet the target,
  refused above ``max_noise_multiplier``.

The plan is saved in every checkpoint; a resumed run must plan the same numbers.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import asdict, dataclass
from typing import Any

from dptrain.accounting import calibrate_noise_multiplier, sample_rate_from_batch, steps_from_epochs
from dptrain.accounting.calibration import epsilon_of_schedule
from dptrain.hf.arguments import PrivacyArguments
from dptrain.hf.errors import (
    NoiseMultiplierTooLargeError,
    PrivacyArgumentsError,
    UnsupportedTrainingArgumentsError,
)

__all__ = ["PrivacyPlan", "make_plan"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrivacyPlan:
    """What a DPTrainer run will do, in the accountant's terms."""

    privacy_unit: str
    num_units: int
    """N: records, or users with group_by (what is sampled and protected)."""
    num_records: int
    expected_batch_size: int
    """B, in units: per_device_train_batch_size x gradient_accumulation_steps x world_size."""
    sample_rate: float
    steps: int
    """T: optimizer updates, each one Poisson-sampled logical batch, noised once."""
    steps_per_epoch: int
    """floor(N / B) (at least 1): Trainer's epoch for logging, evaluation and saving."""
    noise_multiplier: float
    max_grad_norm: float
    target_epsilon: float | None
    target_delta: float
    accountant: str
    clipping: str
    mode: str
    physical_batch_size: int
    """Records per chunk through the model (per process): per_device_train_batch_size."""
    world_size: int

    def as_dict(self) -> dict[str, Any]:
        """Plain types (JSON-safe)."""
        return asdict(self)

    def mismatches(self, saved: dict[str, Any]) -> list[str]:
        """The fields where ``saved`` (another plan's :meth:`as_dict`) differs, described.

        The world size may differ (sampling and noise do not depend on it)."""
        mine = self.as_dict()
        return [
            f"{key}={saved.get(key)!r} in the checkpoint, {value!r} in this run"
            for key, value in mine.items()
            if key != "world_size" and saved.get(key) != value
        ]


def make_plan(
    privacy: PrivacyArguments,
    *,
    num_units: int,
    num_records: int,
    per_device_train_batch_size: int,
    gradient_accumulation_steps: int,
    world_size: int,
    max_steps: int,
    num_train_epochs: float,
) -> PrivacyPlan:
    """The plan, with the noise calibrated (named errors for what cannot be planned)."""
    batch = per_device_train_batch_size * gradient_accumulation_steps * world_size
    unit = privacy.unit
    if batch > num_units:
        raise UnsupportedTrainingArgumentsError(
            f"the expected logical batch per_device_train_batch_size x "
            f"gradient_accumulation_steps x world_size = {per_device_train_batch_size} x "
            f"{gradient_accumulation_steps} x {world_size} = {batch} is larger than the "
            f"{num_units} {unit}s of the training set: expected at most {num_units}"
        )
    q = sample_rate_from_batch(batch, num_units)
    if max_steps is not None and max_steps > 0:
        steps = int(max_steps)
    else:
        try:
            steps = steps_from_epochs(num_train_epochs, q)
        except ValueError as exc:
            raise UnsupportedTrainingArgumentsError(f"num_train_epochs: {exc}") from None
    if privacy.noise_multiplier is not None:
        sigma = privacy.noise_multiplier
    else:
        assert privacy.target_epsilon is not None and privacy.target_delta is not None
        sigma = _calibrate(privacy, q, steps, unit, num_units, batch)
    if privacy.target_delta is not None and privacy.target_delta >= 1.0 / num_units:
        log.warning(
            "target_delta=%g is not below 1 / N = 1 / %d %ss: a mechanism that releases one "
            "%s's data outright meets such a delta; prefer delta << 1 / N",
            privacy.target_delta,
            num_units,
            unit,
            unit,
        )
    assert privacy.target_delta is not None
    return PrivacyPlan(
        privacy_unit=unit,
        num_units=num_units,
        num_records=num_records,
        expected_batch_size=batch,
        sample_rate=q,
        steps=steps,
        steps_per_epoch=max(1, math.floor(num_units / batch * (1 + 1e-12))),
        noise_multiplier=sigma,
        max_grad_norm=privacy.max_grad_norm,
        target_epsilon=privacy.target_epsilon,
        target_delta=privacy.target_delta,
        accountant=privacy.accountant,
        clipping=privacy.clipping,
        mode=privacy.mode,
        physical_batch_size=per_device_train_batch_size,
        world_size=world_size,
    )


@functools.lru_cache(maxsize=64)
def _calibrated(target: float, delta: float, q: float, steps: int, accountant: str) -> float:
    # A PLD calibration costs seconds; a process that builds several trainers for one plan
    # (a resumed run, an evaluation script, the tests) calibrates once. Deterministic.
    return calibrate_noise_multiplier(
        target, delta, sample_rate=q, steps=steps, accountant=accountant
    )


def _calibrate(
    privacy: PrivacyArguments, q: float, steps: int, unit: str, num_units: int, batch: int
) -> float:
    target, delta = privacy.target_epsilon, privacy.target_delta
    assert target is not None and delta is not None
    bound = privacy.max_noise_multiplier
    schedule = [(q, steps)]
    # One accountant evaluation at the bound decides reachability before any search:
    # cheaper than calibrating, and calibration's own range (up to 1e4) is not a sane one.
    at_bound = epsilon_of_schedule(bound, delta, schedule, privacy.accountant)
    if at_bound > target:
        raise NoiseMultiplierTooLargeError(
            f"target_epsilon={target!r} at target_delta={delta!r} over {steps} steps at sample "
            f"rate q={q:.4g} (expected batch {batch} of {num_units} {unit}s) needs a noise "
            f"multiplier above max_noise_multiplier={bound:g} (at sigma={bound:g} epsilon "
            f"would still be {at_bound:.4g}, {privacy.accountant}). Raise target_epsilon, train "
            "fewer steps (max_steps / num_train_epochs) or use a larger batch; or raise "
            "PrivacyArguments.max_noise_multiplier if you mean it"
        )
    try:
        sigma = _calibrated(target, delta, q, steps, privacy.accountant)
    except ValueError as exc:
        raise PrivacyArgumentsError(f"target_epsilon={target!r}: {exc}") from None
    log.info(
        "noise multiplier %.4f for (%g, %g)-DP per %s over %d steps at q=%.4g (%s)",
        sigma,
        target,
        delta,
        unit,
        steps,
        q,
        privacy.accountant,
    )
    return sigma
