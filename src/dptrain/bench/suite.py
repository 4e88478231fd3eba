"""The ``dptrain bench`` suite: time, memory, largest batch, accountants; one run, one machine.

:func:`run_bench` runs the parts in this order, each optional:

1. **timing**: per workload, every method's step is built in this process and
   timed round-robin (:mod:`dptrain.bench.timing`);
2. **memory**: peak memory of every (workload, method) in a fresh process
   (:mod:`dptrain.bench.memory`);
3. **max-batch**: the largest batch under a memory cap for a few workloads
   and methods, every probe a fresh process;
4. **accountants**: epsilon and calibration of dptrain, dp_accounting and
   Opacus on a fixed grid (:mod:`dptrain.bench.accountants`).

:func:`add_bench_arguments` and :func:`run_bench_command` are the CLI
(``dptrain bench``); the results go to ``--out`` as ``bench.json``,
``bench.md`` and ``bench_ratios.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from dptrain.bench import accountants as acc
from dptrain.bench.memory import max_batch_under_cap, measure_peaks
from dptrain.bench.report import (
    MaxBatchRecord,
    StepRecord,
    accountant_tables,
    goals_table,
    max_batch_table,
    step_table,
    write_json,
    write_ratio_chart,
)
from dptrain.bench.timing import fix_threads, time_round_robin
from dptrain.bench.workloads import (
    AMP_MODES,
    DEFAULT_METHODS,
    GPU_WORKLOADS,
    METHODS,
    WORKLOADS,
    build_step,
    check_amp,
    check_methods,
    check_workloads,
    effective_amp,
    first_line,
)

__all__ = [
    "DEFAULT_WORKLOADS",
    "GPU_PARTS",
    "OPT_IN_WORKLOADS",
    "PARTS",
    "QUICK_WORKLOADS",
    "BenchOptions",
    "BenchResult",
    "add_bench_arguments",
    "machine_description",
    "options_from_args",
    "precision_description",
    "run_bench",
    "run_bench_command",
    "write_outputs",
]

#: The parts of the suite, in run order.
PARTS = ("timing", "memory", "max-batch", "accountants")
#: ``--quick``: one small tied workload, which also shows Opacus ghost's refusal.
QUICK_WORKLOADS = ("dpformer-B128-T50-tied",)
#: Run only when named with ``--workloads`` (or ``--gpu``): the real SmolLM2 model takes
#: about 30 min for all methods and about 20 GB of memory in the timing process
#: (docs/engine_benchmark.md); the Llama workloads are real-size GPU ones and their
#: test-size twins.
OPT_IN_WORKLOADS = (
    "smollm2-full",
    "smollm2-lora",
    *(n for n, w in WORKLOADS.items() if w.model == "llama"),
)
#: What ``--gpu`` runs: step time (3 warm-up + 10 timed steps, the issue-27 protocol) and
#: peak memory in a fresh process, for :data:`GPU_WORKLOADS`.
GPU_PARTS = ("timing", "memory")
#: What a plain ``dptrain bench`` runs.
DEFAULT_WORKLOADS = tuple(n for n in WORKLOADS if n not in OPT_IN_WORKLOADS)
MAX_BATCH_WORKLOADS = ("gpt-B16-T128", "dpformer-B128-T50-tied")
MAX_BATCH_METHODS = ("nonprivate", "dptrain-bk", "opacus-hooks", "opacus-ghost")
CPU_CAP_MB = 2048.0
CUDA_CAP_MB = 4096.0


@dataclass
class BenchOptions:
    """Everything a run of the suite depends on (the CLI's flags; defaults are the full suite).

    Attributes:
        quick: the smoke-check settings were asked for (recorded in the report).
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``).
        amp: ``"off"`` (float32) or ``"bf16"`` (forward pass and loss under bfloat16
            autocast, float32 weights), for every method and part.
        threads: ``torch.set_num_threads`` in every process.
        warmup: untimed steps per method before the timed ones.
        steps: timed steps per method.
        workloads / methods: what is timed and measured (``nonprivate`` always included).
        parts: which of :data:`PARTS` run.
        memory_steps: steps each memory process runs.
        jobs: memory processes at a time (1 on CUDA).
        max_batch_workloads / max_batch_methods / cap_mb / max_batch_rtol /
            max_batch_limit: the largest-batch search.
        accountant_grid / calibrate / accountant_repeats: the accountant bench.
        out: folder for bench.json, bench.md and bench_ratios.png (None: no files).
        timeout_s: the limit for any one measuring process.
    """

    quick: bool = False
    device: str = "cpu"
    amp: str = "off"
    threads: int = 1
    warmup: int = 2
    steps: int = 9
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    methods: tuple[str, ...] = DEFAULT_METHODS
    parts: tuple[str, ...] = PARTS
    memory_steps: int = 3
    jobs: int = 1
    max_batch_workloads: tuple[str, ...] = MAX_BATCH_WORKLOADS
    max_batch_methods: tuple[str, ...] = MAX_BATCH_METHODS
    cap_mb: float | None = None
    max_batch_rtol: float = 0.05
    max_batch_limit: int = 8192
    accountant_grid: tuple[acc.AccountantPoint, ...] = acc.GRID
    calibrate: bool = True
    accountant_repeats: int = 3
    out: str | None = "runs/bench"
    timeout_s: float = 1800.0

    @classmethod
    def gpu_defaults(cls, **changes: Any) -> BenchOptions:
        """The ``--gpu`` settings: the real-size Llama workloads on ``cuda``, 3 warm-up +
        10 timed steps, peak memory per method in a fresh process, no batch search and no
        accountants (those do not depend on the device)."""
        base = cls(
            device="cuda",
            warmup=3,
            steps=10,
            workloads=GPU_WORKLOADS,
            parts=GPU_PARTS,
            out="runs/bench-gpu",
        )
        return replace(base, **changes)

    @classmethod
    def quick_defaults(cls, **changes: Any) -> BenchOptions:
        """The ``--quick`` settings: one small workload, 1 warm-up + 3 timed steps, one fresh
        process per method (two at a time), no batch search, epsilon at one grid point."""
        base = cls(
            quick=True,
            warmup=1,
            steps=3,
            workloads=QUICK_WORKLOADS,
            parts=("timing", "memory", "accountants"),
            memory_steps=2,
            jobs=2,
            accountant_grid=acc.QUICK_GRID,
            calibrate=False,
            accountant_repeats=1,
            out="runs/bench-quick",
        )
        return replace(base, **changes)

    def checked(self) -> BenchOptions:
        """These options after checking every field; raises ValueError naming a bad one."""

        def positive_int(name: str, value: object, low: int = 1) -> None:
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} is not allowed: expected an integer >= {low}")

        positive_int("threads", self.threads)
        positive_int("warmup", self.warmup, 0)
        positive_int("steps", self.steps)
        positive_int("memory_steps", self.memory_steps)
        positive_int("jobs", self.jobs)
        positive_int("max_batch_limit", self.max_batch_limit)
        positive_int("accountant_repeats", self.accountant_repeats)
        bad = [p for p in self.parts if p not in PARTS]
        if bad:
            raise ValueError(
                f"parts={','.join(bad)} is not allowed: expected some of {', '.join(PARTS)}"
            )
        check_workloads(self.workloads)
        check_workloads(self.max_batch_workloads)
        check_methods(self.methods)
        check_methods(self.max_batch_methods)
        if self.cap_mb is not None and not self.cap_mb > 0:
            raise ValueError(f"cap_mb={self.cap_mb!r} is not allowed: expected a number > 0")
        if not 0 <= self.max_batch_rtol < 1:
            raise ValueError(
                f"max_batch_rtol={self.max_batch_rtol!r} is not allowed: expected [0, 1)"
            )
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s={self.timeout_s!r} is not allowed: expected > 0")
        check_amp(self.amp)
        device = check_device(self.device)
        measured = [
            *(self.workloads if {"timing", "memory"} & set(self.parts) else ()),
            *(self.max_batch_workloads if "max-batch" in self.parts else ()),
        ]
        gpu_only = [n for n in measured if WORKLOADS[n].gpu]
        if gpu_only and not device.startswith("cuda"):
            raise ValueError(
                f"workloads={','.join(dict.fromkeys(gpu_only))} is not allowed on "
                f"device={device!r}: these real-size workloads need a CUDA device "
                "(--device cuda or --gpu); their llamatiny-* twins run on a CPU"
            )
        jobs = 1 if device.startswith("cuda") else self.jobs
        return replace(
            self,
            device=device,
            jobs=jobs,
            methods=check_methods(self.methods),
            max_batch_methods=check_methods(self.max_batch_methods),
        )


def check_device(device: str) -> str:
    """``cpu`` or an available ``cuda[:N]``; otherwise ValueError saying what is available."""
    if device == "cpu":
        return device
    if not isinstance(device, str) or not (device == "cuda" or device.startswith("cuda:")):
        raise ValueError(f"device={device!r} is not allowed: expected cpu or cuda (cuda:N)")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device={device!r} is not available here: torch.cuda.is_available() is False "
            f"(no GPU, or a CPU-only torch {torch.__version__}); expected device=cpu"
        )
    index = int(device.split(":")[1]) if ":" in device else 0
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"device={device!r} is not available here: expected an index below "
            f"{torch.cuda.device_count()}"
        )
    return device


@dataclass
class BenchResult:
    """Everything one run measured, and when and where."""

    options: BenchOptions
    steps: list[StepRecord] = field(default_factory=list)
    max_batch: list[MaxBatchRecord] = field(default_factory=list)
    accountants: list[acc.AccountantRecord] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def records(self) -> list[Any]:
        """All records, steps first."""
        return [*self.steps, *self.max_batch, *self.accountants]


# -- provenance -----------------------------------------------------------------------------------


def machine_description(device: str = "cpu") -> str:
    """Core count and CPU model (lscpu), and the GPU when the device is CUDA."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    text = f"{os.cpu_count()}-core CPU ({model})"
    if device.startswith("cuda"):
        text += f", {torch.cuda.get_device_name(torch.device(device))}"
    return text


