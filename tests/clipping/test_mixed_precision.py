"""bf16 autocast on CPU: norms and clipped sums are computed in float32 and stay close
to the float32 oracle (bf16 keeps ~3 significant digits, so the bound is loose)."""

import pytest
import torch

from dptrain.clipping import ClippingEngine, flat_factors, oracle_norms, oracle_per_example_grads
from dptrain.losses import per_example_cross_entropy
from dptrain.models import GPT, GPTConfig
from tests.clipping.sensitivity import PRIVATE, sensitivity


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
    metrics = opt.step()
    gen = torch.Generator().manual_seed(3)
    for p, s in zip(engine.parameters(), sums, strict=True):
        noise = torch.empty_like(s).normal_(0.0, 0.5 * 0.01, generator=gen)  # float32 draws
        assert torch.equal(p.grad, ((s + noise) / 4.0).to(torch.bfloat16))
    want = torch.cat([s.flatten() for s in sums]).norm()
    assert metrics.clipped_sum_norm == pytest.approx(float(want), rel=1e-6)
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
