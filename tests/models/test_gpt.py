"""The reference GPT model: shapes, tying, causality, parameter ownership, config checks."""

import math
import re

import pytest
import torch
from torch import nn

from dptrain.models import GPT, GPTConfig

SMALL = {
    "vocab_size": 101,
    "max_seq_len": 16,
    "n_layer": 2,
    "n_head": 2,
    "d_model": 32,
    "d_mlp": 64,
}
B, T = 3, 10
ALLOWED_OWNERS = (nn.Linear, nn.Embedding, nn.LayerNorm)


def small_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**SMALL, **overrides}))


def tokens(seed: int = 1, batch: int = B, seq_len: int = T) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (batch, seq_len), generator=g)


# --- shapes and structure -------------------------------------------------------------


@pytest.mark.parametrize("pre_ln", [True, False])
def test_output_shape(pre_ln):
    model = small_model(pre_ln=pre_ln)
    logits = model(tokens())
    assert logits.shape == (B, T, SMALL["vocab_size"])
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_full_length_and_single_token():
    model = small_model()
    assert model(tokens(seq_len=SMALL["max_seq_len"])).shape == (B, 16, 101)
    assert model(tokens(batch=1, seq_len=1)).shape == (1, 1, 101)


def test_default_config_builds():
    config = GPTConfig()
    assert (config.vocab_size, config.max_seq_len, config.n_layer) == (8000, 512, 4)
    assert (config.n_head, config.d_model, config.d_mlp) == (4, 256, 1024)
    assert (config.dropout, config.bias, config.tie_embeddings) == (0.0, True, False)
    assert config.pre_ln is True and config.padding_idx is None
    model = GPT()
    assert model.config == config
    logits = model(torch.zeros(2, 5, dtype=torch.long))
    assert logits.shape == (2, 5, 8000)


def test_modules_are_named_as_documented():
    model = small_model()
    assert isinstance(model.wte, nn.Embedding) and isinstance(model.wpe, nn.Embedding)
    assert isinstance(model.ln_f, nn.LayerNorm)
    assert isinstance(model.lm_head, nn.Linear) and model.lm_head.bias is None
    assert len(model.blocks) == SMALL["n_layer"]
    attn = model.blocks[0].attn
    assert attn.c_attn.weight.shape == (3 * 32, 32)
    assert attn.c_proj.weight.shape == (32, 32)
    assert model.blocks[0].mlp.c_fc.weight.shape == (64, 32)
    assert model.blocks[0].mlp.c_proj.weight.shape == (32, 64)


def test_every_parameter_lives_in_linear_embedding_or_layernorm():
    for overrides in ({}, {"tie_embeddings": True}, {"bias": False}, {"pre_ln": False}):
        model = small_model(**overrides)
        owned = set()
        for module in model.modules():
            direct = list(module.parameters(recurse=False))
            if direct:
                assert isinstance(module, ALLOWED_OWNERS), (
                    f"{type(module).__name__} holds parameters ({overrides})"
                )
            owned.update(id(p) for p in direct)
        assert owned == {id(p) for p in model.parameters()}
        assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())


def test_no_bias_variant_has_no_biases():
    model = small_model(bias=False)
    assert not [name for name, _ in model.named_parameters() if name.endswith("bias")]
    assert model(tokens()).shape == (B, T, 101)


# --- tied embeddings and parameter counts --------------------------------------------


def test_tied_embeddings_share_one_parameter():
    tied = small_model(tie_embeddings=True)
    untied = small_model(tie_embeddings=False)
    assert tied.lm_head.weight is tied.wte.weight
    assert untied.lm_head.weight is not untied.wte.weight
    vocab_times_d = SMALL["vocab_size"] * SMALL["d_model"]
    assert untied.num_parameters() - tied.num_parameters() == vocab_times_d
    assert tied.num_parameters() == sum(p.numel() for p in tied.parameters())


def test_tied_weight_gets_one_gradient_from_both_uses():
    model = small_model(tie_embeddings=True)
    model(tokens()).square().mean().backward()
    grad = model.wte.weight.grad
    assert grad is not None and model.lm_head.weight.grad is grad
    # Rows of tokens absent from the batch still get a gradient through lm_head.
    absent = sorted(set(range(SMALL["vocab_size"])) - set(tokens().flatten().tolist()))
    assert grad[absent].abs().sum() > 0


def test_num_parameters_matches_formula():
    V, L, d, m, n = (SMALL[k] for k in ("vocab_size", "max_seq_len", "d_model", "d_mlp", "n_layer"))
    ln = 2 * 2 * d  # ln_1, ln_2 (weight and bias)
    c_attn = d * 3 * d + 3 * d
    attn_proj = d * d + d
    c_fc = d * m + m
    mlp_proj = m * d + d
    per_block = ln + c_attn + attn_proj + c_fc + mlp_proj
    embeddings = V * d + L * d
    rest = n * per_block + 2 * d + V * d  # blocks, ln_f, lm_head
    model = small_model()
    assert model.num_parameters() == embeddings + rest
    assert model.num_parameters(exclude_embeddings=True) == rest
    tied = small_model(tie_embeddings=True)
    assert tied.num_parameters(exclude_embeddings=True) == rest - V * d


