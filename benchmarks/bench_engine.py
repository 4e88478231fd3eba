"""Step time and peak memory of the DP clipping engine vs non-private training (not a test).

    .venv/bin/python benchmarks/bench_engine.py [--quick] [--json PATH] [--markdown PATH]

Model: the GPT-2-like reference model, ``GPT(GPTConfig(vocab_size=8000,
max_seq_len=512, n_layer=4, n_head=4, d_model=256, d_mlp=1024, dropout=0.0,
tie_embeddings=...))`` with AdamW(lr=1e-4), on random token ids (fixed seed;
targets are the ids shifted by one). Workloads: B16 T128, B64 T128 and
B4 T512, each with untied and tied embeddings.

Methods (one full training step each):

- ``nonprivate``: mean cross-entropy, ``loss.backward()``, ``opt.step()``;
- ``dptrain-bk``: ``ClippingEngine(mode="book_keeping")`` + ``DPOptimizer(AdamW)``;
- ``dptrain-ghost``: the same with ``mode="ghost"`` (two backward passes);
- ``dptrain-instantiate``: book-keeping with ``norm_method="instantiate"``
  (skipped where the per-example gradients would need more than ~6 GB);
- ``opacus-hooks`` / ``opacus-ghost``: Opacus ``PrivacyEngine.make_private``
  (``poisson_sampling=False``, loss reduction "mean"; ghost mode uses the
  wrapped criterion with ``shape=logits.shape``, one privacy unit per
  sequence). Opacus needs a batch dimension in an Embedding's input, so for
  these methods the position embedding is looked up with (B, T) positions
  (same parameters and output; the row's note says so). Where Opacus refuses
  the model the row carries the error.

The models, batches and steps are those of ``dptrain bench``
(:mod:`dptrain.bench.workloads`), and so are the round-robin timing loop
(:mod:`dptrain.bench.timing`) and the fresh memory process
(:mod:`dptrain.bench.memory`); this script adds the goal checks and the
profile. ``dptrain bench`` (docs/bench.md) is the wider comparison: more
workloads, Opacus functorch, the largest batch under a cap, accountants.

Timing: ``torch.set_num_threads(1)``; within a workload every method gets
2 warm-up steps and then the timed steps, interleaved round-robin (one step
of each method per round, the starting method rotating every round) so that
drift hits all methods alike. Reported: median and interquartile range of the
timed steps, and time_ratio = median / the non-private median of the same
workload in the same run.

Memory: each (workload, method) runs in a fresh process
(``python -m dptrain.bench._child WORKLOAD METHOD``): it builds the model
and optimizer, records ``ru_maxrss`` (the baseline: imports, model,
optimizer, batch), runs 3 steps and reports ``ru_maxrss`` again. Each process
imports only what its method needs (torch and the model; the dptrain engine;
Opacus). memory_ratio = peak RSS / non-private peak RSS (the headline);
increment_ratio = (peak - baseline) / non-private (peak - baseline), which
removes the constant import baseline (a few hundred MB of torch) that pulls
plain ratios towards 1.

A full run ends, if dptrain book-keeping misses a goal, with a torch.profiler
summary of one dptrain-bk step (``--profile WORKLOAD`` runs it alone).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from _harness import command_line, git_description, machine_description
from dptrain.bench import memory as bench_memory
from dptrain.bench import workloads as bench_workloads
from dptrain.bench.report import GOAL_MEMORY_RATIO, GOAL_TIME_RATIO
from dptrain.bench.timing import time_round_robin
from dptrain.bench.workloads import (
    INSTANTIATE_LIMIT_BYTES,
    LR,
    SEED,
    first_line,
)

WARMUP_STEPS = 2
MEMORY_STEPS = 3

WORKLOADS_BY_NAME = bench_workloads.WORKLOADS
#: name -> (batch size, sequence length, tied embeddings): the GPT workloads of dptrain.bench
WORKLOADS: dict[str, tuple[int, int, bool]] = {
    name: (w.batch_size, w.seq_len, w.tied)
    for name, w in WORKLOADS_BY_NAME.items()
    if w.model == "gpt"
}
QUICK_WORKLOADS = ("gpt-B16-T128", "gpt-B16-T128-tied")

METHODS = (
    "nonprivate",
    "dptrain-bk",
    "dptrain-ghost",
    "dptrain-instantiate",
    "opacus-hooks",
    "opacus-ghost",
)
QUICK_METHODS = ("nonprivate", "dptrain-bk", "dptrain-ghost")

#: The goals for dptrain book-keeping: (workload, max time ratio, max memory ratio).
#: The ratios are dptrain bench's (one definition of the issue's goals); the order of the
#: workloads is this report's.
GOAL_WORKLOADS = ("gpt-B16-T128", "gpt-B64-T128", "gpt-B16-T128-tied", "gpt-B64-T128-tied")
PROFILE_WORKLOAD = "gpt-B64-T128"


@dataclass
class Record:
    workload: str
    method: str
    step_time_s: float | None = None
    step_time_q1_s: float | None = None
    step_time_q3_s: float | None = None
    timed_steps: int = 0
    time_ratio: float | None = None
    peak_mb: float | None = None
    baseline_mb: float | None = None
    peak_increment_mb: float | None = None
    memory_ratio: float | None = None
    increment_ratio: float | None = None
    error: str | None = None
    note: str | None = None


# -- building one method's training step (shared with `dptrain bench`) ----------------------------


def make_model(tied: bool) -> torch.nn.Module:
    """The GPT reference model (seed 0), untied or tied."""
    return bench_workloads.make_model(WORKLOADS_BY_NAME["gpt-B16-T128" + ("-tied" if tied else "")])


def make_batch(batch_size: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (seed 0) and the next tokens, (B, T) each."""
    return bench_workloads.make_batch(
        bench_workloads.Workload("gpt", "gpt", batch_size, seq_len, False)
    )


