"""Accountant bench: epsilon and noise calibration, dptrain next to dp_accounting and Opacus.

What is measured, on a fixed grid of DP-SGD runs (Poisson rate q, noise
multiplier sigma, steps T, delta; :data:`GRID`, which includes the usual
MNIST setting q = 256/60000, sigma = 1.1, T = 10,000, delta = 1e-5):

- **epsilon**: the value and the wall time of one epsilon query from a fresh
  accountant, for dptrain's ``pld`` / ``rdp`` / ``gdp``
  (:func:`~dptrain.accounting.make_accountant` over a
  :class:`~dptrain.accounting.PrivacyLedger`), dp_accounting's
  ``PLDAccountant`` / ``RdpAccountant`` on the same ``DpEvent``, and Opacus'
  ``RDPAccountant`` / ``PRVAccountant`` / ``GaussianAccountant``;
- **calibration**: the noise multiplier each library finds for a target
  epsilon (:data:`TARGET_EPSILON`) at the grid's (q, T, delta), and its wall
  time: dptrain's :func:`~dptrain.accounting.calibrate_noise_multiplier`
  (``rtol=0.01`` on sigma), dp_accounting's ``calibrate_dp_mechanism``
  (Brent's method, ``tol=0.01`` on sigma) and Opacus' ``get_noise_multiplier``
  (``epsilon_tolerance=0.01``). Every calibrated sigma is also costed by
  dptrain's PLD accountant (``epsilon_pld``): the tightest rigorous figure,
  which shows how much each route over- or under-shoots the target.

Why: the values cross-check the accountants (the same mechanism must get the
same epsilon from two PLD or two RDP implementations; GDP is an approximation
and may understate it), and the times show what calibration costs before a
run. Every timing starts cold: dptrain's one-step PLD cache is cleared first,
and each query builds a fresh accountant. The time is the median of
``repeats`` runs.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "GRID",
    "QUICK_GRID",
    "TARGET_EPSILON",
    "AccountantPoint",
    "AccountantRecord",
    "accountant_bench",
]


@dataclass(frozen=True)
class AccountantPoint:
    """One DP-SGD run to account: Poisson rate, noise multiplier, steps, delta."""

    sample_rate: float
    noise_multiplier: float
    steps: int
    delta: float


#: The fixed grid; the first point is the headline (MNIST-like DP-SGD).
GRID: tuple[AccountantPoint, ...] = (
    AccountantPoint(256 / 60_000, 1.1, 10_000, 1e-5),
    AccountantPoint(0.01, 0.8, 1_000, 1e-5),
    AccountantPoint(0.001, 0.7, 30_000, 1e-5),
)
QUICK_GRID: tuple[AccountantPoint, ...] = GRID[:1]
#: The epsilon each library calibrates sigma for, at the grid's (q, T, delta).
TARGET_EPSILON = 3.0


@dataclass
class AccountantRecord:
    """One (task, library, accountant, grid point) measurement.

    For ``task="epsilon"``, ``noise_multiplier`` is the input and ``epsilon``
    the answer; for ``task="calibration"``, ``noise_multiplier`` is the answer
    for ``target_epsilon`` and ``epsilon_pld`` what dptrain's PLD says it costs.
    """

    task: str
    library: str
    accountant: str
    sample_rate: float
    steps: int
    delta: float
    noise_multiplier: float | None = None
    target_epsilon: float | None = None
    epsilon: float | None = None
    epsilon_pld: float | None = None
    time_s: float | None = None
    approximate: bool = False
    error: str | None = None
    kind: str = "accountant"

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready dict."""
        return asdict(self)


# -- the implementations --------------------------------------------------------------------------


def _clear_dptrain_caches() -> None:
    from dptrain.accounting import accountants

    for name in ("_subsampled_gaussian_pld", "_gaussian_pld"):
        fn = getattr(accountants, name, None)
        if hasattr(fn, "cache_clear"):
            fn.cache_clear()


def _dptrain_epsilon(name: str) -> Callable[[AccountantPoint], float]:
    def eps(p: AccountantPoint) -> float:
        from dptrain.accounting import PrivacyLedger, make_accountant

        _clear_dptrain_caches()
        ledger = PrivacyLedger.from_schedule([(p.sample_rate, p.steps)], p.noise_multiplier)
        return make_accountant(name, ledger).epsilon(p.delta)

    return eps


def _dp_event(q: float, sigma: float, steps: int) -> Any:
    import dp_accounting

    return dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )


def _dp_accounting_class(name: str) -> Any:
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    if name == "pld":
        return pld_privacy_accountant.PLDAccountant
    return rdp_privacy_accountant.RdpAccountant


def _dp_accounting_epsilon(name: str) -> Callable[[AccountantPoint], float]:
    def eps(p: AccountantPoint) -> float:
        acc = _dp_accounting_class(name)()
        acc.compose(_dp_event(p.sample_rate, p.noise_multiplier, p.steps))
        return float(acc.get_epsilon(p.delta))

    return eps


def _opacus_epsilon(name: str) -> Callable[[AccountantPoint], float]:
    def eps(p: AccountantPoint) -> float:
        from opacus.accountants import GaussianAccountant, PRVAccountant, RDPAccountant

        cls = {"rdp": RDPAccountant, "prv": PRVAccountant, "gdp": GaussianAccountant}[name]
        acc = cls()
        acc.history = [(p.noise_multiplier, p.sample_rate, p.steps)]
        return float(acc.get_epsilon(p.delta))

    return eps


