"""Verdicts that hold on every chunk, in every precision, whatever the kernel order.

The held-out classes of issue 26 and ours, each through the sensitivity test (one
record moves the clipped sum by at most C, or the model is refused):

- subsets that separate every ordered pair of examples, at any chunk size;
- rows that the data decide (a head on tokens selected by their labels) after a
  chunk that looked like blocks; per-example losses gathered by index;
- mixing that some chunks do and others do not (a branch taken at run time);
- mixing where no gradient flows, only in training mode;
- backward passes that accumulate in another order on every run (as GPU kernels
  do), at bf16 rounding level: never refused, while mixing of the same size is.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from dptrain.clipping import ClippingEngine, UnsupportedModelError
from dptrain.clipping.independence import UnsupportedInputsWarning
from dptrain.clipping.separation import separating_masks, subsets_needed
from tests.clipping import hf_zoo
from tests.clipping.sensitivity import LAMBDAS, PRIVATE, REFUSED, SLACK, sensitivity

MODES = ["book_keeping", "ghost"]


# -- subsets that separate every pair --------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 300))
def test_every_ordered_pair_is_separated_with_the_fewest_subsets(b):
    masks = separating_masks(b)
    assert masks.shape == (subsets_needed(b), b)
    # separated[j, i]: some subset holds j and not i
    separated = masks.T.double() @ (~masks).double() > 0
    assert bool((separated | torch.eye(b, dtype=torch.bool)).all())
    m = masks.shape[0]
    if b > 2:  # Sperner: one subset fewer cannot give b codes no one of which holds another
        assert math.comb(m - 1, (m - 1) // 2) < b


class ReadsAnother(nn.Module):
    """Example ``reader`` adds example ``source``'s hidden state to its own."""

    def __init__(self, b: int, reader: int, source: int, detached: bool, d: int = 4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, d), nn.Linear(d, 1)
        pick = torch.zeros(b, b, dtype=torch.float64)
        pick[reader, source] = 1.0
        self.register_buffer("pick", pick)
        self.detached = detached

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        other = self.pick @ (h.detach() if self.detached else h)
        return self.fc2(h + other).squeeze(-1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("detached", [False, True])
@pytest.mark.parametrize(("b", "reader", "source"), [(8, 5, 6), (16, 3, 12), (16, 12, 3)])
def test_one_example_reading_another_is_refused_at_any_chunk_size(
    mode, detached, b, reader, source
):
    torch.manual_seed(0)
    model = ReadsAnother(b, reader, source, detached).double()
    x = torch.randn(b, 3, dtype=torch.float64)
    assert sensitivity(model, lambda: model(x), source, max_grad_norm=0.1, mode=mode)[0] == REFUSED


# -- checks in the mode being trained --------------------------------------------------


class CentredWhenTraining(nn.Module):
    """Subtracts the batch mean (detached) in training mode only, as a homemade norm."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, d), nn.Linear(d, 1)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.training:
            h = h - h.detach().mean(0)
        return self.fc2(h).squeeze(-1)


@pytest.mark.parametrize("mode", MODES)
def test_batch_statistics_taken_only_in_training_mode_are_refused(mode):
    torch.manual_seed(0)
    model = CentredWhenTraining().double().train()
    x = torch.randn(4, 3, dtype=torch.float64)
    engine = ClippingEngine(model, 1.0, mode=mode)
    with pytest.raises(UnsupportedModelError, match=r"^module fc2 \(Linear\): the input of its"):
        engine.backward(model(x))
    engine.detach()
    assert model.training and all(p.grad is None for p in model.parameters())
    assert sensitivity(model, lambda: model(x), 1, max_grad_norm=0.1, mode=mode)[0] == REFUSED


# -- rows that the data decide -----------------------------------------------------------


def _sums_after(engine: ClippingEngine, chunks, last, index: int) -> list[Tensor]:
    """Run ``chunks`` (callables giving losses) through ``engine``, then the clipped sum of
    ``last`` for each lambda (example ``index`` scaled), as sensitivity.clipped_sums does."""
    params = engine.parameters()
    for losses_of in chunks:
        engine.model.zero_grad(set_to_none=True)
        engine.backward(losses_of())
    out = []
    for lam in LAMBDAS:
        engine.model.zero_grad(set_to_none=True)
        losses = last()
        scale = torch.ones_like(losses)
        scale[index] = lam
        engine.backward(losses * scale)
        out.append(torch.cat([engine.clipped_sum(p).flatten().double() for p in params]))
    return out


def _outcome_after(model, chunks, last, index: int, mode: str, c: float = 0.1) -> str:
    """REFUSED, or PRIVATE after asserting one record moved ``last``'s clipped sum by <= C."""
    engine = ClippingEngine(model, c, mode=mode)
    try:
        sums = _sums_after(engine, chunks, last, index)
    except UnsupportedModelError:
        return REFUSED
    finally:
        engine.detach()
        model.zero_grad(set_to_none=True)
    worst = max(float((x - y).norm()) for x, y in itertools.combinations(sums, 2))
    assert worst <= c * (1 + SLACK) + SLACK, (
        f"one record moved the clipped sum by {worst / c:.3f} C"
    )
    return PRIVATE


class SparseHead(nn.Module):
    """A head on the tokens that have labels only (ModernBERT's sparse prediction); the
    token losses are added into their examples by index."""

    def __init__(self, trainable_body: bool, vocab: int = 11, d: int = 6):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.body = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab)
        for p in [*self.tok.parameters(), *self.body.parameters()]:
            p.requires_grad_(trainable_body)

    def forward(self, ids, labels):
        h = torch.tanh(self.body(self.tok(ids)))  # (B, T, d)
        chosen = labels != -100
        logits = self.head(h[chosen])  # (N, vocab): N set by the labels
        token_losses = F.cross_entropy(logits, labels[chosen], reduction="none")
        example = chosen.nonzero()[:, 0]
        return token_losses.new_zeros(ids.shape[0]).index_add(0, example, token_losses)


