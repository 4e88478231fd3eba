"""Host time of a private step where the arithmetic is negligible (a CPU proxy, issue 27).

On a GPU the host issues the kernels: a step whose host work (Python, dispatch) takes
longer than the kernels waits for the host ("launch-bound"). This script measures that
host work on a CPU, where it can be isolated: a tied Llama at SmolLM2-135M's depth
(30 layers) but hidden 32, vocab 128, B 2, T 32, so that the kernels take microseconds and
the step's wall time is the host's. Non-private (mean loss, ``loss.backward()``, AdamW)
and dptrain's book-keeping step (per-example losses, ``ClippingEngine.backward``,
``DPOptimizer`` with noise) alternate in one process, one torch thread, after 3 warm-up
steps each (the engine's checks run on the first); medians of the timed steps.

Linear layers are ghost-normed or instantiated as on CUDA (``--as-on cuda``, the default:
``_harness.cuda_layer_choices``, as ``launch_count.py`` makes them), since the GPU step is
the one this proxies. At T 32 the choices are the real workload's (a 135M Llama at T 512):
every linear layer but the tied head instantiates and streams. At T 16 (``--tokens 16``,
the proxy's size before 2026-11-28, for comparing with figures taken then) the MLP's 90
layers were ghost-normed instead, a path the GPU workload does not take.

**Comparing two versions of the engine.** This machine's speed drifts by up to 2x within
minutes (other tenants), so timings taken in separate runs do not compare. ``--against
REV`` adds the private step of git revision REV, its ``src/dptrain`` copied under another
package name (``dptrain_at_REV``), to the same round-robin: each timed round runs the
non-private step, REV's and this checkout's, so drift touches all three alike.

    python benchmarks/host_overhead.py                 # full and LoRA r4, bf16 autocast
    python benchmarks/host_overhead.py --amp off --steps 30
    python benchmarks/host_overhead.py --workload full --steps 40 --against HEAD~3

Where the private step's host time goes: ``py-spy record -f raw`` on
``--only dptrain-bk`` (py-spy is not a dependency; ``pip install py-spy``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import time

import torch
import torch.nn.functional as F

from _harness import cuda_layer_choices, package_at

LAYERS, HIDDEN, VOCAB, B = 30, 32, 128, 2
T = 32  # default of --tokens


def _model(lora: bool) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * HIDDEN,
        vocab_size=VOCAB,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config)
    if lora:
        from peft import LoraConfig, get_peft_model

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=4, target_modules=targets))
    return model


def _step(method: str, lora: bool, amp: bool, package: str = "dptrain", tokens: int = T):
    """One training step of ``method`` ("nonprivate" or "dptrain-bk") as three closures:
    forward (-> the loss or per-example losses), backward (loss) and the optimizer step.
    ``package``: the dptrain to import (``_harness.package_at``: another revision's); ``tokens``
    per example."""
    ClippingEngine = importlib.import_module(f"{package}.clipping").ClippingEngine
    DPOptimizer = importlib.import_module(f"{package}.optim").DPOptimizer

    model = _model(lora)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, tokens + 1), generator=gen)
    x, y = ids[:, :-1], ids[:, 1:]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)  # CUDA's default

    def autocast():
        return torch.autocast("cpu", torch.bfloat16) if amp else contextlib.nullcontext()

    def logits():
        return model(input_ids=x).logits.float()

    if method == "nonprivate":

        def forward() -> torch.Tensor:
            opt.zero_grad()
            with autocast():
                return F.cross_entropy(logits().flatten(0, 1), y.flatten())

        return forward, lambda loss: loss.backward(), opt.step
    engine = ClippingEngine(model, 1.0)
    dpopt = DPOptimizer(
        opt,
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=B,
        sample_rate=0.01,
        seed=0,
    )

    def dp_forward() -> torch.Tensor:
        dpopt.zero_grad()
        with autocast():
            return F.cross_entropy(logits().transpose(1, 2), y, reduction="none").mean(1)

    return dp_forward, engine.backward, dpopt.step


PHASES = ("step", "forward", "backward", "optimizer")


def measure(
    lora: bool, amp: bool, steps: int, methods: dict[str, tuple[str, str]], tokens: int = T
) -> dict[str, dict[str, float]]:
    """Median milliseconds per step of each method and phase (``PHASES``), the methods run
    round-robin in this process, ``tokens`` per example. ``methods``: {label: (method,
    package)}."""
    built = {label: _step(m, lora, amp, package, tokens) for label, (m, package) in methods.items()}
    for forward, backward, optimizer in built.values():
        for _ in range(3):
            backward(forward())
            optimizer()
    times = {m: {k: [] for k in PHASES} for m in methods}
    for _ in range(steps):
        for m, (forward, backward, optimizer) in built.items():
            t0 = time.perf_counter()
            loss = forward()
            t1 = time.perf_counter()
            backward(loss)
            t2 = time.perf_counter()
            optimizer()
            t3 = time.perf_counter()
            for k, v in zip(PHASES, (t3 - t0, t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[m][k].append(v)
    return {m: {k: 1e3 * statistics.median(v) for k, v in ts.items()} for m, ts in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--amp", choices=("bf16", "off"), default="bf16")
    parser.add_argument("--steps", type=int, default=15, help="timed steps per method")
    parser.add_argument(
        "--only", choices=("nonprivate", "dptrain-bk"), help="one method (for a profiler)"
    )
    parser.add_argument("--workload", choices=("both", "full", "lora"), default="both")
    parser.add_argument("--tokens", type=int, default=T, help=f"tokens per example (default {T})")
    parser.add_argument(
        "--as-on",
        choices=("cuda", "cpu"),
        default="cuda",
        help="whose choice of ghost norm or instantiation per layer (default: CUDA's)",
    )
    parser.add_argument(
        "--against", metavar="REV", help="also time git revision REV's engine, in the same rounds"
    )
    a = parser.parse_args(argv)
    if a.steps < 1:
        parser.error(f"--steps {a.steps} is not allowed: expected an integer >= 1")
    if a.tokens < 1:
        parser.error(f"--tokens {a.tokens} is not allowed: expected an integer >= 1")
    torch.set_num_threads(1)
    methods = {"nonprivate": ("nonprivate", "dptrain"), "dptrain-bk": ("dptrain-bk", "dptrain")}
    if a.only:
        methods = {a.only: methods[a.only]}
    packages = ["dptrain"]
    if a.against:
        packages.append(package_at(a.against))
        methods[f"dptrain-bk at {a.against}"] = ("dptrain-bk", packages[-1])
    if a.as_on == "cuda":
        for package in packages:
            cuda_layer_choices(package)
    labels = [m for m in methods if m != "nonprivate"]
    header = ["phase", "non-private ms", *(c for m in labels for c in (f"{m} ms", "ratio"))]
    print(
        f"| workload ({LAYERS} layers, hidden {HIDDEN}, B {B}, T {a.tokens}, amp {a.amp}, "
        f"layers as on {a.as_on}) | {' | '.join(header)} |\n"
        f"| --- | --- |{' ---: |' * (len(header) - 1)}"
    )
    for lora in (False, True) if a.workload == "both" else (a.workload == "lora",):
        ms = measure(lora, a.amp == "bf16", a.steps, methods, a.tokens)
        for phase in PHASES:
            base = ms.get("nonprivate", {}).get(phase)
            cells = [f"{base:.1f}" if base else "-"]
            for m in labels:
                ratio = f"{ms[m][phase] / base:.2f}x" if base else "-"
                cells += [f"{ms[m][phase]:.1f}", ratio]
            name = "LoRA r4" if lora else "full"
            print(f"| {name} | {phase} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
