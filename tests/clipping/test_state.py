"""State written during a training forward, and BatchNorm judged by its mode.

Per-example clipping bounds one record's effect on its own step. A forward that
writes the model's state from the batch (a MoCo queue, a running mean,
``nn.Embedding(max_norm=...)``'s in-place renormalisation) carries the record into
the next steps, where no per-step bound looks: the engine refuses it at the forward,
naming what was written. BatchNorm is refused only where it normalises by the batch
at a training forward; frozen in eval mode it is per example and accepted.

Each refusal is paired with the same case with the check switched off, where the
neighbouring-data sensitivity test sees the record move the clipped sum by more
than C: so the refusal is what keeps these cases private, and the tests can fail.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.clipping import ClippingEngine, UnsupportedModelError, independence
from dptrain.clipping.replay import ReplayRule
from dptrain.clipping.state import StateWatch
from tests.clipping.oracle_check import assert_engine_matches_oracle
from tests.clipping.sensitivity import PRIVATE, REFUSED, neighbour_sensitivity, sensitivity

MODES = ["book_keeping", "ghost"]
F64 = torch.float64
D = 4
C = 0.1


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, dtype=F64, generator=torch.Generator().manual_seed(seed)) * scale


def _class_losses(logits, y):
    return F.cross_entropy(logits, y, reduction="none")


@pytest.fixture
def state_check_off(monkeypatch):
    """The engine as it was before the state check: no write is ever seen."""
    monkeypatch.setattr(StateWatch, "written", lambda self, before: [])


@pytest.fixture
def batch_norm_check_off(monkeypatch):
    """The engine without the BatchNorm check (and BatchNorm no longer refused by type)."""
    monkeypatch.setattr("dptrain.clipping.engine.uses_batch_statistics", lambda module: False)


# -- models that write state in forward -------------------------------------------------------


class MoCoQueue(nn.Module):
    """MoCo: logits of each query against its key and a queue of earlier keys; this
    batch's keys are enqueued in forward (in place at a pointer, or by rebinding)."""

    def __init__(self, rebind: bool = False, size: int = 6):
        super().__init__()
        self.rebind = rebind
        self.query = nn.Linear(D, D)
        self.key = nn.Linear(D, D).requires_grad_(False)  # the momentum encoder
        self.register_buffer("queue", torch.randn(size, D))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        q, k = self.query(x), self.key(x)
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone().T], 1)
        if self.rebind:
            self.queue = torch.cat([k.detach(), self.queue])[: self.queue.shape[0]]
        else:
            rows = (self.ptr + torch.arange(x.shape[0])) % self.queue.shape[0]
            self.queue[rows] = k.detach()
            self.ptr += x.shape[0]
        return logits