def _labelled(ids: Tensor, counts: list[int]) -> Tensor:
    labels = torch.full_like(ids, -100)
    for i, n in enumerate(counts):
        labels[i, :n] = ids[i, :n]
    return labels


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("trainable_body", [True, False])
@pytest.mark.parametrize(
    ("first", "later"),
    [
        ([2, 2, 2, 2], [3, 1, 2, 2]),  # blocks of 2 per example, then other counts
        ([1, 1, 1, 1], [2, 0, 1, 1]),  # one per example (rows of B), then other counts
        ([3, 3, 3, 3], [3, 3, 3, 3]),  # every token labelled: blocks of T (structural)
    ],
)
def test_a_head_on_selected_tokens_never_leaks(mode, trainable_body, first, later):
    torch.manual_seed(0)
    model = SparseHead(trainable_body).double()
    ids = torch.randint(0, 11, (4, 3))

    def chunk(counts):
        return lambda: model(ids, _labelled(ids, counts))

    outcome = _outcome_after(model, [chunk(first)], chunk(later), 1, mode)
    if first == later:  # equal counts on every chunk: the blocks are right, and clipped
        assert outcome == PRIVATE
    else:
        assert outcome == REFUSED


class GatheredLosses(nn.Module):
    """Per-example losses gathered from token rows by an index the data set: right on a
    chunk with equal counts, wrong (example i reads example j's rows) on the others."""

    def __init__(self, d: int = 6):
        super().__init__()
        self.fc = nn.Linear(3, d)
        self.head = nn.Linear(d, 1)

    def forward(self, x, counts):  # x (B, T, 3)
        token = self.head(torch.tanh(self.fc(x))).squeeze(-1).flatten()  # (B*T,)
        t = x.shape[1]
        # the bug: rows of the first sum(counts) tokens in order, cut in equal parts
        chosen = torch.cat([torch.arange(i * t, i * t + n) for i, n in enumerate(counts)])
        return token[chosen].pow(2).view(x.shape[0], -1).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_losses_gathered_from_other_examples_rows_on_a_later_chunk_are_refused(mode):
    torch.manual_seed(0)
    model = GatheredLosses().double()
    x = torch.randn(4, 3, 3, dtype=torch.float64)
    first = lambda: model(x, [2, 2, 2, 2])  # noqa: E731
    later = lambda: model(x, [3, 1, 2, 2])  # noqa: E731
    assert _outcome_after(model, [first], later, 1, mode) == REFUSED


class SequenceClassifier(nn.Module):
    """Scores every token and reads each example's score at its last real token, by
    index (Hugging Face's *ForSequenceClassification pooling)."""

    def __init__(self, vocab: int = 11, d: int = 6):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.score = nn.Linear(d, 2)

    def forward(self, ids, last):
        logits = self.score(torch.tanh(self.tok(ids)))  # (B, T, 2)
        return logits[torch.arange(ids.shape[0]), last]  # (B, 2)


