"""``PrivacyArguments``: what a DPTrainer run must guarantee, beside ``TrainingArguments``.

    privacy_args = PrivacyArguments(target_epsilon=8, target_delta=1e-5, max_grad_norm=1.0)

A dataclass with ``help`` metadata, so ``HfArgumentParser(PrivacyArguments)`` reads it
from the command line. It shares ``max_grad_norm`` and ``seed`` with TrainingArguments
(with other meanings: the per-example clipping norm, the sampling and noise seed), so
one parser cannot hold both: parse each with ``return_remaining_strings=True``. Every
field is checked when the object is built (:class:`PrivacyArgumentsError` names the
field, its value and what is allowed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dptrain._checks import check_delta, check_int, check_positive
from dptrain.accounting.accountants import ACCOUNTANTS
from dptrain.clipping import CLIPPING_FUNCTIONS, CLIPPING_MODES, SUM_ROUNDINGS
from dptrain.hf.errors import PrivacyArgumentsError

__all__ = ["DEFAULT_MAX_NOISE_MULTIPLIER", "LOSS_REDUCTIONS", "PrivacyArguments"]

#: The largest noise multiplier a target epsilon may calibrate to by default. At
#: sigma = 100 the noise on the summed gradient is 100 C per coordinate group: an
#: expected batch of B examples then carries a signal-to-noise ratio of at most
#: B / (100 sqrt(d)), so below ~1e4 examples per batch training learns next to
#: nothing. A target needing more is almost always a mistake (epsilon far too
#: small for the planned steps and batch size), so it is refused before training.
DEFAULT_MAX_NOISE_MULTIPLIER = 100.0

#: How one example's token losses are reduced to its loss L_i.
LOSS_REDUCTIONS = ("mean", "sum")


def _choice(name: str, value: object, allowed: object) -> None:
    options = sorted(allowed)  # type: ignore[call-overload]
    if value not in options:
        raise PrivacyArgumentsError(f"{name}={value!r} is not allowed: expected one of {options}")


@dataclass
class PrivacyArguments:
    """The privacy side of a :class:`~dptrain.hf.DPTrainer` run.

    Give exactly one of ``target_epsilon`` (the noise is calibrated so the planned
    steps meet (target_epsilon, target_delta)) and ``noise_multiplier`` (used as
    given; epsilon is reported). ``target_delta`` is needed either way: every log
    and the privacy report state epsilon at that delta.
    """

    target_epsilon: float | None = field(
        default=None,
        metadata={"help": "Epsilon the planned steps must meet (noise calibrated to it)."},
    )
    noise_multiplier: float | None = field(
        default=None,
        metadata={"help": "Noise multiplier sigma, instead of target_epsilon."},
    )
    target_delta: float | None = field(
        default=None,
        metadata={"help": "delta of (epsilon, delta)-DP; typically below 1 / number of units."},
    )
    max_grad_norm: float = field(
        default=1.0,
        metadata={"help": "Per-example (or per-user) clipping norm C."},
    )
    clipping: str = field(
        default="flat",
        metadata={"help": "Clipping function.", "choices": sorted(CLIPPING_FUNCTIONS)},
    )
    mode: str = field(
        default="book_keeping",
        metadata={"help": "Clipping engine mode.", "choices": sorted(CLIPPING_MODES)},
    )
    sum_rounding: str = field(
        default="exact",
        metadata={
            "help": "Clipped sums of bf16 layers: 'exact' (two bf16 GEMMs each on CUDA) or "
            "'bounded' (one; clipped examples' factors absorb the rounding and are a few "
            "percent smaller: docs/engine.md, Precision).",
            "choices": list(SUM_ROUNDINGS),
        },
    )
    accountant: str = field(
        default="pld",
        metadata={
            "help": "Accountant for calibration and reports.",
            "choices": sorted(ACCOUNTANTS),
        },
    )
    privacy_unit: str | None = field(
        default=None,
        metadata={
            "help": "Name of the protected unit in reports: 'example' (default), or 'user' "
            "with group_by."
        },
    )
    group_by: str | None = field(
        default=None,
        metadata={
            "help": "Dataset column holding a user id per record: user-level DP (each user's "
            "records are sampled, and clipped, together)."
        },
    )
    seed: int | None = field(
        default=None,
        metadata={
            "help": "Seed of the Poisson sampling and the noise. None (default): drawn from "
            "the OS and logged. Not TrainingArguments.seed: noise from a public seed "
            "would protect nothing."
        },
    )
    secure_mode: bool = field(
        default=False,
        metadata={
            "help": "Draw the noise and the Poisson sampling from the OS's cryptographically "
            "secure generator (os.urandom; Opacus' secure_mode): no seed predicts them. "
            "One process only; not with seed."
        },
    )
    max_noise_multiplier: float = field(
        default=DEFAULT_MAX_NOISE_MULTIPLIER,
        metadata={"help": "Refuse a target_epsilon that calibrates to more noise than this."},
    )
    loss_reduction: str = field(
        default="mean",
        metadata={
            "help": "Reduce each example's token losses by their mean or sum.",
            "choices": list(LOSS_REDUCTIONS),
        },
    )

    def __post_init__(self) -> None:
        if (self.target_epsilon is None) == (self.noise_multiplier is None):
            raise PrivacyArgumentsError(
                f"target_epsilon={self.target_epsilon!r}, noise_multiplier={self.noise_multiplier!r}: "
                "give exactly one of them (a target epsilon to calibrate the noise to, or the "
                "noise multiplier to use)"
            )
        try:
            if self.target_epsilon is not None:
                self.target_epsilon = check_positive("target_epsilon", self.target_epsilon)
            if self.noise_multiplier is not None:
                self.noise_multiplier = check_positive("noise_multiplier", self.noise_multiplier)
            if self.target_delta is None:
                raise ValueError(
                    "target_delta=None is not allowed: every log and the privacy report state "
                    "epsilon at this delta; give one below 1 / (number of examples or users), "
                    "e.g. 1e-5"
                )
            self.target_delta = check_delta(self.target_delta, "target_delta")
            self.max_grad_norm = check_positive("max_grad_norm", self.max_grad_norm)
            self.max_noise_multiplier = check_positive(
                "max_noise_multiplier", self.max_noise_multiplier
            )
            if self.seed is not None:
                self.seed = check_int("seed", self.seed, 0)
                if self.secure_mode:
                    raise ValueError(
                        f"secure_mode=True with seed={self.seed}: secure noise and sampling "
                        "come from the OS's CSPRNG and cannot be seeded; drop the seed"
                    )
        except PrivacyArgumentsError:
            raise
        except ValueError as exc:
            raise PrivacyArgumentsError(str(exc)) from None
        _choice("clipping", self.clipping, CLIPPING_FUNCTIONS)
        _choice("mode", self.mode, CLIPPING_MODES)
        _choice("sum_rounding", self.sum_rounding, SUM_ROUNDINGS)
        _choice("accountant", self.accountant, ACCOUNTANTS)
        _choice("loss_reduction", self.loss_reduction, LOSS_REDUCTIONS)
        if self.clipping == "per_layer" and self.mode == "ghost":
            raise PrivacyArgumentsError(
                "clipping='per_layer' with mode='ghost' is not allowed: per-layer clipping "
                "needs mode='book_keeping'"
            )
        if self.group_by is not None and (not isinstance(self.group_by, str) or not self.group_by):
            raise PrivacyArgumentsError(
                f"group_by={self.group_by!r} is not allowed: expected the name of a dataset column"
            )
        if self.privacy_unit is not None and (
            not isinstance(self.privacy_unit, str) or not self.privacy_unit
        ):
            raise PrivacyArgumentsError(
                f"privacy_unit={self.privacy_unit!r} is not allowed: expected a name such as "
                "'example' or 'user'"
            )
        if self.group_by is not None and self.privacy_unit == "example":
            raise PrivacyArgumentsError(
                f"privacy_unit='example' with group_by={self.group_by!r}: group_by makes all "
                "records of one id one unit; use privacy_unit='user' (or the unit's name)"
            )

    @property
    def unit(self) -> str:
        """The name of the protected unit: ``privacy_unit``, else 'user' with group_by, else
        'example'."""
        if self.privacy_unit is not None:
            return self.privacy_unit
        return "user" if self.group_by is not None else "example"