class RunningMean(nn.Module):
    """Inputs centred by a running mean that the forward updates from the batch."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, 3)
        self.register_buffer("running", torch.zeros(D))

    def forward(self, x):
        out = self.fc(torch.tanh(x - self.running))
        if self.training:
            self.running.mul_(0.9).add_(0.1 * x.mean(0).detach())
        return out


class MaxNormEmbedding(nn.Module):
    """``nn.Embedding(max_norm=1)``: the looked-up rows are renormalised in place."""

    def __init__(self, frozen: bool):
        super().__init__()
        self.emb = nn.Embedding(10, D, max_norm=1.0)
        with torch.no_grad():
            self.emb.weight.mul_(10)  # rows well above max_norm
        self.emb.requires_grad_(not frozen)
        self.head = nn.Linear(D, 3)

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)).mean(1))


def _features(variant, b=4, seed=0):
    """Variant 0: the record (row 1) removed; 1: as it is; 2, 3: an outlier."""
    x = _randn(b, D, seed=seed)
    if variant in (2, 3):
        x[1] *= 1e3 if variant == 2 else 1e6
    return x if variant else x[torch.arange(b) != 1]


def _labels(variant, b=4):
    """The examples' labels, row 1's removed in variant 0 (as in ``_features``)."""
    y = torch.arange(b) % 3
    return y if variant else y[torch.arange(b) != 1]


def _tokens(variant, b=4):
    """Row 1 alone holds token 7, which every example of the next step looks up; variant 0:
    the record removed, 1: as it is."""
    ids = torch.tensor([[1, 2, 3], [7, 7, 4], [2, 3, 1], [3, 1, 2]])[:b]
    return ids if variant else ids[torch.arange(b) != 1]


def _queue_steps(model, v):
    # the record is in the first chunk only; the second chunk is the same in every variant
    x1, x2 = _features(v), _randn(5, D, seed=1)
    return [
        lambda: _class_losses(model(x1), torch.zeros(len(x1), dtype=torch.long)),
        lambda: _class_losses(model(x2), torch.zeros(len(x2), dtype=torch.long)),
    ]


def _running_steps(model, v):
    x1, x2 = _features(v), _randn(5, D, seed=1)
    y1, y2 = _labels(v), torch.arange(5) % 3
    return [lambda: _class_losses(model(x1), y1), lambda: _class_losses(model(x2), y2)]


def _embedding_steps(model, v):
    ids1, ids2 = _tokens(v), torch.tensor([[7, 1], [7, 2], [7, 3], [7, 7], [7, 1], [7, 2]])
    y1, y2 = _labels(v), torch.zeros(6, dtype=torch.long)
    return [lambda: _class_losses(model(ids1), y1), lambda: _class_losses(model(ids2), y2)]


def _move_rows(model):
    # Renormalisation is idempotent: what step t renormalised differs at step t + 1 once
    # the noised step has moved the rows (the same move in every variant).
    model.emb.weight.add_(_randn(*model.emb.weight.shape, seed=5))


# name -> (model, its chunks per variant, number of variants, the step between chunks)
STATEFUL = {
    "queue": (lambda: MoCoQueue(), _queue_steps, 4, None),
    "queue-rebound": (lambda: MoCoQueue(rebind=True), _queue_steps, 4, None),
    "running-mean": (RunningMean, _running_steps, 4, None),
    "max-norm-embedding": (lambda: MaxNormEmbedding(frozen=False), _embedding_steps, 2, _move_rows),
    "max-norm-embedding-frozen": (
        lambda: MaxNormEmbedding(frozen=True),
        _embedding_steps,
        2,
        _move_rows,
    ),
}


def _stateful(name):
    build, steps, variants, between = STATEFUL[name]
    torch.manual_seed(0)
    return build().double(), steps, variants, between


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(STATEFUL))
def test_state_written_in_forward_is_refused(name, mode):
    model, steps, variants, between = _stateful(name)
    outcome = neighbour_sensitivity(
        model, steps, variants, max_grad_norm=C, mode=mode, between=between
    )
    assert outcome[0] == REFUSED
    # the one-step test too: its first forward is refused
    first_step = steps(model, 0)[0]
    assert sensitivity(model, first_step, 1, max_grad_norm=C, mode=mode)[0] == REFUSED


@pytest.mark.parametrize("name", list(STATEFUL))
def test_without_the_check_the_record_moves_the_next_steps_sum_beyond_c(name, state_check_off):
    """What the refusal prevents: the record, in the first step only, moves the second
    step's clipped sum by more than C (the same test as above, the check switched off)."""
    model, steps, variants, between = _stateful(name)
    with pytest.raises(AssertionError, match="one record moved the clipped sum by"):
        neighbour_sensitivity(model, steps, variants, max_grad_norm=C, between=between)


def _refusal(model, run):
    """Run a refused training forward; the message, with nothing recorded or written to .grad."""
    engine = ClippingEngine(model, 1.0)
    try:
        with pytest.raises(UnsupportedModelError) as refused:
            run()
        assert all(not use.calls for use in engine._uses.values()), "records left behind"
        assert all(p.grad is None for p in model.parameters())
    finally:
        engine.detach()
    return str(refused.value)


_PREFIX = (
    "dptrain refuses to train this model: its training forward wrote state that later steps "
    "read, so a record of this step would reach the next steps' clipped sums through it, "
    "unclipped and without noise: "
)
_KEEP_OUTSIDE = (
    "For a queue, a cache or a running statistic: keep such state outside the model, or "
    "update it from noised quantities after the optimizer step."
)


def test_queue_written_in_place_is_named():
    model = MoCoQueue()
    message = _refusal(model, lambda: model(torch.randn(3, D)))
    assert message == (
        _PREFIX + "queue (buffer of MoCoQueue, written in place); ptr (buffer of MoCoQueue, "
        "written in place). " + _KEEP_OUTSIDE
    )