def instantiate_bytes(batch_size: int, tied: bool) -> float:
    """Rough peak of norm_method="instantiate" (see dptrain.bench.workloads.instantiate_bytes)."""
    return bench_workloads.instantiate_bytes(WORKLOADS_BY_NAME["gpt-B16-T128"], batch_size)


def build_step(workload: str, method: str) -> bench_workloads.BuiltStep:
    """Model, optimizer and batch for one (workload, method): dptrain.bench.workloads.build_step."""
    return bench_workloads.build_step(WORKLOADS_BY_NAME[workload], method)


# -- timing ---------------------------------------------------------------------------------------


def time_workload(
    workload: str, methods: tuple[str, ...], timed_steps: int, bar
) -> dict[str, Record]:
    """Round-robin timing of all methods on one workload; failing methods get an error."""
    records = {m: Record(workload, m) for m in methods}
    steps: dict[str, Callable[[], None]] = {}
    for m in methods:
        try:
            built = build_step(workload, m)
        except Exception as exc:  # Opacus refusing the model, or a deliberate skip
            records[m].error = first_line(exc)
            continue
        steps[m], records[m].note = built.step, built.note
    bar.update((len(methods) - len(steps)) * (WARMUP_STEPS + timed_steps))  # not run at all

    def progress(m: str) -> None:
        bar.set_postfix_str(f"{workload} {m}", refresh=False)
        bar.update(1)

    result = time_round_robin(steps, warmup=WARMUP_STEPS, timed=timed_steps, on_step=progress)
    for m, err in result.errors.items():
        records[m].error = err
    for m in steps:
        s = result.summary(m)
        if s is not None:
            rec = records[m]
            rec.step_time_s, rec.step_time_q1_s, rec.step_time_q3_s = s.median_s, s.q1_s, s.q3_s
            rec.timed_steps = s.steps
    base = records.get("nonprivate")
    for rec in records.values():
        if rec.step_time_s is not None and base is not None and base.step_time_s:
            rec.time_ratio = rec.step_time_s / base.step_time_s
    steps.clear()
    return records