def _dptrain_calibrate(name: str) -> Callable[[float, AccountantPoint], float]:
    def cal(target: float, p: AccountantPoint) -> float:
        from dptrain.accounting import calibrate_noise_multiplier

        _clear_dptrain_caches()
        return calibrate_noise_multiplier(
            target, p.delta, sample_rate=p.sample_rate, steps=p.steps, accountant=name
        )

    return cal


def _dp_accounting_calibrate(name: str) -> Callable[[float, AccountantPoint], float]:
    def cal(target: float, p: AccountantPoint) -> float:
        import dp_accounting

        return float(
            dp_accounting.calibrate_dp_mechanism(
                _dp_accounting_class(name),
                lambda sigma: _dp_event(p.sample_rate, sigma, p.steps),
                target,
                p.delta,
                tol=0.01,
            )
        )

    return cal


def _opacus_calibrate(name: str) -> Callable[[float, AccountantPoint], float]:
    def cal(target: float, p: AccountantPoint) -> float:
        from opacus.accountants.utils import get_noise_multiplier

        return float(
            get_noise_multiplier(
                target_epsilon=target,
                target_delta=p.delta,
                sample_rate=p.sample_rate,
                steps=p.steps,
                accountant=name,
                epsilon_tolerance=0.01,
            )
        )

    return cal


#: (library, accountant, approximate, epsilon function)
_EPSILON: tuple[tuple[str, str, bool, Callable[[str], Callable[..., float]]], ...] = (
    ("dptrain", "pld", False, _dptrain_epsilon),
    ("dptrain", "rdp", False, _dptrain_epsilon),
    ("dptrain", "gdp", True, _dptrain_epsilon),
    ("dp_accounting", "pld", False, _dp_accounting_epsilon),
    ("dp_accounting", "rdp", False, _dp_accounting_epsilon),
    ("opacus", "rdp", False, _opacus_epsilon),
    ("opacus", "prv", False, _opacus_epsilon),
    ("opacus", "gdp", True, _opacus_epsilon),
)
_CALIBRATION: tuple[tuple[str, str, bool, Callable[[str], Callable[..., float]]], ...] = (
    ("dptrain", "pld", False, _dptrain_calibrate),
    ("dptrain", "rdp", False, _dptrain_calibrate),
    ("dptrain", "gdp", True, _dptrain_calibrate),
    ("dp_accounting", "pld", False, _dp_accounting_calibrate),
    ("dp_accounting", "rdp", False, _dp_accounting_calibrate),
    ("opacus", "rdp", False, _opacus_calibrate),
    ("opacus", "prv", False, _opacus_calibrate),
)


def _timed(fn: Callable[..., float], repeats: int, *args: Any) -> tuple[float, float]:
    """(value of ``fn(*args)`` on the first run, median wall time over ``repeats`` runs)."""
    times, value = [], math.nan
    for i in range(repeats):
        start = time.perf_counter()
        v = fn(*args)
        times.append(time.perf_counter() - start)
        if i == 0:
            value = v
    return value, statistics.median(times)


def _missing(library: str) -> str | None:
    if library == "opacus" and importlib.util.find_spec("opacus") is None:
        return "skipped: opacus not installed (pip install 'dptrain[bench]')"
    return None


def accountant_bench(
    grid: tuple[AccountantPoint, ...] | list[AccountantPoint] = GRID,
    *,
    calibrate: bool = True,
    target_epsilon: float = TARGET_EPSILON,
    repeats: int = 1,
    libraries: tuple[str, ...] = ("dptrain", "dp_accounting", "opacus"),
    on_record: Callable[[AccountantRecord], None] | None = None,
) -> list[AccountantRecord]:
    """Epsilon (and, with ``calibrate``, sigma calibration) of every library on ``grid``.

    A library that fails or is missing gives a record with ``error`` set.
    """
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r} is not allowed: expected an integer >= 1")
    known = ("dptrain", "dp_accounting", "opacus")
    bad = [lib for lib in libraries if lib not in known]
    if bad:
        raise ValueError(f"libraries={bad!r} is not allowed: expected some of {list(known)}")
    from dptrain.accounting import epsilon_of_schedule

    records: list[AccountantRecord] = []

    def add(rec: AccountantRecord) -> None:
        records.append(rec)
        if on_record is not None:
            on_record(rec)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus' "Optimal order is the largest alpha"
        for p in grid:
            base = {"sample_rate": p.sample_rate, "steps": p.steps, "delta": p.delta}
            for library, name, approx, make in _EPSILON:
                if library not in libraries:
                    continue
                rec = AccountantRecord(
                    "epsilon",
                    library,
                    name,
                    noise_multiplier=p.noise_multiplier,
                    approximate=approx,
                    **base,
                )
                rec.error = _missing(library)
                if rec.error is None:
                    try:
                        rec.epsilon, rec.time_s = _timed(make(name), repeats, p)
                    except Exception as exc:
                        rec.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                add(rec)
            if not calibrate:
                continue
            for library, name, approx, make in _CALIBRATION:
                if library not in libraries:
                    continue
                rec = AccountantRecord(
                    "calibration",
                    library,
                    name,
                    target_epsilon=target_epsilon,
                    approximate=approx,
                    **base,
                )
                rec.error = _missing(library)
                if rec.error is None:
                    try:
                        rec.noise_multiplier, rec.time_s = _timed(
                            make(name), repeats, target_epsilon, p
                        )
                        rec.epsilon_pld = epsilon_of_schedule(
                            rec.noise_multiplier, p.delta, [(p.sample_rate, p.steps)]
                        )
                    except Exception as exc:
                        rec.error = f"{type(exc).__name__}: {exc}".splitlines()[0]
                add(rec)
    return records
