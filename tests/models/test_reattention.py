"""Re-Attention's moment rules against Monte-Carlo sampling, and the de-biasing itself.

Each rule is checked by drawing its inputs and noisy parameters from the
distributions the rule assumes (20,000 draws, fixed seeds, float64) and
comparing the sample mean / variance with the analytic one. Relative errors
seen (max over coordinates, heads or positions; the tolerances leave room):

- linear (isotropic and grouped input): 0.4%, 0.2%; per-head keys: 0.5%
  (MC noise: the rule is exact under its assumptions)
- LayerNorm then per-head keys with an uneven gamma (the profile): 2.3%
- ReLU (exact) and GELU (6-term Hermite expansion): <= 1.4% per coordinate
  (200,000 draws), <= 0.2% averaged over coordinates
- LayerNorm: 0.3% (little noise), 2.4% (noise ~ signal), 0.2% (noise swamps it)
- attention output (fixed weights, independent positions): 1.3%
- residual x + Linear(x) (variances added, covariance neglected): 0.3%
- one pre-LN block's output variance (all of the above together): 2.5%
- the whole 2-layer model (d = 16), key variances of the first / last block:
  GPT-2 init scale 2.8% / 2.5%; weights x5 and embeddings x10 with two heads
  6.7% / 8.6%; post-LN 0.5% / 9.2%
- E[exp(corrected logit)] vs exp(noise-free logit): 0.5%
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from dptrain.models import reattention as ra
from dptrain.models.reattention import Moments
from dptrain.models.seqrec_transformer import SeqRecConfig, SeqRecTransformer

S = 20_000  # Monte-Carlo draws
DT = torch.float64


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, g: torch.Generator, std: float = 1.0) -> torch.Tensor:
    return std * torch.randn(*shape, generator=g, dtype=DT)


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got - want) / want).abs().max())


def assert_mean_close(got: torch.Tensor, draws: torch.Tensor, atol: float = 0.0) -> None:
    """An exact mean rule: within 5 standard errors of the sample mean (plus ``atol``,
    for coordinates where only a handful of draws differ from the rest)."""
    se = draws.std(0) / math.sqrt(draws.shape[0])
    assert bool(((got - draws.mean(0)).abs() <= 5 * se + atol).all())


# -- single rules ------------------------------------------------------------------------------


@pytest.mark.parametrize("grouped", [False, True])
def test_linear_moments_match_sampling(grouped):
    g = gen(0)
    d_in, d_out = 12, 10
    m = randn(d_in, g=g)
    W0, b0 = randn(d_out, d_in, g=g, std=0.5), randn(d_out, g=g, std=0.3)
    w = 0.02
    if grouped:  # two groups of inputs with their own variance (attention heads)
        v = torch.tensor([0.3, 0.05], dtype=DT)
        v_coord = v.repeat_interleave(d_in // 2)
    else:
        v = torch.tensor(0.2, dtype=DT)
        v_coord = v.expand(d_in)
    x = m + v_coord.sqrt() * randn(S, d_in, g=g)
    W = W0 + math.sqrt(w) * randn(S, d_out, d_in, g=g)
    b = b0 + math.sqrt(w) * randn(S, d_out, g=g)
    y = torch.einsum("soi,si->so", W, x) + b
    got = ra.linear_moments(Moments(m, v), W0, b0, w)
    assert rel(got.var, y.var(0).mean()) < 0.02  # seen: 0.4%, 0.2%
    assert_mean_close(got.mean, y)


def test_head_linear_variance_matches_sampling():
    g = gen(1)
    d_in, nh, hs = 8, 2, 4
    m = randn(d_in, g=g)
    W0 = torch.cat([randn(hs, d_in, g=g, std=0.2), randn(hs, d_in, g=g, std=1.0)])  # unlike heads
    v, w = torch.tensor(0.1, dtype=DT), 0.01
    x = m + v.sqrt() * randn(S, d_in, g=g)
    W = W0 + math.sqrt(w) * randn(S, nh * hs, d_in, g=g)
    b = math.sqrt(w) * randn(S, nh * hs, g=g)
    k = torch.einsum("soi,si->so", W, x) + b
    want = k.var(0).view(nh, hs).mean(-1)
    got = ra.head_linear_variance(Moments(m, v), W0, w, bias=True, n_head=nh)
    assert got.shape == (nh,)
    assert rel(got, want) < 0.02  # seen: 0.5%
    assert got[1] > 5 * got[0]  # per head, not pooled


def test_keys_after_layer_norm_follow_gamma():
    """LayerNorm -> per-head keys with an uneven gamma: coordinate k of the LayerNorm
    output has variance gamma_k^2 v_hat, which the profile carries to the keys."""
    g = gen(13)
    d, nh, hs, w = 16, 2, 8, 1e-4
    m = randn(d, g=g)
    gamma = torch.where(torch.arange(d) < 8, 2.0, 0.5).to(DT)  # the heads read unlike parts
    cols = torch.where(torch.arange(d) < 8, 1.0, 0.3).to(DT)
    W0 = torch.cat([randn(hs, d, g=g) * cols, randn(hs, d, g=g) * cols.flip(0)])
    v = torch.tensor(0.5, dtype=DT)
    x = m + v.sqrt() * randn(S, d, g=g)
    h = F.layer_norm(x, (d,), eps=1e-5) * (gamma + math.sqrt(w) * randn(S, d, g=g))
    k = torch.einsum("soi,si->so", W0 + math.sqrt(w) * randn(S, nh * hs, d, g=g), h)
    hm = ra.layer_norm_moments(Moments(m, v), gamma, None, 1e-5, w)
    got = ra.head_linear_variance(hm, W0, w, bias=False, n_head=nh)
    want = k.var(0).view(nh, hs).mean(-1)
    assert rel(got, want) < 0.06  # seen: 2.3%; without the profile: -42% and +306%
    assert float(got[0] / got[1]) > 4


@pytest.mark.parametrize("kind", ["relu", "gelu"])
def test_activation_moments_match_sampling(kind):
    g = gen(2)
    f = {"relu": F.relu, "gelu": F.gelu}[kind]
    m = torch.linspace(-2.0, 2.0, 9, dtype=DT)
    for v in (0.01, 0.1, 0.5, 2.0):  # pre-activation variances of small and large noise
        vt = torch.tensor(v, dtype=DT)
        y = f(m + math.sqrt(v) * randn(10 * S, m.numel(), g=g))  # cheap: 10x the draws
        mean = {"relu": ra.relu_mean, "gelu": ra.gelu_mean}[kind](m, vt)
        var = {"relu": ra.relu_variance, "gelu": ra.gelu_variance}[kind](m, vt)
        assert_mean_close(mean, y, atol=1e-3 * math.sqrt(v))
        ok = y.var(0) > 0.1 * v  # deep in the flat part few draws vary: MC noise is large
        assert rel(var[ok], y.var(0)[ok]) < 0.04, v  # seen: <= 1.4% per coordinate
        pooled = ra.activation_moments(Moments(m, vt), kind)
        assert rel(pooled.var, y.var(0).mean()) < 0.01, v  # seen: <= 0.2%
        torch.testing.assert_close(pooled.mean, mean, rtol=1e-8, atol=1e-12)


def test_fast_gelu_moments_equal_the_reference_formulas():
    """gelu_moments (the model's path, rearranged for speed) = gelu_mean, gelu_variance."""
    g = gen(14)
    m = randn(40, 64, g=g, std=2.0)
    v = 3 * torch.rand(40, 1, generator=g, dtype=DT)  # one variance per row, as in the model
    mean, var = ra.gelu_moments(m, v)
    torch.testing.assert_close(mean, ra.gelu_mean(m, v), rtol=1e-8, atol=1e-12)
    torch.testing.assert_close(var, ra.gelu_variance(m, v), rtol=1e-10, atol=1e-14)
    pooled = ra.activation_moments(Moments(m, v[:, 0]), "gelu")  # chunked on CPU
    torch.testing.assert_close(pooled.var, ra.gelu_variance(m, v).mean(-1))
    # float32 keeps the pooled variance (tiny per-coordinate values may lose digits)
    pooled32 = ra.activation_moments(Moments(m.float(), v[:, 0].float()), "gelu")
    torch.testing.assert_close(pooled32.var.double(), pooled.var, rtol=1e-5, atol=0)


def test_gelu_rule_beats_the_papers_relu_formula_at_small_variance():
    """DPFormer (Remark D.3) reuses the ReLU formulas for GELU; at v = 0.05 that is
    far off, the Hermite rule is not (both against the exact quadrature value)."""
    m = torch.linspace(-1.5, 1.5, 7, dtype=DT)
    v = torch.tensor(0.05, dtype=DT)
    z = torch.linspace(-10, 10, 200_001, dtype=DT)
    p = torch.exp(-z * z / 2)
    p = p / p.sum()
    y = F.gelu(m[:, None] + v.sqrt() * z)
    exact = (p * (y - (p * y).sum(-1, keepdim=True)) ** 2).sum(-1)
    assert rel(ra.gelu_variance(m, v), exact) < 1e-3
    assert rel(ra.relu_variance(m, v), exact) > 0.3


@pytest.mark.parametrize(("v", "tol"), [(0.01, 0.02), (0.5, 0.03), (20.0, 0.03)])
def test_layer_norm_moments_match_sampling(v, tol):
    g = gen(3)
    d, w = 16, 0.004
    m = randn(d, g=g, std=0.8) + 0.5
    gamma0, beta0 = 1 + randn(d, g=g, std=0.2), randn(d, g=g, std=0.1)
    x = m + math.sqrt(v) * randn(S, d, g=g)
    gamma = gamma0 + math.sqrt(w) * randn(S, d, g=g)
    beta = beta0 + math.sqrt(w) * randn(S, d, g=g)
    y = F.layer_norm(x, (d,), eps=1e-5) * gamma + beta
    got = ra.layer_norm_moments(Moments(m, torch.tensor(v, dtype=DT)), gamma0, beta0, 1e-5, w)
    # seen: 0.3% (little noise), 2.4% (noise ~ signal), 0.2% (noise swamps the signal)
    assert rel(got.var, y.var(0).mean()) < tol
    # the mean shrinks with the noise: its energy is what the noise leaves
    assert (got.mean - y.mean(0)).abs().max() < 0.1 * y.std(0).mean()


def test_attention_moments_match_sampling():
    g = gen(4)
    B, nh, L, d_in, hs = 1, 2, 5, 6, 3
    m = randn(B, L, d_in, g=g)
    v = torch.tensor([[0.5, 0.01, 0.2, 2.0, 0.05]], dtype=DT)  # (B, L): a rare item at j = 3
    att = torch.softmax(randn(B, nh, L, L, g=g), -1).tril()
    att = att / att.sum(-1, keepdim=True)
    W0, b0 = randn(nh * hs, d_in, g=g, std=0.5), randn(nh * hs, g=g, std=0.2)
    w = 0.01
    x = m + v.sqrt()[..., None] * randn(S, B, L, d_in, g=g)
    W = W0 + math.sqrt(w) * randn(S, nh * hs, d_in, g=g)
    b = b0 + math.sqrt(w) * randn(S, nh * hs, g=g)
    val = torch.einsum("sbli,soi->sblo", x, W) + b[:, None, None]  # (S, B, L, nh hs)
    val = val.view(S, B, L, nh, hs).transpose(2, 3)  # (S, B, nh, L, hs)
    y = (att @ val).transpose(2, 3).reshape(S, B, L, nh * hs)
    got = ra.attention_moments(att, Moments(m, v), W0, b0, w)
    want = y.var(0).view(B, L, nh, hs).mean(-1)
    assert got.var.shape == (B, L, nh)
    assert rel(got.var, want) < 0.03  # seen: 1.3%
    assert_mean_close(got.mean, y)


def test_residual_variances_add():
    """x + Linear(x): the rule adds the two variances, neglecting their covariance
    v tr(W)/d_in (small for a weight matrix not aligned with the identity)."""
    g = gen(5)
    d, w = 16, 0.002
    m, v = randn(d, g=g), torch.tensor(0.3, dtype=DT)
    W0, b0 = randn(d, d, g=g, std=0.3), torch.zeros(d, dtype=DT)
    x = m + v.sqrt() * randn(S, d, g=g)
    W = W0 + math.sqrt(w) * randn(S, d, d, g=g)
    out = x + torch.einsum("soi,si->so", W, x)
    s = Moments(m, v)
    got = ra.residual_moments(s, ra.linear_moments(s, W0, b0 * 0 + b0, w))
    assert rel(got.var, out.var(0).mean()) < 0.03  # seen: 0.3%


def test_rules_never_build_a_graph():
    """The bookkeeping must not create a gradient path into parameters (the engine
    would miss it): outputs do not require grad even if every input does."""
    torch.manual_seed(0)
    W = torch.randn(4, 4, requires_grad=True)
    m = torch.randn(2, 3, 4, requires_grad=True)
    v = torch.rand(2, 3, requires_grad=True)
    s = Moments(m, v)
    outs = [
        *ra.linear_moments(s, W, W[0], 0.1),
        *ra.layer_norm_moments(s, W[0], W[1], 1e-5, 0.1),
        *ra.activation_moments(s, "gelu"),
        *ra.activation_moments(s, "relu"),
        ra.head_linear_variance(s, W, 0.1, bias=True, n_head=2),
        *ra.attention_moments(torch.rand(2, 1, 3, 3, requires_grad=True), s, W, W[0], 0.1),
        ra.reattention_bias(torch.randn(2, 1, 3, 4, requires_grad=True), v.unsqueeze(1)),
    ]
    assert all(not t.requires_grad for t in outs if t is not None)


# -- a block and the whole model against sampled parameters ----------------------------------------


def make_model(pre_ln=True, w_scale=1.0, e_scale=1.0, n_head=1, n_layer=2, seed=0):
    torch.manual_seed(seed)
    cfg = SeqRecConfig(
        n_items=30,
        max_len=8,
        d_model=16,
        n_head=n_head,
        n_layer=n_layer,
        dropout=0.0,
        pre_ln=pre_ln,
    )
    model = SeqRecTransformer(cfg).to(DT).eval()
    with torch.no_grad():  # away from the symmetric initialisation
        for name, p in model.named_parameters():
            if "emb" in name:
                p.mul_(e_scale)
            elif p.dim() == 2:
                p.mul_(w_scale)
            else:
                p.add_(0.1 * torch.randn_like(p))
        model.item_emb.weight[0].zero_()
    g = gen(seed + 1)
    items = torch.randint(1, 31, (2, 8), generator=g)
    items[0, :3] = 0  # left padding
    freqs = torch.logspace(-2, math.log10(0.5), 31, dtype=DT)[torch.randperm(31, generator=g)]
    model.set_effective_errors(1.0, 64, freqs)
    return model, items


def sample_parameters(model, n: int, g: torch.Generator, skip=()) -> dict[str, torch.Tensor]:
    """n draws of every parameter: observed value + N(0, effective error^2). Parameters
    named in ``skip`` (and ln_f, head: they come after every key) stay fixed."""
    w = float(model.param_error_var)
    out = {}
    for name, p in model.named_parameters():
        if name.startswith(("ln_f", "head", *skip)):
            out[name] = p.detach().expand(n, *p.shape)
            continue
        std = model.item_error_var.sqrt()[:, None] if name.startswith("item_emb") else math.sqrt(w)
        out[name] = p.detach() + std * torch.randn((n, *p.shape), generator=g, dtype=DT)
    return out


def sampled_run(model, P, items, keys_only=False) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The model's forward, written out for a batch of parameter draws: keys and outputs
    of every block, each (n, B, L, d). An independent re-implementation of the blocks.
    ``keys_only``: stop at the last block's keys."""
    cfg = model.config
    d, nh = cfg.d_model, cfg.n_head
    hs, L = d // nh, items.shape[1]

    def lin(x, name):
        return (
            torch.einsum("nbli,noi->nblo", x, P[name + ".weight"])
            + P[name + ".bias"][:, None, None]
        )

    def ln(x, name):
        y = F.layer_norm(x, (d,), eps=1e-5)
        return y * P[name + ".weight"][:, None, None] + P[name + ".bias"][:, None, None]

    x = P["item_emb.weight"][:, items] + P["pos_emb.weight"][:, :L][:, None]
    mask = model.attention_mask(items, DT)
    keys, outs = [], []
    for i in range(cfg.n_layer):
        pf = f"blocks.{i}."

        def attn(h, pf=pf):
            q, k, v = lin(h, pf + "attn.c_attn").split(d, -1)
            keys.append(k)
            n, B = q.shape[:2]

            def heads(t):
                return t.view(n, B, L, nh, hs).transpose(2, 3)

            a = torch.softmax(heads(q) @ heads(k).transpose(-1, -2) / math.sqrt(hs) + mask, -1)
            y = (a @ heads(v)).transpose(2, 3).reshape(n, B, L, d)
            return lin(y, pf + "attn.c_proj")

        def mlp(h, pf=pf):
            return lin(F.gelu(lin(h, pf + "mlp.c_fc")), pf + "mlp.c_proj")

        if keys_only and i == cfg.n_layer - 1:
            h = ln(x, pf + "ln_1") if cfg.pre_ln else x
            keys.append(lin(h, pf + "attn.c_attn")[..., d : 2 * d])
            break
        if cfg.pre_ln:
            x = x + attn(ln(x, pf + "ln_1"))
            x = x + mlp(ln(x, pf + "ln_2"))
        else:
            x = ln(x + attn(x), pf + "ln_1")
            x = ln(x + mlp(x), pf + "ln_2")
        outs.append(x)
    return keys, outs


def mc_key_variances(model, items, seed=7, chunk=2000) -> list[torch.Tensor]:
    """Per-coordinate key variances (B, nh, L) per block over S parameter draws."""
    g = gen(seed)
    sums = None
    for _ in range(S // chunk):
        last = f"blocks.{model.config.n_layer - 1}."
        skip = (last + "attn.c_proj", last + "ln_2", last + "mlp")  # after the last keys
        keys = sampled_run(model, sample_parameters(model, chunk, g, skip), items, True)[0]
        part = [(k.sum(0), k.pow(2).sum(0)) for k in keys]
        sums = (
            part
            if sums is None
            else [(a + c, b + e) for (a, b), (c, e) in zip(sums, part, strict=True)]
        )
    B, L = items.shape
    nh = model.config.n_head
    out = []
    for s1, s2 in sums:
        var = s2 / S - (s1 / S) ** 2  # (B, L, d)
        out.append(var.view(B, L, nh, -1).mean(-1).transpose(1, 2))
    return out


def test_sampled_forward_is_the_models_forward():
    """The MC harness runs the same network as the model (one draw = the observed weights)."""
    model, items = make_model(n_head=2)
    P = {n: p.detach()[None] for n, p in model.named_parameters()}
    keys = sampled_run(model, P, items)[0]
    got = []
    hooks = [
        b.attn.c_attn.register_forward_hook(lambda m, a, o: got.append(o[..., 16:32]))
        for b in model.blocks
    ]
    model(items)
    for h in hooks:
        h.remove()
    for k, want in zip(keys, got, strict=True):
        torch.testing.assert_close(k[0], want)


def test_one_block_output_variance_matches_sampling():
    model, items = make_model(w_scale=5.0, e_scale=10.0, n_layer=1)
    block, w = model.blocks[0], model.param_error_var
    s0 = ra.embedding_moments(
        items, model.item_emb.weight, model.pos_emb.weight, model.item_error_var, w
    )
    mask = model.attention_mask(items, DT)
    x0 = model.item_emb(items) + model.pos_emb(torch.arange(items.shape[1]))
    with torch.no_grad():
        _, att = block(x0, mask)
    h = block.attn_input_moments(s0, w)
    got = block.moments(s0, h, att, w).var  # (B, L)
    # sample: the block with noisy parameters on noisy embeddings
    g = gen(11)
    sums = torch.zeros(2, *items.shape, 16, dtype=DT)
    for _ in range(S // 2000):
        out = sampled_run(model, sample_parameters(model, 2000, g), items)[1][0]
        sums += torch.stack([out.sum(0), out.pow(2).sum(0)])
    want = (sums[1] / S - (sums[0] / S) ** 2).mean(-1)
    valid = items != 0
    assert rel(got[valid], want[valid]) < 0.06  # seen: 2.5%


@pytest.mark.parametrize(
    ("pre_ln", "w_scale", "e_scale", "n_head", "tols"),
    [
        (True, 1.0, 1.0, 1, (0.06, 0.06)),  # GPT-2 init scale; seen 2.8%, 2.5%
        (True, 5.0, 10.0, 2, (0.1, 0.12)),  # "trained" weights, two heads; 6.7%, 8.6%
        (False, 5.0, 10.0, 1, (0.06, 0.12)),  # post-LN; seen 0.5%, 9.2%
    ],
)
def test_whole_model_key_variances_match_sampling(pre_ln, w_scale, e_scale, n_head, tols):
    """s^2 of every block's keys, propagated through the whole 2-layer model, against the
    keys' variance over 20,000 draws of all parameters with their effective errors."""
    model, items = make_model(pre_ln=pre_ln, w_scale=w_scale, e_scale=e_scale, n_head=n_head)
    got = model.key_variances(items)
    want = mc_key_variances(model, items)
    valid = (items != 0).unsqueeze(1).expand_as(got[0])  # padded keys are never attended to
    for layer, tol in enumerate(tols):
        assert rel(got[layer][valid], want[layer][valid]) < tol, layer
    # the rare items' keys really are the noisy ones (the correction has work to do)
    assert float(want[-1][valid].max() / want[-1][valid].min()) > 2


# -- the de-biasing ---------------------------------------------------------------------------------


def test_reattention_bias_formula():
    q = torch.tensor([[[[1.0, 2.0], [0.0, 3.0]]]], dtype=DT)  # (1, 1, 2, 2): ||q||^2 = 5, 9
    s2 = torch.tensor([[[0.5, 2.0]]], dtype=DT)
    got = ra.reattention_bias(q, s2, scale=0.5)
    want = -0.5 / 4 * torch.tensor([[5 * 0.5, 5 * 2.0], [9 * 0.5, 9 * 2.0]], dtype=DT)
    torch.testing.assert_close(got[0, 0], want)


def test_corrected_logits_are_unbiased_in_exp():
    """E[exp(q.k/sqrt d - ||q||^2 s^2/(2d))] = exp(q.mu/sqrt d) for k ~ N(mu, s^2 I)."""
    g = gen(12)
    d = 8
    q, mu = randn(d, g=g), randn(4, d, g=g)
    s2 = torch.tensor([0.01, 0.1, 0.3, 0.6], dtype=DT)
    k = mu + s2.sqrt()[:, None] * randn(S, 4, d, g=g)
    z = k @ q / math.sqrt(d)
    bias = ra.reattention_bias(q.view(1, 1, 1, d), s2.view(1, 1, 4))[0, 0, 0]
    truth = torch.exp(mu @ q / math.sqrt(d))
    assert rel(torch.exp(z + bias).mean(0), truth) < 0.03
    # without the correction: inflated by exp(||q||^2 s^2 / (2d)), the bias Re-Attention removes
    inflation = torch.exp(q.pow(2).sum() * s2 / (2 * d))
    assert rel(torch.exp(z).mean(0), truth * inflation) < 0.03
    assert float(inflation[-1]) > 1.2


@pytest.mark.parametrize("correction", [0.5, 1.0])
def test_debiased_softmax_is_closer_to_the_noise_free_attention(correction):
    """Keys with known per-token variances: half the tokens "rare" (||q||^2 s^2/(2d) =
    ``correction``), half nearly noise-free. Over 20,000 noise draws, the vanilla
    softmax gives the rare tokens too much attention on average; the de-biased one
    is much closer to the attention of the noise-free keys mu.

    Seen (fixed seed): rare tokens' mass a* = 0.596; vanilla 0.681 / 0.742, de-biased
    0.571 / 0.535 (correction 0.5 / 1); L1 error on rare tokens 0.085 -> 0.027 and
    0.146 -> 0.063. Not a free lunch: at correction 4 the de-biased softmax
    over-corrects (0.298 vs vanilla 0.897; errors 0.301 and 0.298), since
    E[softmax] is not the ratio of the expectations the correction makes unbiased.
    """
    g = gen(0)
    d, n = 16, 20
    mu, q = randn(n, d, g=g), randn(d, g=g)
    rare = torch.arange(n) % 2 == 0
    q_sq = q.pow(2).sum()
    s2 = torch.where(rare, correction, 0.01) * 2 * d / q_sq
    a_star = torch.softmax(mu @ q / math.sqrt(d), 0)  # attention with noise-free keys
    k = mu + s2.sqrt()[:, None] * randn(S, n, d, g=g)
    logits = k @ q / math.sqrt(d)
    bias = ra.reattention_bias(q.view(1, 1, 1, d), s2.view(1, 1, n))[0, 0, 0]
    vanilla = torch.softmax(logits, -1).mean(0)
    debiased = torch.softmax(logits + bias, -1).mean(0)
    err_vanilla = (vanilla - a_star)[rare].abs().sum()
    err_debiased = (debiased - a_star)[rare].abs().sum()
    assert vanilla[rare].sum() > a_star[rare].sum() + 0.05  # attention distraction
    assert err_debiased < 0.5 * err_vanilla
