"""Per-example clipping rules for convolutions (``nn.Conv1d/2d/3d``) and ``nn.GroupNorm``.

Registered for the exact types by importing this module (``dptrain.clipping`` does).

How the engine passes (a, g) to them (``raw_layout``)
----------------------------------------------------
Both rules set the class attribute ``raw_layout = True``. For such a rule the
engine must NOT reshape the output gradient to ``(B, T, -1)`` (a conv output is
channels-first, so that reshape would mix channels and positions). Precisely:

- ``prepare(module, a)`` returns ``a`` unchanged;
- ``per_example`` / ``norms_sq`` / ``clipped_sum`` / ``ghost_is_cheaper`` receive
  ``a`` = the module's raw input ``(B, C_in, *spatial_in)`` and ``g`` = the raw
  gradient of ``sum_i L_i`` w.r.t. the module's output, in the output's own shape
  ``(B, C_out, *spatial_out)``, with dim 0 = the B examples (the engine refuses
  unbatched inputs; the ``(b * k, ...)`` block layout is not supported either);
- the methods check the shapes and raise ``ValueError`` on a ``g`` that does not
  have the output's shape (e.g. one reshaped to ``(B, T, -1)`` by an engine that
  ignores ``raw_layout``).

Several calls of one module: per-example gradients add up over calls, but their
norms do not, so the calls cannot be handled one by one for norms. Instead:
``A_c, G_c = rule.unfold(module, a_c, g_c)`` per call, each ``(B, L_c, d_in)``,
``(B, L_c, d_out)``; concatenate along dim 1 (positions, like tokens of a
Linear; the spatial sizes of the calls may differ); then call
``per_example_unfolded`` / ``norms_sq_unfolded(ghost)`` / ``clipped_sum_unfolded``
/ ``ghost_is_cheaper_unfolded`` on ``(A, G)``. For a single call either path is
exact; the raw ``ConvRule.clipped_sum`` is cheaper (the conv's own weight backward on
scaled inputs, no unfold; except float32 on CUDA, see there).

Handling several calls one at a time with the raw methods is exact for
``per_example`` and ``clipped_sum`` (sum the results over calls) but NOT for
``norms_sq`` (||sum_c grad_c||^2 != sum_c ||grad_c||^2). So the engine keeps a
single call raw, never concatenates raw records along dim 1 (channels), unfolds
and concatenates several calls and reads them through :meth:`RawLayoutRule.unfolded_view`,
and refuses the ``(b * k, ...)`` block layout for these rules.

Conv math: after padding (any ``padding_mode``, and ``'same'``'s asymmetric
padding, are applied with ``F.pad``: a fixed linear map of each example's input,
so every mode is exact), the input is unfolded to A ``(B, L, groups * d_in_g)``
with ``d_in_g = C_in/groups * prod(kernel)`` (group-major, matching the weight's
``(C_out, C_in/groups, *kernel)`` layout) and g to G ``(B, L, C_out)``; per group
the weight's per-example gradient is ``G_gi^T A_gi``, a Linear over L positions,
so the ghost norm ``<A A^T, G G^T>`` (summed over groups) or instantiation apply.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dptrain.clipping.rules import RULES, LayerRule, _gram_inner, is_trainable, weighted_sum

__all__ = ["ConvRule", "GroupNormRule", "RawLayoutRule"]

#: padding_mode -> F.pad's mode.
_PAD_MODES = {
    "zeros": "constant",
    "reflect": "reflect",
    "replicate": "replicate",
    "circular": "circular",
}
#: Number of spatial dims -> the weight gradient of that convolution (ATen's backward).
_WEIGHT_GRAD = {
    1: torch.nn.grad.conv1d_weight,
    2: torch.nn.grad.conv2d_weight,
    3: torch.nn.grad.conv3d_weight,
}


def _scale_rows(x: Tensor, factors: Tensor) -> Tensor:
    """x[i] * factors[i] for x (B, ...), B = 0 included (as rules._scale_rows: a 2-D product)."""
    flat = x.reshape(x.shape[0], math.prod(x.shape[1:]))
    return (flat * factors.to(x.dtype)[:, None]).view(x.shape)


class RawLayoutRule(LayerRule):
    """A rule that takes (a, g) in the module's own layouts (see the module docstring).

    Subclasses give :meth:`unfold` and the ``*_unfolded`` methods; the raw
    methods unfold and delegate.
    """

    raw_layout = True

    def prepare(self, module, a):
        return a

    def unfold(self, module: nn.Module, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
        """(A (B, L, d_in), G (B, L, d_out)): one call in a form that concatenates along dim 1."""
        raise NotImplementedError

    def per_example_unfolded(self, module: nn.Module, A: Tensor, G: Tensor) -> dict[str, Tensor]:
        raise NotImplementedError

    def norms_sq_unfolded(
        self, module: nn.Module, A: Tensor, G: Tensor, ghost: bool
    ) -> dict[str, Tensor]:
        """Default: instantiate."""
        return {
            k: v.flatten(1).pow(2).sum(1)
            for k, v in self.per_example_unfolded(module, A, G).items()
        }

    def clipped_sum_unfolded(
        self, module: nn.Module, A: Tensor, G: Tensor, factors: Tensor
    ) -> dict[str, Tensor]:
        """Default: from the per-example gradients."""
        return weighted_sum(self.per_example_unfolded(module, A, G), factors)

    def ghost_is_cheaper_unfolded(self, module: nn.Module, A: Tensor, G: Tensor) -> bool:
        return self.norm_choice == "ghost"

    def unfolded_view(self) -> LayerRule:
        """This rule reading already unfolded (A, G) records (several calls concatenated)."""
        return _Unfolded(self)

    def per_example(self, module, a, g):
        return self.per_example_unfolded(module, *self.unfold(module, a, g))

    def norms_sq(self, module, a, g, ghost):
        return self.norms_sq_unfolded(module, *self.unfold(module, a, g), ghost)

    def clipped_sum(self, module, a, g, factors):
        return self.clipped_sum_unfolded(module, *self.unfold(module, a, g), factors)

    def ghost_is_cheaper(self, module, a, g):
        return self.ghost_is_cheaper_unfolded(module, *self.unfold(module, a, g))


class _Unfolded(LayerRule):
    """A raw-layout rule's ``*_unfolded`` methods under the ordinary rule signature."""

    def __init__(self, rule: RawLayoutRule):
        self.rule = rule
        self.param_names = rule.param_names
        self.norm_choice = rule.norm_choice
        self.float32_inside = rule.float32_inside

    def per_example(self, module, a, g):
        return self.rule.per_example_unfolded(module, a, g)

    def norms_sq(self, module, a, g, ghost):
        return self.rule.norms_sq_unfolded(module, a, g, ghost)

    def clipped_sum(self, module, a, g, factors):
        return self.rule.clipped_sum_unfolded(module, a, g, factors)

    def ghost_is_cheaper(self, module, a, g):
        return self.rule.ghost_is_cheaper_unfolded(module, a, g)


