"""Where a private step on the real SmolLM2-135M goes, phase by phase (not a test).

    PYTHONPATH=src taskset -c 1 python benchmarks/profile_smollm2.py \
        [--workload smollm2-full] [--methods nonprivate,dptrain-bk,dptrain-ghost] \
        [--warmup 1] [--steps 3] [--batch B] [--num-layers N] [--amp off|bf16] \
        [--experiment instantiate-narrow] [--min-ms 0.5] [--torch-profiler] [--json PATH]

Builds a ``dptrain bench`` workload (:mod:`dptrain.bench.workloads`; by default the
pretrained SmolLM2-135M-Instruct, float32, B=4, T=128 random token ids; any workload
that runs on a CPU can be named, e.g. ``llamatiny-full-bf16`` for a quick check) and
runs one training step at a time with wall-clock timers (``time.perf_counter``, one
torch thread, so every operator has finished when a timer stops) around:

- the step's phases: forward, loss, ``engine.backward`` (``loss.backward()`` for the
  non-private step), optimizer step (the noise, the inner AdamW step);
- the engine's phases, by wrapping *this instance's* methods and the module
  functions it calls (the engine's code is not changed; every wrapped name is in
  :data:`TARGETS`): the p.grad check, the graph check (``_live_calls``), the example
  layouts, the independence check and the exact self-check (on new layout patterns:
  the first step), the output gradients (``Streaming.output_gradients``: autograd's
  backward to the recorded outputs, with the streamed modules' per-example gradients
  formed inside it), the records (``build_records``), the per-example norms per
  module kind (q/k/v/o/gate/up/down, the streamed modules' held gradients, the tied
  embedding's phantom norm with its embedding ghost norm, head Gram inner product
  and cross term), the clip factors, the book-keeping sums per module kind and their
  addition to ``p.grad``, ghost's second backward (``Tensor.backward``); the
  self-check's masked backwards show as ``torch.autograd.backward`` under it.

The wrapped names are internals, so they rot when the engine is refactored. They are
all listed in :data:`TARGETS` and resolved before anything runs: if any is missing
the script stops with one :class:`StaleTargetsError` naming every missing one. A
target that exists but was not called in a run is listed under the run's table
("not called"): some are conditional (ghost's second backward, the rows check of rows
that the data decide, the streamed modules), any other one means the engine no longer
goes through it.

Timers nest; a row's time includes its children's, and "(rest)" is a parent's time
outside its timed children. The first ``--warmup`` steps (the checks run in the
first) are reported separately from the median of the ``--steps`` timed steps. Each
run also reports the peak RSS of the first step and of the later steps (``VmHWM``,
reset through ``/proc/self/clear_refs`` after the first step).

``--experiment`` applies a change to the engine *from this script* (by patching this
engine instance, for one run) to measure what an engine change would save:

- ``instantiate-narrow``: k_proj/v_proj (576 -> 192 on SmolLM2) get per-example
  gradients (reused for the sum) instead of the ghost norm that the cost rule picks.

Dropped: ``rmsnorm-direct`` (RMSNorm's n(x) as x * rsqrt(mean(x^2) + eps) instead of
through ``torch.func.functional_call``): the engine no longer calls functional_call
there (it swaps a neutral weight into the module's ``_parameters`` and runs its own
forward, so n(x) stays bitwise the model's), and the experiment patched the rule
object that every engine in the process shares. The experiments the engine adopted
earlier (skipping the tied modules' own norms, sharing input Gram blocks, freeing
records during book-keeping, one host sync for the noise diagnostics) were removed
before: see docs/engine_benchmark.md.

With several ``--methods`` each runs in a fresh process (peak RSS per method). Prints
markdown tables (and ``--json PATH`` writes the raw figures). CPU only: on a GPU the
timers would stop before the kernels finish, and autograd's hooks run on device threads.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import torch

from dptrain.bench import workloads as W

#: A timer's label, or a function of the wrapped call's arguments that gives it.
Label = str | Callable[..., str]

PRIVATE_METHODS = W.DPTRAIN_METHODS
METHODS = ("nonprivate", *PRIVATE_METHODS)
#: The workloads that run on a CPU (the real-size Llama ones are refused there).
CPU_WORKLOADS = tuple(sorted(n for n, w in W.WORKLOADS.items() if not w.gpu))


class Target(NamedTuple):
    """A method or function to time: ``root``'s attribute at the dotted ``path``.

    ``root`` is ``"engine"`` (the ClippingEngine), ``"dp_optimizer"`` (the DPOptimizer),
    ``"adamw"`` (the AdamW that steps: the DPOptimizer's inner one, or the non-private
    step's own) or a module's import name. ``private``: timed in private steps only.
    """

    root: str
    path: str
    label: Label
    private: bool = True


#: Every name this script wraps, in one place (module docstring). Order is irrelevant.
TARGETS: tuple[Target, ...] = (
    Target("torch.autograd", "grad", "torch.autograd.grad"),
    Target("torch", "Tensor.backward", "Tensor.backward", private=False),
    # (the self-check's masked backwards)
    Target("torch.autograd", "backward", "torch.autograd.backward", private=False),
    Target("adamw", "step", "AdamW step", private=False),
    # engine.backward, in the order it runs
    Target("engine", "_check_untouched_grads", "p.grad check"),
    Target("engine", "_live_calls", "graph check (_live_calls)"),
    Target("engine", "_rows.layouts", "example layouts (RowDecisions.layouts)"),
    Target("dptrain.clipping.independence", "run", "independence check (new layouts)"),
    Target("dptrain.clipping.self_check", "rows", "rows check (rows the data decide)"),
    Target("engine", "_streaming.output_gradients", "output gradients (output_gradients)"),
    Target("engine", "_streaming._stream", lambda use, *_: f"streamed: {kind_of(use.name)}"),
    Target("dptrain.clipping.engine", "build_records", "records (build_records)"),
    Target("dptrain.clipping.self_check", "run", "self-check (new layouts)"),
    Target("engine", "_norms_sums.norms_sq", "per-example norms (norms_sq)"),
    Target("engine", "_norms_sums._held_norms_sq", "norms: streamed modules (held grads)"),
    Target("engine", "_norms_sums._module_norms_sq", lambda use, *_: f"norms: {kind_of(use.name)}"),
    Target("dptrain.clipping.sums", "_tied_norm_sq", "norms: tied embedding (phantom)"),
    Target("dptrain.clipping.sums", "embedding_ghost_norm", "embedding ghost norm (lookups)"),
    Target("dptrain.clipping.sums", "gram_inner", "head Gram inner product"),
    Target("dptrain.clipping.sums", "phantom_cross_term", "phantom cross term"),
    Target("engine", "_norms_sums.rounding_margins", "rounding margins"),
    Target("engine", "clip_factors", "clip factors"),
    Target("engine", "_book_keeping", "book-keeping sums (_book_keeping)"),
    Target(
        "engine",
        "_norms_sums._weighted_sum_of",
        lambda name, *_: f"sum: {kind_of(name.rsplit('.', 1)[0])}",
    ),
    Target("engine", "_store.add", "add to p.grad (GradStore.add)"),
    Target("engine", "clear", "clear records"),
    Target("engine", "_mark_grads", "mark grads"),
    # the optimizer step
    Target("dp_optimizer", "check_clipped_gradients", "check clipped gradients"),
    Target("dp_optimizer", "add_noise", "add noise (DPOptimizer.add_noise)"),
)

#: Targets that are called only in some runs (module docstring): which, and when.
CONDITIONAL = {
    "Tensor.backward": "private steps: ghost's second backward only",
    "torch.autograd.backward": "private steps: the self-check (first step) or ghost",
    "rows check (rows the data decide)": "models whose rows the data decide",
    "norms: streamed modules (held grads)": "models with streamed modules",
    "independence check (new layouts)": "the first step (warm-up)",
    "self-check (new layouts)": "the first step (warm-up)",
    "book-keeping sums (_book_keeping)": "book-keeping, or ghost on low precision",
}

#: What each ``--experiment`` replaces (checked with :data:`TARGETS`).
EXPERIMENT_TARGETS: dict[str, tuple[Target, ...]] = {
    "instantiate-narrow": (
        Target("engine", "_norms_sums.ghost", "norm method"),
        Target("engine", "_streaming._ghost", "norm method (streaming's copy)"),
    ),
}

#: The workload helpers the step is built from (checked with :data:`TARGETS`).
WORKLOAD_HELPERS = tuple(
    Target("dptrain.bench.workloads", name, name, private=False)
    for name in ("_logits", "_mean_loss", "_per_example_losses", "_DPTRAIN_KWARGS")
)

#: Roots that are objects of a run, not modules.
_OBJECT_ROOTS = {
    "engine": "the ClippingEngine",
    "dp_optimizer": "the DPOptimizer",
    "adamw": "the AdamW optimizer",
}


class StaleTargetsError(RuntimeError):
    """Names this script wraps or calls no longer exist (the engine was refactored)."""


class Timers:
    """Nested wall-clock timers: inclusive seconds per label path, per step."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.current: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)  # per wrapped target name
        self.steps: list[dict[str, float]] = []

    @contextlib.contextmanager
    def __call__(self, label: str) -> Iterator[None]:
        path = " > ".join([*self.stack, label])
        self.stack.append(label)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.current[path] += time.perf_counter() - start
            self.counts[path] += 1
            self.stack.pop()

    def wrap(self, fn: Callable, label: Label, name: str | None = None) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if name is not None:
                self.calls[name] += 1
            text = label(*args, **kwargs) if callable(label) else label
            with self(text):
                return fn(*args, **kwargs)

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)