def _versions() -> str:
    out = []
    for pkg in ("torch", "opacus", "transformers", "dp-accounting"):
        try:
            out.append(f"{pkg} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            out.append(f"{pkg} not installed")
    return ", ".join(out)


def _git_commit() -> str | None:
    with contextlib.suppress(OSError):
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
        )
        return proc.stdout.strip() or None
    return None


# -- the parts ------------------------------------------------------------------------------------


def _progress(total: int, desc: str) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, disable=None, leave=False)


def _time_workload(name: str, o: BenchOptions, log: Callable[[str], None]) -> list[StepRecord]:
    (w,) = check_workloads([name])
    records = {
        m: StepRecord(
            name,
            m,
            batch_size=w.batch_size,
            seq_len=w.seq_len,
            device=o.device,
            threads=o.threads,
            amp=effective_amp(w, o.amp),
        )
        for m in o.methods
    }
    steps = {}
    for m in o.methods:
        try:
            built = build_step(w, m, device=o.device, amp=o.amp)
        except Exception as exc:  # a refusal or a deliberate skip
            records[m].error = first_line(exc)
            continue
        steps[m] = built.step
        records[m].note = built.note
    sync = torch.cuda.synchronize if o.device.startswith("cuda") else None
    with _progress(len(steps) * (o.warmup + o.steps), f"timing {name}") as bar:
        result = time_round_robin(
            steps, warmup=o.warmup, timed=o.steps, synchronize=sync, on_step=lambda _m: bar.update()
        )
    for m, err in result.errors.items():
        records[m].error = err
    for m in steps:
        s = result.summary(m)
        if s is not None:
            r = records[m]
            r.step_time_s, r.step_time_q1_s, r.step_time_q3_s, r.timed_steps = (
                s.median_s,
                s.q1_s,
                s.q3_s,
                s.steps,
            )
    base = records["nonprivate"].step_time_s
    for r in records.values():
        if r.step_time_s is not None and base:
            r.time_ratio = r.step_time_s / base
    steps.clear()
    del result
    gc.collect()
    if o.device.startswith("cuda"):
        torch.cuda.empty_cache()
    log(
        f"timed {name}: "
        + ", ".join(
            f"{r.method} {r.step_time_s:.3f}s" if r.step_time_s else f"{r.method} -"
            for r in records.values()
        )
    )
    return list(records.values())


