"""Re-Attention (DPFormer §5): analytic tracking of the DP-noise variance of attention keys.

DP-SGD leaves Gaussian noise in the parameters. If the key of position j is
k_j ~ N(mu_j, s_j^2 I), then for a query q

    E[exp(q . k_j / sqrt(d_h))] = exp(q . mu_j / sqrt(d_h) + ||q||^2 s_j^2 / (2 d_h)),

so keys that carry more noise (rare items, whose embedding rows are rarely
trained but always noised) draw attention they do not deserve. Re-Attention
subtracts ``scale * ||q_i||^2 s_j^2 / (2 d_h)`` from the logit of query i and key j
(:func:`reattention_bias`).

s_j^2 comes from propagating the first two moments of every hidden state
through the network, layer by layer, with the noisy parameters as the means of
their distributions (DPFormer §5.2.2, eq. 5.7): a mean tensor and ONE variance
per position (the per-coordinate variance, taken equal for all coordinates:
"isotropic", as DP noise is; a LayerNorm's gain adds a per-coordinate profile
shared by all positions). The functions below are the rules, one per
sub-layer, each stating its formula; :class:`Moments` is what they pass on.
The full specification and its assumptions are in ``docs/reattention.md``.
Shapes: ``...`` is any leading shape, usually (B, L).

No gradient path: every function runs under ``torch.no_grad()`` on detached
tensors. The clipping engine sees a parameter's gradient only through the
outputs of the modules that own it; a gradient that reached a weight directly
through this bookkeeping would escape per-example clipping (a privacy bug). The
moments are constants for autograd, and so is the logit correction.
"""

from __future__ import annotations

import math
from functools import cache
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "GELU_TERMS",
    "Moments",
    "activation_moments",
    "attention_moments",
    "embedding_moments",
    "gelu_mean",
    "gelu_moments",
    "gelu_variance",
    "head_linear_variance",
    "layer_norm_moments",
    "linear_moments",
    "reattention_bias",
    "relu_mean",
    "relu_variance",
    "residual_moments",
]

#: Terms of the Hermite expansion used for GELU (see :func:`gelu_variance`).
GELU_TERMS = 6

_SQRT_2PI = math.sqrt(2 * math.pi)


class Moments(NamedTuple):
    """Mean and per-coordinate variance of a hidden state under the parameters' DP noise."""

    mean: Tensor
    """(..., d) expected values."""
    var: Tensor
    """(...,) the variance of every coordinate (their average, with ``profile``), or
    (..., G) one per contiguous group of d / G coordinates (the heads of an
    attention output)."""
    profile: Tensor | None = None
    """(d,) with mean 1, or None: coordinate k has variance ``var * profile[k]``. The
    same for every position: a LayerNorm's gamma^2 / mean(gamma^2)."""


def _col_sq(weight: Tensor, profile: Tensor | None) -> Tensor:
    """W_ok^2 weighted by the input profile: (d_out, d_in)."""
    sq = weight.pow(2)
    return sq if profile is None else sq * profile.to(sq.dtype)


def _const(t: Tensor, like: Tensor) -> Tensor:
    """``t`` detached, in ``like``'s dtype (the moments may be kept wider than the model)."""
    return t.detach().to(like.dtype)


def _pdf(x: Tensor) -> Tensor:
    return torch.exp(-0.5 * x * x) / _SQRT_2PI


def _cdf(x: Tensor) -> Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2)))


# -- embeddings, linear layers, LayerNorm ------------------------------------------------------


@torch.no_grad()
def embedding_moments(
    items: Tensor,
    item_weight: Tensor,
    pos_weight: Tensor,
    item_var: Tensor,
    pos_var: Tensor | float,
) -> Moments:
    """Moments of ``item_weight[items] + pos_weight[arange(L)]`` for ids ``items`` (B, L).

    mean = E_v + P_t (the observed rows), var = item_var[v] + pos_var: the item
    row and the position row carry independent noise, so their per-coordinate
    variances add. Returns mean (B, L, d), var (B, L), in float32 at least (the
    rules that follow keep that dtype, whatever the model's).
    """
    L = items.shape[-1]
    dtype = torch.promote_types(item_weight.dtype, torch.float32)
    mean = item_weight.detach()[items].to(dtype) + pos_weight.detach()[:L].to(dtype)
    var = item_var.detach()[items].to(dtype) + pos_var
    return Moments(mean, var)