def test_queue_rebound_is_named():
    model = MoCoQueue(rebind=True)
    message = _refusal(model, lambda: model(torch.randn(3, D)))
    assert message == (
        _PREFIX + "queue (buffer of MoCoQueue, rebound to another tensor). " + _KEEP_OUTSIDE
    )


def test_running_mean_is_named():
    model = nn.Sequential(nn.Linear(D, D), RunningMean())
    message = _refusal(model, lambda: model(torch.randn(3, D)))
    assert message == (
        _PREFIX + "1.running (buffer of RunningMean, written in place). " + _KEEP_OUTSIDE
    )


@pytest.mark.parametrize("frozen", [False, True])
def test_embedding_with_max_norm_is_named(frozen):
    model = MaxNormEmbedding(frozen)
    message = _refusal(model, lambda: model(torch.tensor([[1, 2], [3, 4]])))
    assert message == (
        _PREFIX + "emb.weight (parameter of Embedding, written in place). "
        "Embedding(max_norm=1): max_norm renormalises the rows of the tokens in the batch in "
        "place, without noise: construct the embedding without max_norm."
    )


def test_layers_writing_the_same_state_are_folded_in_the_message():
    # InstanceNorm normalises each example by itself, but with track_running_stats it
    # also averages the batch into its running statistics.
    model = nn.Sequential(
        *[
            nn.Sequential(nn.Linear(D, D), nn.InstanceNorm1d(3, track_running_stats=True))
            for _ in range(3)
        ]
    )
    message = _refusal(model, lambda: model(torch.randn(2, 3, D)))
    assert message == (
        _PREFIX + "*.1.running_mean (buffer of InstanceNorm1d, written in place; 3 modules); "
        "*.1.running_var (buffer of InstanceNorm1d, written in place; 3 modules). "
        "InstanceNorm1d updates its running statistics from the batch: construct it with "
        "track_running_stats=False, or call .eval() on it to freeze them."
    )


def test_parameter_written_in_forward_is_refused():
    class Clamped(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, 2)
            self.scale = nn.Parameter(torch.ones(2))

        def forward(self, x):
            with torch.no_grad():
                self.scale.clamp_(0, 1)
            return self.fc(x) * self.scale

    model = Clamped()
    message = _refusal(model, lambda: model(torch.randn(3, D)))
    assert message == (
        _PREFIX + "scale (parameter of Clamped, written in place). A parameter may change only "
        "by the optimizer's noised step: do not write or rebind parameters in forward "
        "(registering a torch parametrization there, as peft's target_parameters does at every "
        "call, writes the weight too)."
    )


# -- what is not refused ----------------------------------------------------------------------


def test_state_written_only_in_no_grad_forwards_is_not_checked():
    """Evaluation (grad disabled) is not a training forward: its writes are not refused."""

    class EvalCache(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, 3)
            self.register_buffer("last", torch.zeros(D))

        def forward(self, x):
            if not torch.is_grad_enabled():
                self.last.copy_(x[-1])
            return self.fc(x)

    torch.manual_seed(0)
    model = EvalCache().double()
    x, y = _randn(4, D), torch.tensor([0, 1, 2, 0])
    engine = ClippingEngine(model, 1.0)
    with torch.no_grad():
        model(x)
    assert torch.equal(model.last, x[-1])
    engine.detach()
    assert_engine_matches_oracle(
        model, lambda rows: _class_losses(model(x[rows]), y[rows]), 4, mode="book_keeping"
    )


@pytest.mark.parametrize("mode", MODES)
def test_dropout_writes_no_state(mode):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 3)).double()
    x, y = _randn(4, D), torch.tensor([0, 1, 2, 0])

    def losses():
        torch.manual_seed(1)  # the same masks for every lambda
        return _class_losses(model(x), y)

    assert sensitivity(model, losses, 1, max_grad_norm=C, mode=mode)[0] == PRIVATE


def test_read_only_buffers_are_fine():
    class Centred(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, 3)
            self.register_buffer("mean", torch.randn(D))

        def forward(self, x):
            return self.fc(x - self.mean)

    torch.manual_seed(0)
    model = Centred().double()
    x, y = _randn(4, D), torch.tensor([0, 1, 2, 0])
    for mode in MODES:
        assert_engine_matches_oracle(
            model, lambda rows: _class_losses(model(x[rows]), y[rows]), 4, mode=mode
        )


# -- BatchNorm: by what it does at each training forward --------------------------------------


