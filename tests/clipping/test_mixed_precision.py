"""bf16 autocast on CPU: norms and clipped sums are computed in float32 and stay close
to the float32 oracle (bf16 keeps ~3 significant digits, so the bound is loose)."""

import gc
import weakref

import pytest
import torch

from dptrain.clipping import ClippingEngine, flat_factors, oracle_norms, oracle_per_example_grads
from dptrain.losses import per_example_cross_entropy
from dptrain.models import GPT, GPTConfig
from tests.clipping.sensitivity import PRIVATE, clipped_sums, sensitivity


def test_bf16_autocast_matches_float32_oracle():
    torch.manual_seed(0)
    cfg = GPTConfig(
        vocab_size=30,
        max_seq_len=16,
        n_layer=1,
        n_head=2,
        d_model=16,
        d_mlp=32,
        tie_embeddings=True,
    )
    model = GPT(cfg)
    ids = torch.randint(0, 30, (4, 9))
    x, y = ids[:, :-1], ids[:, 1:]
    grads = oracle_per_example_grads(
        model, lambda i: per_example_cross_entropy(model(x[i : i + 1]), y[i : i + 1]).sum(), 4
    )
    norms = oracle_norms(grads)
    c = float(norms.median())
    engine = ClippingEngine(model, c)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    stats = engine.backward(per_example_cross_entropy(logits.float(), y))
    assert stats.norms.dtype == torch.float32
    assert torch.allclose(stats.norms, norms, rtol=3e-2)
    factors = flat_factors(norms, c)
    for name, p in model.named_parameters():
        want = torch.einsum("b,b...->...", factors, grads[name])
        assert p.grad.dtype == torch.float32
        err = (p.grad - want).norm() / want.norm()
        assert err < 5e-2, name


def _tied_gpt(seed: int) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(
        vocab_size=30,
        max_seq_len=16,
        n_layer=2,
        n_head=2,
        d_model=32,
        d_mlp=64,
        tie_embeddings=True,
    )
    return GPT(cfg)


def _tied_gpt_and_bf16_losses(b: int = 6):
    model = _tied_gpt(seed=1)
    ids = torch.randint(0, 30, (b, 9))
    x, y = ids[:, :-1], ids[:, 1:]

    def losses():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        return per_example_cross_entropy(logits.float(), y)

    return model, losses


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
def test_one_record_moves_the_bf16_clipped_sum_by_at_most_c(mode):
    # Ghost's second backward under autocast forms the sum in bf16, which differs from the
    # sum whose norms were clipped: before the engine formed it from its float32 records,
    # one record moved it by 1.001-1.002 C here. Float32 arithmetic leaves ~1e-7.
    model, losses = _tied_gpt_and_bf16_losses()
    outcome, worst = sensitivity(model, losses, 1, max_grad_norm=0.01, mode=mode, slack=1e-6)
    assert outcome == PRIVATE and worst > 0.99  # example 1 is clipped: the bound is reached


def test_ghost_forms_a_bf16_sum_from_its_records_and_a_float32_one_by_a_second_backward():
    model, losses = _tied_gpt_and_bf16_losses()
    sums = {}
    for mode in ("book_keeping", "ghost"):
        engine = ClippingEngine(model, 0.01, mode=mode)
        model.zero_grad(set_to_none=True)
        engine.backward(losses())
        sums[mode] = [p.grad.clone() for p in engine.parameters()]
        engine.detach()
    for bk, gh in zip(sums["book_keeping"], sums["ghost"], strict=True):
        assert torch.equal(bk, gh)  # the same float32 records, the same arithmetic
    model.zero_grad(set_to_none=True)
    engine = ClippingEngine(model, 0.01, mode="ghost")
    ids = torch.randint(0, 30, (4, 9))
    engine.backward(per_example_cross_entropy(model(ids[:, :-1]), ids[:, 1:]))
    assert not engine._sum_from_records  # float32: the second backward, as ghost means
    engine.detach()


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
@pytest.mark.parametrize("b", [6, 64])
def test_one_record_moves_a_bf16_parameter_sum_by_at_most_c(mode, b):
    # Summed in bf16 (p.grad's dtype) this moved by 1.0001 C at B 6 and 1.0005 C at B 64:
    # the engine now keeps the float32 sum the optimizer noises (clipped_sum).
    model = _tied_gpt(seed=0).bfloat16()
    ids = torch.randint(0, 30, (b, 9), generator=torch.Generator().manual_seed(b))
    x, y = ids[:, :-1], ids[:, 1:]

    def losses():
        return per_example_cross_entropy(model(x).float(), y)

    outcome, _ = sensitivity(model, losses, 1, max_grad_norm=0.01, mode=mode, slack=1e-6)
    assert outcome == PRIVATE


