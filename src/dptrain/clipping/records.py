"""What the engine records of each clippable module, and the records it reads.

A forward call of a clippable module leaves a :class:`Call`: the input its rule
reads, and where its output's gradient enters the autograd graph. A backward
turns each call's output gradient ``g`` into a record ``(a, g)`` with the
examples along the first dimension (:func:`example_rows`), which the norms and
sums (:mod:`dptrain.clipping.sums`) read. Which rows belong to which example is
decided elsewhere (:mod:`dptrain.clipping.decisions`); here rows are only
arranged as the module's layout says.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge
from torch.utils._pytree import tree_flatten, tree_map

from dptrain.clipping.precision import LOW_PRECISION, upcast
from dptrain.clipping.rules import LayerRule, is_trainable, param_of

__all__ = [
    "AutocastCopies",
    "Call",
    "Use",
    "build_records",
    "detached",
    "example_rows",
    "examples_first",
    "for_rule",
    "in_backward",
    "low_precision",
    "own_params",
    "tensor_inputs",
]


@dataclass(eq=False)
class Call:
    """What one forward call of a clippable module recorded."""

    index: int
    """Its place among the module's calls in this forward (0 for the first)."""
    a: Tensor | None
    """The input the rule reads (detached); (b, T) ids for an expanded shared table. None
    once a streamed call's per-example gradients are formed (its last reader)."""
    edge: GradientEdge
    """Where the output's gradient enters the graph (not the output: holding it would
    keep e.g. the (B, T, vocab) logits alive through the backward)."""
    out_shape: tuple[int, ...]
    in_nodes: list
    """Graph nodes of the call's tensor inputs: where the module's own operations end."""
    expanded_to: int | None = None
    """For a table shared by all examples: the number of examples its output is broadcast
    to (``a``: the ids repeated per example; ``edge``: the broadcast's output), or None."""
    shared: bool = False
    """Looked up with ids every example may share ((T,) or (1, T)): which rows are whose is
    found at the backward, where the output is broadcast over the batch (shared_table.py)."""
    batch_dim: int = 0
    """The dimension of the output that holds the examples (1 for a time-first module)."""
    inputs: tuple | None = None
    """(args, kwargs), detached, for a rule that replays the call (replay.py)."""
    low_precision: bool = False
    """The call ran in float16/bfloat16 (autocast, or such inputs or outputs): autograd
    would form its parameters' gradients in that precision (the engine then forms the
    clipped sum from the records)."""
    a_shape: tuple[int, ...] = field(init=False)
    """``a``'s shape, for messages once ``a`` is gone."""

    def __post_init__(self) -> None:
        self.a_shape = tuple(self.a.shape)


@dataclass(eq=False)  # identity: a Use is a dict key
class Use:
    """One clippable module and what its forward calls recorded."""

    name: str
    module: nn.Module
    rule: LayerRule
    calls: list[Call] = field(default_factory=list)
    unrecorded: str | None = None
    """Why a forward call could not be recorded (then its parameters' uses are refused)."""


def own_params(use: Use) -> list[nn.Parameter]:
    """The trainable parameters ``use``'s rule covers."""
    params = (param_of(use.module, n) for n in use.rule.param_names)
    return [p for p in params if is_trainable(p)]


