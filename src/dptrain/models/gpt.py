"""A GPT-2-like causal language model: the reference model of the DP engine.

The model follows GPT-2 (and Karpathy's nanoGPT) and reads top to bottom::

    idx (B, T) token ids
      -> wte(idx) (B, T, d) + wpe(arange(T)[None]) (1, T, d)   token + learned positions
      -> dropout
      -> n_layer x Block:                              pre-LN (default):
             x = x + attn(ln_1(x))                         causal self-attention
             x = x + mlp(ln_2(x))                          Linear -> GELU -> Linear
      -> ln_f                                          final LayerNorm
      -> lm_head (B, T, vocab_size)                    logits; no loss inside the model

Shapes use B = batch size, T = sequence length, d = ``d_model``, nh = ``n_head``
and hs = d / nh (head size).

Why only Linear, Embedding and LayerNorm hold parameters
--------------------------------------------------------
DP-SGD clips each example's gradient, and the engine gets per-example gradient
norms (ghost clipping, book-keeping) from per-module rules that exist only for
``nn.Linear``, ``nn.Embedding`` and ``nn.LayerNorm`` (and RMSNorm). A parameter
held anywhere else would have no rule and could not be clipped. So:

- attention projects q, k, v with one ``nn.Linear(d, 3d)`` and the output with
  ``nn.Linear(d, d)``; the attention itself is
  ``F.scaled_dot_product_attention(..., is_causal=True)``, which has no
  parameters (no ``nn.MultiheadAttention``, whose weights are raw parameters);
- the MLP is ``nn.Linear(d, d_mlp) -> GELU -> nn.Linear(d_mlp, d)``;
- there is no raw ``nn.Parameter`` anywhere.

The residual stream is written ``x = x + f(x)``, never ``x += f(x)``: an
in-place update of a module's output would corrupt the activations that
backward hooks keep for the per-example rules.

Two details matter for per-example gradients:

- the position embedding is looked up with ``torch.arange(T)[None]`` of shape
  (1, T), and its (1, T, d) output is broadcast over the batch, as Hugging Face
  GPT-2 does (nanoGPT looks up a 1-D (T,) arange, which works as well). The
  clipping engine leaves that output as it is and reads each example's
  gradient with respect to the positions where it is added to the (B, T, d)
  token embeddings (row i of that sum is example i's; see
  :mod:`dptrain.clipping.shared_table`);
- with ``tie_embeddings=True``, ``lm_head.weight`` is the same ``Parameter``
  object as ``wte.weight``, so that one matrix receives gradients from both an
  Embedding and a Linear (the case phantom clipping handles).

Initialisation is GPT-2's: weights of Linear and Embedding layers are normal
with std 0.02, the two residual projections of each block (``attn.c_proj`` and
``mlp.c_proj``) use std 0.02 / sqrt(2 * n_layer), biases are zero and
LayerNorms start as the identity (weight 1, bias 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig"]


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is not allowed: expected an integer >= {minimum}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not allowed: expected True or False")


@dataclass
class GPTConfig:
    """Sizes and options of a :class:`GPT` model; every field is checked on creation.

    Attributes:
        vocab_size: number of token ids (logits per position).
        max_seq_len: the longest sequence the position embedding covers.
        n_layer: number of Transformer blocks.
        n_head: number of attention heads; must divide ``d_model``.
        d_model: width of the residual stream (embedding size).
        d_mlp: hidden width of each block's MLP.
        dropout: dropout probability in [0, 1) on embeddings, attention weights,
            and the outputs of the attention and the MLP (training mode only).
        bias: whether Linear and LayerNorm layers have biases (``lm_head`` never has one).
        tie_embeddings: whether ``lm_head.weight`` is ``wte.weight`` (the same Parameter).
        pre_ln: pre-LayerNorm blocks (GPT-2) if True, post-LayerNorm
            (original Transformer) if False.
        padding_idx: a token id whose embedding row is zero and gets no gradient
            through ``wte`` (see ``nn.Embedding``), or None.
    """

    vocab_size: int = 8000
    max_seq_len: int = 512
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 256
    d_mlp: int = 1024
    dropout: float = 0.0
    bias: bool = True
    tie_embeddings: bool = False
    pre_ln: bool = True
    padding_idx: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_seq_len", "n_layer", "n_head", "d_model", "d_mlp"):
            _check_int(name, getattr(self, name), 1)
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"d_model={self.d_model!r} is not allowed: expected a multiple of "
                f"n_head={self.n_head!r}"
            )
        d = self.dropout
        if isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d < 1:
            raise ValueError(f"dropout={d!r} is not allowed: expected a number in [0, 1)")
        for name in ("bias", "tie_embeddings", "pre_ln"):
            _check_bool(name, getattr(self, name))
        p = self.padding_idx
        if p is not None and (
            isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.vocab_size
        ):
            raise ValueError(
                f"padding_idx={p!r} is not allowed: expected None or an integer in "
                f"[0, vocab_size={self.vocab_size})"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention from two Linear layers and SDPA."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.d_model = config.d_model
        self.dropout = float(config.dropout)
        self.c_attn = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)  # output
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, d); position t attends to positions <= t only."""
        B, T, d = x.shape
        nh, hs = self.n_head, d // self.n_head
        q, k, v = self.c_attn(x).split(d, dim=2)  # each (B, T, d)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, d)  # (B, T, d): heads side by side
        return self.resid_drop(self.c_proj(y))  # (B, T, d)


