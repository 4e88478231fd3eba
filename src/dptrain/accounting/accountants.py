"""Accountants: how a :class:`PrivacyLedger` is counted as (epsilon, delta).

One small interface, bound to a ledger::

    acc = make_accountant("pld", ledger)
    acc.epsilon(delta=1e-5); acc.delta(epsilon=3.0)

The accountant reads the ledger each time it is asked, so it stays valid while
training appends steps (results are cached per ledger state).

- ``pld``: privacy loss distributions composed numerically (Koskela et al. 2020;
  Gopi et al. 2021; Doroshenko et al. 2022) by Google's ``dp_accounting``.
  Pessimistic discretisation, so the epsilon is an upper bound up to the
  truncation mass. The default: the tightest of the three.
- ``rdp``: Renyi DP of the Poisson-subsampled Gaussian (Mironov, Talwar & Zhang
  2019) converted to (epsilon, delta) (Canonne, Kamath & Steinke 2020, Prop. 12),
  also by ``dp_accounting``. A strict upper bound, looser than PLD.
- ``gdp``: the Gaussian-DP central limit theorem (Bu et al. 2020). Approximate:
  it can *underestimate* epsilon; everything that prints it says so.
"""

from __future__ import annotations

import abc
import functools
import math
from typing import ClassVar

import dp_accounting
import numpy as np
from dp_accounting.pld import privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant

from dptrain._checks import check_delta, check_positive, check_real
from dptrain.accounting.gdp import clt_mu, gdp_delta, gdp_epsilon
from dptrain.accounting.ledger import PrivacyLedger, PrivateSteps

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_RDP_ORDERS",
    "Accountant",
    "GDPAccountant",
    "PLDAccountant",
    "RDPAccountant",
    "ledger_to_dp_event",
    "make_accountant",
]

#: RDP orders: dense near 1 (small epsilon, many steps) and up to 1024 (few steps).
DEFAULT_RDP_ORDERS: tuple[float, ...] = tuple(
    [1.0 + x / 20.0 for x in range(1, 40)]
    + [3.0 + x / 4.0 for x in range(0, 28)]
    + list(range(10, 64))
    + [80.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0]
)


def ledger_to_dp_event(ledger: PrivacyLedger) -> dp_accounting.DpEvent:
    """The ledger as a ``dp_accounting`` event (composition of self-composed steps)."""
    return dp_accounting.ComposedDpEvent(
        [dp_accounting.SelfComposedDpEvent(_segment_event(s), s.count) for s in ledger.segments]
    )


def _segment_event(s: PrivateSteps) -> dp_accounting.DpEvent:
    gaussian = dp_accounting.GaussianDpEvent(s.noise_multiplier)
    if s.sample_rate == 1.0:
        return gaussian
    return dp_accounting.PoissonSampledDpEvent(s.sample_rate, gaussian)


