"""The clipping engine: per-example clipping without per-example gradients.

Attach it to a model; every forward pass (with grad enabled) records each
clippable module's input ``a`` and where its output enters the autograd graph
(a gradient edge: holding the output itself would keep e.g. the (B, T, vocab)
logits alive until the backward). Then, given the
per-example losses L_i (B,), :meth:`ClippingEngine.backward`

1. takes the gradient of sum_i L_i w.r.t. the recorded outputs only
   (``torch.autograd.grad``: autograd skips the parameter-gradient kernels),
   so row i of each output gradient ``g`` belongs to example i;
2. computes every example's gradient norm per parameter from (a, g) with the
   layer rules (ghost norm or instantiation, chosen per layer by cost), with
   phantom clipping for an embedding tied to an output layer;
3. turns norms into clip factors c_i (flat, automatic, or per layer);
4. adds the clipped sum sum_i c_i grad_i into ``p.grad``, either by
   book-keeping (from the stored a and g, no second backward; Bu et al. 2023)
   or by a second backward of sum_i c_i L_i (ghost clipping, Li et al. 2022).

``p.grad`` accumulates over calls, so a logical batch can be processed in
physical chunks; the DP optimizer then adds the noise once and steps.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from dptrain._checks import check_positive
from dptrain.clipping.functions import CLIPPING_FUNCTIONS, automatic_factors, flat_factors
from dptrain.clipping.outside_use import OutsideUseCheck
from dptrain.clipping.phantom import phantom_cross_term
from dptrain.clipping.rules import EmbeddingRule, LayerRule, LinearRule, find_rule

__all__ = ["CLIPPING_MODES", "NORM_METHODS", "ClipStats", "ClippingEngine", "UnsupportedModelError"]

#: How the clipped sum is formed: one backward (book-keeping) or two (ghost).
CLIPPING_MODES = ("book_keeping", "ghost")
#: How per-example norms of linear layers are computed.
NORM_METHODS = ("auto", "ghost", "instantiate")

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class UnsupportedModelError(ValueError):
    """The model has parts the engine cannot clip per example."""


@dataclass
class ClipStats:
    """Per-example clipping figures of one call of :meth:`ClippingEngine.backward`."""

    norms: Tensor
    """(B,) per-example gradient norms before clipping (float32 or float64)."""
    factors: Tensor
    """(B,) clip factors for flat/automatic clipping; (B, groups) for per-layer."""
    max_grad_norm: float
    batch_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.batch_size = int(self.norms.shape[0])

    @property
    def clipped_fraction(self) -> float:
        """Share of examples whose gradient norm exceeded the clipping norm."""
        if self.batch_size == 0:
            return 0.0
        return float((self.norms > self.max_grad_norm).float().mean())

    @property
    def mean_norm(self) -> float:
        return float(self.norms.mean()) if self.batch_size else 0.0

    @property
    def max_norm(self) -> float:
        return float(self.norms.max()) if self.batch_size else 0.0


@dataclass(eq=False)  # identity: a _Use is a dict key
class _Use:
    """One clippable module and what its forward calls recorded."""

    name: str
    module: nn.Module
    rule: LayerRule
    inputs: list[Tensor] = field(default_factory=list)
    # Where each output's gradient enters the graph, not the output itself: holding
    # the tensor would keep e.g. the (B, T, vocab) logits alive through the backward.
    output_edges: list[GradientEdge] = field(default_factory=list)


class ClippingEngine:
    """Per-example clipping for a model, by layer rules and hooks.

    Args:
        model: the model; every trainable parameter must belong to a module with
            a rule (see :mod:`dptrain.clipping.rules`), else it is refused.
        max_grad_norm: the clipping norm C.
        clipping: ``"flat"`` (min(1, C/||g_i||)), ``"automatic"``
            (C/(||g_i|| + gamma)) or ``"per_layer"`` (flat clipping of each
            module's parameters at C_l, sum_l C_l^2 = C^2).
        mode: ``"book_keeping"`` (one backward, default) or ``"ghost"`` (second
            backward on sum_i c_i L_i).
        norm_method: ``"auto"`` picks ghost or instantiation per linear layer
            by the memory rule 2 T^2 < d_in d_out; ``"ghost"``/``"instantiate"``
            force one.
        gamma: the stabiliser of automatic clipping.
        layer_max_grad_norms: per-layer thresholds {group name: C_l} for
            per-layer clipping; default C / sqrt(number of groups) each.
    """

    def __init__(
        self,
        model: nn.Module,
        max_grad_norm: float,
        *,
        clipping: str = "flat",
        mode: str = "book_keeping",
        norm_method: str = "auto",
        gamma: float = 0.01,
        layer_max_grad_norms: dict[str, float] | None = None,
    ):
        self.max_grad_norm = check_positive("max_grad_norm", max_grad_norm)
        _check_choice("clipping", clipping, CLIPPING_FUNCTIONS)
        _check_choice("mode", mode, CLIPPING_MODES)
        _check_choice("norm_method", norm_method, NORM_METHODS)
        if clipping == "per_layer" and mode == "ghost":
            raise ValueError(
                "clipping='per_layer' needs mode='book_keeping': a second backward of "
                "sum_i c_i L_i can apply only one factor per example"
            )
        self.model = model
        self.clipping = clipping
        self.mode = mode
        self.norm_method = norm_method
        self.gamma = check_positive("gamma", gamma)
        self._uses = self._plan(model)
        self._groups = self._group_params()
        self.layer_max_grad_norms = self._layer_thresholds(layer_max_grad_norms)
        self._batch_size: int | None = None
        self._batch_shape: tuple[int, ...] | None = None
        # Per-example gradients of instantiated modules, kept from the norms for the sum.
        self._per_example: dict[_Use, dict[str, Tensor]] = {}
        self._handles = [
            model.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True),
            # always_call: a forward that raises must still leave the check's mode
            model.register_forward_hook(self._root_hook, always_call=True),
        ]
        # The first forward with gradients is checked for parameters used outside
        # their modules (see dptrain.clipping.outside_use); later ones are not.
        self._outside_check: OutsideUseCheck | None = None
        self._checked = False
        for use in self._uses.values():
            self._handles.append(use.module.register_forward_hook(self._make_hook(use)))

    # -- set-up: which parameters, which rules ------------------------------------------

    def _plan(self, model: nn.Module) -> dict[nn.Module, _Use]:
        batch_norms = [
            f"{name} ({type(m).__name__})"
            for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
        ]
        if batch_norms:
            raise UnsupportedModelError(
                "BatchNorm mixes the examples of a batch, so per-example gradients do not "
                f"exist: {', '.join(batch_norms)}. Replace it with LayerNorm or GroupNorm."
            )
        uses: dict[nn.Module, _Use] = {}
        covered: set[int] = set()
        reasons = []
        for name, module in model.named_modules():
            own = [p for p in module.parameters(recurse=False) if p.requires_grad]
            if not own:
                continue
            rule = find_rule(module)
            if rule is None:
                continue
            for attr in rule.param_names:
                p = getattr(module, attr, None)
                if isinstance(p, nn.Parameter) and p.requires_grad:
                    covered.add(id(p))  # reported below if the module is refused
            why = rule.check(module)
            if why is not None:
                reasons.append(f"{name or '<model>'} ({type(module).__name__}): {why}")
                continue
            uses[module] = _Use(name, module, rule)
        missing = [
            f"{name} ({_owner_type(model, name)})"
            for name, p in model.named_parameters()
            if p.requires_grad and id(p) not in covered
        ]
        if reasons or missing:
            parts = []
            if missing:
                parts.append(
                    "no per-example clipping rule for these trainable parameters: "
                    + ", ".join(missing)
                )
            if reasons:
                parts.append("modules that cannot be clipped exactly: " + "; ".join(reasons))
            raise UnsupportedModelError(
                "dptrain refuses to train this model: "
                + ". ".join(parts)
                + ". Freeze them (requires_grad=False), replace the modules, or register a "
                "rule with dptrain.clipping.register_rule."
            )
        return uses

    def _group_params(self) -> dict[str, list[tuple[_Use, str]]]:
        """Parameter name -> its uses [(module use, attribute)]; shared parameters have several."""
        by_param: dict[int, list[tuple[_Use, str]]] = defaultdict(list)
        names: dict[int, str] = {}
        for use in self._uses.values():
            for attr in use.rule.param_names:
                p = getattr(use.module, attr, None)
                if isinstance(p, nn.Parameter) and p.requires_grad:
                    by_param[id(p)].append((use, attr))
                    names.setdefault(id(p), f"{use.name}.{attr}" if use.name else attr)
        return {names[k]: v for k, v in by_param.items()}

    def _layer_thresholds(self, given: dict[str, float] | None) -> dict[str, float]:
        groups = sorted({self._group_of(n, uses) for n, uses in self._groups.items()})
        if given is None:
            return {g: self.max_grad_norm / math.sqrt(len(groups)) for g in groups}
        if set(given) != set(groups):
            raise ValueError(
                f"layer_max_grad_norms has keys {sorted(given)}: expected exactly {groups}"
            )
        total = math.sqrt(
            sum(check_positive(f"layer_max_grad_norms[{k!r}]", v) ** 2 for k, v in given.items())
        )
        if total > self.max_grad_norm * (1 + 1e-9):
            raise ValueError(
                f"layer_max_grad_norms have root-sum-square {total:.6g} > max_grad_norm="
                f"{self.max_grad_norm:g}: the total sensitivity would exceed C"
            )
        return dict(given)

    @staticmethod
    def _group_of(param_name: str, uses: list[tuple[_Use, str]]) -> str:
        """Per-layer clipping group: the module, or the parameter itself when shared."""
        return uses[0][0].name if len(uses) == 1 else param_name

    @property
    def parameter_names(self) -> list[str]:
        """Names of the parameters the engine clips."""
        return list(self._groups)

    def parameters(self) -> list[nn.Parameter]:
        """The parameters the engine clips (every trainable parameter of the model)."""
        return [getattr(uses[0][0].module, uses[0][1]) for uses in self._groups.values()]

    # -- hooks ----------------------------------------------------------------------------

    def _root_pre_hook(self, module, args, kwargs):
        self._batch_shape = _batch_shape_of(args, kwargs)
        self._batch_size = None if self._batch_shape is None else self._batch_shape[0]
        if not self._checked and torch.is_grad_enabled() and self._outside_check is None:
            owners = {}
            for name, uses in self._groups.items():
                p = getattr(uses[0][0].module, uses[0][1])
                owners[id(p)] = (name, tuple(u.module for u, _ in uses))
            self._outside_check = OutsideUseCheck(owners)
            if module in self._uses:  # the root is clipped itself: its pre-hook is already past
                self._outside_check.running.append(module)
            self._outside_check.__enter__()

    def _root_hook(self, module, args, output):
        check = self._outside_check
        if check is None:
            return
        check.__exit__(None, None, None)
        check.remove_hooks()
        self._outside_check = None
        self._checked = output is not None  # a forward that raised is checked again next time
        if check.found:
            self.clear()
            uses = ", ".join(f"{name} (in {func})" for name, func in check.found.items())
            raise UnsupportedModelError(
                "dptrain refuses to train this model: parameters used outside the forward "
                f"of the module that owns them: {uses}. Their gradient through that use would "
                "escape per-example clipping. Move the computation into a module the engine "
                "clips (e.g. an nn.Linear), or register a rule for the module that uses them."
            )

    def _make_hook(self, use: _Use):
        def hook(module, args, output):
            if not torch.is_grad_enabled() or not isinstance(output, Tensor):
                return None
            if not output.requires_grad:
                # Its parameters were frozen after the engine was built and its input
                # needs no gradient: this call gives no parameter a gradient to clip.
                return None
            a = args[0]
            b = self._batch_size
            shape = self._batch_shape
            if (
                b is not None
                and isinstance(use.rule, EmbeddingRule)
                and a.dim() == 1
                and a.shape[0] == b
                and shape is not None
                and len(shape) >= 2
                and shape[1] == b
            ):
                # (T,) position ids or (B,) per-example ids? With T == B the shapes cannot
                # tell, and guessing wrong would clip per position instead of per example.
                raise UnsupportedModelError(
                    f"module {use.name} ({type(module).__name__}) got a 1-D input of length {b}, "
                    f"which is both the batch size and the sequence length of the batch "
                    f"{shape}: the engine cannot tell shared position ids from per-example ids. "
                    "Pass position ids with a batch dimension, shape (1, T) or (B, T)."
                )
            if b is not None and (a.dim() == 0 or a.shape[0] != b):
                if isinstance(use.rule, EmbeddingRule) and (a.dim() == 1 or a.shape[0] == 1):
                    # Shared positions (HF/nanoGPT position ids of shape (T,) or (1, T)):
                    # give every example its own copy so its gradient stays separate.
                    a = a.reshape(1, -1).expand(b, -1)
                    output = output.reshape(1, *output.shape[-2:]).expand(b, -1, -1)
                else:
                    raise UnsupportedModelError(
                        f"module {use.name} ({type(module).__name__}) got an input of shape "
                        f"{tuple(a.shape)} whose first dimension is not the batch size {b}: "
                        "its per-example gradients would be mixed"
                    )
            use.inputs.append(a.detach())
            use.output_edges.append(get_gradient_edge(output))
            return output

        return hook

    def detach(self) -> None:
        """Remove the hooks; the model is then an ordinary model again."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.clear()

    def clear(self) -> None:
        """Forget what the last forward recorded."""
        for use in self._uses.values():
            use.inputs.clear()
            use.output_edges.clear()

    # -- the clipped backward -------------------------------------------------------------

    def backward(self, losses: Tensor, loss_scale: float = 1.0) -> ClipStats:
        """Add sum_i c_i grad L_i to each parameter's ``.grad``; return the clipping figures.

        ``losses`` are the per-example losses (B,) of the last forward pass.
        ``loss_scale`` K: the losses carry a loss scale (mixed precision); clipping
        is then at C K (Li et al. 2022, App. T) and the optimizer unscales.
        """
        if losses.dim() != 1:
            raise ValueError(
                f"losses has shape {tuple(losses.shape)}: expected per-example losses of shape (B,)"
            )
        threshold = self.max_grad_norm * check_positive("loss_scale", loss_scale)
        b = losses.shape[0]
        active = [u for u in self._uses.values() if u.output_edges]
        if b == 0 or not active:
            self.clear()
            zeros = torch.zeros(b)
            return ClipStats(zeros, zeros, self.max_grad_norm)
        edges = [e for u in active for e in u.output_edges]
        grads = torch.autograd.grad(
            losses.sum(), edges, allow_unused=True, retain_graph=self.mode == "ghost"
        )
        records = self._records(active, grads, b)
        norms_sq = self._norms_sq(records)
        if self.clipping == "per_layer":
            factors, total = self._per_layer_factors(norms_sq, threshold)
        else:
            total = (
                torch.stack(list(norms_sq.values())).sum(0).sqrt()
                if norms_sq
                else torch.zeros(b)  # the losses did not depend on any clipped parameter
            )
            factors = (
                flat_factors(total, threshold)
                if self.clipping == "flat"
                else automatic_factors(total, threshold, self.gamma * loss_scale)
            )
        if self.mode == "ghost":
            self.clear()
            (losses * factors.to(losses.dtype).detach()).sum().backward()
        else:
            self._book_keeping(records, factors)
            self.clear()
            self._per_example = {}
        return ClipStats(total.detach() / loss_scale, factors.detach(), self.max_grad_norm)

    def _records(
        self, active: list[_Use], grads: tuple, b: int
    ) -> dict[_Use, tuple[Tensor, Tensor]]:
        """(a, g) per module, calls concatenated along tokens, in float32 or float64."""
        records = {}
        i = 0
        for use in active:
            a_parts, g_parts = [], []
            for a in use.inputs:
                g = grads[i]
                i += 1
                if g is None:  # this call did not reach the loss
                    continue
                if g.dim() == 0 or g.shape[0] != b:
                    raise UnsupportedModelError(
                        f"module {use.name} ({type(use.module).__name__}) produced an output of "
                        f"shape {tuple(g.shape)} for {b} per-example losses: its first dimension "
                        "is not the batch size, so its per-example gradients would be mixed (if "
                        "the model takes its inputs in an unusual container, pass input_ids= or "
                        "a tensor as the first argument)"
                    )
                a = use.rule.prepare(use.module, a)
                a_parts.append(upcast(a))
                g_parts.append(upcast(g).reshape(b, a.shape[1], -1))
            if len(a_parts) == 1:  # the usual case: no copy
                records[use] = (a_parts[0], g_parts[0])
            elif a_parts:
                records[use] = (torch.cat(a_parts, 1), torch.cat(g_parts, 1))
        return records

    def _ghost(self, use: _Use, a: Tensor, g: Tensor) -> bool:
        if use.rule.norm_choice != "either":
            return use.rule.norm_choice == "ghost"
        if self.norm_method != "auto":
            return self.norm_method == "ghost"
        return use.rule.ghost_is_cheaper(use.module, a, g)

    def _module_norms_sq(self, use: _Use, a: Tensor, g: Tensor) -> dict[str, Tensor]:
        if self._ghost(use, a, g):
            return use.rule.norms_sq(use.module, a, g, True)
        per_example = use.rule.per_example(use.module, a, g)
        if self.mode == "book_keeping":  # reused for the clipped sum
            self._per_example[use] = per_example
        return {k: v.flatten(1).pow(2).sum(1) for k, v in per_example.items()}

    def _norms_sq(self, records: dict[_Use, tuple[Tensor, Tensor]]) -> dict[str, Tensor]:
        """Parameter name -> (B,) squared per-example gradient norms."""
        self._per_example = {}
        per_module = {use: self._module_norms_sq(use, a, g) for use, (a, g) in records.items()}
        out = {}
        for name, uses in self._groups.items():
            present = [(u, attr) for u, attr in uses if u in records]
            if not present:
                continue
            if len(uses) == 1:
                u, attr = present[0]
                out[name] = per_module[u][attr]
            elif _is_phantom(uses) and len(present) == 2:
                out[name] = self._phantom_norm_sq(present, records, per_module)
            else:
                out[name] = self._shared_per_example(present, records).flatten(1).pow(2).sum(1)
        return out

    def _phantom_norm_sq(self, present, records, per_module) -> Tensor:
        """||X^T G_in + G_out^T H||^2 with the cross term (DESIGN.md, phantom clipping)."""
        (emb, emb_attr), (lin, lin_attr) = sorted(
            present, key=lambda ua: not isinstance(ua[0].rule, EmbeddingRule)
        )
        x, g_in = records[emb]
        h, g_out = records[lin]
        g_in = emb.rule._masked(emb.module, x, g_in)  # type: ignore[attr-defined]
        cross = phantom_cross_term(x, g_in, h, g_out)
        return per_module[emb][emb_attr] + per_module[lin][lin_attr] + 2 * cross

    @staticmethod
    def _shared_per_example(present, records) -> Tensor:
        """Sum over uses of the per-example gradients of one shared parameter."""
        total = None
        for u, attr in present:
            a, g = records[u]
            part = u.rule.per_example(u.module, a, g)[attr]
            total = part if total is None else total + part
        return total

    def _per_layer_factors(self, norms_sq: dict[str, Tensor], threshold: float):
        scale = threshold / self.max_grad_norm
        group_sq: dict[str, Tensor] = {}
        for name, sq in norms_sq.items():
            gname = self._group_of(name, self._groups[name])
            group_sq[gname] = group_sq.get(gname, 0) + sq
        factors = {
            gname: flat_factors(sq.sqrt(), self.layer_max_grad_norms[gname] * scale)
            for gname, sq in group_sq.items()
        }
        total = torch.stack(list(group_sq.values())).sum(0).sqrt()
        self._group_factors = factors
        stacked = torch.stack([factors[k] for k in sorted(factors)], 1)
        return stacked, total

    def _factor_for(self, name: str, factors: Tensor) -> Tensor:
        if self.clipping == "per_layer":
            return self._group_factors[self._group_of(name, self._groups[name])]
        return factors

    def _book_keeping(self, records, factors: Tensor) -> None:
        """sum_i c_i grad_i from the stored (a, g), added into ``p.grad``."""
        sums: dict[_Use, dict[str, Tensor]] = {}
        for name, uses in self._groups.items():
            present = [(u, attr) for u, attr in uses if u in records]
            if not present:
                continue
            c = self._factor_for(name, factors)
            if len(uses) == 1 or _is_phantom(uses):
                grad = None
                for u, attr in present:
                    if u in self._per_example:
                        pe = self._per_example[u][attr]
                        part = torch.einsum("b,b...->...", c.to(pe.dtype), pe)
                    else:
                        if u not in sums:
                            a, g = records[u]
                            sums[u] = u.rule.clipped_sum(u.module, a, g, c)
                        part = sums[u][attr]
                    grad = part if grad is None else grad + part
            else:
                per_ex = self._shared_per_example(present, records)
                grad = torch.einsum("b,b...->...", c.to(per_ex.dtype), per_ex)
            p = getattr(present[0][0].module, present[0][1])
            grad = grad.to(p.dtype)
            if p.grad is None:
                # the param's own strides (a transposed Conv1D sum is not), as torch's
                # gradient layout contract asks: avoids slow paths and a warning downstream
                p.grad = grad if grad.stride() == p.stride() else grad.contiguous()
            else:
                p.grad.add_(grad)


def _is_phantom(uses: list[tuple[_Use, str]]) -> bool:
    """One Embedding weight tied to one Linear weight (tied LM head / item scoring)."""
    # Exact rule types: Conv1D (a LinearRule subclass) stores its weight transposed.
    return (
        len(uses) == 2
        and {type(u.rule) for u, _ in uses} == {EmbeddingRule, LinearRule}
        and all(attr == "weight" for _, attr in uses)
    )


def upcast(t: Tensor) -> Tensor:
    """float16/bfloat16 -> float32; other dtypes unchanged (norms and sums need the range)."""
    return t.float() if t.dtype in _LOW_PRECISION else t


_BATCH_KEYS = ("input_ids", "inputs_embeds", "input", "x", "idx")


def _batch_shape_of(args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """Shape of the root model's batch input: its usual input names first, then any tensor.

    Inputs may come in a dict, list or tuple (e.g. a tokenizer's batch dict), searched in order.
    """
    for key in _BATCH_KEYS:
        v = kwargs.get(key)
        if isinstance(v, Tensor) and v.dim() > 0:
            return tuple(v.shape)
    for v in (*args, *kwargs.values()):
        if isinstance(v, Tensor):
            if v.dim() > 0:
                return tuple(v.shape)
        elif isinstance(v, Mapping):
            found = _batch_shape_of((), dict(v))
            if found is not None:
                return found
        elif isinstance(v, list | tuple):
            found = _batch_shape_of(tuple(v), {})
            if found is not None:
                return found
    return None


def _batch_size_of(args: tuple, kwargs: dict) -> int | None:
    """The batch size of the root model's call (first dimension of :func:`_batch_shape_of`)."""
    shape = _batch_shape_of(args, kwargs)
    return None if shape is None else shape[0]


def _owner_type(model: nn.Module, param_name: str) -> str:
    module_name = param_name.rpartition(".")[0]
    return type(model.get_submodule(module_name)).__name__ if module_name else type(model).__name__


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed: expected one of {list(allowed)}")
