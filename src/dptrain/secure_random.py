"""Noise and sampling from the operating system's cryptographically secure generator.

``make_private(..., secure_mode=True)`` draws the Gaussian noise and the Poisson
sampling from here instead of torch's generators.

Why. torch's generators (Mersenne Twister on CPU, Philox on CUDA) are fast and
statistically sound, but not cryptographic: their state is a 64-bit seed, and whoever
learns or guesses it (it is in a checkpoint, or ``seed=`` was a small integer) can
recompute every noise vector and subtract it from the released updates, which removes
the guarantee. A seed per draw taken from ``os.urandom`` does not fix this: the noise is
still a deterministic function of 64 bits. Here every random bit comes from
``os.urandom`` (``getrandom(2)``: the kernel's ChaCha20 CSPRNG, reseeded from hardware
entropy), so there is no seed to learn.

How (the same recipe as Opacus' ``secure_mode``, which draws from torchcsprng's
``/dev/urandom`` generator):

* uniforms: 53 random bits per float64, ``k * 2**-53`` in [0, 1) (every float64 of the
  grid equally likely; ``torch.rand(dtype=float64)`` uses the same grid);
* Gaussians: the Box-Muller transform in float64, ``sqrt(-2 ln u1) (cos, sin)(2 pi u2)``
  with ``u1`` in (0, 1];
* floating-point attacks: a single floating-point Gaussian sample is not exactly
  Gaussian, and the gaps between representable outputs can reveal the unnoised value
  (Mironov 2012 for the Laplace mechanism; Holohan & Braghin 2021, "Secure Random
  Sampling in Differential Privacy", for Gaussians). As Opacus does after Holohan &
  Braghin, each coordinate is the sum of 4 independent draws of std ``sigma``, halved
  (std ``sigma``), computed in float64 before the cast to the gradient's dtype, which
  smooths the fine structure the attack reads. This is a mitigation, not a proof: an
  exact discrete Gaussian (Canonne, Kamath & Steinke 2020) is not implemented.

Cost (``benchmarks/bench_secure_mode.py``, docs/migrating_from_opacus.md): 32 bytes of
``os.urandom`` per noised coordinate, 0.3-0.6 microseconds on one CPU thread, 50-90x
torch's ``normal_``; 1.6-2.1x the whole step of a 0.2-3.7M-parameter GPT.
"""

from __future__ import annotations

import math
import os

import torch
from torch import Tensor

__all__ = ["secure_normal", "secure_uniform"]

#: float64 coordinates drawn per os.urandom call: bounds the memory of one draw (32 MiB
#: of bytes for the 4 uniforms a secure Gaussian coordinate takes).
_CHUNK = 1 << 20
#: Independent Gaussian draws summed per coordinate (Opacus' secure_mode: 4, halved).
_SUMMED_DRAWS = 4


def secure_uniform(n: int) -> Tensor:
    """``n`` float64 uniforms on [0, 1) from ``os.urandom``: ``k * 2**-53``, k uniform on
    the 2**53 integers (the top 53 of 64 random bits)."""
    if n < 0:
        raise ValueError(f"n={n!r} is not allowed: expected an integer >= 0")
    if n == 0:
        return torch.empty(0, dtype=torch.float64)
    words = torch.frombuffer(bytearray(os.urandom(8 * n)), dtype=torch.int64)
    # >> on int64 is arithmetic: mask to the top 53 bits as a non-negative integer
    bits = (words >> 11) & ((1 << 53) - 1)
    return bits.to(torch.float64) * 2.0**-53


def _standard_normal(n: int) -> Tensor:
    """``n`` float64 N(0, 1) draws by Box-Muller from secure uniforms."""
    pairs = (n + 1) // 2
    u = secure_uniform(2 * pairs)
    radius = torch.sqrt(-2.0 * torch.log1p(-u[:pairs]))  # 1 - u in (0, 1]: log is finite
    angle = (2.0 * math.pi) * u[pairs:]
    return torch.cat([radius * torch.cos(angle), radius * torch.sin(angle)])[:n]


def secure_normal(
    shape: torch.Size | tuple[int, ...],
    std: float,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Tensor:
    """N(0, std^2) noise of ``shape`` from the OS's CSPRNG (see the module docstring).

    Each coordinate is ``(z1 + z2 + z3 + z4) * std / 2`` with ``z_i`` float64 Box-Muller
    draws (std exactly ``std``), cast to ``dtype`` and moved to ``device`` at the end.
    """
    if not (std >= 0 and math.isfinite(std)):
        raise ValueError(f"std={std!r} is not allowed: expected a finite number >= 0")
    n = math.prod(shape)
    out = torch.empty(n, dtype=torch.float64)
    for start in range(0, n, _CHUNK):
        m = min(_CHUNK, n - start)
        draws = _standard_normal(_SUMMED_DRAWS * m).view(_SUMMED_DRAWS, m)
        out[start : start + m] = draws.sum(0) * (std / math.sqrt(_SUMMED_DRAWS))
    return out.view(tuple(shape)).to(dtype=dtype, device=device)