def _add_memory(records: list[StepRecord], o: BenchOptions) -> None:
    configs = [(r.workload, r.method) for r in records]
    with _progress(len(configs), "memory") as bar:
        peaks = measure_peaks(
            configs,
            jobs=o.jobs,
            on_done=lambda _c: bar.update(),
            device=o.device,
            amp=o.amp,
            threads=o.threads,
            steps=o.memory_steps,
            timeout=o.timeout_s,
        )
    by = {(r.workload, r.method): r for r in records}
    for key, res in peaks.items():
        r = by[key]
        if "peak_mb" in res:
            r.peak_mb, r.baseline_mb = res["peak_mb"], res["baseline_mb"]
            r.peak_increment_mb = r.peak_mb - r.baseline_mb
            r.note = r.note or res.get("note")
        elif r.error is None:
            r.error = res.get("error", "memory measurement failed")
    for r in records:
        base = by.get((r.workload, "nonprivate"))
        if base is None or base.peak_mb is None or r.peak_mb is None:
            continue
        r.memory_ratio = r.peak_mb / base.peak_mb
        if base.peak_increment_mb and base.peak_increment_mb > 0:
            r.increment_ratio = r.peak_increment_mb / base.peak_increment_mb


def _max_batch(o: BenchOptions, log: Callable[[str], None]) -> list[MaxBatchRecord]:
    cap = o.cap_mb or (CUDA_CAP_MB if o.device.startswith("cuda") else CPU_CAP_MB)
    out = []
    for w in o.max_batch_workloads:
        rows = []
        for m in o.max_batch_methods:
            res = max_batch_under_cap(
                w,
                m,
                cap,
                device=o.device,
                amp=o.amp,
                threads=o.threads,
                rtol=o.max_batch_rtol,
                limit=o.max_batch_limit,
                timeout=o.timeout_s,
                on_probe=lambda b, ok, w=w, m=m: log(
                    f"max-batch {w} {m}: B={b} {'fits' if ok else 'does not fit'}"
                ),
            )
            rows.append(
                MaxBatchRecord(
                    w,
                    m,
                    cap,
                    max_batch_size=res.batch_size,
                    first_failing=res.first_failing,
                    limit_reached=res.limit_reached,
                    probes=[list(p) for p in res.probes],
                    error=res.error,
                    device=o.device,
                    amp=o.amp,
                )
            )
        base = next((r for r in rows if r.method == "nonprivate"), None)
        for r in rows:
            if base is not None and base.max_batch_size and r.max_batch_size is not None:
                r.ratio_to_nonprivate = r.max_batch_size / base.max_batch_size
        out += rows
    return out


