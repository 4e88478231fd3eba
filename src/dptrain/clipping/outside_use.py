"""Detect a clipped parameter used outside the forward of the module that owns it.

The engine gets each example's gradient from what a module's forward records
(its input and output). If a parameter of such a module also enters the
computation elsewhere (``y = x + self.fc.bias`` in a parent's forward, a
weight reused by hand), the gradient through that use never reaches the
recorded output: book-keeping would drop it, and a second backward (ghost
mode) would add it scaled by clip factors computed without it, so the
clipped gradient could exceed C. Neither is acceptable, so the engine checks
the first forward pass with gradients and refuses such a model by name.

How: a :class:`torch.overrides.TorchFunctionMode` sees every torch function
call of that forward, and temporary hooks on the clipped modules keep the
stack of module forwards in progress. A call that takes a clipped parameter
and returns a tensor attached to autograd, while none of the parameter's own
modules is running, is an outside use. Calls under ``no_grad`` and calls
whose result does not require grad (``.detach()``, shape or dtype queries) are
not uses: they create no gradient path.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["OutsideUseCheck"]


class OutsideUseCheck(TorchFunctionMode):
    """Context manager for one forward pass; ``found`` lists the outside uses.

    Args:
        owners: parameter id -> (name, the modules whose forward may use it).
    """

    def __init__(self, owners: dict[int, tuple[str, tuple[nn.Module, ...]]]):
        super().__init__()
        self.owners = owners
        self.running: list[nn.Module] = []
        self.found: dict[str, str] = {}  # parameter name -> first function that used it
        self._handles: list = []
        for _, modules in owners.values():
            for m in modules:
                self._handles.append(m.register_forward_pre_hook(self._enter))
                self._handles.append(m.register_forward_hook(self._leave))

    def _enter(self, module, args):
        self.running.append(module)

    def _leave(self, module, args, output):
        if self.running and self.running[-1] is module:
            self.running.pop()

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # Under no_grad nothing enters the graph (a view of a parameter still says
        # requires_grad there, so the grad mode is checked first).
        if not torch.is_grad_enabled() or not _attached(out):
            return out
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, nn.Parameter) and id(t) in self.owners:
                name, modules = self.owners[id(t)]
                if not any(m in self.running for m in modules):
                    self.found.setdefault(name, getattr(func, "__name__", str(func)))
        return out


def _attached(out) -> bool:
    """Whether a result carries a gradient path (a tensor requiring grad, or holds one)."""
    return any(isinstance(t, Tensor) and t.requires_grad for t in tree_flatten(out)[0])
