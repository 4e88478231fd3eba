"""The microbatch oracle: per-example gradients from batch-size-1 backward passes.

Slow and memory-hungry, and exactly what DP-SGD means: the reference every
clipping rule is tested against (as Opacus tests its grad samplers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["oracle_clipped_sum", "oracle_norms", "oracle_per_example_grads"]


def oracle_per_example_grads(
    model: nn.Module, example_loss: Callable[[int], Tensor], batch_size: int
) -> dict[str, Tensor]:
    """{parameter name: (B, *shape)} from B separate backward passes.

    ``example_loss(i)`` must run the model on example i alone and return its loss.
    Shared (tied) parameters appear once, under their first name.
    """
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out: dict[str, list[Tensor]] = {n: [] for n in params}
    for i in range(batch_size):
        model.zero_grad(set_to_none=True)
        example_loss(i).backward()
        for n, p in params.items():
            out[n].append(p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
    model.zero_grad(set_to_none=True)
    if batch_size == 0:
        return {n: torch.zeros(0, *p.shape, dtype=p.dtype) for n, p in params.items()}
    return {n: torch.stack(v) for n, v in out.items()}


def oracle_norms(grads: dict[str, Tensor]) -> Tensor:
    """(B,) per-example norms over all parameters."""
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()


def oracle_clipped_sum(grads: dict[str, Tensor], factors: Tensor) -> dict[str, Tensor]:
    """{name: sum_i factors[i] * grad_i}."""
    return {n: torch.einsum("b,b...->...", factors.to(g.dtype), g) for n, g in grads.items()}
