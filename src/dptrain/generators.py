"""Random generators whose state survives checkpoints on any device.

``torch.Generator.set_state`` takes only a CPU ``uint8`` tensor, for CPU and CUDA
generators alike. A saved state does not always come back so: accelerate's
``AcceleratedOptimizer`` moves every tensor of an optimizer's state dict to the
training device (so a noise generator's state arrives as a CUDA tensor), a JSON
checkpoint holds a list of ints, and ``torch.load(map_location=...)`` may place it
anywhere. Restoring through :func:`restore_generator` accepts each of these, so a
resumed run continues the noise stream it saved instead of failing before its first
step (issue 27) or, worse, restarting the stream from its seed, which would repeat
noise already added to earlier steps.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["canonical_device", "generator_state", "restore_generator"]


def canonical_device(device: torch.device | str) -> torch.device:
    """``device`` with its index filled in (``cuda`` -> ``cuda:0`` on device 0).

    Parameters report ``cuda:0``; a generator keyed by ``cuda`` would be a second
    generator, seeded afresh, whose noise repeats the first one's.
    """
    device = torch.device(device)
    if device.type not in ("cpu", "meta") and device.index is None:
        device = torch.empty(0, device=device).device
    return device


def generator_state(state: Any, name: str = "generator state") -> Tensor:
    """``state`` as the CPU ``uint8`` tensor ``Generator.set_state`` accepts.

    ``state``: a tensor on any device and of any integer or floating dtype holding the
    bytes, or a sequence of ints (a JSON checkpoint's). ``name`` names it in errors.
    """
    if isinstance(state, Tensor):
        raw = state.detach()
        if raw.dtype == torch.uint8:
            return raw.to(device="cpu").contiguous()
        values = raw.to(device="cpu", dtype=torch.float64)
    else:
        try:
            values = torch.as_tensor(state, dtype=torch.float64)
        except (TypeError, ValueError, RuntimeError) as e:
            raise ValueError(
                f"{name}={type(state).__name__} is not allowed: expected a uint8 tensor or a "
                "sequence of ints in [0, 255] (a generator's get_state())"
            ) from e
    if values.dim() != 1 or not bool(
        ((values >= 0) & (values <= 255) & (values == values.round())).all()
    ):
        raise ValueError(
            f"{name} (shape {tuple(values.shape)}, dtype {values.dtype}) is not allowed: "
            "expected a 1-D sequence of byte values, integers in [0, 255]"
        )
    return values.to(torch.uint8).contiguous()


def restore_generator(generator: torch.Generator, state: Any) -> torch.Generator:
    """Set ``generator`` to ``state`` (any device or dtype, see :func:`generator_state`)."""
    generator.set_state(generator_state(state))
    return generator