@pytest.mark.parametrize("mode", MODES)
def test_pooling_by_index_is_decided_per_chunk_without_a_full_check(mode):
    torch.manual_seed(0)
    model = SequenceClassifier().double()
    ids = torch.randint(0, 11, (4, 5))
    y = torch.tensor([0, 1, 1, 0])

    def chunk(last):
        return lambda: F.cross_entropy(model(ids, torch.tensor(last)), y, reduction="none")

    engine = ClippingEngine(model, 0.1, mode=mode)
    for last in ([4, 4, 4, 4], [1, 3, 2, 4], [0, 0, 3, 1]):
        model.zero_grad(set_to_none=True)
        engine.backward(chunk(last)())
    assert engine.self_checks == 1  # the selection's rows are decided where it reads them
    engine.detach()
    assert _outcome_after(model, [chunk([4, 4, 4, 4])], chunk([1, 3, 2, 4]), 2, mode) == PRIVATE


class SortedByLength(nn.Module):
    """Sorts the examples by length inside forward and puts them back after the first
    layer (as bucketing code does): the first layer's rows are another example's."""

    def __init__(self, vocab: int = 11, d: int = 6):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, 1)

    def forward(self, ids, lengths):
        order = torch.argsort(lengths, stable=True)
        h = self.tok(ids[order])  # rows in length order
        h = h[torch.argsort(order)]  # back in the chunk's order
        return self.fc(torch.tanh(h)).squeeze(-1).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_examples_reordered_by_the_data_inside_forward_never_leak(mode):
    torch.manual_seed(0)
    model = SortedByLength().double()
    ids = torch.randint(0, 11, (4, 3))

    def chunk(lengths):
        return lambda: model(ids, torch.tensor(lengths))

    # the first chunk is already in order (the rows are right); the later one is not
    outcome = _outcome_after(model, [chunk([1, 2, 3, 4])], chunk([4, 1, 3, 2]), 1, mode)
    assert outcome == REFUSED


