"""The engine's exact self-check, run on a chunk whose layout pattern is new.

The clipping engine reads example i's gradient from row i of each recorded
call (see :mod:`dptrain.clipping.layout`). That is right only if example i's
loss reaches no other row and the rules reconstruct the whole gradient. Both
are checked with one extra backward pass, of the re-weighted loss
sum_i w_i L_i with weights w_i = 2^e_i (e_i random in -3..3):

1. **Rows.** For every recorded output, d(sum_i w_i L_i)/d out must equal
   w_i * d(sum_i L_i)/d out in row i. Powers of two scale floating-point
   numbers exactly, so for a correct layout the two agree to the last bit on
   a deterministic backend; a row that carries the gradient of another
   example's loss (a shared table whose length equals the chunk size, a
   time-first tensor with T = B, an operation that mixes the examples, a loss
   with in-batch negatives) differs by an amount of the order of the mixing.
   A streamed module's g is not kept (engine._output_gradients): the test is made
   on what the engine reads from row i, example i's gradient formed from it.
2. **Completeness.** For every clipped parameter, the rules' weighted sum
   sum_i w_i grad_i (book-keeping from the recorded a and g) must equal
   autograd's gradient of sum_i w_i L_i. This checks each rule's algebra on
   the module it was given (a registered rule for the wrong type, a generic
   rule on a module it cannot handle) and any gradient path the records miss.

The weights come from a fixed-seed generator: they carry no data and need no
privacy. The check's cost is one backward (with parameter gradients) on the
chunks where a pattern is new, usually the first chunk and a handful more.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dptrain.clipping.precision import tolerance_dtypes

if TYPE_CHECKING:  # pragma: no cover
    from dptrain.clipping.engine import ClippingEngine

__all__ = ["ROW_TOLERANCE", "SUM_TOLERANCE", "check_weights", "run"]

#: Relative tolerance of the rows check, by the dtype of the recorded gradient. A
#: correct layout agrees exactly on CPU; the slack is for reordered sums on GPUs.
ROW_TOLERANCE = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.bfloat16: 1e-3,
    torch.float16: 1e-3,
}
#: Relative tolerance of the completeness check: the rules and autograd sum in
#: different orders (and, under autocast, in different precisions).
SUM_TOLERANCE = {
    torch.float64: 1e-9,
    torch.float32: 1e-4,
    torch.bfloat16: 5e-2,
    torch.float16: 5e-2,
}

_EXPONENTS = torch.arange(-3, 4)


def check_weights(b: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Tensor:
    """(b,) powers of two, pairwise distinct where b <= 7, from a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    if b <= len(_EXPONENTS):
        e = _EXPONENTS[torch.randperm(len(_EXPONENTS), generator=gen)[:b]]
    else:
        e = _EXPONENTS[torch.randint(len(_EXPONENTS), (b,), generator=gen)]
    return torch.pow(2.0, e.to(torch.float64)).to(dtype=dtype, device=device)


