"""Mixed precision for forward passes: float32, or bfloat16 autocast with float32 weights.

One switch (``amp``) shared by the recipes and ``dptrain bench``. Under ``"bf16"`` the
forward pass and loss run in ``torch.autocast(dtype=torch.bfloat16)`` and the backward
outside it, as PyTorch recommends; weights, gradients and optimizer state stay float32.
The clipping engine reads bf16 activations and output gradients, computes norms and
clipped sums from them in float32, and forms the sum from those records in both modes
(ghost's second backward would form it in bf16; see docs/engine.md "Precision").
On a CPU with AVX512-BF16 a bf16 matmul ran 3.5x as fast as a float32 one here.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["AMP_MODES", "amp_context", "check_amp"]

#: Precision of the forward pass and loss: float32, or bfloat16 autocast.
AMP_MODES = ("off", "bf16")


def check_amp(amp: str) -> str:
    """``amp`` if it is one of :data:`AMP_MODES`; otherwise ValueError naming the choices."""
    if amp not in AMP_MODES:
        raise ValueError(f"amp={amp!r} is not allowed: expected one of {', '.join(AMP_MODES)}")
    return amp


def amp_context(
    amp: str, device: str | torch.device = "cpu"
) -> contextlib.AbstractContextManager[Any]:
    """The context a forward pass and loss run in: none for ``"off"``, bfloat16 autocast on
    the device's type for ``"bf16"``. A fresh one per use: an autocast object must not be
    entered twice at once."""
    if check_amp(amp) == "off":
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
