"""Small pieces every recipe shares: delta rules, choice checks, epsilon for the progress bar,
the plan printed before training and the privacy record written after it, weight-decay
groups, and the white-box audit of a run (``audit=true``)."""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from dptrain._checks import check_int, check_positive
from dptrain.accounting import PrivacyLedger, make_accountant
from dptrain.audit.gradient_canaries import GradientCanaries
from dptrain.privacy_record import PrivacyRecord
from dptrain.progress import delta_warning, plan_text
from dptrain.recipes._launch import refuse_several_processes

__all__ = [
    "DELTA_RULES",
    "attach_audit_canaries",
    "check_audit",
    "check_audit_world_size",
    "check_choice",
    "check_epsilons",
    "cycle",
    "decay_param_groups",
    "epsilon_so_far",
    "print_plan",
    "recipe_privacy_record",
    "report_audit",
    "resolve_delta",
    "write_privacy_records",
]

log = logging.getLogger(__name__)

#: delta given as a rule of the number N of training records (or users); all are below 1/N,
#: the largest delta under which (epsilon, delta)-DP still means something for one record.
#: ``min(1e-5,1/(10N))`` is the library's advice (well below 1/N, and the usual 1e-5 for any
#: N up to 10,000; docs/accounting.md); ``1/(2N)`` reproduces Li et al. 2022 and is weaker.
DELTA_RULES = ("min(1e-5,1/(10N))", "1/N^1.1", "1/(2N)")


def check_choice(name: str, value: object, allowed: Sequence[str]) -> None:
    """Refuse ``value`` unless it is one of ``allowed`` (the error lists them)."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed: expected one of {list(allowed)}")


def check_epsilons(epsilons: Sequence[float | None]) -> None:
    """Refuse an empty or repeating list of guarantees, or one that is not a target
    epsilon > 0 or None (the non-private run)."""
    if not epsilons:
        raise ValueError("epsilons=[] is not allowed: expected target epsilons and/or null")
    for e in epsilons:
        if e is not None:
            check_positive("epsilons", e)
    if len(set(epsilons)) != len(epsilons):
        raise ValueError(f"epsilons={list(epsilons)!r} is not allowed: values repeat")


def resolve_delta(delta: float | str, n_records: int) -> float:
    """delta as a number: ``min(1e-5,1/(10N))``, ``1/N^1.1``, ``1/(2N)`` (Li et al. 2022) or
    a number as given."""
    if delta == "min(1e-5,1/(10N))":
        return min(1e-5, 1.0 / (10 * n_records))
    if delta == "1/N^1.1":
        return 1.0 / n_records**1.1
    if delta == "1/(2N)":
        return 1.0 / (2 * n_records)
    return float(delta)


def epsilon_so_far(ledger: PrivacyLedger | None, delta: float | None, accountant: str) -> float:
    """epsilon spent so far, for progress bars and per-step logs.

    PLD runs on a 1e-3 grid here (about 10x faster than the 1e-4 of the final
    figure, and pessimistic: never below it); results.json has the 1e-4 value.
    """
    if ledger is None or delta is None or not ledger.num_steps:
        return 0.0
    options = {"value_discretization_interval": 1e-3} if accountant == "pld" else {}
    return make_accountant(accountant, ledger, **options).epsilon(delta)


def print_plan(**plan: Any) -> None:
    """Print the private plan (:func:`dptrain.progress.plan_text`, same keywords) on stderr
    before the first step; a delta >= 1/N is also logged as a warning."""
    print(plan_text(**plan), file=sys.stderr, flush=True)
    warning = delta_warning(plan["delta"], plan["units"], plan["unit"])
    if warning:
        log.warning(warning)


def recipe_privacy_record(
    producer: str,
    results: dict[str, Any],
    ledger: PrivacyLedger | None,
    *,
    privacy_unit: str,
    covers: Sequence[str],
    not_covered: Sequence[str],
    training: dict[str, Any] | None = None,
) -> PrivacyRecord:
    """The privacy record (docs/privacy_record.md) of a recipe's run, from its
    ``results.json`` figures (``epsilon``, ``delta``, ``accountant`` or ``calibrated_with``,
    ``epsilon_by_accountant``, ``noise_multiplier``, ``sample_rate``, ``steps``...)."""
    epsilon = results.get("epsilon")
    private = epsilon is not None and math.isfinite(epsilon)
    accountant = results.get("accountant") or ("pld" if private else None)
    figures = {
        "steps_taken": results.get("steps"),
        "planned_steps": results.get("steps"),
        "target_epsilon": results.get("target_epsilon"),
        "noise_multiplier": results.get("noise_multiplier"),
        "max_grad_norm": results.get("max_grad_norm", results.get("max_norm")),
        "sample_rate": results.get("sample_rate"),
        "seed": "given" if results.get("seed") is not None else "drawn from the OS",
        **(training or {}),
    }
    if not private:
        return PrivacyRecord(
            private=False,
            statement="none: trained without differential privacy (a baseline)",
            privacy_unit=privacy_unit,
            producer=producer,
            not_covered=["everything: no differential privacy"],
            training=figures,
            ledger=None if ledger is None else ledger.state_dict(),
        )
    delta = results["delta"]
    return PrivacyRecord(
        private=True,
        statement=(
            f"({epsilon:.4g}, {delta:.3g})-DP for the training data at the {privacy_unit} "
            f"level ({accountant} accountant)"
        ),
        privacy_unit=privacy_unit,
        producer=producer,
        epsilon=epsilon,
        delta=delta,
        accountant=accountant,
        epsilon_by_accountant=dict(results.get("epsilon_by_accountant") or {}),
        neighbouring=f"add or remove one {privacy_unit}",
        covers=list(covers),
        not_covered=list(not_covered),
        training=figures,
        ledger=None if ledger is None else ledger.state_dict(),
    )


def write_privacy_records(record: PrivacyRecord, *folders: str | Path) -> None:
    """``record`` as ``privacy.json`` into each folder (the run, and its model folder)."""
    for folder in folders:
        record.write(folder)


def cycle(loader: Iterable[Any]) -> Iterator[Any]:
    """Iterate ``loader`` again and again (non-private runs count steps, not epochs)."""
    while True:
        yield from loader


def decay_param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Optimizer groups: weight decay on the trainable matrices and embeddings, none on
    biases and norm gains (BERT's convention; every vector parameter is one of those).
    A parameter shared by several modules (a tied embedding) is listed once."""
    decay, no_decay = [], []
    seen: set[int] = set()
    for p in model.parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.dim() < 2 else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


