"""Batch-size and learning-rate schedules the recipes share (``mlm``, ``lm``, ``table2text``).

**Growing batch size** (Anil et al. 2021, §5.3). ``batch_size`` is the final
expected batch B. With growth g > 1 the warm-up is cut into S stages of
(nearly) equal length; stage k = 0..S-1 uses B_k = round(B/g + k (B - B/g) / S),
the linear increments of Anil et al. (262K -> 1M in four quarters of the
warm-up, +196K each), and B from the end of the warm-up on. Growth 1 is a fixed
batch. An explicit schedule ``"BxS,BxS,..."`` (expected batch x steps) may be
given instead. :func:`schedule_function` turns the stages into the
``step -> B`` function that :func:`~dptrain.privacy_engine.make_private` takes,
so the noise is calibrated for the schedule and the ledger records each stage.

**Learning rate** (:func:`lr_lambda`), with W warm-up steps, T steps and t = 0..T-1:
linear warm-up ``(t + 1) / W`` for t < W, then ``constant`` (1), ``linear``
decay ``(T - t) / (T - W)`` or ``quadratic`` decay ``(1 - (t - W) / (T - W))**2``
(Anil et al. §4.3, :func:`lr_factor`).
"""

from __future__ import annotations

import re
from collections.abc import Callable

from dptrain._checks import check_int

__all__ = [
    "LR_SCHEDULES",
    "batch_stages",
    "check_schedule_steps",
    "check_stages",
    "lr_factor",
    "lr_lambda",
    "parse_batch_schedule",
    "resolve_stages",
    "schedule_function",
]

#: The learning-rate schedules :func:`lr_lambda` knows (after the linear warm-up).
LR_SCHEDULES = ("constant", "linear", "quadratic")

_STAGE = re.compile(r"^\s*(\d+)\s*[xX*]\s*(\d+)\s*$")


def parse_batch_schedule(spec: str) -> list[tuple[int, int]]:
    """``"256x10,1024x50"`` -> ``[(256, 10), (1024, 50)]`` (expected batch, steps) per stage."""
    stages = []
    for part in str(spec).split(","):
        m = _STAGE.match(part)
        if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            raise ValueError(
                f"batch_schedule={spec!r} is not allowed: expected stages 'BxS' separated by "
                "commas, B (expected batch) and S (steps) integers >= 1, e.g. '256x10,1024x50'"
            )
        stages.append((int(m.group(1)), int(m.group(2))))
    return stages


def check_schedule_steps(spec: str, steps: int) -> None:
    """Refuse an explicit schedule whose stages do not add up to ``steps``."""
    total = sum(s for _, s in parse_batch_schedule(spec))
    if total != steps:
        raise ValueError(
            f"batch_schedule={spec!r} has {total} steps but steps={steps}: expected the "
            "stages to add up to steps"
        )


def batch_stages(
    batch_size: int, steps: int, warmup_steps: int, growth: float = 1.0, stages: int = 4
) -> list[tuple[int, int]]:
    """The growing schedule as ``[(B_k, steps_k), ...]`` (see the module docstring).

    The warm-up is cut into ``stages`` parts of nearly equal length (the first
    ``warmup_steps % stages`` one step longer); stage k has
    B_k = round(B/g + k (B - B/g) / S); the rest of the run has B. Consecutive
    stages with the same batch are merged, empty ones dropped.
    """
    batch_size = check_int("batch_size", batch_size, 1)
    steps = check_int("steps", steps, 1)
    warmup_steps = check_int("warmup_steps", warmup_steps, 0)
    stages = check_int("growth_stages", stages, 1)
    if warmup_steps > steps:
        raise ValueError(
            f"warmup_steps={warmup_steps!r} is not allowed: expected at most steps={steps}"
        )
    out: list[tuple[int, int]] = []

    def add(b: int, n: int) -> None:
        if n <= 0:
            return
        if out and out[-1][0] == b:
            out[-1] = (b, out[-1][1] + n)
        else:
            out.append((b, n))

    if growth > 1 and warmup_steps > 0:
        start = batch_size / growth
        for k in range(stages):
            length = warmup_steps // stages + (1 if k < warmup_steps % stages else 0)
            add(max(1, round(start + k * (batch_size - start) / stages)), length)
        add(batch_size, steps - warmup_steps)
    else:
        add(batch_size, steps)
    return out


def resolve_stages(
    batch_size: int,
    steps: int,
    warmup_steps: int,
    growth: float,
    growth_stages: int,
    batch_schedule: str | None,
) -> list[tuple[int, int]]:
    """The explicit ``batch_schedule`` when given, else :func:`batch_stages` of the rest."""
    if batch_schedule is not None:
        return parse_batch_schedule(batch_schedule)
    return batch_stages(batch_size, steps, warmup_steps, growth, growth_stages)


def check_stages(stages: list[tuple[int, int]], n: int, what: str = "training examples") -> None:
    """Refuse a stage whose expected batch exceeds the ``n`` units (``what``) there are."""
    for k, (b, s) in enumerate(stages):
        if b > n:
            raise ValueError(
                f"batch schedule stage {k} (expected batch {b} for {s} steps) is not allowed: "
                f"its expected batch exceeds the {n} {what}; expected batches <= {n} "
                "(lower batch_size, or use more data)"
            )


def schedule_function(stages: list[tuple[int, int]]) -> Callable[[int], int]:
    """step (from 0) -> expected batch size of the stage that step falls in."""
    bounds = []
    end = 0
    for b, n in stages:
        end += n
        bounds.append((end, b))
    total = end

    def batch_at(step: int) -> int:
        if not 0 <= step < total:
            raise ValueError(f"step={step!r} is outside the schedule's {total} steps")
        for stop, b in bounds:
            if step < stop:
                return b
        raise AssertionError("unreachable")

    return batch_at


def lr_factor(step: int, total_steps: int, warmup_steps: int) -> float:
    """Anil et al.'s schedule: linear warm-up, then quadratic decay to 0 (module docstring)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if total_steps == warmup_steps:
        return 1.0
    return max(0.0, 1.0 - (step - warmup_steps) / (total_steps - warmup_steps)) ** 2


def lr_lambda(total_steps: int, schedule: str, warmup_steps: int) -> Callable[[int], float]:
    """step -> learning-rate factor: linear warm-up over ``warmup_steps``, then ``schedule``
    (one of :data:`LR_SCHEDULES`; see the module docstring). For ``LambdaLR``."""
    if schedule not in LR_SCHEDULES:
        raise ValueError(
            f"lr_schedule={schedule!r} is not allowed: expected one of {list(LR_SCHEDULES)}"
        )
    if schedule == "quadratic":
        return lambda step: lr_factor(step, total_steps, warmup_steps)

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        if schedule == "constant":
            return 1.0
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return factor