def run_bench(options: BenchOptions, log: Callable[[str], None] | None = None) -> BenchResult:
    """Run the parts of the suite ``options`` asks for; ``log`` gets one line per event."""
    o = options.checked()
    threads_before = torch.get_num_threads()
    fix_threads(o.threads)
    try:
        return _run(o, log or (lambda line: print(line, file=sys.stderr, flush=True)))
    finally:
        torch.set_num_threads(threads_before)


def _run(o: BenchOptions, say: Callable[[str], None]) -> BenchResult:
    result = BenchResult(o)
    start = time.perf_counter()
    load_start = os.getloadavg()
    if "timing" in o.parts or "memory" in o.parts:
        for name in o.workloads:
            if "timing" in o.parts:
                result.steps += _time_workload(name, o, say)
            else:
                (w,) = check_workloads([name])
                result.steps += [
                    StepRecord(
                        name,
                        m,
                        batch_size=w.batch_size,
                        seq_len=w.seq_len,
                        device=o.device,
                        threads=o.threads,
                        amp=effective_amp(w, o.amp),
                    )
                    for m in o.methods
                ]
        if "memory" in o.parts:
            say(f"memory: {len(result.steps)} fresh processes, {o.jobs} at a time")
            _add_memory(result.steps, o)
    if "max-batch" in o.parts:
        result.max_batch = _max_batch(o, say)
    if "accountants" in o.parts:
        say("accountants")
        result.accountants = acc.accountant_bench(
            o.accountant_grid, calibrate=o.calibrate, repeats=o.accountant_repeats
        )
    total = time.perf_counter() - start
    result.meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_description(o.device),
        "python": platform.python_version(),
        "versions": _versions(),
        "commit": _git_commit(),
        "command": shlex.join(["dptrain", *sys.argv[1:]]) if sys.argv else "dptrain bench",
        "quick": o.quick,
        "device": o.device,
        "amp": o.amp,
        "threads": o.threads,
        "warmup": o.warmup,
        "timed_steps": o.steps,
        "memory_steps": o.memory_steps,
        "total_s": total,
        "load_average_start": load_start[0],
        "load_average_end": os.getloadavg()[0],
    }
    return result


# -- output ---------------------------------------------------------------------------------------


def precision_description(amp: str) -> str:
    """How a run's steps compute, for the report: float32, or what bf16 autocast covers."""
    if check_amp(amp) == "off":
        return "float32 (`--amp off`)"
    return (
        "bf16 mixed precision (`--amp bf16`): forward pass and loss under "
        "`torch.autocast(dtype=torch.bfloat16)`, backward outside it; float32 weights, "
        "gradients and optimizer"
    )


