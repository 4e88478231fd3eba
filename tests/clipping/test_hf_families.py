"""Hugging Face model families against the batch-size-1 oracle and the sensitivity test.

Tiny float64 models built from configs (tests/clipping/hf_zoo.py). Every family
listed here must be clipped exactly (relative error <= 1e-10, both modes, flat,
automatic and per-layer clipping) and keep one record's influence within C;
the families still refused are listed with the module type that blocks them.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dptrain.clipping import ClippingEngine, UnsupportedModelError
from tests.clipping import hf_zoo
from tests.clipping.oracle_check import assert_engine_matches_oracle
from tests.clipping.sensitivity import PRIVATE, zoo_case_outcomes

MODES = ["book_keeping", "ghost"]
B, T = 3, 6

#: Families clipped exactly (both modes) against the oracle.
EXACT = [
    "llama",
    "llama-tied",
    "qwen2",
    "qwen3",
    "mistral",
    "phi3",
    "gemma",
    "gemma2",
    "gemma3",
    "opt",
    "bart",
    "t5",
    "gpt2",
    "bert",
    "vit",
    "mixtral",
]

#: Families whose forward runs parts in float32 even in a float64 model (the eager softmax,
#: the RMSNorm normalisation). Book-keeping weights the per-example gradients after the
#: backward, in float64, and stays exact; ghost mode's second backward scales each loss by
#: its clip factor *before* those float32 casts, so it is float32-accurate there.
FLOAT32_INSIDE = set(EXACT) - {"bart", "gpt2", "bert"}  # T5: T5LayerNorm's variance
#: Gemma's RMSNorm multiplies by (1 + w) in float32: its weight gradient, the oracle's
#: included, is float32-accurate in either mode.
GEMMA = {"gemma", "gemma2", "gemma3"}

#: Still refused (at the first backward), with what the refusal names (see docs/engine.md):
#: DeBERTa-v2 reads its relative-position table through ``.weight``, shared by all examples,
#: and projects it with the attention's query and key layers.
REFUSED = {
    "deberta-v2": r"deberta\.encoder\.rel_embeddings\.weight \(Embedding, in",
}


#: The default run covers every family in book-keeping and these in every mode; the rest
#: of the grid is marked slow (``pytest -m slow``).
QUICK = {"llama-tied", "gemma", "opt", "bart", "t5", "gpt2"}


def _grid(families, modes=MODES):
    return [
        pytest.param(
            f,
            m,
            marks=[] if (f in QUICK or m == "book_keeping") else [pytest.mark.slow],
            id=f"{f}-{m}",
        )
        for f in families
        for m in modes
    ]


def _tolerance(family: str, mode: str) -> float | None:
    if family in GEMMA or (mode == "ghost" and family in FLOAT32_INSIDE):
        return 1e-6
    return None


def _case(family: str):
    return hf_zoo.FAMILIES[family]()


def _losses_of(case):
    return lambda rows: hf_zoo.per_example_losses(case, B, T, 0, rows)


@pytest.mark.parametrize(("family", "mode"), _grid(EXACT))
def test_family_matches_the_oracle(family, mode):
    case = _case(family)
    tol = _tolerance(family, mode)
    assert_engine_matches_oracle(
        case.model,
        _losses_of(case),
        B,
        mode=mode,
        tol=tol,
        # key biases get a gradient that is zero in exact arithmetic: rounding noise, of
        # the order of float32 rounding of the model's largest gradients (5.4 in ViT, whose
        # key biases then come out at 1e-10)
        scale_floor=(1e-3 if family == "vit" else 1e-4) if tol else None,
    )


@pytest.mark.parametrize("clipping", ["automatic", "per_layer"])
@pytest.mark.parametrize("family", ["llama-tied", "qwen3", "bart"])
def test_family_with_other_clipping_functions(family, clipping):
    case = _case(family)
    assert_engine_matches_oracle(
        case.model, _losses_of(case), B, mode="book_keeping", clipping=clipping
    )


@pytest.mark.parametrize(
    ("family", "mode"),
    [
        pytest.param(
            *p.values, marks=p.marks + ([] if p.values[0] in QUICK else [pytest.mark.slow]), id=p.id
        )
        for p in _grid(EXACT)
    ],
)
def test_family_keeps_one_record_within_c(family, mode):
    # chunk sizes that coincide with T and T + 1 included; ghost mode on float32-inside
    # families: ||c_i g_i|| = C up to float32 rounding
    slack = 1e-6 if _tolerance(family, mode) else 1e-9
    outcomes = zoo_case_outcomes(_case(family), (B, T, T + 1), T, mode=mode, slack=slack)
    assert outcomes == [PRIVATE] * 3


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_family_still_refused_names_the_module_type(family):
    case = hf_zoo.FAMILIES[family]()
    kwargs, labels = case.make_batch(B, T, 0)
    with pytest.raises(UnsupportedModelError, match=REFUSED[family]):
        engine = ClippingEngine(case.model, 1.0)
        engine.backward(case.losses(case.model(**kwargs), labels))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_t5_relative_position_bias_is_clipped_exactly(attention, mode):
    # The shared (buckets, heads) tables of the encoder and the decoder, trainable, through
    # SDPA (which sums a broadcast bias's gradient over the batch inside its kernel) and
    # eager attention; chunk sizes equal to T and to the number of buckets included.
    case = hf_zoo.t5(attn_implementation=attention)
    tables = [n for n, p in case.model.named_parameters() if "relative_attention_bias" in n]
    assert len(tables) == 2 and all(case.model.get_parameter(n).requires_grad for n in tables)
    engine = ClippingEngine(case.model, 1.0, mode=mode)
    assert {type(u.rule).__name__ for u in engine._uses.values()} >= {"T5RelativeBiasRule"}
    engine.detach()
    for b in (B, T, 8):
        assert_engine_matches_oracle(
            case.model,
            lambda rows, b=b: hf_zoo.per_example_losses(case, b, T, 0, rows),
            b,
            mode=mode,
            tol=_tolerance("t5", mode),
        )
    slack = 1e-6 if _tolerance("t5", mode) else 1e-9
    assert zoo_case_outcomes(case, (T, 8), T, mode=mode, slack=slack) == [PRIVATE] * 2


def test_mt5_relative_position_bias_is_clipped_exactly():
    case = hf_zoo.t5(model_class="MT5ForConditionalGeneration")
    assert_engine_matches_oracle(case.model, _losses_of(case), B, mode="book_keeping")


def test_t5_generation_is_unchanged_under_the_engine():
    # The rule's pre-hook acts only where gradients are recorded: generate() (no_grad,
    # with a cache) computes exactly what the plain model computes.
    case = hf_zoo.t5()
    kwargs, _ = case.make_batch(2, T, 0)
    kwargs = {k: v for k, v in kwargs.items() if k in ("input_ids", "attention_mask")}
    plain = case.model.generate(**kwargs, max_new_tokens=4, do_sample=False)
    engine = ClippingEngine(case.model, 1.0)
    hooked = case.model.generate(**kwargs, max_new_tokens=4, do_sample=False)
    engine.detach()
    assert torch.equal(plain, hooked)


@pytest.mark.parametrize("mode", MODES)
def test_llama_without_its_norm_rule_is_replayed_exactly(mode):
    # The generic rule (replay.py) stands in for a missing written rule.
    from dptrain.clipping.replay import ReplayRule
    from dptrain.clipping.rules import RULES_BY_NAME

    case = hf_zoo.FAMILIES["llama"]()
    key = "transformers.models.llama.modeling_llama.LlamaRMSNorm"
    rule = RULES_BY_NAME.pop(key)
    try:
        engine = ClippingEngine(case.model, 1.0)
        norm = case.model.model.norm
        assert isinstance(engine._uses[norm].rule, ReplayRule)
        engine.detach()
        assert_engine_matches_oracle(
            case.model, _losses_of(case), B, mode=mode, tol=_tolerance("llama", mode)
        )
    finally:
        RULES_BY_NAME[key] = rule