def _pretrained_bn(bn: nn.modules.batchnorm._BatchNorm, seed: int = 1):
    """Running statistics as a pretrained network has them (not the initial 0 / 1)."""
    with torch.no_grad():
        bn.running_mean.copy_(_randn(bn.num_features, seed=seed))
        bn.running_var.copy_(_randn(bn.num_features, seed=seed + 1).abs() + 0.5)
    return bn


class FrozenBackbone(nn.Module):
    """A pretrained front end (linear + BatchNorm, frozen) before a trainable head."""

    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(D, 6), _pretrained_bn(nn.BatchNorm1d(6)), nn.ReLU())
        self.backbone.requires_grad_(False)
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.backbone(x))


def _frozen_backbone(bn_training: bool) -> nn.Module:
    torch.manual_seed(0)
    model = FrozenBackbone().double().train()
    model.backbone.train(bn_training)
    return model


def _one_step(model, v):
    x, y = _features(v, b=5), _labels(v, b=5)
    return [lambda: _class_losses(model(x), y)]


@pytest.mark.parametrize("mode", MODES)
def test_frozen_batchnorm_in_eval_mode_before_a_trainable_head_is_private(mode):
    model = _frozen_backbone(bn_training=False)
    x, y = _features(1, b=5), torch.arange(5) % 3
    assert (
        sensitivity(model, lambda: _class_losses(model(x), y), 1, max_grad_norm=C, mode=mode)[0]
        == PRIVATE
    )
    # the record as an outlier, or removed: the others' inputs do not move
    assert neighbour_sensitivity(model, _one_step, 4, max_grad_norm=C, mode=mode)[0] == PRIVATE
    assert_engine_matches_oracle(
        model, lambda rows: _class_losses(model(x[rows]), y[rows]), 5, mode=mode
    )


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_in_training_mode_is_refused(mode):
    model = _frozen_backbone(bn_training=True)
    x, y = _features(1, b=5), torch.arange(5) % 3
    assert (
        sensitivity(model, lambda: _class_losses(model(x), y), 1, max_grad_norm=C, mode=mode)[0]
        == REFUSED
    )
    assert neighbour_sensitivity(model, _one_step, 4, max_grad_norm=C, mode=mode)[0] == REFUSED
    running = model.backbone[1].running_mean.clone()
    message = _refusal(model, lambda: model(x))
    assert message.startswith(
        "dptrain refuses to train this model: backbone.1 (BatchNorm1d) ran in training mode "
        "in a training forward: it normalises every example by the mean and variance of the "
        "whole batch"
    )
    assert "Call .eval() on it" in message
    assert torch.equal(model.backbone[1].running_mean, running), "refused after it wrote"


def test_without_the_checks_batchnorm_in_training_mode_moves_the_sum_beyond_c(
    batch_norm_check_off, state_check_off, monkeypatch
):
    """A frozen front end's batch statistics mix the examples' inputs, which the gradient
    checks do not see: with the independence check off too, the record, an outlier or
    removed, moves the others' clipped gradients. With it on (it runs in training mode)
    the model is refused on its checked chunk. (The state check alone refuses it too, by
    its num_batches_tracked counter: torch's kernel writes the running mean and variance
    without moving their version counters.)"""
    model = _frozen_backbone(bn_training=True)
    assert neighbour_sensitivity(model, _one_step, 4, max_grad_norm=C)[0] == REFUSED
    monkeypatch.setattr(independence, "run", lambda *args, **kwargs: None)
    with pytest.raises(AssertionError, match="one record moved the clipped sum by"):
        neighbour_sensitivity(model, _one_step, 4, max_grad_norm=C)


def test_batchnorm_without_running_statistics_is_refused_in_eval_mode():
    # torch then uses the batch's statistics in eval mode too
    model = nn.Sequential(nn.Linear(D, D), nn.BatchNorm1d(D, track_running_stats=False)).eval()
    message = _refusal(model, lambda: model(torch.randn(3, D)))
    assert message == (
        "dptrain refuses to train this model: 1 (BatchNorm1d) ran without running statistics "
        "in a training forward: it normalises every example by the mean and variance of the "
        "whole batch (mixing the examples, so per-example gradients do not exist). Construct "
        "it with track_running_stats=True and load running statistics, then call .eval() on "
        "it, or replace it with GroupNorm or LayerNorm."
    )


