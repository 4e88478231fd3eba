"""Where a private step on the real SmolLM2-135M goes, phase by phase (not a test).

    PYTHONPATH=src taskset -c 1 python benchmarks/profile_smollm2.py \
        [--workload smollm2-full] [--methods nonprivate,dptrain-bk,dptrain-ghost] \
        [--warmup 1] [--steps 3] [--experiment NAME ...] [--torch-profiler]

Builds the ``dptrain bench`` workload (:mod:`dptrain.bench.workloads`: the
pretrained SmolLM2-135M-Instruct, float32, B=4, T=128 random token ids) and
runs one training step at a time with wall-clock timers (``time.perf_counter``,
one torch thread, so every operator has finished when a timer stops) around:

- the step's phases: forward, loss, ``engine.backward`` / ``loss.backward()``,
  optimizer step (noise, the inner AdamW step);
- the engine's phases, by wrapping *this instance's* methods and the module
  functions it calls (the engine's code is not changed): the p.grad check, the
  graph check (``_live_calls``), the example layouts, ``torch.autograd.grad``
  to the recorded outputs, the records, the exact self-check (first step
  only), the per-example norms per module kind (q/k/v/o/gate/up/down, RMSNorm,
  the embedding and the tied head's own norms) and the tied embedding's
  phantom norm (``_tied_norm_sq``: its embedding ghost norm, the head's Gram
  inner product, the cross term), the book-keeping sums per module kind, the
  second backward (ghost mode).

Timers nest; a row's time includes its children's. The first ``--warmup``
steps (the self-check runs in the first) are reported separately from the
median of the ``--steps`` timed steps.

``--experiment`` applies a change to the engine *from this script* (by
monkeypatching, for one run) to measure what an engine change would save:

- ``instantiate-narrow``: k_proj/v_proj (576 -> 192) are instantiated instead
  of ghost-normed (their per-example gradients are then reused for the sum);
- ``rmsnorm-direct``: the RMSNorm rule computes x * rsqrt(mean(x^2) + eps)
  in float32 directly instead of calling the module through
  ``torch.func.functional_call``.

(The experiments measured on 2026-11-24 that the engine has since adopted, such
as skipping the tied modules' own norms, sharing input Gram blocks, freeing
records during book-keeping and one host sync for the noise diagnostics, are no
longer here: see docs/engine_benchmark.md.)

Each run also reports the peak RSS of the first step and of the later steps
(``VmHWM``, reset through ``/proc/self/clear_refs`` after the first step: the
exact self-check runs in the first step only).

Prints markdown tables (and ``--json PATH`` writes the raw figures).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from dptrain.bench import workloads as W

STEP_PHASES = ("forward", "loss", "backward", "optimizer step")


class Timers:
    """Nested wall-clock timers: inclusive seconds per label path, per step."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.current: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)
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

    def wrap(self, fn: Callable, label: str | Callable[..., str]) -> Callable:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            name = label(*args, **kwargs) if callable(label) else label
            with self(name):
                return fn(*args, **kwargs)

        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        return wrapped

    def end_step(self) -> None:
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)


def kind_of(name: str) -> str:
    """'model.layers.3.self_attn.k_proj' -> 'k_proj'; RMSNorms -> 'RMSNorm'; LoRA -> 'lora_A'."""
    parts = name.split(".")
    for special in ("lora_A", "lora_B"):
        if special in parts:
            return f"{parts[parts.index(special) - 1]}.{special}"
    last = parts[-1]
    if last.endswith("layernorm") or last == "norm":
        return "RMSNorm"
    return last


