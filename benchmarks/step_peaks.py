"""Tensor memory of the first three steps of a bench workload at a chosen batch, counted on
a CPU as the CUDA allocator would count it (issue 27, memory; the counter is
``tensor_peak.LiveTensors``): non-private against dptrain's book-keeping, its linear
layers ghost-normed or instantiated as on CUDA (``rules.SIZE_RULE_DEVICES``), and which
tensors, by the operator that made them, make the difference at each step's peak. The
first step runs the engine's checks; weights and AdamW state made before a step are not
in its count.

    PYTHONPATH=src:benchmarks python benchmarks/step_peaks.py llama135m-full-bf16 4 128
    PYTHONPATH=src:benchmarks python benchmarks/step_peaks.py llama135m-full-bf16 4 512 dptrain-bk,dptrain-instantiate

The fourth argument names the private methods to set beside non-private (default
dptrain-bk). On a CPU the engine's float32-output products upcast their bf16 operands
(``tensor_cores.mm_f32``); those copies, absent on CUDA, are counted here.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time

import torch

from tensor_peak import LiveTensors, largest_differences


def _child(name: str, method: str, b: int, t: int) -> None:
    from dptrain.bench.workloads import WORKLOADS, build_step
    from dptrain.clipping import rules

    torch.set_num_threads(2)
    rules.SIZE_RULE_DEVICES.add("cpu")  # ghost or instantiation per layer, as on CUDA
    step = build_step(dataclasses.replace(WORKLOADS[name], seq_len=t, batch_size=b), method).step
    out = []
    for _ in range(3):
        mode = LiveTensors()
        start = time.perf_counter()
        with mode:
            step()
        out.append(
            {"peak": mode.peak, "at_peak": dict(mode.at_peak), "s": time.perf_counter() - start}
        )
    print(json.dumps(out))


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[5] == "child":  # name, method, b, t, "child"
        _child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return
    name, b, t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    methods = sys.argv[4].split(",") if len(sys.argv) > 4 else ["dptrain-bk"]
    got = {}
    for method in ("nonprivate", *methods):
        run = subprocess.run(
            [sys.executable, __file__, name, method, str(b), str(t), "child"],
            capture_output=True,
            text=True,
            check=True,
        )
        got[method] = json.loads(run.stdout.strip().splitlines()[-1])
    for i, label in enumerate(("first (checks)", "second", "third")):
        base = got["nonprivate"][i]
        for method in methods:
            mine = got[method][i]
            print(
                f"step {label}: non-private {base['peak'] / 2**20:.0f} MB, {method} "
                f"{mine['peak'] / 2**20:.0f} MB ({mine['peak'] / base['peak']:.2f}x)"
            )
            for op, d in largest_differences(base["at_peak"], mine["at_peak"], 8):
                print(f"   {d / 2**20:+8.1f} MB  {op}")


if __name__ == "__main__":
    main()