@torch.no_grad()
def linear_moments(x: Moments, weight: Tensor, bias: Tensor | None, w: Tensor | float) -> Moments:
    """Moments of y = W x + b with x ~ (m, v), W's and b's entries of variance ``w``.

    mean = W m + b (W, b the observed ``weight`` (d_out, d_in), ``bias``). With
    all entries independent (DPFormer eq. 5.5, Lemma D.1)

        var(y_o) = sum_k W_ok^2 v_k + w sum_k (m_k^2 + v_k) + w [bias],

    averaged over the d_out outputs:

        v_y = sum_k v_k ||W_:k||^2 / d_out + w (||m||^2 + sum_k v_k) + w [bias].

    ``x.var`` (...,) means v_k = v p_k for every k (p = ``x.profile``, or 1);
    (..., G) gives each contiguous group of d_in / G inputs its own v (an
    attention output, head by head). Returns mean (..., d_out), var (...,);
    the output is isotropic (no profile).
    """
    m, v = x.mean.detach(), x.var
    weight = _const(weight, m)
    d_out, d_in = weight.shape
    if v.dim() == m.dim():  # grouped input variances
        g = v.shape[-1]
        col_sq = weight.pow(2).view(d_out, g, d_in // g).sum((0, 2)) / d_out  # (G,)
        signal = v @ col_sq.to(v.dtype)
        v_sum = v.sum(-1) * (d_in // g)
    else:
        signal = v * (_col_sq(weight, x.profile).sum() / d_out)
        v_sum = v * d_in
    var = signal + w * (m.pow(2).sum(-1) + v_sum + float(bias is not None))
    mean = F.linear(m, weight, None if bias is None else _const(bias, m))
    return Moments(mean, var)


@torch.no_grad()
def head_linear_variance(
    x: Moments, weight: Tensor, w: Tensor | float, *, bias: bool, n_head: int
) -> Tensor:
    """The variance part of :func:`linear_moments` per head: the outputs of ``weight``
    (d_out, d_in) split into ``n_head`` contiguous groups, each averaged on its own.

    For the keys: s^2_h = v sum_k p_k ||W_h,:k||^2 / d_h + w (||m||^2 + d_in v) + w [bias],
    with W_h the rows of head h and p the input's profile (1 if None). ``x.var``
    must be (...,); returns (..., n_head).
    """
    m, v = x.mean.detach(), x.var
    weight = _const(weight, m)
    d_out, d_in = weight.shape
    hs = d_out // n_head
    row_sq = _col_sq(weight, x.profile).view(n_head, hs * d_in).sum(1) / hs  # (nh,)
    noise = w * (m.pow(2).sum(-1) + d_in * v + float(bias))  # (...,)
    return v.unsqueeze(-1) * row_sq.to(v.dtype) + noise.unsqueeze(-1)


@torch.no_grad()
def layer_norm_moments(
    x: Moments, weight: Tensor | None, bias: Tensor | None, eps: float, w: Tensor | float
) -> Moments:
    """Moments of LayerNorm(x) = gamma * (x - mean_k x) / sqrt(var_k x + eps) + beta.

    Input x = m + n, n isotropic noise of variance v. The normaliser is taken
    at its expectation, s^2 = var_k(m) + v + eps (var_k over the d coordinates);
    r = v / s^2 is the share of the input that is noise. Linearising around m,
    the normalised noise keeps d - 2 of its d degrees of freedom (centring
    removes one, the normaliser absorbs the radial one): r (1 - 2/d) per
    coordinate; noise that swamps m gives a random vector of unit variance per
    coordinate: 1. One formula exact in both limits:

        v_hat = r (1 - (2/d) (1 - r)),
        var   = mean_k(gamma_k^2) v_hat + w (var_k(m) + v) / s^2 + w [beta],
        mean  = gamma * (m - mean_k m) / s + beta,
        profile = gamma^2 / mean_k(gamma_k^2),

    the w terms the noise of gamma (times E[xhat_k^2]) and of beta (the profile
    is applied to them too: they are small beside gamma_k^2 v_hat unless
    everything is). Coordinate k's variance is gamma_k^2 v_hat, not the
    average: the profile keeps that for the layers that read this output (a
    gamma of 1 +- 0.1 already moves a head's key variance by 12%). The mean
    shrinks with the noise (||mean xhat||^2 = d (1 - r) + O(eps)): LayerNorm fixes
    the norm of its output, so the noise it lets through is taken out of the
    mean, not added to it. The input's own profile is ignored (its average
    variance ``v`` is used). Returns mean (..., d), var (...,), profile (d,).
    """
    m, v = x.mean.detach(), x.var
    d = m.shape[-1]
    centred = m - m.mean(-1, keepdim=True)
    var_m = centred.pow(2).mean(-1)
    s2 = var_m + v + eps
    r = v / s2
    v_hat = r * (1 - (2.0 / d) * (1 - r))
    mean = centred / s2.sqrt().unsqueeze(-1)
    profile = None
    if weight is None:
        var = v_hat
    else:
        g2 = _const(weight, m).pow(2)
        var = g2.mean() * v_hat + w * (var_m + v) / s2
        mean = mean * _const(weight, m)
        profile = g2 / g2.mean().clamp_min(torch.finfo(g2.dtype).tiny)
    if bias is not None:
        var = var + w
        mean = mean + _const(bias, m)
    return Moments(mean, var, profile)


# -- activations ---------------------------------------------------------------------------------


@torch.no_grad()
def relu_mean(m: Tensor, v: Tensor) -> Tensor:
    """E[ReLU(X)], X ~ N(m, v): m Phi(m / sqrt v) + sqrt(v) phi(m / sqrt v) (exact)."""
    m = m.detach()
    v = torch.as_tensor(v, dtype=m.dtype, device=m.device)
    sd = v.clamp_min(torch.finfo(m.dtype).tiny).sqrt()
    a = m / sd
    return m * _cdf(a) + sd * _pdf(a)


@torch.no_grad()
def relu_variance(m: Tensor, v: Tensor) -> Tensor:
    """Var[ReLU(X)], X ~ N(m, v), exact (moment matching, DPFormer eq. 5.6).

    With a = m / sqrt(v): E[y] = sqrt(v) (a Phi(a) + phi(a)) and E[y^2] = v ((1 + a^2)
    Phi(a) + a phi(a)), so var = v (Phi + a^2 Phi (1 - Phi) + a phi (1 - 2 Phi) - phi^2):
    the same value without the cancellation of E[y^2] - E[y]^2 at large a.
    ``m`` and ``v`` broadcast.
    """
    m = m.detach()
    v = torch.as_tensor(v, dtype=m.dtype, device=m.device)
    a = m / v.clamp_min(torch.finfo(m.dtype).tiny).sqrt()
    cdf, pdf = _cdf(a), _pdf(a)
    g = cdf + a * a * cdf * (1 - cdf) + a * pdf * (1 - 2 * cdf) - pdf * pdf
    return v * g.clamp_min(0)


@torch.no_grad()
def gelu_mean(m: Tensor, v: Tensor) -> Tensor:
    """E[GELU(X)] = E[X Phi(X)], X ~ N(m, v): m Phi(u) + v phi(u) / s, s = sqrt(1 + v), u = m / s.

    Exact (Stein's lemma E[X g(X)] = m E g + v E g', with E Phi(X) = Phi(u) and
    E phi(X) = phi(u) / s). ``m`` and ``v`` broadcast.
    """
    m = m.detach()
    v = torch.as_tensor(v, dtype=m.dtype, device=m.device)
    s = (1 + v).sqrt()
    u = m / s
    return m * _cdf(u) + v * _pdf(u) / s


@cache
def _gelu_polys(terms: int) -> tuple[tuple[float, ...], ...]:
    """Coefficients (lowest degree first) of p_n, n = 2..terms, GELU^(n)(x) = phi(x) p_n(x)."""
    polys = [(2.0, 0.0, -1.0)]  # GELU'' = phi (2 - x^2)
    for _ in range(3, terms + 1):
        p = polys[-1]  # p_{n+1} = -x p_n + p_n'
        q = [0.0] * (len(p) + 1)
        for k, c in enumerate(p):
            q[k + 1] -= c
            if k:
                q[k - 1] += k * c
        polys.append(tuple(q))
    return tuple(polys)


@torch.no_grad()
def gelu_variance(m: Tensor, v: Tensor, terms: int = GELU_TERMS) -> Tensor:
    """Var[GELU(X)], GELU(x) = x Phi(x), X ~ N(m, v), by its Hermite expansion.

    For Gaussian X, var f(X) = sum_{n>=1} v^n / n! (E f^(n)(X))^2 (Wiener chaos;
    Gaussian integration by parts): a sum of positive terms, no cancellation.
    For GELU each expectation is closed form: with s^2 = 1 + v, u = m / s,
    mu = m / s^2, t = v / s^2,

        E f'(X)    = Phi(u) + phi(u) mu / s,
        E f^(n)(X) = phi(u) / s * E[p_n(Y)],  Y ~ N(mu, t),  n >= 2,

    where f^(n) = phi p_n, p_2 = 2 - x^2, p_{n+1} = -x p_n + p_n'. The first
    ``terms`` terms are kept (6: relative error below 0.2% for v <= 0.5 and
    below 1% for m >= -1, v <= 2; truncation only underestimates).

    The paper applies the ReLU formulas to GELU (its Remark D.3). That is
    accurate only for v >> 1: at the variances this model's MLP sees
    (v ~ 0.01 .. 0.5) it is off by -100% .. +35%, so GELU gets its own rule.
    """
    m = m.detach()
    v = torch.as_tensor(v, dtype=m.dtype, device=m.device)
    s2 = 1 + v
    s = s2.sqrt()
    u = m / s
    k = _pdf(u) / s
    mu, t = m / s2, v / s2
    out = v * (_cdf(u) + k * mu).pow(2)
    moments = [torch.ones_like(mu), mu]  # E[Y^j], by E Y^j = mu E Y^{j-1} + (j-1) t E Y^{j-2}
    for j in range(2, terms + 1):
        moments.append(mu * moments[-1] + (j - 1) * t * moments[-2])
    v_pow, factorial = v, 1.0
    for n, poly in enumerate(_gelu_polys(terms), start=2):
        v_pow = v_pow * v
        factorial *= n
        e = sum(c * moments[j] for j, c in enumerate(poly) if c)
        out = out + v_pow / factorial * (k * e).pow(2)
    return out


@torch.no_grad()
def gelu_moments(m: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`gelu_mean` and :func:`gelu_variance` (6 terms) together, in few passes.

    The same formulas, rearranged for speed (this runs on every MLP hidden
    unit): with q = mu^2 and a = 1 - t = 1 / (1 + v), E f^(n)(X) = +-phi(u) / s d_n
    where d_n = E[He_n(Y) - He_{n-2}(Y)] (f^(n) = (-1)^(n-1) phi (He_n - He_{n-2})):

        d_2 = q - (a + 1),                d_3 = mu (q - (3a + 1)),
        d_4 = q^2 - (6a + 1) q + 3a^2 + a,
        d_5 = mu (q^2 - (10a + 1) q + 15a^2 + 3a),
        d_6 = q^3 - (15a + 1) q^2 + (45a^2 + 6a) q - 15a^3 - 3a^2,

    var = v ((E f')^2 + (phi(u) / s)^2 sum_{n=2..6} v^(n-1) / n! d_n^2). ``v``
    broadcasts against ``m`` and is typically one value per position: the
    coefficients are computed at that size (with sqrt(v^(n-1) / n!) folded in),
    only the Horner steps run per coordinate.
    """
    m = m.detach()
    v = torch.as_tensor(v, dtype=m.dtype, device=m.device)
    a = 1 / (1 + v)  # = 1 / s^2 = 1 - t
    inv_s = a.sqrt()
    u = m * inv_s
    cdf = torch.special.ndtr(u)
    k = u.square_().mul_(-0.5).exp_().mul_(inv_s / _SQRT_2PI)  # phi(u) / s (u is spent)
    mean = torch.mul(m, cdf).addcmul_(k, v)
    mu = torch.mul(m, a)
    var = cdf.addcmul_(k, mu).square_()  # (E f')^2
    q = mu.square()
    a2 = a * a
    r = [(v.pow(n - 1) / math.factorial(n)).sqrt() for n in range(2, 7)]  # per position
    rest = torch.addcmul(-(a + 1) * r[0], q, r[0]).square_()
    d = torch.addcmul(-(3 * a + 1) * r[1], q, r[1]).mul_(mu)
    rest.addcmul_(d, d)
    d = torch.addcmul(-(6 * a + 1) * r[2], q, r[2]).mul_(q).add_((3 * a2 + a) * r[2])
    rest.addcmul_(d, d)
    d = torch.addcmul(-(10 * a + 1) * r[3], q, r[3]).mul_(q).add_((15 * a2 + 3 * a) * r[3])
    rest.addcmul_(d.mul_(mu), d)
    d = torch.addcmul(-(15 * a + 1) * r[4], q, r[4]).mul_(q).add_((45 * a2 + 6 * a) * r[4])
    d.mul_(q).sub_((15 * a2 * a + 3 * a2) * r[4])
    rest.addcmul_(d, d)
    return mean, var.addcmul_(rest, k.square_()).mul_(v)


#: Rows x columns per chunk of the activation rules on CPU: 1 MB blocks stay in cache
#: and reuse freed memory (a fresh 8 MB buffer is zero-filled page by page by the OS).
_CPU_CHUNK_ELEMENTS = 1 << 18


@torch.no_grad()
def activation_moments(x: Moments, kind: str = "gelu") -> Moments:
    """Moment matching through a coordinate-wise activation (DPFormer eq. 5.6).

    Coordinate k of the input is N(m_k, v_k) (v_k = v p_k with the input's
    profile); the output mean is E f(N(m_k, v_k)) per coordinate
    (:func:`gelu_mean`, :func:`relu_mean`) and the output variance the average
    over k of Var f(N(m_k, v_k)) (:func:`gelu_variance`, :func:`relu_variance`;
    GELU through :func:`gelu_moments`, the same values computed faster).
    ``x.var`` must be (...,). Returns mean (..., d), var (...,).
    """
    if kind not in ("gelu", "relu"):
        raise ValueError(f"kind={kind!r} is not allowed: expected 'gelu' or 'relu'")
    m, v = x.mean.detach(), x.var.unsqueeze(-1)
    if x.profile is not None:
        v = v * x.profile.to(v.dtype)
    d = m.shape[-1]
    m2, v2 = m.reshape(-1, d), v.expand(*m.shape[:-1], v.shape[-1]).reshape(-1, v.shape[-1])
    rows = m2.shape[0]
    step = rows if m.device.type != "cpu" else max(1, _CPU_CHUNK_ELEMENTS // d)
    mean, var = torch.empty_like(m2), m2.new_empty(rows)
    for i in range(0, rows, step):
        mi, vi = m2[i : i + step], v2[i : i + step]
        if kind == "gelu":
            mean_i, var_i = gelu_moments(mi, vi)
        else:
            mean_i, var_i = relu_mean(mi, vi), relu_variance(mi, vi)
        mean[i : i + step] = mean_i
        var[i : i + step] = var_i.mean(-1)
    return Moments(mean.view(m.shape), var.view(m.shape[:-1]))


# -- attention and residuals ------------------------------------------------------------------


@torch.no_grad()
def attention_moments(
    att: Tensor, x: Moments, weight_v: Tensor, bias_v: Tensor | None, w: Tensor | float
) -> Moments:
    """Moments of each head's output y_i = sum_j a_ij (W_v x_j + b_v), heads side by side.

    Since sum_j a_ij = 1, y_i = W_v xbar_i + b_v with xbar_i = sum_j a_ij x_j: the
    value projection applied once to the attention-weighted input. The weights
    a_ij (``att`` (B, nh, L, L), as applied, after dropout) are taken as fixed
    (their own noise, from the keys and queries, is neglected), and the inputs'
    noise as independent across positions (a repeated item breaks this), so

        mean xbar_i = sum_j a_ij m_j,    vbar_i = sum_j a_ij^2 v_j,

    (xbar keeps the input's profile p), and :func:`linear_moments` with head h's
    rows W_v,h of ``weight_v`` (d, d_in):

        mean y_h,i = W_v,h mean xbar_h,i + b_v,h,
        var  y_h,i = vbar_h,i sum_k p_k ||W_v,h,:k||^2 / d_h
                     + w (||mean xbar_h,i||^2 + d_in vbar_h,i) + w.

    The noise of W_v is shared by all positions, so it enters through the
    weighted mean ||mean xbar_i||^2 (exact), not through sum_j a_ij^2 ||m_j||^2.
    ``x``: mean (B, L, d_in), var (B, L). Returns mean (B, L, d), var (B, L, nh).
    """
    att = _const(att, x.mean)
    B, nh, L, _ = att.shape
    weight_v = _const(weight_v, x.mean)
    d_out, d_in = weight_v.shape
    hs = d_out // nh
    w_heads = weight_v.view(nh, hs, d_in)
    row_sq = _col_sq(weight_v, x.profile).view(nh, hs * d_in).sum(1) / hs  # (nh,)
    xbar = att @ x.mean.detach().unsqueeze(1)  # (B, nh, L, d_in)
    vbar = ((att * att) @ x.var.unsqueeze(1).unsqueeze(-1).to(att.dtype)).squeeze(-1)
    var = vbar * row_sq.view(1, nh, 1).to(vbar.dtype) + w * (
        xbar.pow(2).sum(-1) + d_in * vbar + float(bias_v is not None)
    )  # (B, nh, L)
    mean = torch.einsum("bhli,hoi->blho", xbar, w_heads.to(xbar.dtype))  # (B, L, nh, hs)
    if bias_v is not None:
        mean = mean + _const(bias_v, mean).view(nh, hs)
    return Moments(mean.reshape(B, L, d_out), var.transpose(1, 2))


@torch.no_grad()
def residual_moments(skip: Moments, branch: Moments) -> Moments:
    """Moments of x + f(x): means add, and so do variances (the branch's noise is taken
    as independent of the skip path's: their covariance v tr(J) / d, J the
    branch's Jacobian, is neglected; it vanishes on average for weights that
    are not aligned with the identity). Both must have one variance per
    position; a profile is averaged away (the sum is taken as isotropic)."""
    return Moments(skip.mean + branch.mean, skip.var + branch.var)


@torch.no_grad()
def reattention_bias(q: Tensor, key_var: Tensor, scale: float = 1.0) -> Tensor:
    """The Re-Attention correction of the logits: -scale ||q_i||^2 s_j^2 / (2 d_h).

    ``q`` (B, nh, L, d_h) the queries (detached: the correction is a constant for
    autograd), ``key_var`` (B, nh, L) the keys' per-coordinate variances s_j^2 ->
    (B, nh, L, L), to add to q_i . k_j / sqrt(d_h) before the softmax.
    """
    q = q.detach()
    q_sq = q.pow(2).sum(-1)  # (B, nh, L)
    return (-scale / (2 * q.shape[-1])) * q_sq.unsqueeze(-1) * key_var.to(q.dtype).unsqueeze(-2)
