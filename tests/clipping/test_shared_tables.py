"""Tables shared by all examples, and parametrized weights: exact, or refused by name.

An embedding looked up with ids every example shares ((T,) or (1, T): positions,
a soft prompt's arange(K)) returns one output for the whole batch. The engine
must not change that output (user code sees the module's own shapes: a held-out
audit found raw shape errors when the engine expanded it to (B, T, d)); it reads
each example's rows where the output is broadcast over the batch
(``x + table(ids)``, ``.expand(B, ...)``, ``.repeat(B, ...)``: peft's prompt
tuning) and refuses, by name and before any gradient is written, a table whose
output is used otherwise (as a matrix). ``torch.nn.utils.parametrize``
parametrizations are replayed per example (weight_norm, custom) or refused by
name (spectral_norm writes its power-iteration buffers in every forward).

"Exact": relative error <= 1e-10 against the batch-size-1 oracle in float64
(1e-5 for Llama in ghost mode, whose float32 softmax and RMSNorm statistics
round before the second backward; tests/clipping/test_peft.py), and the
sensitivity test: one record moves the clipped sum by at most C.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from dptrain.clipping import ClippingEngine, UnsupportedModelError
from tests.clipping.oracle_check import assert_engine_matches_oracle
from tests.clipping.sensitivity import PRIVATE, REFUSED, sensitivity

pytestmark = [
    # peft 0.21 calls transformers' deprecated is_gradient_checkpointing, and passes prefix
    # tuning's cache as past_key_values
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
    pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated"),
]

MODES = ["book_keeping", "ghost"]
T, D, VOCAB, K = 5, 4, 11, 3


def _ids(b, t=T, seed=0):
    return torch.randint(0, VOCAB, (b, t), generator=torch.Generator().manual_seed(seed))


def _labels(b):
    return torch.arange(b) % 2


def _losses_of(model, x, y):
    """losses_of(rows) for the oracle harness: model on rows of x, cross-entropy against y."""
    return lambda rows=slice(None): F.cross_entropy(model(x[rows]), y[rows], reduction="none")


def _outcome(model, losses_of, mode, slack=1e-9):
    torch.manual_seed(0)
    return sensitivity(model, losses_of, index=1, max_grad_norm=0.1, mode=mode, slack=slack)[0]


def _assert_exact(model, x, y, mode, tol=None):
    b = x.shape[0]
    assert_engine_matches_oracle(model, _losses_of(model, x, y), b, mode=mode, tol=tol)
    assert _outcome(model, _losses_of(model, x, y), mode) == PRIVATE


# -- 1. what user code sees: the module's own output -----------------------------------------


class Positions(nn.Module):
    """Token + position embeddings, the positions looked up with (T,) or (1, T) ids (nanoGPT,
    HF GPT-2); the shape of the position table's output is noted as the model sees it."""

    def __init__(self, batched_ids: bool, max_len=16):
        super().__init__()
        self.batched_ids = batched_ids
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(max_len, D)
        self.head = nn.Linear(D, 2)
        self.seen: list[tuple[int, ...]] = []

    def forward(self, ids):
        pos_ids = torch.arange(ids.shape[1])
        pos = self.pos(pos_ids[None] if self.batched_ids else pos_ids)
        self.seen.append(tuple(pos.shape))
        return self.head(torch.tanh(self.tok(ids) + pos).mean(1))


@pytest.mark.parametrize("batched_ids", [False, True], ids=["(T,)", "(1, T)"])
def test_a_position_table_returns_its_own_shape_under_the_engine(batched_ids):
    torch.manual_seed(0)
    model = Positions(batched_ids).double()
    ids = _ids(3)
    engine = ClippingEngine(model, 1.0)
    engine.backward(_losses_of(model, ids, _labels(3))())
    engine.detach()
    want = (1, T, D) if batched_ids else (T, D)
    assert model.seen and set(model.seen) == {want}  # (the independence check's re-runs too)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("batched_ids", [False, True], ids=["(T,)", "(1, T)"])
