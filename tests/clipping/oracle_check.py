"""Shared harness: engine vs the microbatch oracle (batch-size-1 backward passes)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from dptrain.clipping import (
    ClippingEngine,
    automatic_factors,
    flat_factors,
    oracle_clipped_sum,
    oracle_norms,
    oracle_per_example_grads,
)

TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
# Below this size a reference value is rounding noise (e.g. a loss that is exactly
# zero by symmetry but computes to 1e-13): errors are measured against the floor.
SCALE_FLOOR = {torch.float64: 1e-9, torch.float32: 1e-4}


def relative_error(got: Tensor, want: Tensor, floor: float | None = None) -> float:
    """max |got - want| / max(max |want|, floor (default: the dtype's))."""
    scale = max(want.abs().max().item(), SCALE_FLOOR[want.dtype] if floor is None else floor)
    return (got.to(want.dtype) - want).abs().max().item() / scale


def assert_engine_matches_oracle(
    model: nn.Module,
    losses_of: Callable[[slice], Tensor],
    batch_size: int,
    *,
    mode: str,
    norm_method: str = "auto",
    clipping: str = "flat",
    dtype: torch.dtype = torch.float64,
    engine: ClippingEngine | None = None,
    tol: float | None = None,
    scale_floor: float | None = None,
    units: Tensor | None = None,
) -> None:
    """Per-example norms and the noiseless clipped sum equal the oracle's.

    ``losses_of(slice)`` runs the model on those examples and returns their
    per-example losses. C is set to the median norm so some examples are
    clipped and some are not. ``engine``: use this engine (its C is reset), e.g.
    one that has seen earlier chunks; it is left attached. ``tol``: the relative
    tolerance, default by dtype (for models that compute parts in lower precision);
    ``scale_floor``: below it a reference value counts as rounding noise (default by dtype).
    ``units``: a privacy-unit id per example; the oracle's unit gradient is the sum of its
    examples' batch-size-1 gradients, units in order of first appearance.
    """
    tol = TOLERANCE[dtype] if tol is None else tol
    grads = oracle_per_example_grads(model, lambda i: losses_of(slice(i, i + 1)).sum(), batch_size)
    if units is not None:
        grads = {n: _unit_sums(g, units) for n, g in grads.items()}
    norms = oracle_norms(grads) if batch_size else torch.zeros(0, dtype=dtype)
    c = float(norms.median()) if batch_size else 1.0
    c = c if c > 0 else 1.0
    own = engine is None
    if own:
        engine = ClippingEngine(model, c, mode=mode, norm_method=norm_method, clipping=clipping)
    else:
        engine.clear()  # forget the oracle's forward passes
        engine.max_grad_norm = c
    try:
        stats = engine.backward(losses_of(slice(0, batch_size)), units=units)
    finally:
        if own:
            engine.detach()
    if batch_size == 0:
        for p in model.parameters():
            assert p.grad is None or p.grad.abs().max() == 0
        return
    assert relative_error(stats.norms.to(dtype), norms) <= tol, "per-example norms differ"
    if clipping == "per_layer":
        want = _per_layer_sum(engine, grads)
    else:
        factors = flat_factors(norms, c) if clipping == "flat" else automatic_factors(norms, c)
        want = oracle_clipped_sum(grads, factors)
    got = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert set(got) == set(want)
    for name in want:
        assert got[name] is not None, f"{name} got no gradient"
        err = relative_error(got[name], want[name], scale_floor)
        assert err <= tol, f"{name}: clipped sum off by {err:.2e} (mode={mode}, {norm_method})"
    model.zero_grad(set_to_none=True)


def _unit_sums(grads: Tensor, units: Tensor) -> Tensor:
    """(B, ...) per-example gradients -> (U, ...) per-unit sums, in order of first appearance."""
    order = list(dict.fromkeys(units.tolist()))
    return torch.stack([grads[units == u].sum(0) for u in order])


def _per_layer_sum(engine: ClippingEngine, grads: dict[str, Tensor]) -> dict[str, Tensor]:
    """Oracle per-layer clipping: each group's per-example norm clipped at its C_l."""
    group_of = {name: engine._group_of(name, uses) for name, uses in engine._groups.items()}
    # Map oracle names (first name of each parameter) to engine names by identity.
    by_id = {id(p): n for n, p in engine.model.named_parameters()}
    engine_name = {
        by_id[id(getattr(uses[0][0].module, uses[0][1]))]: n for n, uses in engine._groups.items()
    }
    sq: dict[str, Tensor] = {}
    for name, g in grads.items():
        grp = group_of[engine_name[name]]
        sq[grp] = sq.get(grp, 0) + g.flatten(1).pow(2).sum(1)
    factors = {
        grp: flat_factors(v.sqrt(), engine.layer_max_grad_norms[grp]) for grp, v in sq.items()
    }
    return {
        name: torch.einsum("b,b...->...", factors[group_of[engine_name[name]]].to(g.dtype), g)
        for name, g in grads.items()
    }
