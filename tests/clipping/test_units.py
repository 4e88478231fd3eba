"""Privacy units of several examples (a user's records): the unit's summed gradient is
clipped as one, exactly (against the batch-size-1 oracle summed per unit), in one chunk
or spanning several."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dptrain.clipping import ClippingEngine, flat_factors, oracle_clipped_sum
from dptrain.clipping.units import unit_index
from tests.clipping import hf_zoo
from tests.clipping.oracle_check import (
    _per_layer_sum,
    assert_engine_matches_oracle,
    relative_error,
)
from tests.clipping.sensitivity import PRIVATE, sensitivity

MODES = ["book_keeping", "ghost"]
B, T = 6, 5
#: non-contiguous units of 3, 2 and 1 examples, ids neither sorted nor dense
UNITS = torch.tensor([7, 2, 7, 11, 2, 7])
#: families that exercise each record kind: phantom (tied embedding + head), HF Conv1D and
#: shared positions, conv (raw layout) and replay, T5's shared bias, Mixtral's token blocks
FAMILIES = ["llama-tied", "gpt2", "vit", "t5", "mixtral"]
FLOAT32_INSIDE = {"llama-tied", "vit", "t5", "mixtral"}


def _tol(family, mode):
    return 1e-6 if mode == "ghost" and family in FLOAT32_INSIDE else None


def test_unit_index_orders_units_by_first_appearance():
    index = unit_index(UNITS, B)
    assert index.inverse.tolist() == [0, 1, 0, 2, 1, 0]
    assert index.slots.tolist() == [[0, 2, 5], [1, 4, B], [3, B, B]]
    x = torch.arange(B * 2, dtype=torch.float64).reshape(B, 2, 1)
    grouped = index.regroup(x)  # (U, k * T, 1)
    assert grouped.shape == (3, 6, 1)
    assert grouped[1].flatten().tolist() == [2, 3, 8, 9, 0, 0]
    assert unit_index(torch.arange(4), 4).trivial


@pytest.mark.parametrize("units", [torch.zeros(5, dtype=torch.long), torch.ones(B), [0] * B])
def test_bad_units_are_named(units):
    with pytest.raises(ValueError, match="units="):
        unit_index(units, B)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_units_match_the_oracle(family, mode):
    case = hf_zoo.FAMILIES[family]()
    assert_engine_matches_oracle(
        case.model,
        lambda rows: hf_zoo.per_example_losses(case, B, T, 0, rows),
        B,
        mode=mode,
        units=UNITS,
        tol=_tol(family, mode),
        # ViT's key biases get a gradient that is zero in exact arithmetic (softmax is
        # shift-invariant): rounding noise, measured against a floor (test_hf_families)
        scale_floor=1e-3 if family == "vit" else (1e-4 if _tol(family, mode) else None),
    )


@pytest.mark.parametrize("clipping", ["automatic", "per_layer"])
def test_units_with_other_clipping_functions(clipping):
    case = hf_zoo.FAMILIES["llama-tied"]()
    assert_engine_matches_oracle(
        case.model,
        lambda rows: hf_zoo.per_example_losses(case, B, T, 0, rows),
        B,
        mode="book_keeping",
        clipping=clipping,
        units=UNITS,
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["llama-tied", "gpt2"])
def test_one_unit_moves_the_clipped_sum_by_at_most_c(family, mode):
    case = hf_zoo.FAMILIES[family]()
    kwargs, labels = case.make_batch(B, T, 0)
    slack = 1e-6 if _tol(family, mode) else 1e-9

    def losses():
        return case.losses(case.model(**kwargs), labels)

    for unit in (7, 11):  # three examples; one
        outcome, _ = sensitivity(
            case.model, losses, unit, max_grad_norm=0.1, mode=mode, slack=slack, units=UNITS
        )
        assert outcome == PRIVATE


@pytest.mark.parametrize("clipping", ["flat", "per_layer"])
def test_a_unit_spanning_chunks_is_clipped_once(clipping):
    # Unit "a" has examples 0-4, cut into chunks 0-2 and 3-4 (add_to_unit); examples 5 and
    # 6, 7 are units of their own chunk (backward with units). Want: the oracle's sum of
    # each unit's summed batch-size-1 gradients, clipped per unit.
    case = hf_zoo.FAMILIES["gpt2"]()
    model, n = case.model, 8
    units = torch.tensor([0, 0, 0, 0, 0, 1, 2, 2])

    def losses_of(rows):
        return hf_zoo.per_example_losses(case, n, T, 0, rows)

    engine = ClippingEngine(model, 1.0, clipping=clipping)
    engine.detach()  # only for its parameter names and groups
    want_norms, want = _unit_oracle(model, losses_of, n, units, engine)
    c = float(want_norms.median())
    engine = ClippingEngine(model, c, clipping=clipping)
    try:
        engine.add_to_unit(losses_of(slice(0, 3)))
        engine.add_to_unit(losses_of(slice(3, 5)))
        first = engine.close_unit()
        rest = engine.backward(losses_of(slice(5, 8)), units=units[5:])
    finally:
        engine.detach()
    got_norms = torch.cat([first.norms, rest.norms])
    assert relative_error(got_norms, want_norms) <= 1e-10
    if clipping == "flat":
        expected = oracle_clipped_sum(want, flat_factors(want_norms, c))
    else:  # each group's unit norm clipped at its own threshold C_l
        expected = _per_layer_sum(engine, want)
    for name, g in expected.items():
        assert relative_error(model.get_parameter(name).grad, g) <= 1e-10, name
    model.zero_grad(set_to_none=True)


def _unit_oracle(model, losses_of, n, units, engine):
    from dptrain.clipping import oracle_per_example_grads

    grads = oracle_per_example_grads(model, lambda i: losses_of(slice(i, i + 1)).sum(), n)
    order = list(dict.fromkeys(units.tolist()))
    per_unit = {
        name: torch.stack([g[units == u].sum(0) for u in order]) for name, g in grads.items()
    }
    norms = torch.stack([g.flatten(1).pow(2).sum(1) for g in per_unit.values()]).sum(0).sqrt()
    return norms, per_unit


def test_open_unit_blocks_the_next_chunk():
    case = hf_zoo.FAMILIES["gpt2"]()
    kwargs, labels = case.make_batch(2, T, 0)
    engine = ClippingEngine(case.model, 1.0)
    try:
        engine.add_to_unit(case.losses(case.model(**kwargs), labels))
        with pytest.raises(RuntimeError, match="close_unit"):
            engine.backward(case.losses(case.model(**kwargs), labels))
        engine.close_unit()
        with pytest.raises(RuntimeError, match="no privacy unit is open"):
            engine.close_unit()
    finally:
        engine.detach()