# -- memory ---------------------------------------------------------------------------------------


def measure_memory_child(workload: str, method: str) -> None:
    """Hidden mode: build, run MEMORY_STEPS steps, print the result as one JSON line."""
    bench_memory.main([workload, method, "--steps", str(MEMORY_STEPS)])


def measure_memory(workload: str, method: str) -> dict:
    """Peak RSS of (workload, method) in a fresh process (dptrain.bench.memory.measure_peak)."""
    return bench_memory.measure_peak(workload, method, threads=1, steps=MEMORY_STEPS)


def add_memory(records: dict[str, Record], bar) -> None:
    for m, rec in records.items():
        bar.set_postfix_str(f"{rec.workload} {m}", refresh=False)
        res = measure_memory(rec.workload, m)
        bar.update(1)
        if "peak_mb" in res:
            rec.peak_mb = res["peak_mb"]
            rec.baseline_mb = res["baseline_mb"]
            rec.peak_increment_mb = rec.peak_mb - rec.baseline_mb
        elif rec.error is None:
            rec.error = res.get("error", "memory measurement failed")
    base = records.get("nonprivate")
    if base is None or base.peak_mb is None:
        return
    for rec in records.values():
        if rec.peak_mb is not None:
            rec.memory_ratio = rec.peak_mb / base.peak_mb
            if base.peak_increment_mb and base.peak_increment_mb > 0:
                rec.increment_ratio = rec.peak_increment_mb / base.peak_increment_mb


# -- profile --------------------------------------------------------------------------------------


