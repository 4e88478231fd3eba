"""Cost of Re-Attention: step time and peak memory, vanilla vs Re-Attention (not a test).

    .venv/bin/python benchmarks/bench_reattention.py [--quick] [--steps N]
        [--json PATH] [--markdown PATH] [--no-memory]

Model: ``SeqRecTransformer(SeqRecConfig(n_items=1682, max_len=50, d_model=64,
n_head=1, n_layer=2))`` (defaults otherwise: tied embeddings, dropout 0.2,
pre-LN), with ``re_attention`` False ("vanilla") or True ("re-attention"), the
same initial weights for both. Batch: B = 128 left-padded sequences of L = 50
items (next-item targets, padding ignored), drawn once (fixed seed) from a
Zipf-like catalogue; the item frequencies given to ``set_effective_errors``
(sigma = 1, B = 128) are the shares of 943 synthetic users' sequences that
contain each item (the MovieLens-100K sizes).

One training step: forward, ``per_example_cross_entropy(..., ignore_index=0)``,
``ClippingEngine(model, 1.0, clipping="automatic", mode="book_keeping")
.backward`` and ``DPOptimizer(AdamW(lr=1e-3)).step()`` (noise added).

Timing: ``torch.set_num_threads(1)``; 2 warm-up steps per configuration, then
the timed steps interleaved (one step of each configuration per round, the
first one alternating), so that drift hits both alike. Reported: median and
interquartile range; overhead = median(re-attention) / median(vanilla) - 1.

Memory: each configuration in a fresh process (this script with the hidden
``--measure-memory CONFIG`` flag, started through a small launcher without
torch so that it does not inherit this process's peak): ``ru_maxrss`` after
building everything (baseline) and after 3 steps (peak).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from _harness import run_fresh

N_ITEMS = 1682
N_USERS = 943
BATCH = 128
SEQ_LEN = 50
SIGMA = 1.0
LR = 1e-3
SEED = 0
WARMUP_STEPS = 2
MEMORY_STEPS = 3
CONFIGS = ("vanilla", "re-attention")


@dataclass
class Record:
    config: str
    step_time_s: float | None = None
    step_time_q1_s: float | None = None
    step_time_q3_s: float | None = None
    timed_steps: int = 0
    overhead: float | None = None
    baseline_mb: float | None = None
    peak_mb: float | None = None
    peak_increment_mb: float | None = None
    error: str | None = None


def synthetic_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x, y) of shape (BATCH, SEQ_LEN) and item frequencies (N_ITEMS + 1,)."""
    g = torch.Generator().manual_seed(SEED)
    popularity = 1.0 / torch.arange(1, N_ITEMS + 1, dtype=torch.float64) ** 0.9  # Zipf-like
    users = torch.multinomial(popularity.expand(N_USERS, -1), SEQ_LEN + 1, generator=g) + 1
    lengths = torch.randint(5, SEQ_LEN + 2, (N_USERS,), generator=g)
    keep = torch.arange(SEQ_LEN + 1).expand(N_USERS, -1) >= (SEQ_LEN + 1 - lengths)[:, None]
    users = users * keep  # left padding with 0
    contains = torch.zeros(N_USERS, N_ITEMS + 1)
    contains.scatter_(1, users, 1.0)
    freqs = contains.mean(0)
    freqs[0] = 0.0
    seqs = users[:BATCH]
    return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous(), freqs


def build_step(config: str) -> Callable[[], None]:
    """Model, engine and optimizer for one configuration; returns one training step."""
    from dptrain.clipping import ClippingEngine
    from dptrain.losses import per_example_cross_entropy
    from dptrain.models.seqrec_transformer import SeqRecConfig, SeqRecTransformer
    from dptrain.optim import DPOptimizer

    if config not in CONFIGS:
        raise ValueError(f"config={config!r} is not allowed: expected one of {list(CONFIGS)}")
    x, y, freqs = synthetic_data()
    torch.manual_seed(SEED)  # the same initial weights for both configurations
    cfg = SeqRecConfig(
        n_items=N_ITEMS, max_len=SEQ_LEN, d_model=64, n_head=1, n_layer=2,
        re_attention=config == "re-attention",
    )  # fmt: skip
    model = SeqRecTransformer(cfg).train()
    model.set_effective_errors(SIGMA, BATCH, freqs)
    engine = ClippingEngine(model, 1.0, clipping="automatic", mode="book_keeping")
    dpopt = DPOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR),
        noise_multiplier=SIGMA,
        max_grad_norm=1.0,
        expected_batch_size=BATCH,
        sample_rate=BATCH / N_USERS,
        seed=SEED,
    )

    def step() -> None:
        dpopt.zero_grad()
        losses = per_example_cross_entropy(model(x), y, ignore_index=0)
        engine.backward(losses)
        dpopt.step()

    return step


