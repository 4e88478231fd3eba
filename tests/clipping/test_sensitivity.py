"""The sensitivity test over the classes where an engine can be silently not private.

Each case is a model and per-example losses; the engine must either keep one
record's influence on the clipped sum within C (tests/clipping/sensitivity.py)
or refuse the model. Where a case is private by design, the test also says
which outcome is expected, so a refusal of a supported model fails too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dptrain.losses import per_example_cross_entropy
from dptrain.models.rnn import DPGRU
from tests.clipping.sensitivity import PRIVATE, REFUSED, sensitivity

MODES = ["book_keeping", "ghost"]
T = 5


def _ids(b, t=T, vocab=13, seed=0):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _outcome(model, losses_of, mode, **kw):
    torch.manual_seed(0)
    return sensitivity(model, losses_of, index=1, max_grad_norm=0.1, mode=mode, **kw)[0]


# -- 1. a shared lookup whose length is not T: a prefix token added inside forward ----------


class PrefixPositions(nn.Module):
    """A [CLS] row prepended inside forward: positions run over T + 1, looked up 1-D."""

    def __init__(self, vocab=13, d=6, max_len=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.cls = nn.Embedding(1, d)
        self.pos = nn.Embedding(max_len, d)
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        b, t = ids.shape
        cls = self.cls(torch.zeros(b, 1, dtype=torch.long))
        h = torch.cat([cls, self.tok(ids)], 1) + self.pos(torch.arange(t + 1))
        return self.head(torch.tanh(h).mean(1))


def _prefix_losses(b):
    model = PrefixPositions().double()
    ids, y = _ids(b), torch.arange(b) % 3
    return model, lambda: F.cross_entropy(model(ids), y, reduction="none")


@pytest.mark.parametrize("mode", MODES)
def test_prefix_positions_when_the_chunk_holds_t_plus_one_examples(mode):
    # (T + 1,) ids for T + 1 examples: the table's (T + 1, d) output is broadcast over the
    # batch (added to the (B, T + 1, d) tokens), so it is read as shared (structure, not
    # sizes) and clipped exactly; it used to be refused.
    assert _outcome(*_prefix_losses(T + 1), mode) == PRIVATE


@pytest.mark.parametrize("mode", MODES)
def test_prefix_positions_otherwise(mode):
    assert _outcome(*_prefix_losses(T - 1), mode) == PRIVATE


# -- 2. T5's relative-position ids of shape (T, T) ----------------------------------------


class RelativeBias(nn.Module):
    """Attention with a T5-style bias: bucket ids (T, T) -> Embedding -> (1, heads, T, T)."""

    def __init__(self, vocab=13, d=6, heads=2, buckets=4):
        super().__init__()
        self.heads, self.buckets = heads, buckets
        self.tok = nn.Embedding(vocab, d)
        self.bias = nn.Embedding(buckets, heads)
        self.qk = nn.Linear(d, 2 * d)
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        t = ids.shape[1]
        h = self.tok(ids)
        q, k = self.qk(h).chunk(2, -1)
        rel = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).clamp(0, self.buckets - 1)
        bias = self.bias(rel).permute(2, 0, 1).unsqueeze(0)  # (1, heads, T, T)
        scores = (q @ k.transpose(1, 2)).unsqueeze(1) + bias  # (B, heads, T, T)
        return self.head(scores.softmax(-1).mean(1) @ h).mean(1)


@pytest.mark.parametrize("b", [T, T + 2])
@pytest.mark.parametrize("mode", MODES)
def test_relative_position_ids(mode, b):
    model = RelativeBias().double()
    ids, y = _ids(b), torch.arange(b) % 3
    assert _outcome(model, lambda: F.cross_entropy(model(ids), y, reduction="none"), mode) in (
        REFUSED,
    )


# -- 3. time-first models (T, B, ...) -------------------------------------------------------


class TimeFirst(nn.Module):
    def __init__(self, vocab=13, d=6):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.rnn = DPGRU(d, d, batch_first=False)
        self.head = nn.Linear(d, 3)

    def forward(self, ids):  # ids (T, B)
        out, _ = self.rnn(self.tok(ids))  # (T, B, d)
        return self.head(out)  # (T, B, 3): the head sees time-first rows


@pytest.mark.parametrize("b", [T, T + 1])
@pytest.mark.parametrize("mode", MODES)
def test_time_first_model(mode, b):
    model = TimeFirst().double()
    ids, y = _ids(b).T.contiguous(), torch.arange(b) % 3

    def losses():
        return F.cross_entropy(model(ids).sum(0), y, reduction="none")

    assert _outcome(model, losses, mode) == REFUSED


# -- 4. a clipped parameter used after forward returns --------------------------------------


class Encoder(nn.Module):
    def __init__(self, vocab=13, d=6):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)

    def forward(self, ids):
        return torch.tanh(self.fc(self.tok(ids)))  # (B, T, d)


@pytest.mark.parametrize("mode", MODES)
def test_tied_head_written_in_the_loss_code(mode):
    model = Encoder().double()
    ids = _ids(4)

    def losses():
        logits = model(ids) @ model.tok.weight.T  # the tied head, outside any module
        return per_example_cross_entropy(logits[:, :-1], ids[:, 1:])

    assert _outcome(model, losses, mode) == REFUSED


@pytest.mark.parametrize("mode", MODES)
def test_weight_penalty_added_to_the_per_example_losses(mode):
    model = Encoder().double()
    ids = _ids(4)

    def losses():
        return model(ids).pow(2).sum((1, 2)) + 1e-3 * model.fc.weight.pow(2).sum()

    assert _outcome(model, losses, mode) == REFUSED


# -- 5. operations that mix examples --------------------------------------------------------


class Centred(nn.Module):
    def __init__(self, d=6):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, d), nn.Linear(d, 1)

    def forward(self, x):
        h = self.fc1(x)
        return self.fc2(h - h.mean(0)).squeeze(-1)  # batch statistics


@pytest.mark.parametrize("mode", MODES)
def test_batch_mean_between_layers(mode):
    model = Centred().double()
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert _outcome(model, lambda: model(x).pow(2), mode) == REFUSED


@pytest.mark.parametrize("mode", MODES)
def test_in_batch_negatives_in_the_loss(mode):
    model = Encoder().double()
    ids = _ids(4)

    def losses():  # contrastive: each example against the others of the chunk
        z = model(ids).mean(1)
        return F.cross_entropy(z @ z.T, torch.arange(4), reduction="none")

    assert _outcome(model, losses, mode) == REFUSED


# -- 6. classes of our own ------------------------------------------------------------------


class Flattened(nn.Module):
    """Tokens flattened to (B*T, d) (OPT does this) or time-major (T*B, d)."""

    def __init__(self, time_major: bool, vocab=13, d=6):
        super().__init__()
        self.time_major = time_major
        self.tok = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, d)
        self.head = nn.Linear(d, 1)

    def forward(self, ids):
        h = self.tok(ids)
        b, t, d = h.shape
        if self.time_major:
            flat = self.fc(h.transpose(0, 1).reshape(t * b, d)).reshape(t, b, d).transpose(0, 1)
        else:
            flat = self.fc(h.reshape(b * t, d)).reshape(b, t, d)
        return self.head(torch.tanh(flat)).squeeze(-1).pow(2).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_tokens_flattened_example_major_are_clipped(mode):
    model = Flattened(time_major=False).double()
    ids = _ids(4)
    assert _outcome(model, lambda: model(ids), mode) == PRIVATE


@pytest.mark.parametrize("mode", MODES)
def test_tokens_flattened_time_major_are_refused(mode):
    model = Flattened(time_major=True).double()
    ids = _ids(4)
    assert _outcome(model, lambda: model(ids), mode) == REFUSED


class TableOfTwoB(nn.Module):
    """A linear layer over a shared (2B, d) table: a multiple of B looks like blocks."""

    def __init__(self, rows: int, d=6):
        super().__init__()
        self.rows = rows
        self.table = nn.Linear(d, d)
        self.fc = nn.Linear(d, 1)

    def forward(self, x):  # x (B, rows, d)
        shared = self.table(torch.eye(self.rows, x.shape[-1], dtype=x.dtype))
        return self.fc(torch.tanh(x + shared)).squeeze(-1).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_shared_table_whose_length_is_a_multiple_of_the_chunk(mode):
    model = TableOfTwoB(rows=8).double()
    x = torch.randn(4, 8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert _outcome(model, lambda: model(x), mode) == REFUSED


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool, vocab=13, d=6):
        super().__init__()
        self.reentrant = reentrant
        self.tok = nn.Embedding(vocab, d)
        self.block = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.LayerNorm(d), nn.Linear(d, d))
        self.head = nn.Linear(d, 3)

    def forward(self, ids):
        h = checkpoint(self.block, self.tok(ids), use_reentrant=self.reentrant)
        return self.head(h.mean(1))


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_activation_checkpointing(mode, reentrant):
    model = Checkpointed(reentrant).double()
    ids, y = _ids(4), torch.arange(4) % 3

    def losses():
        return F.cross_entropy(model(ids), y, reduction="none")

    assert _outcome(model, losses, mode) == (REFUSED if reentrant else PRIVATE)


class NormalisedInput(nn.Module):
    """Standardises its float input with batch statistics before any trainable layer."""

    def __init__(self, d=6):
        super().__init__()
        self.fc = nn.Linear(d, 1)

    def forward(self, x):
        x = (x - x.mean(0)) / (x.std(0) + 1e-6)
        return self.fc(x).squeeze(-1)


def test_batch_statistics_before_any_trainable_layer():
    model = NormalisedInput().double()
    # The record enters the others' inputs through the batch mean and std.
    x = torch.randn(4, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[1] *= 1e3

    def losses():
        return model(x).pow(2)

    assert _outcome(model, losses, "book_keeping") == REFUSED


# -- 7. supported models stay supported -------------------------------------------------------


# The layers as a CPU and as CUDA choose them: CUDA instantiates every linear layer of
# this small GPT at T 6 (d_in d_out <= T (d_in + d_out)), the CPU ghost-norms the MLP.
# CUDA's choice with flat clipping only: the clipping function does not depend on how a
# norm is formed.
@pytest.mark.parametrize(
    ("clipping", "chosen_as_on"),
    [("flat", "cpu"), ("automatic", "cpu"), ("per_layer", "cpu"), ("flat", "cuda")],
)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_reference_gpt_is_private(mode, tied, clipping, chosen_as_on, monkeypatch):
    from dptrain.clipping import rules
    from tests.clipping.test_models import gpt_case

    monkeypatch.setattr(rules, "SIZE_RULE_DEVICES", {"cuda", chosen_as_on})
    if clipping == "per_layer" and mode == "ghost":
        pytest.skip("per-layer clipping needs book-keeping")
    for batch, seq in [(4, 6), (6, 6), (7, 6)]:  # B == T and B == T + 1 included
        model, losses_of, b = gpt_case(tied, batch=batch, seq=seq)
        result = sensitivity(
            model,
            lambda lo=losses_of, b=b: lo(slice(0, b)),
            1,
            mode=mode,
            clipping=clipping,
        )
        assert result[0] == PRIVATE
