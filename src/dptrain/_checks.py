"""Argument checks shared by the public API.

Every message names the argument, the value it got and what is allowed, so a
user can fix a call without reading the source.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_real(name: str, value: object) -> float:
    """Return ``value`` as a float; reject non-numbers, NaN and infinities."""
    if not _is_real(value) or not math.isfinite(float(value)):  # type: ignore[arg-type]
        raise ValueError(f"{name}={value!r} is not allowed: expected a finite real number")
    return float(value)  # type: ignore[arg-type]


def check_positive(name: str, value: object) -> float:
    """A finite number > 0."""
    v = check_real(name, value)
    if v <= 0:
        raise ValueError(f"{name}={value!r} is not allowed: expected a number > 0")
    return v


def check_real_at_least(name: str, value: object, minimum: float) -> float:
    """A finite number >= minimum."""
    v = check_real(name, value)
    if v < minimum:
        raise ValueError(f"{name}={value!r} is not allowed: expected a number >= {minimum:g}")
    return v


def check_in_interval(
    name: str,
    value: object,
    low: float,
    high: float,
    *,
    low_open: bool = True,
    high_open: bool = True,
) -> float:
    """A finite number inside an interval whose ends may be open or closed."""
    v = check_real(name, value)
    too_low = v <= low if low_open else v < low
    too_high = v >= high if high_open else v > high
    if too_low or too_high:
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
        raise ValueError(f"{name}={value!r} is outside the allowed range {interval}")
    return v


def check_delta(value: object, name: str = "delta") -> float:
    """delta of (epsilon, delta)-DP: in the open interval (0, 1)."""
    return check_in_interval(name, value, 0.0, 1.0)


def check_sample_rate(value: object, name: str = "sample_rate") -> float:
    """Poisson sampling rate q: in (0, 1]; q = 1 means every record every step."""
    return check_in_interval(name, value, 0.0, 1.0, high_open=False)


def check_int(name: str, value: object, minimum: int) -> int:
    """An integer >= minimum (bools and floats with a fraction are refused)."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        else:
            raise ValueError(f"{name}={value!r} is not allowed: expected an integer >= {minimum}")
    if value < minimum:
        raise ValueError(f"{name}={value!r} is not allowed: expected an integer >= {minimum}")
    return value


def check_finite_array(name: str, values: Iterable[float] | Any) -> Any:
    """``values`` (an iterable, array or tensor) as a flat float64 numpy array; NaN and
    infinities refused."""
    import numpy as np

    arr = np.asarray(
        values.detach().cpu().numpy() if hasattr(values, "detach") else list(values),
        dtype=np.float64,
    ).ravel()
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} is not allowed: it holds NaN or infinite values")
    return arr
