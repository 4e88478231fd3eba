"""Peak memory of a training step, and the largest batch under a memory cap.

What is measured and why:

- **Peak memory** of one (workload, method) is read in a *fresh process* that
  builds the model, optimizer and batch and runs a few steps: a process's
  peak only grows, so methods measured one after another in one process
  would hide each other's peaks. On CPU the figure is the peak resident set
  size (``ru_maxrss``): everything the process touched, torch's import
  included. That import is a constant of a few hundred MB that pulls every
  ratio towards 1, so records also carry the *baseline* (``ru_maxrss``
  right after the model, optimizer and batch exist) and the increment above
  it. On CUDA the figure is ``torch.cuda.max_memory_allocated()`` (tensors
  only; the CUDA context is not counted).

  Linux keeps ``ru_maxrss`` across ``execve``, and a child forked from a
  large process would start from that process's peak; so a small launcher
  (``python -S``, no torch) starts the measuring process
  (``python -m dptrain.bench._child``) and the peak it reports is its own.

- **Largest batch under a cap** (as in Li et al. 2022, Figure 4, and DPFormer,
  Figure 3): :func:`find_max_batch` doubles the batch size until a step no
  longer fits, then bisects; every probe is a fresh process. On CPU a batch
  *fits* a cap of C MB when the process completes its steps with the address
  space limited (``RLIMIT_AS``) to what it had plus the C MB minus its resident
  size at that point, and its peak RSS stays <= C. The limit is set after the
  imports and one warm-up step at batch size 1 (which loads lazily initialised
  libraries), so it bounds the training itself. On CUDA the cap is
  ``torch.cuda.set_per_process_memory_fraction`` and the check
  ``max_memory_allocated() <= C``.

Run ``python -m dptrain.bench._child WORKLOAD METHOD [--batch-size B]
[--cap-mb C] [--device D] [--amp {off,bf16}] [--threads N] [--steps S]`` to
measure one configuration; it prints one JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "MaxBatchResult",
    "ProbeError",
    "find_max_batch",
    "main",
    "max_batch_under_cap",
    "measure_in_process",
    "measure_peak",
    "measure_peaks",
    "run_fresh",
]

_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"
_MB = 1024 * 1024


class ProbeError(RuntimeError):
    """A probe of the batch search failed for a reason other than memory (e.g. a refusal)."""


# -- the measuring process -----------------------------------------------------------------------


def _proc_status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field_name}")  # pragma: no cover


def _maxrss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return type(exc).__name__ == "OutOfMemoryError" or (
        isinstance(exc, RuntimeError)
        and ("can't allocate memory" in text or "out of memory" in text or "bad_alloc" in text)
    )


def _set_cpu_cap(cap_mb: float) -> None:
    if not os.path.exists("/proc/self/status"):
        raise ValueError("a memory cap on CPU needs Linux (/proc/self/status): none here")
    rss_mb = _proc_status_kib("VmRSS") / 1024
    if rss_mb >= cap_mb:
        raise ProbeError(
            f"cap_mb={cap_mb:g} is below the process's resident size after imports "
            f"({rss_mb:.0f} MB): expected a larger cap"
        )
    limit = _proc_status_kib("VmSize") * 1024 + int((cap_mb - rss_mb) * _MB)
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def measure_in_process(
    workload: str,
    method: str,
    *,
    device: str = "cpu",
    threads: int = 1,
    steps: int = 3,
    batch_size: int | None = None,
    cap_mb: float | None = None,
    amp: str = "off",
) -> dict[str, Any]:
    """Build one (workload, method) in *this* process, run ``steps`` steps, report memory.

    Meant for a fresh process (:func:`measure_peak` starts one). Returns
    ``baseline_mb`` and ``peak_mb`` (see the module docstring), or ``error``;
    with ``cap_mb``, ``fits`` says whether the steps completed within the cap.
    """
    import torch

    from dptrain.bench.timing import fix_threads
    from dptrain.bench.workloads import (
        build_step,
        check_amp,
        check_workloads,
        effective_amp,
        first_line,
        preload,
    )

    fix_threads(threads)
    (w,) = check_workloads([workload])
    amp = effective_amp(w, check_amp(amp))  # a Llama workload fixes its own precision
    cuda = device.startswith("cuda")
    out: dict[str, Any] = {
        "workload": workload,
        "method": method,
        "batch_size": w.batch_size if batch_size is None else batch_size,
        "device": device,
        "amp": amp,
    }
    try:
        preload(w, method)
        if cap_mb is not None:
            # Load lazily initialised libraries and kernels before the cap is set.
            warm = build_step(w, method, device=device, batch_size=1, amp=amp)
            warm.step()
            del warm
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
                total = torch.cuda.get_device_properties(torch.device(device)).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, cap_mb * _MB / total), device)
            else:
                _set_cpu_cap(cap_mb)
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        built = build_step(w, method, device=device, batch_size=batch_size, amp=amp)
        if built.note:
            out["note"] = built.note
        if cuda:
            torch.cuda.synchronize(device)
            out["baseline_mb"] = torch.cuda.memory_allocated(device) / _MB
        else:
            out["baseline_mb"] = _maxrss_mb()
        for _ in range(steps):
            built.step()
        if cuda:
            torch.cuda.synchronize(device)
            out["peak_mb"] = torch.cuda.max_memory_allocated(device) / _MB
        else:
            out["peak_mb"] = _maxrss_mb()
        if cap_mb is not None:
            out["fits"] = out["peak_mb"] <= cap_mb
    except Exception as exc:
        if cap_mb is not None and _is_oom(exc):
            out["fits"] = False
            out["oom"] = first_line(exc)
        else:
            out["error"] = first_line(exc)
    return out


def main(argv: list[str] | None = None) -> None:
    """``python -m dptrain.bench._child``: measure one configuration, print one JSON line."""
    from dptrain.bench.workloads import AMP_MODES

    p = argparse.ArgumentParser(prog="python -m dptrain.bench._child", description=__doc__)
    p.add_argument("workload")
    p.add_argument("method")
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", choices=AMP_MODES, default="off")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--cap-mb", type=float)
    a = p.parse_args(argv)
    out = measure_in_process(
        a.workload,
        a.method,
        device=a.device,
        threads=a.threads,
        steps=a.steps,
        batch_size=a.batch_size,
        cap_mb=a.cap_mb,
        amp=a.amp,
    )
    print(json.dumps(out), flush=True)


# -- fresh processes -----------------------------------------------------------------------------


def _child_env() -> dict[str, str]:
    """The environment, with the folder holding this dptrain first on PYTHONPATH (so the
    child measures the same sources, installed or not)."""
    import dptrain

    root = os.path.dirname(os.path.dirname(os.path.abspath(dptrain.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def run_fresh(module: str, args: Iterable[str], *, timeout: float = 1800) -> dict[str, Any]:
    """Run ``python -m module args`` in a fresh process (through a torch-free launcher);
    return the last JSON line it printed, or ``{"error": ...}``."""
    cmd = [sys.executable, "-m", module, *args]
    try:
        proc = subprocess.run(
            [sys.executable, "-S", "-c", _LAUNCHER, *cmd],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=_child_env(),
        )
    except subprocess.TimeoutExpired:
        return {"error": f"measuring process timed out after {timeout:g} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    if proc.returncode in (-9, 137):
        return {"killed": True, "error": "measuring process killed (SIGKILL: out of memory?)"}
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"measuring process failed (exit {proc.returncode}): {tail}"}


def measure_peak(
    workload: str,
    method: str,
    *,
    device: str = "cpu",
    threads: int = 1,
    steps: int = 3,
    batch_size: int | None = None,
    cap_mb: float | None = None,
    amp: str = "off",
    timeout: float = 1800,
) -> dict[str, Any]:
    """:func:`measure_in_process` in a fresh process; same result keys."""
    from dptrain.bench.workloads import check_amp

    check_amp(amp)  # here, not as the child's argparse exit
    args = [workload, method, "--device", device, "--amp", amp, "--threads", str(threads)]
    args += ["--steps", str(steps)]
    if batch_size is not None:
        args += ["--batch-size", str(batch_size)]
    if cap_mb is not None:
        args += ["--cap-mb", repr(float(cap_mb))]
    return run_fresh("dptrain.bench._child", args, timeout=timeout)


def measure_peaks(
    configs: list[tuple[str, str]],
    *,
    jobs: int = 1,
    on_done: Callable[[tuple[str, str]], None] | None = None,
    **kwargs: Any,
) -> dict[tuple[str, str], dict[str, Any]]:
    """:func:`measure_peak` of each (workload, method), ``jobs`` processes at a time.

    Each figure is its own process's peak, so running several at once does not
    change them (as long as the machine has the memory); on CUDA keep ``jobs=1``.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs={jobs!r} is not allowed: expected an integer >= 1")

    def one(cfg: tuple[str, str]) -> dict[str, Any]:
        res = measure_peak(*cfg, **kwargs)
        if on_done is not None:
            on_done(cfg)
        return res

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return dict(zip(configs, pool.map(one, configs), strict=True))


