"""Phantom clipping vs untying the embedding (DPFormer Figure 3) on SeqRecTransformer (not a test).

    .venv/bin/python benchmarks/bench_phantom.py [--quick] [--json PATH] [--markdown PATH]
        [--plot PATH] [--cap-mb MB] [--workloads A,B] [--methods A,B] [--steps N]

Model: ``SeqRecTransformer(SeqRecConfig(n_items, max_len=50, d_model=64, n_head=1,
n_layer=2, dropout=0.0, tie_embeddings=...))`` (d_mlp = 4 d), AdamW(lr=1e-3), on
random item ids in 1..n_items (fixed seed, no padding; targets random too: the
cost of a step does not depend on the ids). Catalogues: ``ml100k``, n_items of
MovieLens-100k as loaded by :func:`dptrain.data.load_movielens_100k` (1,349),
and ``synth20k``, a synthetic catalogue of 20,000 items (the paper's Amazon data
has a much larger catalogue than MovieLens). Workloads (batch B, sequence
length L = 50): ml100k-B128 and synth20k-B128 by default; synth20k-B512 on
request (``--workloads``: several GB and tens of seconds a step on one core).

Methods (one full training step each):

- ``nonprivate-tied``: the tied model, mean of the per-example cross-entropies
  (``ignore_index=0``), ``loss.backward()``, ``AdamW.step()`` (the reference);
- ``phantom``: the tied model with ``ClippingEngine(model, 1.0, clipping="automatic",
  mode="book_keeping")`` (phantom clipping of the shared embedding) and
  ``DPOptimizer(AdamW, noise_multiplier=1.0)``;
- ``untied``: the same engine and optimizer on the model with a separate
  scoring matrix (``tie_embeddings=False``): one more n_items x d matrix;
- ``untied-half-d``: untied with d_model=32 (the paper's "fair" comparison, about
  the parameter count of the tied d=64 model);
- ``phantom-ghost``: phantom with ``mode="ghost"`` (a second backward pass).

Timing: ``torch.set_num_threads(1)``; within a workload every method gets 2
warm-up steps and then the timed steps (default 9), interleaved round-robin (one
step of each method per round, the starting method rotating every round) so
that drift hits all methods alike. Reported: the median step time, and
time_ratio = median / the nonprivate-tied median of the same workload.
throughput_seq_s = B / median step time at the workload's batch B.

Memory: each (workload, method) runs in a fresh process (hidden flag
``--child-memory``) that builds the model, optimizer and batch, records
``ru_maxrss`` (baseline: imports, model, optimizer, batch), runs 3 steps and
reports ``ru_maxrss`` again. memory_ratio = peak / nonprivate-tied peak;
increment_ratio = (peak - baseline) / the same for nonprivate-tied.

Largest batch under a memory cap (``--cap-mb``, default 1500 MB of peak RSS):
per (catalogue, method), a doubling-then-binary search over the batch size,
every probe a fresh process (hidden flag ``--child-probe``) that runs 2 steps at
batch B on a random batch (B may exceed the 943 MovieLens users) and reports its
peak RSS; B fits iff the peak <= the cap (a probe stops after its first step
when that is already over the cap). The binary search stops when the gap
between the largest fitting and the smallest failing batch is at most
``--batch-tol`` (default 5%) of the former. Reported: max_batch, the peak of
that probe, the smallest failing batch, and max_batch_throughput_seq_s =
max_batch / the probe's second-step time (one step in a fresh process: rougher
than the interleaved medians).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from _harness import command_line, git_description, machine_description, maxrss_mb, run_fresh

LR = 1e-3
SEED = 0
SEQ_LEN = 50
D_MODEL = 64
WARMUP_STEPS = 2
MEMORY_STEPS = 3
PROBE_STEPS = 2
DEFAULT_CAP_MB = 1500.0
ML100K_N_ITEMS = 1349  # what load_movielens_100k() gives; checked at run time

#: catalogue -> n_items (ml100k is read from the data at run time)
CATALOGUES: dict[str, int] = {"ml100k": ML100K_N_ITEMS, "synth20k": 20000}

#: workload -> (catalogue, batch size)
WORKLOADS: dict[str, tuple[str, int]] = {
    "ml100k-B128": ("ml100k", 128),
    "synth20k-B128": ("synth20k", 128),
    "synth20k-B512": ("synth20k", 512),  # est. ~20 s a step, ~8 GB on one core: off by default
}
DEFAULT_WORKLOADS = ("ml100k-B128", "synth20k-B128")
QUICK_WORKLOADS = ("ml100k-B128",)

#: method -> (tied embeddings, d_model, engine mode or None for non-private)
METHODS: dict[str, tuple[bool, int, str | None]] = {
    "nonprivate-tied": (True, D_MODEL, None),
    "phantom": (True, D_MODEL, "book_keeping"),
    "untied": (False, D_MODEL, "book_keeping"),
    "untied-half-d": (False, D_MODEL // 2, "book_keeping"),
    "phantom-ghost": (True, D_MODEL, "ghost"),
}
REFERENCE = "nonprivate-tied"
QUICK_METHODS = ("nonprivate-tied", "phantom", "untied", "untied-half-d")


@dataclass
class Record:
    workload: str
    method: str
    n_items: int
    batch_size: int
    d_model: int
    tied: bool
    n_params: int | None = None
    step_time_s: float | None = None
    step_time_q1_s: float | None = None
    step_time_q3_s: float | None = None
    timed_steps: int = 0
    time_ratio: float | None = None
    throughput_seq_s: float | None = None
    peak_mb: float | None = None
    baseline_mb: float | None = None
    peak_increment_mb: float | None = None
    memory_ratio: float | None = None
    increment_ratio: float | None = None
    cap_mb: float | None = None
    max_batch: int | None = None
    max_batch_peak_mb: float | None = None
    first_failing_batch: int | None = None
    max_batch_throughput_seq_s: float | None = None
    max_batch_ratio: float | None = None
    error: str | None = None


# -- one method's training step ------------------------------------------------------------------


def make_batch(n_items: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(1, n_items + 1, (batch_size, SEQ_LEN + 1), generator=gen)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def make_model(n_items: int, method: str) -> torch.nn.Module:
    from dptrain.models.seqrec_transformer import SeqRecConfig, SeqRecTransformer

    tied, d_model, _ = METHODS[method]
    torch.manual_seed(SEED)
    config = SeqRecConfig(
        n_items=n_items,
        max_len=SEQ_LEN,
        d_model=d_model,
        n_head=1,
        n_layer=2,
        dropout=0.0,
        tie_embeddings=tied,
    )
    return SeqRecTransformer(config).train()


def n_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied Parameter counts once


def build_step(n_items: int, batch_size: int, method: str) -> tuple[Callable[[], None], int]:
    """Model, optimizer and batch for one method; returns (one-step closure, parameter count)."""
    from dptrain.losses import per_example_cross_entropy

    _, _, mode = METHODS[method]
    x, y = make_batch(n_items, batch_size)
    model = make_model(n_items, method)
    n_params = n_parameters(model)

    if mode is None:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)

        def step() -> None:
            opt.zero_grad()
            losses = per_example_cross_entropy(model(x), y, ignore_index=0)
            losses.mean().backward()
            opt.step()

        return step, n_params

    from dptrain.clipping import ClippingEngine
    from dptrain.optim import DPOptimizer

    engine = ClippingEngine(model, 1.0, clipping="automatic", mode=mode)
    dpopt = DPOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=batch_size,
        sample_rate=0.01,
        seed=SEED,
    )

    def dp_step() -> None:
        dpopt.zero_grad()
        losses = per_example_cross_entropy(model(x), y, ignore_index=0)
        engine.backward(losses)
        dpopt.step()

    return dp_step, n_params


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- timing ---------------------------------------------------------------------------------------


def time_workload(
    workload: str, n_items: int, batch_size: int, methods: tuple[str, ...], timed_steps: int
) -> dict[str, Record]:
    """Round-robin timing of all methods on one workload; failing methods get an error."""
    records = {
        m: Record(workload, m, n_items, batch_size, METHODS[m][1], METHODS[m][0]) for m in methods
    }
    steps: dict[str, Callable[[], None]] = {}
    for m in methods:
        try:
            steps[m], records[m].n_params = build_step(n_items, batch_size, m)
        except Exception as exc:
            records[m].error = first_line(exc)
    times: dict[str, list[float]] = {m: [] for m in steps}
    rounds = WARMUP_STEPS + timed_steps
    for r in range(rounds):
        alive = [m for m in methods if m in steps]
        k = r % len(alive) if alive else 0
        parts = []
        for m in alive[k:] + alive[:k]:
            start = time.perf_counter()
            try:
                steps[m]()
            except Exception as exc:
                records[m].error = first_line(exc)
                del steps[m]
                parts.append(f"{m} failed")
                continue
            elapsed = time.perf_counter() - start
            if r >= WARMUP_STEPS:
                times[m].append(elapsed)
            parts.append(f"{m} {elapsed:.3f}s")
        kind = "warm-up" if r < WARMUP_STEPS else "timed"
        log(f"  [{workload}] round {r + 1}/{rounds} ({kind}): " + ", ".join(parts))
    for m, ts in times.items():
        if m in steps and ts:
            rec = records[m]
            rec.step_time_s = statistics.median(ts)
            if len(ts) >= 2:
                q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive")
                rec.step_time_q1_s, rec.step_time_q3_s = q1, q3
            rec.timed_steps = len(ts)
            rec.throughput_seq_s = batch_size / rec.step_time_s
    base = records.get(REFERENCE)
    for rec in records.values():
        if rec.step_time_s is not None and base is not None and base.step_time_s:
            rec.time_ratio = rec.step_time_s / base.step_time_s
    steps.clear()
    return records


# -- fresh processes: peak memory and batch-size probes ------------------------------------------


def child_memory(n_items: int, batch_size: int, method: str) -> None:
    """Hidden mode: build, run MEMORY_STEPS steps, print {"peak_mb", "baseline_mb"} as JSON."""
    torch.set_num_threads(1)
    out: dict = {"n_items": n_items, "batch_size": batch_size, "method": method}
    try:
        step, _ = build_step(n_items, batch_size, method)
        out["baseline_mb"] = maxrss_mb()
        for _ in range(MEMORY_STEPS):
            step()
        out["peak_mb"] = maxrss_mb()
    except Exception as exc:
        out["error"] = first_line(exc)
    print(json.dumps(out))


def child_probe(n_items: int, batch_size: int, method: str, cap_mb: float) -> None:
    """Hidden mode: up to PROBE_STEPS steps at this batch; print peak RSS and step time."""
    torch.set_num_threads(1)
    out: dict = {"n_items": n_items, "batch_size": batch_size, "method": method}
    try:
        step, _ = build_step(n_items, batch_size, method)
        for i in range(PROBE_STEPS):
            start = time.perf_counter()
            step()
            out["step_time_s"] = time.perf_counter() - start
            out["steps"] = i + 1
            if maxrss_mb() > cap_mb:
                break  # already over the cap: no need for the next step
        out["peak_mb"] = maxrss_mb()
    except (MemoryError, RuntimeError) as exc:  # an allocation that failed outright
        out["peak_mb"] = maxrss_mb()
        out["error"] = first_line(exc)
    print(json.dumps(out))


def run_child(*args: str) -> dict:
    return run_fresh(__file__, *args)


def add_memory(records: dict[str, Record]) -> None:
    for m, rec in records.items():
        res = run_child("--child-memory", str(rec.n_items), str(rec.batch_size), m)
        if "peak_mb" in res:
            rec.peak_mb = res["peak_mb"]
            rec.baseline_mb = res["baseline_mb"]
            rec.peak_increment_mb = rec.peak_mb - rec.baseline_mb
            log(
                f"  [{rec.workload}] {m}: peak RSS {rec.peak_mb:.0f} MB "
                f"(baseline {rec.baseline_mb:.0f} MB)"
            )
        else:
            rec.error = rec.error or res.get("error", "memory measurement failed")
            log(f"  [{rec.workload}] {m}: {rec.error}")
    base = records.get(REFERENCE)
    if base is None or base.peak_mb is None:
        return
    for rec in records.values():
        if rec.peak_mb is not None:
            rec.memory_ratio = rec.peak_mb / base.peak_mb
            if base.peak_increment_mb and base.peak_increment_mb > 0:
                rec.increment_ratio = rec.peak_increment_mb / base.peak_increment_mb


@dataclass
class MaxBatch:
    max_batch: int | None = None
    peak_mb: float | None = None
    step_time_s: float | None = None
    first_failing: int | None = None
    probes: int = 0
    error: str | None = None


def find_max_batch(
    catalogue: str,
    n_items: int,
    method: str,
    cap_mb: float,
    start: int,
    tol: float,
    max_probes: int,
) -> MaxBatch:
    """Doubling (or halving) from ``start``, then binary search; one fresh process per probe."""
    result = MaxBatch()
    seen: dict[int, dict] = {}

    def fits(b: int) -> bool:
        if b not in seen:
            if result.probes >= max_probes:
                raise RuntimeError(f"gave up after {max_probes} probes")
            result.probes += 1
            res = run_child("--child-probe", str(n_items), str(b), method, repr(cap_mb))
            seen[b] = res
            ok = "peak_mb" in res and res["peak_mb"] <= cap_mb and "error" not in res
            res["fits"] = ok
            peak = f"peak {res['peak_mb']:.0f} MB" if "peak_mb" in res else res.get("error")
            log(
                f"  [{catalogue}] {method} B={b}: {peak} -> "
                f"{'fits' if ok else 'over the cap'} ({cap_mb:.0f} MB)"
            )
        return seen[b]["fits"]

    try:
        lo, hi = None, None  # largest fitting, smallest failing
        b = start
        if fits(b):
            lo = b
            while hi is None:
                b *= 2
                if fits(b):
                    lo = b
                else:
                    hi = b
        else:
            hi = b
            while lo is None:
                if b == 1:
                    result.error = f"even B=1 is over the cap ({cap_mb:.0f} MB)"
                    result.first_failing = 1
                    return result
                b //= 2
                if fits(b):
                    lo = b
                else:
                    hi = b
        while hi - lo > max(1, int(tol * lo)):
            mid = (lo + hi) // 2
            if fits(mid):
                lo = mid
            else:
                hi = mid
    except RuntimeError as exc:
        result.error = str(exc)
        lo = max((b for b, r in seen.items() if r["fits"]), default=None)
        failing = [b for b, r in seen.items() if not r["fits"]]
        hi = min(failing) if failing else None
    result.max_batch, result.first_failing = lo, hi
    if lo is not None:
        result.peak_mb = seen[lo].get("peak_mb")
        result.step_time_s = seen[lo].get("step_time_s")
    return result


# -- reporting ------------------------------------------------------------------------------------


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{spec}}{suffix}"


def markdown_table(records: list[Record]) -> str:
    lines = [
        "| workload | method | d | params | step time (s) | IQR (s) | time ratio | seq/s "
        "| peak RSS (MB) | memory ratio | increment ratio | max batch | peak at max (MB) "
        "| seq/s at max | max-batch ratio | error / note |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: | ---: | ---: | --- |",
    ]
    for r in records:
        iqr = (
            f"{r.step_time_q1_s:.3f}-{r.step_time_q3_s:.3f}"
            if r.step_time_q1_s is not None and r.step_time_q3_s is not None
            else "-"
        )
        max_b = "-" if r.max_batch is None else str(r.max_batch)
        if r.first_failing_batch is not None:
            max_b += f" (<{r.first_failing_batch})"
        note = (r.error or "").replace("|", "\\|")
        lines.append(
            f"| {r.workload} | {r.method} | {r.d_model} | {_fmt(r.n_params, ',')} "
            f"| {_fmt(r.step_time_s, '.3f')} | {iqr} | {_fmt(r.time_ratio, '.2f', 'x')} "
            f"| {_fmt(r.throughput_seq_s, '.0f')} | {_fmt(r.peak_mb, '.0f')} "
            f"| {_fmt(r.memory_ratio, '.3f', 'x')} | {_fmt(r.increment_ratio, '.2f', 'x')} "
            f"| {max_b} | {_fmt(r.max_batch_peak_mb, '.0f')} "
            f"| {_fmt(r.max_batch_throughput_seq_s, '.0f')} "
            f"| {_fmt(r.max_batch_ratio, '.2f', 'x')} | {note} |"
        )
    return "\n".join(lines)


def write_markdown(path: str, records: list[Record], settings: list[str]) -> None:
    parts = [
        "# Phantom clipping vs untied embeddings (DPFormer Figure 3) on SeqRecTransformer",
        "",
        *settings,
        "",
        "## Results",
        "",
        markdown_table(records),
        "",
        "time ratio and memory ratio are relative to `nonprivate-tied` on the same "
        "workload; max-batch ratio = max batch / the `nonprivate-tied` max batch on the same "
        "catalogue (the max batch does not depend on the workload's B).",
    ]
    with open(path, "w") as f:
        f.write("\n".join(parts).rstrip() + "\n")


def write_plot(path: str, records: list[Record], cap_mb: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r.workload for r in records))
    methods = list(dict.fromkeys(r.method for r in records))
    catalogues = list(dict.fromkeys(WORKLOADS[w][0] for w in workloads))
    by_key = {(r.workload, r.method): r for r in records}
    # one max batch per (catalogue, method): take it from the first workload of the catalogue
    first_workload = {c: next(w for w in workloads if WORKLOADS[w][0] == c) for c in catalogues}
    panels = [
        ("time_ratio", "step time / nonprivate-tied", workloads, lambda g, m: by_key.get((g, m))),
        (
            "memory_ratio",
            "peak RSS / nonprivate-tied",
            workloads,
            lambda g, m: by_key.get((g, m)),
        ),
        (
            "max_batch",
            f"largest batch under {cap_mb:.0f} MB",
            catalogues,
            lambda g, m: by_key.get((first_workload[g], m)),
        ),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    width = 0.8 / max(1, len(methods))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (field_name, title, groups, get) in zip(axes, panels, strict=True):
        for j, m in enumerate(methods):
            xs, ys = [], []
            for i, g in enumerate(groups):
                rec = get(g, m)
                value = None if rec is None else getattr(rec, field_name)
                if value is not None:
                    xs.append(i + (j - (len(methods) - 1) / 2) * width)
                    ys.append(value)
            bars = ax.bar(xs, ys, width, label=m, color=colors[j % len(colors)])
            fmt = "%d" if field_name == "max_batch" else "%.2f"
            ax.bar_label(bars, fmt=fmt, fontsize=7, rotation=90, padding=2)
        if field_name != "max_batch":
            ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_xticks(range(len(groups)), groups)
        ax.set_title(title)
        ax.margins(y=0.2)
    axes[0].legend(fontsize=8)
    fig.suptitle("SeqRecTransformer (L=50, 2 blocks, 1 head): phantom clipping vs untying")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------


def movielens_n_items() -> int:
    try:
        from dptrain.data import load_movielens_100k

        return int(load_movielens_100k().n_items)
    except Exception as exc:  # the packaged data missing: the published figure
        log(f"could not load MovieLens-100k ({first_line(exc)}); using n_items={ML100K_N_ITEMS}")
        return ML100K_N_ITEMS


def _choices(parser: argparse.ArgumentParser, flag: str, value: str, allowed) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(value.split(",")))
    bad = [n for n in names if n not in allowed]
    if bad:
        parser.error(f"{flag} {','.join(bad)} not allowed: expected some of {list(allowed)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="ml100k-B128 only, 4 methods (no phantom-ghost), 5 timed steps, max batch "
        "from B=256 with cap 850 MB, doubling/halving only (about 1.5 minutes)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the records (a JSON list) here")
    parser.add_argument("--markdown", metavar="PATH", help="write the report (markdown) here")
    parser.add_argument("--plot", metavar="PATH", help="write a PNG bar chart here")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 9; quick 5)")
    parser.add_argument(
        "--cap-mb",
        type=float,
        default=None,
        help=f"peak-RSS cap of the max-batch search (default {DEFAULT_CAP_MB:.0f}; quick 850)",
    )
    parser.add_argument(
        "--batch-tol",
        type=float,
        default=None,
        help="stop the binary search at this relative gap (default 0.05; quick 1: none)",
    )
    parser.add_argument(
        "--start-batch",
        type=int,
        default=None,
        help="first batch size of the max-batch search (default 128; quick 256)",
    )
    parser.add_argument(
        "--max-probes", type=int, default=24, help="probe processes per (catalogue, method)"
    )
    parser.add_argument("--no-max-batch", action="store_true", help="skip the max-batch search")
    parser.add_argument(
        "--workloads", metavar="A,B", help=f"only these workloads (of {', '.join(WORKLOADS)})"
    )
    parser.add_argument(
        "--methods",
        metavar="A,B",
        help=f"only these methods (of {', '.join(METHODS)}; {REFERENCE} is always added)",
    )
    parser.add_argument("--child-memory", nargs=3, metavar=("N", "B", "M"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--child-probe", nargs=4, metavar=("N", "B", "M", "C"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()

    if args.child_memory:
        n, b, m = args.child_memory
        child_memory(int(n), int(b), m)
        return
    if args.child_probe:
        n, b, m, cap = args.child_probe
        child_probe(int(n), int(b), m, float(cap))
        return

    torch.set_num_threads(1)
    workloads = QUICK_WORKLOADS if args.quick else DEFAULT_WORKLOADS
    methods = QUICK_METHODS if args.quick else tuple(METHODS)
    if args.workloads:
        workloads = _choices(parser, "--workloads", args.workloads, WORKLOADS)
    if args.methods:
        methods = _choices(parser, "--methods", f"{REFERENCE},{args.methods}", METHODS)
    timed_steps = args.steps or (5 if args.quick else 9)
    cap_mb = args.cap_mb or (850.0 if args.quick else DEFAULT_CAP_MB)
    tol = args.batch_tol if args.batch_tol is not None else (1.0 if args.quick else 0.05)
    start_batch = args.start_batch or (256 if args.quick else 128)
    if timed_steps < 1:
        parser.error(f"--steps={timed_steps} is not allowed: expected an integer >= 1")
    if start_batch < 1 or args.max_probes < 1 or tol < 0 or cap_mb <= 0:
        parser.error("--start-batch and --max-probes must be >= 1, --batch-tol >= 0, --cap-mb > 0")

    catalogues = dict(CATALOGUES)
    if any(WORKLOADS[w][0] == "ml100k" for w in workloads):
        catalogues["ml100k"] = movielens_n_items()
    start = time.perf_counter()
    load_at_start = os.getloadavg()
    log(
        f"torch.set_num_threads(1); workloads {', '.join(workloads)}; methods "
        f"{', '.join(methods)}; {WARMUP_STEPS} warm-up + {timed_steps} timed steps; "
        f"n_items: " + ", ".join(f"{c}={catalogues[c]}" for c in catalogues)
    )

    per_workload: list[dict[str, Record]] = []
    for w in workloads:
        catalogue, b = WORKLOADS[w]
        log(f"timing {w} (n_items={catalogues[catalogue]}, B={b})")
        per_workload.append(time_workload(w, catalogues[catalogue], b, methods, timed_steps))
    for w, records in zip(workloads, per_workload, strict=True):
        log(f"peak memory {w} (fresh process per method)")
        add_memory(records)

    if not args.no_max_batch:
        needed = list(dict.fromkeys(WORKLOADS[w][0] for w in workloads))
        for catalogue in needed:
            log(f"max batch under {cap_mb:.0f} MB, {catalogue} (fresh process per probe)")
            found = {
                m: find_max_batch(
                    catalogue,
                    catalogues[catalogue],
                    m,
                    cap_mb,
                    start_batch,
                    tol,
                    args.max_probes,
                )
                for m in methods
            }
            ref = found.get(REFERENCE)
            for records in per_workload:
                for m, rec in records.items():
                    if WORKLOADS[rec.workload][0] != catalogue:
                        continue
                    mb = found[m]
                    rec.cap_mb = cap_mb
                    rec.max_batch, rec.first_failing_batch = mb.max_batch, mb.first_failing
                    rec.max_batch_peak_mb = mb.peak_mb
                    if mb.max_batch and mb.step_time_s:
                        rec.max_batch_throughput_seq_s = mb.max_batch / mb.step_time_s
                    if mb.max_batch and ref is not None and ref.max_batch:
                        rec.max_batch_ratio = mb.max_batch / ref.max_batch
                    if mb.error:
                        note = f"max batch: {mb.error}"
                        rec.error = f"{rec.error}; {note}" if rec.error else note

    all_records = [rec for records in per_workload for rec in records.values()]
    total_s = time.perf_counter() - start
    load_at_end = os.getloadavg()
    settings = [
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Machine: {machine_description()}; Python {platform.python_version()}; "
        f"torch {torch.__version__}",
        f"- Command: `{command_line()}`{' (quick mode)' if args.quick else ''}",
        f"- dptrain: {git_description()}",
        f"- Total run time: {total_s / 60:.1f} min; 1-minute load average "
        f"{load_at_start[0]:.2f} at the start, {load_at_end[0]:.2f} at the end.",
        "- Model: `SeqRecTransformer(SeqRecConfig(n_items, max_len=50, d_model=64 (32 for "
        "untied-half-d), n_head=1, n_layer=2, dropout=0.0, tie_embeddings=...))`, AdamW("
        f"lr={LR}); random item ids (seed {SEED}); n_items: "
        + ", ".join(f"{c} = {catalogues[c]}" for c in catalogues)
        + ".",
        "- DP methods: `ClippingEngine(model, 1.0, clipping='automatic', mode=...)` + "
        "`DPOptimizer(AdamW, noise_multiplier=1.0, max_grad_norm=1.0)`; per-example "
        "cross-entropy (`ignore_index=0`).",
        f"- Timing: `torch.set_num_threads(1)`, {WARMUP_STEPS} warm-up + {timed_steps} timed "
        "steps per method, methods interleaved round-robin within a workload; median, IQR.",
        f"- Memory: peak RSS (`ru_maxrss`) of a fresh process per (workload, method) running "
        f"{MEMORY_STEPS} steps; increment = peak - RSS after building model, optimizer, batch.",
        f"- Max batch: doubling from B={start_batch} then binary search to a {tol:.0%} "
        f"gap; each probe a fresh process running up to {PROBE_STEPS} steps on a random "
        f"batch; fits iff peak RSS <= {cap_mb:.0f} MB; `max batch (<N)`: N is the smallest "
        "batch found over the cap. seq/s at max: max batch / the probe's second step time.",
    ]
    print(markdown_table(all_records))
    print()
    print(f"total run time: {total_s:.0f} s ({total_s / 60:.1f} min)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in all_records], f, indent=1)
            f.write("\n")
    if args.markdown:
        write_markdown(args.markdown, all_records, settings)
    if args.plot:
        write_plot(args.plot, all_records, cap_mb)


if __name__ == "__main__":
    main()
