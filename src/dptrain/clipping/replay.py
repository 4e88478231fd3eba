"""Per-example gradients by replaying a module on one example at a time.

The generic rule for a module type without a written rule (a raw
``nn.Parameter`` such as ViT's class token and position table, a custom layer),
and the rule for ``nn.MultiheadAttention``, whose projections are used through
``F.multi_head_attention_forward`` rather than called as modules.

Example i's gradient of the module's parameters is

    grad_i = d <f(x_i), g_i> / d theta,

where x_i is example i's slice of the recorded inputs and g_i row i of the
gradient of sum_j L_j with respect to the module's output (which carries example
i's loss alone: the engine's rows check). f is linear in g_i, so this is exact
whenever the module treats examples independently; where it does not (batch
statistics, dropout that draws another mask on replay) the replay differs from
the batched call and the engine's completeness check refuses the model, naming
it. Replays run the module B times at batch size 1 (a loop, not ``torch.func.vmap``:
modules written for eager mode, HF's included, use operations vmap cannot batch),
so a written rule is worth having where the module is hot.

The record handed to the engine is the per-example gradients themselves,
flattened: ``a`` (B, 1, P) and ``g`` (B, 1, 1) of ones, so grad_i = g_i a_i as
for a linear layer over one token, and the engine's norms and sums need no
special case.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from dptrain.clipping.layout import example_slice
from dptrain.clipping.rules import RULES, LayerRule, param_of, weighted_sum

__all__ = ["MultiheadAttentionRule", "ParametrizedRule", "ReplayRule"]


class ReplayRule(LayerRule):
    """Per-example gradients of ``param_names`` by batch-size-1 replays of the module.

    The instance registered in :data:`~dptrain.clipping.rules.RULES` is a
    template; the engine binds one per module with :meth:`for_module`.
    """

    replays = True
    norm_choice = "instantiate"
    #: Whether the rule covers its submodules' parameters too (they are used by the
    #: module's own code, not by calling the submodules).
    claims_subtree = False

    def claimed_modules(self, module: nn.Module) -> list[nn.Module]:
        return [m for m in module.modules() if m is not module] if self.claims_subtree else []

    def __init__(self, param_names: tuple[str, ...] = ()):
        self.param_names = tuple(param_names)

    @classmethod
    def for_module(cls, module: nn.Module) -> ReplayRule:
        """A rule for ``module``'s own trainable parameters."""
        names = tuple(n for n, p in module.named_parameters(recurse=False) if p.requires_grad)
        return cls(names)

    @staticmethod
    def applies_to(module: nn.Module) -> bool:
        """Whether the generic rule may be tried on a module without a written rule.

        Not on torch's recurrent layers: they return a tuple and run time-first by
        default (dptrain's DPGRU/DPLSTM have rules).
        """
        return not isinstance(module, nn.RNNBase)

    # -- what the engine calls in the forward ----------------------------------------

    def batch_dim(self, module: nn.Module, args: tuple, kwargs: dict) -> int:
        """The dimension of the module's first input and output that holds the examples."""
        return 0

    # -- replay ---------------------------------------------------------------------

    def example_inputs(
        self, module: nn.Module, args: tuple, kwargs: dict, i: int, b: int
    ) -> tuple[tuple, dict]:
        """Example i's inputs: tensors whose first dimension is b are sliced, others shared.

        With the first input laid out in blocks of k rows per example (b k rows,
        example-major, as Mixtral's experts see their tokens), every input with b k
        rows is sliced in blocks. Which inputs are sliced is part of the layout pattern
        the engine checks exactly the first time it is seen (a shared table of length b
        would be sliced wrongly, and the completeness check would refuse it).
        """
        return example_slice((args, kwargs), i, b, _rows_per_example(args, kwargs, b))

    def replay(self, module: nn.Module, calls: list[tuple[tuple, dict, Tensor]], b: int) -> Tensor:
        """(B, P) per-example gradients of ``param_names``, flattened, summed over calls.

        ``calls``: (args, kwargs, g) per recorded call, with g (B, ...) examples first.
        """
        params = [param_of(module, n) for n in self.param_names]
        sizes = [p.numel() for p in params]
        out = torch.zeros(b, sum(sizes), dtype=params[0].dtype, device=params[0].device)
        for args, kwargs, g in calls:
            bd = self.batch_dim(module, args, kwargs)
            k = g.shape[0] // b  # rows (1) or blocks of k rows per example
            for i in range(b):
                args_i, kwargs_i = self.example_inputs(module, args, kwargs, i, b)
                with torch.enable_grad():
                    y = self.output_of(module, module(*args_i, **kwargs_i))
                    g_i = g[i * k : (i + 1) * k].movedim(0, bd).to(y.dtype)
                    grads = torch.autograd.grad(y, params, g_i, allow_unused=True)
                out[i] += torch.cat(
                    [
                        (torch.zeros_like(p) if d is None else d).reshape(-1)
                        for p, d in zip(params, grads, strict=True)
                    ]
                ).to(out.dtype)
        return out

    # -- the rule interface on the flattened record ---------------------------------

    def prepare(self, module: nn.Module, a: Tensor) -> Tensor:
        return a

    def per_example(self, module: nn.Module, a: Tensor, g: Tensor) -> dict[str, Tensor]:
        flat = (a * g).sum(1)  # one row per example, or a unit's examples' rows (units.py)
        out, start = {}, 0
        for name in self.param_names:
            p = param_of(module, name)
            out[name] = flat[:, start : start + p.numel()].reshape(-1, *p.shape)
            start += p.numel()
        return out

    def clipped_sum(
        self, module: nn.Module, a: Tensor, g: Tensor, factors: Tensor
    ) -> dict[str, Tensor]:
        return weighted_sum(self.per_example(module, a, g), factors)


