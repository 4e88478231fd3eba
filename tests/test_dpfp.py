"""Tests of DP forward propagation (Du & Mi et al., DP-FP, Algorithm 1)."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from dptrain.accounting import DPFPCalibration, PrivacyLedger
from dptrain.dpfp import BernoulliMicroBatches, DPForwardLayer, DPFPTrainer

# -- DPForwardLayer -----------------------------------------------------------------


def test_clipping_is_exact() -> None:
    layer = DPForwardLayer(2.0, 0.0, seed=0)
    h = torch.tensor([[3.0, 4.0], [0.3, 0.4], [0.0, 0.0], [1.2, 1.6], [-6.0, 8.0]])
    out = layer(h)
    norms = torch.linalg.vector_norm(out, dim=1)
    # Rows above C are scaled onto the sphere of radius C, keeping their direction.
    assert norms[0].item() == pytest.approx(2.0, rel=1e-6)
    assert norms[4].item() == pytest.approx(2.0, rel=1e-6)
    torch.testing.assert_close(out[0], torch.tensor([1.2, 1.6]))
    torch.testing.assert_close(out[4], torch.tensor([-1.2, 1.6]))
    # Rows within C (including exactly C and zero) are untouched, bit for bit.
    assert torch.equal(out[1], h[1])
    assert torch.equal(out[2], h[2])
    assert torch.equal(out[3], h[3])


def test_noise_std_is_noise_multiplier_times_clip() -> None:
    clip, z = 2.5, 0.8
    layer = DPForwardLayer(clip, z, seed=123)
    n_rows, k = 500, 20
    out = layer(torch.zeros(n_rows, k))
    n = out.numel()
    # sum(x^2) / s^2 ~ chi2(n): mean n, std sqrt(2n). A 5-sigma band.
    stat = float((out.double() ** 2).sum()) / (clip * z) ** 2
    assert abs(stat - n) < 5 * math.sqrt(2 * n)
    assert abs(float(out.double().mean())) < 5 * clip * z / math.sqrt(n)
    assert layer.noise_std == pytest.approx(2.0)


def test_noise_rows_are_added_after_clipping() -> None:
    layer = DPForwardLayer(1.0, 0.01, seed=5)
    h = torch.full((2000, 4), 10.0)  # norm 20 -> clipped to 1: each coordinate 0.5
    out = layer(h)
    assert float(out.mean()) == pytest.approx(0.5, abs=1e-3)


def test_eval_mode_is_identity_bit_exact() -> None:
    layer = DPForwardLayer(0.1, 3.0, seed=0).eval()
    h = torch.randn(7, 5, generator=torch.Generator().manual_seed(1)) * 10
    out = layer(h)
    assert out is h or torch.equal(out, h)


def test_reproducible_with_seed_and_different_without() -> None:
    h = torch.randn(6, 3, generator=torch.Generator().manual_seed(2))
    a = DPForwardLayer(1.0, 1.0, seed=42)(h)
    b = DPForwardLayer(1.0, 1.0, seed=42)(h)
    c = DPForwardLayer(1.0, 1.0, seed=43)(h)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    os_seeded = DPForwardLayer(1.0, 1.0)
    assert isinstance(os_seeded.seed, int)
    again = DPForwardLayer(1.0, 1.0, seed=os_seeded.seed)
    assert torch.equal(os_seeded(h), again(h))


def test_dtype_is_kept_and_noise_drawn_in_float32() -> None:
    layer = DPForwardLayer(1.0, 1.0, seed=0)
    out = layer(torch.zeros(4, 3, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    ref = torch.randn((4, 3), generator=torch.Generator().manual_seed(0), dtype=torch.float32)
    torch.testing.assert_close(out, ref.to(torch.bfloat16))
    assert DPForwardLayer(1.0, 1.0, seed=0)(torch.zeros(2, 2, dtype=torch.float64)).dtype == (
        torch.float64
    )


def test_layer_exposes_its_settings() -> None:
    layer = DPForwardLayer(1.5, 0.25, seed=9)
    assert (layer.max_norm, layer.noise_multiplier, layer.seed) == (1.5, 0.25, 9)
    assert "seed=9" in repr(layer)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"max_norm": 0.0, "noise_multiplier": 1.0}, "max_norm=0.0 is not allowed: expected"),
        ({"max_norm": -1.0, "noise_multiplier": 1.0}, "max_norm=-1.0 is not allowed"),
        ({"max_norm": 1.0, "noise_multiplier": -0.1}, "noise_multiplier=-0.1 is not allowed"),
        ({"max_norm": 1.0, "noise_multiplier": math.nan}, "noise_multiplier=nan is not allowed"),
        ({"max_norm": 1.0, "noise_multiplier": 1.0, "seed": -1}, "seed=-1 is not allowed"),
        ({"max_norm": 1.0, "noise_multiplier": 1.0, "seed": 2**64}, "seed=18446744073709551616"),
    ],
)
def test_layer_bad_arguments(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=re.escape(fragment)):
        DPForwardLayer(**kwargs)


def test_layer_bad_input() -> None:
    layer = DPForwardLayer(1.0, 1.0, seed=0)
    with pytest.raises(ValueError, match=r"input shape=\(2, 3, 4\) is not allowed: expected"):
        layer(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match=re.escape("input dtype=torch.int64 is not allowed")):
        layer(torch.zeros(2, 3, dtype=torch.long))


def test_gradient_flows_through_clip_and_noise() -> None:
    layer = DPForwardLayer(1.0, 0.5, seed=0)
    h = torch.tensor([[0.3, 0.4], [3.0, 4.0], [0.0, 0.0]], requires_grad=True)
    layer(h).sum().backward()
    assert h.grad is not None and torch.isfinite(h.grad).all()
    torch.testing.assert_close(h.grad[0], torch.ones(2))  # unclipped row: identity


# -- BernoulliMicroBatches ----------------------------------------------------------


def test_bernoulli_micro_batch_statistics() -> None:
    d, b, m, t = 500, 20, 4, 200
    sampler = BernoulliMicroBatches(d, b, m, t, seed=7)
    p = sampler.p
    assert p == pytest.approx(b / (m * d))
    steps = list(sampler)
    assert len(steps) == t and all(len(s) == m for s in steps)
    sizes = torch.tensor([len(mb) for s in steps for mb in s], dtype=torch.float64)
    n = sizes.numel()
    mean, var = d * p, d * p * (1 - p)
    assert abs(float(sizes.mean()) - mean) < 5 * math.sqrt(var / n)
    # Sample variance: relative std about sqrt((2 + excess kurtosis) / n).
    kurt = (1 - 6 * p * (1 - p)) / var
    assert abs(float(sizes.var()) / var - 1) < 5 * math.sqrt((2 + kurt) / n)
    # Every record is equally likely: per-record counts ~ Binomial(n, p), chi-square over d.
    counts = torch.zeros(d, dtype=torch.float64)
    for s in steps:
        for mb in s:
            assert mb == sorted(set(mb))
            counts[mb] += 1
    chi2 = float(((counts - n * p) ** 2).sum()) / (n * p * (1 - p))
    assert abs(chi2 - d) < 5 * math.sqrt(2 * d)
    assert any(len(mb) == 0 for s in steps for mb in s)  # empties are yielded, not skipped


def test_bernoulli_micro_batches_reproducible() -> None:
    a = list(BernoulliMicroBatches(100, 8, 4, 5, seed=3))
    b = list(BernoulliMicroBatches(100, 8, 4, 5, seed=3))
    c = list(BernoulliMicroBatches(100, 8, 4, 5, seed=4))
    assert a == b and a != c
    s = BernoulliMicroBatches(100, 8, 4, 5)
    assert isinstance(s.seed, int)
    assert list(s) == list(BernoulliMicroBatches(100, 8, 4, 5, seed=s.seed))


def test_bernoulli_bad_arguments() -> None:
    with pytest.raises(ValueError, match="batch_size=41 is not allowed: expected batch_size <="):
        BernoulliMicroBatches(10, 41, 4, 1, seed=0)
    with pytest.raises(ValueError, match="micro_batches=0 is not allowed: expected an integer"):
        BernoulliMicroBatches(10, 4, 0, 1, seed=0)
    with pytest.raises(ValueError, match="batch_size=0 is not allowed: expected a number > 0"):
        BernoulliMicroBatches(10, 0, 4, 1, seed=0)


# -- DPFPTrainer --------------------------------------------------------------------


def _data(n: int = 200, seed: int = 0) -> list[tuple[torch.Tensor, int]]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 4, generator=g) + (2 * y[:, None] - 1) * torch.tensor([1.5, -1.0, 0, 0])
    return [(x[i], int(y[i])) for i in range(n)]


def _collate(records: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.stack([r[0] for r in records]), torch.tensor([r[1] for r in records])


def _setup(
    *, trainable: bool, noise: float = 0.1, d: int = 200, m: int = 4, t: int = 10, lr: float = 0.5
) -> tuple[DPFPTrainer, BernoulliMicroBatches, nn.Module, list]:
    torch.manual_seed(0)
    encoder = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh())
    head = nn.Linear(8, 2)
    params = list(head.parameters()) + (list(encoder.parameters()) if trainable else [])
    data = _data(d)
    sampler = BernoulliMicroBatches(d, 32, m, t, seed=11)
    trainer = DPFPTrainer.from_sampler(
        sampler,
        encoder,
        head,
        DPForwardLayer(1.0, noise, seed=5),
        torch.optim.SGD(params, lr=lr),
        nn.functional.cross_entropy,
        data,
        _collate,
        encoder_trainable=trainable,
    )
    return trainer, sampler, encoder, data


def test_frozen_encoder_is_unchanged_and_head_learns() -> None:
    trainer, sampler, encoder, data = _setup(trainable=False, t=30)
    before = [p.detach().clone() for p in encoder.parameters()]
    head_before = trainer.head.weight.detach().clone()
    x, y = _collate(data)
    assert float((trainer.predict(x).argmax(1) == y).float().mean()) < 0.6  # chance before
    results = trainer.fit(sampler)
    assert all(not p.requires_grad for p in encoder.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, encoder.parameters(), strict=True))
    assert all(p.grad is None for p in encoder.parameters())
    assert not torch.equal(head_before, trainer.head.weight)
    assert len(results) == 30
    acc = float((trainer.predict(x).argmax(1) == y).float().mean())
    assert acc > 0.8, acc
    # Inference does not add noise: predictions are deterministic.
    assert torch.equal(trainer.predict(x), trainer.predict(x))


def test_trainable_encoder_receives_gradients() -> None:
    trainer, sampler, encoder, _ = _setup(trainable=True, t=3)
    before = [p.detach().clone() for p in encoder.parameters()]
    trainer.fit(sampler)
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in encoder.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, encoder.parameters(), strict=True))


def test_ledger_records_t_times_m_events_including_empty() -> None:
    d, m, t = 200, 32, 6  # B = M: one record per micro-batch on average (paper)
    trainer, sampler, _, _ = _setup(trainable=False, d=d, m=m, t=t, noise=0.7)
    results = trainer.fit(sampler)
    assert sum(r.micro_batch_sizes.count(0) for r in results) > 0  # empties occurred
    ledger = trainer.ledger
    assert ledger.num_steps == t * m
    assert [(s.sample_rate, s.noise_multiplier) for s in ledger.segments] == [(32 / (m * d), 0.7)]
    # The same ledger as the calibration's T * M subsampled Gaussian steps.
    cal = DPFPCalibration(
        noise_multiplier=0.7,
        noise_std=0.7,
        clip=1.0,
        sample_rate=32 / (m * d),
        steps=t,
        micro_batches=m,
        target_epsilon=1.0,
        delta=1e-5,
        accountant="pld",
    )
    assert cal.ledger() == ledger


def test_all_empty_step_records_but_does_not_update() -> None:
    trainer, _, _, _ = _setup(trainable=False)
    w = trainer.head.weight.detach().clone()
    result = trainer.step([[], [], [], []])
    assert not result.updated and math.isnan(result.loss)
    assert torch.equal(w, trainer.head.weight)
    assert trainer.ledger.num_steps == 4


def test_step_averages_micro_batch_mean_losses() -> None:
    trainer, _, _, data = _setup(trainable=False, noise=1e-6)
    trainer.dp_layer.noise_multiplier = 1e-12  # effectively no noise: compare with a reference
    head = trainer.head
    w0 = [p.detach().clone() for p in head.parameters()]
    mbs = [[0, 1, 2], [], [5], [7, 9]]
    # Reference: mean over non-empty micro-batches of each one's mean loss, one SGD step.
    ref = nn.Linear(8, 2)
    with torch.no_grad():
        for p, q in zip(ref.parameters(), w0, strict=True):
            p.copy_(q)
    losses = []
    for ix in mbs[:1] + mbs[2:]:
        x, y = _collate([data[i] for i in ix])
        h = trainer.dp_layer.clip(trainer.encoder(x))
        losses.append(nn.functional.cross_entropy(ref(h), y))
    (sum(losses) / 3).backward()
    result = trainer.step(mbs)
    assert result.micro_batch_sizes == [3, 0, 1, 2]
    assert result.loss == pytest.approx(float(sum(losses).detach() / 3), rel=1e-5)
    for p, q, p0 in zip(head.parameters(), ref.parameters(), w0, strict=True):
        torch.testing.assert_close(p.detach(), p0 - 0.5 * q.grad, rtol=1e-5, atol=1e-6)


def test_privacy_scope_text() -> None:
    frozen, sampler, _, _ = _setup(trainable=False, t=2)
    frozen.fit(sampler)
    text = frozen.privacy_scope(delta=1e-5)
    assert "labels are NOT protected" in text
    assert "encoder_trainable=False (frozen encoder)" in text
    assert "covered by the guarantee" in text
    assert "one noisy row per sampled example" in text
    assert "sensitivity C" in text
    assert "8 subsampled Gaussian events" in text
    assert "epsilon=" in text
    trainable, _, _, _ = _setup(trainable=True, t=2)
    assert "OUTSIDE the formal guarantee" in trainable.privacy_scope()


def test_trainer_bad_arguments() -> None:
    encoder, head = nn.Linear(4, 8), nn.Linear(8, 2)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    data = _data(10)
    common = (encoder, head)
    with pytest.raises(
        ValueError, match=re.escape("noise_multiplier=0.0 is not allowed: expected a number")
    ):
        DPFPTrainer(
            *common, DPForwardLayer(1.0, 0.0, seed=0), opt, nn.functional.cross_entropy,
            data, _collate, sample_rate=0.1, micro_batches=2,
        )  # fmt: skip
    with pytest.raises(ValueError, match="encoder_trainable=True is not allowed here"):
        DPFPTrainer(
            *common, DPForwardLayer(1.0, 1.0, seed=0), opt, nn.functional.cross_entropy,
            data, _collate, sample_rate=0.1, micro_batches=2, encoder_trainable=True,
        )  # fmt: skip
    trainer = DPFPTrainer(
        *common, DPForwardLayer(1.0, 1.0, seed=0), opt, nn.functional.cross_entropy,
        data, _collate, sample_rate=0.1, micro_batches=2,
    )  # fmt: skip
    with pytest.raises(ValueError, match=re.escape("len(micro_batch_indices)=3 is not allowed")):
        trainer.step([[0], [1], [2]])
    with pytest.raises(
        ValueError, match=re.escape("sampler p=0.2, micro_batches=2 is not allowed")
    ):
        trainer.fit(BernoulliMicroBatches(10, 4, 2, 1, seed=0))
    assert isinstance(trainer.ledger, PrivacyLedger)


# -- fused micro-batches ------------------------------------------------------------


def _collate64(records: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _collate(records)
    return x.double(), y


def _fusion_pair(*, trainable: bool, lr: float = 0.5) -> tuple[DPFPTrainer, DPFPTrainer, list]:
    """Two trainers on identical float64 models and data, unfused and fused.

    The DP-FP layer's noise is made negligible (noise_multiplier 1e-12 after construction;
    the trainer refuses 0 and the ledger needs > 0): both paths then compute the same
    function of the same weights, so the updates must agree to float64 rounding.
    """
    data = _data(60)
    pair = []
    for fuse in (False, True):
        torch.manual_seed(0)
        encoder = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 8)).double()
        head = nn.Linear(8, 2).double()
        params = list(head.parameters()) + (list(encoder.parameters()) if trainable else [])
        trainer = DPFPTrainer(
            encoder,
            head,
            DPForwardLayer(0.7, 1.0, seed=5),  # C small enough that some rows are clipped
            torch.optim.SGD(params, lr=lr),
            nn.functional.cross_entropy,
            data,
            _collate64,
            sample_rate=0.05,
            micro_batches=5,
            encoder_trainable=trainable,
            fuse_micro_batches=fuse,
        )
        trainer.dp_layer.noise_multiplier = 1e-12
        pair.append(trainer)
    return pair[0], pair[1], data


def _params(trainer: DPFPTrainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in [*trainer.encoder.parameters(), *trainer.head.parameters()]]


@pytest.mark.parametrize("trainable", [False, True])
def test_fused_micro_batches_give_the_same_step(trainable: bool) -> None:
    plain, fused, data = _fusion_pair(trainable=trainable)
    assert not plain.fuse_micro_batches and fused.fuse_micro_batches
    x, _ = _collate64(data)
    norms = torch.linalg.vector_norm(plain.encoder(x), dim=1)
    assert (norms > 0.7).any() and (norms < 0.7).any()  # clipping is exercised both ways
    before = _params(plain)
    steps = [
        [[0, 1, 2], [], [5], [7, 9, 11, 13], []],  # empties between and at the end
        [[], [3], [4, 8], [], [20, 21, 22, 23, 24, 25]],  # an empty first
        [[], [], [], [], [59]],
    ]
    for micro in steps:
        a, b = plain.step(micro), fused.step(micro)
        assert a.micro_batch_sizes == b.micro_batch_sizes == [len(ix) for ix in micro]
        assert a.updated and b.updated
        # the loss: mean over the non-empty micro-batches of each one's mean loss
        assert b.loss == pytest.approx(a.loss, rel=1e-10)
        for p, q in zip(
            [*plain.encoder.parameters(), *plain.head.parameters()],
            [*fused.encoder.parameters(), *fused.head.parameters()],
            strict=True,
        ):
            if p.grad is None:
                assert q.grad is None and not trainable
                continue
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-10, atol=1e-12)
    after = _params(fused)
    moved = [not torch.equal(x0, x1) for x0, x1 in zip(before, after, strict=True)]
    assert any(moved[-2:])  # the head trained
    assert any(moved[:-2]) == trainable  # the encoder only when trainable
    assert plain.ledger == fused.ledger and fused.ledger.num_steps == 3 * 5
    assert plain.steps_taken == fused.steps_taken == 3


def test_fused_step_loss_is_the_mean_of_micro_batch_means() -> None:
    _, fused, data = _fusion_pair(trainable=False)
    micro = [[0, 1, 2], [], [5], [7, 9], []]
    with torch.no_grad():
        means = []
        for ix in (ix for ix in micro if ix):
            x, y = _collate64([data[i] for i in ix])
            h = fused.dp_layer.clip(fused.encoder(x))
            means.append(float(nn.functional.cross_entropy(fused.head(h), y)))
    result = fused.step(micro)
    # not the mean over the 6 records: micro-batch [0, 1, 2] weighs as much as [5]
    assert result.loss == pytest.approx(sum(means) / 3, rel=1e-10)


def test_fused_all_empty_step_records_but_does_not_update() -> None:
    _, fused, _ = _fusion_pair(trainable=True)
    before = _params(fused)
    result = fused.step([[], [], [], [], []])
    assert not result.updated and math.isnan(result.loss)
    assert result.micro_batch_sizes == [0] * 5
    assert all(torch.equal(a, b) for a, b in zip(before, _params(fused), strict=True))
    assert fused.ledger.num_steps == 5 and fused.steps_taken == 1


def test_fused_noise_is_per_row_and_reproducible() -> None:
    """With real noise, fused steps are reproducible from the seed and differ from no noise."""
    results = []
    for _ in range(2):
        _, fused, _ = _fusion_pair(trainable=False)
        fused.dp_layer.noise_multiplier = 1.0
        fused.step([[0, 1], [], [2, 3, 4], [5], []])
        results.append(_params(fused))
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    _, quiet, _ = _fusion_pair(trainable=False)
    quiet.step([[0, 1], [], [2, 3, 4], [5], []])
    assert not torch.allclose(results[0][-2], _params(quiet)[-2])


@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_fuse_micro_batches_must_be_a_bool(value) -> None:
    head = nn.Linear(8, 2)
    with pytest.raises(
        ValueError,
        match=re.escape(f"fuse_micro_batches={value!r} is not allowed: expected True or False"),
    ):
        DPFPTrainer(
            nn.Linear(4, 8), head, DPForwardLayer(1.0, 1.0, seed=0),
            torch.optim.SGD(head.parameters(), lr=0.1), nn.functional.cross_entropy,
            _data(10), _collate, sample_rate=0.1, micro_batches=2, fuse_micro_batches=value,
        )  # fmt: skip


def test_fused_refuses_targets_that_are_not_a_tensor() -> None:
    def list_collate(records):
        return torch.stack([r[0] for r in records]), [r[1] for r in records]

    def loss_fn(out, y):
        return nn.functional.cross_entropy(out, torch.as_tensor(y))

    data = _data(10)
    trainers = []
    for fuse in (False, True):
        head = nn.Linear(8, 2)
        trainer = DPFPTrainer(
            nn.Linear(4, 8), head, DPForwardLayer(1.0, 1.0, seed=0),
            torch.optim.SGD(head.parameters(), lr=0.1), loss_fn, data, list_collate,
            sample_rate=0.1, micro_batches=2, fuse_micro_batches=fuse,
        )  # fmt: skip
        trainers.append(trainer)
    assert trainers[0].step([[0, 1], [2]]).updated  # unfused: any targets the loss takes
    with pytest.raises(
        ValueError,
        match=re.escape(
            "targets of type list is not allowed with fuse_micro_batches=True: expected a "
            "Tensor whose rows follow the records"
        ),
    ):
        trainers[1].step([[0, 1], [2]])


def test_fused_matches_unfused_on_a_padded_bert_encoder() -> None:
    """The recipe's use: a BERT encoder with mean pooling, micro-batches padded to different
    widths when run alone than when fused; the attention mask makes the rows independent."""
    transformers = pytest.importorskip("transformers")
    from dptrain.models.text_classifier import PooledEncoder

    g = torch.Generator().manual_seed(0)
    lengths = [3, 9, 5, 2, 7, 4]
    records = [(torch.randint(5, 30, (n,), generator=g), i % 2) for i, n in enumerate(lengths)]

    def collate(recs):
        width = max(len(x) for x, _ in recs)
        ids = torch.zeros(len(recs), width, dtype=torch.long)
        mask = torch.zeros(len(recs), width, dtype=torch.long)
        for row, (x, _) in enumerate(recs):
            ids[row, : len(x)], mask[row, : len(x)] = x, 1
        return {"input_ids": ids, "attention_mask": mask}, torch.tensor([y for _, y in recs])

    pair = []
    for fuse in (False, True):
        torch.manual_seed(0)
        cfg = transformers.BertConfig(
            vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=16, max_position_embeddings=16, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        encoder = PooledEncoder(transformers.BertModel(cfg, add_pooling_layer=False), "mean")
        encoder = encoder.double()
        head = nn.Linear(8, 2).double()
        trainer = DPFPTrainer(
            encoder, head, DPForwardLayer(1.0, 1.0, seed=0),
            torch.optim.SGD([*encoder.parameters(), *head.parameters()], lr=0.1),
            nn.functional.cross_entropy, records, collate, sample_rate=0.2, micro_batches=3,
            encoder_trainable=True, fuse_micro_batches=fuse,
        )  # fmt: skip
        trainer.dp_layer.noise_multiplier = 1e-12
        pair.append(trainer)
    micro = [[0, 3], [], [1, 2, 4, 5]]
    a, b = pair[0].step(micro), pair[1].step(micro)
    assert b.loss == pytest.approx(a.loss, rel=1e-9)
    for p, q in zip(pair[0].encoder.parameters(), pair[1].encoder.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-8, atol=1e-12)