@pytest.mark.parametrize("b", [3, T, T + 1])
def test_position_tables_are_exact_at_every_chunk_size(b, batched_ids, mode):
    """Chunk sizes equal to T included: the broadcast, a structural fact, shows the table is
    shared; row i of the sum it is added into is checked to be example i's."""
    torch.manual_seed(0)
    model = Positions(batched_ids).double()
    _assert_exact(model, _ids(b), _labels(b), mode)


class TwicePositions(Positions):
    """The position output added in two places (every layer, as some encoders do)."""

    def forward(self, ids):
        pos = self.pos(torch.arange(ids.shape[1]))
        h = torch.tanh(self.tok(ids) + pos)
        return self.head(torch.tanh(h + pos).mean(1))


@pytest.mark.parametrize("mode", MODES)
def test_a_table_broadcast_twice_is_exact(mode):
    torch.manual_seed(0)
    model = TwicePositions(False).double()
    _assert_exact(model, _ids(4), _labels(4), mode)


# -- 2. a shared table used as a matrix: refused by name, the forward untouched ----------------


class TableAsMatrix(nn.Module):
    """A table's rows used as a weight matrix over every example's features."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.emb = nn.Embedding(K, D)
        self.head = nn.Linear(K, 2)

    def forward(self, x):  # x (B, T, D)
        w = self.emb(torch.arange(K))  # (K, D)
        if self.how == "linear":
            h = F.linear(x, w)
        elif self.how == "matmul":
            h = x @ w.T
        elif self.how == "einsum":
            h = torch.einsum("btd,kd->btk", x, w)
        elif self.how == "mul":  # elementwise with a shared (K, D) table, K = T
            h = (x[:, :K] * w).sum(-1, keepdim=True).expand(-1, -1, K)
        else:  # subtracted from the examples: the sign of its gradient differs
            h = (x[:, :K] - w).sum(-1, keepdim=True).expand(-1, -1, K)
        return self.head(torch.tanh(h).mean(1))


def _features(b, t=T):
    return torch.randn(b, t, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


def _refusal(b: int) -> str:
    """What the refusal of TableAsMatrix says at chunk size b."""
    if b != K:
        return re.escape(
            f"module emb (Embedding) looks up ids of shape ({K},) shared by all {b} examples, "
            f"and its output ({K}, {D}) is used by "
        ) + (
            r".*Give every example its own rows: look the ids up with a batch dimension, "
            r"table\(ids\.expand\(B, -1\)\)"
        )
    # K ids for K examples may be one per example: read as rows, the exact check refuses
    return re.escape(
        f"module emb (Embedding): the rows of its input ({K},) / output ({K}, {D}) ({K} "
        "examples) are not one per example"
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["linear", "matmul", "einsum", "mul", "sub"])
@pytest.mark.parametrize("b", [2, K, K + 1])
def test_a_table_used_as_a_matrix_is_refused_by_name_before_any_gradient(how, b, mode):
    torch.manual_seed(0)
    model = TableAsMatrix(how).double()
    x, y = _features(b), _labels(b)
    plain = model(x)  # the forward without the engine
    engine = ClippingEngine(model, 1.0, mode=mode)
    out = model(x)
    assert out.shape == plain.shape and torch.equal(out, plain)  # user code sees the same
    with pytest.raises(UnsupportedModelError, match=_refusal(b)):
        engine.backward(F.cross_entropy(out, y, reduction="none"))
    engine.detach()
    assert all(p.grad is None for p in model.parameters())
    assert _outcome(model, _losses_of(model, x, y), mode) == REFUSED


class TimeFirstPositions(nn.Module):
    """Positions broadcast over dimension 1 of a time-first (T, B, d) stream."""

    def __init__(self, max_len=16):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(max_len, D)
        self.head = nn.Linear(D, 2)

    def forward(self, ids):  # ids (B, T)
        h = self.tok(ids.T) + self.pos(torch.arange(ids.shape[1])).unsqueeze(1)  # (T, B, d)
        return self.head(torch.tanh(h).mean(0))


# (with T = b the independence check cannot split the time-first inputs: it says so)
@pytest.mark.filterwarnings("ignore::dptrain.clipping.UnsupportedInputsWarning")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("b", [3, T])
def test_a_table_broadcast_along_another_dimension_is_refused(b, mode):
    torch.manual_seed(0)
    model = TimeFirstPositions().double()
    ids, y = _ids(b), _labels(b)
    if b != T:  # (with T = b the time-first token rows are refused first, by the self-check)
        engine = ClippingEngine(model, 1.0, mode=mode)
        with pytest.raises(
            UnsupportedModelError,
            match=re.escape(
                f"module pos (Embedding) looks up ids of shape ({T},) shared by all {b} "
                f"examples, and its output ({T}, {D}) is used by AddBackward0 (output ({T}, {b}, {D}))"
            ),
        ):
            engine.backward(_losses_of(model, ids, y)())
        engine.detach()
    assert _outcome(model, _losses_of(model, ids, y), mode) == REFUSED


# -- 3. hand-written soft prompts: exact ----------------------------------------------------


class SoftPrompt(nn.Module):
    """K learned prompt rows prepended to every example's token embeddings."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.prompt_emb = nn.Embedding(K, D)
        self.tok = nn.Embedding(VOCAB, D)
        self.head = nn.Linear(D, 2)

    def forward(self, ids):
        b = ids.shape[0]
        if self.how == "expand":  # (1, K) ids
            prompt = self.prompt_emb(torch.arange(K)[None]).expand(b, -1, -1)
        elif self.how == "unsqueeze-expand":  # (K,) ids
            prompt = self.prompt_emb(torch.arange(K)).unsqueeze(0).expand(b, -1, -1)
        elif self.how == "view-repeat":
            prompt = self.prompt_emb(torch.arange(K)).view(1, K, D).repeat(b, 1, 1)
        else:  # "batched": ids with a batch dimension, an ordinary per-example lookup
            prompt = self.prompt_emb(torch.arange(K).expand(b, -1))
        h = torch.cat([prompt, self.tok(ids)], 1)  # (B, K + T, D)
        return self.head(torch.tanh(h).mean(1))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["expand", "unsqueeze-expand", "view-repeat", "batched"])
