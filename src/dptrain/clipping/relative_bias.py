"""T5's relative-position bias: a table shared by all examples, clipped per example.

T5 (and mT5) learn one (buckets, heads) table in the first self-attention layer
of each stack. ``T5Attention.compute_bias`` looks it up with the bucket ids of
every (query, key) pair, (T_q, T_k), and returns a bias of shape
(1, heads, T_q, T_k) that the stack hands to every later layer; each layer adds
it to all examples' attention scores. Nothing recorded in that computation has
an example dimension: the gradient reaching the table is already summed over
the batch (inside the attention kernel for SDPA), and the bucket ids (T_q, T_k)
would be read as T_q examples' rows if T_q happened to equal the batch size.

The rule therefore gives the bias an example dimension before the layer runs.
A forward pre-hook on the attention module computes the bias with the module's
own ``compute_bias`` and passes it on expanded to the batch,

    X = bias[0].permute(1, 2, 0) expanded to (B, T_q, T_k, heads)   (recorded)
    position_bias = X.permute(0, 3, 1, 2)                           (B, heads, T_q, T_k)

so every use by every layer reaches example i's copy X[i]. The gradient of
sum_j L_j with respect to X is then, row by row, each example's own (the
engine's rows check verifies it), and the table's per-example gradient is an
embedding gradient with the ids (T_q, T_k) shared by all rows:

    grad_i[k, h] = sum_{(q, s): bucket(q, s) = k} dL_i / dX[i, q, s, h].

It is a (buckets, heads) matrix per example, so it is instantiated (a ghost
norm would compare (T_q T_k)^2 pairs). The expansion is a view: the forward
computes what T5 computes, the attention's bias input is a stride-0 broadcast.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from dptrain.clipping.rules import RULES_BY_NAME, EmbeddingRule

__all__ = ["T5RelativeBiasRule"]

_TABLE = "relative_attention_bias"


@dataclass
class _Expanded:
    """What the pre-hook built for one call: the bias as passed on, its recorded
    example-first view and the bucket ids of its lookup."""

    position_bias: Tensor  # (B, heads, T_q, T_k)
    per_example: Tensor  # (B, T_q, T_k, heads)
    ids: Tensor  # (T_q, T_k)


class T5RelativeBiasRule(EmbeddingRule):
    """The ``relative_attention_bias`` table of a T5-style attention layer."""

    param_names = (f"{_TABLE}.weight",)
    norm_choice = "instantiate"

    def __init__(self) -> None:
        # The last call's expansion per attention module (one entry each, replaced by the
        # next forward), read by the engine's forward hook for that same call.
        self._last: weakref.WeakKeyDictionary[nn.Module, _Expanded] = weakref.WeakKeyDictionary()

    def claimed_modules(self, module: nn.Module) -> list[nn.Module]:
        table = getattr(module, _TABLE, None)
        return [table] if isinstance(table, nn.Module) else []

    def check(self, module: nn.Module) -> str | None:
        table = getattr(module, _TABLE, None)
        if not getattr(module, "has_relative_attention_bias", False) or not isinstance(
            table, nn.Embedding
        ):
            return "the rule reads a relative_attention_bias nn.Embedding, which it has not"
        return super().check(table)

    # -- the forward: give the bias an example dimension ---------------------------------

    def forward_pre_hook(self, module: nn.Module, args: tuple, kwargs: dict):
        """Compute the bias as the module would and pass it on expanded to the batch."""
        if not torch.is_grad_enabled() or kwargs.get("position_bias") is not None:
            return None  # generation or evaluation, or a bias passed in by the caller
        if kwargs.get("key_value_states") is not None:
            return None  # cross-attention: T5 gives it no relative bias
        hidden = args[0] if args else kwargs["hidden_states"]
        b, t_q = hidden.shape[0], hidden.shape[1]  # T5Attention: (batch, seq_length, dim)
        cache = kwargs.get("past_key_values")
        past = cache.get_seq_length(module.layer_idx) if cache is not None else 0
        seen: list[Tensor] = []
        handle = getattr(module, _TABLE).register_forward_hook(
            lambda _m, inputs, _out: seen.append(inputs[0])
        )
        try:
            bias = module.compute_bias(t_q, past + t_q, device=hidden.device, past_seen_tokens=past)
        finally:
            handle.remove()
        x = bias[0].permute(1, 2, 0).unsqueeze(0).expand(b, -1, -1, -1)  # (B, T_q, T_k, H)
        position_bias = x.permute(0, 3, 1, 2)  # (B, H, T_q, T_k)
        self._last[module] = _Expanded(position_bias, x, seen[0])
        return args, {**kwargs, "position_bias": position_bias}

    def output_of(self, module: nn.Module, output: object) -> Tensor | None:
        last = self._last.get(module)
        if last is None or not isinstance(output, tuple) or output[1] is not last.position_bias:
            return None
        return last.per_example

    def recorded_input(self, module: nn.Module, inputs: list[Tensor]) -> Tensor | None:
        last = self._last.pop(module)
        return last.ids.unsqueeze(0).expand(last.per_example.shape[0], -1, -1)  # (B, T_q, T_k)

    # -- the embedding algebra on the table ---------------------------------------------

    def per_example(self, module, a, g):
        out = super().per_example(getattr(module, _TABLE), a, g)
        return {self.param_names[0]: out["weight"]} if out else {}

    def clipped_sum(self, module, a, g, factors):
        out = super().clipped_sum(getattr(module, _TABLE), a, g, factors)
        return {self.param_names[0]: out["weight"]} if out else {}

    def accumulation_bound(self, module, a, g, weights):
        # ids expanded over the batch count each lookup once per example: more terms than
        # autograd's one lookup adds after summing the batch, so the bound still holds
        out = super().accumulation_bound(getattr(module, _TABLE), a, g, weights)
        return {self.param_names[0]: out["weight"]} if out else {}


RULES_BY_NAME.update(
    {
        f"transformers.models.{fam}.modeling_{fam}.{cls}Attention": T5RelativeBiasRule()
        for fam, cls in [("t5", "T5"), ("mt5", "MT5")]
    }
)
