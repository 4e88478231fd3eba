"""A CPU tensor that reports itself on ``cuda:0``: how a checkpoint's tensors look after
accelerate moved them to a GPU, on a machine without one.

``torch.Generator.set_state`` refuses it exactly as it refuses a real CUDA tensor
("RNG state must be a torch.ByteTensor"); copying it to the CPU (``.cpu()``,
``.to("cpu")``, ``.to(device="cpu", dtype=...)``) gives back the bytes it holds. Every
other operation but ``detach`` raises, so code that computes on it without moving it first fails too.
"""

from __future__ import annotations

from typing import Any

import torch

FAKE_DEVICE = torch.device("cuda", 0)


class FakeCudaTensor(torch.Tensor):
    """Holds ``inner`` (a CPU tensor) while reporting device ``cuda:0``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> FakeCudaTensor:
        t = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, dtype=inner.dtype, device=FAKE_DEVICE
        )
        t.inner = inner
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
            return FakeCudaTensor(args[0].inner)
        if func is torch.ops.aten._to_copy.default:
            device = kwargs.get("device")
            if device is not None and torch.device(device).type == "cpu":
                inner = args[0].inner
                return inner.to(dtype=kwargs.get("dtype") or inner.dtype).clone()
        raise NotImplementedError(f"{func} on a fake CUDA tensor: move it to the CPU first")


def to_fake_cuda(monkeypatch: Any) -> None:
    """Make ``Tensor.to("cuda")`` (what accelerate's ``move_to_device`` calls) return a
    :class:`FakeCudaTensor` for the rest of the test."""
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        target = args[0] if args else kwargs.get("device")
        if isinstance(target, str | torch.device) and torch.device(target).type == "cuda":
            return FakeCudaTensor(self.detach().clone())
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
