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
    python benchmarks/module_host_cost.py --against 690cf09   # that revision's engine too
    python benchmarks/module_host_cost.py --floor   # and the least a hook-based step does

``--against REV`` adds the private step of git revision REV (its ``src/dptrain`` copied
under another name, ``_harness.package_at``) to the same alternation, so that the
machine's drift touches both versions alike.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import time

import torch
from torch import nn

from _harness import cuda_layer_choices, package_at


class Stack(nn.Module):
    def __init__(self, layers: int, d: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, T, d)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _Tap(torch.autograd.Function):
    """Identity on x that leads to a leaf (the anchor), so that requesting the anchor's
    gradient runs every layer's node (as the engine's streaming.Tap)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _as_computed(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the dtype the layer computed with it: autocast's copy (as the engine's
    records.AutocastCopies keeps), else ``x``."""
    kind = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(kind):
        return x.detach().to(torch.get_autocast_dtype(kind))
    return x.detach()


class HookFloor:
    """The least a private step built on hooks does (``--floor``): a forward hook per
    layer keeps its input and output node; a pre-hook per node forms the layer's
    per-example gradients into its slot of one buffer as the output gradient arrives; one
    reduction gives the norms, one product the clipped sums. No graph walk, no checks,
    no layout, no rule dispatch: what the engine's per-module Python adds beyond this is
    its generality and its checks. Not private for any other model, and not a method."""

    def __init__(self, model: Stack):
        self.model, self.records = model, []
        self.anchor = torch.zeros((), requires_grad=True)
        for layer in model.layers:
            layer.register_forward_hook(
                lambda m, args, out: self.records.append((_as_computed(args[0]), out.grad_fn))
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.records.clear()
        return self.model(_Tap.apply(x, self.anchor))

    def backward(self, losses: torch.Tensor) -> None:
        b, layers = losses.shape[0], len(self.records)
        d = self.model.layers[0].in_features
        # in the records' dtype (bf16 under autocast, as the engine's bf16 slots)
        buffer = self.records[0][0].new_empty(b, layers * d * d)
        slots = buffer.view(b, layers, d, d).unbind(1)

        def former(a, slot):
            def hook(grads):
                torch.bmm(grads[0].transpose(1, 2), a, out=slot)

            return hook

        handles = [
            node.register_prehook(former(a, slot))
            for (a, node), slot in zip(self.records, slots, strict=True)
        ]
        torch.autograd.grad(losses.sum(), [self.anchor], allow_unused=True)  # it gets none
        for h in handles:
            h.remove()
        low = buffer.dtype in (torch.bfloat16, torch.float16)
        norms = torch.linalg.vector_norm(buffer, dim=1, dtype=torch.float32 if low else None)
        factors = (1.0 / norms).clamp(max=1.0).to(buffer.dtype)
        sums = torch.mv(buffer.T, factors).split(d * d)
        for layer, s in zip(self.model.layers, sums, strict=True):
            layer.weight.grad = s.view(d, d).to(layer.weight.dtype)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per method")
    parser.add_argument("--amp", choices=("off", "bf16"), default="off")
    parser.add_argument(
        "--against", metavar="REV", help="also time git revision REV's engine, in the same rounds"
    )
    parser.add_argument(
        "--floor", action="store_true", help="also time the least a hook-based step does"
    )
    a = parser.parse_args(argv)
    for name in ("layers", "steps"):
        if getattr(a, name) < 1:
            parser.error(f"--{name} {getattr(a, name)} is not allowed: expected an integer >= 1")
    packages = {"dptrain-bk": "dptrain"}
    if a.against:
        packages[f"dptrain-bk at {a.against}"] = package_at(a.against)
    torch.set_num_threads(1)
    b, t, d = 2, 32, 32
    torch.manual_seed(0)
    plain = Stack(a.layers, d)
    engines = {}
    for label, package in packages.items():
        cuda_layer_choices(package)
        private = Stack(a.layers, d)
        private.load_state_dict(plain.state_dict())
        engine_class = importlib.import_module(f"{package}.clipping").ClippingEngine
        engines[label] = (private, engine_class(private, 1.0))
    x = torch.randn(b, t, d)

    def autocast():
        if a.amp == "bf16":
            return torch.autocast("cpu", torch.bfloat16)
        return contextlib.nullcontext()

    def step(model: nn.Module, backward, forward=None) -> tuple[float, float]:
        for p in model.parameters():
            p.grad = None
        t0 = time.perf_counter()
        with autocast():
            y = (forward or model)(x)
        t1 = time.perf_counter()
        backward(y.float().pow(2).mean((1, 2)))
        return t1 - t0, time.perf_counter() - t1

    methods = {"non-private": lambda: step(plain, lambda losses: losses.mean().backward())}
    for label, (private, engine) in engines.items():
        methods[label] = lambda private=private, engine=engine: step(private, engine.backward)
    if a.floor:
        floor = HookFloor(Stack(a.layers, d))
        methods["hook floor"] = lambda: step(floor.model, floor.backward, floor.forward)
    for run in methods.values():  # warm-up; the engine's checks run on the first step
        for _ in range(3):
            run()
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in methods}
    for _ in range(a.steps):
        for m, run in methods.items():
            times[m].append(run())
    streamed = len(engines["dptrain-bk"][1].streamed)
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