def kind_of(name: str) -> str:
    """'model.layers.3.self_attn.k_proj' -> 'k_proj'; RMSNorms -> 'RMSNorm'; LoRA ->
    'k_proj.lora_A'."""
    parts = name.split(".")
    for special in ("lora_A", "lora_B"):
        if special in parts:
            return f"{parts[parts.index(special) - 1]}.{special}"
    last = parts[-1]
    if last.endswith("layernorm") or last == "norm":
        return "RMSNorm"
    return last


# -- the targets: resolved up front, wrapped for one run, restored after -----------------------


class Resolved(NamedTuple):
    owner: Any
    attr: str
    label: Label
    name: str  # "root.path", as errors and "not called" name it


def resolve(targets: Sequence[Target], roots: dict[str, Any]) -> list[Resolved]:
    """Each target's owner and attribute; :class:`StaleTargetsError` naming every one that
    is missing (a module root is imported; an object root missing from ``roots`` is
    skipped: that run has no such object)."""
    found, missing = [], []
    for t in targets:
        name = f"{t.root}.{t.path}"
        if t.root in _OBJECT_ROOTS and t.root not in roots:
            continue
        try:
            owner = roots[t.root] if t.root in roots else importlib.import_module(t.root)
            *parents, attr = t.path.split(".")
            for part in parents:
                owner = getattr(owner, part)
            getattr(owner, attr)
        except (ImportError, AttributeError):
            missing.append(name)
            continue
        found.append(Resolved(owner, attr, t.label, name))
    if missing:
        roots_text = "; ".join(f"{k} is {v}" for k, v in _OBJECT_ROOTS.items())
        raise StaleTargetsError(
            f"{len(missing)} name(s) this profiler wraps or calls no longer exist: "
            f"{', '.join(missing)} ({roots_text}). The engine or the bench workloads were "
            "refactored: update TARGETS (or EXPERIMENT_TARGETS, WORKLOAD_HELPERS) in "
            "benchmarks/profile_smollm2.py to the current names"
        )
    return found


