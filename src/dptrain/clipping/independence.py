"""Check that each example's recorded inputs are what that example alone gives.

The self-check (:mod:`dptrain.clipping.self_check`) follows gradients, so it
sees every way example i's loss reaches other rows *through differentiable
paths*. It cannot see an example changing the others' inputs where no
gradient flows: batch statistics taken before the first trainable module (a
frozen front end that standardises by the batch mean), a detached batch mean,
routing with a capacity shared by the batch. There the rules read a_i, which
holds other examples' data, and one record can move the clipped sum by more
than C while every gradient row is clean.

So on the chunks the self-check runs on, the model is run again without
gradients, in eval mode (dropout off, so runs are comparable) and with the
random number generators restored afterwards: once on the whole chunk, and
once on each of a few examples alone (the first and the last). Every clipped
module records a summary of the first tensor input of each call: integer
inputs (ids) as they are, floating inputs projected on a fixed random vector
along their last (feature) dimension, so the check holds kilobytes where the
inputs of every layer would take hundreds of megabytes (a difference between
two rows survives a random projection with probability 1). Example i's rows
of the batched run must equal the run of example i alone (relative tolerance
by dtype, for kernels that block sums differently at batch size 1; float32 under
TF32 gets float16's, :mod:`~dptrain.clipping.precision`). A call
whose input has the same shape in both runs is a table shared by all examples
and must be equal as a whole. A mismatch refuses the model, naming the
module.

Limits: the check runs in eval mode, so mixing that a module does only in
training mode is not seen (BatchNorm, the usual case, is refused by type);
root inputs are split into examples by their first dimension (the model's
batch dimension, which the engine asks for anyway); where the model cannot
run on one example so split (an input laid out (B * heads, T, T)), the check
is skipped with an :class:`UnsupportedInputsWarning`.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dptrain.clipping.layout import example_slice
from dptrain.clipping.precision import tolerance_dtypes

if TYPE_CHECKING:  # pragma: no cover
    from dptrain.clipping.engine import ClippingEngine

__all__ = ["INPUT_TOLERANCE", "SummaryPool", "UnsupportedInputsWarning", "run", "summary"]


class UnsupportedInputsWarning(UserWarning):
    """The model's inputs could not be split into examples for the independence check."""


#: Relative tolerance between an example's input in the batched run and alone.
INPUT_TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.bfloat16: 5e-2,
    torch.float16: 5e-2,
}


def run(engine: ClippingEngine, uses, b: int) -> None:
    """Raise :class:`~dptrain.clipping.UnsupportedModelError` if an example's inputs to
    a clipped module depend on the other examples of the chunk."""
    from dptrain.clipping.engine import UnsupportedModelError

    if b < 2 or engine._root_inputs is None:
        return
    args, kwargs = engine._root_inputs
    unverified: list[str] = []
    tol_dtype_of = tolerance_dtypes(engine.model)  # float32 under TF32: float16's
    with _eval_mode(engine.model), _same_random_state(engine.model):
        batched = engine._probe_inputs(args, kwargs)
        for i in sorted({0, b - 1}):
            try:
                alone = engine._probe_inputs(*example_slice((args, kwargs), i, b))
            except Exception as e:  # inputs not split along dim 0 (a (B * heads, T, T) mask)
                warnings.warn(
                    f"dptrain could not run the model on example {i} alone to check that "
                    f"examples do not mix before its clipped modules ({type(e).__name__}: "
                    f"{e}); the check was skipped for this chunk (the gradient checks ran). "
                    "Pass every per-example input with the examples along dimension 0 to "
                    "enable it.",
                    UnsupportedInputsWarning,
                    stacklevel=4,
                )
                return
            for use in uses:
                want, got = batched.get(use, []), alone.get(use, [])
                if len(want) != len(got):
                    raise UnsupportedModelError(
                        f"module {use.name} ({type(use.module).__name__}) was called "
                        f"{len(want)} times on the chunk of {b} examples but {len(got)} times "
                        f"on example {i} alone: the model's computation depends on the batch, "
                        "so per-example clipping cannot bound one example's influence"
                    )
                for k, ((x_shape, dtype, x), (y_shape, _, y)) in enumerate(
                    zip(want, got, strict=True)
                ):
                    if x_shape[-1:] != y_shape[-1:]:  # the examples along the last dimension,
                        unverified.append(f"{use.name} ({type(use.module).__name__})")
                        continue  # which the projection sums over
                    err = _difference(x, y, i, b)
                    if err > INPUT_TOLERANCE.get(tol_dtype_of(dtype, x.device), 0.0):
                        raise UnsupportedModelError(
                            f"module {use.name} ({type(use.module).__name__}): the input of "
                            f"its call {k} for example {i} differs when the example is run "
                            f"alone (relative difference {err:.2e}). The model mixes examples "
                            "before this module where no gradient flows (batch statistics, a "
                            "detached batch mean, a capacity shared by the batch), so one "
                            "example changes what the others' gradients are computed from. "
                            "Compute such statistics per example, or freeze the module."
                        )
    if unverified:
        warnings.warn(
            "dptrain could not check that examples do not mix before these modules, whose "
            "input holds the examples along its last dimension: "
            + ", ".join(dict.fromkeys(unverified))
            + " (the gradient checks ran)",
            UnsupportedInputsWarning,
            stacklevel=3,
        )


