"""Records of the benchmark and how they are written: JSON, markdown, a PNG chart.

Three kinds of record, each with a ``kind`` field:

- ``"step"`` (:class:`StepRecord`), one per workload x method: median step
  time and its interquartile range, ``time_ratio`` to the non-private median
  of the same run, peak memory (``peak_mb``), ``memory_ratio`` to the
  non-private peak, the baseline (memory once the model, optimizer and batch
  exist) and the increment above it; ``amp`` is the precision (``"off"``:
  float32, ``"bf16"``: bfloat16 autocast). A method that refuses the model, or
  is skipped, has ``error`` set and no figures;
- ``"max_batch"`` (:class:`MaxBatchRecord`): the largest batch size under a
  memory cap, per workload x method;
- ``"accountant"`` (:class:`~dptrain.bench.accountants.AccountantRecord`).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dptrain.bench.accountants import AccountantRecord

__all__ = [
    "GOAL_MEMORY_RATIO",
    "GOAL_SPEEDUP_OVER_OPACUS_GHOST",
    "GOAL_TIME_RATIO",
    "GOAL_WORKLOADS",
    "MaxBatchRecord",
    "StepRecord",
    "accountant_tables",
    "goals_table",
    "max_batch_table",
    "step_table",
    "write_json",
    "write_ratio_chart",
]

#: The issue's goals for ``dptrain-bk`` at B16/B64 T128, untied and tied.
GOAL_WORKLOADS = ("gpt-B16-T128", "gpt-B16-T128-tied", "gpt-B64-T128", "gpt-B64-T128-tied")
GOAL_TIME_RATIO = 1.25
GOAL_MEMORY_RATIO = 1.10
GOAL_SPEEDUP_OVER_OPACUS_GHOST = 1.6


@dataclass
class StepRecord:
    """Time and memory of one method on one workload (see the module docstring)."""

    workload: str
    method: str
    step_time_s: float | None = None
    step_time_q1_s: float | None = None
    step_time_q3_s: float | None = None
    timed_steps: int = 0
    time_ratio: float | None = None
    peak_mb: float | None = None
    memory_ratio: float | None = None
    baseline_mb: float | None = None
    peak_increment_mb: float | None = None
    increment_ratio: float | None = None
    error: str | None = None
    note: str | None = None
    batch_size: int | None = None
    seq_len: int | None = None
    device: str = "cpu"
    threads: int = 1
    amp: str = "off"
    kind: str = "step"

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready dict."""
        return asdict(self)


@dataclass
class MaxBatchRecord:
    """The largest batch size of one method on one workload under ``cap_mb``.

    ``ratio_to_nonprivate``: max batch / non-private max batch of the same run.
    ``probes``: [batch size, fits] in the order tried.
    """

    workload: str
    method: str
    cap_mb: float
    max_batch_size: int | None = None
    first_failing: int | None = None
    limit_reached: bool = False
    ratio_to_nonprivate: float | None = None
    probes: list[list[Any]] = field(default_factory=list)
    error: str | None = None
    device: str = "cpu"
    amp: str = "off"
    kind: str = "max_batch"

    def to_dict(self) -> dict[str, Any]:
        """The record as a JSON-ready dict."""
        return asdict(self)


Record = StepRecord | MaxBatchRecord | AccountantRecord

#: One colour per method in the chart: dptrain in blues/greens, Opacus in reds/oranges.
_METHOD_COLORS = {
    "dptrain-bk": "#1f77b4",
    "dptrain-bk-bounded": "#9467bd",
    "dptrain-ghost": "#17becf",
    "dptrain-instantiate": "#2ca02c",
    "opacus-hooks": "#d62728",
    "opacus-ghost": "#ff7f0e",
    "opacus-functorch": "#8c564b",
}


# -- JSON -----------------------------------------------------------------------------------------