def preflight(experiments: Sequence[str] = ()) -> None:
    """Resolve every target on a one-layer engine and optimizer, before any model loads."""
    from dptrain.clipping import ClippingEngine
    from dptrain.optim import DPOptimizer

    model = torch.nn.Linear(2, 2)
    engine = ClippingEngine(model, 1.0)
    adamw = torch.optim.AdamW(model.parameters())
    dp_optimizer = DPOptimizer(
        adamw, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=1, sample_rate=0.5
    )
    try:
        resolve(
            [*TARGETS, *WORKLOAD_HELPERS, *(t for e in experiments for t in EXPERIMENT_TARGETS[e])],
            {"engine": engine, "dp_optimizer": dp_optimizer, "adamw": adamw},
        )
    finally:
        engine.detach()


@contextlib.contextmanager
def instrumented(resolved: Sequence[Resolved], timers: Timers) -> Iterator[None]:
    """Every resolved target wrapped with a timer, put back as it was on exit (a module
    function, a class's method, or an instance's, which then reads its class's again)."""
    undo: list[tuple[Any, str, Any]] = []
    absent = object()
    try:
        for r in resolved:
            own = vars(r.owner).get(r.attr, absent)
            undo.append((r.owner, r.attr, own))
            setattr(r.owner, r.attr, timers.wrap(getattr(r.owner, r.attr), r.label, r.name))
        yield
    finally:
        for owner, attr, own in reversed(undo):
            if own is absent:
                delattr(owner, attr)
            else:
                setattr(owner, attr, own)