# -- audit=true: the white-box one-run audit of a recipe's run -------------------------------


def check_audit(
    audit: bool, canaries: int, *, private: bool, non_private: str, clipping: str = "flat"
) -> None:
    """Check a recipe's ``audit`` / ``audit_canaries`` settings (``ValueError`` naming them).

    ``private``: whether the run adds noise; ``non_private`` names the settings that make
    it a non-private run (in the error); ``clipping``: the run's clipping function.
    """
    check_int("audit_canaries", canaries, 2)
    if not audit:
        return
    if not private:
        raise ValueError(
            f"audit=true is not allowed with a non-private run ({non_private}): the audit "
            "measures the noise and clipping such a run does not add"
        )
    if clipping == "per_layer":
        raise ValueError(
            "audit=true is not allowed with clipping='per_layer': the white-box canaries need "
            "one clip factor per gradient (flat or automatic clipping)"
        )


def check_audit_world_size(audit: bool, world_size: int | None = None) -> None:
    """Refuse ``audit=true`` on several processes (torchrun), before anything runs.

    The multi-process step reduces and noises the clipped sums in its own order, without
    the optimizer's audit hook, so :meth:`GradientCanaries.attach` refuses it.
    ``world_size``: default ``WORLD_SIZE``.
    """
    if audit:
        refuse_several_processes(
            "audit=true",
            "the white-box canaries audit a one-process run (the multi-process step has no "
            "audit hook); audit the same configuration without torchrun / --nproc",
            world_size,
        )


def attach_audit_canaries(
    audit: bool, params: Iterable[nn.Parameter], optimizer: Any, canaries: int, seed: int | None
) -> GradientCanaries | None:
    """With ``audit``, ``min(canaries, #trainable coordinates)`` Dirac canaries on the
    trainable ``params``, attached to the private ``optimizer`` (a DPOptimizer); else None.

    Seeded by ``seed + 1`` (0 + 1 for a run seeded from the OS): the canaries'
    coordinates, inclusions and sampling are fixed by the run's seed and differ from
    its own streams.
    """
    if not audit:
        return None
    trainable = [p for p in params if p.requires_grad]
    m = min(canaries, sum(p.numel() for p in trainable))
    return GradientCanaries(trainable, m, seed=(seed or 0) + 1).attach(optimizer)


def report_audit(
    results: dict[str, Any],
    canaries: GradientCanaries | None,
    delta: float | None,
    ledger: PrivacyLedger | None,
) -> None:
    """Put the audit section (:meth:`GradientCanaries.report`) into ``results["audit"]``,
    against the run's final ``results["epsilon"]``; nothing without canaries."""
    if canaries is not None:
        results["audit"] = canaries.report(results["epsilon"], delta, ledger)
