"""Time noise calibration under each accountant (not a test).

    .venv/bin/python benchmarks/bench_calibration.py [--repeats 3]

Compares dptrain's calibration (GDP guess, coarse-PLD search, fine-PLD
settle) with the plain approach: bisection on sigma with dp_accounting's PLD
at its default resolution until the bracket is within 1%. Prints a markdown
table of median wall times and accountant evaluations.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import dp_accounting
from dp_accounting.pld import pld_privacy_accountant

from dptrain.accounting import calibrate_noise

Q, DELTA, TARGET = 256 / 60_000, 1e-5, 3.0


def plain_bisection(steps: int) -> tuple[float, int]:
    """Bisection on sigma in [0.1, 20] with full-resolution PLD until hi/lo <= 1.01."""

    def eps(sigma: float) -> float:
        acc = pld_privacy_accountant.PLDAccountant()
        event = dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(sigma))
        acc.compose(event, steps)
        return acc.get_epsilon(DELTA)

    lo, hi, n = 0.1, 20.0, 0
    while hi / lo > 1.01:
        mid = (lo * hi) ** 0.5
        n += 1
        if eps(mid) <= TARGET:
            hi = mid
        else:
            lo = mid
    return hi, n


def timed(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"# Calibration time, q = 256/60000, target epsilon {TARGET}, delta {DELTA:g}")
    print(
        f"machine: {platform.machine()}, {platform.processor() or 'cpu'}, python {platform.python_version()}"
    )
    print()
    print("| steps | method | sigma | evaluations | median time (s) |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for steps in (10_000, 100_000):
        for name in ("pld", "rdp", "gdp"):
            runs = [
                timed(
                    lambda name=name, steps=steps: calibrate_noise(
                        TARGET, DELTA, sample_rate=Q, steps=steps, accountant=name
                    )
                )
                for _ in range(args.repeats)
            ]
            cal = runs[0][1]
            med = statistics.median(t for t, _ in runs)
            print(
                f"| {steps:,} | dptrain {name} | {cal.noise_multiplier:.4f} | "
                f"{cal.evaluations} | {med:.2f} |"
            )
        t, (sigma, n) = timed(lambda steps=steps: plain_bisection(steps))
        print(f"| {steps:,} | plain PLD bisection | {sigma:.4f} | {n} | {t:.2f} |")


if __name__ == "__main__":
    main()
