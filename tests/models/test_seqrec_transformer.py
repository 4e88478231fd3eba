"""The SASRec-style next-item Transformer: shapes, padding, causality, tying, Re-Attention
switches, effective errors, config checks, and per-example clipping against the oracle."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from dptrain.clipping import ClippingEngine
from dptrain.losses import per_example_cross_entropy
from dptrain.models.seqrec_transformer import SeqRecConfig, SeqRecTransformer
from tests.clipping.oracle_check import assert_engine_matches_oracle

N_ITEMS = 40
SMALL = {"n_items": N_ITEMS, "max_len": 12, "d_model": 16, "n_head": 2, "n_layer": 2}
B, L = 3, 10


def small_model(seed: int = 0, dtype=torch.float64, **overrides) -> SeqRecTransformer:
    torch.manual_seed(seed)
    cfg = SeqRecConfig(**{**SMALL, "dropout": 0.0, **overrides})
    return SeqRecTransformer(cfg).to(dtype).eval()


def item_batch(seed: int = 1, batch: int = B, seq_len: int = L) -> torch.Tensor:
    """Left-padded ids: row 0 has a padded prefix of 4, row 1 none, row 2 one item."""
    g = torch.Generator().manual_seed(seed)
    items = torch.randint(1, N_ITEMS + 1, (batch, seq_len), generator=g)
    items[0, :4] = 0
    if batch > 2:
        items[2, :-1] = 0
    return items


def frequencies(seed: int = 2) -> torch.Tensor:
    """Long-tailed shares in [0.005, 0.5]; item 7 never seen (floored), index 0 padding."""
    g = torch.Generator().manual_seed(seed)
    f = torch.logspace(math.log10(0.005), math.log10(0.5), N_ITEMS + 1, dtype=torch.float64)
    f = f[torch.randperm(N_ITEMS + 1, generator=g)]
    f[0], f[7] = 0.0, 0.0
    return f


def noisy(model: SeqRecTransformer, sigma: float = 1.0, batch_size: float = 16):
    model.set_effective_errors(sigma, batch_size, frequencies())
    return model


# -- shapes and structure ---------------------------------------------------------------------


@pytest.mark.parametrize("pre_ln", [True, False])
@pytest.mark.parametrize("re_attention", [False, True])
def test_shapes(pre_ln, re_attention):
    model = noisy(small_model(pre_ln=pre_ln, re_attention=re_attention))
    items = item_batch()
    scores = model(items)
    assert scores.shape == (B, L, N_ITEMS + 1)
    assert model.hidden(items).shape == (B, L, 16)
    last = model.last_scores(items)
    assert last.shape == (B, N_ITEMS + 1)
    torch.testing.assert_close(last, scores[:, -1])
    assert [k.shape for k in model.key_variances(items)] == [(B, 2, L)] * 2
    assert model(item_batch(batch=1, seq_len=1)).shape == (1, 1, N_ITEMS + 1)


def test_defaults():
    cfg = SeqRecConfig(n_items=1682)
    assert (cfg.max_len, cfg.d_model, cfg.n_head, cfg.n_layer, cfg.d_mlp) == (50, 64, 1, 2, 256)
    assert (cfg.dropout, cfg.pre_ln, cfg.tie_embeddings) == (0.2, True, True)
    assert (cfg.re_attention, cfg.reattention_scale) == (False, 1.0)
    model = SeqRecTransformer(cfg)
    assert isinstance(model.item_emb, nn.Embedding) and model.item_emb.padding_idx == 0
    assert model.item_emb.weight.shape == (1683, 64)
    assert model.pos_emb.weight.shape == (50, 64)
    assert model.head.bias is None and model.head.weight.shape == (1683, 64)
    assert isinstance(model.ln_f, nn.LayerNorm)
    assert isinstance(SeqRecTransformer(SeqRecConfig(n_items=5, pre_ln=False)).ln_f, nn.Identity)


def test_every_parameter_lives_in_linear_embedding_or_layernorm():
    for overrides in ({}, {"tie_embeddings": False}, {"pre_ln": False}, {"re_attention": True}):
        model = small_model(**overrides)
        owned = set()
        for module in model.modules():
            if isinstance(module, nn.Linear | nn.Embedding | nn.LayerNorm):
                owned |= {id(p) for p in module.parameters(recurse=False)}
        assert all(id(p) in owned for p in model.parameters())
        ClippingEngine(model, 1.0).detach()  # accepted: no UnsupportedModelError


def test_initialisation():
    model = small_model(dtype=torch.float32)
    assert torch.equal(model.item_emb.weight[0], torch.zeros(16))  # padding row
    assert abs(model.item_emb.weight[1:].std().item() - 0.02) < 0.004
    for block in model.blocks:
        assert torch.equal(block.ln_1.weight, torch.ones(16))
        assert torch.equal(block.attn.c_attn.bias, torch.zeros(48))
        assert block.attn.c_proj.weight.std().item() < 0.015  # 0.02 / sqrt(2 n_layer)


# -- padding and causality ------------------------------------------------------------------------


@pytest.mark.parametrize("re_attention", [False, True])
def test_padding_gives_no_nan_and_no_gradient_nan(re_attention):
    model = noisy(small_model(re_attention=re_attention))
    items = item_batch()
    items[1] = 0  # one sequence entirely padding
    scores = model(items)
    assert torch.isfinite(scores).all()
    targets = torch.roll(items, -1, 1)
    targets[:, -1] = 0
    losses = per_example_cross_entropy(scores, targets, ignore_index=0)
    assert losses[1] == 0
    losses.sum().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_padding_column_is_never_predicted():
    model = small_model()
    scores = model(item_batch())
    assert (scores[..., 0] == torch.finfo(scores.dtype).min).all()
    assert (scores[..., 1:] > torch.finfo(scores.dtype).min).all()
    assert (scores.argmax(-1) != 0).all()
    # finite: a target 0 that slips past ignore_index gets a finite (enormous) token loss,
    # which a zero mask turns into 0 (-inf would give inf * 0 = NaN), and a finite gradient
    tokens = nn.functional.cross_entropy(
        scores.flatten(0, 1), torch.zeros(B * L, dtype=torch.long), reduction="none"
    )
    assert torch.isfinite(tokens).all()
    assert (tokens * 0).sum() == 0
    (grad,) = torch.autograd.grad(tokens.mean(), scores)
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("re_attention", [False, True])
def test_padded_keys_are_not_attended(re_attention):
    """Changing the padding row's embedding changes nothing at real positions."""
    model = noisy(small_model(re_attention=re_attention))
    items = item_batch()
    before = model(items)
    with torch.no_grad():
        model.item_emb.weight[0].normal_()
    after = model(items)
    real = items != 0
    torch.testing.assert_close(after[real], before[real], rtol=0, atol=1e-12)
    assert not torch.allclose(after[~real], before[~real])


