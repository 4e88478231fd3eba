"""Small pieces every recipe shares: delta rules, choice checks, epsilon for the progress bar,
weight-decay groups."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch import nn

from dptrain._checks import check_positive
from dptrain.accounting import PrivacyLedger, make_accountant

__all__ = [
    "DELTA_RULES",
    "check_choice",
    "check_epsilons",
    "cycle",
    "decay_param_groups",
    "epsilon_so_far",
    "resolve_delta",
]

#: delta given as a rule of the number N of training records; both are below 1/N, the
#: largest delta under which (epsilon, delta)-DP still means something for one record.
DELTA_RULES = ("1/N^1.1", "1/(2N)")


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
    """delta as a number: ``1/N^1.1``, ``1/(2N)`` (Li et al. 2022) or a number as given."""
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