def instrument(engine, dpopt, timers: Timers) -> None:
    """Wrap the engine's phases (this instance, the rule singletons, the module functions)."""
    import dptrain.clipping.engine as eng
    from dptrain.clipping import independence, self_check

    for attr, label in (
        ("_check_untouched_grads", "p.grad check"),
        ("_live_calls", "graph check (_live_calls)"),
        ("_layouts", "example layouts"),
        ("_records", "records (a, g)"),
        ("_norms_sq", "per-example norms (_norms_sq)"),
        ("_tied_norm_sq", "tied embedding phantom norm (_tied_norm_sq)"),
        ("_book_keeping", "book-keeping sums (_book_keeping)"),
        ("_mark_grads", "mark grads"),
        ("clear", "clear records"),
    ):
        setattr(engine, attr, timers.wrap(getattr(engine, attr), label))
    engine._module_norms_sq = timers.wrap(
        engine._module_norms_sq, lambda use, a, g: f"norms: {kind_of(use.name)}"
    )
    for fn_name, label in (
        ("embedding_ghost_norm", "embedding ghost norm (input lookups)"),
        ("gram_inner", "head Gram inner product (h, g_out: 49,152 wide)"),
        ("phantom_cross_term", "phantom cross term"),
    ):
        setattr(eng, fn_name, timers.wrap(getattr(eng, fn_name), label))
    self_check.run = timers.wrap(self_check.run, "self-check (new layout patterns)")
    independence.run = timers.wrap(independence.run, "independence check (new patterns)")
    names = {id(u.module): u.name for u in engine._uses.values()}
    rules = {id(u.rule): u.rule for u in engine._uses.values()}
    for rule in rules.values():
        rule.clipped_sum = timers.wrap(
            rule.clipped_sum, lambda m, *a, **k: f"sum: {kind_of(names.get(id(m), '?'))}"
        )
    dpopt.add_noise = timers.wrap(dpopt.add_noise, "add noise (DPOptimizer.add_noise)")
    dpopt.original_optimizer.step = timers.wrap(dpopt.original_optimizer.step, "AdamW step")
    dpopt.check_clipped_gradients = timers.wrap(
        dpopt.check_clipped_gradients, "check clipped gradients"
    )


def patch_autograd(timers: Timers) -> None:
    grad = torch.autograd.grad
    torch.autograd.grad = timers.wrap(grad, "torch.autograd.grad")
    backward = torch.Tensor.backward
    torch.Tensor.backward = timers.wrap(backward, "Tensor.backward")


# -- experiments: engine changes applied from here, for one run ---------------------------------


def instantiate_narrow(engine) -> None:
    """k_proj / v_proj: per-example gradients (4 x 192 x 576) instead of the ghost norm."""
    original = engine._ghost

    def ghost(use, a, g):
        if kind_of(use.name) in ("k_proj", "v_proj"):
            return False
        return original(use, a, g)

    engine._ghost = ghost


def rmsnorm_direct(engine) -> None:
    """RMSNormRule._normalised as x * rsqrt(mean(x^2) + eps) in float32 (Llama's own formula),
    without torch.func.functional_call."""
    from dptrain.clipping.rules import RMSNormRule

    for use in engine._uses.values():
        if isinstance(use.rule, RMSNormRule):
            rule = use.rule
            break
    else:
        return

    def normalised(module, a):
        x = a.float()
        eps = getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6))
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(a.dtype)

    rule._normalised = normalised


EXPERIMENTS = {
    "instantiate-narrow": instantiate_narrow,
    "rmsnorm-direct": rmsnorm_direct,
}


# -- the step ---------------------------------------------------------------------------------------


def build(workload: W.Workload, method: str, timers: Timers, experiments: list[str]):
    """(step, engine or None): the workload's step for ``method``, with timers."""
    x, y = W.make_batch(workload)
    model = W.make_model(workload)
    params = [p for p in model.parameters() if p.requires_grad]
    if method == "nonprivate":
        opt = torch.optim.AdamW(params, lr=W.LR)
        opt.step = timers.wrap(opt.step, "AdamW step")

        def step() -> None:
            opt.zero_grad()
            with timers("forward"):
                logits = W._logits(model, workload, x)
            with timers("loss"):
                loss = W._mean_loss(workload, logits, y)
            del logits
            with timers("backward"):
                loss.backward()
            with timers("optimizer step"):
                opt.step()

        return step, None

    from dptrain.clipping import ClippingEngine
    from dptrain.optim import DPOptimizer

    engine = ClippingEngine(model, 1.0, **W._DPTRAIN_KWARGS[method])
    dpopt = DPOptimizer(
        torch.optim.AdamW(params, lr=W.LR),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=workload.batch_size,
        sample_rate=0.01,
        seed=W.SEED,
    )
    for name in experiments:
        EXPERIMENTS[name](engine)
    instrument(engine, dpopt, timers)

    def dp_step() -> None:
        dpopt.zero_grad()
        with timers("forward"):
            logits = W._logits(model, workload, x)
        with timers("loss"):
            losses = W._per_example_losses(workload, logits, y)
        del logits
        with timers("backward"):
            engine.backward(losses)
        with timers("optimizer step"):
            dpopt.step()

    return dp_step, engine