def time_configs(configs: tuple[str, ...], timed_steps: int) -> dict[str, Record]:
    records = {c: Record(c) for c in configs}
    steps = {c: build_step(c) for c in configs}
    times: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(WARMUP_STEPS + timed_steps):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for c in order:
            start = time.perf_counter()
            steps[c]()
            elapsed = time.perf_counter() - start
            if r >= WARMUP_STEPS:
                times[c].append(elapsed)
        print(f"  round {r + 1}/{WARMUP_STEPS + timed_steps}", file=sys.stderr, end="\r")
    print(file=sys.stderr)
    for c, ts in times.items():
        rec = records[c]
        rec.step_time_s = statistics.median(ts)
        q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive")
        rec.step_time_q1_s, rec.step_time_q3_s, rec.timed_steps = q1, q3, len(ts)
    base = records.get("vanilla")
    for rec in records.values():
        if base is not None and base.step_time_s and rec.step_time_s is not None:
            rec.overhead = rec.step_time_s / base.step_time_s - 1
    return records


def measure_memory_child(config: str) -> None:
    """Hidden mode: build, run MEMORY_STEPS steps, print the RSS figures as JSON."""
    torch.set_num_threads(1)
    out: dict = {"config": config}
    try:
        step = build_step(config)
        out["baseline_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for _ in range(MEMORY_STEPS):
            step()
        out["maxrss_kib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    except Exception as exc:
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    print(json.dumps(out))


def measure_memory(config: str) -> dict:
    return run_fresh(__file__, "--measure-memory", config, what="memory")


def environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "workload": {
            "n_items": N_ITEMS,
            "batch": BATCH,
            "seq_len": SEQ_LEN,
            "d_model": 64,
            "n_head": 1,
            "n_layer": 2,
            "noise_multiplier": SIGMA,
        },
    }


def markdown(records: dict[str, Record], env: dict) -> str:
    def ms(v: float | None) -> str:
        return "" if v is None else f"{v * 1e3:.1f}"

    def mb(v: float | None) -> str:
        return "" if v is None else f"{v:.0f}"

    lines = [
        f"Re-Attention cost: SeqRecTransformer d=64, 1 head, 2 blocks, n_items={N_ITEMS}, "
        f"B={BATCH}, L={SEQ_LEN}; book-keeping + automatic clipping + DP AdamW; "
        f"torch {env['torch']}, {env['processor']}, 1 thread, {env['date']}.",
        "",
        "| config | step median (ms) | IQR (ms) | steps | overhead | baseline RSS (MB) "
        "| peak RSS (MB) | peak - baseline (MB) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for rec in records.values():
        iqr = (
            f"{ms(rec.step_time_q1_s)} - {ms(rec.step_time_q3_s)}"
            if rec.step_time_q1_s is not None
            else ""
        )
        overhead = "" if rec.overhead is None else f"{rec.overhead:+.1%}"
        lines.append(
            f"| {rec.config} | {ms(rec.step_time_s)} | {iqr} | {rec.timed_steps} | {overhead} "
            f"| {mb(rec.baseline_mb)} | {mb(rec.peak_mb)} | {mb(rec.peak_increment_mb)} |"
        )
    errors = [f"- {r.config}: {r.error}" for r in records.values() if r.error]
    return "\n".join(lines + (["", *errors] if errors else [])) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15, help="timed steps per config (>= 9)")
    parser.add_argument("--quick", action="store_true", help="9 timed steps")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory processes")
    parser.add_argument("--json", metavar="PATH", help="write the records as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="write a markdown table")
    parser.add_argument("--measure-memory", metavar="CONFIG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_memory:
        measure_memory_child(args.measure_memory)
        return 0
    steps = 9 if args.quick else args.steps
    if steps < 9:
        parser.error(f"--steps={steps} is not allowed: expected at least 9")
    torch.set_num_threads(1)
    env = environment()
    records = time_configs(CONFIGS, steps)
    if not args.no_memory:
        for rec in records.values():
            res = measure_memory(rec.config)
            if "maxrss_kib" in res:
                rec.baseline_mb = res["baseline_kib"] / 1024
                rec.peak_mb = res["maxrss_kib"] / 1024
                rec.peak_increment_mb = rec.peak_mb - rec.baseline_mb
            else:
                rec.error = res.get("error", "memory measurement failed")
    table = markdown(records, env)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"environment": env, "records": [asdict(r) for r in records.values()]}, f, indent=2
            )
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