class ConvRule(RawLayoutRule):
    """``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d``: any stride, padding (int, tuple,
    ``'same'``, ``'valid'``; every ``padding_mode``), dilation, groups, bias or none."""

    norm_choice = "either"

    def check(self, module):
        if not isinstance(module, nn.modules.conv._ConvNd) or module.transposed:
            return "not a (non-transposed) convolution"
        if module.padding_mode not in _PAD_MODES:
            return f"padding_mode={module.padding_mode!r} is not supported"
        if isinstance(module.padding, str) and module.padding not in ("same", "valid"):
            return f"padding={module.padding!r} is not supported"
        if len(module.kernel_size) not in _WEIGHT_GRAD:
            return f"{len(module.kernel_size)}-d convolutions are not supported"
        return None

    # -- geometry -------------------------------------------------------------------

    @staticmethod
    def _pads(module: nn.Module) -> list[int]:
        """F.pad's argument (last spatial dim first) equivalent to the module's padding."""
        n = len(module.kernel_size)
        pads = [0] * (2 * n)
        for i in range(n):
            j = n - 1 - i  # F.pad lists the last dimension first
            if module.padding == "same":
                total = module.dilation[i] * (module.kernel_size[i] - 1)
                pads[2 * j], pads[2 * j + 1] = total // 2, total - total // 2
            elif module.padding != "valid":
                pads[2 * j] = pads[2 * j + 1] = module.padding[i]
        return pads

    def _padded(self, module: nn.Module, a: Tensor) -> Tensor:
        pads = self._pads(module)
        if not any(pads):
            return a
        mode = _PAD_MODES[module.padding_mode]
        if mode == "constant" or a.shape[0] == 0:  # (no examples: only the shape matters)
            return F.pad(a, pads)
        return F.pad(a, pads, mode=mode)

    def _zero_padding(self, module: nn.Module) -> tuple[int, ...] | None:
        """The conv's own (symmetric, zero) padding where it can be passed to the
        convolution instead of padding the input; None otherwise."""
        if module.padding_mode != "zeros":
            return None
        if module.padding == "valid":
            return (0,) * len(module.kernel_size)
        if module.padding == "same":
            pads = self._pads(module)
            return tuple(pads[0::2])[::-1] if pads[0::2] == pads[1::2] else None
        return tuple(module.padding)

    def _out_spatial(self, module: nn.Module, a: Tensor) -> tuple[int, ...]:
        pads = self._pads(module)
        n = len(module.kernel_size)
        out = []
        for i in range(n):
            j = n - 1 - i
            size = a.shape[2 + i] + pads[2 * j] + pads[2 * j + 1]
            span = module.dilation[i] * (module.kernel_size[i] - 1) + 1
            out.append((size - span) // module.stride[i] + 1)
        return tuple(out)

    def _check_shapes(self, module: nn.Module, a: Tensor, g: Tensor) -> None:
        n = len(module.kernel_size)
        want = (a.shape[0], module.out_channels, *self._out_spatial(module, a))
        if a.dim() != n + 2 or a.shape[1] != module.in_channels or tuple(g.shape) != want:
            raise ValueError(
                f"ConvRule (raw_layout) needs a = the raw input (B, {module.in_channels}, "
                f"*spatial) and g = the raw output gradient {want}; got a {tuple(a.shape)}, "
                f"g {tuple(g.shape)}"
            )

    def _dims(self, module: nn.Module) -> tuple[int, int, int]:
        """(groups, d_in per group, d_out per group)."""
        groups = module.groups
        d_in = module.in_channels // groups * math.prod(module.kernel_size)
        return groups, d_in, module.out_channels // groups

    # -- unfolded form --------------------------------------------------------------

    def unfold(self, module, a, g):
        """A (B, L, groups * d_in_g), G (B, L, C_out), L = prod(spatial_out)."""
        self._check_shapes(module, a, g)
        b, n = a.shape[0], len(module.kernel_size)
        x = self._padded(module, a)
        for i in range(n):
            span = module.dilation[i] * (module.kernel_size[i] - 1) + 1
            x = x.unfold(2 + i, span, module.stride[i])  # appends a window dim
        x = x[(..., *[slice(None, None, d) for d in module.dilation])]
        # (B, C, *L, *k) -> (B, *L, C, *k)
        perm = [0, *range(2, 2 + n), 1, *range(2 + n, 2 + 2 * n)]
        t = math.prod(g.shape[2:])  # (explicit sizes: B may be 0)
        A = x.permute(perm).reshape(b, t, module.in_channels * math.prod(module.kernel_size))
        G = g.flatten(2).transpose(1, 2)
        return A, G

    def _by_group(self, module: nn.Module, A: Tensor, G: Tensor) -> tuple[Tensor, Tensor]:
        """(B, groups, L, d_in_g), (B, groups, L, d_out_g)."""
        groups, d_in, d_out = self._dims(module)
        b, t = A.shape[:2]
        A = A.reshape(b, t, groups, d_in).transpose(1, 2)
        G = G.reshape(b, t, groups, d_out).transpose(1, 2)
        return A, G

    def ghost_is_cheaper_unfolded(self, module, A, G):
        """Per group, as LinearRule: ghost norm when 2 L^2 < d_in_g d_out_g."""
        _, d_in, d_out = self._dims(module)
        t = A.shape[1]
        return 2 * t * t < d_in * d_out

    def per_example_unfolded(self, module, A, G):
        out = {}
        if is_trainable(module.weight):
            Ag, Gg = self._by_group(module, A, G)
            w = torch.einsum("bgto,bgti->bgoi", Gg, Ag)
            out["weight"] = w.reshape(A.shape[0], *module.weight.shape)
        if is_trainable(module.bias):
            out["bias"] = G.sum(1)
        return out

    def norms_sq_unfolded(self, module, A, G, ghost):
        if not ghost:
            return super().norms_sq_unfolded(module, A, G, ghost)
        out = {}
        if is_trainable(module.weight):
            b = A.shape[0]
            if module.groups == 1:
                out["weight"] = _gram_inner(A, G)
            else:
                Ag, Gg = self._by_group(module, A, G)
                inner = _gram_inner(Ag.flatten(0, 1), Gg.flatten(0, 1))
                out["weight"] = inner.reshape(b, module.groups).sum(1)
        if is_trainable(module.bias):
            out["bias"] = G.sum(1).pow(2).sum(1)
        return out

    def clipped_sum_unfolded(self, module, A, G, factors):
        out = {}
        if is_trainable(module.weight):
            Ag, Gg = self._by_group(module, A, G)  # scale the narrower operand
            if Ag.shape[-1] <= Gg.shape[-1]:
                Ag = _scale_rows(Ag, factors)
            else:
                Gg = _scale_rows(Gg, factors)
            w = torch.einsum("bgto,bgti->goi", Gg, Ag)
            out["weight"] = w.reshape(module.weight.shape)
        if is_trainable(module.bias):
            out["bias"] = torch.einsum("b,bp->p", factors.to(G.dtype), G.sum(1))
        return out

    # -- raw form (a single call) ---------------------------------------------------

    def ghost_is_cheaper(self, module, a, g):
        self._check_shapes(module, a, g)
        _, d_in, d_out = self._dims(module)
        t = math.prod(g.shape[2:])
        return 2 * t * t < d_in * d_out

    def clipped_sum(self, module, a, g, factors):
        """sum_i c_i grad_i as the conv's weight gradient for the output gradient c_i g_i
        (or for the input c_i a_i, whichever is smaller): no unfold.

        Not for float32 on CUDA, where cuDNN may use TF32 (by default for convolutions,
        ~1e-3 relative error, which would let a clipped contribution exceed C): there
        the unfolded product (a matmul, full float32 unless the user lowered
        torch's matmul precision, as for LinearRule) is used instead.
        """
        if g.is_cuda and g.dtype == torch.float32:
            return super().clipped_sum(module, a, g, factors)
        self._check_shapes(module, a, g)
        out = {}
        if is_trainable(module.weight):
            if a.shape[0] == 0:
                out["weight"] = g.new_zeros(module.weight.shape)
            else:
                if a.numel() <= g.numel():
                    a_s, g_s = _scale_rows(a, factors), g
                else:
                    a_s, g_s = a, _scale_rows(g, factors)
                padding = self._zero_padding(module)
                if padding is None:
                    a_s, padding = self._padded(module, a_s), 0
                out["weight"] = _WEIGHT_GRAD[len(module.kernel_size)](
                    a_s.to(g.dtype),
                    module.weight.shape,
                    g_s,
                    stride=module.stride,
                    padding=padding,
                    dilation=module.dilation,
                    groups=module.groups,
                )
        if is_trainable(module.bias):
            out["bias"] = torch.einsum("b,bp->p", factors.to(g.dtype), g.flatten(2).sum(2))
        return out


class GroupNormRule(RawLayoutRule):
    """``nn.GroupNorm``: grad_w,i = sum_positions g * xhat, grad_b,i = sum_positions g.

    xhat = F.group_norm(a, num_groups, None, None, eps) is recomputed from the raw
    input; per-example gradients are C-vectors, so they are always instantiated.
    Unfolded form: A = xhat and G = g, both (B, L, C).
    """

    norm_choice = "instantiate"

    def unfold(self, module, a, g):
        if a.dim() < 2 or a.shape[1] != module.num_channels or g.numel() != a.numel():
            raise ValueError(
                f"GroupNormRule (raw_layout) needs a = the raw input (B, {module.num_channels}, "
                f"*spatial) and g of the same shape; got a {tuple(a.shape)}, g {tuple(g.shape)}"
            )
        b, c = a.shape[:2]
        xhat = a if b == 0 else F.group_norm(a, module.num_groups, None, None, module.eps)
        t = math.prod(a.shape[2:])  # (explicit sizes: B may be 0)
        A = xhat.reshape(b, c, t).transpose(1, 2)
        G = g.reshape(b, c, t).transpose(1, 2)
        return A, G

    def per_example_unfolded(self, module, A, G):
        out = {}
        if is_trainable(module.weight):
            out["weight"] = (G * A).sum(1)
        if is_trainable(module.bias):
            out["bias"] = G.sum(1)
        return out


#: Exact types only (see :func:`dptrain.clipping.rules.find_rule`).
RULES[nn.Conv1d] = ConvRule()
RULES[nn.Conv2d] = ConvRule()
RULES[nn.Conv3d] = ConvRule()
RULES[nn.GroupNorm] = GroupNormRule()