def example_rows(use: Use, a: Tensor, g: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """One call's (a, g) as its rule reads them: (b, T, ...) example rows, in the dtypes
    the call computed in (a bf16 record stays bf16: :func:`for_rule`)."""
    if a.shape[0] != b:  # blocks: (b * k, ...) rows, example-major
        a = a.reshape(b, -1, *a.shape[1:])
    a = use.rule.prepare(use.module, a)
    if g.dim() != 3 or g.shape[:2] != (b, a.shape[1]):  # (a reshape to itself is an op too)
        g = g.reshape(b, a.shape[1], -1)
    if 0 in g.stride() and g.numel() > 1:
        # a broadcast gradient (the backward of a sum over tokens): matrix products on
        # stride-0 operands run about 50x slower on CPU than on the materialised copy
        g = g.contiguous()
    return a, g


def for_rule(rule: LayerRule, a: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """A record as ``rule`` reads it: as recorded for a rule that forms its products with
    float32 accumulation from low-precision operands itself (``low_precision_records``,
    :mod:`dptrain.clipping.tensor_cores`) or upcasts them itself (``upcasts_itself``),
    else upcast to float32 (a copy for the time
    the rule runs: the record itself stays in its own, smaller, dtype)."""
    if getattr(rule, "low_precision_records", False) or getattr(rule, "upcasts_itself", False):
        return a, g
    return upcast(a), upcast(g)


def examples_first(calls: list[Call], grads: tuple) -> tuple:
    """Output gradients with each call's examples along dimension 0."""
    return tuple(
        g.movedim(c.batch_dim, 0) if g is not None and c.batch_dim else g
        for c, g in zip(calls, grads, strict=True)
    )


def build_records(
    active: list[Use],
    live: dict[Use, list[Call]],
    grads: tuple,
    b: int,
    replaying: Callable[[], AbstractContextManager],
) -> tuple[dict[Use, tuple[Tensor, Tensor]], dict[Use, LayerRule]]:
    """(a, g) per module, example rows first, calls concatenated along tokens (in the
    calls' dtypes, except a replay's flat record and raw channels-first records, which
    are float32/64), and the rules that read a record differently from the module's own (the unfolded view
    of a raw-layout rule called several times). None for streamed modules (g is None).

    ``replaying()``: a context in which a replaying rule re-runs its module (those
    forwards are not new calls)."""
    records = {}
    views: dict[Use, LayerRule] = {}
    i = 0
    for use in active:
        if getattr(use.rule, "replays", False):
            calls = [(*c.inputs, grads[i + j]) for j, c in enumerate(live[use])]
            i += len(calls)
            calls = [c for c in calls if c[2] is not None]
            if calls:
                with replaying():
                    flat = use.rule.replay(use.module, calls, b)
                flat = upcast(flat)
                records[use] = (flat[:, None, :], flat.new_ones(b, 1, 1))
            continue
        raw = getattr(use.rule, "raw_layout", False)
        a_parts, g_parts = [], []
        for call in live[use]:
            g = grads[i]
            i += 1
            if g is None:  # this call did not reach the loss
                continue
            a = call.a
            if raw:  # channels-first: (B, C, *spatial) as the module saw it
                a_parts.append(upcast(a))
                g_parts.append(upcast(g))
                continue
            a, g = example_rows(use, a, g, b)
            a_parts.append(a)
            g_parts.append(g)
        if len(a_parts) == 1:  # the usual case: no copy
            records[use] = (a_parts[0], g_parts[0])
        elif a_parts and raw:
            # Dim 1 of a raw record is channels: unfold each call to (B, L, d) first,
            # then positions concatenate as tokens do (conv_rules, "Several calls").
            pairs = zip(a_parts, g_parts, strict=True)
            unfolded = [use.rule.unfold(use.module, a, g) for a, g in pairs]
            records[use] = tuple(torch.cat(parts, 1) for parts in zip(*unfolded, strict=True))
            views[use] = use.rule.unfolded_view()
        elif a_parts:
            records[use] = (torch.cat(a_parts, 1), torch.cat(g_parts, 1))
    return records, views


def tensor_inputs(args: tuple, kwargs: dict) -> list[Tensor]:
    """The tensors among a call's arguments, nested containers included, in order."""
    if not kwargs and all(isinstance(t, Tensor) for t in args):
        return list(args)  # the usual call, module(x): same list, without the tree walk
    return [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]


def detached(tree):
    """``tree`` with every tensor detached (a replay's inputs, without their graph)."""
    return tree_map(lambda v: v.detach() if isinstance(v, Tensor) else v, tree)


def in_backward() -> bool:
    """Whether autograd is running a backward now (e.g. a checkpointed block's recomputation)."""
    return torch._C._current_graph_task_id() != -1


def low_precision(a: Tensor, output: Tensor) -> bool:
    """Whether a call computed in float16/bfloat16: under autocast, or on such tensors."""
    return (
        torch.is_autocast_enabled(output.device.type)
        or a.dtype in LOW_PRECISION
        or output.dtype in LOW_PRECISION
    )


class AutocastCopies:
    """A module input in the dtype autocast computed the module in, one copy per input.

    Under autocast a float32 input (a norm layer's output, say) enters a linear layer's
    matrix product as its bf16 copy; autograd forms the weight's gradient from that copy.
    Recording the copy instead of the float32 input keeps the record in the compute dtype
    (half the memory, tensor-core products: tensor_cores.py) and computes the gradient
    autograd computes. Modules reading the same input (q, k and v projections; a gated
    MLP's gate and up) share one copy, so the Gram blocks of it are formed once.
    """

    def __init__(self) -> None:
        self._copies: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        # the inputs handed to modules by shared() -> (that input, the copy it views)
        self._given: dict[int, tuple[Tensor, Tensor]] = {}

    def of(self, a: Tensor) -> Tensor:
        """``a`` as autocast computes with it (itself where autocast is off or leaves it);
        for an input :meth:`shared` handed out, the copy it views."""
        given = self._given.get(id(a))
        if given is not None and given[0] is a:
            return given[1]
        kind = a.device.type
        if a.dtype != torch.float32 or not torch.is_autocast_enabled(kind):
            return a
        key = (id(a), a._version)
        held = self._copies.get(key)
        if held is None:  # the input is held too: its id cannot be reused meanwhile
            with torch.no_grad():  # a copy without a graph (no detach op after it)
                held = self._copies[key] = (a, a.to(torch.get_autocast_dtype(kind)))
        return held[1]

    def shared(self, x: Tensor) -> Tensor:
        """What a linear layer under autocast is handed instead of its float32 input ``x``:
        the shared copy (:meth:`of`) as its own node of the graph (:class:`SharedCast`).

        Autocast would cast ``x`` inside the layer, once per layer, and the matrix product
        would save that cast for the weight's gradient: q, k and v (or gate and up) each
        kept a bf16 copy of the same input, and the record a fourth (1.6 GB at B 16, T 512
        for a 135M Llama's LoRA adapters). Handed the shared copy, every layer saves the
        same memory the record holds. Values and gradients are autocast's own: the copy is
        the same rounding, and each layer's gradient for ``x`` is cast to float32 on its own
        node before autograd adds them, as autocast's casts are."""
        copy = self.of(x)
        out = SharedCast.apply(x, copy)
        self._given[id(out)] = (out, copy)
        return out

    def clear(self) -> None:
        self._copies.clear()
        self._given.clear()


class SharedCast(torch.autograd.Function):
    """``copy`` (x rounded to a lower precision, made without a graph) as a view with x
    below it in the graph: the gradient for x is the incoming one cast to x's dtype, as
    for autocast's own cast (``AutocastCopies.shared``)."""

    @staticmethod
    def forward(ctx, x: Tensor, copy: Tensor) -> Tensor:
        ctx.dtype = x.dtype
        return copy.view_as(copy)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.to(ctx.dtype), None
