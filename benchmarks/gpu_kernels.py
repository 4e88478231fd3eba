"""The top kernels of one training step of a ``dptrain bench`` workload (not a test).

    PYTHONPATH=src python benchmarks/gpu_kernels.py --device cuda \
        --workload llama135m-full-bf16 --methods nonprivate,dptrain-bk [--top 25] [--out FILE]

Builds each method's step (:func:`dptrain.bench.workloads.build_step`), runs
``--warmup`` steps (the engine's first-step checks included), then records one step
under ``torch.profiler`` and prints, per method: the step's wall time, the device time
and the host (CPU) time the profiler saw, how many kernels it launched, the share of
device time in matrix-product kernels whose names say they run in float32 (``f32f32``,
``sgemm``: CUDA cores, not tensor cores), and the ``--top`` kernels by device time.
On a CPU (``--device cpu``) the same table lists aten operators by CPU time; that is
how the script is checked without a GPU.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from dptrain.bench import workloads as W

# Kernel names of float32 matrix products on CUDA cores (cuBLAS/CUTLASS SIMT sgemm, the
# sm80 xmma f32f32 kernels the issue-27 profile showed).
F32_GEMM_MARKERS = ("f32f32", "sgemm", "gemm_f32")
GEMM_MARKERS = ("gemm", "xmma", "cutlass", "matmul", "nvjet")


def _device_us(e) -> float:
    return float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0))


def profile_step(workload: str, method: str, device: str, warmup: int, top: int) -> str:
    built = W.build_step(workload, method, device=device)
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        built.step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        built.step()
        sync()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    lines = [f"### {workload} / {method}", ""]
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        total = sum(_device_us(e) for e in kernels)
        launches = sum(e.count for e in kernels)
        gemm = [e for e in kernels if any(m in e.key.lower() for m in GEMM_MARKERS)]
        f32 = [e for e in gemm if any(m in e.key.lower() for m in F32_GEMM_MARKERS)]
        gemm_us = sum(_device_us(e) for e in gemm)
        f32_us = sum(_device_us(e) for e in f32)
        host_us = sum(e.self_cpu_time_total for e in events)
        lines.append(
            f"wall {wall * 1e3:.1f} ms; device time {total / 1e3:.1f} ms in {launches} kernel "
            f"launches; host (self CPU) time {host_us / 1e3:.1f} ms; matrix-product kernels "
            f"{gemm_us / 1e3:.1f} ms, of which float32 (CUDA cores) {f32_us / 1e3:.1f} ms "
            f"({(f32_us / gemm_us if gemm_us else 0):.0%})"
        )
        rows = sorted(kernels, key=_device_us, reverse=True)[:top]
        lines += ["", "| kernel | calls | device ms | share |", "| --- | ---: | ---: | ---: |"]
        for e in rows:
            name = e.key.replace("|", "/")[:110]
            share = _device_us(e) / total if total else 0.0
            lines.append(f"| `{name}` | {e.count} | {_device_us(e) / 1e3:.2f} | {share:.1%} |")
    else:
        total = sum(e.self_cpu_time_total for e in events)
        lines.append(f"wall {wall * 1e3:.1f} ms; {sum(e.count for e in events)} operator calls")
        rows = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
        lines += ["", "| operator | calls | self CPU ms | share |", "| --- | ---: | ---: | ---: |"]
        for e in rows:
            share = e.self_cpu_time_total / total if total else 0.0
            lines.append(
                f"| `{e.key}` | {e.count} | {e.self_cpu_time_total / 1e3:.2f} | {share:.1%} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workload", default="llama135m-full-bf16", choices=sorted(W.WORKLOADS))
    p.add_argument("--methods", default="nonprivate,dptrain-bk")
    p.add_argument("--device", default="cuda")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--out", help="also write the tables to this file")
    a = p.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"device={a.device!r} is not available here: expected --device cpu", file=sys.stderr)
        return 2
    text = f"# Top kernels of one step ({a.device}, torch {torch.__version__})\n\n"
    for method in a.methods.split(","):
        try:
            text += profile_step(a.workload, method, a.device, a.warmup, a.top) + "\n"
        except Exception as exc:  # a refusal is a result too
            text += f"### {a.workload} / {method}\n\n{W.first_line(exc)}\n\n"
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
