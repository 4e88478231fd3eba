"""Check that each example's recorded inputs are what that example alone makes them.

The rows check (:mod:`dptrain.clipping.self_check`) follows gradients, so it
sees every way example i's loss reaches other rows *through differentiable
paths*. It cannot see an example changing the others' inputs where no
gradient flows: batch statistics taken before the first trainable module (a
frozen front end that standardises by the batch mean), a detached batch mean,
statistics of the batch taken only in training mode, routing with a capacity
shared by the batch. There the rules read a_i, which holds other examples'
data, and one record can move the clipped sum by more than C while every
gradient row is clean.

So on the chunks the self-check runs on, the model is run again without
gradients, **in the mode it is being trained in** (training mode: batch
statistics that a module takes only when training are seen), each run from the
random state the training forward began with (dropout draws the masks it drew,
since every run has the same shapes; a branch taken at random goes the same way), once on the chunk as it is and once per subset S_k of a
family that separates every ordered pair of examples
(:mod:`dptrain.clipping.separation`) on the chunk with every example outside
S_k *replaced* by a copy of an example in S_k whose data differ from it. The
chunk keeps its size and every tensor its shape, so every kernel runs with the
same shapes and blocking, and the inputs that each clipped module's calls
receive for the examples in S_k must be **bitwise** equal between the two
runs: a per-example computation gives the same bits for the same row whatever
the other rows hold (no tolerance, so the verdict depends neither on the
precision nor on how sums are blocked; an earlier form compared the chunk with
one example run alone, at batch size 1, whose kernels block sums differently,
and needed a tolerance by dtype). Every clipped module records a summary of
the first tensor input of each call: integer inputs (ids) as they are, floating
inputs projected on a fixed random vector along their last (feature)
dimension, so the check holds kilobytes where the inputs of every layer would
take hundreds of megabytes (a difference between two rows survives a random
projection with probability 1). A mismatch refuses the model, naming the
module; buffers the re-runs wrote are restored and the random state is left as
it was, so the checks change nothing the training run can see.

Limits: an example's replacement is one other example of the chunk, so a
statistic that happens not to change under that replacement (a maximum over
the batch held by a member) is not seen for that pair; the sensitivity test
makes the record an outlier instead. Root inputs are split into examples by
their first dimension (the model's batch dimension, which the engine asks for
anyway). Where a replacement changes the shape of a module's input (padding
trimmed to the chunk's longest example inside forward, tokens selected by their
labels), its rows cannot be matched and that module's call is reported in an
:class:`UnsupportedInputsWarning` as not verified (the gradient checks ran).
Where the losses' graph selects rows by index values anywhere (a mixture of
experts routes tokens), the sizes of some products inside the model change with
the replaced examples and their sums are blocked differently, so there the runs
are compared within :data:`INPUT_TOLERANCE` (by dtype) instead of bitwise.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import TYPE_CHECKING

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from dptrain.clipping.errors import UnsupportedModelError
from dptrain.clipping.heap import release_free_memory
from dptrain.clipping.precision import tolerance_dtypes
from dptrain.clipping.separation import separating_masks

if TYPE_CHECKING:  # pragma: no cover
    from dptrain.clipping.check_interface import Reruns

__all__ = [
    "INPUT_TOLERANCE",
    "SummaryPool",
    "UnsupportedInputsWarning",
    "random_state",
    "run",
    "summary",
]

#: Relative tolerance between a kept example's inputs in the two runs, by dtype, used
#: only where the losses' graph selects rows by index values (routing): there the sizes
#: of some products (tokens per expert) change with the replaced examples, and kernels
#: block their sums differently. Everywhere else the runs must agree bitwise.
INPUT_TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.bfloat16: 5e-2,
    torch.float16: 5e-2,
}


class UnsupportedInputsWarning(UserWarning):
    """The independence check could not verify some module's inputs on a chunk."""


