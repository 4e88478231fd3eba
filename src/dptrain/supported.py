"""Which parameter dtypes, autocast dtypes and devices private training supports.

Checked by :func:`~dptrain.make_private` before anything is built, and (for autocast,
which is only known when the forward runs) at every forward of the private model, so
an unsupported setting is refused with its name and value before the first step:

- parameters in float32, float64 or bfloat16. float16 is refused: its 5 exponent bits
  underflow small gradients unless a loss scaler multiplies the loss, and make_private
  has none (a ``GradScaler`` unscales, and may skip, a step after the noise was added,
  which the ledger cannot express). float8 and integer parameters are not trained by
  gradients this engine computes.
- autocast off, or to bfloat16 (the rule of Li et al. 2022, App. T: low-precision
  activations, norms and clipped sums in float32). float16 autocast is refused for the
  reason above.
- parameters on a CPU or a CUDA device: the engine, its checks and the noise generators
  are tested there. ``meta`` tensors hold no values; other backends (``mps``, ``xla``,
  ``xpu``...) are untested, and a clipping bug there would be a privacy bug.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = [
    "SUPPORTED_AUTOCAST_DTYPES",
    "SUPPORTED_DEVICE_TYPES",
    "SUPPORTED_PARAMETER_DTYPES",
    "check_autocast",
    "check_device",
    "check_model_supported",
    "refuse_unsupported_autocast",
]

SUPPORTED_PARAMETER_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
SUPPORTED_AUTOCAST_DTYPES = (torch.bfloat16,)
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda")

_FLOAT16_WHY = (
    "float16 needs a loss scaler and private training has none (a GradScaler unscales or "
    "skips a step after the noise is added); use bfloat16"
)


def _names(dtypes: tuple[torch.dtype, ...]) -> str:
    return ", ".join(str(d).removeprefix("torch.") for d in dtypes)


def check_model_supported(model: nn.Module) -> None:
    """Refuse a trainable parameter of an unsupported dtype or on an unsupported device.

    The error names the parameter, its dtype or device, and what is allowed.
    """
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if p.dtype not in SUPPORTED_PARAMETER_DTYPES:
            why = _FLOAT16_WHY if p.dtype == torch.float16 else "gradients are computed in those"
            raise ValueError(
                f"model parameter {name!r} has dtype={p.dtype}, which is not allowed: expected "
                f"one of {_names(SUPPORTED_PARAMETER_DTYPES)} ({why})"
            )
        if p.device.type not in SUPPORTED_DEVICE_TYPES:
            raise ValueError(
                f"model parameter {name!r} is on device={str(p.device)!r}, which is not "
                f"allowed: expected a device of type {' or '.join(SUPPORTED_DEVICE_TYPES)}"
                + (" (meta tensors hold no values)" if p.device.type == "meta" else "")
            )


def check_device(value: str | torch.device, name: str = "device") -> torch.device:
    """``value`` as a torch.device if it names a CPU or a CUDA device present here.

    A recipe asks before it loads data or a model: ``device='cuda'`` on a machine without
    one would otherwise fail inside ``model.to`` after the work that came before it.
    """
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError) as e:
        raise ValueError(
            f"{name}={value!r} is not allowed: expected 'cpu', 'cuda' or 'cuda:N'"
        ) from e
    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(f"{name}={value!r} is not allowed: expected 'cpu', 'cuda' or 'cuda:N'")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(
                f"{name}={value!r} is not available here (PyTorch sees no CUDA device): "
                f"expected {name}='cpu'"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"{name}={value!r} is not available here: expected 'cuda:0' to "
                f"'cuda:{count - 1}' ({count} CUDA device(s))"
            )
    return device


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype active for ``device_type`` now, or None when autocast is off."""
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
    if device_type == "cpu":
        return torch.get_autocast_cpu_dtype() if torch.is_autocast_cpu_enabled() else None
    return torch.get_autocast_gpu_dtype() if torch.is_autocast_enabled() else None


def check_autocast(device_types: tuple[str, ...] = SUPPORTED_DEVICE_TYPES) -> None:
    """Refuse an active autocast to a dtype other than bfloat16 on any of ``device_types``."""
    for device_type in device_types:
        dtype = _autocast_dtype(device_type)
        if dtype is not None and dtype not in SUPPORTED_AUTOCAST_DTYPES:
            why = f" ({_FLOAT16_WHY})" if dtype == torch.float16 else ""
            raise ValueError(
                f"torch.autocast(device_type={device_type!r}, dtype={dtype}) is not allowed "
                f"around a private model's forward: expected autocast off or dtype "
                f"{_names(SUPPORTED_AUTOCAST_DTYPES)}{why}"
            )


def refuse_unsupported_autocast(model: nn.Module) -> RemovableHandle:
    """Check the autocast state at every forward of ``model`` (before it runs): the
    state is the caller's context, known only then. Returns the hook's handle."""
    device_types = tuple(
        sorted({p.device.type for p in model.parameters()} & set(SUPPORTED_DEVICE_TYPES))
    ) or ("cpu",)

    def hook(module: nn.Module, args: tuple) -> None:
        check_autocast(device_types)

    return model.register_forward_pre_hook(hook)