def markdown_report(result: BenchResult) -> str:
    """The whole run as markdown: provenance, then one section per part that ran."""
    m, o = result.meta, result.options
    memory_how = (
        "`torch.cuda.max_memory_allocated()`"
        if o.device.startswith("cuda")
        else "peak RSS (`ru_maxrss`)"
    )
    lines = [
        "# dptrain bench" + (" (--quick)" if o.quick else ""),
        "",
        f"- Date: {m['date']}; total run time {m['total_s'] / 60:.1f} min",
        f"- Machine: {m['machine']}; Python {m['python']}; {m['versions']}",
        f"- Command: `{m['command']}`" + (f" (commit {m['commit']})" if m["commit"] else ""),
        f"- Device: {o.device}; `torch.set_num_threads({o.threads})` in every process; "
        f"1-minute load average {m['load_average_start']:.2f} at the start, "
        f"{m['load_average_end']:.2f} at the end",
        f"- Precision: {precision_description(o.amp)}",
    ]
    if "timing" in o.parts:
        lines.append(
            f"- Timing: {o.warmup} warm-up + {o.steps} timed steps per method, round-robin; "
            "median, IQR; time ratio = median / non-private median of the same run"
        )
    if "memory" in o.parts:
        lines.append(
            f"- Memory: {memory_how} of a fresh process per (workload, method) running "
            f"{o.memory_steps} steps; memory ratio = peak / non-private peak; increment = "
            "peak minus the baseline once model, optimizer and batch exist"
        )
    skipped = [p for p in PARTS if p not in o.parts]
    if skipped:
        lines.append(f"- Not run: {', '.join(skipped)}")
    if result.steps:
        named = dict.fromkeys(r.workload for r in result.steps)
        lines += ["", "## Workloads", ""]
        lines += [f"- `{n}`: {WORKLOADS[n].describe()}" for n in named]
        if any(WORKLOADS[n].precision for n in named):
            lines.append(
                "- A `-autocast` workload runs under bf16 autocast and a `-bf16` one with "
                "bf16 weights and no autocast, whatever `--amp` says"
            )
        lines += ["", "## Step time and peak memory", "", step_table(result.steps)]
        goals = goals_table(result.steps)
        if goals:
            lines += ["", "## Goals (dptrain book-keeping)", "", goals]
        lines += ["", "![time and memory ratios](bench_ratios.png)"]
    if result.max_batch:
        cap = result.max_batch[0].cap_mb
        how = (
            "`torch.cuda.set_per_process_memory_fraction` and `max_memory_allocated() <= cap`"
            if o.device.startswith("cuda")
            else "address space limited (RLIMIT_AS) to the cap beyond the resident size after "
            "the imports and a batch-1 warm-up step, and peak RSS <= cap"
        )
        lines += [
            "",
            f"## Largest batch under a {cap:.0f} MB cap",
            "",
            f"Doubling from the workload's batch size, then bisection to within "
            f"{o.max_batch_rtol:.0%}; each probe is a fresh process running "
            f"2 steps; a batch fits when the steps complete with the {how}.",
            "",
            max_batch_table(result.max_batch),
        ]
    if result.accountants:
        lines += ["", "## Accountants", "", accountant_tables(result.accountants)]
    return "\n".join(lines) + "\n"


def write_outputs(result: BenchResult, out: str) -> list[str]:
    """bench.json, bench.md and (with step records) bench_ratios.png in ``out``; their paths."""
    os.makedirs(out, exist_ok=True)
    paths = [os.path.join(out, "bench.json"), os.path.join(out, "bench.md")]
    write_json(paths[0], result.records(), **result.meta)
    with open(paths[1], "w") as f:
        f.write(markdown_report(result))
    if result.steps:
        paths.append(os.path.join(out, "bench_ratios.png"))
        o = result.options
        precision = ", bf16 autocast" if o.amp == "bf16" else ""
        title = f"{result.meta['machine']}, {o.device}{precision}, {result.meta['date']}"
        write_ratio_chart(paths[2], result.steps, title=title)
    return paths


# -- the CLI --------------------------------------------------------------------------------------