def profile_markdown(workload: str, method: str = "dptrain-bk", top: int = 10) -> str:
    """Profile one step (after warm-up) with torch.profiler; markdown summary."""
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.set_num_threads(1)
    b, t, tied = WORKLOADS[workload]
    x, y = make_batch(b, t)
    model = make_model(tied)
    if method == "nonprivate":
        opt = torch.optim.AdamW(model.parameters(), lr=LR)

        def step() -> None:
            opt.zero_grad()
            with record_function("phase: forward"):
                logits = model(x)
            with record_function("phase: loss"):
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            with record_function("phase: backward"):
                loss.backward()
            with record_function("phase: optimizer step"):
                opt.step()

    else:
        from dptrain.clipping import ClippingEngine
        from dptrain.losses import per_example_cross_entropy
        from dptrain.optim import DPOptimizer

        mode = "ghost" if method == "dptrain-ghost" else "book_keeping"
        engine = ClippingEngine(model, 1.0, mode=mode)
        dpopt = DPOptimizer(
            torch.optim.AdamW(model.parameters(), lr=LR),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            expected_batch_size=b,
            sample_rate=0.01,
            seed=SEED,
        )
        # Label the engine's phases on this instance only (the engine itself is untouched).
        for attr, label in (
            ("_records", "engine: collect (a, g) records"),
            ("_norms_sq", "engine: per-example norms"),
            ("_book_keeping", "engine: book-keeping clipped sums"),
        ):
            fn = getattr(engine, attr)

            def labelled(*args, _fn=fn, _label=label, **kwargs):
                with record_function(_label):
                    return _fn(*args, **kwargs)

            setattr(engine, attr, labelled)
        add_noise = dpopt.add_noise

        def labelled_noise(*args, **kwargs):
            with record_function("optimizer: add noise"):
                return add_noise(*args, **kwargs)

        dpopt.add_noise = labelled_noise

        def step() -> None:
            dpopt.zero_grad()
            with record_function("phase: forward"):
                logits = model(x)
            with record_function("phase: loss"):
                losses = per_example_cross_entropy(logits, y, reduction="sum")
            with record_function("phase: engine.backward"):
                engine.backward(losses)
            with record_function("phase: optimizer step"):
                dpopt.step()

    for _ in range(WARMUP_STEPS):
        step()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    wall = time.perf_counter() - start
    events = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in events) or 1.0
    lines = [
        f"Profile of one `{method}` step on `{workload}` (torch.profiler, CPU, "
        f"record_shapes=True, 1 thread, after {WARMUP_STEPS} warm-up steps; "
        f"step wall time under the profiler {wall:.2f} s).",
        "",
        "Phases (inclusive CPU time of the labelled regions):",
        "",
        "| phase | CPU time (s) | share of step |",
        "| --- | ---: | ---: |",
    ]
    phases = [
        e
        for e in events
        if e.key.startswith(("phase:", "engine:", "optimizer:")) and e.cpu_time_total > 0
    ]
    step_total = sum(e.cpu_time_total for e in phases if e.key.startswith("phase:")) or 1.0
    rows = [(e.key, e.cpu_time_total) for e in phases]
    inclusive = dict(rows)
    if "phase: engine.backward" in inclusive:
        labelled = sum(v for k, v in rows if k.startswith("engine:"))
        rest = inclusive["phase: engine.backward"] - labelled
        rows.append(("engine: the rest (autograd.grad to the outputs, clip factors)", rest))
    order = (
        "phase: forward",
        "phase: loss",
        "phase: backward",
        "phase: engine.backward",
        "engine: collect",
        "engine: per-example",
        "engine: book-keeping",
        "engine: the rest",
        "phase: optimizer step",
        "optimizer: add noise",
    )
    rows.sort(key=lambda kv: next(i for i, p in enumerate((*order, "")) if kv[0].startswith(p)))
    for key, v in rows:
        lines.append(f"| {key} | {v / 1e6:.3f} | {v / step_total:.0%} |")
    lines += [
        "",
        f"Top {top} operators by self CPU time:",
        "",
        "| operator | calls | self CPU (s) | share |",
        "| --- | ---: | ---: | ---: |",
    ]
    ops = sorted(
        (e for e in events if not e.key.startswith(("phase:", "engine:", "optimizer:"))),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )
    for e in ops[:top]:
        lines.append(
            f"| `{e.key}` | {e.count} | {e.self_cpu_time_total / 1e6:.3f} | "
            f"{e.self_cpu_time_total / total_self:.0%} |"
        )
    by_shape = sorted(
        prof.key_averages(group_by_input_shape=True),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )
    by_shape = [e for e in by_shape if not e.key.startswith(("phase:", "engine:", "optimizer:"))]
    lines += [
        "",
        f"Top {top} (operator, input shapes) by self CPU time:",
        "",
        "| operator | input shapes | calls | self CPU (s) |",
        "| --- | --- | ---: | ---: |",
    ]
    for e in by_shape[:top]:
        shapes = ", ".join(str(tuple(s)) for s in e.input_shapes if s) or "(tensor list)"
        lines.append(f"| `{e.key}` | {shapes} | {e.count} | {e.self_cpu_time_total / 1e6:.3f} |")
    return "\n".join(lines)


def run_profile_subprocess(workload: str, method: str) -> str:
    proc = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--profile",
            workload,
            "--profile-method",
            method,
        ],
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return f"(profile of {method} on {workload} failed: {tail})"
    # the profiler's own trace lines (USDT: ...) are not part of the summary
    return "\n".join(ln for ln in proc.stdout.strip().splitlines() if not ln.startswith("USDT:"))


# -- reporting ------------------------------------------------------------------------------------


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{spec}}{suffix}"