def run(engine: Reruns, uses, b: int) -> None:
    """Raise :class:`~dptrain.clipping.UnsupportedModelError` if an example's inputs to
    a clipped module depend on the other examples of the chunk."""
    if b < 2 or engine.root_inputs is None:
        return
    tree = engine.root_inputs
    unverified: dict[str, None] = {}
    tol_dtype_of = tolerance_dtypes(engine.model)  # float32 under TF32: float16's

    def tolerance(x) -> float:
        if not engine.sizes_by_data:
            return 0.0
        (_, dtype, values) = x
        return INPUT_TOLERANCE.get(tol_dtype_of(dtype, values.device), 0.0)

    with _replays(engine.model, engine.root_random_state) as restart:
        restart()
        base = engine.probe(*tree)
        release_free_memory()  # the re-run's activations: freed, still resident (heap.py)
        for mask in separating_masks(b):
            replaced = _replaced(tree, mask, b)
            if replaced is None:  # the examples outside are copies of those inside
                if engine.lockstep:
                    # nothing to compare, but the other ranks run this pass (under FSDP2
                    # each forward gathers parameters from all ranks): run it too
                    restart()
                    engine.probe(*tree)
                continue
            restart()
            try:
                got = engine.probe(*replaced)
            except Exception as e:  # a model that cannot run on its own examples reordered
                warnings.warn(
                    f"dptrain could not run the model on the chunk with some examples replaced "
                    f"by others of the chunk, to check that examples do not mix before its "
                    f"clipped modules ({type(e).__name__}: {e}); the check was skipped for this "
                    "chunk (the gradient checks ran). Pass every per-example input with the "
                    "examples along dimension 0 to enable it.",
                    UnsupportedInputsWarning,
                    stacklevel=4,
                )
                return
            release_free_memory()
            members = mask.nonzero().flatten().tolist()
            for use in uses:
                want, have = base.get(use, []), got.get(use, [])
                if len(want) != len(have):
                    raise UnsupportedModelError(
                        f"module {use.name} ({type(use.module).__name__}) was called "
                        f"{len(want)} times on the chunk of {b} examples but {len(have)} times "
                        f"when examples outside {members} were replaced: which modules an "
                        "example goes through depends on the other examples, so per-example "
                        "clipping cannot bound one example's influence"
                    )
                for k, (x, y) in enumerate(zip(want, have, strict=True)):
                    call = use.calls[k] if k < len(use.calls) else None
                    bd = 0 if call is None else call.batch_dim
                    verdict = _same_rows(x, y, mask, b, bd, tolerance(x))
                    if verdict is None:
                        unverified[f"{use.name} ({type(use.module).__name__})"] = None
                    elif verdict >= 0:
                        raise UnsupportedModelError(
                            f"module {use.name} ({type(use.module).__name__}): the input of its "
                            f"call {k} for example {verdict} changed when other examples of "
                            f"the chunk were replaced (examples {members} kept). The model "
                            "mixes examples before this module where no gradient flows (batch "
                            "statistics, a detached batch mean, statistics taken only in "
                            "training mode, a capacity shared by the batch), so one example "
                            "changes what the others' gradients are computed from. Compute "
                            "such statistics per example, or freeze the modules before it."
                        )
    if unverified:
        warnings.warn(
            "dptrain could not check that examples do not mix before these modules, whose "
            "inputs change shape when other examples of the chunk change (padding trimmed to "
            "the longest example, tokens selected by the data) or hold the examples along "
            "their last dimension: " + ", ".join(unverified) + " (the gradient checks ran)",
            UnsupportedInputsWarning,
            stacklevel=3,
        )


