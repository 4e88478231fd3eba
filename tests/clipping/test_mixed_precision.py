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


@pytest.mark.xfail(
    strict=True,
    reason="known gap: with bf16 parameters the clipped sum is rounded to bf16 in p.grad "
    "(and noised there), so one record moves it by C plus the rounding, which grows with "
    "the batch (1.0001 C at B 6, 1.0005 C at B 64). Fix: sum and noise in float32, then cast",
)
def test_one_record_moves_a_bf16_parameter_sum_by_at_most_c():
    model = _tied_gpt(seed=0).bfloat16()
    ids = torch.randint(0, 30, (64, 9))
    x, y = ids[:, :-1], ids[:, 1:]

    def losses():
        return per_example_cross_entropy(model(x).float(), y)

    sensitivity(model, losses, 1, max_grad_norm=0.01, mode="book_keeping", slack=1e-6)
