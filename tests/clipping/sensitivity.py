"""The acceptance test of the engine: one record moves the clipped sum by at most C.

Scale one example's loss by lambda in {0, 1, 10, 1e3, 1e6} (lambda = 0 removes the
record's influence); the noiseless clipped sum over the chunk, for each lambda,
may differ from any other by at most C (plus 1e-9 slack), or the engine must
refuse the model. The sums are compared pairwise, so a model that leaks the
record into other examples' rows or bypasses clipping fails for large lambda.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from copy import deepcopy

import torch
from torch import Tensor, nn

from dptrain.clipping import ClippingEngine, UnsupportedModelError

LAMBDAS = (0.0, 1.0, 10.0, 1e3, 1e6)
SLACK = 1e-9

REFUSED = "refused"
PRIVATE = "private"


def clipped_sums(
    model: nn.Module,
    losses_of: Callable[[], Tensor],
    index: int,
    *,
    max_grad_norm: float,
    mode: str,
    clipping: str = "flat",
    units: Tensor | None = None,
    sum_rounding: str = "exact",
    norm_method: str = "auto",
) -> list[Tensor]:
    """The flattened noiseless clipped sum for each lambda (example ``index`` scaled; with
    ``units``, a privacy-unit id per example, every example of unit ``index``)."""
    engine = ClippingEngine(
        model,
        max_grad_norm,
        mode=mode,
        clipping=clipping,
        sum_rounding=sum_rounding,
        norm_method=norm_method,
    )
    params = engine.parameters()
    out = []
    try:
        for lam in LAMBDAS:
            model.zero_grad(set_to_none=True)
            losses = losses_of()
            scale = torch.ones_like(losses)
            scale[index if units is None else units == index] = lam
            engine.backward(losses * scale, units=units)
            # what the optimizer noises: p.grad, or a bf16 parameter's float32 sum behind it
            sums = [engine.clipped_sum(p) for p in params]
            out.append(
                torch.cat(
                    [
                        (s if s is not None else torch.zeros_like(p)).flatten().double()
                        for p, s in zip(params, sums, strict=True)
                    ]
                )
            )
    finally:
        engine.detach()
        model.zero_grad(set_to_none=True)
    return out


def sensitivity(
    model: nn.Module,
    losses_of: Callable[[], Tensor],
    index: int = 0,
    *,
    max_grad_norm: float = 1.0,
    mode: str = "book_keeping",
    clipping: str = "flat",
    slack: float = SLACK,
    units: Tensor | None = None,
    sum_rounding: str = "exact",
) -> tuple[str, float]:
    """(REFUSED, nan) or (PRIVATE, max pairwise distance / C); asserts the bound.

    ``slack``: relative slack; 1e-9 unless the model computes in lower precision inside.
    """
    try:
        sums = clipped_sums(
            model,
            losses_of,
            index,
            max_grad_norm=max_grad_norm,
            mode=mode,
            clipping=clipping,
            units=units,
            sum_rounding=sum_rounding,
        )
    except UnsupportedModelError:
        return REFUSED, float("nan")
    worst = max(float((x - y).norm()) for x, y in itertools.combinations(sums, 2))
    assert worst <= max_grad_norm * (1 + slack) + SLACK, (
        f"one record moved the clipped sum by {worst / max_grad_norm:.3f} C (mode={mode})"
    )
    return PRIVATE, worst / max_grad_norm


def neighbour_sensitivity(
    model: nn.Module,
    chunks_of: Callable[[nn.Module, int], list[Callable[[], Tensor]]],
    variants: int,
    *,
    max_grad_norm: float = 1.0,
    mode: str = "book_keeping",
    slack: float = SLACK,
    between: Callable[[nn.Module], None] | None = None,
) -> tuple[str, float]:
    """The bound over neighbouring data where the forward itself may carry the record:
    (REFUSED, nan) or (PRIVATE, max distance / C); asserts the bound.

    Variant v runs a fresh copy of ``model`` (its state included) through the chunks
    ``chunks_of(copy, v)`` in order, each a thunk returning per-example losses for one
    clipped backward (``p.grad`` cleared before each, no optimizer step). Variant 0 is
    the data without the record; the others hold it (as it is, an outlier, ...). The
    last chunk's clipped sum of each may differ from variant 0's by at most C (adding
    or removing one record). With the record in the last chunk this bounds mixing in
    the forward (batch statistics), which scaling its loss cannot see; with the record
    only in an earlier chunk, state that a forward wrote (then the last chunk should
    not move at all). ``between(copy)`` runs after each chunk but the last: a change of
    the parameters that does not depend on the data, standing in for the optimizer's
    noised step (the same noise in every variant).
    """
    sums = []
    for v in range(variants):
        copy = deepcopy(model)
        engine = None
        try:
            engine = ClippingEngine(copy, max_grad_norm, mode=mode)
            chunks = chunks_of(copy, v)
            for k, losses_of in enumerate(chunks):
                copy.zero_grad(set_to_none=True)
                engine.backward(losses_of())
                if between is not None and k < len(chunks) - 1:
                    with torch.no_grad():
                        between(copy)
            sums.append(
                torch.cat(
                    [
                        (s if s is not None else torch.zeros_like(p)).flatten().double()
                        for p in engine.parameters()
                        for s in [engine.clipped_sum(p)]
                    ]
                )
            )
        except UnsupportedModelError:
            return REFUSED, float("nan")
        finally:
            if engine is not None:
                engine.detach()
    worst = max(float((x - sums[0]).norm()) for x in sums[1:])
    assert worst <= max_grad_norm * (1 + slack) + SLACK, (
        f"one record moved the clipped sum by {worst / max_grad_norm:.3f} C (mode={mode})"
    )
    return PRIVATE, worst / max_grad_norm


def zoo_case_outcomes(case, sizes, seq_len: int, *, mode: str, slack: float) -> list[str]:
    """The sensitivity outcome of a Hugging Face zoo case (tests/clipping/hf_zoo.py) at each
    chunk size in ``sizes``, example 1 scaled."""
    outcomes = []
    for b in sizes:
        kwargs, labels = case.make_batch(b, seq_len, 0)

        def losses(kwargs=kwargs, labels=labels):
            return case.losses(case.model(**kwargs), labels)

        result = sensitivity(case.model, losses, 1, max_grad_norm=0.1, mode=mode, slack=slack)
        outcomes.append(result[0])
    return outcomes