def test_batchnorm_in_training_mode_is_refused_under_no_grad_inside_the_forward():
    class NoGradFrontEnd(FrozenBackbone):
        def forward(self, x):
            with torch.no_grad():
                h = self.backbone(x)
            return self.head(h)

    torch.manual_seed(0)
    model = NoGradFrontEnd().train()
    message = _refusal(model, lambda: model(torch.randn(3, D)))
    assert message.startswith("dptrain refuses to train this model: backbone.1 (BatchNorm1d)")


def test_model_train_sets_a_frozen_batchnorm_back_to_training_mode():
    model = _frozen_backbone(bn_training=False)
    engine = ClippingEngine(model, 1.0)
    x, y = _features(1), torch.arange(4) % 3
    engine.backward(_class_losses(model(x), y))
    model.train()  # what a training loop may call every step
    with pytest.raises(UnsupportedModelError, match=re.escape("backbone.1 (BatchNorm1d) ran")):
        model(x)
    engine.detach()


class ConvBN(nn.Module):
    """Conv -> BatchNorm2d (eval, trainable affine) -> conv -> pooled head."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = _pretrained_bn(nn.BatchNorm2d(3))
        self.conv2 = nn.Conv2d(3, 3, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        h = self.conv2(torch.relu(self.bn(self.conv1(x))))
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_batchnorm_in_eval_mode_with_trainable_affine_matches_the_oracle(kind, mode):
    """Its weight and bias have no written rule: the generic replay covers them, exactly."""
    torch.manual_seed(0)
    if kind == "1d":
        model = nn.Sequential(
            nn.Linear(D, 6), _pretrained_bn(nn.BatchNorm1d(6)), nn.Tanh(), nn.Linear(6, 3)
        )
        x = _randn(5, D)
    else:
        model = ConvBN()
        x = _randn(5, 2, 5, 5)
    model = model.double().train()
    bn = model[1] if kind == "1d" else model.bn
    bn.eval()
    with torch.no_grad():  # not the initial 1 / 0
        bn.weight.copy_(_randn(bn.num_features, seed=3))
        bn.bias.copy_(_randn(bn.num_features, seed=4))
    y = torch.arange(5) % 2
    assert_engine_matches_oracle(
        model, lambda rows: _class_losses(model(x[rows]), y[rows]), 5, mode=mode
    )
    engine = ClippingEngine(model, 1.0)
    assert isinstance(engine._uses[bn].rule, ReplayRule)
    engine.detach()
    assert (
        sensitivity(model, lambda: _class_losses(model(x), y), 1, max_grad_norm=C, mode=mode)[0]
        == PRIVATE
    )


# -- Hugging Face rotary embeddings -----------------------------------------------------------


def _rope_model(kind: str) -> nn.Module:
    import transformers

    from tests.clipping import hf_zoo

    if kind == "dynamic":  # frequencies rebuilt, and kept, for the longest batch seen
        config = transformers.LlamaConfig(
            **{**hf_zoo._DECODER, "max_position_embeddings": 8},
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        )
        return transformers.LlamaForCausalLM(config)
    config = transformers.Phi3Config(  # longrope: factors picked by the batch's longest sequence
        **{**hf_zoo._DECODER, "max_position_embeddings": 32},
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0] * 4,
            "long_factor": [2.0] * 4,
            "original_max_position_embeddings": 8,
        },
    )
    return transformers.Phi3ForCausalLM(config)


@pytest.mark.parametrize(
    ("kind", "seq_len", "written"),
    [("dynamic", 12, "rebound to another tensor"), ("longrope", 6, "written in place")],
)
def test_rotary_embeddings_that_follow_the_batch_length_are_refused(kind, seq_len, written):
    """The families of the coverage table (default RoPE) write nothing in forward
    (test_hf_families.py runs them all through the engine); these two RoPE types do."""
    torch.manual_seed(0)
    model = _rope_model(kind)
    if kind == "dynamic":  # within the original window nothing is written
        engine = ClippingEngine(model, 1.0)
        model(input_ids=torch.randint(3, 50, (2, 6)))
        engine.detach()
    message = _refusal(model, lambda: model(input_ids=torch.randint(3, 50, (2, seq_len))))
    rotary = type(model.model.rotary_emb).__name__
    assert f"model.rotary_emb.inv_freq (buffer of {rotary}, {written})" in message
    assert f"{rotary}: a rotary embedding whose frequencies follow the sequence length" in message