def run(workload: W.Workload, method: str, warmup: int, steps: int, experiments: list[str]):
    timers = Timers()
    patch_autograd(timers)
    step, engine = build(workload, method, timers, experiments)
    wall: list[float] = []
    peaks: list[float] = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        with timers("step"):
            step()
        wall.append(time.perf_counter() - start)
        timers.end_step()
        if i == 0:  # peak RSS of the first step, then of the later ones
            peaks.append(_vm_hwm_mb())
            with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
                f.write("5")
    peaks.append(_vm_hwm_mb())
    torch.autograd.grad = torch.autograd.grad.__wrapped__
    torch.Tensor.backward = torch.Tensor.backward.__wrapped__
    timed = timers.steps[warmup:]
    paths = sorted({p for s in timers.steps for p in s}, key=_order)
    median = {p: statistics.median(s.get(p, 0.0) for s in timed) for p in paths}
    first = timers.steps[0] if warmup else {}
    return {
        "workload": workload.name,
        "method": method,
        "experiments": experiments,
        "warmup": warmup,
        "steps": steps,
        "wall_s": wall,
        "median_step_s": statistics.median(wall[warmup:]),
        "median": median,
        "first_step": first,
        "calls_per_step": {p: timers.counts[p] / (warmup + steps) for p in paths},
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


def markdown(results: list[dict[str, Any]]) -> str:
    """One table per run: path, median ms per step, share of the step, first step."""
    out = []
    for r in results:
        step = r["median"].get("step", r["median_step_s"])
        exp = f", experiments: {', '.join(r['experiments'])}" if r["experiments"] else ""
        out += [
            f"### {r['method']} on {r['workload']}{exp}",
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
            if ms < 0.5 and first < 0.5:
                continue
            depth = path.count(" > ")
            label = path.rsplit(" > ", 1)[-1]
            out.append(
                f"| {'&nbsp;&nbsp;' * (depth - 1) + ('- ' if depth > 1 else '')}{label} "
                f"| {ms:.1f} | {ms / 1000 / step:.1%} | {first:.1f} |"
            )
        out.append("")
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


def torch_profile(workload: W.Workload, method: str, top: int = 15) -> str:
    """torch.profiler of one step after one warm-up: top operators by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    timers = Timers()
    step, _ = build(workload, method, timers, [])
    step()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
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


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", default="smollm2-full", choices=sorted(W.WORKLOADS))
    p.add_argument("--methods", default="nonprivate,dptrain-bk,dptrain-ghost")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--num-layers", type=int, default=None, help="cut the model (quick checks)")
    p.add_argument("--experiment", action="append", default=[], choices=sorted(EXPERIMENTS))
    p.add_argument("--torch-profiler", action="store_true", help="also the top operators")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args()
    torch.set_num_threads(1)
    for message in W.QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    workload = W.WORKLOADS[a.workload]
    if a.num_layers is not None:
        import dataclasses

        workload = dataclasses.replace(workload, num_layers=a.num_layers)
    methods = a.methods.split(",")
    for method in methods:
        W.preload(workload, method)
    if len(methods) > 1:  # one fresh process per method: the wrappers patch module state
        results = []
        for method in methods:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "r.json")
                cmd = [sys.executable, os.path.abspath(__file__), *_drop_json(sys.argv[1:])]
                cmd += ["--methods", method, "--json", path]
                subprocess.run(cmd, check=True)
                with open(path) as f:
                    results += json.load(f)
    else:
        exps = [] if methods[0] == "nonprivate" else a.experiment
        results = [run(workload, methods[0], a.warmup, a.steps, exps)]
        print(markdown(results), flush=True)
        if a.torch_profiler:
            print(torch_profile(workload, methods[0]), "\n", flush=True)
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
