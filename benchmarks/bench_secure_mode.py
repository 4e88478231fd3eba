"""What ``secure_mode=True`` costs (not a test).

    .venv/bin/python benchmarks/bench_secure_mode.py [--repeats 5] [--threads 1]

1. Noise alone: median wall time of N(0, 1) noise for n coordinates from torch's
   generator and from :func:`dptrain.secure_random.secure_normal` (os.urandom).
2. A whole private step (make_private on the reference GPT, batch 64, one chunk):
   median step time with and without ``secure_mode`` (noise and Poisson sampling
   from os.urandom).

Prints markdown tables (docs/migrating_from_opacus.md quotes them).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from dptrain.losses import per_example_cross_entropy
from dptrain.models import GPT, GPTConfig
from dptrain.privacy_engine import make_private
from dptrain.secure_random import secure_normal


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def noise_table(repeats: int) -> None:
    print(
        "| coordinates | torch.normal_ (s) | secure_normal (s) | ratio | secure ns / coordinate |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for n in (100_000, 1_000_000, 4_000_000):
        plain = _median_time(lambda n=n: torch.empty(n).normal_(0.0, 1.0), repeats)
        secure = _median_time(lambda n=n: secure_normal((n,), 1.0), repeats)
        print(
            f"| {n:,} | {plain:.4f} | {secure:.4f} | {secure / plain:.0f}x | {secure / n * 1e9:.0f} |"
        )


def step_table(repeats: int) -> None:
    print("\n| model | parameters | step, torch noise (s) | step, secure_mode (s) | overhead |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for d_model, n_layer in ((64, 2), (256, 4)):
        row = {}
        for secure in (False, True):
            torch.manual_seed(0)
            cfg = GPTConfig(
                vocab_size=1000,
                max_seq_len=32,
                n_layer=n_layer,
                n_head=4,
                d_model=d_model,
                d_mlp=4 * d_model,
            )
            model = GPT(cfg)
            ids = torch.randint(0, 1000, (640, 33))
            data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            private = make_private(
                model,
                opt,
                data,
                batch_size=64,
                max_grad_norm=1.0,
                steps=repeats + 1,
                noise_multiplier=1.0,
                secure_mode=secure,
            )
            times = []
            for batch in private.data_loader:  # sampling counted too (secure in secure_mode)
                t = time.perf_counter()
                private.optimizer.zero_grad()
                for x, y in batch.chunks:
                    private.backward(per_example_cross_entropy(model(x), y))
                private.optimizer.step()
                times.append(time.perf_counter() - t)
            row[secure] = statistics.median(times[1:])  # the first step warms up
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"| GPT d={d_model} L={n_layer} | {n_params:,} | {row[False]:.3f} | "
            f"{row[True]:.3f} | {row[True] / row[False]:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads\n"
    )
    noise_table(args.repeats)
    step_table(args.repeats)


if __name__ == "__main__":
    main()