@pytest.mark.parametrize("b", [2, K, K + T])
def test_hand_written_soft_prompts_are_exact(how, b, mode):
    torch.manual_seed(0)
    model = SoftPrompt(how).double()
    _assert_exact(model, _ids(b), _labels(b), mode)


# -- 4. peft prompt tuning and prefix tuning on tiny HF models -------------------------------

B, SEQ, VIRTUAL = 3, 6, 4


def _peft_case(family: str, method: str):
    """The family's tiny float64 model under a peft prompt-learning method; labels padded
    with IGNORE_INDEX over the virtual tokens where the logits include them."""
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from tests.clipping import hf_zoo

    configs = {
        "prompt": lambda: peft.PromptTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=VIRTUAL
        ),
        "prefix": lambda: peft.PrefixTuningConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=VIRTUAL
        ),
        "prefix-projection": lambda: peft.PrefixTuningConfig(
            task_type="CAUSAL_LM",
            num_virtual_tokens=VIRTUAL,
            prefix_projection=True,
            encoder_hidden_size=16,
        ),
        "p-tuning": lambda: peft.PromptEncoderConfig(
            task_type="CAUSAL_LM", num_virtual_tokens=VIRTUAL, encoder_hidden_size=16
        ),
    }
    case = hf_zoo.FAMILIES[family]()
    with torch.random.fork_rng(devices=[]):  # peft draws the prompt's initial weights
        torch.manual_seed(1)
        case.model = peft.get_peft_model(case.model, configs[method]()).to(torch.float64)
    prefix = 0 if method.startswith("prefix") else VIRTUAL  # prefix tuning adds no logits
    make = case.make_batch

    def make_batch(b, seq, seed):
        kwargs, labels = make(b, seq, seed)
        pad = torch.full((b, prefix), hf_zoo.IGNORE_INDEX)
        return kwargs, torch.cat([pad, labels], 1)

    case.make_batch = make_batch
    return case, hf_zoo


