"""The privacy ledger: a record of every private step, as it happened.

Following dp_accounting's split, the ledger says *what happened* (which
mechanism ran, how often) and knows nothing about *how it is counted*; the
accountants in :mod:`dptrain.accounting.accountants` turn a ledger into
(epsilon, delta).

Every private step of dptrain is a Poisson-subsampled Gaussian mechanism:
each record joins the step's batch independently with probability
``sample_rate`` (q), and the released sum of clipped contributions carries
Gaussian noise of standard deviation ``noise_multiplier * C`` (sigma * C).
``sample_rate = 1`` is the plain (unsampled) Gaussian mechanism.

Consecutive steps with the same (q, sigma) are merged into one segment with a
count; a change of q or sigma (a growing batch size as in Anil et al. 2021,
a noise schedule) starts a new segment, so heterogeneous training is
accounted exactly as it ran.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dptrain._atomic import write_json_atomically
from dptrain._checks import check_int, check_positive, check_sample_rate

__all__ = ["NEIGHBOURING_RELATIONS", "PrivacyLedger", "PrivateSteps"]

#: Neighbouring relations the accountants support. dptrain counts privacy
#: under add/remove-one-record (the relation Poisson sampling amplifies).
NEIGHBOURING_RELATIONS = ("add_or_remove_one",)

_FORMAT_VERSION = 1


@dataclass(frozen=True)
class PrivateSteps:
    """``count`` consecutive Poisson-subsampled Gaussian steps with one (q, sigma)."""

    sample_rate: float
    noise_multiplier: float
    count: int = 1

    def __post_init__(self) -> None:
        # Normalise to plain floats/ints so equality and JSON are exact.
        object.__setattr__(self, "sample_rate", check_sample_rate(self.sample_rate))
        object.__setattr__(
            self, "noise_multiplier", check_positive("noise_multiplier", self.noise_multiplier)
        )
        object.__setattr__(self, "count", check_int("count", self.count, minimum=1))


class PrivacyLedger:
    """An append-only list of :class:`PrivateSteps` segments.

    Args:
        privacy_unit: what one "record" is for the guarantee: ``"example"``,
            ``"user"`` (one user's whole history), ... . Reports print it.
        neighbouring: the neighbouring relation; only ``"add_or_remove_one"``.
    """

    def __init__(self, privacy_unit: str = "example", neighbouring: str = "add_or_remove_one"):
        if neighbouring not in NEIGHBOURING_RELATIONS:
            raise ValueError(
                f"neighbouring={neighbouring!r} is not supported: expected one of "
                f"{list(NEIGHBOURING_RELATIONS)}"
            )
        if not isinstance(privacy_unit, str) or not privacy_unit:
            raise ValueError(f"privacy_unit={privacy_unit!r} is not allowed: expected a name")
        self.privacy_unit = privacy_unit
        self.neighbouring = neighbouring
        self._segments: list[PrivateSteps] = []
        self._autosave: Path | None = None

    def autosave(self, path: str | os.PathLike) -> None:
        """Keep ``path`` holding this ledger as JSON: written now and after every change,
        each time atomically, so a run stopped at any point (killed, out of memory) leaves
        the record of the budget it spent. Copies of the ledger do not autosave."""
        self._autosave = Path(path)
        self._save()

    def __getstate__(self) -> dict[str, Any]:
        # A pickled or deep-copied ledger is another ledger: it must not write this one's file.
        return {**self.__dict__, "_autosave": None}

    def _save(self) -> None:
        if self._autosave is not None:
            write_json_atomically(self._autosave, self.state_dict())

    # -- recording -----------------------------------------------------------------

    def record(self, sample_rate: float, noise_multiplier: float, count: int = 1) -> None:
        """Record ``count`` private steps with sampling rate q and noise multiplier sigma."""
        steps = PrivateSteps(sample_rate, noise_multiplier, count)
        last = self._segments[-1] if self._segments else None
        if (
            last is not None
            and last.sample_rate == steps.sample_rate
            and last.noise_multiplier == steps.noise_multiplier
        ):
            self._segments[-1] = PrivateSteps(
                last.sample_rate, last.noise_multiplier, last.count + steps.count
            )
        else:
            self._segments.append(steps)
        self._save()

    @classmethod
    def from_schedule(
        cls,
        schedule: Iterable[tuple[float, int]],
        noise_multiplier: float,
        privacy_unit: str = "example",
    ) -> PrivacyLedger:
        """A ledger for segments ``[(q_1, steps_1), (q_2, steps_2), ...]`` sharing one sigma.

        Segments with zero steps are skipped (a stage of a schedule may be empty).
        """
        ledger = cls(privacy_unit=privacy_unit)
        for sample_rate, steps in schedule:
            if check_int("steps", steps, minimum=0) > 0:
                ledger.record(sample_rate, noise_multiplier, steps)
        return ledger

    # -- reading -------------------------------------------------------------------

    @property
    def segments(self) -> tuple[PrivateSteps, ...]:
        return tuple(self._segments)

    @property
    def num_steps(self) -> int:
        """Total number of private steps recorded."""
        return sum(s.count for s in self._segments)

    def __len__(self) -> int:
        return len(self._segments)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PrivacyLedger):
            return NotImplemented
        return (
            self._segments == other._segments
            and self.privacy_unit == other.privacy_unit
            and self.neighbouring == other.neighbouring
        )

    def __repr__(self) -> str:
        body = ", ".join(
            f"(q={s.sample_rate:g}, sigma={s.noise_multiplier:g}) x {s.count}"
            for s in self._segments
        )
        return f"PrivacyLedger(unit={self.privacy_unit!r}, [{body}])"

    def copy(self) -> PrivacyLedger:
        return PrivacyLedger.from_state_dict(self.state_dict())

    # -- serialisation -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A plain-Python (JSON-safe) snapshot, for checkpoints."""
        return {
            "format_version": _FORMAT_VERSION,
            "privacy_unit": self.privacy_unit,
            "neighbouring": self.neighbouring,
            "segments": [asdict(s) for s in self._segments],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace this ledger's contents with ``state`` (from :meth:`state_dict`)."""
        version = state.get("format_version")
        if version != _FORMAT_VERSION:
            raise ValueError(
                f"ledger format_version={version!r} is not supported: expected {_FORMAT_VERSION}"
            )
        restored = PrivacyLedger(state["privacy_unit"], state["neighbouring"])
        for seg in state["segments"]:
            restored.record(seg["sample_rate"], seg["noise_multiplier"], seg["count"])
        self.privacy_unit = restored.privacy_unit
        self.neighbouring = restored.neighbouring
        self._segments = restored._segments
        self._save()

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> PrivacyLedger:
        ledger = cls()
        ledger.load_state_dict(state)
        return ledger

    def to_json(self) -> str:
        return json.dumps(self.state_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> PrivacyLedger:
        return cls.from_state_dict(json.loads(text))