def test_bf16_parameter_sum_is_float32_across_chunks_and_rounded_into_p_grad():
    model = _tied_gpt(seed=0).bfloat16()
    ids = torch.randint(0, 30, (8, 9), generator=torch.Generator().manual_seed(1))
    engine = ClippingEngine(model, 0.01)
    whole = ClippingEngine(_tied_gpt(seed=0).bfloat16(), 0.01)
    for rows in (slice(0, 5), slice(5, 8)):  # two chunks of one logical batch
        x, y = ids[rows, :-1], ids[rows, 1:]
        engine.backward(per_example_cross_entropy(model(x).float(), y))
    x, y = ids[:, :-1], ids[:, 1:]
    whole.backward(per_example_cross_entropy(whole.model(x).float(), y))
    for p, q in zip(engine.parameters(), whole.parameters(), strict=True):
        s = engine.clipped_sum(p)
        assert s.dtype == torch.float32 and p.grad.dtype == torch.bfloat16
        assert torch.equal(p.grad, s.to(torch.bfloat16))  # p.grad: the float32 sum, rounded
        # the two chunks' sums add in float32: the one-chunk sum up to float32 rounding
        assert torch.allclose(s, whole.clipped_sum(q), rtol=1e-4, atol=1e-7)
    # a cleared p.grad drops the float32 sum with it
    model.zero_grad(set_to_none=True)
    assert all(engine.clipped_sum(p) is None for p in engine.parameters())
    engine.detach()
    whole.detach()


def test_dp_optimizer_noises_the_float32_sum_then_casts():
    from dptrain.optim import DPOptimizer

    model = _tied_gpt(seed=0).bfloat16()
    engine = ClippingEngine(model, 0.01)
    opt = DPOptimizer(
        torch.optim.SGD(engine.parameters(), lr=0.0),
        noise_multiplier=0.5,
        max_grad_norm=0.01,
        expected_batch_size=4.0,
        sample_rate=0.5,
        seed=3,
        engine=engine,
    )
    ids = torch.randint(0, 30, (4, 9), generator=torch.Generator().manual_seed(2))
    engine.backward(per_example_cross_entropy(model(ids[:, :-1]).float(), ids[:, 1:]))
    sums = [engine.clipped_sum(p).clone() for p in engine.parameters()]
    held = [weakref.ref(engine.clipped_sum(p)) for p in engine.parameters()]
    metrics = opt.step()
    # float32 draws, one block for this small model (dptrain.noise's layout)
    sizes = [s.numel() for s in sums]
    flat = torch.empty(sum(sizes)).normal_(
        0.0, 0.5 * 0.01, generator=torch.Generator().manual_seed(3)
    )
    for p, s, noise in zip(engine.parameters(), sums, flat.split(sizes), strict=True):
        assert torch.equal(p.grad, ((s + noise.view(s.shape)) / 4.0).to(torch.bfloat16))
    want = torch.cat([s.flatten() for s in sums]).norm()
    assert metrics.clipped_sum_norm == pytest.approx(float(want), rel=1e-6)
    # once noised and cast into p.grad, the float32 sums are let go (not held through
    # the next step's forward and backward)
    gc.collect()
    assert all(r() is None for r in held)
    engine.detach()


def test_bf16_unit_spanning_chunks_adds_its_clipped_sum_in_float32():
    # A user's examples over two chunks (add_to_unit, close_unit) after a chunk of single
    # examples: the unit's clipped sum joins the float32 sum, norm at most C.
    model = _tied_gpt(seed=0).bfloat16()
    ids = torch.randint(0, 30, (7, 9), generator=torch.Generator().manual_seed(4))
    engine = ClippingEngine(model, 0.01)

    def losses(rows):
        return per_example_cross_entropy(model(ids[rows, :-1]).float(), ids[rows, 1:])

    engine.backward(losses(slice(0, 3)))
    before = [engine.clipped_sum(p).clone() for p in engine.parameters()]
    engine.add_to_unit(losses(slice(3, 5)))
    engine.add_to_unit(losses(slice(5, 7)))
    engine.close_unit()
    after = [engine.clipped_sum(p) for p in engine.parameters()]
    assert all(s.dtype == torch.float32 for s in after)
    moved = torch.cat([(a - b).flatten() for a, b in zip(after, before, strict=True)]).norm()
    assert 0 < float(moved) <= 0.01 * (1 + 1e-6)
    for p, s in zip(engine.parameters(), after, strict=True):
        assert torch.equal(p.grad, s.to(torch.bfloat16))
    engine.detach()


# -- sum_rounding="bounded": one bf16 GEMM per clipped sum, its rounding in the factors --