# -- experiments: engine changes applied from here, for one run ---------------------------------


def instantiate_narrow(engine: Any) -> None:
    """k_proj / v_proj: per-example gradients (B x 192 x 576 on SmolLM2) instead of the
    ghost norm. Both readers of the choice are patched: the norms' and streaming's."""
    original = engine._norms_sums.ghost

    def ghost(use: Any, a: torch.Tensor, g: torch.Tensor) -> bool:
        if kind_of(use.name) in ("k_proj", "v_proj"):
            return False
        return original(use, a, g)

    engine._norms_sums.ghost = ghost
    engine._streaming._ghost = ghost


EXPERIMENTS: dict[str, Callable[[Any], None]] = {"instantiate-narrow": instantiate_narrow}


# -- the step ---------------------------------------------------------------------------------------


def build(workload: W.Workload, method: str, timers: Timers, experiments: Sequence[str], amp: str):
    """(step, engine or None, resolved targets): the workload's step for ``method``, with
    timers; the targets are resolved (StaleTargetsError) before the step can run."""
    x, y = W.make_batch(workload)
    model = W.make_model(workload)
    params = [p for p in model.parameters() if p.requires_grad]
    adamw = torch.optim.AdamW(params, lr=W.LR)
    if method == "nonprivate":
        resolved = resolve([t for t in TARGETS if not t.private], {"adamw": adamw})

        def step() -> None:
            adamw.zero_grad()
            with W.amp_context(amp):
                with timers("forward"):
                    logits = W._logits(model, workload, x)
                with timers("loss"):
                    loss = W._mean_loss(workload, logits, y)
            del logits
            with timers("loss.backward()"):
                loss.backward()
            with timers("optimizer step"):
                adamw.step()

        return step, None, resolved

    from dptrain.clipping import ClippingEngine
    from dptrain.optim import DPOptimizer

    engine = ClippingEngine(model, 1.0, **W._DPTRAIN_KWARGS[method])
    dpopt = DPOptimizer(
        adamw,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=workload.batch_size,
        sample_rate=0.01,
        seed=W.SEED,
    )
    roots = {"engine": engine, "dp_optimizer": dpopt, "adamw": adamw}
    resolve([t for e in experiments for t in EXPERIMENT_TARGETS[e]], roots)
    resolved = resolve(TARGETS, roots)
    for name in experiments:
        EXPERIMENTS[name](engine)

    def dp_step() -> None:
        dpopt.zero_grad()
        with W.amp_context(amp):
            with timers("forward"):
                logits = W._logits(model, workload, x)
            with timers("loss"):
                losses = W._per_example_losses(workload, logits, y)
        del logits
        with timers("engine.backward"):
            engine.backward(losses)
        with timers("optimizer step"):
            dpopt.step()

    return dp_step, engine, resolved


def run(
    workload: W.Workload,
    method: str,
    warmup: int,
    steps: int,
    experiments: Sequence[str] = (),
    amp: str = "off",
) -> dict[str, Any]:
    """``warmup + steps`` timed steps of ``method`` on ``workload``: the figures (JSON-able)."""
    timers = Timers()
    step, engine, resolved = build(workload, method, timers, experiments, amp)
    wall: list[float] = []
    peaks: list[float] = []
    with instrumented(resolved, timers):
        for i in range(warmup + steps):
            start = time.perf_counter()
            with timers("step"):
                step()
            wall.append(time.perf_counter() - start)
            timers.end_step()
            if i == 0:  # peak RSS of the first step (the checks), then of the later ones
                peaks.append(_vm_hwm_mb())
                with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
    peaks.append(_vm_hwm_mb())
    timed = timers.steps[warmup:]
    paths = sorted({p for s in timers.steps for p in s}, key=_order)
    median = {p: statistics.median(s.get(p, 0.0) for s in timed) for p in paths}
    labels = {r.name: r.label for r in resolved}
    return {
        "workload": workload.name,
        "batch_size": workload.batch_size,
        "seq_len": workload.seq_len,
        "amp": amp,
        "method": method,
        "experiments": list(experiments),
        "warmup": warmup,
        "steps": steps,
        "wall_s": wall,
        "median_step_s": statistics.median(wall[warmup:]),
        "median": median,
        "first_step": timers.steps[0] if warmup else {},
        "calls_per_step": {p: timers.counts[p] / (warmup + steps) for p in paths},
        "not_called": [
            lab if isinstance(lab, str) else name
            for name, lab in labels.items()
            if timers.calls[name] == 0
        ],
        "self_checks": None if engine is None else engine.self_checks,
        "peak_rss_first_step_mb": peaks[0],
        "peak_rss_later_steps_mb": peaks[-1],
    }


