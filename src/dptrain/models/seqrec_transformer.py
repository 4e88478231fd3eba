"""A SASRec-style Transformer for next-item prediction, with optional Re-Attention (DPFormer).

The model reads top to bottom::

    items (B, L) item ids, LEFT-padded, 0 = padding
      -> item_emb(items) (B, L, d) + pos_emb(arange(L)[None]) (1, L, d)   item + learned position
      -> dropout
      -> n_layer x Block                                  pre-LN (default):
             x = x + attn(ln_1(x))                             causal, padding-masked
             x = x + mlp(ln_2(x))                              Linear -> GELU -> Linear
      -> ln_f                                             final LayerNorm (pre-LN only)
      -> head (B, L, n_items + 1)                         scores over the whole catalogue

Shapes use B = batch size, L = sequence length, d = ``d_model``, nh = ``n_head``,
hs = d / nh (head size) and V = n_items + 1 (the catalogue plus the padding id 0).
The score at position t ranks the item that follows items[:, :t+1]; column 0
(padding) is set to the most negative finite number of the dtype so that it
is never predicted. Finite on purpose: with -inf, a target 0 that slipped past
``ignore_index`` would give an infinite loss, and inf * 0 (the loss mask) is
NaN; the finite minimum still loses every ranking, gets softmax probability
exactly 0, and so no gradient reaches column 0.

Parameters live only in ``nn.Linear``, ``nn.Embedding`` and ``nn.LayerNorm``
(the module types the clipping engine has per-example rules for), residuals
are written ``x = x + f(x)`` (never in place), and the position embedding is
looked up with ``arange(L)[None]`` of shape (1, L), as in :mod:`dptrain.models.gpt`.
With ``tie_embeddings=True`` the scoring layer's weight is the same Parameter
as the item embedding (phantom clipping in the engine); untied, it is a
separate matrix (the paper's "Transformer without parameter sharing").

Attention mask: query i sees key j iff j <= i (causal) and item j is not
padding. A padded query (left padding: everything before it is padding too)
would see no key at all and its softmax would be NaN, so the diagonal is
always allowed. Outputs at padded positions are meaningless and must be
ignored by the loss (targets 0 with ``ignore_index=0``).

Re-Attention (``re_attention=True``; DPFormer §5, ``docs/reattention.md``):
starting from the effective errors set by
:meth:`SeqRecTransformer.set_effective_errors`, the mean and the
per-coordinate DP-noise variance (one number per position) of every hidden
state are propagated analytically beside the forward pass, block by block
(the rules are in :mod:`dptrain.models.reattention`; each block's
``attn_input_moments`` / ``moments`` methods mirror its ``forward``). Each
block's key variances s_j^2 come from the moments of its attention input, and
``reattention_scale * ||q_i||^2 s_j^2 / (2 hs)`` is subtracted from the logit
of query i and key j. The bookkeeping runs under ``torch.no_grad()`` on
detached weights, so it creates no gradient path into any parameter (a path
the engine could not see would escape clipping); the correction is a constant
for autograd, ||q_i||^2 included (see the docs for why). With zero effective
errors (the default) the model computes exactly the vanilla model.

Attention is written out (q k^T, mask, softmax, dropout, @ v) rather than
calling ``F.scaled_dot_product_attention``: Re-Attention needs the attention
weights to propagate the variances, and both variants then share one code path.

Initialisation is GPT-2's (not SASRec's Xavier): Linear and Embedding weights
normal with std 0.02, the residual projections (``attn.c_proj``,
``mlp.c_proj``) std 0.02 / sqrt(2 n_layer), biases zero, LayerNorms identity,
the padding row of the item embedding zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dptrain.models import reattention as ra
from dptrain.models.reattention import Moments

__all__ = ["SeqRecConfig", "SeqRecTransformer"]


def _err(name: str, value: object, expected: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed: expected {expected}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SeqRecConfig:
    """Sizes and options of a :class:`SeqRecTransformer`; every field is checked on creation.

    Attributes:
        n_items: catalogue size; item ids are 1..n_items, 0 is padding.
        max_len: the longest input sequence (rows of the position embedding).
        d_model: width of the residual stream and of the embeddings.
        n_head: attention heads; must divide ``d_model``.
        n_layer: Transformer blocks.
        d_mlp: hidden width of each MLP; None means 4 * d_model (resolved on creation).
        dropout: probability in [0, 1) on embeddings, attention weights and branch outputs.
        pre_ln: pre-LayerNorm blocks and a final LayerNorm if True; post-LN blocks if False.
        tie_embeddings: whether the scoring layer's weight is the item embedding.
        re_attention: whether to de-bias the attention logits (DPFormer §5).
        reattention_scale: multiplier on the correction, >= 0; 1 is the paper's.
    """

    n_items: int
    max_len: int = 50
    d_model: int = 64
    n_head: int = 1
    n_layer: int = 2
    d_mlp: int | None = None
    dropout: float = 0.2
    pre_ln: bool = True
    tie_embeddings: bool = True
    re_attention: bool = False
    reattention_scale: float = 1.0

    def __post_init__(self) -> None:
        for name in ("n_items", "max_len", "d_model", "n_head", "n_layer"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise _err(name, value, "an integer >= 1")
        if self.d_model % self.n_head:
            raise _err("d_model", self.d_model, f"a multiple of n_head={self.n_head!r}")
        if self.d_mlp is None:
            self.d_mlp = 4 * self.d_model
        elif not _is_int(self.d_mlp) or self.d_mlp < 1:
            raise _err("d_mlp", self.d_mlp, "None or an integer >= 1")
        if not _is_real(self.dropout) or not 0 <= self.dropout < 1:
            raise _err("dropout", self.dropout, "a number in [0, 1)")
        for name in ("pre_ln", "tie_embeddings", "re_attention"):
            if not isinstance(getattr(self, name), bool):
                raise _err(name, getattr(self, name), "True or False")
        if not _is_real(self.reattention_scale) or self.reattention_scale < 0:
            raise _err("reattention_scale", self.reattention_scale, "a finite number >= 0")


class CausalSelfAttention(nn.Module):
    """Causal, padding-masked multi-head self-attention from two Linear layers."""

    def __init__(self, config: SeqRecConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model)  # q, k, v
        self.c_proj = nn.Linear(config.d_model, config.d_model)  # output
        self.attn_drop = nn.Dropout(config.dropout)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(
        self, x: Tensor, mask: Tensor, key_var: Tensor | None = None, scale: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        """(B, L, d) -> (B, L, d), and the attention weights as applied (B, nh, L, L).

        ``mask`` (B, 1, L, L) is 0 where a query may see a key and -inf elsewhere.
        With ``key_var`` (B, nh, L), the keys' noise variances s_j^2, the
        Re-Attention correction -scale ||q_i||^2 s_j^2 / (2 hs) is added to the logits.
        """
        B, L, d = x.shape
        nh, hs = self.n_head, d // self.n_head
        q, k, v = self.c_attn(x).split(d, dim=2)  # each (B, L, d)
        q = q.view(B, L, nh, hs).transpose(1, 2)  # (B, nh, L, hs)
        k = k.view(B, L, nh, hs).transpose(1, 2)  # (B, nh, L, hs)
        v = v.view(B, L, nh, hs).transpose(1, 2)  # (B, nh, L, hs)
        if key_var is not None:  # a constant (B, nh, L, L): no gradient path
            mask = mask + ra.reattention_bias(q, key_var, scale)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hs))  # (B, nh, L, L)
        att = F.softmax(att + mask, dim=-1)  # (B, nh, L, L); every row has its diagonal
        att = self.attn_drop(att)
        y = att @ v  # (B, nh, L, hs)
        y = y.transpose(1, 2).contiguous().view(B, L, d)  # (B, L, d): heads side by side
        return self.resid_drop(self.c_proj(y)), att  # (B, L, d)

    @torch.no_grad()
    def key_variance(self, x: Moments, w: Tensor | float) -> Tensor:
        """Keys' per-coordinate variances s^2 (B, nh, L) for an input with moments ``x``."""
        d = x.mean.shape[-1]
        w_k = self.c_attn.weight[d : 2 * d]
        s2 = ra.head_linear_variance(x, w_k, w, bias=True, n_head=self.n_head)  # (B, L, nh)
        return s2.transpose(1, 2)

    @torch.no_grad()
    def moments(self, x: Moments, att: Tensor, w: Tensor | float) -> Moments:
        """Moments of the branch output (B, L, d), (B, L) given those of its input."""
        d = x.mean.shape[-1]
        w_v, b_v = self.c_attn.weight[2 * d :], self.c_attn.bias[2 * d :]
        y = ra.attention_moments(att, x, w_v, b_v, w)  # (B, L, d), (B, L, nh)
        return ra.linear_moments(y, self.c_proj.weight, self.c_proj.bias, w)


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear -> GELU -> Linear."""

    def __init__(self, config: SeqRecConfig) -> None:
        super().__init__()
        assert config.d_mlp is not None  # resolved by SeqRecConfig
        self.c_fc = nn.Linear(config.d_model, config.d_mlp)
        self.gelu = nn.GELU()  # exact (erf) GELU, whose moments are closed form
        self.c_proj = nn.Linear(config.d_mlp, config.d_model)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        """(B, L, d) -> (B, L, d)."""
        h = self.gelu(self.c_fc(x))  # (B, L, d_mlp)
        return self.drop(self.c_proj(h))  # (B, L, d)

    @torch.no_grad()
    def moments(self, x: Moments, w: Tensor | float) -> Moments:
        """Moments of the output (B, L, d), (B, L) given those of the input."""
        h = ra.linear_moments(x, self.c_fc.weight, self.c_fc.bias, w)  # (B, L, d_mlp)
        h = ra.activation_moments(h, "gelu")
        return ra.linear_moments(h, self.c_proj.weight, self.c_proj.bias, w)


class Block(nn.Module):
    """One Transformer block: attention then MLP, each in a residual branch."""

    def __init__(self, config: SeqRecConfig) -> None:
        super().__init__()
        self.pre_ln = config.pre_ln
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config)

    def forward(
        self, x: Tensor, mask: Tensor, key_var: Tensor | None = None, scale: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        """(B, L, d) -> (B, L, d), and the attention weights (B, nh, L, L).

        Out-of-place updates only (the engine's hooks keep activations).
        """
        if self.pre_ln:  # normalise the input of each branch
            a, att = self.attn(self.ln_1(x), mask, key_var, scale)
            x = x + a
            x = x + self.mlp(self.ln_2(x))
        else:  # normalise after each residual sum
            a, att = self.attn(x, mask, key_var, scale)
            x = self.ln_1(x + a)
            x = self.ln_2(x + self.mlp(x))
        return x, att

    # -- Re-Attention: the same block on moments (no gradient) ---------------------------------

    @staticmethod
    def _ln(ln: nn.LayerNorm, x: Moments, w: Tensor | float) -> Moments:
        return ra.layer_norm_moments(x, ln.weight, ln.bias, ln.eps, w)

    @torch.no_grad()
    def attn_input_moments(self, x: Moments, w: Tensor | float) -> Moments:
        """Moments of the attention's input given those of the block's input."""
        return self._ln(self.ln_1, x, w) if self.pre_ln else x

    @torch.no_grad()
    def moments(self, x: Moments, h: Moments, att: Tensor, w: Tensor | float) -> Moments:
        """Moments of the block's output, from those of its input ``x``, of the attention's
        input ``h`` (:meth:`attn_input_moments`) and the applied attention weights."""
        a = self.attn.moments(h, att, w)
        if self.pre_ln:
            x = ra.residual_moments(x, a)
            return ra.residual_moments(x, self.mlp.moments(self._ln(self.ln_2, x, w), w))
        x = self._ln(self.ln_1, ra.residual_moments(x, a), w)
        return self._ln(self.ln_2, ra.residual_moments(x, self.mlp.moments(x, w)), w)


class SeqRecTransformer(nn.Module):
    """Next-item Transformer: ``forward(items (B, L)) -> scores (B, L, n_items + 1)``.

    See the module docstring for the architecture, the masking and Re-Attention.
    """

    def __init__(self, config: SeqRecConfig) -> None:
        super().__init__()
        self.config = config
        d, n_vocab = config.d_model, config.n_items + 1
        self.item_emb = nn.Embedding(n_vocab, d, padding_idx=0)
        self.pos_emb = nn.Embedding(config.max_len, d)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(d) if config.pre_ln else nn.Identity()
        self.head = nn.Linear(d, n_vocab, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.item_emb.weight  # one Parameter, two modules
        # Effective errors (DPFormer §5.2.1) as variances; buffers, never trained.
        self.register_buffer("item_error_var", torch.zeros(n_vocab))  # (V,) item rows
        self.register_buffer("param_error_var", torch.zeros(()))  # every other weight
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """GPT-2 initialisation (see the module docstring)."""
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)
        self.item_emb.weight[0].zero_()  # normal_ overwrote the padding row

    @torch.no_grad()
    def set_effective_errors(
        self,
        noise_multiplier: float,
        batch_size: float,
        item_frequencies: Tensor,
        *,
        min_frequency: float | None = None,
    ) -> None:
        """Set the effective errors Re-Attention starts from (DPFormer §5.2.1, C = 1).

        Every weight in the blocks and the position embedding gets noise std
        sigma / B; the embedding row of item v gets sigma / (B f_v), f_v =
        ``item_frequencies[v]`` the share of training records that contain v
        (index 0, padding, is ignored; its row gets 0). A frequency of 0 would
        give an infinite error, so frequencies are floored at ``min_frequency``,
        by default the smallest positive frequency given (an unseen item counts
        as the rarest seen one; with N training records that is >= 1/N). Stored
        as variances in the buffers ``param_error_var`` and ``item_error_var``.
        ``noise_multiplier=0`` gives zero errors: the vanilla model exactly.
        """
        if not _is_real(noise_multiplier) or noise_multiplier < 0:
            raise _err("noise_multiplier", noise_multiplier, "a finite number >= 0")
        if not _is_real(batch_size) or batch_size <= 0:
            raise _err("batch_size", batch_size, "a finite number > 0")
        n_vocab = self.config.n_items + 1
        f = torch.as_tensor(item_frequencies).detach()
        if f.shape != (n_vocab,) or f.is_complex() or f.dtype == torch.bool:
            raise ValueError(
                f"item_frequencies has shape {tuple(f.shape)} and dtype {f.dtype}: expected "
                f"real numbers of shape (n_items + 1,) = ({n_vocab},), index 0 for padding"
            )
        f = f.to(torch.float64)[1:]
        if not torch.isfinite(f).all() or (f < 0).any() or (f > 1).any():
            raise ValueError("item_frequencies must be shares in [0, 1]")
        sigma_b = float(noise_multiplier) / float(batch_size)
        item_std = torch.zeros(n_vocab, dtype=torch.float64)
        if sigma_b > 0:
            if min_frequency is None:
                positive = f[f > 0]
                if positive.numel() == 0:
                    raise ValueError("item_frequencies are all 0: give min_frequency")
                min_frequency = float(positive.min())
            elif not _is_real(min_frequency) or not 0 < min_frequency <= 1:
                raise _err("min_frequency", min_frequency, "None or a number in (0, 1]")
            item_std[1:] = sigma_b / f.clamp_min(min_frequency)
        self.item_error_var.copy_(item_std.pow(2))
        self.param_error_var.fill_(sigma_b**2)

    def attention_mask(self, items: Tensor, dtype: torch.dtype) -> Tensor:
        """(B, 1, L, L) additive mask: 0 where query i may see key j (j <= i and item j
        not padding, or j == i), -inf elsewhere."""
        L = items.shape[1]
        causal = torch.ones(L, L, dtype=torch.bool, device=items.device).tril()  # (L, L)
        allowed = causal & (items != 0).unsqueeze(1)  # (B, L, L): key j is an item
        allowed = allowed | torch.eye(L, dtype=torch.bool, device=items.device)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=items.device)
        return mask.masked_fill(~allowed, float("-inf")).unsqueeze(1)  # (B, 1, L, L)

    def _trunk(self, items: Tensor, key_vars: list[Tensor] | None = None) -> Tensor:
        """items (B, L) -> final hidden states (B, L, d); fills ``key_vars`` if given."""
        if items.dim() != 2:
            raise ValueError(
                f"items has shape {tuple(items.shape)}: expected (batch, seq_len), two dimensions"
            )
        n = items.shape[1]  # L
        if n > self.config.max_len:
            raise ValueError(f"sequence length L={n} exceeds max_len={self.config.max_len}")
        pos = torch.arange(n, device=items.device).unsqueeze(0)  # (1, L): shared by the batch
        x = self.drop(self.item_emb(items) + self.pos_emb(pos))  # (B, L, d)
        mask = self.attention_mask(items, x.dtype)  # (B, 1, L, L)
        track = self.config.re_attention or key_vars is not None
        # The moments are bookkeeping, kept in float32 at least and out of autocast.
        exact = torch.autocast(x.device.type, enabled=False)
        if track:  # moments of x under the DP noise: mean (B, L, d), variance (B, L)
            w = self.param_error_var.to(torch.promote_types(x.dtype, torch.float32))
            with exact:
                s = ra.embedding_moments(
                    items, self.item_emb.weight, self.pos_emb.weight, self.item_error_var, w
                )
        scale = float(self.config.reattention_scale)
        last = len(self.blocks) - 1
        for i, block in enumerate(self.blocks):
            key_var = None
            if track:
                with exact:
                    h = block.attn_input_moments(s, w)
                    key_var = block.attn.key_variance(h, w)  # (B, nh, L)
                if key_vars is not None:
                    key_vars.append(key_var)
            x, att = block(x, mask, key_var if self.config.re_attention else None, scale)
            if track and i < last:  # the last block's output moments are never needed
                with exact:
                    s = block.moments(s, h, att, w)
        return self.ln_f(x)  # (B, L, d)

    def _scores(self, h: Tensor) -> Tensor:
        """(..., d) -> (..., n_items + 1) with the padding column at the finite minimum."""
        scores = self.head(h)
        pad = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
        pad[0] = True
        return scores.masked_fill(pad, torch.finfo(scores.dtype).min)

    def forward(self, items: Tensor) -> Tensor:
        """Item ids (B, L), left-padded with 0 -> scores (B, L, n_items + 1).

        Train through this method (the clipping engine's hooks read the batch
        size from its argument).
        """
        return self._scores(self._trunk(items))

    def hidden(self, items: Tensor) -> Tensor:
        """Final hidden states (B, L, d), before the scoring layer."""
        return self._trunk(items)

    def last_scores(self, items: Tensor) -> Tensor:
        """Scores (B, n_items + 1) at the last position, for evaluation (use under no_grad)."""
        return self._scores(self._trunk(items)[:, -1])

    @torch.no_grad()
    def key_variances(self, items: Tensor) -> list[Tensor]:
        """The tracked per-coordinate key variances s^2, one (B, nh, L) per block.

        Computed whether or not ``re_attention`` is on (a vanilla model is then
        left uncorrected but can be inspected).
        """
        out: list[Tensor] = []
        self._trunk(items, out)
        return out