def _names(text: str) -> tuple[str, ...]:
    return tuple(n.strip() for n in text.split(",") if n.strip())


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``dptrain bench``."""
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke check (< 2 min on 2 cores): {', '.join(QUICK_WORKLOADS)}, 1 warm-up + 3 "
        "timed steps, one memory process per method, epsilon at one grid point, no batch search",
    )
    p.add_argument(
        "--gpu",
        action="store_true",
        help=f"the real-size runs on CUDA: {', '.join(GPU_WORKLOADS)}; 3 warm-up + 10 timed "
        "steps, peak memory per method in a fresh process (an error without a CUDA device)",
    )
    p.add_argument("--device", help="cpu (default; cuda with --gpu) or cuda[:N]")
    p.add_argument(
        "--amp",
        choices=AMP_MODES,
        default="off",
        help="precision of every method's forward pass and loss: off (default, float32) or "
        "bf16 (torch.autocast to bfloat16, float32 weights; on CPU or CUDA)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--warmup", type=int, help="warm-up steps per method (default 2; quick 1)")
    p.add_argument("--steps", type=int, help="timed steps per method (default 9; quick 3)")
    p.add_argument(
        "--workloads",
        type=_names,
        help=f"comma-separated, of: {', '.join(WORKLOADS)} (default: all but the opt-in "
        f"{', '.join(OPT_IN_WORKLOADS)})",
    )
    p.add_argument(
        "--methods",
        type=_names,
        help=f"comma-separated, of: {', '.join(METHODS)} (nonprivate is always added)",
    )
    p.add_argument(
        "--skip", type=_names, default=(), help=f"parts not to run, of: {', '.join(PARTS)}"
    )
    p.add_argument(
        "--max-batch", action="store_true", help="run the largest-batch search in --quick too"
    )
    p.add_argument("--memory-steps", type=int, help="steps per memory process (default 3)")
    p.add_argument("--jobs", type=int, help="memory processes at a time (default 1; quick 2)")
    p.add_argument(
        "--cap-mb",
        type=float,
        help=f"memory cap of the batch search (default {CPU_CAP_MB:.0f} on CPU, "
        f"{CUDA_CAP_MB:.0f} on CUDA)",
    )
    p.add_argument(
        "--max-batch-workloads",
        type=_names,
        help=f"default {','.join(MAX_BATCH_WORKLOADS)}",
    )
    p.add_argument(
        "--max-batch-methods", type=_names, help=f"default {','.join(MAX_BATCH_METHODS)}"
    )
    p.add_argument(
        "--out", help="folder for bench.json, bench.md, bench_ratios.png (default runs/bench)"
    )
    p.add_argument(
        "--json", action="store_true", help="print JSON lines (one per record) instead of tables"
    )


def options_from_args(args: argparse.Namespace) -> BenchOptions:
    """:class:`BenchOptions` from ``dptrain bench`` flags (quick defaults under ``--quick``)."""
    if args.quick and args.gpu:
        raise ValueError("--quick and --gpu are not allowed together: choose one")
    if args.quick:
        o = BenchOptions.quick_defaults()
    elif args.gpu:
        o = BenchOptions.gpu_defaults()
    else:
        o = BenchOptions()
    changes: dict[str, Any] = {"amp": args.amp, "threads": args.threads}
    if args.device is not None:
        changes["device"] = args.device
    for flag, attr in (
        ("warmup", "warmup"),
        ("steps", "steps"),
        ("workloads", "workloads"),
        ("methods", "methods"),
        ("memory_steps", "memory_steps"),
        ("jobs", "jobs"),
        ("cap_mb", "cap_mb"),
        ("max_batch_workloads", "max_batch_workloads"),
        ("max_batch_methods", "max_batch_methods"),
        ("out", "out"),
    ):
        value = getattr(args, flag)
        if value is not None:
            changes[attr] = value
    bad = [s for s in args.skip if s not in PARTS]
    if bad:
        raise ValueError(
            f"--skip={','.join(bad)} is not allowed: expected some of {', '.join(PARTS)}"
        )
    parts = [p for p in PARTS if p in o.parts or (p == "max-batch" and args.max_batch)]
    changes["parts"] = tuple(p for p in parts if p not in args.skip)
    return replace(o, **changes).checked()


def run_bench_command(args: argparse.Namespace) -> int:
    """``dptrain bench``: run, write the files, print the report (or JSON lines)."""
    options = options_from_args(args)
    result = run_bench(options)
    paths = write_outputs(result, options.out) if options.out else []
    if args.json:
        for rec in result.records():
            print(json.dumps(rec.to_dict()))
    else:
        print(markdown_report(result))
    if paths:
        print(f"written: {', '.join(paths)}", file=sys.stderr)
    return 0