def write_json(path: str | os.PathLike[str], records: Iterable[Record], **meta: Any) -> None:
    """``{"meta": {...}, "records": [...]}`` to ``path`` (the folder is created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = {"meta": meta, "records": [r.to_dict() for r in records]}
    with open(path, "w") as f:
        json.dump(payload, f, indent=1)
        f.write("\n")


# -- markdown -------------------------------------------------------------------------------------


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{spec}}{suffix}"


def _cell(text: str | None) -> str:
    return (text or "").replace("|", "\\|")


def step_table(records: Sequence[StepRecord]) -> str:
    """Markdown table of the step records, one row each."""
    lines = [
        "| workload | method | step time median (s) | IQR (s) | time ratio | peak (MB) "
        "| memory ratio | increment (MB) | increment ratio | error / note |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in records:
        iqr = (
            f"{r.step_time_q1_s:.3f}-{r.step_time_q3_s:.3f}"
            if r.step_time_q1_s is not None and r.step_time_q3_s is not None
            else "-"
        )
        text = r.error or ""
        if r.note:
            text = f"{text}; note: {r.note}" if text else f"note: {r.note}"
        lines.append(
            f"| {r.workload} | {r.method} | {_fmt(r.step_time_s, '.3f')} | {iqr} "
            f"| {_fmt(r.time_ratio, '.2f', 'x')} | {_fmt(r.peak_mb, '.0f')} "
            f"| {_fmt(r.memory_ratio, '.3f', 'x')} | {_fmt(r.peak_increment_mb, '.0f')} "
            f"| {_fmt(r.increment_ratio, '.2f', 'x')} | {_cell(text)} |"
        )
    return "\n".join(lines)


def goals_table(records: Sequence[StepRecord]) -> str:
    """The issue's goals for ``dptrain-bk`` (time, memory, speed-up over Opacus ghost),
    for the goal workloads present; empty if none is."""
    by = {(r.workload, r.method): r for r in records}
    rows = []
    for w in GOAL_WORKLOADS:
        bk = by.get((w, "dptrain-bk"))
        if bk is None:
            continue
        og = by.get((w, "opacus-ghost"))
        if og is not None and og.step_time_s and bk.step_time_s:
            speed = og.step_time_s / bk.step_time_s
            speed_text = (
                f"{speed:.2f}x ({'met' if speed >= GOAL_SPEEDUP_OVER_OPACUS_GHOST else 'missed'})"
            )
        elif og is not None and og.error:
            speed_text = f"Opacus ghost: {_cell(og.error)}"
        else:
            speed_text = "-"

        def verdict(value: float | None, limit: float) -> str:
            if value is None:
                return "-"
            if value <= limit:
                return f"{value:.3f}x (met)"
            return f"{value:.3f}x (**missed** by {value / limit - 1:.1%})"

        rows.append(
            f"| {w} | {verdict(bk.time_ratio, GOAL_TIME_RATIO)} "
            f"| {verdict(bk.memory_ratio, GOAL_MEMORY_RATIO)} | {speed_text} |"
        )
    if not rows:
        return ""
    head = [
        f"| workload | dptrain-bk time ratio (goal <= {GOAL_TIME_RATIO:.2f}x) "
        f"| memory ratio (goal <= {GOAL_MEMORY_RATIO:.2f}x) "
        f"| Opacus ghost time / dptrain-bk time (goal >= {GOAL_SPEEDUP_OVER_OPACUS_GHOST:.1f}x) |",
        "| --- | ---: | ---: | --- |",
    ]
    return "\n".join(head + rows)


def max_batch_table(records: Sequence[MaxBatchRecord]) -> str:
    """Markdown table of the largest-batch records."""
    lines = [
        "| workload | method | cap (MB) | largest batch | first failing | vs non-private "
        "| probes | error |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in records:
        best = "-" if r.max_batch_size is None else str(r.max_batch_size)
        if r.limit_reached:
            best = f">= {best} (search limit)"
        lines.append(
            f"| {r.workload} | {r.method} | {r.cap_mb:.0f} | {best} "
            f"| {'-' if r.first_failing is None else r.first_failing} "
            f"| {_fmt(r.ratio_to_nonprivate, '.2f', 'x')} | {len(r.probes)} | {_cell(r.error)} |"
        )
    return "\n".join(lines)


def accountant_tables(records: Sequence[AccountantRecord]) -> str:
    """Two markdown tables: epsilon queries, then calibrations (if any)."""
    eps = [r for r in records if r.task == "epsilon"]
    cal = [r for r in records if r.task == "calibration"]
    parts = []
    if eps:
        lines = [
            "| q | sigma | steps | delta | library | accountant | epsilon | time (s) | note |",
            "| ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | --- |",
        ]
        for r in eps:
            note = r.error or ("approximate (may understate epsilon)" if r.approximate else "")
            lines.append(
                f"| {r.sample_rate:.5g} | {_fmt(r.noise_multiplier, 'g')} | {r.steps:,} | {r.delta:g} "
                f"| {r.library} | {r.accountant} | {_fmt(r.epsilon, '.4f')} "
                f"| {_fmt(r.time_s, '.3f')} | {_cell(note)} |"
            )
        parts.append("\n".join(lines))
    if cal:
        lines = [
            "| q | steps | delta | target epsilon | library | accountant | sigma "
            "| PLD epsilon of sigma | time (s) | note |",
            "| ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | ---: | --- |",
        ]
        for r in cal:
            note = r.error or ("approximate (may understate epsilon)" if r.approximate else "")
            lines.append(
                f"| {r.sample_rate:.5g} | {r.steps:,} | {r.delta:g} | {_fmt(r.target_epsilon, 'g')} "
                f"| {r.library} | {r.accountant} | {_fmt(r.noise_multiplier, '.4f')} "
                f"| {_fmt(r.epsilon_pld, '.4f')} | {_fmt(r.time_s, '.3f')} | {_cell(note)} |"
            )
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


# -- the chart ------------------------------------------------------------------------------------


def write_ratio_chart(
    path: str | os.PathLike[str], records: Sequence[StepRecord], *, title: str = ""
) -> None:
    """PNG bar chart: time ratio (top) and memory ratio (bottom) to non-private, grouped by
    workload, one bar per private method; a method without a figure shows "n/a"."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    workloads = list(dict.fromkeys(r.workload for r in records))
    methods = [m for m in dict.fromkeys(r.method for r in records) if m != "nonprivate"]
    by = {(r.workload, r.method): r for r in records}
    width = 0.8 / max(1, len(methods))
    fig, axes = plt.subplots(
        2,
        1,
        figsize=(max(6.0, 1.6 * len(workloads) + 2), 7),
        sharex=True,
        squeeze=False,
        layout="constrained",
    )
    colors = {m: _METHOD_COLORS.get(m, "grey") for m in methods}
    for ax, attr, label in (
        (axes[0][0], "time_ratio", "step time / non-private"),
        (axes[1][0], "memory_ratio", "peak memory / non-private"),
    ):
        for j, m in enumerate(methods):
            for i, w in enumerate(workloads):
                x = i - 0.4 + (j + 0.5) * width
                r = by.get((w, m))
                value = None if r is None else getattr(r, attr)
                if value is None:
                    if r is not None:  # a refusal or a skip: mark the gap
                        ax.text(x, 0.02, "n/a", rotation=90, ha="center", va="bottom", fontsize=7)
                    continue
                ax.bar(x, value, width=width, color=colors[m])
                ax.text(x, value, f"{value:.2f}", rotation=90, ha="center", va="bottom", fontsize=6)
        ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_ylabel(label)
        ax.margins(y=0.12)
        ax.set_ylim(bottom=0.0, top=max(1.5, ax.get_ylim()[1]))
        ax.grid(axis="y", alpha=0.3)
    handles = [Patch(color=colors[m], label=m) for m in methods]
    fig.legend(
        handles=handles, loc="outside lower center", ncol=min(3, len(handles) or 1), fontsize=8
    )
    axes[1][0].set_xticks(range(len(workloads)))
    axes[1][0].set_xticklabels(workloads, rotation=20, ha="right", fontsize=8)
    if title:
        axes[0][0].set_title(title, fontsize=9)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
