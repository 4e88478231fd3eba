"""What the property checks (dptrain.audit.properties) detect at the CLI self-test's defaults:
N = 1000 records, q = 0.1, T = 20 steps, two tensors (a 1000 x 1000 weight, 65,536 of its
coordinates kept, and a bias of 1000), alpha = 1e-3 (each check at alpha / 3).

    PYTHONPATH=src python benchmarks/property_checks_reach.py

(a) and (b) from their exact null distributions (closed form); (c) by simulating the
sampler's sizes with numpy and running batch_size_test itself.
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from dptrain.audit.properties import DEFAULT_ALPHA, STATISTICAL_CHECKS, batch_size_test

N, Q, T = 1000, 0.1, 20
SIZES = {"weight": 65_536, "bias": 1000}
LEVEL = DEFAULT_ALPHA / STATISTICAL_CHECKS


def batch_rates(runs: int = 2000) -> list[tuple[float, float]]:
    rng = np.random.default_rng(0)
    out = []
    for k in (0.8, 0.85, 0.9, 0.95, 1.0, 1.05, 1.1, 1.15, 1.2, 1.3):
        flagged = sum(
            batch_size_test(rng.binomial(N, min(1.0, k * Q), T), N, [Q] * T, LEVEL, seed=i).flagged
            for i in range(runs)
        )
        out.append((k, flagged / runs))
    return out


def std_ratio(power: float = 0.5) -> dict[str, tuple[float, float]]:
    """Per tensor: the std ratios below / above 1 flagged with probability ``power`` in every
    step (pooled test) - the smallest error seen at the defaults."""
    tests = len(SIZES) * (1 + T)
    a = LEVEL / tests / 2  # two-sided, Bonferroni over every tensor and step test
    out = {}
    for name, n in SIZES.items():
        dof = n * T
        lo, hi = stats.chi2.ppf(a, dof), stats.chi2.isf(a, dof)
        # chi = r^2 chi2(dof): flagged w.p. `power` when r^2 = lo / median or hi / median
        med = stats.chi2.ppf(power, dof)
        med_hi = stats.chi2.isf(power, dof)
        out[name] = (float(np.sqrt(lo / med_hi)), float(np.sqrt(hi / med)))
    return out


def correlation(power: float = 0.5) -> dict[str, float]:
    """The correlation between the noise of two steps flagged with probability ``power``."""
    groups = {**SIZES, "all tensors": sum(SIZES.values())}
    pairs = len(groups) * T * (T - 1) // 2
    a = LEVEL / pairs / 2
    out = {}
    for name, n in groups.items():
        h = (n - 1) / 2
        r_crit = 2 * stats.beta.isf(a, h, h) - 1
        # r is about N(rho, (1 - rho^2)^2 / n): at power 1/2 rho ~ r_crit
        out[name] = float(r_crit if power == 0.5 else np.nan)
    return out


def main() -> None:
    print(f"(c) batch sizes, N {N}, q {Q}, T {T}: sampler rate k q -> fraction of runs flagged")
    for k, f in batch_rates():
        print(f"    k = {k:<5g} {f:.3f}")
    print("(b) noise std: measured / claimed std flagged in half the runs (low, high)")
    for name, (lo, hi) in std_ratio().items():
        print(f"    {name:<7} {lo:.4f} {hi:.4f}")
    print("(a) correlation of two steps' noise flagged in half the runs")
    for name, r in correlation().items():
        print(f"    {name:<12} {r:.4f}")


if __name__ == "__main__":
    main()
