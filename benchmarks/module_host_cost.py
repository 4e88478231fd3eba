"""Host time the private step adds per streamed module (a CPU proxy, issue 27).

A stack of ``--layers`` ``nn.Linear(d, d)`` layers with a ``tanh`` between them, B 2,
T 32, d 32: the engine instantiates every layer and forms its per-example gradients as
its output gradient arrives (streamed), as it does for every linear layer of a 135M
Llama at T 512 on CUDA (``_harness.cuda_layer_choices``). The kernels take microseconds,
so the time is the host's. Non-private (``loss.backward()``) and book-keeping steps
alternate in one process, one torch thread; medians over ``--steps`` steps, in
microseconds per module for the forward and for the backward.

    python benchmarks/module_host_cost.py
    python benchmarks/module_host_cost.py --amp bf16 --steps 300
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from torch import nn

from _harness import cuda_layer_choices


class Stack(nn.Module):
    def __init__(self, layers: int, d: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per method")
    parser.add_argument("--amp", choices=("off", "bf16"), default="off")
    a = parser.parse_args(argv)
    for name in ("layers", "steps"):
        if getattr(a, name) < 1:
            parser.error(f"--{name} {getattr(a, name)} is not allowed: expected an integer >= 1")
    from dptrain.clipping import ClippingEngine

    torch.set_num_threads(1)
    cuda_layer_choices()
    b, t, d = 2, 32, 32
    torch.manual_seed(0)
    plain, private = Stack(a.layers, d), Stack(a.layers, d)
    engine = ClippingEngine(private, 1.0)
    x = torch.randn(b, t, d)

    def autocast():
        if a.amp == "bf16":
            return torch.autocast("cpu", torch.bfloat16)
        return contextlib.nullcontext()

    def step(model: nn.Module, backward) -> tuple[float, float]:
        for p in model.parameters():
            p.grad = None
        t0 = time.perf_counter()
        with autocast():
            y = model(x)
        t1 = time.perf_counter()
        backward(y.float().pow(2).mean((1, 2)))
        return t1 - t0, time.perf_counter() - t1

    methods = {
        "non-private": lambda: step(plain, lambda losses: losses.mean().backward()),
        "dptrain-bk": lambda: step(private, engine.backward),
    }
    for run in methods.values():  # warm-up; the engine's checks run on the first step
        for _ in range(3):
            run()
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
    for _ in range(a.steps):
        for m, run in methods.items():
            times[m].append(run())
    streamed = len(engine.streamed)
    print(
        f"| {a.layers} x Linear({d}, {d}), B {b}, T {t}, amp {a.amp} | forward us | backward us |"
    )
    print("| --- | ---: | ---: |")
    for m, ts in times.items():
        fwd, bwd = (1e6 * statistics.median(v[i] for v in ts) / a.layers for i in (0, 1))
        print(f"| {m} | {fwd:.1f} | {bwd:.1f} |")
    print(f"\n({streamed} of {a.layers} layers streamed)")


if __name__ == "__main__":
    main()
