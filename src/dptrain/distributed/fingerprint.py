"""Fingerprints of a run's configuration: what every rank must agree on, as short strings.

:func:`~dptrain.distributed.make_private_distributed` all-gathers them and
raises on every rank if they differ; :mod:`dptrain.checkpoint` shortens the
sample-rate schedule it records the same way (:func:`_short`).

Internal to :mod:`dptrain.distributed` and :mod:`dptrain.checkpoint`: no public names.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn


def _short(text: str, limit: int = 120) -> str:
    if len(text) <= limit:
        return text
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _model_layout(model: nn.Module) -> tuple[int, str]:
    """(trainable parameter count, digest of every parameter's and buffer's name/shape/dtype)."""
    h = hashlib.sha256()
    count = 0
    for name, p in model.named_parameters():
        h.update(f"p {name} {tuple(p.shape)} {p.dtype} {p.requires_grad};".encode())
        if p.requires_grad:
            count += p.numel()
    for name, b in model.named_buffers():
        h.update(f"b {name} {tuple(b.shape)} {b.dtype};".encode())
    return count, h.hexdigest()[:16]


def _optimizer_summary(optimizer: torch.optim.Optimizer) -> str:
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"n_params": len(g["params"])}
        for g in optimizer.param_groups
    ]
    return _short(f"{type(optimizer).__name__}{groups!r}")


def _config_fingerprint(
    model: nn.Module, optimizer: torch.optim.Optimizer, data: Any, settings: dict[str, Any]
) -> dict[str, str]:
    """What every rank must agree on, as strings (compared for equality)."""
    import dptrain

    fp = {}
    for key, value in settings.items():
        if key == "batch_size" and callable(value):
            steps = settings.get("steps")
            if isinstance(steps, int) and steps > 0:
                sizes = [value(t) for t in range(steps)]
                fp[key] = _short(f"schedule {sizes!r}")
            else:
                fp[key] = "schedule"
        else:
            fp[key] = _short(repr(value))
    dataset = getattr(data, "dataset", data)
    fp["dataset_size"] = repr(len(dataset))
    count, layout = _model_layout(model)
    fp["model_parameters"] = repr(count)
    fp["model_layout"] = layout
    fp["optimizer"] = _optimizer_summary(optimizer)
    fp["versions"] = f"torch {torch.__version__}, dptrain {dptrain.__version__}"
    return fp
