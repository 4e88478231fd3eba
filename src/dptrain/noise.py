"""The tensor work of a noised step: Gaussian noise drawn in a few large blocks, the sums
divided and handed to ``p.grad``, with a handful of kernel launches rather than several per
parameter.

Why blocks. One ``normal_``, one add and one norm per parameter is three kernel launches per
parameter (816 on a 30-layer Llama with 272 parameters, beside the casts that hand each sum
to ``p.grad``); on a GPU the private step waits for the host to issue them (issue 27: the
step was launch-bound). Here the sums are taken in parameter order and cut into blocks of
one device and dtype and at most ``block_numel`` elements (a larger parameter is a block
alone). Each block's noise is one draw: a flat tensor filled by one ``normal_`` from the
device's generator, cut into views shaped as the block's sums, added with one
``_foreach_add_`` and measured with one norm of the flat tensor.

Why this is the same mechanism. Every coordinate of every sum still gets its own
N(0, std^2) draw, independent of all others and of the data (Abadi et al. 2016, Alg. 1,
line "Add noise"); only which output of the generator lands on which coordinate differs
from a draw per parameter. The layout depends on the parameter order, their shapes, devices
and dtypes and ``block_numel`` alone, so a seed reproduces the noise exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch._utils import _unflatten_dense_tensors

__all__ = [
    "BLOCK_NUMEL",
    "add_noise_",
    "divide_and_publish",
    "noise_blocks",
    "total_norm",
    "total_norms",
]

#: Elements per noise block (8M: 32 MB of float32 noise alive beside the sums at a time,
#: or the largest parameter's size where that is larger).
BLOCK_NUMEL = 1 << 23


def _blocks(sums: list[Tensor], block_numel: int) -> list[list[int]]:
    """Indices of ``sums``, in order, cut where the device or dtype changes or where a block
    would pass ``block_numel`` elements."""
    blocks: list[list[int]] = []
    size = 0
    key = None
    for i, s in enumerate(sums):
        k = (s.device, s.dtype)
        if not blocks or k != key or size + s.numel() > block_numel:
            blocks.append([])
            key, size = k, 0
        blocks[-1].append(i)
        size += s.numel()
    return blocks


def _draws(
    sums: list[Tensor],
    std: float,
    generator_for: Callable[[torch.device], torch.Generator],
    block_numel: int,
) -> Iterator[tuple[list[int], Tensor, list[Tensor]]]:
    """For each block: its indices, its flat noise and the views of it shaped as its sums."""
    if block_numel < 1:
        raise ValueError(f"block_numel={block_numel!r} is not allowed: expected an integer >= 1")
    for block in _blocks(sums, block_numel):
        first = sums[block[0]]
        shaped_as = [sums[i] for i in block]
        flat = torch.empty(
            sum(s.numel() for s in shaped_as), dtype=first.dtype, device=first.device
        )
        flat.normal_(0.0, std, generator=generator_for(first.device))
        # the views in one call (DDP's bucket views): a Python view per parameter cost the
        # noise step a millisecond on a 272-parameter model
        yield block, flat, list(_unflatten_dense_tensors(flat, shaped_as))


def noise_blocks(
    sums: list[Tensor],
    std: float,
    generator_for: Callable[[torch.device], torch.Generator],
    block_numel: int = BLOCK_NUMEL,
) -> Iterator[tuple[list[int], list[Tensor]]]:
    """For each block (module docstring): the indices of its sums and its noise, one view
    per sum shaped as the sum, N(0, std^2) in the sum's dtype, drawn with
    ``generator_for(device)``. A block's noise lives until the next is drawn."""
    for block, _, views in _draws(sums, std, generator_for, block_numel):
        yield block, views


def add_noise_(
    sums: list[Tensor],
    std: float,
    generator_for: Callable[[torch.device], torch.Generator],
    block_numel: int = BLOCK_NUMEL,
) -> list[Tensor]:
    """sums[i] += N(0, std^2 I) in place, drawn as :func:`noise_blocks` draws it; returns
    the L2 norm of each block's noise (tensors, in block order: no host sync), whose
    :func:`total_norm` is the noise's."""
    norms = []
    for block, flat, noise in _draws(sums, std, generator_for, block_numel):
        torch._foreach_add_([sums[i] for i in block], noise)
        norms.append(torch.linalg.vector_norm(flat))  # one reduction, not one per sum
    return norms


def divide_and_publish(params: list[nn.Parameter], sums: list[Tensor], divisor: float) -> None:
    """sums /= divisor in place, then ``p.grad`` <- the sum, cast to p's dtype after (for a
    float16/bfloat16 parameter the sum is the engine's float32 one; the cast is
    post-processing of the noised value)."""
    if not sums:
        return
    torch._foreach_div_(sums, divisor)
    cast = [(p, s) for p, s in zip(params, sums, strict=True) if s is not p.grad]
    if not cast:
        return
    grads = [torch.empty_like(p) for p, _ in cast]
    torch._foreach_copy_(grads, [s for _, s in cast])
    for (p, _), g in zip(cast, grads, strict=True):
        p.grad = g


def total_norm(norms: list[Tensor]) -> float:
    """sqrt(sum of squares) of per-tensor norms (as :func:`add_noise_` returns them), in
    float64, read once (one host sync)."""
    return total_norms(norms)[0]


def total_norms(*groups: list[Tensor]) -> tuple[float, ...]:
    """:func:`total_norm` of each group of per-tensor norms (0.0 for an empty one), all read
    from the device together: one host sync for all the groups. On a GPU each read waits
    for every kernel queued before it, and the host then has to issue the next ones with
    the GPU idle; a private step reads its diagnostics (the clipped sums' norm and the
    noise's) once."""
    totals = []
    for norms in groups:
        if not norms:
            continue
        device = norms[0].device
        if any(n.device != device for n in norms):  # a model across devices: gathered on one
            norms = [n.to(device) for n in norms]
        totals.append(torch.linalg.vector_norm(torch.stack(norms).double()))
    if not totals:
        return (0.0,) * len(groups)
    device = totals[0].device
    read = iter(torch.stack([t.to(device) for t in totals]).tolist())
    return tuple(next(read) if norms else 0.0 for norms in groups)