@pytest.mark.parametrize("pre_ln", [True, False])
@pytest.mark.parametrize("re_attention", [False, True])
def test_causal(pre_ln, re_attention):
    model = noisy(small_model(pre_ln=pre_ln, re_attention=re_attention))
    items = item_batch()
    before = model(items)
    for t in (5, L - 1):
        changed = items.clone()
        changed[:, t] = changed[:, t] % N_ITEMS + 1
        after = model(changed)
        torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-12)
        assert not torch.allclose(after[:, t], before[:, t])


# -- tying --------------------------------------------------------------------------------------


def test_tied_head_is_the_item_embedding():
    model = small_model(tie_embeddings=True)
    assert model.head.weight is model.item_emb.weight
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names  # one Parameter, listed once
    untied = small_model(tie_embeddings=False)
    assert untied.head.weight is not untied.item_emb.weight
    assert "head.weight" in [n for n, _ in untied.named_parameters()]
    n_tied = sum(p.numel() for p in model.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == (N_ITEMS + 1) * 16


# -- Re-Attention switches and effective errors ----------------------------------------------------


@pytest.mark.parametrize("pre_ln", [True, False])
def test_re_attention_with_zero_noise_is_vanilla_exactly(pre_ln):
    vanilla = small_model(pre_ln=pre_ln)
    re = small_model(pre_ln=pre_ln, re_attention=True)
    re.load_state_dict(vanilla.state_dict())
    items = item_batch()
    assert torch.equal(re(items), vanilla(items))  # never set: zero errors
    re.set_effective_errors(0.0, 16, frequencies())
    assert torch.equal(re(items), vanilla(items))
    noisy(re)
    assert (re(items) - vanilla(items)).abs().max() > 1e-9
    noisy(vanilla)  # errors set, but Re-Attention off: still vanilla
    assert torch.equal(vanilla(items), small_model(pre_ln=pre_ln)(items))


def test_reattention_scale():
    items = item_batch()
    out = {}
    for scale in (0.0, 1.0, 2.0):
        model = noisy(small_model(re_attention=True, reattention_scale=scale))
        out[scale] = model(items)
    assert torch.equal(out[0.0], small_model()(items))
    gap_1 = (out[1.0] - out[0.0]).abs().max()
    gap_2 = (out[2.0] - out[0.0]).abs().max()
    assert 0 < gap_1 < gap_2


def test_correction_lowers_attention_on_noisy_keys():
    """The first block's attention weights: the keys with the larger tracked variance
    lose attention under Re-Attention, none gains more than the quietest key."""
    vanilla = noisy(small_model(), sigma=5.0)
    re = noisy(small_model(re_attention=True), sigma=5.0)
    items = item_batch()
    x = vanilla.item_emb(items) + vanilla.pos_emb(torch.arange(L))
    mask = vanilla.attention_mask(items, x.dtype)
    key_var = re.key_variances(items)[0]  # (B, nh, L)
    with torch.no_grad():
        _, att_v = vanilla.blocks[0](x, mask)
        _, att_r = re.blocks[0](x, mask, key_var)
    b, t = 1, L - 1  # the last query of the unpadded row
    ratio = att_r[b, :, t] / att_v[b, :, t]  # (nh, L)
    for h in range(2):
        noisiest, quietest = key_var[b, h, : t + 1].argmax(), key_var[b, h, : t + 1].argmin()
        assert ratio[h, noisiest] < 1 < ratio[h, quietest]


def test_effective_errors_are_buffers():
    model = noisy(small_model(re_attention=True), sigma=2.0, batch_size=8)
    buffers = dict(model.named_buffers())
    assert set(buffers) == {"item_error_var", "param_error_var"}
    assert all(not b.requires_grad for b in buffers.values())
    assert not any(n.endswith("error_var") for n, _ in model.named_parameters())
    assert set(buffers) <= set(model.state_dict())
    f = frequencies()
    torch.testing.assert_close(float(model.param_error_var), (2.0 / 8) ** 2)
    want = (2.0 / (8 * f)) ** 2
    real = f > 0
    torch.testing.assert_close(model.item_error_var[real], want[real].to(torch.float64))
    assert model.item_error_var[0] == 0  # padding
    # an unseen item counts as the rarest seen one, not as infinitely noisy
    torch.testing.assert_close(model.item_error_var[7], want[real].max().to(torch.float64))
    model.set_effective_errors(2.0, 8, f, min_frequency=0.1)
    torch.testing.assert_close(model.item_error_var[7], torch.tensor((2.0 / 0.8) ** 2).double())
    assert torch.isfinite(model.item_error_var).all()


def test_backward_leaves_the_buffers_alone():
    """The bookkeeping is a constant for autograd (that no gradient reaches a parameter
    outside its module's output is what the oracle tests below check)."""
    model = noisy(small_model(re_attention=True), sigma=3.0)
    items = item_batch()
    targets = torch.roll(items, -1, 1)
    loss = per_example_cross_entropy(model(items), targets, ignore_index=0).sum()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    assert all(b.grad is None for b in model.buffers())
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sigma": -1.0}, "noise_multiplier=-1.0 is not allowed: expected a finite number >= 0"),
        ({"sigma": math.nan}, "noise_multiplier=nan is not allowed"),
        ({"batch_size": 0}, "batch_size=0 is not allowed: expected a finite number > 0"),
        ({"freqs": torch.ones(5)}, "item_frequencies has shape (5,)"),
        ({"freqs": torch.full((N_ITEMS + 1,), 2.0)}, "item_frequencies must be shares in [0, 1]"),
        ({"freqs": torch.zeros(N_ITEMS + 1)}, "item_frequencies are all 0: give min_frequency"),
        ({"min_frequency": 0.0}, "min_frequency=0.0 is not allowed"),
    ],
)
def test_set_effective_errors_refuses_bad_input(kwargs, message):
    model = small_model()
    with pytest.raises(ValueError, match=re.escape(message)):
        model.set_effective_errors(
            kwargs.get("sigma", 1.0),
            kwargs.get("batch_size", 16),
            kwargs.get("freqs", frequencies()),
            min_frequency=kwargs.get("min_frequency"),
        )