def markdown_table(records: list[Record]) -> str:
    lines = [
        "| workload | method | step time median (s) | IQR (s) | time ratio | peak RSS (MB) "
        "| memory ratio | peak increment (MB) | increment ratio | error / note |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in records:
        iqr = (
            f"{r.step_time_q1_s:.3f}-{r.step_time_q3_s:.3f}"
            if r.step_time_q1_s is not None and r.step_time_q3_s is not None
            else "-"
        )
        note = "; ".join(t for t in (r.error, r.note and f"note: {r.note}") if t)
        note = note.replace("|", "\\|")
        lines.append(
            f"| {r.workload} | {r.method} | {_fmt(r.step_time_s, '.3f')} | {iqr} "
            f"| {_fmt(r.time_ratio, '.2f', 'x')} | {_fmt(r.peak_mb, '.0f')} "
            f"| {_fmt(r.memory_ratio, '.3f', 'x')} | {_fmt(r.peak_increment_mb, '.0f')} "
            f"| {_fmt(r.increment_ratio, '.2f', 'x')} | {note} |"
        )
    return "\n".join(lines)


@dataclass
class GoalCheck:
    workload: str
    metric: str
    value: float | None
    limit: float

    @property
    def met(self) -> bool | None:
        return None if self.value is None else self.value <= self.limit

    def describe(self) -> str:
        if self.value is None:
            return "not measured"
        if self.met:
            return f"met ({self.value:.3f}x <= {self.limit:.2f}x)"
        miss = self.value - self.limit
        return (
            f"**missed** ({self.value:.3f}x > {self.limit:.2f}x: by {miss:.3f}x, "
            f"{miss / self.limit:.1%} over the limit)"
        )


def check_goals(records: list[Record], method: str = "dptrain-bk") -> list[GoalCheck]:
    by_key = {(r.workload, r.method): r for r in records}
    checks = []
    for w in GOAL_WORKLOADS:
        r = by_key.get((w, method))
        if r is None:
            continue
        checks.append(GoalCheck(w, "step time ratio", r.time_ratio, GOAL_TIME_RATIO))
        checks.append(GoalCheck(w, "peak-RSS ratio", r.memory_ratio, GOAL_MEMORY_RATIO))
    return checks


def goals_markdown(checks: list[GoalCheck], records: list[Record]) -> str:
    by_key = {(r.workload, r.method): r for r in records}
    lines = [
        f"Goals for `dptrain-bk`: step time <= {GOAL_TIME_RATIO:.2f}x and peak memory "
        f"<= {GOAL_MEMORY_RATIO:.2f}x non-private at B16 and B64, T128, untied and tied. "
        "The memory goal is judged on the plain peak-RSS ratio (the headline); the "
        "increment ratio (peak minus the RSS after model + optimizer creation) is shown "
        "alongside. For reference, Opacus 1.6 was earlier measured at 1.77-2.42x time and "
        "1.18-1.27x memory in ghost mode, 1.43-2.09x and 1.21-1.73x in hooks mode.",
        "",
        "| workload | goal | measured | verdict | increment ratio (info) |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for c in checks:
        r = by_key[(c.workload, "dptrain-bk")]
        info = _fmt(r.increment_ratio, ".2f", "x") if c.metric == "peak-RSS ratio" else ""
        lines.append(
            f"| {c.workload} | {c.metric} <= {c.limit:.2f}x | {_fmt(c.value, '.3f', 'x')} "
            f"| {c.describe()} | {info} |"
        )
    return "\n".join(lines)


def source_fingerprint() -> str:
    """sha256 (12 hex digits) of the dptrain package sources this run measures."""
    import hashlib

    import dptrain

    root = os.path.dirname(os.path.abspath(dptrain.__file__))
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                digest.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    digest.update(f.read())
    return digest.hexdigest()[:12]


def write_markdown(
    path: str,
    records: list[Record],
    *,
    quick: bool,
    timed_steps: int,
    total_s: float,
    checks: list[GoalCheck],
    profiles: list[str],
    provenance: list[str],
) -> None:
    versions = ", ".join(
        f"{p} {importlib.metadata.version(p)}" for p in ("torch", "opacus", "transformers")
    )
    parts = [
        "# Clipping engine benchmark: step time and peak memory vs non-private training",
        "",
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Machine: {machine_description()}; Python {platform.python_version()}; {versions}",
        f"- Command: `{command_line()}`{' (quick mode)' if quick else ''}",
        f"- Total run time: {total_s / 60:.1f} min",
        *provenance,
        "- Threads: `torch.set_num_threads(1)` in every process.",
        "- Model: `GPT(GPTConfig(vocab_size=8000, max_seq_len=512, n_layer=4, n_head=4, "
        "d_model=256, d_mlp=1024, dropout=0.0, tie_embeddings=...))`, AdamW(lr=1e-4); "
        "random token ids (seed 0), targets = ids shifted by one. `-tied` workloads tie "
        "`lm_head.weight` to `wte.weight`.",
        f"- Timing: {WARMUP_STEPS} warm-up steps then {timed_steps} timed steps per method, "
        "methods interleaved round-robin within a workload (starting method rotating each "
        "round); median and interquartile range (IQR) of the timed steps; time ratio = "
        "median / non-private median of the same workload in the same run.",
        f"- Memory: peak RSS (`ru_maxrss`) of a fresh process per (workload, method) that "
        f"builds the model and runs {MEMORY_STEPS} steps; memory ratio = peak / non-private "
        "peak (headline). Each process imports only what its method needs (torch + model; "
        "+ dptrain engine; + Opacus), so import costs are part of the plain peak. Peak "
        "increment = peak minus `ru_maxrss` right after model + optimizer (+ make_private) "
        "creation; increment ratio = increment / non-private increment.",
        "- `dptrain-instantiate` is skipped where its per-example gradients (largest Linear, "
        "lm_head, float32, plus their square) would exceed "
        f"{INSTANTIATE_LIMIT_BYTES / 1e9:.0f} GB; estimates here: "
        + ", ".join(
            f"{w} {instantiate_bytes(WORKLOADS[w][0], WORKLOADS[w][2]) / 1e9:.2f} GB"
            for w in dict.fromkeys(r.workload for r in records)
        )
        + ".",
        "- dptrain: `ClippingEngine(model, 1.0, mode=...)`, `DPOptimizer(AdamW, "
        "noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=B, sample_rate=0.01, "
        "seed=0)`, per-example summed cross-entropy. Opacus 1.6: `make_private(..., "
        "noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False)`, loss reduction "
        "mean; ghost mode steps through the returned criterion with `shape=logits.shape`.",
        "",
        "## Results",
        "",
        markdown_table(records),
        "",
        "## Goals",
        "",
        goals_markdown(checks, records),
    ]
    if profiles:
        parts += ["", "## Where the time goes (torch.profiler)", ""]
        for p in profiles:
            parts += [p, ""]
    with open(path, "w") as f:
        f.write("\n".join(parts).rstrip() + "\n")


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="B16 T128 untied and tied, 5 timed steps, nonprivate + dptrain-bk + dptrain-ghost",
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write the records (a JSON list, one per row) here"
    )
    parser.add_argument("--markdown", metavar="PATH", help="write the report (markdown) here")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 9; quick 5)")
    parser.add_argument(
        "--workloads", metavar="A,B", help=f"only these workloads (of {', '.join(WORKLOADS)})"
    )
    parser.add_argument(
        "--methods",
        metavar="A,B",
        help=f"only these methods (of {', '.join(METHODS)}; nonprivate is always added)",
    )
    parser.add_argument(
        "--no-profile", action="store_true", help="do not profile when a goal is missed"
    )
    parser.add_argument("--profile", metavar="WORKLOAD", help="only profile one step, print it")
    parser.add_argument("--profile-method", default="dptrain-bk", help=argparse.SUPPRESS)
    parser.add_argument(
        "--measure-memory", nargs=2, metavar=("WORKLOAD", "METHOD"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    for msg in bench_workloads.QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=msg)

    if args.measure_memory:
        measure_memory_child(*args.measure_memory)
        return
    if args.profile:
        print(profile_markdown(args.profile, args.profile_method))
        return

    from tqdm import tqdm

    torch.set_num_threads(1)
    workloads = QUICK_WORKLOADS if args.quick else tuple(WORKLOADS)
    methods = QUICK_METHODS if args.quick else METHODS
    if args.workloads:
        workloads = tuple(args.workloads.split(","))
        bad = [w for w in workloads if w not in WORKLOADS]
        if bad:
            parser.error(
                f"--workloads {','.join(bad)} not allowed: expected some of {list(WORKLOADS)}"
            )
    if args.methods:
        methods = tuple(dict.fromkeys(("nonprivate", *args.methods.split(","))))
        bad = [m for m in methods if m not in METHODS]
        if bad:
            parser.error(f"--methods {','.join(bad)} not allowed: expected some of {list(METHODS)}")
    timed_steps = args.steps or (5 if args.quick else 9)
    if timed_steps < 1:
        parser.error(f"--steps={timed_steps} is not allowed: expected an integer >= 1")
    print(
        f"torch.set_num_threads(1); {len(workloads)} workloads x {len(methods)} methods, "
        f"{WARMUP_STEPS} warm-up + {timed_steps} timed steps each",
        file=sys.stderr,
    )
    fingerprint, git_at_start, load_at_start = (
        source_fingerprint(),
        git_description(),
        os.getloadavg(),
    )
    start = time.perf_counter()
    all_records: list[Record] = []
    total_steps = len(workloads) * len(methods) * (WARMUP_STEPS + timed_steps)
    with tqdm(total=total_steps, desc="timing", unit="step", file=sys.stderr) as bar:
        per_workload = [time_workload(w, methods, timed_steps, bar) for w in workloads]
    with tqdm(
        total=len(workloads) * len(methods), desc="memory", unit="proc", file=sys.stderr
    ) as bar:
        for records in per_workload:
            add_memory(records, bar)
            all_records.extend(records.values())

    checks = check_goals(all_records)
    profiles: list[str] = []
    missed = [c for c in checks if c.met is False]
    if missed and not args.quick and not args.no_profile:
        targets = [PROFILE_WORKLOAD]
        if any("tied" in c.workload for c in missed):
            targets.append(PROFILE_WORKLOAD + "-tied")
        for w in tqdm(targets, desc="profile", file=sys.stderr):
            profiles.append(run_profile_subprocess(w, "dptrain-bk"))
        profiles.append(run_profile_subprocess(PROFILE_WORKLOAD, "nonprivate"))
    total_s = time.perf_counter() - start
    load_at_end = os.getloadavg()
    provenance = [
        f"- dptrain sources: {git_at_start} at the start, sha256 {fingerprint} of "
        "src/dptrain/**/*.py; "
        + (
            "unchanged at the end of the run."
            if source_fingerprint() == fingerprint
            else "**WARNING: the sources changed during the run** (now "
            f"{git_description()}); timing and memory may come from different versions."
        ),
        f"- 1-minute load average: {load_at_start[0]:.2f} at the start, "
        f"{load_at_end[0]:.2f} at the end (the benchmark itself keeps about one core busy).",
    ]
    for line in provenance:
        print(line.removeprefix("- "), file=sys.stderr)

    table = markdown_table(all_records)
    print(table)
    print()
    print(goals_markdown(checks, all_records))
    for p in profiles:
        print()
        print(p)
    print()
    print(f"total run time: {total_s:.0f} s ({total_s / 60:.1f} min)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in all_records], f, indent=1)
            f.write("\n")
    if args.markdown:
        write_markdown(
            args.markdown,
            all_records,
            quick=args.quick,
            timed_steps=timed_steps,
            total_s=total_s,
            checks=checks,
            profiles=profiles,
            provenance=provenance,
        )


if __name__ == "__main__":
    main()