# --- initialisation --------------------------------------------------------------------


def test_gpt2_initialisation():
    model = GPT(GPTConfig(n_layer=8, vocab_size=2000))  # large enough for tight std estimates
    assert model.wte.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.blocks[0].attn.c_attn.weight.std().item() == pytest.approx(0.02, rel=0.02)
    residual = 0.02 / math.sqrt(2 * 8)
    for block in model.blocks:
        assert block.attn.c_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
        assert block.mlp.c_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
        assert torch.all(block.attn.c_attn.bias == 0) and torch.all(block.mlp.c_fc.bias == 0)
        assert torch.all(block.ln_1.weight == 1) and torch.all(block.ln_1.bias == 0)


def test_padding_idx_row_is_zero_and_gets_no_embedding_gradient():
    model = small_model(padding_idx=0)
    assert torch.all(model.wte.weight[0] == 0)
    idx = tokens()
    idx[:, ::2] = 0
    model(idx).square().mean().backward()
    assert torch.all(model.wte.weight.grad[0] == 0)


# --- behaviour -------------------------------------------------------------------------


@pytest.mark.parametrize("pre_ln", [True, False])
def test_causal_changing_later_tokens_leaves_earlier_logits_unchanged(pre_ln):
    model = small_model(pre_ln=pre_ln).eval()
    idx = tokens()
    with torch.no_grad():
        base = model(idx)
        for t in (0, 4, T - 2):
            changed = idx.clone()
            changed[:, t + 1 :] = (changed[:, t + 1 :] + 7) % SMALL["vocab_size"]
            out = model(changed)
            torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1])
            assert not torch.allclose(out[:, t + 1 :], base[:, t + 1 :])


def test_batch_elements_are_independent():
    model = small_model().eval()
    idx = tokens()
    with torch.no_grad():
        together = model(idx)
        alone = torch.cat([model(idx[i : i + 1]) for i in range(B)])
    torch.testing.assert_close(together, alone)


def test_dropout_acts_only_in_training_mode():
    model = small_model(dropout=0.3)
    idx = tokens()
    model.train()
    assert not torch.equal(model(idx), model(idx))
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(idx), model(idx))


def test_sequence_longer_than_max_seq_len_raises():
    model = small_model()
    message = "sequence length T=17 exceeds max_seq_len=16"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        model(tokens(seq_len=17))


def test_input_must_be_two_dimensional():
    with pytest.raises(ValueError, match=re.escape("expected (batch, seq_len)")):
        small_model()(tokens()[0])


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_embeddings": True}, {"pre_ln": False}, {"bias": False, "dropout": 0.1}],
)
def test_backward_reaches_every_parameter(overrides):
    model = small_model(**overrides).train()
    idx = tokens()
    logits = model(idx)
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens(seed=2).flatten())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), f"{name} has a non-finite gradient"
        assert p.grad.abs().sum() > 0, f"{name} has an all-zero gradient"


def test_post_ln_differs_from_pre_ln():
    idx = tokens()
    with torch.no_grad():
        pre = small_model(pre_ln=True).eval()(idx)
        post = small_model(pre_ln=False).eval()(idx)  # same seed, same weights
    assert not torch.allclose(pre, post)


# --- config validation -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"vocab_size": 0}, "vocab_size=0 is not allowed: expected an integer >= 1"),
        ({"max_seq_len": -3}, "max_seq_len=-3 is not allowed: expected an integer >= 1"),
        ({"n_layer": 2.0}, "n_layer=2.0 is not allowed: expected an integer >= 1"),
        ({"n_head": True}, "n_head=True is not allowed: expected an integer >= 1"),
        ({"d_model": 0}, "d_model=0 is not allowed: expected an integer >= 1"),
        ({"d_mlp": "64"}, "d_mlp='64' is not allowed: expected an integer >= 1"),
        (
            {"d_model": 30, "n_head": 4},
            "d_model=30 is not allowed: expected a multiple of n_head=4",
        ),
        ({"dropout": 1.0}, "dropout=1.0 is not allowed: expected a number in [0, 1)"),
        ({"dropout": -0.1}, "dropout=-0.1 is not allowed: expected a number in [0, 1)"),
        (
            {"dropout": float("nan")},
            "dropout=nan is not allowed: expected a number in [0, 1)",
        ),
        ({"bias": 1}, "bias=1 is not allowed: expected True or False"),
        ({"tie_embeddings": "yes"}, "tie_embeddings='yes' is not allowed: expected True or False"),
        ({"pre_ln": None}, "pre_ln=None is not allowed: expected True or False"),
        (
            {"padding_idx": 101},
            "padding_idx=101 is not allowed: expected None or an integer in [0, vocab_size=101)",
        ),
        (
            {"padding_idx": -1},
            "padding_idx=-1 is not allowed: expected None or an integer in [0, vocab_size=101)",
        ),
    ],
)
def test_config_validation_messages(overrides, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        GPTConfig(**{**SMALL, **overrides})


def test_public_names_are_documented():
    import dptrain.models
    import dptrain.models.gpt

    for module in (dptrain.models, dptrain.models.gpt):
        assert module.__doc__
        for name in module.__all__:
            assert getattr(module, name).__doc__, f"{module.__name__}.{name} has no docstring"