PEFT_EXACT = ["prompt", "prefix", "prefix-projection"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", PEFT_EXACT)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_peft_prompt_and_prefix_tuning_match_the_oracle(family, method, mode):
    case, hf_zoo = _peft_case(family, method)
    trainable = [n for n, p in case.model.named_parameters() if p.requires_grad]
    assert trainable and all(n.startswith("prompt_encoder.") for n in trainable)
    tol = 1e-5 if mode == "ghost" and family == "llama" else None
    assert_engine_matches_oracle(
        case.model,
        lambda rows: hf_zoo.per_example_losses(case, B, SEQ, 0, rows),
        B,
        mode=mode,
        tol=tol,
        scale_floor=1e-4 if tol else None,
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("method", PEFT_EXACT)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_peft_prompt_and_prefix_tuning_keep_one_record_within_c(family, method, mode):
    """Chunk sizes equal to the number of virtual tokens and to the prompted length too."""
    from tests.clipping.sensitivity import zoo_case_outcomes

    case, _ = _peft_case(family, method)
    slack = 1e-6 if mode == "ghost" and family == "llama" else 1e-9
    sizes = (B, VIRTUAL, SEQ + VIRTUAL)
    assert zoo_case_outcomes(case, sizes, SEQ, mode=mode, slack=slack) == [PRIVATE] * 3


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_peft_p_tuning_is_refused_by_name_before_any_gradient(family):
    """P-tuning runs its MLP on the one shared prompt before repeating it over the batch:
    the examples' gradients are summed in the MLP, before any broadcast."""
    case, hf_zoo = _peft_case(family, "p-tuning")
    engine = ClippingEngine(case.model, 1.0)
    with pytest.raises(
        UnsupportedModelError,
        match=re.escape(
            "module prompt_encoder.default.embedding (Embedding) looks up ids of shape "
            f"(1, {VIRTUAL}) shared by all {B} examples"
        ),
    ):
        engine.backward(hf_zoo.per_example_losses(case, B, SEQ, 0, slice(None)))
    engine.detach()
    assert all(p.grad is None for p in case.model.parameters())


# -- 5. parametrizations (torch.nn.utils.parametrize) ----------------------------------------


class Symmetric(nn.Module):
    """A custom parametrization: W = triu(X) + triu(X, 1)^T."""

    def forward(self, x):
        return x.triu() + x.triu(1).transpose(-1, -2)


def _parametrized(kind: str) -> nn.Module:
    torch.manual_seed(0)
    fc = nn.Linear(D, D)
    if kind == "weight_norm":
        torch.nn.utils.parametrizations.weight_norm(fc)
    elif kind == "spectral_norm":
        torch.nn.utils.parametrizations.spectral_norm(fc)
    elif kind == "orthogonal":
        torch.nn.utils.parametrizations.orthogonal(fc)
    else:
        parametrize.register_parametrization(fc, "weight", Symmetric())
    return nn.Sequential(fc, nn.Tanh(), nn.Linear(D, 2)).double()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["weight_norm", "orthogonal", "custom"])
@pytest.mark.parametrize("b", [2, 3, D])  # 2 and D divide the output size D
def test_parametrized_weights_are_replayed_exactly(kind, b, mode):
    model = _parametrized(kind)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert any(".parametrizations.weight.original" in n for n in trainable)
    x = torch.randn(b, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    _assert_exact(model, x, _labels(b), mode)


def test_spectral_norm_is_refused_by_name_when_the_engine_is_built():
    model = _parametrized("spectral_norm")
    with pytest.raises(
        UnsupportedModelError,
        match=re.escape(
            "0 (ParametrizedLinear): Linear with a parametrization on weight (_SpectralNorm): "
            "its power iteration writes the buffers _u and _v in every training forward"
        ),
    ):
        ClippingEngine(model, 1.0)


@pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")
def test_hook_based_weight_norm_is_refused_by_name():
    """The deprecated torch.nn.utils.weight_norm recomputes ``weight`` in a pre-hook from
    ``weight_g`` / ``weight_v``, which no rule covers."""
    torch.manual_seed(0)
    fc = torch.nn.utils.weight_norm(nn.Linear(D, D))
    with pytest.raises(UnsupportedModelError, match=r"Linear \(1 module: fc; parameters "):
        ClippingEngine(nn.ModuleDict({"fc": fc}), 1.0)
