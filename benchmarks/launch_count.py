"""Kernel launches per steady step, counted on a CPU as a CUDA device would launch them: a
proxy of the GPU step time where the step is launch-bound (issue 27).

On an H200 the private step of ``llama135m-full-bf16`` (B 16, T 512) took 2.26x the
non-private step while its GPU time was 1.54x: the host issued 9,022 kernels against
3,989 and the GPU waited for them (docs/engine_benchmark.md, "The GPU session"). The
launch count does not depend on B (it does on T, through the per-layer choice of ghost
norm or instantiation), so a CPU counts it at B 1 in seconds:

- every aten operator that is not a view or an allocation is one launch (a ``_foreach_``
  operator counts once: CUDA's multi-tensor apply launches a few kernels for all of them);
- the products of bf16 records are float32-output GEMMs on CUDA, with no upcast, and a
  clipped sum there is split into two GEMMs (``tensor_cores.ops_emulated`` corrects for
  both);
- AdamW runs with ``foreach=True``, as it does by default on CUDA (not on a CPU);
- ghost norms form whole Gram matrices, as on CUDA (``rules.HALF_GRAM_DEVICES``), and
  streamed per-example gradients are formed in their slots (``streaming.SLOT_DEVICES``),
  and linear layers are ghost-normed or instantiated as on CUDA (``rules.SIZE_RULE_DEVICES``);
- the step is the bench's (``dptrain.bench.workloads.build_step``): forward, loss,
  backward with clipping, noise, AdamW; the third step is counted (the first runs the
  engine's checks).

    PYTHONPATH=src:. python benchmarks/launch_count.py                 # llama135m-full-bf16, B 1, T 512
    PYTHONPATH=src:. python benchmarks/launch_count.py --workloads llama135m-full-bf16,llama135m-lora-autocast --by-kind 12
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import subprocess
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from _harness import cuda_layer_choices

# Operators that launch no kernel: views, allocations, metadata.
NO_LAUNCH = {
    "view", "_unsafe_view", "reshape", "expand", "transpose", "t", "permute", "as_strided",
    "unsqueeze", "squeeze", "slice", "select", "detach", "alias", "split", "split_with_sizes",
    "unbind", "chunk", "narrow", "_reshape_alias", "unflatten", "flatten", "lift_fresh",
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "diagonal",
    "movedim", "contiguous", "_local_scalar_dense", "is_same_size", "set_", "resize_",
}  # fmt: skip


class _Launches(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.kinds: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_LAUNCH:
            self.kinds[name] += 1
        return func(*args, **(kwargs or {}))


def _child(workload: str, method: str, b: int, t: int) -> None:
    torch.optim.AdamW.__init__ = functools.partialmethod(torch.optim.AdamW.__init__, foreach=True)
    from dptrain.bench.workloads import WORKLOADS, build_step
    from dptrain.clipping.tensor_cores import flops_emulated, ops_emulated

    cuda_layer_choices()

    torch.set_num_threads(2)
    w = dataclasses.replace(WORKLOADS[workload], batch_size=b, seq_len=t)
    step = build_step(w, method).step
    step()
    step()
    counter = _Launches()
    flops_emulated(reset=True, on=True)
    try:
        with counter:
            step()
        delta = ops_emulated()
    finally:
        flops_emulated(reset=True, on=False)
    print(json.dumps({"kinds": dict(counter.kinds), "delta": delta}))


def count(workload: str, method: str, b: int, t: int) -> tuple[int, Counter]:
    """(launches as on CUDA, launches by operator as here) of one steady step, in a fresh process."""
    run = subprocess.run(
        [sys.executable, __file__, "--child", workload, method, str(b), str(t)],
        capture_output=True,
        text=True,
    )
    if run.returncode:
        raise RuntimeError(f"{workload} / {method}: {run.stderr.strip().splitlines()[-1]}")
    got = json.loads(run.stdout.strip().splitlines()[-1])
    kinds = Counter(got["kinds"])
    return sum(kinds.values()) + got["delta"], kinds


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default="llama135m-full-bf16")
    ap.add_argument("--methods", default="dptrain-bk")
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--t", type=int, default=512)
    ap.add_argument(
        "--by-kind", type=int, default=0, help="show the N operators the method adds most"
    )
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        w, m, b, t = args.child
        _child(w, m, int(b), int(t))
        return
    print(
        f"Kernel launches per steady step as on CUDA (B {args.b}, T {args.t}; torch {torch.__version__})\n"
    )
    print("| workload | method | launches | ratio to non-private |")
    print("| --- | --- | ---: | ---: |")
    for workload in args.workloads.split(","):
        base, base_kinds = count(workload, "nonprivate", args.b, args.t)
        print(f"| {workload} | nonprivate | {base} | 1.00x |")
        for method in args.methods.split(","):
            n, kinds = count(workload, method, args.b, args.t)
            print(f"| {workload} | {method} | {n} | {n / base:.2f}x |")
            if args.by_kind:
                diff = {k: kinds[k] - base_kinds[k] for k in set(kinds) | set(base_kinds)}
                top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.by_kind]
                print("|  |  | " + ", ".join(f"{k} {d:+d}" for k, d in top) + " (as here) | |")


if __name__ == "__main__":
    main()