class Accountant(abc.ABC):
    """(epsilon, delta) of the steps recorded in a ledger."""

    #: Short name used by the CLI and configs.
    name: ClassVar[str]
    #: True when the figures are estimates that may understate the privacy loss.
    approximate: ClassVar[bool] = False

    def __init__(self, ledger: PrivacyLedger):
        if not isinstance(ledger, PrivacyLedger):
            raise TypeError(f"ledger must be a PrivacyLedger, got {type(ledger).__name__}")
        self.ledger = ledger
        self._cache_key: tuple[PrivateSteps, ...] | None = None
        self._state: object = None

    def _current(self) -> object:
        key = self.ledger.segments
        if key != self._cache_key:
            self._state = self._build(key)
            self._cache_key = key
        return self._state

    @abc.abstractmethod
    def _build(self, segments: tuple[PrivateSteps, ...]) -> object:
        """Precompute whatever makes epsilon/delta queries cheap."""

    @abc.abstractmethod
    def epsilon(self, delta: float) -> float:
        """Smallest epsilon such that the recorded steps are (epsilon, delta)-DP."""

    @abc.abstractmethod
    def delta(self, epsilon: float) -> float:
        """Smallest delta such that the recorded steps are (epsilon, delta)-DP."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.ledger!r})"


class _DpAccountingAccountant(Accountant):
    """An accountant whose ``_build`` returns a composed ``dp_accounting`` accountant."""

    def epsilon(self, delta: float) -> float:
        delta = check_delta(delta)
        if self.ledger.num_steps == 0:
            return 0.0
        return float(self._current().get_epsilon(delta))  # type: ignore[attr-defined]

    def delta(self, epsilon: float) -> float:
        epsilon = _check_epsilon_query(epsilon)
        if self.ledger.num_steps == 0:
            return 0.0
        return float(self._current().get_delta(epsilon))  # type: ignore[attr-defined]


class PLDAccountant(_DpAccountingAccountant):
    """Numerical composition of privacy loss distributions (``dp_accounting``).

    Args:
        value_discretization_interval: grid step of the privacy-loss values.
            Coarser is faster and more pessimistic (epsilon only grows).
    """

    name = "pld"

    def __init__(self, ledger: PrivacyLedger, value_discretization_interval: float = 1e-4):
        super().__init__(ledger)
        self.value_discretization_interval = check_positive(
            "value_discretization_interval", value_discretization_interval
        )

    def _build(self, segments: tuple[PrivateSteps, ...]) -> object:
        # The same operations as dp_accounting's PLDAccountant on ledger_to_dp_event
        # (identity, then per segment the one-step PLD self-composed count times),
        # with the one-step PLD cached: a run that asks for epsilon after every
        # epoch rebuilds only the cheap self-composition.
        pld = privacy_loss_distribution.identity(self.value_discretization_interval)
        for s in segments:
            if s.sample_rate == 1.0:
                step = _gaussian_pld(
                    s.noise_multiplier / math.sqrt(s.count), self.value_discretization_interval
                )
            else:
                step = _subsampled_gaussian_pld(
                    s.sample_rate, s.noise_multiplier, self.value_discretization_interval
                ).self_compose(s.count)
            pld = pld.compose(step)
        return _PLDQueries(pld)


class _PLDQueries:
    """The get_epsilon / get_delta interface of a composed accountant, for one PLD."""

    def __init__(self, pld: privacy_loss_distribution.PrivacyLossDistribution):
        self.pld = pld

    def get_epsilon(self, delta: float) -> float:
        return self.pld.get_epsilon_for_delta(delta)

    def get_delta(self, epsilon: float) -> float:
        return self.pld.get_delta_for_epsilon(epsilon)


_ADD_OR_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE


@functools.lru_cache(maxsize=128)
def _subsampled_gaussian_pld(
    sample_rate: float, noise_multiplier: float, interval: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=noise_multiplier,
        value_discretization_interval=interval,
        sampling_prob=sample_rate,
        neighboring_relation=_ADD_OR_REMOVE,
    )


@functools.lru_cache(maxsize=128)
def _gaussian_pld(
    standard_deviation: float, interval: float
) -> privacy_loss_distribution.PrivacyLossDistribution:
    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=standard_deviation,
        value_discretization_interval=interval,
        neighboring_relation=_ADD_OR_REMOVE,
    )


class RDPAccountant(_DpAccountingAccountant):
    """Renyi DP of the subsampled Gaussian, converted to (epsilon, delta)."""

    name = "rdp"

    def __init__(self, ledger: PrivacyLedger, orders: tuple[float, ...] = DEFAULT_RDP_ORDERS):
        super().__init__(ledger)
        self.orders = tuple(float(a) for a in orders)
        if not self.orders or min(self.orders) <= 1.0:
            raise ValueError(f"orders={orders!r} is not allowed: expected orders > 1")

    def _build(self, segments: tuple[PrivateSteps, ...]) -> object:
        acc = rdp_privacy_accountant.RdpAccountant(
            orders=list(self.orders),
            neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
        )
        acc.compose(ledger_to_dp_event(self.ledger))
        return acc

    def rdp(self) -> np.ndarray:
        """Renyi divergence bound at each of :attr:`orders` for the whole ledger."""
        if self.ledger.num_steps == 0:
            return np.zeros(len(self.orders))
        return np.asarray(self._current().rdp, dtype=float)  # type: ignore[attr-defined]


class GDPAccountant(Accountant):
    """Gaussian DP with the central limit theorem: approximate (may understate epsilon)."""

    name = "gdp"
    approximate = True

    def _build(self, segments: tuple[PrivateSteps, ...]) -> object:
        return clt_mu(segments)

    @property
    def mu(self) -> float:
        """mu_tot of the recorded steps."""
        return float(self._current())  # type: ignore[arg-type]

    def epsilon(self, delta: float) -> float:
        delta = check_delta(delta)
        mu = self.mu
        return math.inf if math.isinf(mu) else gdp_epsilon(delta, mu)

    def delta(self, epsilon: float) -> float:
        epsilon = _check_epsilon_query(epsilon)
        mu = self.mu
        return 1.0 if math.isinf(mu) else gdp_delta(epsilon, mu)


def _check_epsilon_query(epsilon: float) -> float:
    # A delta query may ask about epsilon = 0 (the total variation distance).
    eps = check_real("epsilon", epsilon)
    if eps < 0:
        raise ValueError(f"epsilon={epsilon!r} is not allowed: expected a number >= 0")
    return eps


#: Accountants by name; ``pld`` is the default everywhere.
ACCOUNTANTS: dict[str, type[Accountant]] = {
    cls.name: cls for cls in (PLDAccountant, RDPAccountant, GDPAccountant)
}


def make_accountant(name: str, ledger: PrivacyLedger, **options: object) -> Accountant:
    """The accountant called ``name`` (``pld``, ``rdp`` or ``gdp``) over ``ledger``."""
    try:
        cls = ACCOUNTANTS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"accountant={name!r} is not known: expected one of {sorted(ACCOUNTANTS)}"
        ) from None
    return cls(ledger, **options)  # type: ignore[arg-type]