# -- the largest batch under a cap ---------------------------------------------------------------


@dataclass
class MaxBatchResult:
    """The outcome of :func:`find_max_batch`.

    Attributes:
        batch_size: the largest batch size found to fit (None: not even the smallest).
        first_failing: the smallest batch size found not to fit (None: none failed).
        limit_reached: the search stopped at its upper limit while still fitting.
        probes: (batch size, fits) in the order tried.
        error: why the search stopped early, if it did.
    """

    batch_size: int | None
    first_failing: int | None = None
    limit_reached: bool = False
    probes: list[tuple[int, bool]] = field(default_factory=list)
    error: str | None = None


def find_max_batch(
    fits: Callable[[int], bool], *, start: int = 1, limit: int = 65_536, rtol: float = 0.0
) -> MaxBatchResult:
    """Largest batch size ``b`` in [1, limit] with ``fits(b)``, assuming ``fits`` is monotone.

    From ``start``: double while it fits (or halve while it does not) to bracket
    the boundary, then bisect until the bracket is 1 wide, or at most
    ``rtol * lower end`` wide (``rtol > 0`` trades precision for fewer probes,
    each of which may be a fresh process). A :class:`ProbeError` from ``fits``
    ends the search with the error recorded.
    """
    for name, value, low in (("start", start, 1), ("limit", limit, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name}={value!r} is not allowed: expected an integer >= {low}")
    if start > limit:
        raise ValueError(f"start={start!r} is not allowed: expected at most limit={limit!r}")
    if not isinstance(rtol, int | float) or isinstance(rtol, bool) or not 0 <= rtol < 1:
        raise ValueError(f"rtol={rtol!r} is not allowed: expected a number in [0, 1)")
    result = MaxBatchResult(batch_size=None)

    def probe(b: int) -> bool:
        ok = bool(fits(b))
        result.probes.append((b, ok))
        return ok

    try:
        if probe(start):
            lo, hi = start, None
            while hi is None:
                nxt = min(2 * lo, limit)
                if nxt == lo:
                    result.batch_size, result.limit_reached = lo, True
                    return result
                if probe(nxt):
                    lo = nxt
                else:
                    hi = nxt
        else:
            lo, hi = 0, start
            b = start // 2
            while b >= 1:
                if probe(b):
                    lo = b
                    break
                hi, b = b, b // 2
            if lo == 0:
                result.first_failing = hi
                return result
        while hi - lo > max(1, int(lo * rtol)):
            mid = (lo + hi) // 2
            if probe(mid):
                lo = mid
            else:
                hi = mid
        result.batch_size, result.first_failing = lo, hi
    except ProbeError as exc:
        fitted = [b for b, ok in result.probes if ok]
        result.batch_size = max(fitted) if fitted else None
        result.error = str(exc)
    return result


def max_batch_under_cap(
    workload: str,
    method: str,
    cap_mb: float,
    *,
    device: str = "cpu",
    threads: int = 1,
    steps: int = 2,
    start: int | None = None,
    limit: int = 8192,
    rtol: float = 0.05,
    amp: str = "off",
    timeout: float = 1800,
    on_probe: Callable[[int, bool], None] | None = None,
) -> MaxBatchResult:
    """:func:`find_max_batch` where a probe runs ``steps`` steps in a fresh process under a
    ``cap_mb`` cap (module docstring). ``start`` defaults to the workload's batch size."""
    from dptrain.bench.workloads import check_amp, check_workloads

    (w,) = check_workloads([workload])
    check_amp(amp)
    if not isinstance(cap_mb, int | float) or isinstance(cap_mb, bool) or cap_mb <= 0:
        raise ValueError(f"cap_mb={cap_mb!r} is not allowed: expected a number of MB > 0")

    def fits(b: int) -> bool:
        res = measure_peak(
            workload,
            method,
            device=device,
            threads=threads,
            steps=steps,
            batch_size=b,
            cap_mb=cap_mb,
            amp=amp,
            timeout=timeout,
        )
        if "fits" in res:
            ok = bool(res["fits"])
        elif res.get("killed"):
            ok = False
        else:
            raise ProbeError(res.get("error", "probe failed"))
        if on_probe is not None:
            on_probe(b, ok)
        return ok

    return find_max_batch(fits, start=start or min(w.batch_size, limit), limit=limit, rtol=rtol)


if __name__ == "__main__":
    main()