# -- config checks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"n_items": 0}, "n_items=0 is not allowed: expected an integer >= 1"),
        ({"n_items": 3.0}, "n_items=3.0 is not allowed: expected an integer >= 1"),
        ({"n_items": True}, "n_items=True is not allowed"),
        ({"max_len": 0}, "max_len=0 is not allowed: expected an integer >= 1"),
        ({"d_model": 10, "n_head": 4}, "d_model=10 is not allowed: expected a multiple of"),
        ({"n_layer": -1}, "n_layer=-1 is not allowed"),
        ({"d_mlp": 0}, "d_mlp=0 is not allowed: expected None or an integer >= 1"),
        ({"dropout": 1.0}, "dropout=1.0 is not allowed: expected a number in [0, 1)"),
        ({"dropout": "0.1"}, "dropout='0.1' is not allowed"),
        ({"pre_ln": 1}, "pre_ln=1 is not allowed: expected True or False"),
        ({"tie_embeddings": None}, "tie_embeddings=None is not allowed"),
        ({"re_attention": "yes"}, "re_attention='yes' is not allowed"),
        ({"reattention_scale": -0.5}, "reattention_scale=-0.5 is not allowed"),
        ({"reattention_scale": math.inf}, "reattention_scale=inf is not allowed"),
    ],
)
def test_config_refuses_bad_input(overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SeqRecConfig(**{"n_items": 10, **overrides})


def test_input_checks():
    model = small_model()
    with pytest.raises(ValueError, match=re.escape("items has shape (10,)")):
        model(torch.ones(10, dtype=torch.long))
    with pytest.raises(ValueError, match="sequence length L=13 exceeds max_len=12"):
        model(torch.ones(1, 13, dtype=torch.long))


# -- the DP engine against the microbatch oracle ----------------------------------------------------


def engine_case(tied: bool, re_attention: bool, pre_ln: bool = True):
    model = small_model(tie_embeddings=tied, re_attention=re_attention, pre_ln=pre_ln, n_items=23)
    with torch.no_grad():  # larger weights than at initialisation: a sizeable correction
        for p in model.parameters():
            p.mul_(5.0)
    model.set_effective_errors(3.0, 4, torch.linspace(0.01, 0.5, 24))
    g = torch.Generator().manual_seed(3)
    seqs = torch.randint(1, 24, (4, 8), generator=g)
    seqs[0, :3] = 0  # left padding
    seqs[2, :6] = 0
    x, y = seqs[:, :-1], seqs[:, 1:]  # next-item targets; 0 (padding) is ignored

    def losses_of(sl):
        return per_example_cross_entropy(model(x[sl]), y[sl], ignore_index=0)

    return model, losses_of, x.shape[0]


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("re_attention", [False, True])
def test_engine_matches_oracle(mode, tied, re_attention):
    model, losses_of, b = engine_case(tied, re_attention)
    assert_engine_matches_oracle(model, losses_of, b, mode=mode)


@pytest.mark.parametrize("tied", [True, False])
def test_engine_matches_oracle_post_ln_automatic_clipping(tied):
    model, losses_of, b = engine_case(tied, True, pre_ln=False)
    assert_engine_matches_oracle(model, losses_of, b, mode="book_keeping", clipping="automatic")


def test_re_attention_changes_the_gradient():
    """The oracle tests above would pass trivially if the correction did nothing."""
    grads = []
    for re_attention in (False, True):
        model, losses_of, _ = engine_case(True, re_attention)
        losses_of(slice(0, 4)).sum().backward()
        grads.append(model.blocks[0].attn.c_attn.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1], rtol=1e-6, atol=0)