def _vm_hwm_mb() -> float:
    """Peak resident set size (VmHWM) of this process, MB; resettable, unlike ru_maxrss."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _order(path: str) -> tuple:
    return (path.count(" > "), path)


def markdown(results: list[dict[str, Any]], min_ms: float = 0.5) -> str:
    """One table per run: path, median ms per step, share of the step, first step; rows
    under ``min_ms`` in both columns are left out."""
    out = []
    for r in results:
        step = r["median"].get("step", r["median_step_s"])
        exp = f", experiments: {', '.join(r['experiments'])}" if r["experiments"] else ""
        out += [
            f"### {r['method']} on {r['workload']} (B={r['batch_size']}, T={r['seq_len']}, "
            f"amp {r['amp']}){exp}",
            "",
            f"{r['warmup']} warm-up + {r['steps']} timed steps; median step "
            f"{r['median_step_s']:.3f} s (steps: {', '.join(f'{t:.2f}' for t in r['wall_s'])} s)"
            + (f"; self-checks run: {r['self_checks']}" if r["self_checks"] is not None else "")
            + f"; peak RSS {r['peak_rss_first_step_mb']:.0f} MB in the first step, "
            f"{r['peak_rss_later_steps_mb']:.0f} MB in the later ones",
            "",
            "| phase (nested: a row includes its children) | median ms / step | share | "
            "first step ms |",
            "| --- | ---: | ---: | ---: |",
        ]
        median, first_step = _with_rest(r["median"]), _with_rest(r["first_step"])
        weight = {p: max(median.get(p, 0.0), first_step.get(p, 0.0)) for p in median}
        for path in sorted(median, key=_tree_key(weight)):
            if path == "step":
                continue
            ms = 1000 * median[path]
            first = 1000 * first_step.get(path, 0.0)
            if ms < min_ms and first < min_ms:
                continue
            depth = path.count(" > ")
            label = path.rsplit(" > ", 1)[-1]
            out.append(
                f"| {'&nbsp;&nbsp;' * (depth - 1) + ('- ' if depth > 1 else '')}{label} "
                f"| {ms:.1f} | {ms / 1000 / step:.1%} | {first:.1f} |"
            )
        out.append("")
        if r["not_called"]:
            why = [f"{n} ({CONDITIONAL[n]})" if n in CONDITIONAL else n for n in r["not_called"]]
            out += [f"Not called in this run: {'; '.join(why)}.", ""]
    return "\n".join(out)


def _with_rest(times: dict[str, float]) -> dict[str, float]:
    """``times`` plus, under each parent with timed children, a "(rest)" row: the parent's
    time not in any child (e.g. the clip factors, p.grad assignment, Python glue)."""
    out = dict(times)
    children: dict[str, float] = defaultdict(float)
    for path, t in times.items():
        if " > " in path:
            children[path.rsplit(" > ", 1)[0]] += t
    for parent, inside in children.items():
        if parent in times and parent != "step":
            out[f"{parent} > (rest)"] = max(times[parent] - inside, 0.0)
    return out


def _tree_key(median: dict[str, float]) -> Callable[[str], tuple]:
    """Depth-first order: each parent before its children, siblings by time, largest first."""

    def key(path: str) -> tuple:
        parts = path.split(" > ")
        return tuple(
            (-median.get(" > ".join(parts[: i + 1]), 0.0), parts[i]) for i in range(len(parts))
        )

    return key


def torch_profile(workload: W.Workload, method: str, amp: str = "off", top: int = 15) -> str:
    """torch.profiler of one step after one warm-up: top operators by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    step, engine, _ = build(workload, method, Timers(), [], amp)
    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    if engine is not None:
        engine.detach()
    events = sorted(
        prof.key_averages(group_by_input_shape=True),
        key=lambda e: e.self_cpu_time_total,
        reverse=True,
    )
    total = sum(e.self_cpu_time_total for e in prof.key_averages()) or 1.0
    lines = [
        f"Top {top} (operator, input shapes) by self CPU time, one `{method}` step on "
        f"`{workload.name}` under torch.profiler:",
        "",
        "| operator | input shapes | calls | self CPU (ms) | share |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for e in events[:top]:
        shapes = ", ".join(str(tuple(s)) for s in e.input_shapes if s) or "-"
        lines.append(
            f"| `{e.key}` | {shapes} | {e.count} | {e.self_cpu_time_total / 1e3:.1f} "
            f"| {e.self_cpu_time_total / total:.1%} |"
        )
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", default="smollm2-full", choices=CPU_WORKLOADS)
    p.add_argument(
        "--methods",
        default="nonprivate,dptrain-bk,dptrain-ghost",
        help=f"comma-separated, from {', '.join(METHODS)}",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed first steps (>= 0)")
    p.add_argument("--steps", type=int, default=3, help="timed steps (>= 1)")
    p.add_argument("--batch", type=int, default=None, help="override the workload's B")
    p.add_argument("--num-layers", type=int, default=None, help="smollm2-*: cut the model")
    p.add_argument(
        "--amp",
        default=None,
        choices=W.AMP_MODES,
        help="bf16 autocast of the forward and loss (default off; llama* workloads fix theirs)",
    )
    p.add_argument("--experiment", action="append", default=[], choices=sorted(EXPERIMENTS))
    p.add_argument("--min-ms", type=float, default=0.5, help="leave out rows under this")
    p.add_argument("--torch-profiler", action="store_true", help="also the top operators")
    p.add_argument("--json", metavar="PATH")
    return p


def _checked(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[W.Workload, list[str]]:
    """The workload as asked and the methods; bad values exit 2, naming the argument."""
    methods = a.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        p.error(f"--methods {a.methods!r} is not allowed: expected some of {', '.join(METHODS)}")
    for flag, value, least in (
        ("--warmup", a.warmup, 0),
        ("--steps", a.steps, 1),
        ("--batch", a.batch, 1),
        ("--num-layers", a.num_layers, 1),
    ):
        if value is not None and value < least:
            p.error(f"{flag} {value} is not allowed: expected an integer >= {least}")
    if a.min_ms < 0:
        p.error(f"--min-ms {a.min_ms} is not allowed: expected a number >= 0")
    workload = W.WORKLOADS[a.workload]
    if a.num_layers is not None:
        if workload.model != "smollm2":
            p.error(
                f"--num-layers {a.num_layers} is not allowed with --workload {a.workload}: "
                "only the smollm2-* workloads can be cut"
            )
        workload = dataclasses.replace(workload, num_layers=a.num_layers)
    if a.batch is not None:
        workload = dataclasses.replace(workload, batch_size=a.batch)
    if a.amp is not None and W.effective_amp(workload, a.amp) != a.amp:
        p.error(
            f"--amp {a.amp} is not allowed with --workload {a.workload}: that workload fixes "
            f"its own precision (amp {W.effective_amp(workload, a.amp)}); leave --amp out"
        )
    return workload, methods


def main(argv: Sequence[str] | None = None) -> None:
    """The command line (module docstring); ``argv`` defaults to ``sys.argv[1:]``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    p = _parser()
    a = p.parse_args(argv)
    workload, methods = _checked(p, a)
    preflight(a.experiment)  # every wrapped name exists, before a model loads
    torch.set_num_threads(1)
    for message in W.QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for method in methods:
        W.preload(workload, method)
    if len(methods) > 1:  # one fresh process per method: a peak RSS each
        results = []
        for method in methods:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "r.json")
                cmd = [sys.executable, os.path.abspath(__file__), *_drop_json(argv)]
                cmd += ["--methods", method, "--json", path]
                subprocess.run(cmd, check=True)
                with open(path) as f:
                    results += json.load(f)
    else:
        exps = [] if methods[0] == "nonprivate" else a.experiment
        amp = W.effective_amp(workload, a.amp or "off")
        results = [run(workload, methods[0], a.warmup, a.steps, exps, amp)]
        print(markdown(results, a.min_ms), flush=True)
        if a.torch_profiler:
            print(torch_profile(workload, methods[0], amp), "\n", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


def _drop_json(argv: list[str]) -> list[str]:
    """argv without --methods/--json and their values (the parent passes its own)."""
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        if x in ("--methods", "--json"):
            skip = True
            continue
        if x.startswith(("--methods=", "--json=")):
            continue
        out.append(x)
    return out


if __name__ == "__main__":
    main()
