"""Clipping functions: per-example factors c_i from per-example gradient norms.

Each keeps ||c_i g_i|| <= C, so one example changes the clipped sum by at
most C in L2 norm: the sensitivity the Gaussian noise N(0, sigma^2 C^2) covers.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["CLIPPING_FUNCTIONS", "automatic_factors", "flat_factors"]


def flat_factors(norms: Tensor, max_grad_norm: float) -> Tensor:
    """min(1, C / ||g_i||) (Abadi et al. 2016); an example with zero gradient keeps factor 1."""
    return (max_grad_norm / norms.clamp_min(torch.finfo(norms.dtype).tiny)).clamp(max=1.0)


def automatic_factors(norms: Tensor, max_grad_norm: float, gamma: float = 0.01) -> Tensor:
    """C / (||g_i|| + gamma): automatic (normalised) clipping (Bu et al. 2023), used by DPFormer.

    ||c_i g_i|| = C ||g_i|| / (||g_i|| + gamma) < C for gamma > 0.
    """
    return max_grad_norm / (norms + gamma)


CLIPPING_FUNCTIONS = ("flat", "automatic", "per_layer")
