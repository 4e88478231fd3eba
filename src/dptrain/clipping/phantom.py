"""Phantom clipping: the exact per-example norm of a tied input/output embedding.

DPFormer (§4) ties the item embedding E (V x d) between the input lookup and
the output scores s = H E^T. Per example (DESIGN.md):

    grad_E = X^T G_in + G_out^T H
    ||grad_E||^2 = ||X^T G_in||^2 + ||G_out^T H||^2 + 2 <X^T G_in, G_out^T H>

The first two terms are the embedding's and the output layer's own ghost
norms; adding only those two is wrong. The cross term is

    <X^T G_in, G_out^T H> = sum_{t,s} G_out[s, x_t] <G_in,t, H_s>,

computed here in O(T T' d) per example without forming any V x d matrix.
"""

from __future__ import annotations

from torch import Tensor

from dptrain.clipping.tensor_cores import bmm_f32

__all__ = ["phantom_cross_term"]


def phantom_cross_term(x: Tensor, g_in: Tensor, h: Tensor, g_out: Tensor) -> Tensor:
    """Per-example <X^T G_in, G_out^T H>, shape (B,).

    Args:
        x: token ids of the input lookup, (B, T).
        g_in: gradient w.r.t. the looked-up rows, (B, T, d) (padding rows zeroed).
        h: input of the output layer, (B, T', d).
        g_out: gradient w.r.t. the scores, (B, T', V).
    """
    t_out = h.shape[1]
    # float32 products of bf16 records (tensor_cores.py); G_out's picked entries upcast
    inner = bmm_f32(g_in, h.transpose(1, 2))  # (B, T, T'): <G_in,t, H_s>
    picked = g_out.gather(2, x.unsqueeze(1).expand(-1, t_out, -1))  # (B, T', T): G_out[s, x_t]
    return (inner * picked.transpose(1, 2).to(inner.dtype)).sum((1, 2))