class MLP(nn.Module):
    """Position-wise feed-forward network: Linear -> GELU -> Linear."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.d_model, config.d_mlp, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's GELU
        self.c_proj = nn.Linear(config.d_mlp, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, d)."""
        h = self.gelu(self.c_fc(x))  # (B, T, d_mlp)
        return self.drop(self.c_proj(h))  # (B, T, d)


class Block(nn.Module):
    """One Transformer block: attention then MLP, each in a residual branch."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.pre_ln = config.pre_ln
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d) -> (B, T, d). Out-of-place updates only (see the module docstring)."""
        if self.pre_ln:  # GPT-2: normalise the input of each branch
            x = x + self.attn(self.ln_1(x))
            x = x + self.mlp(self.ln_2(x))
        else:  # original Transformer: normalise after each residual sum
            x = self.ln_1(x + self.attn(x))
            x = self.ln_2(x + self.mlp(x))
        return x


class GPT(nn.Module):
    """GPT-2-like causal language model: ``forward(idx (B, T)) -> logits (B, T, vocab_size)``.

    Every parameter lives in an ``nn.Linear``, ``nn.Embedding`` or ``nn.LayerNorm``
    (see the module docstring). ``ln_f`` is kept in the post-LN variant as well,
    so that both variants have the same parameter names.
    """

    def __init__(self, config: GPTConfig | None = None) -> None:
        super().__init__()
        config = GPTConfig() if config is None else config
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.padding_idx)
        self.wpe = nn.Embedding(config.max_seq_len, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, bias=config.bias)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # one Parameter, two modules
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        """GPT-2 initialisation (see the module docstring)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)
        if self.config.padding_idx is not None:  # normal_ overwrote the zero row
            self.wte.weight[self.config.padding_idx].zero_()

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of trainable scalars, a tied matrix counted once.

        With ``exclude_embeddings=True`` the token and position tables
        (``wte``, ``wpe``) are left out; a tied ``lm_head.weight`` is then left
        out too, since it is ``wte.weight``.
        """
        skip = {id(self.wte.weight), id(self.wpe.weight)} if exclude_embeddings else set()
        # model.parameters() yields a shared Parameter once.
        return sum(p.numel() for p in self.parameters() if id(p) not in skip)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``idx`` (B, T) -> logits (B, T, vocab_size); T <= max_seq_len."""
        if idx.dim() != 2:
            raise ValueError(
                f"idx has shape {tuple(idx.shape)}: expected (batch, seq_len), two dimensions"
            )
        t = idx.size(1)  # T
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length T={t} exceeds max_seq_len={self.config.max_seq_len}")
        pos = torch.arange(t, device=idx.device).unsqueeze(0)  # (1, T): shared by the batch
        tok_emb = self.wte(idx)  # (B, T, d)
        pos_emb = self.wpe(pos)  # (1, T, d), broadcast over B
        x = self.drop(tok_emb + pos_emb)  # (B, T, d)
        for block in self.blocks:
            x = block(x)  # (B, T, d)
        x = self.ln_f(x)  # (B, T, d)
        return self.lm_head(x)  # (B, T, vocab_size)
