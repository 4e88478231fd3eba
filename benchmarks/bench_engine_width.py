"""Book-keeping overhead vs model width: why d = 256 is the hard case (not a test).

    .venv/bin/python benchmarks/bench_engine_width.py [--widths 256,512,768] [--steps 9]
        [--markdown PATH]

The engine's work beyond non-private training is dominated by the ghost
norms of the linear layers: per example and layer, two T x T Gram matrices,
0.75 T^2 (d_in + d_out) multiply-adds with the blocked Gram (rules.py),
against T d_in d_out for each of the three GEMMs non-private training does
(forward, input gradient, weight gradient). Their ratio,

    0.75 T (d_in + d_out) / (3 d_in d_out),

halves when the width doubles. This script measures the step-time ratio of
``dptrain-bk`` to non-private training for the GPT-2-like reference model at
several widths (4 pre-LN blocks, MLP 4 d, 64-dimensional heads, vocab 8000,
untied head, AdamW, B16 T128, one thread) and the share of the private step
spent in the per-example norms, next to the flop ratio above.

Timing as in bench_engine.py: 2 warm-up steps, then the timed steps of the two
methods interleaved round-robin; medians; ratios within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _harness import command_line, git_description, machine_description
from dptrain.bench.timing import fix_threads, time_round_robin
from dptrain.clipping import ClippingEngine
from dptrain.losses import per_example_cross_entropy
from dptrain.models.gpt import GPT, GPTConfig
from dptrain.optim import DPOptimizer

BATCH, SEQ, VOCAB, LAYERS, LR = 16, 128, 8000, 4, 1e-4


def ghost_flop_share(d: int, t: int = SEQ, vocab: int = VOCAB) -> float:
    """Ghost-norm multiply-adds over non-private GEMM multiply-adds (see the module text)."""
    shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * LAYERS + [(d, vocab)]
    ghost = sum(0.75 * t * t * (i + o) for i, o in shapes)
    gemm = sum(3 * t * i * o for i, o in shapes)
    return ghost / gemm


def build(d: int, private: bool):
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            vocab_size=VOCAB,
            max_seq_len=SEQ,
            n_layer=LAYERS,
            n_head=d // 64,
            d_model=d,
            d_mlp=4 * d,
            dropout=0.0,
        )
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if not private:

        def step() -> None:
            opt.zero_grad()
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()

        return step, None
    engine = ClippingEngine(model, 1.0)
    dpopt = DPOptimizer(
        opt,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=BATCH,
        sample_rate=0.01,
        seed=0,
    )
    norm_time = [0.0]
    norms_sq = engine._norms_sq  # timed from outside: the engine has no timers of its own

    def timed_norms(records):
        start = time.perf_counter()
        out = norms_sq(records)
        norm_time[0] += time.perf_counter() - start
        return out

    engine._norms_sq = timed_norms

    def dp_step() -> None:
        dpopt.zero_grad()
        engine.backward(per_example_cross_entropy(model(x), y, reduction="sum"))
        dpopt.step()

    return dp_step, norm_time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default="256,512,768")
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    widths = [int(w) for w in args.widths.split(",")]
    for w in widths:
        if w < 64 or w % 64:
            parser.error(f"--widths has {w}: expected multiples of 64 (64-dimensional heads)")
    fix_threads(1)
    start = time.time()
    rows = []
    for d in widths:
        plain, _ = build(d, private=False)
        private, norm_time = build(d, private=True)
        times = time_round_robin({"nonprivate": plain, "dptrain-bk": private}, warmup=2, timed=0)
        norm_time[0] = 0.0
        times = time_round_robin(
            {"nonprivate": plain, "dptrain-bk": private}, warmup=0, timed=args.steps
        )
        np_s = statistics.median(times.times["nonprivate"])
        bk_s = statistics.median(times.times["dptrain-bk"])
        row = {
            "d": d,
            "nonprivate_s": np_s,
            "bk_s": bk_s,
            "ratio": bk_s / np_s,
            "norm_share": norm_time[0] / args.steps / np_s,
            "flop_share": ghost_flop_share(d),
        }
        rows.append(row)
        print(
            f"d={d}: non-private {np_s:.3f} s, dptrain-bk {bk_s:.3f} s, ratio {row['ratio']:.3f}x, "
            f"norms {row['norm_share']:.1%} of the non-private step "
            f"(ghost flops / non-private GEMM flops {row['flop_share']:.1%})",
            flush=True,
        )
    lines = [
        f"- Command: `{command_line()}`",
        f"- Machine: {machine_description()}; sources: {git_description()}",
        f"- {args.steps} timed steps per method after 2 warm-up steps, one thread, "
        f"{(time.time() - start) / 60:.1f} min",
        "",
        "| d_model | non-private (s) | dptrain-bk (s) | time ratio | per-example norms "
        "(share of the non-private step) | ghost-norm flops / non-private GEMM flops |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['d']} | {r['nonprivate_s']:.3f} | {r['bk_s']:.3f} | {r['ratio']:.2f}x | "
            f"{r['norm_share']:.1%} | {r['flop_share']:.1%} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
