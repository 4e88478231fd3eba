"""The errors :class:`~dptrain.hf.DPTrainer` raises before training, one class per cause.

All are raised from ``DPTrainer(...)`` (or from ``train()`` before its first step),
never in the middle of a run: a configuration that would train without the
guarantee it claims is refused up front, with a message naming the argument.
Each derives from :class:`DPTrainerError` (a ``ValueError``) so one ``except``
catches them all. A model the clipping engine cannot clip exactly raises the
engine's own :class:`dptrain.UnsupportedModelError`.
"""

from __future__ import annotations

from dptrain.distributed import CheckpointError

__all__ = [
    "DPTrainerError",
    "MissingLabelsError",
    "NoiseMultiplierTooLargeError",
    "PrivacyArgumentsError",
    "PrivacyCheckpointError",
    "SamplingConflictError",
    "UnsupportedTrainingArgumentsError",
]


class DPTrainerError(ValueError):
    """A DPTrainer configuration refused before training."""


class PrivacyArgumentsError(DPTrainerError):
    """A :class:`~dptrain.hf.PrivacyArguments` field is missing, contradictory or out of range."""


class MissingLabelsError(DPTrainerError):
    """The collated training batch has no labels to compute per-example losses from."""


class NoiseMultiplierTooLargeError(DPTrainerError):
    """The target epsilon needs more noise than ``PrivacyArguments.max_noise_multiplier``."""


class SamplingConflictError(DPTrainerError):
    """A data-loading option would replace or distort the Poisson sampling the accountant assumes."""


class UnsupportedTrainingArgumentsError(DPTrainerError):
    """A TrainingArguments / Trainer option DPTrainer cannot honour privately."""


class PrivacyCheckpointError(CheckpointError):
    """A checkpoint cannot continue this run's ledger and sampler (missing or mismatched)."""