def _rows_per_example(args: tuple, kwargs: dict, b: int) -> int:
    """k where the first tensor input has b k rows (1 for one row per example)."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, Tensor):
            return v.shape[0] // b if v.dim() and b and v.shape[0] % b == 0 else 1
    return 1


class MultiheadAttentionRule(ReplayRule):
    """``nn.MultiheadAttention``: its input and output projections (``out_proj`` is used
    through ``F.multi_head_attention_forward``, never called) by replay.

    The examples' dimension is known from ``batch_first``, not guessed from sizes;
    ``key_padding_mask`` (B, S) and a per-example ``attn_mask`` (B * heads, L, S)
    are sliced with their example's rows, a 2-D ``attn_mask`` is shared.
    """

    claims_subtree = True

    @classmethod
    def for_module(cls, module: nn.Module) -> ReplayRule:
        names = tuple(n for n, p in module.named_parameters() if p.requires_grad)
        return cls(names)

    def batch_dim(self, module, args, kwargs):
        query = args[0] if args else kwargs["query"]
        if query.dim() != 3:
            raise ValueError(
                f"nn.MultiheadAttention called on an unbatched query of shape "
                f"{tuple(query.shape)}: per-example clipping needs a batch dimension"
            )
        return 0 if module.batch_first else 1

    def output_of(self, module, output):
        return output[0]

    def example_inputs(self, module, args, kwargs, i, b):
        bound = inspect.signature(module.forward).bind(*args, **kwargs)
        bd = self.batch_dim(module, args, kwargs)
        new = dict(bound.arguments)
        for name in ("query", "key", "value"):
            new[name] = new[name].narrow(bd, i, 1)
        if new.get("key_padding_mask") is not None:
            new["key_padding_mask"] = new["key_padding_mask"][i : i + 1]
        mask = new.get("attn_mask")
        if mask is not None and mask.dim() == 3:
            h = module.num_heads
            new["attn_mask"] = mask[i * h : (i + 1) * h]
        return (), new


RULES[nn.MultiheadAttention] = MultiheadAttentionRule()


#: Parametrizations that write state in a training forward: the power iteration of
#: ``torch.nn.utils.parametrizations.spectral_norm`` updates its buffers ``_u`` and ``_v``.
STATEFUL_PARAMETRIZATIONS = {"_SpectralNorm": "its power iteration writes the buffers _u and _v"}


class ParametrizedRule(ReplayRule):
    """A module with ``torch.nn.utils.parametrize`` parametrizations (``weight_norm``,
    ``orthogonal``, a custom one): replayed per example with its parametrized tensors
    recomputed from their originals in every replay, so example i's gradient reaches the
    originals (``parametrizations.weight.original0`` ...) through the parametrization.

    The parametrization is called inside the module's forward (reading ``module.weight``),
    so the module's recorded call covers it; the ``parametrizations`` submodules get no
    rule of their own. A parametrization that writes state in a training forward
    (``spectral_norm``'s power iteration) is refused by name: a replay would run it again
    and compute another weight.
    """

    @classmethod
    def for_module(cls, module: nn.Module) -> ReplayRule:
        own = [n for n, p in module.named_parameters(recurse=False) if p.requires_grad]
        inner = [
            f"parametrizations.{n}"
            for n, p in module.parametrizations.named_parameters()
            if p.requires_grad
        ]
        return cls((*own, *inner))

    def claimed_modules(self, module: nn.Module) -> list[nn.Module]:
        return list(module.parametrizations.modules())

    def check(self, module: nn.Module) -> str | None:
        base = type(module).__mro__[1].__name__  # ParametrizedLinear -> Linear
        for tensor_name, plist in module.parametrizations.items():
            for p in plist:
                why = STATEFUL_PARAMETRIZATIONS.get(type(p).__name__)
                if why is not None:
                    return (
                        f"{base} with a parametrization on {tensor_name} ({type(p).__name__}): "
                        f"{why} in every training forward (state written in forward), and the "
                        "per-example replay that clips it would run it again, on another "
                        "weight. Remove it (torch.nn.utils.parametrize.remove_parametrizations("
                        f"module, {tensor_name!r})) or freeze the module's parameters"
                    )
        return None


def parametrized_rule(module: nn.Module) -> ParametrizedRule | None:
    """The rule template for a module with parametrizations, or None for other modules."""
    return _PARAMETRIZED if parametrize.is_parametrized(module) else None


_PARAMETRIZED = ParametrizedRule()
