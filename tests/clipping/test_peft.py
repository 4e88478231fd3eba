"""LoRA / peft adapters on tiny float64 GPT-2 and Llama against the batch-size-1 oracle.

What peft adds to a model, and what the engine does with it:

- ``lora_A`` / ``lora_B`` are plain ``nn.Linear`` modules called inside peft's
  ``lora.Linear`` forward: clipped exactly by the linear rule, both modes,
  flat / automatic / per-layer clipping;
- ``modules_to_save`` wraps a module in a ``ModulesToSaveWrapper``: a trainable
  copy (a plain ``nn.Linear`` / ``nn.Embedding`` / norm) beside the frozen
  original, which must get no gradient; with ``ensure_weight_tying=True`` the
  copies of a tied embedding and head share one Parameter (phantom clipping);
- ``bias="all"`` / ``"lora_only"`` and ``lora_bias=True`` train biases of the
  base layers or of ``lora_B``;
- DoRA's magnitude vector (``DoraLinearLayer.weight``) has no rule and is
  refused by name at engine construction; with the magnitude frozen the
  direction (``lora_A`` / ``lora_B``) is clipped exactly (the weight-norm
  computation calls ``lora_B(lora_A(eye))``, detached: recorded, never live);
- LoRA on embeddings (``lora_embedding_A/B``), trainable tokens and
  ``target_parameters`` (parametrised weights) are refused by name.

Tolerance: relative error <= 1e-10, except ghost mode on Llama (HF computes the eager
softmax and the RMSNorm statistics in float32 inside the float64 model, and the second
backward scales each loss before those casts): 1e-5 there, and 1e-10 again once those
casts are removed (test_lora_ghost_mode_is_exact_without_float32_inside).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import peft

from dptrain import make_private
from dptrain.clipping import (
    ClippingEngine,
    UnsupportedModelError,
    flat_factors,
    oracle_clipped_sum,
    oracle_norms,
    oracle_per_example_grads,
    rules,
)
from dptrain.clipping.state import StateWatch
from tests.clipping import hf_zoo
from tests.clipping.oracle_check import assert_engine_matches_oracle, relative_error
from tests.clipping.sensitivity import PRIVATE, zoo_case_outcomes
from tests.clipping.test_hf_families import FLOAT32_INSIDE, MODES, B, T, _losses_of

pytestmark = [
    # peft's advice on tied layers without ensure_weight_tying (the untied copy is the point)
    pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning"),
    pytest.mark.filterwarnings("ignore:You have requested `ensure_weight_tying`:UserWarning"),
    # LoRA on GPT-2's lm_head (an nn.Linear) beside its Conv1Ds
    pytest.mark.filterwarnings("ignore:fan_in_fan_out is set to True:UserWarning"),
    # peft 0.21 calls transformers' deprecated is_gradient_checkpointing
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
]

RANK = 4
#: Attention and MLP projections of each family.
TARGETS = {
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
}
FAMILIES = ["gpt2", "llama", "llama-tied"]
#: (clipping, mode) pairs: every clipping function in both modes (per-layer clipping needs
#: book-keeping).
CLIPPINGS = [
    ("flat", "book_keeping"),
    ("flat", "ghost"),
    ("automatic", "book_keeping"),
    ("automatic", "ghost"),
    ("per_layer", "book_keeping"),
]


def _base(family: str) -> str:
    """The family whose tolerances and targets apply (the Llama variants are Llama)."""
    return "gpt2" if family == "gpt2" else "llama"


def _case(family: str) -> hf_zoo.ZooCase:
    if family == "llama-bias":
        return hf_zoo.llama(attention_bias=True, mlp_bias=True)
    if family == "llama-classifier":
        return hf_zoo.llama_classifier()
    return hf_zoo.FAMILIES[family]()


def _lora(family: str, **overrides) -> hf_zoo.ZooCase:
    """The family's tiny model with LoRA r=4 on its attention and MLP projections.

    ``init_lora_weights=False``: lora_B random, not zero, so lora_A's gradient is not
    zero either (peft's default init is tested separately).
    """
    case = _case(family)
    config = dict(
        r=RANK,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=TARGETS[_base(family)],
        fan_in_fan_out=family == "gpt2",  # GPT-2's Conv1D stores (d_in, d_out)
        init_lora_weights=False,
    )
    config.update(copy.deepcopy(overrides))  # peft edits modules_to_save in place
    with torch.random.fork_rng(devices=[]):  # peft draws the adapters' initial weights
        torch.manual_seed(1)
        case.model = peft.get_peft_model(case.model, peft.LoraConfig(**config))
    return case


def _tolerance(family: str, mode: str) -> float | None:
    """None (the dtype's: 1e-10) but in ghost mode on Llama, whose float32 softmax and RMSNorm
    statistics leave ~1e-7 relative rounding in the oracle and in the second backward; on the
    small lora_A gradients of a random lora_B it reaches 2.3e-6 (see the float64 test below)."""
    return 1e-5 if mode == "ghost" and _base(family) in FLOAT32_INSIDE else None


def _check(case: hf_zoo.ZooCase, family: str, mode: str, clipping: str = "flat") -> None:
    """Engine vs oracle at the family's tolerance."""
    tol = _tolerance(family, mode)
    assert_engine_matches_oracle(
        case.model,
        _losses_of(case),
        B,
        mode=mode,
        clipping=clipping,
        tol=tol,
        scale_floor=1e-4 if tol else None,
    )


def _trainable(model) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


# -- 1. plain LoRA --------------------------------------------------------------------------


# The adapters as a CPU and as CUDA choose them: CUDA instantiates (streams) them at T 6
# (r d <= T (r + d)), the CPU ghost-norms them (2 T^2 < r d). CUDA's choice with flat
# clipping only: the clipping function does not depend on how a norm is formed.
@pytest.mark.parametrize(
    ("clipping", "mode", "chosen_as_on"),
    [(c, m, "cpu") for c, m in CLIPPINGS] + [(c, m, "cuda") for c, m in CLIPPINGS if c == "flat"],
)
@pytest.mark.parametrize("family", FAMILIES)
def test_lora_matches_the_oracle(family, mode, clipping, chosen_as_on, monkeypatch):
    monkeypatch.setattr(rules, "SIZE_RULE_DEVICES", {"cuda", chosen_as_on})
    case = _lora(family)
    trainable = _trainable(case.model)
    assert trainable and all(re.search(r"\.lora_[AB]\.default\.weight$", n) for n in trainable)
    engine = ClippingEngine(case.model, 1.0, mode=mode, clipping=clipping)
    assert engine.parameter_names == trainable  # every LoRA matrix, nothing else
    engine.detach()
    _check(case, family, mode, clipping)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["gpt2", "llama-tied"])
def test_lora_at_peft_initialisation_matches_the_oracle(family, mode):
    """peft's default init: lora_B = 0, so every lora_A gets an exactly zero gradient."""
    case = _lora(family, init_lora_weights=True)
    _check(case, family, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("family", "targets"),
    [("gpt2", ["lm_head", "c_attn"]), ("llama-tied", ["lm_head"]), ("llama", "all-linear")],
    ids=["gpt2-lm_head", "llama-tied-lm_head", "llama-all-linear"],
)
def test_lora_on_other_targets_matches_the_oracle(family, targets, mode):
    """LoRA on the (tied, frozen) head; peft's "all-linear"."""
    _check(_lora(family, target_modules=targets), family, mode)


@pytest.mark.parametrize(
    ("family", "overrides"),
    [("llama-tied", dict(modules_to_save=["norm"])), ("llama-bias", dict(lora_bias=True))],
    ids=["llama-tied-norms", "llama-lora_bias"],
)
def test_lora_ghost_mode_is_exact_without_float32_inside(family, overrides, monkeypatch):
    """Ghost mode's 1e-5 on Llama is HF's float32, not the engine: with a float64 RMSNorm and
    SDPA attention (float64 softmax) it matches the oracle to 1e-10."""
    from transformers.models.llama import modeling_llama

    from dptrain.clipping.rules import RULES, RMSNormRule

    def float64_rms_norm(self, h):  # LlamaRMSNorm without its float32 cast
        return (
            self.weight * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        )

    class Float64RMSNormRule(RMSNormRule):
        # the rule for that forward: RMSNormRule repeats the shipped forward's float32
        # n(x) (and refuses a replaced forward)
        def check(self, module):
            return None

        def normalised(self, module, a):
            return a * torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", float64_rms_norm)
    monkeypatch.setitem(RULES, modeling_llama.LlamaRMSNorm, Float64RMSNormRule())
    case = _lora(family, **overrides)
    case.model.get_base_model().set_attn_implementation("sdpa")
    for clipping in ("flat", "automatic"):
        assert_engine_matches_oracle(
            case.model, _losses_of(case), B, mode="ghost", clipping=clipping, tol=1e-10
        )


# -- 2. modules_to_save ---------------------------------------------------------------------

#: (family, LoraConfig overrides); ensure_weight_tying: the copies of a tied embedding
#: and head are one Parameter (phantom clipping of the copy).
SAVED = {
    "gpt2-lm_head": ("gpt2", dict(modules_to_save=["lm_head"])),  # untied from wte
    "gpt2-ln_f": ("gpt2", dict(modules_to_save=["ln_f"])),
    "gpt2-wte": ("gpt2", dict(modules_to_save=["wte"])),
    "gpt2-tied-copies": ("gpt2", dict(modules_to_save=["lm_head"], ensure_weight_tying=True)),
    "llama-lm_head": ("llama", dict(modules_to_save=["lm_head"])),
    "llama-embed_tokens": ("llama", dict(modules_to_save=["embed_tokens"])),
    "llama-norms": ("llama", dict(modules_to_save=["norm"])),  # every RMSNorm
    "llama-tied-embed_tokens": ("llama-tied", dict(modules_to_save=["embed_tokens"])),
    "llama-tied-tied-copies": (
        "llama-tied",
        dict(modules_to_save=["embed_tokens"], ensure_weight_tying=True),
    ),
    # task_type SEQ_CLS: peft adds the "score" head to modules_to_save itself
    "llama-classifier-score": (
        "llama-classifier",
        dict(task_type="SEQ_CLS", target_modules=["q_proj", "v_proj"]),
    ),
}


def _wrappers(model) -> dict[str, object]:
    return {
        n: m for n, m in model.named_modules() if isinstance(m, peft.utils.ModulesToSaveWrapper)
    }


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("saved", sorted(SAVED))
def test_modules_to_save_matches_the_oracle(saved, mode):
    family, overrides = SAVED[saved]
    case = _lora(family, **overrides)
    wrappers = _wrappers(case.model)
    assert wrappers
    copies = [p for w in wrappers.values() for p in w.modules_to_save["default"].parameters()]
    originals = [p for w in wrappers.values() for p in w.original_module.parameters()]
    assert copies and all(p.requires_grad for p in copies)
    assert originals and not any(p.requires_grad for p in originals)
    if overrides.get("ensure_weight_tying"):  # the tied copies are one Parameter
        assert len({id(p) for p in copies}) < len(copies)
    _check(case, family, mode)

    # The frozen originals are not clipped and get no gradient; the copies do.
    engine = ClippingEngine(case.model, 1.0, mode=mode)
    assert not [n for n in engine.parameter_names if "original_module" in n]
    engine.backward(_losses_of(case)(slice(None)))
    engine.detach()
    assert all(p.grad is None for p in originals)
    assert all(p.grad is not None for p in copies)


# -- 3. DoRA --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_dora_matches_the_oracle(family, mode):
    """DoraLinearLayer.weight (the magnitude) has no written rule: the generic rule replays
    the layer per example (dptrain.clipping.replay), exact against the oracle."""
    case = _lora(family, use_dora=True)
    engine = ClippingEngine(case.model, 1.0)
    kinds = {type(u.rule).__name__ for u in engine._uses.values()}
    engine.detach()
    assert "ReplayRule" in kinds
    _check(case, family, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_dora_with_frozen_magnitude_matches_the_oracle(family, mode):
    """DoRA's direction only: lora_B(lora_A(x)) times m / ||W + s BA|| (a constant: peft
    detaches the norm, as the DoRA paper prescribes). The norm's own call
    lora_B(lora_A(eye(d_in))) is recorded by the hooks but never reaches the loss."""
    case = _lora(family, use_dora=True)
    for name, p in case.model.named_parameters():
        if "lora_magnitude_vector" in name:
            p.requires_grad_(False)
    _check(case, family, mode)


# -- 4. biases ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("family", "overrides", "biases"),
    [
        # every bias of GPT-2: Conv1D (wrapped or not) and LayerNorm
        ("gpt2", dict(bias="all"), 13),
        ("gpt2", dict(bias="lora_only"), 8),  # the wrapped Conv1Ds' base_layer.bias
        ("llama-bias", dict(bias="all"), 14),  # attention_bias and mlp_bias on
        ("llama-bias", dict(bias="lora_only"), 6),
        ("llama-bias", dict(lora_bias=True), 6),  # lora_B.bias
    ],
    ids=["gpt2-all", "gpt2-lora_only", "llama-all", "llama-lora_only", "llama-lora_bias"],
)
def test_lora_biases_match_the_oracle(family, overrides, biases, mode):
    targets = {"gpt2": TARGETS["gpt2"], "llama-bias": ["q_proj", "v_proj", "down_proj"]}
    case = _lora(family, target_modules=targets[family], **overrides)
    trained = [n for n in _trainable(case.model) if n.endswith("bias")]
    assert len(trained) == biases, trained
    if overrides.get("bias") == "lora_only":
        assert all(n.endswith("base_layer.bias") for n in trained)
    _check(case, family, mode)


# -- peft variants with no rule: refused by name ----------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama-tied"])
def test_lora_on_embeddings_and_trainable_tokens_are_refused_by_name(family):
    """Their raw parameters live in a ParameterDict that is never called: refused at the
    first backward, by path, before any gradient is written."""
    embedding = "wte" if family == "gpt2" else "embed_tokens"
    for kwargs, pattern in [
        (
            {"target_modules": [embedding]},
            rf"{embedding}\.lora_embedding_A\.default \(ParameterDict",
        ),
        ({"trainable_token_indices": [5, 6]}, r"token_adapter\.trainable_tokens_delta\.default"),
    ]:
        case = _lora(family, **kwargs)
        engine = ClippingEngine(case.model, 1.0)
        with pytest.raises(UnsupportedModelError, match=pattern):
            engine.backward(_losses_of(case)(slice(None)))
        engine.detach()
        assert all(p.grad is None for p in case.model.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_lora_on_parameters_is_refused_at_the_first_forward(mode):
    """target_parameters: peft registers a parametrisation of the base weight at every
    forward and removes it after, which writes the weight (``set_`` onto itself): the
    state check refuses it at the forward, naming the weight."""
    case = _lora("llama", target_modules=[], target_parameters=["mlp.down_proj.weight"])
    engine = ClippingEngine(case.model, 1.0, mode=mode)
    with pytest.raises(
        UnsupportedModelError,
        match=r"wrote state that later steps read.*: base_model\.model\.model\.layers\.\*\.mlp\."
        r"down_proj\.base_layer\.weight \(parameter of Linear, written in place; 2 modules\)",
    ):
        _losses_of(case)(slice(None))
    engine.detach()
    assert all(p.grad is None for p in case.model.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_lora_on_parameters_is_refused_at_the_first_backward(mode, monkeypatch):
    """target_parameters: lora_A / lora_B enter as a parametrised weight (B @ A), never
    through their own forward: the graph check refuses them and writes no gradient (with
    the state check, which refuses them first, switched off)."""
    monkeypatch.setattr(StateWatch, "written", lambda self, before: [])
    case = _lora("llama", target_modules=[], target_parameters=["mlp.down_proj.weight"])
    engine = ClippingEngine(case.model, 1.0, mode=mode)
    with pytest.raises(
        UnsupportedModelError,
        match=r"outside the forward of the module that owns them: base_model\.model\.model\."
        r"layers\.0\.mlp\.down_proj\.lora_A\.default\.weight \(Linear, in MmBackward0\)",
    ):
        engine.backward(_losses_of(case)(slice(None)))
    engine.detach()
    assert all(p.grad is None for p in case.model.parameters())


@pytest.mark.parametrize("mode", MODES)
def test_lora_with_hf_activation_checkpointing_matches_the_oracle(mode):
    """The usual peft set-up: non-reentrant checkpointing, input embeddings requiring grad."""
    case = _lora("llama", target_modules=["q_proj", "v_proj"])
    case.model.activation_checkpointing_enable({"use_reentrant": False})
    case.model.enable_input_require_grads()
    _check(case, "llama", mode)


# -- 5. through make_private ----------------------------------------------------------------

N_DATA, BATCH, CHUNK, C = 8, 4, 2, 0.5

#: (family, LoraConfig overrides) for the make_private runs.
PRIVATE_RUNS = {
    "gpt2-bias-ln_f": ("gpt2", dict(bias="lora_only", modules_to_save=["ln_f"])),
    "llama-tied-tied-copies": SAVED["llama-tied-tied-copies"],
}


def _private_run(family, overrides, mode):
    case = _lora(family, **overrides)
    model = case.model
    kwargs, labels = case.make_batch(N_DATA, T, 0)
    data = [hf_zoo.slice_batch(kwargs, labels, i) for i in range(N_DATA)]
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    private = make_private(
        model,
        optimizer,
        data,
        batch_size=BATCH,
        max_grad_norm=C,
        steps=2,
        noise_multiplier=1.0,
        max_physical_batch_size=CHUNK,
        mode=mode,
        seed=0,
    )
    return case, private


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("run", sorted(PRIVATE_RUNS))
def test_make_private_steps_on_the_clipped_sum_of_every_trainable_parameter(run, mode):
    """Before each step every trainable p.grad is the oracle's clipped sum over the logical
    batch (all chunks); the step then moves every trainable parameter."""
    family, overrides = PRIVATE_RUNS[run]
    case, private = _private_run(family, overrides, mode)
    model = case.model
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert set(private.engine.parameter_names) == set(params)
    tol = _tolerance(family, mode) or 1e-10
    sizes = []
    for batch in private.data_loader:
        rows = [
            hf_zoo.slice_batch(x, y, slice(j, j + 1))
            for x, y in batch.chunks
            for j in range(len(y))
        ]
        sizes.append(len(rows))
        if rows:  # the oracle first: its backward passes leave p.grad None
            grads = oracle_per_example_grads(
                model,
                lambda i, rows=rows: case.losses(model(**rows[i][0]), rows[i][1]).sum(),
                len(rows),
            )
            want = oracle_clipped_sum(grads, flat_factors(oracle_norms(grads), C))
        private.optimizer.zero_grad()
        for x, y in batch.chunks:
            private.backward(case.losses(model(**x), y))
        before = {n: p.detach().clone() for n, p in params.items()}
        if rows:
            for name, p in params.items():
                assert p.grad is not None, f"{name} got no clipped gradient"
                err = relative_error(p.grad, want[name], 1e-4 if tol > 1e-10 else None)
                assert err <= tol, f"{name}: off by {err:.2e}"
        private.optimizer.step()
        for name, p in params.items():  # the clipped sum plus noise, at least noise
            assert not torch.equal(p.detach(), before[name]), name
    assert private.optimizer.steps_taken == 2 and private.ledger.num_steps == 2
    assert sum(sizes) > 0
    private.engine.detach()


def _make_stray(model, how: str) -> list[torch.nn.Parameter]:
    """Make parameters trainable after make_private, the peft way."""
    if how == "second-adapter":
        model.add_adapter(
            "extra", peft.LoraConfig(r=2, lora_dropout=0.0, target_modules=["k_proj"])
        )
        model.base_model.set_adapter(["default", "extra"])  # both trained from now on
        stray = [p for n, p in model.named_parameters() if ".extra." in n]
    else:  # unfreeze the frozen original of a saved module
        stray = list(model.base_model.model.model.norm.original_module.parameters())
        for p in stray:
            p.requires_grad_(True)
    assert stray and all(p.requires_grad for p in stray)
    return stray


def _one_step(case, private) -> None:
    for batch in private.data_loader:
        private.optimizer.zero_grad()
        for x, y in batch.chunks:
            private.backward(case.losses(case.model(**x), y))
        private.optimizer.step()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["second-adapter", "unfrozen-original"])
def test_parameter_made_trainable_and_given_to_the_optimizer_is_refused_at_the_step(how, mode):
    """Extends tests/test_optim.py to peft: the step refuses, by name, and takes no step."""
    case, private = _private_run("llama", dict(modules_to_save=["model.norm"]), mode)
    stray = _make_stray(case.model, how)
    private.optimizer.add_param_group({"params": stray})
    expected = "extra" if how == "second-adapter" else r"model\.norm\.original_module\.weight"
    with pytest.raises(
        UnsupportedModelError,
        match=rf"^trainable parameters the clipping engine does not clip: [^(]*{expected}",
    ):
        _one_step(case, private)
    assert private.optimizer.steps_taken == 0 and len(private.ledger) == 0
    private.engine.detach()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["second-adapter", "unfrozen-original"])
def test_parameter_made_trainable_after_make_private_is_refused_at_the_step(how, mode):
    """The issue's rule: after every step each trainable parameter got a clipped gradient,
    else a hard error, whether or not the optimizer holds it."""
    case, private = _private_run("llama", dict(modules_to_save=["model.norm"]), mode)
    stray = _make_stray(case.model, how)
    try:
        with pytest.raises(UnsupportedModelError, match="trainable parameters the clipping engine"):
            _one_step(case, private)
    finally:
        private.engine.detach()
    # and no unclipped gradient reached them (ghost mode's second backward included)
    assert all(p.grad is None for p in stray)


# -- 6. one record moves the clipped sum by at most C -----------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("family", "overrides"),
    [
        ("llama", {}),
        ("llama-tied", {}),
        SAVED["llama-tied-tied-copies"],
        ("llama", dict(modules_to_save=["norm"])),
    ],
    ids=["llama", "llama-tied", "llama-tied-tied-copies", "llama-norms"],
)
@pytest.mark.parametrize("chosen_as_on", ["cpu", "cuda"])  # cuda: the adapters stream at T 6
def test_lora_keeps_one_record_within_c(family, overrides, mode, chosen_as_on, monkeypatch):
    monkeypatch.setattr(rules, "SIZE_RULE_DEVICES", {"cuda", chosen_as_on})
    case = _lora(family, **overrides)
    # chunk sizes that coincide with the rank r and the sequence length T, and T + 1
    slack = 1e-6 if _tolerance(family, mode) else 1e-9
    outcomes = zoo_case_outcomes(case, (B, RANK, T, T + 1), T, mode=mode, slack=slack)
    assert outcomes == [PRIVATE] * 4