class CapacityRouter(nn.Module):
    """Each example keeps only its tokens among the chunk's top half by a detached score
    (a capacity shared by the batch, as in switch-style routing)."""

    def __init__(self, d: int = 4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, d), nn.Linear(d, 1)

    def forward(self, x):  # x (B, T, 3)
        h = torch.tanh(self.fc1(x))
        score = h.detach().sum(-1).flatten()
        kept = torch.zeros_like(score).scatter(0, score.topk(score.numel() // 2).indices, 1.0)
        return self.fc2(h * kept.view(h.shape[:2]).unsqueeze(-1)).squeeze(-1).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_a_capacity_shared_by_the_chunk_is_refused(mode):
    torch.manual_seed(0)
    model = CapacityRouter().double()
    x = torch.randn(4, 3, 3, dtype=torch.float64)
    assert sensitivity(model, lambda: model(x), 1, max_grad_norm=0.1, mode=mode)[0] == REFUSED


class TrimsPadding(nn.Module):
    """Cuts the chunk's padding to its longest example inside forward (as collators and
    some models do): the shapes every module sees depend on the longest example."""

    def __init__(self, vocab: int = 11, d: int = 6):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.fc = nn.Linear(d, 1)

    def forward(self, ids, mask):
        longest = int(mask.sum(1).max())
        ids, mask = ids[:, :longest], mask[:, :longest]
        return (self.fc(torch.tanh(self.tok(ids))).squeeze(-1) * mask).sum(1)


@pytest.mark.parametrize("mode", MODES)
def test_padding_trimmed_to_the_longest_example_is_clipped_not_refused(mode):
    torch.manual_seed(0)
    model = TrimsPadding().double()
    ids = torch.randint(1, 11, (4, 6))
    mask = torch.zeros(4, 6)
    for i, n in enumerate([2, 5, 3, 1]):
        mask[i, :n] = 1
    ids = ids * mask.long()
    # example 1 is the longest: scaling its loss, or replacing it, changes the others' shape
    with pytest.warns(UnsupportedInputsWarning, match="inputs change shape"):
        outcome = sensitivity(model, lambda: model(ids, mask), 1, max_grad_norm=0.1, mode=mode)
    assert outcome[0] == PRIVATE


# -- mixing that some chunks do and others do not ------------------------------------------


class MixesSometimes(nn.Module):
    """Adds the next example's hidden state to each example's on the forwards where a
    draw of the random number generator falls below 1/2."""

    def __init__(self, detached: bool, d: int = 4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(3, d), nn.Linear(d, 1)
        self.detached = detached

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if torch.rand(()) < 0.5:
            h = h + 0.5 * (h.detach() if self.detached else h).roll(1, 0)
        return self.fc2(h).squeeze(-1)


def _seed_that_mixes_later() -> int:
    """A seed whose first draw does not mix and whose second does."""
    for seed in itertools.count():
        torch.manual_seed(seed)
        if float(torch.rand(())) >= 0.5 and float(torch.rand(())) < 0.5:
            return seed
    raise AssertionError  # pragma: no cover


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("detached", [False, True])
def test_mixing_on_a_later_chunk_only_is_refused(mode, detached):
    torch.manual_seed(0)
    model = MixesSometimes(detached).double()
    x = torch.randn(4, 3, dtype=torch.float64)
    torch.manual_seed(_seed_that_mixes_later())
    outcome = _outcome_after(model, [lambda: model(x)], lambda: model(x), 1, mode)
    assert outcome == REFUSED


# -- backward accumulation in another order on every run (GPU kernels) ------------------------


class _Jitter(torch.autograd.Function):
    """Identity whose backward rounds differently on every run: each gradient entry times
    (1 + u 2^-8), u uniform in [-1, 1] drawn anew (bf16's rounding step), as a GPU kernel
    that accumulates in another order on every run perturbs it; nothing crosses rows."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * (1 + (torch.rand_like(g) * 2 - 1) * 2**-8)


class _Leak(torch.autograd.Function):
    """Identity whose backward adds 2^-8 of the previous example's gradient: mixing as
    small as the jitter above."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g + 2**-8 * g.roll(1, 0)


class Perturbed(nn.Module):
    def __init__(self, fn, vocab: int = 17, d: int = 16):
        super().__init__()
        self.fn = fn
        self.tok = nn.Embedding(vocab, d)
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, vocab)

    def forward(self, ids):
        h = self.fn.apply(torch.tanh(self.fc1(self.tok(ids))))
        return self.fc2(h)


def _bf16_token_losses(model, ids):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids[:, :-1])
    return F.cross_entropy(logits.float().transpose(1, 2), ids[:, 1:], reduction="none").mean(1)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mode", MODES)
def test_bf16_rounding_noise_in_the_backward_is_never_refused(mode, seed):
    torch.manual_seed(seed)
    model = Perturbed(_Jitter)
    ids = torch.randint(0, 17, (16, 12))
    engine = ClippingEngine(model, 1.0, mode=mode)
    engine.backward(_bf16_token_losses(model, ids))  # not refused
    assert engine.self_checks == 1
    engine.detach()


@pytest.mark.parametrize("mode", MODES)
def test_mixing_as_small_as_bf16_rounding_is_refused(mode):
    torch.manual_seed(0)
    model = Perturbed(_Leak)
    ids = torch.randint(0, 17, (16, 12))
    engine = ClippingEngine(model, 1.0, mode=mode)
    with pytest.raises(UnsupportedModelError, match=r"are not one per example"):
        engine.backward(_bf16_token_losses(model, ids))
    engine.detach()


# -- a Llama under bf16 autocast at the sizes users train at -------------------------------


@pytest.mark.parametrize(
    ("mode", "b", "t"),
    [
        ("book_keeping", 16, 512),
        pytest.param("ghost", 16, 512, marks=pytest.mark.slow),
        pytest.param("book_keeping", 8, 512, marks=pytest.mark.slow),
        pytest.param("ghost", 8, 512, marks=pytest.mark.slow),
    ],
)
def test_llama_under_bf16_autocast_at_b16_t512_is_clipped_not_refused(mode, b, t):
    """A tied Llama (SDPA attention, as users run it) under bf16 autocast on the CPU, at
    the chunk sizes at which the rows check's tolerance refused Llama on an H100."""
    case = hf_zoo.llama(tied=True, max_position_embeddings=t, attn_implementation="sdpa")
    model = case.model.float()
    kwargs, labels = case.make_batch(b, t, 0)

    def losses():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(**kwargs)
        return hf_zoo.token_losses(_Upcast(out.logits.float()), labels)

    # bf16 inside: one record moves the float32 sum by C plus float32 rounding
    outcome, worst = sensitivity(model, losses, 1, max_grad_norm=0.1, mode=mode, slack=1e-5)
    assert outcome == PRIVATE, "refused"
    assert worst <= 1 + 1e-5


class _Upcast:
    def __init__(self, logits: Tensor):
        self.logits = logits