def run(engine: ClippingEngine, losses: Tensor, calls, grads, records, parts) -> None:
    """Raise :class:`~dptrain.clipping.UnsupportedModelError` if the chunk fails the check.

    ``calls``: every recorded (use, call) the losses depend on; ``grads``: their output
    gradients, None for a streamed call, whose per-example gradients were formed during
    the backward and its g dropped (``parts[call]``: (those gradients, g's dtype, g's
    device), or None where g was None; engine._output_gradients).

    One backward of sum_i w_i L_i. Its gradients are checked as autograd produces them
    and then dropped (hooks on the recorded outputs' nodes and on the parameters), so the
    check never holds a second copy of every output gradient and every parameter
    gradient: on the first chunk that would raise the run's peak memory.
    """
    from dptrain.clipping.engine import UnsupportedModelError

    b = losses.shape[0]
    w = check_weights(b, losses.dtype, losses.device, seed=engine.self_checks)
    edges = [call.edge for _, call in calls]
    # g's dtype and device per call (a streamed call's g is gone: kept in parts), or None
    g_meta = [
        parts[call][1:] if parts.get(call) else ((g.dtype, g.device) if g is not None else None)
        for (_, call), g in zip(calls, grads, strict=True)
    ]
    g_dtypes = [None if m is None else m[0] for m in g_meta]
    g_devices = [None if m is None else m[1] for m in g_meta]
    low = any(d in (torch.bfloat16, torch.float16) for d in g_dtypes)
    dtype = _record_dtype(
        [g for _, g in records.values()]
        + [t for part in parts.values() if part for t in part[0].values()]
    )
    w_records = w.to(dtype)
    # float32 on a GPU with TF32 matrix products rounds as float16 does (precision.py)
    tol_dtype_of = tolerance_dtypes(engine.model)
    tol = (
        SUM_TOLERANCE[torch.bfloat16] if low else SUM_TOLERANCE[tol_dtype_of(dtype, losses.device)]
    )

    # rows: per recorded output, the weighted gradient against w_i times the plain one
    row_errors: list[float] = [0.0 if d is None else math.inf for d in g_dtypes]
    by_node: dict[int, list[int]] = {}
    for k, edge in enumerate(edges):
        by_node.setdefault(id(edge.node), []).append(k)

    def rows_hook(node):
        def hook(grad_outputs):
            for k in by_node[id(node)]:
                use, call = calls[k]
                wg = grad_outputs[edges[k].output_nr]
                if call in parts:
                    row_errors[k] = _streamed_rows_error(engine, use, call, parts[call], wg, w)
                    continue
                if wg is not None and call.batch_dim:
                    wg = wg.movedim(call.batch_dim, 0)
                row_errors[k] = _rows_error(grads[k], wg, w, b)

        return hook

    # completeness: per parameter, (max |mine - auto|, max |auto|, max |mine|)
    names = [
        n
        for n in engine.parameter_names
        if any(engine._recorded(u, records) for u, _ in engine._groups[n])
    ]
    params = {id(engine.parameter(n)): n for n in names}
    seen: dict[str, tuple[float, float, float]] = {}
    sums: dict = {}

    def param_hook(p):
        name = params[id(p)]
        present = [(u, attr) for u, attr in engine._groups[name] if engine._recorded(u, records)]
        mine = engine._weighted_sum_of(name, present, records, w_records, sums)
        seen[name] = _gaps(mine, p.grad)
        p.grad = None  # autograd's gradient is not kept; the engine's is restored below

    saved = {n: engine.parameter(n).grad for n in names}
    handles = [
        e.node.register_prehook(rows_hook(e.node)) for e in {id(e.node): e for e in edges}.values()
    ]
    handles += [engine.parameter(n).register_post_accumulate_grad_hook(param_hook) for n in names]
    try:
        for n in names:
            engine.parameter(n).grad = None
        torch.autograd.backward(
            (losses * w).sum(),
            inputs=[engine.parameter(n) for n in names],
            retain_graph=not engine._sum_from_records,  # ghost: its second backward follows
        )
    finally:
        for h in handles:
            h.remove()
        for n, g in saved.items():
            engine.parameter(n).grad = g

    for (use, call), g_dtype, g_device, err in zip(
        calls, g_dtypes, g_devices, row_errors, strict=True
    ):
        # float32 under TF32 on a GPU is checked at float16's tolerance (precision.py)
        tol_dtype = torch.float32 if g_dtype is None else tol_dtype_of(g_dtype, g_device)
        if err > ROW_TOLERANCE.get(tol_dtype, 1e-5):
            raise UnsupportedModelError(
                f"module {use.name} ({type(use.module).__name__}): the rows of its "
                f"{_describe(call, b)} are not one per example: re-weighting each example's "
                f"loss changed row i by more than that example's weight (relative error "
                f"{err:.2e}). Example i's loss reaches rows of other examples, so clipping "
                "these rows would not bound one example's influence. Typical causes: a table "
                f"shared by all examples whose length equals the chunk size ({b}; pass its "
                "ids with a batch dimension, shape (1, T), or change max_physical_batch_size), "
                "a time-first (T, B, ...) tensor with T = B, or an operation that mixes "
                "examples (batch statistics, in-batch negatives in the loss)."
            )

    # A parameter whose gradient is zero by symmetry (BERT's key bias: softmax ignores
    # a shift shared by all keys) has only rounding noise to compare: its scale is
    # floored at sqrt(tol) times the largest gradient of the model.
    for name in names:  # parameters autograd gave no gradient: compared with zero
        if name not in seen:
            present = [
                (u, attr) for u, attr in engine._groups[name] if engine._recorded(u, records)
            ]
            mine = engine._weighted_sum_of(name, present, records, w_records, sums)
            seen[name] = _gaps(mine, None)
    floor = math.sqrt(tol) * max((auto for _, auto, _ in seen.values()), default=0.0)
    for name in names:
        diff, auto, mine = seen[name]
        scale = max(auto, mine, floor)
        err = diff / scale if scale > 0 else 0.0
        ptol = tol
        if any(u.rule.float32_inside for u, _ in engine._groups[name]):
            ptol = max(tol, SUM_TOLERANCE[tol_dtype_of(torch.float32, losses.device)])
        if err > ptol:
            owners = ", ".join(
                f"{u.name} ({type(u.module).__name__})" for u, _ in engine._groups[name]
            )
            raise UnsupportedModelError(
                f"parameter {name}: the gradient the engine reconstructs from the recorded "
                f"calls of {owners} differs from autograd's by {err:.2e} (relative). The rule "
                "for this module type does not compute its gradient exactly (a rule registered "
                "for a type it does not fit?), or part of the gradient bypasses the module's "
                "recorded input and output. Register a rule that fits, or freeze the parameter."
            )