def _replaced(tree, mask: Tensor, b: int):
    """``tree`` with every example outside ``mask`` replaced by an example inside whose
    rows differ from its own, in every tensor with b rows along dimension 0; None where
    no example outside differs from every example inside."""
    flat, spec = tree_flatten(tree)
    rows = [k for k, v in enumerate(flat) if isinstance(v, Tensor) and v.dim() and len(v) == b]
    members = mask.nonzero().flatten().tolist()
    source = {}
    for j in (~mask).nonzero().flatten().tolist():
        # start at a different member for each outside example, so they do not all
        # become copies of one
        for s in members[j % len(members) :] + members[: j % len(members)]:
            if any(not torch.equal(flat[k][j], flat[k][s]) for k in rows):
                source[j] = s
                break
    if not source:
        return None
    targets = torch.tensor(list(source))
    sources = torch.tensor(list(source.values()))
    for k in rows:
        v = flat[k].clone()
        v[targets.to(v.device)] = flat[k][sources.to(v.device)]
        flat[k] = v
    return tree_unflatten(flat, spec)


def _same_rows(x, y, mask: Tensor, b: int, batch_dim: int, tol: float) -> int | None:
    """-1 where the examples in ``mask`` have the same rows in both summaries (bitwise,
    or within relative ``tol``), else the first example whose rows differ; None where
    they cannot be matched (the shapes differ, or the examples lie along the summed
    last dimension).

    A dimension of b rows (or of b blocks of rows, example-major) along ``batch_dim``
    holds the examples; any other input is shared by all and must be equal as a whole.
    """
    (x_shape, _, xs), (y_shape, _, ys) = x, y
    if x_shape != y_shape:
        return None
    projected = xs.dim() < len(x_shape)
    if projected and batch_dim == len(x_shape) - 1:
        return None
    if batch_dim < xs.dim() and xs.shape[batch_dim] % b == 0 and xs.shape[batch_dim] > 0:
        xr = xs.movedim(batch_dim, 0).reshape(b, -1)
        yr = ys.movedim(batch_dim, 0).reshape(b, -1)
        for i in mask.nonzero().flatten().tolist():
            if not _equal(xr[i], yr[i], tol):
                return i
        return -1
    return -1 if _equal(xs, ys, tol) else int(mask.nonzero()[0, 0])


def _equal(x: Tensor, y: Tensor, tol: float) -> bool:
    """Equal values (within relative ``tol`` of x's largest), NaN where the other has NaN
    (a NaN row is the same NaN row)."""
    if not x.is_floating_point():
        return torch.equal(x, y)
    nan = x.isnan()
    if not torch.equal(nan, y.isnan()):
        return False
    x, y = x.masked_fill(nan, 0), y.masked_fill(nan, 0)
    if torch.equal(x, y):
        return True
    if tol == 0.0:
        return False
    return float((x - y).abs().max()) <= tol * float(x.abs().max())


def random_state(model: torch.nn.Module) -> tuple:
    """The random state of the devices ``model`` runs on (CPU, and its CUDA devices)."""
    devices = _cuda_devices(model)
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices]


def _cuda_devices(model: torch.nn.Module) -> list[int]:
    # Before CUDA is initialised no tensor can be on a GPU: no walk over the parameters
    # (run before every training forward; milliseconds for a LoRA model's hundreds).
    if not torch.cuda.is_initialized():
        return []
    return sorted({p.get_device() for p in model.parameters() if p.is_cuda})


@contextlib.contextmanager
def _replays(model: torch.nn.Module, start: tuple | None):
    """Re-runs that leave no trace: ``restart()`` puts back the random state ``start``
    (the state the training forward began from, so every run draws what it drew) and the
    buffers a run wrote; the random state and the buffers are as before at the end.
    """
    buffers = [(buf, buf._version, buf.clone()) for buf in model.buffers()]
    with torch.random.fork_rng(devices=_cuda_devices(model)):
        cpu, cuda = start if start is not None else random_state(model)

        def restart() -> None:
            torch.set_rng_state(cpu)
            for d, state in cuda:
                torch.cuda.set_rng_state(state, d)
            for buf, version, saved in buffers:
                if buf._version != version:
                    buf.copy_(saved)

        try:
            yield restart
        finally:
            restart()


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
