"""Clipping functions: per-example factors c_i from per-example gradient norms.

Each keeps ||c_i g_i|| <= C, so one example changes the clipped sum by at
most C in L2 norm: the sensitivity the Gaussian noise N(0, sigma^2 C^2) covers.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["CLIPPING_FUNCTIONS", "automatic_factors", "flat_factors"]


def flat_factors(norms: Tensor, max_grad_norm: float, margins: Tensor | None = None) -> Tensor:
    """min(1, C / ||g_i||) (Abadi et al. 2016); an example with zero gradient keeps factor 1.

    ``margins`` r_i: how far rounding may move a scaled example's contribution c_i g_i,
    divided by c_i (tensor_cores.py). An example within C keeps factor 1 (exactly: its
    sum is then not rounded); one above gets C / (||g_i|| + r_i), so that
    c_i ||g_i|| + c_i r_i = C.
    """
    tiny = torch.finfo(norms.dtype).tiny
    factors = (max_grad_norm / norms.clamp_min(tiny)).clamp(max=1.0)
    if margins is None:
        return factors
    scaled = (max_grad_norm / (norms + margins.to(norms.dtype)).clamp_min(tiny)).clamp(max=1.0)
    return torch.where(factors < 1.0, scaled, factors)


def automatic_factors(
    norms: Tensor, max_grad_norm: float, gamma: float = 0.01, margins: Tensor | None = None
) -> Tensor:
    """C / (||g_i|| + gamma): automatic (normalised) clipping (Bu et al. 2023), used by DPFormer.

    ||c_i g_i|| = C ||g_i|| / (||g_i|| + gamma) < C for gamma > 0. With ``margins`` r_i
    (see :func:`flat_factors`): C / (||g_i|| + r_i + gamma).
    """
    if margins is not None:
        norms = norms + margins.to(norms.dtype)
    return max_grad_norm / (norms + gamma)


CLIPPING_FUNCTIONS = ("flat", "automatic", "per_layer")