@pytest.mark.parametrize(
    ("mode", "clipping"),
    [
        ("book_keeping", "flat"),
        ("ghost", "flat"),
        ("book_keeping", "automatic"),
        ("book_keeping", "per_layer"),
    ],
)
@pytest.mark.parametrize("weights", ["bf16", "autocast"])
def test_one_record_moves_a_one_gemm_bf16_sum_by_at_most_c(mode, clipping, weights):
    b = 64
    model = _tied_gpt(seed=0)
    if weights == "bf16":
        model = model.bfloat16()
    ids = torch.randint(0, 30, (b, 9), generator=torch.Generator().manual_seed(b))
    x, y = ids[:, :-1], ids[:, 1:]

    def losses():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=weights == "autocast"):
            logits = model(x)
        return per_example_cross_entropy(logits.float(), y)

    outcome, worst = sensitivity(
        model,
        losses,
        1,
        max_grad_norm=0.01,
        mode=mode,
        clipping=clipping,
        slack=1e-6,
        sum_rounding="bounded",
    )
    assert outcome == PRIVATE and worst > 0.9


class _OneLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8, bias=False)

    def forward(self, x):
        return self.lin(x)


def _cancelling_losses(b: int = 8, t: int = 255):
    """A bf16 linear layer whose tokens' gradient terms cancel (tokens in triples with
    equal inputs and output gradients summing to about zero): where rounding c g to bf16
    moves a contribution the most relative to its norm (test_tensor_cores.py)."""
    model = _OneLinear().bfloat16()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, t // 3, 1, 8, generator=gen).expand(-1, -1, 3, -1).reshape(b, t, 8)
    y = torch.randn(b, t // 3, 3, 8, generator=gen)
    y[:, :, 2] = -(y[:, :, 0] + y[:, :, 1]) * (1 + 1e-3)
    x, y = x.bfloat16(), y.reshape(b, t, 8)

    def losses():
        return (model(x).float() * y).sum((1, 2))

    return model, losses


def _moved_from_removed(model, losses, c: float, norm_method: str) -> float:
    """max over lambda of ||sum(lambda) - sum(0)|| / C: adding the record against leaving
    it out. (Not pairwise, as sensitivity() compares: here the record's gradient at
    different lambdas points in different directions, since its tokens' terms cancel to
    what bf16 rounding of lambda g leaves.)"""
    sums = clipped_sums(
        model,
        losses,
        1,
        max_grad_norm=c,
        mode="book_keeping",
        sum_rounding="bounded",
        norm_method=norm_method,
    )
    return max(float((s - sums[0]).norm()) for s in sums[1:]) / c


@pytest.mark.parametrize("norm_method", ["ghost", "auto"])
def test_the_rounding_margin_is_what_keeps_a_one_gemm_sum_within_c(monkeypatch, norm_method):
    model, losses = _cancelling_losses()
    worst = _moved_from_removed(model, losses, 1e-3, norm_method)
    # within C; far below it under ghost (the margin is many times the cancelled norm
    # here: C / (||g|| + r) scales the record to C ||g|| / (||g|| + r))
    assert 0.01 < worst <= 1 + 1e-6
    # Without the margin in the factors, the same rounded sums leak (when the sum is
    # formed from the record: ghost norm), so the check can fail.
    from dptrain.clipping.sums import NormsAndSums

    monkeypatch.setattr(NormsAndSums, "rounding_margins", lambda self: {})
    leaked = _moved_from_removed(model, losses, 1e-3, norm_method)
    if norm_method == "ghost":
        assert leaked > 1.005  # float32 accumulation alone stays within 1e-6
    else:  # 2 T^2 > 64 weights: instantiated, summed in float32, nothing rounds
        assert leaked <= 1 + 1e-6


def test_one_gemm_factors_absorb_the_margin_and_unclipped_examples_are_exact():
    model, losses = _cancelling_losses()
    sums, stats = {}, {}
    for rounding in ("exact", "bounded"):
        for c in (1e-3, 1e6):  # every example clipped; none clipped
            # ghost norm: the sum comes from the record, where the rounding is
            engine = ClippingEngine(model, c, sum_rounding=rounding, norm_method="ghost")
            model.zero_grad(set_to_none=True)
            stats[rounding, c] = engine.backward(losses())
            sums[rounding, c] = engine.clipped_sum(model.lin.weight).clone()
            engine.detach()
    # factor 1: nothing is rounded, the same float32 products as the exact path
    assert torch.equal(sums["exact", 1e6], sums["bounded", 1e6])
    assert torch.equal(stats["bounded", 1e6].factors, torch.ones(8))
    # clipped: c_i = C / (||g_i|| + r_i), r_i = 2^-8 sum_t ||a_t|| ||g_t||
    norms = stats["bounded", 1e-3].norms
    assert torch.equal(norms, stats["exact", 1e-3].norms)
    from dptrain.clipping.tensor_cores import rounding_bound

    gen = torch.Generator().manual_seed(0)
    a = torch.randn(8, 85, 1, 8, generator=gen).expand(-1, -1, 3, -1).reshape(8, 255, 8)
    y = torch.randn(8, 85, 3, 8, generator=gen)
    y[:, :, 2] = -(y[:, :, 0] + y[:, :, 1]) * (1 + 1e-3)
    g = y.reshape(8, 255, 8).bfloat16()  # the output gradients, as the record holds them
    r = rounding_bound(a.bfloat16(), g)
    want = 1e-3 / (norms + r)
    assert torch.allclose(stats["bounded", 1e-3].factors, want, rtol=1e-6)
    assert (r / norms > 0.05).all()  # cancelling tokens: a margin of several percent


def test_an_unknown_sum_rounding_is_named():
    with pytest.raises(
        ValueError,
        match=r"sum_rounding='fast' is not allowed: expected one of \['exact', 'bounded'\]",
    ):
        ClippingEngine(_OneLinear(), 1.0, sum_rounding="fast")


class _FewRows(torch.nn.Module):
    """A bf16 table of 4 rows looked up by 8 x 4,096 tokens (8,192 adds per row), then a
    fixed readout: autograd's CPU scatter-add accumulates the table's gradient in bf16."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(4, 8).bfloat16()
        self.register_buffer("readout", torch.randn(8, generator=torch.Generator().manual_seed(1)))

    def forward(self, x):
        return torch.tanh(self.emb(x).float()) @ self.readout


def _few_rows_losses(model):
    x = torch.randint(0, 4, (8, 4096), generator=torch.Generator().manual_seed(0))

    def losses():
        return model(x).pow(2).mean(1)

    return losses


def test_a_bf16_tables_gradient_is_checked_within_autograds_accumulation_bound(monkeypatch):
    # autograd's own bf16 gradient is off by more than the bf16 tolerance (5e-2) here; the
    # check allows each row what that many bf16 additions may lose (rules.accumulation_bound)
    from dptrain.clipping import UnsupportedModelError
    from dptrain.clipping.rules import EmbeddingRule

    model = _FewRows()
    losses = _few_rows_losses(model)
    ClippingEngine(model, 1e-3).backward(losses())  # checked: first chunk, not refused
    # the engine's float32 sum adds 8,192 terms per row: rounding up to k u_32 = 4.9e-4
    # relative (measured 2.2e-4), hence the slack; the bf16 accumulation is autograd's only
    outcome, worst = sensitivity(model, losses, 3, max_grad_norm=1e-3, slack=1e-3)
    assert outcome == PRIVATE and worst > 0.9
    # without the allowance the same sound table is refused: the bound is what passes it
    monkeypatch.setattr(EmbeddingRule, "accumulation_bound", lambda *args: {})
    model.zero_grad(set_to_none=True)
    with pytest.raises(UnsupportedModelError, match="differs from autograd's"):
        ClippingEngine(model, 1e-3).backward(losses())


def test_the_accumulation_bound_holds_for_bf16_scatter_adds_and_is_zero_for_single_terms():
    from dptrain.clipping.rules import EmbeddingRule

    rule, gen = EmbeddingRule(), torch.Generator().manual_seed(2)
    emb = torch.nn.Embedding(6, 5, padding_idx=5).bfloat16()
    x = torch.randint(0, 4, (3, 2000), generator=gen)
    x[0, :7] = 5  # padding: no gradient, not counted
    x[1, 0] = 4  # row 4: one term, added exactly
    g = torch.randn(3, 2000, 5, generator=gen).bfloat16()
    weights = torch.tensor([1.0, 0.0, -2.0])
    bound = rule.accumulation_bound(emb, x, g.float(), weights)["weight"]
    # autograd's gradient: the embedding backward kernel, in bf16 (weights are powers of
    # two, so each term w_i g_t is exact in bf16)
    table = emb.weight.detach().clone().requires_grad_()
    out = torch.nn.functional.embedding(x, table, padding_idx=5)
    out.backward(g * weights.view(-1, 1, 1).bfloat16())
    terms = (g.double() * weights.double().view(-1, 1, 1)) * (x != 5).unsqueeze(-1)
    exact = torch.zeros(6, 5, dtype=torch.float64).index_add_(0, x.flatten(), terms.flatten(0, 1))
    gap = (table.grad.double() - exact).abs()
    assert (gap <= bound.double()).all() and gap[:4].max() > 1e-2 * exact[:4].abs().max()
    assert (bound[4:] == 0).all()  # row 4 only in example 1 (weight 0); 5 is padding
    assert rule.accumulation_bound(emb.float(), x, g.float(), weights) == {}
