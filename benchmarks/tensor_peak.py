"""Peak of the tensor memory one steady step allocates (a CPU stand-in for the CUDA
allocator's peak), and which tensors are alive at that peak (issue 27, memory).

Resident-set figures on a CPU include glibc's free lists and vary by 5-10% between runs;
this counts tensors instead: a dispatch mode sees every operator's outputs, adds each new
storage's bytes once (views and in-place results add nothing) and takes them off when the storage is freed.
The third step of ``benchmarks/cpu_proxies.py``'s tied Llama (h 256, 4 layers, vocab
8192, B 8, T 256, bf16 autocast) is measured, non-private and dptrain's book-keeping,
full fine-tuning and LoRA r16; the live tensors at each peak are grouped by the operator
that made them and the private step's extra shown by group.

    PYTHONPATH=src:. python benchmarks/tensor_peak.py          # about a minute
"""

from __future__ import annotations

import subprocess
import sys
import weakref
from collections import Counter

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


class LiveTensors(TorchDispatchMode):
    """Bytes of the storages operators created and that are still alive; their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: dict[int, tuple[int, str]] = {}
        self._by_label: Counter = Counter()  # the alive bytes by label, kept as they change
        self.at_peak: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # a view or an in-place result shares an input's storage: nothing new
        inputs = {
            a.untyped_storage().data_ptr()
            for a in pytree.tree_leaves((args, kwargs))
            if isinstance(a, torch.Tensor)
        }
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if not key or key in self._alive or key in inputs:
                continue
            n = storage.nbytes()
            label = f"{func.__name__} {str(t.dtype).removeprefix('torch.')}"
            self._alive[key] = (n, label)
            self._by_label[label] += n
            self.live += n
            weakref.finalize(storage, self._freed, key)
            if self.live > self.peak:
                self.peak = self.live
                self.at_peak = self._by_label.copy()
        return out

    def _freed(self, key: int) -> None:
        n, label = self._alive.pop(key)
        self._by_label[label] -= n
        self.live -= n


def largest_differences(base: dict, mine: dict, n: int) -> list[tuple[str, int]]:
    """The ``n`` labels whose alive bytes at the peak differ most (mine - base), by size."""
    diff = {k: mine.get(k, 0) - base.get(k, 0) for k in {*base, *mine}}
    return sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:n]


def _child(method: str, lora: bool) -> None:
    import json

    from cpu_proxies import stepper

    torch.set_num_threads(1)
    step = stepper(method, lora, 8, 256)
    step()
    step()
    mode = LiveTensors()
    with mode:
        step()
    print(json.dumps({"peak": mode.peak, "at_peak": dict(mode.at_peak)}))


def main() -> None:
    import json

    if len(sys.argv) == 3:
        _child(sys.argv[1], sys.argv[2] == "1")
        return
    for lora in (False, True):
        got = {}
        for method in ("nonprivate", "dptrain-bk"):
            run = subprocess.run(
                [sys.executable, __file__, method, "1" if lora else "0"],
                capture_output=True,
                text=True,
                check=True,
            )
            got[method] = json.loads(run.stdout.strip().splitlines()[-1])
        base, mine = got["nonprivate"], got["dptrain-bk"]
        name = "LoRA r16" if lora else "full"
        print(
            f"{name}: peak of the steady step's tensors {base['peak'] / 2**20:.1f} MB "
            f"non-private, {mine['peak'] / 2**20:.1f} MB dptrain-bk "
            f"({mine['peak'] / base['peak']:.2f}x); alive at the peak, by the operator "
            "that made them, the largest differences:"
        )
        for label, d in largest_differences(base["at_peak"], mine["at_peak"], 6):
            print(f"  {d / 2**20:+7.1f} MB  {label}")


if __name__ == "__main__":
    main()
