"""bf16 autocast on CPU: norms and clipped sums are computed in float32 and stay close
to the float32 oracle (bf16 keeps ~3 significant digits, so the bound is loose)."""

import torch

from dptrain.clipping import ClippingEngine, flat_factors, oracle_norms, oracle_per_example_grads
from dptrain.losses import per_example_cross_entropy
from dptrain.models import GPT, GPTConfig


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
