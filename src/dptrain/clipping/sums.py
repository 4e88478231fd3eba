"""Per-example gradient norms and clipped sums, from the records of one backward.

Given each module's record ``(a, g)`` (examples first, :mod:`dptrain.clipping.records`)
and the per-example gradients already formed for streamed modules
(:mod:`dptrain.clipping.streaming`), :class:`NormsAndSums` computes

- each clipped parameter's squared per-example norms, (B,): ghost norm or
  instantiation per layer (the rule's ``norm_choice`` and the cost rule), phantom
  clipping for an embedding tied to output layers, and per-example gradients summed
  over uses for any other shared parameter;
- each parameter's weighted sum sum_i c_i grad_i from the same records
  (book-keeping, Bu et al. 2023), one parameter at a time, freeing each module's
  record as soon as every parameter that reads it has its sum.

Clip factors (flat, automatic, per layer) are the engine's; here they are given.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Collection, Iterator

import torch
from torch import Tensor

from dptrain.clipping.phantom import phantom_cross_term
from dptrain.clipping.precision import LOW_PRECISION
from dptrain.clipping.records import Use, for_rule
from dptrain.clipping.rules import (
    EmbeddingRule,
    LayerRule,
    LinearRule,
    embedding_ghost_norm,
    gram_cache,
    gram_inner,
    weighted_sum,
)
from dptrain.clipping.streaming import PerExampleGrads
from dptrain.clipping.tensor_cores import one_gemm_sums, row_norm_cache, split_cache

__all__ = ["NormsAndSums", "is_tied"]

#: (a, g) per module, examples first.
Records = dict[Use, tuple[Tensor, Tensor]]


def is_tied(uses: list[tuple[Use, str]]) -> bool:
    """An embedding weight shared by lookups and output layers (tied LM heads, T5, BART)."""
    # Exact LinearRule: Conv1D (a LinearRule subclass) stores its weight transposed.
    return (
        len(uses) >= 2
        and all(attr == "weight" for _, attr in uses)
        and all(isinstance(u.rule, EmbeddingRule) or type(u.rule) is LinearRule for u, _ in uses)
        and any(isinstance(u.rule, EmbeddingRule) for u, _ in uses)
    )


class NormsAndSums:
    """Norms and weighted sums of a model's clipped parameters from one backward's records.

    Args:
        groups: parameter name -> its uses [(module use, attribute)]; a shared
            parameter has several.
        norm_method: ``"auto"`` (the rule's cost comparison), ``"ghost"`` or
            ``"instantiate"`` for layers that can do either.
        sum_rounding: ``"exact"``: a bf16 record's sum scales exactly (two GEMMs);
            ``"bounded"``: one GEMM on the rounded scaled operand, its rounding bounded
            per example (:meth:`rounding_margins`, for the clip factors to absorb).
    """

    def __init__(
        self,
        groups: dict[str, list[tuple[Use, str]]],
        norm_method: str,
        sum_rounding: str = "exact",
    ):
        self.groups = groups
        self.norm_method = norm_method
        self.sum_rounding = sum_rounding
        # This backward's rounding bounds {use: {attr: (B,)}}: the modules whose sums
        # round (one_gemm_sums), and only those, since the factors absorbed them.
        self._bounds: dict[Use, dict[str, Tensor]] = {}
        self.per_example: dict[Use, dict[str, Tensor]] = PerExampleGrads()
        """Per-example gradients {name: (B, *shape)} by module: formed during the backward
        for streamed modules, or for the norm of an instantiated one (kept for the sum)."""
        self.views: dict[Use, LayerRule] = {}
        """Rules that read this backward's records differently from the module's own (the
        unfolded view of a raw-layout rule)."""
        self.frozen: frozenset[str] = frozenset()
        """Parameters frozen (``requires_grad=False``) since the engine was built, set by
        the engine for each backward: no gradient, so neither a norm nor a sum (the rules
        form none for them)."""
        # The modules whose every parameter is a tied weight: their norms come from the
        # tied computation alone (phantom clipping), never from their own rule.
        tied = {n for n, uses in groups.items() if is_tied(uses)}
        owned: dict[int, list[str]] = defaultdict(list)
        for n, uses in groups.items():
            for u, _ in uses:
                owned[id(u)].append(n)
        self._tied_only = {k for k, names in owned.items() if all(n in tied for n in names)}

    def clear(self) -> None:
        self.per_example = PerExampleGrads()
        self.views = {}
        self._bounds = {}

    def rule(self, use: Use) -> LayerRule:
        """The rule that reads ``use``'s record: its own, or an unfolded view of it."""
        return self.views.get(use, use.rule)

    def ghost(self, use: Use, a: Tensor, g: Tensor) -> bool:
        """Whether ``use``'s norm is computed by the ghost norm (no per-example gradients)."""
        rule = self.rule(use)
        if rule.norm_choice != "either":
            return rule.norm_choice == "ghost"
        if self.norm_method != "auto":
            return self.norm_method == "ghost"
        return rule.ghost_is_cheaper(use.module, a, g)

    def _trained_groups(self) -> list[tuple[str, list[tuple[Use, str]]]]:
        """(name, uses) of the parameters that take a gradient in this backward: all but
        those frozen since the engine was built (:attr:`frozen`)."""
        return [(n, uses) for n, uses in self.groups.items() if n not in self.frozen]

    def recorded(self, use: Use, records: Records) -> bool:
        """Whether ``use`` has this backward's record or its per-example gradients."""
        return use in records or use in self.per_example

    # -- norms ------------------------------------------------------------------------------

    def norms_sq(self, records: Records, keep: bool) -> dict[str, Tensor]:
        """Parameter name -> (B,) squared per-example gradient norms. ``keep``: keep the
        per-example gradients instantiated on the way, for the sum (book-keeping)."""
        # The streamed modules' per-example gradients exist already (no record).
        per_module = self._held_norms_sq()
        if not keep:  # the second backward forms the sum: norms suffice
            self.per_example = PerExampleGrads()
        with gram_cache():
            for use, (a, g) in records.items():
                if id(use) not in self._tied_only:
                    per_module[use] = self._module_norms_sq(use, a, g, keep)
        self._bounds = {}
        if self.sum_rounding == "bounded" and keep:
            with row_norm_cache():  # inputs shared by several layers: their norms once
                for use, (a, g) in records.items():
                    if use not in self.per_example:  # its sum comes from the record
                        rule = self.rule(use)
                        bound = rule.rounding_bound(use.module, *for_rule(rule, a, g))
                        if bound:
                            self._bounds[use] = bound
        out = {}
        for name, uses in self._trained_groups():
            present = [(u, attr) for u, attr in uses if u in records or u in per_module]
            if not present:
                continue
            if len(uses) == 1:
                u, attr = present[0]
                out[name] = per_module[u][attr]
            elif is_tied(uses):
                out[name] = _tied_norm_sq(present, records)
            else:
                out[name] = self._shared_per_example(present, records).flatten(1).pow(2).sum(1)
        return out

    def rounding_margins(self) -> dict[str, Tensor]:
        """Parameter name -> (B,) r_i: how far, at most, the rounding of this backward's
        sums moves example i's contribution to that parameter, divided by c_i (the bounds
        of its uses whose sums round, added). Empty unless ``sum_rounding="bounded"`` and
        some record is bf16. The engine clips ||g_i|| + sqrt(sum r_i^2) instead of
        ||g_i|| for an example it scales (docs/engine.md, "Precision")."""
        out: dict[str, Tensor] = {}
        if not self._bounds:  # nothing rounds (the default): no walk over the parameters
            return out
        for name, uses in self._trained_groups():
            if len(uses) > 1 and not is_tied(uses):
                continue  # summed from per-example gradients in float32: no rounding
            for u, attr in uses:
                bound = self._bounds.get(u, {}).get(attr)
                if bound is not None:
                    out[name] = bound if name not in out else out[name] + bound
        return out

    def _held_norms_sq(self) -> dict[Use, dict[str, Tensor]]:
        """Squared norms of the per-example gradients formed so far: those in the streamed
        modules' buffer from one split of it (streaming.Slots), any others one by one."""
        slots = getattr(self.per_example, "slots", None)
        if slots is None:
            return {u: _squared_norms(grads) for u, grads in self.per_example.items()}
        from_buffer = slots.squared_norms()
        out = {}
        for u, grads in self.per_example.items():
            out[u] = {}
            for k, v in grads.items():
                held = slots.holds(u, k, v)  # else a copy of its own (Slots.hold)
                out[u][k] = from_buffer[(u, k)] if held else _squared_norms({k: v})[k]
        return out

    def _module_norms_sq(self, use: Use, a: Tensor, g: Tensor, keep: bool) -> dict[str, Tensor]:
        if self.ghost(use, a, g):
            return self.rule(use).norms_sq(use.module, *for_rule(self.rule(use), a, g), True)
        per_example = self.rule(use).per_example(use.module, *for_rule(self.rule(use), a, g))
        if keep:  # reused for the clipped sum
            self.per_example[use] = per_example
        return _squared_norms(per_example)

    def _shared_per_example(self, present, records: Records) -> Tensor:
        """Sum over uses of the per-example gradients of one shared parameter."""
        total = None
        for u, attr in present:
            a, g = for_rule(self.rule(u), *records[u])
            part = self.rule(u).per_example(u.module, a, g)[attr]
            total = part if total is None else total + part
        return total

    # -- weighted sums ----------------------------------------------------------------------

    def weighted_sum(
        self, name: str, records: Records, c: Tensor, cache: dict, formed: Collection[Use] = ()
    ) -> Tensor:
        """sum_i c_i grad_i of parameter ``name`` from its uses' records (``cache``: the
        rules' whole-module sums, keyed by (use, id(c))). ``formed``: uses whose sum is
        taken over their per-example gradients formed from the record, as the step forms
        a streamed module's (the self-check asks for it so).

        Each part of ``cache`` this parameter read is dropped from it: a rule's sum gives
        all of a module's parameters at once, and the module's other parameters still
        find theirs, but no part outlives its one reader. (The self-check asks for every
        parameter in one backward: kept, the parts added up to a float32 copy of every
        gradient, alive at the check's peak.)
        """
        present = [(u, attr) for u, attr in self.groups[name] if self.recorded(u, records)]
        grad = self._weighted_sum_of(name, present, records, c, cache, formed)
        for u, attr in present:
            key = (u, id(c))
            parts = cache.get(key)
            if parts is not None:
                parts.pop(attr, None)
                if not parts:
                    del cache[key]
        return grad

    def drain(
        self, records: Records, factor_of: Callable[[str], Tensor]
    ) -> Iterator[tuple[str, Tensor]]:
        """Yield (parameter name, sum_i c_i grad_i), one parameter at a time, from the
        stored (a, g); ``factor_of(name)`` -> c.

        Consumes ``records``: a module's record (with its recorded calls and per-example
        gradients) is dropped as soon as every parameter that reads it has its sum, so
        book-keeping never holds all records and all sums at once.
        """
        pending: dict[Use, int] = defaultdict(int)
        groups = self._trained_groups()
        for _, uses in groups:
            for u, _ in uses:
                if self.recorded(u, records):
                    pending[u] += 1
        # rule.clipped_sum gives all of a module's parameters at once; kept per factor
        # tensor, since per-layer clipping may give a module's parameters different ones
        sums: dict[tuple[Use, int], dict[str, Tensor]] = {}
        splits: dict = {}  # the last scaled record split (tensor_cores.split_cache)
        for name, uses in groups:
            present = [(u, attr) for u, attr in uses if self.recorded(u, records)]
            if not present:
                continue
            with split_cache(splits):
                grad = self._weighted_sum_of(name, present, records, factor_of(name), sums)
            yield name, grad
            del grad
            for u, _ in present:
                pending[u] -= 1
                if pending[u] == 0:
                    records.pop(u, None)
                    self.per_example.pop(u, None)
                    u.calls.clear()
                    for key in [k for k in sums if isinstance(k, tuple) and k[0] is u]:
                        del sums[key]
        splits.clear()

    def accumulation_bound(self, name: str, records: Records, weights: Tensor) -> Tensor | None:
        """How far autograd's gradient of parameter ``name`` for these example weights may
        lie from the exact sum where its kernels add in low precision (the rules'
        :meth:`~dptrain.clipping.rules.LayerRule.accumulation_bound`, summed over the uses
        recorded; each use's kernel adds its own terms). None where no rule gives one."""
        total = None
        for u, attr in self.groups[name]:
            if u not in records:  # streamed: per-example gradients formed, no record
                continue
            a, g = for_rule(self.rule(u), *records[u])
            part = self.rule(u).accumulation_bound(u.module, a, g, weights).get(attr)
            if part is not None:
                total = part if total is None else total + part
        return total

    def _weighted_sum_of(
        self, name, present, records: Records, c: Tensor, sums: dict, formed: Collection[Use] = ()
    ) -> Tensor:
        if len(self.groups[name]) > 1 and not is_tied(self.groups[name]):
            return weighted_sum({name: self._shared_per_example(present, records)}, c)[name]
        grad = None
        for u, attr in present:
            if u in self.per_example:
                part = self._held_sum(u, attr, c, sums)
            else:
                key = (u, id(c))
                if key not in sums:
                    rule = self.rule(u)
                    a, g = for_rule(rule, *records[u])
                    if u in formed:
                        sums[key] = weighted_sum(rule.per_example(u.module, a, g), c)
                    else:
                        # one rounded GEMM only where the factors absorbed this record's bound
                        with one_gemm_sums(u in self._bounds):
                            sums[key] = rule.clipped_sum(u.module, a, g, c)
                part = sums[key][attr]
            if grad is None:
                grad = part
            elif grad.dtype == torch.promote_types(grad.dtype, part.dtype) and (
                grad.shape == part.shape
            ):
                # in place: each (use, attribute) part has this one reader, and a tied
                # embedding's parts are the largest float32 tensors the step forms (1 GB
                # each on a 1B model's 128k-token table); a third copy would be its peak
                grad.add_(part)
            else:
                grad = grad + part
        return grad

    def _held_sum(self, use: Use, attr: str, c: Tensor, sums: dict) -> Tensor:
        """sum_i c_i grad_i of a formed per-example gradient. Those in the streamed modules'
        buffer are summed all at once for the first factors asked for (one product; the
        result, one parameter-sized vector, is kept in ``sums`` until the drain ends);
        per-layer clipping's other factors, and gradients outside it, one by one."""
        v = self.per_example[use][attr]
        slots = getattr(self.per_example, "slots", None)
        if slots is not None and slots.holds(use, attr, v):
            held = sums.get("streamed")
            if held is None:
                held = sums["streamed"] = (c, slots.weighted_sums(c))
            if held[0] is c:
                return held[1][(use, attr)]
        return weighted_sum({attr: v}, c)[attr]


def _tied_norm_sq(present, records: Records) -> Tensor:
    """||sum_k X_k^T G_k + sum_l G_out,l^T H_l||^2: phantom clipping (DESIGN.md).

    The embedding uses (lookups) are concatenated along tokens, as are the
    linear uses (output layers): both gradients are sums over tokens. Then
    ||X^T G_in||^2 + ||G_out^T H||^2 + 2 <X^T G_in, G_out^T H>; adding the two
    ghost norms alone would drop the cross term and be wrong.
    """
    embs = [u for u, _ in present if isinstance(u.rule, EmbeddingRule)]
    lins = [u for u, _ in present if not isinstance(u.rule, EmbeddingRule)]
    total = 0
    if embs:
        x = _cat([records[u][0] for u in embs])
        g_in = _cat([u.rule.masked(u.module, *for_rule(u.rule, *records[u])) for u in embs])
        total = total + embedding_ghost_norm(x, g_in)
    if lins:
        h = _cat([records[u][0] for u in lins])
        g_out = _cat([records[u][1] for u in lins])  # (a copy of a 49,152-wide head: avoid)
        total = total + gram_inner(h, g_out)
    if embs and lins:
        total = total + 2 * phantom_cross_term(x, g_in, h, g_out)
    return total


def _squared_norms(per_example: dict[str, Tensor]) -> dict[str, Tensor]:
    """{name: (B,) squared norms} of per-example gradients {name: (B, *shape)}; those kept
    in bf16 (streaming.Slots) squared and summed in float32, as stored."""
    return {
        k: (
            torch.linalg.vector_norm(v.flatten(1), dim=1, dtype=torch.float32).square()
            if v.dtype in LOW_PRECISION
            else v.flatten(1).pow(2).sum(1)
        )
        for k, v in per_example.items()
    }


def _cat(parts: list[Tensor]) -> Tensor:
    """Concatenation along tokens; one part is returned as it is (no copy)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)
