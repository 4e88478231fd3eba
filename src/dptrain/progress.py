"""What a private run tells its user as it goes: the plan before the first step, and the
epsilon spent at every step.

- :func:`plan_text`: N (or users), q, steps, sigma, C, delta, the accountant and the
  target epsilon, printed before any training, so a wrong setting is seen at once and
  not after the run (a run learns nothing it could not have said at step 0).
- :func:`delta_warning`: delta is meant to be well below 1/N: a mechanism that publishes
  one random record outright is (0, 1/N)-DP, so delta >= 1/N protects nobody
  (Dwork & Roth 2014, §2.3; Ponomareva et al. 2023, "How to DP-fy ML", §5.2).
- :class:`EpsilonBar`: a tqdm bar that shows the epsilon spent after every step (from
  an :class:`EpsilonCurve`), beside whatever else the run puts on it.
- :class:`EpsilonCurve`: epsilon after each step of a fixed schedule, cheap enough for a
  progress bar at every step. A PLD evaluation costs 0.1-0.2 s on a 1e-3 grid (0.7-1.8 s
  at the 1e-4 of the final figure; measured on 2 CPU cores, q 0.01-0.15, 1-10,000 steps),
  too slow to run after every step. The curve evaluates at most ``points`` steps spread
  over the run, each once, when training first reaches it, and shows for step t the value
  at the first of them >= t: epsilon never decreases with more steps, so what the bar
  shows is never below what was spent, and it is exact at those steps.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from tqdm.auto import tqdm

from dptrain.accounting import PrivacyLedger, make_accountant

__all__ = ["EpsilonBar", "EpsilonCurve", "delta_warning", "plan_text"]


def delta_warning(delta: float, units: int, unit: str = "record") -> str | None:
    """A warning when ``delta`` >= 1 / ``units`` (else None)."""
    if delta < 1.0 / units:
        return None
    return (
        f"delta={delta:.3g} is not below 1/N = 1/{units} {unit}s ({1.0 / units:.3g}): a "
        f"mechanism that publishes one {unit} outright meets such a delta, so the guarantee "
        f"protects no {unit}; use delta well below 1/N (e.g. min(1e-5, 1/(10N)) = "
        f"{min(1e-5, 0.1 / units):.3g})"
    )


def plan_text(
    *,
    units: int,
    unit: str,
    sample_rate: float | Sequence[float],
    expected_batch: int | Sequence[int],
    steps: int,
    noise_multiplier: float,
    max_grad_norm: float,
    clipping: str,
    delta: float,
    delta_rule: str | None,
    accountant: str,
    target_epsilon: float | None,
) -> str:
    """The private plan of a run as lines of text (a warning line when delta >= 1/N)."""

    def many(values: float | Sequence[float], fmt: str) -> str:
        if isinstance(values, int | float):
            return format(values, fmt)
        shown = [format(v, fmt) for v in values]
        return shown[0] if len(shown) == 1 else " -> ".join(shown) + " (growing)"

    target = (
        f"{target_epsilon:g} (the noise is calibrated so the {steps} steps spend at most this)"
        if target_epsilon is not None
        else "none (noise multiplier given; epsilon is what the steps spend)"
    )
    rows = [
        ("units N", f"{units} {unit}s (Poisson-sampled, each protected)"),
        (
            "sample rate q",
            f"{many(sample_rate, '.4g')} (expected batch {many(expected_batch, 'd')})",
        ),
        ("steps", f"{steps}"),
        ("noise sigma", f"{noise_multiplier:.4g} (noise std sigma x C on each summed gradient)"),
        ("clipping C", f"{max_grad_norm:g} ({clipping})"),
        ("delta", f"{delta:.3g}" + (f" ({delta_rule})" if delta_rule else " (given)")),
        ("accountant", accountant),
        ("target epsilon", target),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["private plan (fixed before the first step):"]
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    warning = delta_warning(delta, units, unit)
    if warning:
        lines.append(f"  WARNING: {warning}")
    return "\n".join(lines)


class EpsilonCurve:
    """epsilon after step t of a fixed schedule, for every t, from at most ``points``
    accountant evaluations (module docstring).

    ``schedule``: ``[(sample_rate, noise_multiplier, steps), ...]`` in order.
    """

    def __init__(
        self,
        schedule: Sequence[tuple[float, float, int]],
        delta: float,
        accountant: str = "pld",
        *,
        points: int = 50,
    ) -> None:
        self.schedule = [(float(q), float(s), int(k)) for q, s, k in schedule if k > 0]
        self.delta = delta
        self.accountant = accountant
        self.steps = sum(k for _, _, k in self.schedule)
        # Every step of a short run; for a long one, `points` steps spread evenly (the
        # first few steps too, where epsilon moves most).
        grid = {math.ceil(self.steps * i / points) for i in range(1, points + 1)}
        grid |= set(range(1, min(self.steps, 5) + 1))
        self.grid = sorted(t for t in grid if 1 <= t <= self.steps)
        self._values: dict[int, float] = {}

    def _epsilon_at(self, t: int) -> float:
        ledger = PrivacyLedger()
        left = t
        for q, sigma, k in self.schedule:
            take = min(k, left)
            if take:
                ledger.record(q, sigma, take)
            left -= take
            if not left:
                break
        # The 1e-3 PLD grid: about 10x faster than 1e-4 and pessimistic (never below it).
        options = {"value_discretization_interval": 1e-3} if self.accountant == "pld" else {}
        return make_accountant(self.accountant, ledger, **options).epsilon(self.delta)

    def at_most(self, step: int) -> int:
        """The step whose epsilon is shown for ``step``: the first evaluated one >= it."""
        if step <= 0:
            return 0
        if step > self.steps:
            raise ValueError(f"step={step} is not allowed: the schedule has {self.steps} steps")
        return self.grid[bisect.bisect_left(self.grid, step)]

    def __call__(self, step: int) -> float:
        """An upper bound on epsilon after ``step`` steps (exact at the evaluated steps)."""
        t = self.at_most(step)
        if t == 0:
            return 0.0
        if t not in self._values:
            self._values[t] = self._epsilon_at(t)
        return self._values[t]


class EpsilonBar(tqdm):
    """A progress bar that shows ``eps=<=...`` after every step: the epsilon spent so
    far, an upper bound from ``curve`` (None: a non-private run, nothing shown). Other
    figures set with ``set_postfix`` are kept beside it (a later ``eps=`` from the ledger
    replaces the bound until the next step). ``events_per_step``: ledger steps per bar
    step (DP-FP's micro-batches)."""

    def __init__(
        self, *args, curve: EpsilonCurve | None = None, events_per_step: int = 1, **kwargs
    ) -> None:
        self._curve = curve
        self._per_step = events_per_step
        self._done = 0
        self._shown: dict[str, object] = {}
        super().__init__(*args, **kwargs)

    def update(self, n: float | None = 1) -> bool | None:
        self._done += int(n or 0)
        if self._curve is not None and not self.disable:
            events = min(self._done * self._per_step, self._curve.steps)
            self._shown["eps"] = f"<={self._curve(events):.2f}"
            super().set_postfix(self._shown, refresh=False)
        return super().update(n)

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs) -> None:
        self._shown.update(ordered_dict or {}, **kwargs)
        super().set_postfix(self._shown, refresh=refresh)