class SummaryPool:
    """Storage for the summaries of one probe run, handed out from a few large blocks.

    A probe runs while the chunk's activations are alive, so the heap has no free room
    below its top: hundreds of small summaries allocated one by one land between each
    layer's temporaries and pin them, and glibc's heap grew by up to 400 MB (resident,
    never returned) on SmolLM2; copied into blocks, they pin nothing.
    """

    def __init__(self, block: int = 1 << 20):
        self.block = block
        self._blocks: dict[tuple, tuple[Tensor, int]] = {}  # (dtype, device) -> (block, used)

    def hold(self, v: Tensor) -> Tensor:
        """A copy of ``v`` in the pool."""
        key, n = (v.dtype, v.device), v.numel()
        block, used = self._blocks.get(key, (None, 0))
        if block is None or used + n > block.numel():
            block, used = v.new_empty(max(self.block, n)), 0
        self._blocks[key] = (block, used + n)
        return block[used : used + n].view(v.shape).copy_(v)


def summary(
    x: Tensor, pool: SummaryPool | None = None
) -> tuple[tuple[int, ...], torch.dtype, Tensor]:
    """(shape, dtype, values) of a module input: ids as they are; floating values
    projected on a fixed unit Gaussian vector along the last dimension, in float64
    (kept in ``pool`` where one is given)."""
    x = x.detach()
    if not x.is_floating_point():
        return tuple(x.shape), x.dtype, x
    if x.dim() == 0 or x.shape[-1] <= 1:
        values = x.double()
    else:
        values = x.double() @ _direction(x.shape[-1], x.device)
    return tuple(x.shape), x.dtype, values if pool is None else pool.hold(values)


_DIRECTIONS: dict = {}


def _direction(d: int, device: torch.device) -> Tensor:
    key = (d, device)
    if key not in _DIRECTIONS:
        r = torch.randn(d, generator=torch.Generator().manual_seed(d), dtype=torch.float64)
        _DIRECTIONS[key] = (r / r.norm()).to(device)
    return _DIRECTIONS[key]


def _difference(x: Tensor, y: Tensor, i: int, b: int) -> float:
    """Relative max difference between example i's part of x (batched run) and y (alone).

    The examples' dimension is the one where the two runs' shapes differ (b k rows
    against k: rows, or blocks of k rows per example, example-major); where none
    differs, the input is a table shared by all examples and must be equal as a whole.
    """
    differ = [d for d in range(x.dim()) if x.dim() == y.dim() and x.shape[d] != y.shape[d]]
    if x.dim() == y.dim() and not differ:
        part = x
    elif len(differ) == 1 and x.shape[differ[0]] == b * y.shape[differ[0]]:
        d, k = differ[0], y.shape[differ[0]]
        part = x.narrow(d, i * k, k)
    else:
        return float("inf")
    if not part.is_floating_point():
        return 0.0 if torch.equal(part, y) else float("inf")
    if part.numel() == 0:
        return 0.0
    nan = part.isnan()
    if not torch.equal(nan, y.isnan()):  # e.g. a batch std of one example alone
        return float("inf")
    part, y = part.masked_fill(nan, 0), y.masked_fill(nan, 0)
    diff = float((part.double() - y.double()).abs().max())
    if diff == 0.0:
        return 0.0
    scale = float(part.double().abs().max())
    return diff / scale if scale > 0 else float("inf")


@contextlib.contextmanager
def _eval_mode(model: torch.nn.Module):
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def _same_random_state(model: torch.nn.Module):
    """The probe runs draw no randomness that training would notice."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        yield
