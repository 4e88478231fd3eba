"""DP training on 1 vs 2 processes (CPU, gloo), and DP's overhead over non-private DDP (not a test).

    .venv/bin/python benchmarks/bench_distributed.py [--quick] [--nprocs 1,2] [--batch B]
        [--seq-len T] [--steps N] [--warmup N] [--threads-per-proc N] [--json PATH]
        [--markdown PATH]

Model: the GPT-2-like reference model of the engine, ``GPT(GPTConfig(vocab_size=8000,
max_seq_len=512, n_layer=4, n_head=4, d_model=256, d_mlp=1024, dropout=0.0))``
(``--quick``: vocab 100, 1 layer, d_model 32, d_mlp 64), next-token
cross-entropy on random token ids, a dataset of N = 64 B sequences of T tokens
(default B = 32, T = 128; quick B = 8, T = 16), AdamW(lr=1e-4).

Methods, for each process count W (``--nprocs``, default 1,2), all W processes
started by :func:`dptrain.distributed.spawn` (gloo):

- ``ddp``: non-private data parallelism: ``torch.nn.parallel.DistributedDataParallel``
  around the model, every rank a fixed batch of B / W sequences, mean
  cross-entropy, ``loss.backward()`` (DDP all-reduces and averages), ``opt.step()``;
- ``dp``: :func:`dptrain.distributed.make_private_distributed` (book-keeping
  clipping, C = 1, sigma = 1): each step draws a Poisson logical batch of mean
  B over the whole dataset, every rank clips its share (one physical chunk of
  up to 2 B / W sequences), then :class:`~dptrain.distributed.DistributedDPOptimizer`
  all-reduces the clipped sums with rank 0's noise and steps. The step time
  includes drawing and collating the batch. The logical batches are the same
  for every W (same seed), so the W = 1 and W = 2 runs do the same work.

Timing: torch threads per process = ``--threads-per-proc`` (default: CPU cores
/ W, so every W uses the whole machine); in each W, both methods are built in
the same processes, get ``--warmup`` steps (default 2; quick 1) and then
``--steps`` timed steps (default 8; quick 3), interleaved (one step of each
method per round, the first method alternating) so that drift hits both
alike. Rank 0's wall time per step is recorded (every step ends in an
all-reduce, so the ranks move together). Reported: the median step time,
speedup = median(W = 1) / median(W) for the same method, and dp_overhead =
median(dp) / median(ddp) at the same W. DP batch sizes are random (Binomial,
mean B): medians over few steps carry that noise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from _harness import command_line, git_description, machine_description

METHODS = ("ddp", "dp")
SEED = 0

FULL_MODEL = dict(vocab_size=8000, max_seq_len=512, n_layer=4, n_head=4, d_model=256, d_mlp=1024)
QUICK_MODEL = dict(vocab_size=100, max_seq_len=64, n_layer=1, n_head=2, d_model=32, d_mlp=64)


def _worker(cfg: dict) -> dict:
    """One process of a W-process run: both methods, interleaved; rank 0's step times."""
    from torch.nn.parallel import DistributedDataParallel

    from dptrain.distributed import make_private_distributed
    from dptrain.losses import per_example_cross_entropy
    from dptrain.models import GPT, GPTConfig

    rank, world = dist.get_rank(), dist.get_world_size()
    b, t, steps = cfg["batch"], cfg["seq_len"], cfg["warmup"] + cfg["steps"]
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(0, cfg["model"]["vocab_size"], (64 * b, t + 1), generator=gen)
    data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])

    def model() -> torch.nn.Module:
        torch.manual_seed(SEED)
        return GPT(GPTConfig(**cfg["model"], dropout=0.0))

    # non-private DDP: a fixed batch of B / W sequences on every rank
    ddp_model = DistributedDataParallel(model())
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=1e-4)
    share = max(1, b // world)
    x_fixed, y_fixed = (
        ids[rank * share : (rank + 1) * share, :-1],
        ids[rank * share : (rank + 1) * share, 1:],
    )

    def ddp_step() -> None:
        ddp_opt.zero_grad()
        logits = ddp_model(x_fixed)
        F.cross_entropy(logits.flatten(0, 1), y_fixed.flatten()).backward()
        ddp_opt.step()

    dp_model = model()
    private = make_private_distributed(
        dp_model,
        torch.optim.AdamW(dp_model.parameters(), lr=1e-4),
        data,
        batch_size=b,
        max_grad_norm=1.0,
        steps=steps,
        noise_multiplier=1.0,
        max_physical_batch_size=max(1, 2 * b // world),
        seed=SEED,
    )
    batches = iter(private.data_loader)
    sizes: list[int] = []

    def dp_step() -> None:
        batch = next(batches)
        sizes.append(batch.global_size)
        private.optimizer.zero_grad()
        for x, y in batch.chunks:
            private.backward(per_example_cross_entropy(dp_model(x), y))
        private.optimizer.step()

    step_fns = {"ddp": ddp_step, "dp": dp_step}
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for i in range(steps):
        order = METHODS if i % 2 == 0 else METHODS[::-1]
        for m in order:
            dist.barrier()
            start = time.perf_counter()
            step_fns[m]()
            elapsed = time.perf_counter() - start
            if i >= cfg["warmup"]:
                times[m].append(elapsed)
    n_params = sum(p.numel() for p in dp_model.parameters())
    return {"times": times, "dp_batch_sizes": sizes[cfg["warmup"] :], "n_params": n_params}


def run(args: argparse.Namespace) -> dict:
    from dptrain.distributed import spawn

    cfg = {
        "model": QUICK_MODEL if args.quick else FULL_MODEL,
        "batch": args.batch or (8 if args.quick else 32),
        "seq_len": args.seq_len or (16 if args.quick else 128),
        "steps": args.steps or (3 if args.quick else 8),
        "warmup": args.warmup if args.warmup is not None else (1 if args.quick else 2),
    }
    cores = os.cpu_count() or 1
    records = []
    for w in args.nprocs:
        threads = args.threads_per_proc or max(1, cores // w)
        start = time.perf_counter()
        out = spawn(_worker, w, args=(cfg,), num_threads=threads, timeout=600)[0]
        wall = time.perf_counter() - start
        for m in METHODS:
            ts = out["times"][m]
            records.append(
                {
                    "method": m,
                    "nprocs": w,
                    "threads_per_proc": threads,
                    "median_step_s": statistics.median(ts),
                    "min_step_s": min(ts),
                    "max_step_s": max(ts),
                    "timed_steps": len(ts),
                    "mean_dp_batch": statistics.mean(out["dp_batch_sizes"]) if m == "dp" else None,
                    "n_params": out["n_params"],
                    "run_wall_s": wall,
                }
            )
    by = {(r["method"], r["nprocs"]): r for r in records}
    for r in records:
        one = by.get((r["method"], 1))
        r["speedup"] = one["median_step_s"] / r["median_step_s"] if one else None
        ddp = by[("ddp", r["nprocs"])]
        r["dp_overhead"] = (
            r["median_step_s"] / ddp["median_step_s"] if r["method"] == "dp" else None
        )
    return {
        "when": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "code": git_description(),
        "command": command_line(),
        "torch": torch.__version__,
        "config": cfg,
        "records": records,
    }


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = [
        "# DP on torch.distributed (gloo, CPU): 1 vs N processes, DP vs non-private DDP",
        "",
        f"- Machine: {result['machine']}; {result['code']}; torch {result['torch']}",
        f"- Command: `{result['command']}`",
        f"- Model: GPT({cfg['model']}), T = {cfg['seq_len']}, B = {cfg['batch']} (DP: "
        f"Poisson, mean B); {cfg['warmup']} warm-up + {cfg['steps']} timed steps, interleaved",
        "",
        "| method | processes | threads/proc | median step (s) | min-max (s) | speedup vs 1 proc "
        "| DP / DDP |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["records"]:
        speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        over = f"{r['dp_overhead']:.2f}x" if r["dp_overhead"] else "-"
        lines.append(
            f"| {r['method']} | {r['nprocs']} | {r['threads_per_proc']} | "
            f"{r['median_step_s']:.4f} | {r['min_step_s']:.4f}-{r['max_step_s']:.4f} | "
            f"{speed} | {over} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny model and batch (seconds)")
    parser.add_argument(
        "--nprocs",
        type=lambda s: [int(v) for v in s.split(",")],
        default=[1, 2],
        help="process counts, comma-separated (default 1,2)",
    )
    parser.add_argument("--batch", type=int, default=None, help="logical batch B (default 32)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens T (default 128)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 8)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 2)")
    parser.add_argument("--threads-per-proc", type=int, default=None)
    parser.add_argument("--json", metavar="PATH", help="write the result (JSON) here")
    parser.add_argument("--markdown", metavar="PATH", help="write the report (markdown) here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    report = markdown(result)
    print(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(report)


if __name__ == "__main__":
    sys.exit(main())