def _gaps(mine: Tensor | None, auto: Tensor | None) -> tuple[float, float, float]:
    """(max |mine - auto|, max |auto|, max |mine|), None read as zero."""
    if mine is None and auto is None:
        return 0.0, 0.0, 0.0
    ref = auto if auto is not None else mine
    mine = torch.zeros_like(ref) if mine is None else mine.to(ref.dtype)
    auto = torch.zeros_like(ref) if auto is None else auto
    if not ref.numel():
        return 0.0, 0.0, 0.0
    return float((mine - auto).abs().max()), float(auto.abs().max()), float(mine.abs().max())


def _rows_error(g: Tensor | None, wg: Tensor | None, w: Tensor, b: int) -> float:
    """max_i ||wg_i - w_i g_i|| / max_i ||w_i g_i|| (0 where both are absent or zero)."""
    if g is None and wg is None:
        return 0.0
    if g is None or wg is None:
        return float("inf")
    g = g.reshape(b, -1).to(torch.float64)
    wg = wg.reshape(b, -1).to(torch.float64)
    want = g * w.to(torch.float64)[:, None]
    scale = float(want.norm(dim=1).max())
    diff = float((wg - want).norm(dim=1).max())
    if scale == 0:
        return 0.0 if diff == 0 else float("inf")
    return diff / scale


def _streamed_rows_error(engine, use, call, part, wg: Tensor | None, w: Tensor) -> float:
    """The rows test for a streamed call, whose g was not kept: on what the engine reads
    from row i, example i's gradient. Formed from the re-weighted g it must be w_i times
    the one formed from g; a row carrying another example's loss changes it unless that
    contribution vanishes in example i's gradient, the quantity clipped (part: the
    call's per-example gradients, g's dtype and device, or None where g was None)."""
    b = w.shape[0]
    if part is None or wg is None:
        return 0.0 if part is None and wg is None else math.inf
    weighted = engine._call_per_example(use, call, wg, b)
    call.a = None  # its last reader: the input goes as this backward frees the graph
    return max((_rows_error(v, weighted[k], w, b) for k, v in part[0].items()), default=0.0)


def _describe(call, b: int) -> str:
    if call.expanded_to is not None:
        return f"output (a shared table expanded to {tuple(call.out_shape)})"
    return f"input {call.a_shape} / output {tuple(call.out_shape)} ({b} examples)"


def _record_dtype(tensors) -> torch.dtype:
    """float64 if any of the records' tensors is, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
