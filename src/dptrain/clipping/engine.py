"""The clipping engine: per-example clipping without per-example gradients.

Attach it to a model; every forward pass (with grad enabled) records each
clippable module's input ``a`` and where its output enters the autograd graph
(a gradient edge: holding the output itself would keep e.g. the (B, T, vocab)
logits alive until the backward). Then, given the
per-example losses L_i (B,), :meth:`ClippingEngine.backward`

1. takes the gradient of sum_i L_i w.r.t. the recorded outputs only
   (``torch.autograd.grad``: autograd skips the parameter-gradient kernels),
   so row i of each output gradient ``g`` belongs to example i; modules with
   small per-example gradients (LoRA, norm layers) form them as their g
   arrives and keep neither g nor a ("streamed", :mod:`dptrain.clipping.streaming`);
2. computes every example's gradient norm per parameter from (a, g) with the
   layer rules (ghost norm or instantiation, chosen per layer by cost), with
   phantom clipping for an embedding tied to an output layer;
3. turns norms into clip factors c_i (flat, automatic, or per layer);
4. adds the clipped sum sum_i c_i grad_i into ``p.grad``, either by
   book-keeping (from the stored a and g, no second backward; Bu et al. 2023)
   or by a second backward of sum_i c_i L_i (ghost clipping, Li et al. 2022).
   A float16/bfloat16 parameter's sum is kept in float32 beside its ``p.grad``
   (which holds it rounded): the optimizer noises the float32 sum and casts
   after (:meth:`ClippingEngine.clipped_sum`).

``p.grad`` accumulates over calls, so a logical batch can be processed in
physical chunks; the DP optimizer then adds the noise once and steps.

None of this is private unless every recorded row belongs to one example and
every gradient path into a clipped parameter passes through a recorded call.
The engine never infers that from a size that may coincide (docs/engine.md,
"Which rows are examples"):

- each backward walks the losses' autograd graph and refuses a parameter used
  outside its modules' recorded calls (:mod:`dptrain.clipping.graph_check`);
- each recorded call gets an example layout (rows, blocks of rows, or a table
  shared by all examples); the first time a layout pattern or a graph signature
  is seen, the chunk is checked in full (:mod:`dptrain.clipping.self_check`,
  :mod:`dptrain.clipping.independence`), with subsets of the chunk that separate
  every ordered pair of examples: the masked loss's gradient must be exactly zero
  on the rows of the examples left out, the rules' masked sum must equal
  autograd's, and re-runs with the left-out examples replaced must leave the
  kept examples' inputs bitwise unchanged. A mismatch refuses the model, naming
  the module;
- rows that the data decide (selections by index values, data-dependent row
  counts) are rows-checked on every chunk (:mod:`dptrain.clipping.decisions`).

Across steps: a training forward must leave the model's buffers and parameters as
it found them, and BatchNorm must use its running statistics; state written from a
batch reaches later steps past every per-step bound (:mod:`dptrain.clipping.state`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from dptrain._checks import check_positive
from dptrain._gc import collector_paused
from dptrain.clipping import independence, self_check, shared_table
from dptrain.clipping.decisions import RowDecisions
from dptrain.clipping.errors import UnclippedGradientError, UnsupportedModelError
from dptrain.clipping.functions import CLIPPING_FUNCTIONS, automatic_factors, flat_factors
from dptrain.clipping.grad_store import GradStore, ParameterSharding
from dptrain.clipping.graph_check import grad_node, interior, output_edge, parameter_uses
from dptrain.clipping.precision import LOW_PRECISION, upcast
from dptrain.clipping.records import (
    AutocastCopies,
    Call,
    Use,
    build_records,
    detached,
    in_backward,
    low_precision,
    tensor_inputs,
)
from dptrain.clipping.replay import ReplayRule
from dptrain.clipping.rules import EmbeddingRule, LayerRule, find_rule, is_trainable, param_of
from dptrain.clipping.state import (
    StateSnapshot,
    StateWatch,
    batch_statistics_refusal,
    state_refusal,
    uses_batch_statistics,
)
from dptrain.clipping.streaming import Streaming
from dptrain.clipping.sums import NormsAndSums
from dptrain.clipping.units import UnitIndex, unit_index

__all__ = [
    "CLIPPING_MODES",
    "NORM_METHODS",
    "SUM_ROUNDINGS",
    "ClipStats",
    "ClippingEngine",
    "UnclippedGradientError",
    "UnsupportedModelError",
]

#: How the clipped sum is formed: one backward (book-keeping) or two (ghost).
CLIPPING_MODES = ("book_keeping", "ghost")
#: How per-example norms of linear layers are computed.
NORM_METHODS = ("auto", "ghost", "instantiate")
#: How clipped sums of bf16 records are formed (tensor_cores.py): exactly (two GEMMs) or
#: as one GEMM whose rounding the clip factors absorb.
SUM_ROUNDINGS = ("exact", "bounded")


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
        norm_method: ``"auto"`` picks ghost or instantiation per linear layer:
            ghost where an example's gradient is larger than its record,
            d_in d_out > T (d_in + d_out) (``LinearRule.ghost_is_cheaper``);
            ``"ghost"``/``"instantiate"`` force one.
        gamma: the stabiliser of automatic clipping.
        layer_max_grad_norms: per-layer thresholds {group name: C_l} for
            per-layer clipping; default C / sqrt(number of groups) each.
        sum_rounding: for bf16 records of linear layers, ``"exact"`` (default: each
            example's contribution is exactly c'_i grad_i, c'_i <= c_i; two bf16 GEMMs
            on CUDA) or ``"bounded"`` (one bf16 GEMM on the rounded scaled operand; a
            bound R_i on what rounding moves is added to the norm a scaled example is
            clipped at, c_i = C / (||g_i|| + R_i), so one record still moves the sum by
            at most C; clipped examples' factors are smaller by R_i / ||g_i||, a few
            percent at T 128-512). docs/engine.md, "Precision".
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
        sum_rounding: str = "exact",
    ):
        self.max_grad_norm = check_positive("max_grad_norm", max_grad_norm)
        _check_choice("sum_rounding", sum_rounding, SUM_ROUNDINGS)
        _check_choice("clipping", clipping, CLIPPING_FUNCTIONS)
        _check_choice("mode", mode, CLIPPING_MODES)
        _check_choice("norm_method", norm_method, NORM_METHODS)
        if clipping == "per_layer" and mode == "ghost":
            raise ValueError(
                "clipping='per_layer' needs mode='book_keeping': a second backward of "
                "sum_i c_i L_i can apply only one factor per example"
            )
        self.model = model
        # A model sharded across ranks (FSDP2): where autograd's parameters are (shard()).
        self._sharding: ParameterSharding | None = None
        self._shards: dict[str, nn.Parameter] = {}
        self.clipping = clipping
        self.mode = mode
        # Whether this backward forms the clipped sum from the records (book-keeping, and
        # ghost on a low-precision chunk) or by ghost's second backward; set per backward.
        self._sum_from_records = mode == "book_keeping"
        self.norm_method = norm_method
        self.sum_rounding = sum_rounding
        self.gamma = check_positive("gamma", gamma)
        self._uses = self._plan(model)
        self._groups = self._group_params()
        self.layer_max_grad_norms = self._layer_thresholds(layer_max_grad_norms)
        self._batch_shape: tuple[int, ...] | None = None
        # Norms and weighted sums from each backward's records, with the per-example
        # gradients of instantiated modules kept for the sum (sums.py) ...
        self._norms_sums = NormsAndSums(self._groups, norm_method, sum_rounding)
        # ... and the modules whose per-example gradients are formed during the backward
        # as their output gradients arrive (streaming.py).
        shared = {id(self.parameter(n)) for n, uses in self._groups.items() if len(uses) > 1}
        self._streaming = Streaming(
            list(self._uses.values()),
            shared,
            self._norms_sums.ghost,
            lambda: self._norms_sums.per_example,
        )
        # Linear layers' float32 inputs as autocast computed with them (records.py).
        self._autocast_copies = AutocastCopies()
        # True while a replaying rule re-runs modules: those forwards are not new calls.
        self._replaying = False
        # The root call's inputs (detached) and, during an independence check's re-run, the
        # first input of each clipped module's calls (independence.py).
        self._root_inputs: tuple | None = None
        self._root_random_state: tuple | None = None
        self._probe: dict[Use, list] | None = None
        self._probe_pool: independence.SummaryPool | None = None
        # What is known about which rows are whose, and what each chunk must establish.
        self._rows = RowDecisions()

        self.self_checks = 0
        """How many chunks were checked exactly so far (new layout patterns)."""
        self.streamed: tuple[str, ...] = ()
        """Modules whose per-example gradients the last backward formed as their output
        gradients arrived, dropping those (streaming.py)."""
        # The clipped sums in p.grad (float32 beside a low-precision one), and which
        # p.grad the engine wrote: grad_store.py.
        self._store = GradStore()
        # The summed, unclipped gradient of a privacy unit spanning chunks (add_to_unit).
        self._open_unit: dict[str, Tensor] | None = None
        # State written by a training forward carries its records into later steps
        # (state.py): the model's state when the running training forward began, else None.
        self._state = StateWatch(model)
        self._state_before: StateSnapshot | None = None
        self._handles = [
            model.register_forward_pre_hook(self._root_pre_hook, with_kwargs=True),
            model.register_forward_hook(self._root_hook, with_kwargs=True),
        ]
        # BatchNorm is fine where it uses its running statistics; whether it does is a
        # matter of its mode at each call, not of its type.
        self._handles += [
            m.register_forward_pre_hook(self._make_batch_norm_check(name))
            for name, m in model.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)
        ]
        # The leaves the last losses' graph reaches other than the clipped parameters
        # (_live_calls): the backward requests them so that streamed modules' nodes run.
        self._leaves: list = []
        for use in self._uses.values():
            if use.rule.forward_pre_hook is not None:
                self._handles.append(
                    use.module.register_forward_pre_hook(
                        use.rule.forward_pre_hook, with_kwargs=True
                    )
                )
            if use in self._streaming.streamable:
                tap = self._streaming.tap(use, self._recording)
                self._handles.append(use.module.register_forward_pre_hook(tap, with_kwargs=True))
            if _casts_as_linear(use):  # after the tap: it may tie the input to the anchor
                self._handles.append(
                    use.module.register_forward_pre_hook(self._shared_cast, with_kwargs=True)
                )
            self._handles.append(
                use.module.register_forward_hook(self._make_hook(use), with_kwargs=True)
            )

    # -- set-up: which parameters, which rules ------------------------------------------

    def _plan(self, model: nn.Module) -> dict[nn.Module, Use]:
        uses: dict[nn.Module, Use] = {}
        covered: set[int] = set()
        in_subtree: set[int] = set()  # modules whose parameters an ancestor's rule covers
        reasons = []

        def add(name: str, module: nn.Module, rule: LayerRule) -> None:
            for attr in rule.param_names:
                p = param_of(module, attr)
                if is_trainable(p):
                    covered.add(id(p))  # reported below if the module is refused
            why = rule.check(module)
            if why is not None:
                reasons.append(f"{name or '<model>'} ({type(module).__name__}): {why}")
            else:
                uses[module] = Use(name, module, rule)

        # Written rules first (parents before children, so a rule that covers its
        # submodules' parameters is seen before them) ...
        for name, module in model.named_modules():
            if id(module) in in_subtree:
                continue
            rule = find_rule(module)
            if rule is None:
                continue
            if getattr(rule, "replays", False):
                rule = rule.for_module(module)
            claimed = rule.claimed_modules(module)
            in_subtree.update(id(m) for m in claimed)
            if any(p.requires_grad for p in module.parameters(recurse=False)) or (
                claimed and any(is_trainable(param_of(module, n)) for n in rule.param_names)
            ):
                add(name, module, rule)
        # ... then the generic rule (replay.py) for trainable parameters no rule covers,
        # guarded like any rule by the exact check. A parameter tied to one a written
        # rule covers (BERT's prediction-head bias, the decoder's) is not replayed.
        for name, module in model.named_modules():
            if id(module) in in_subtree or module in uses or not ReplayRule.applies_to(module):
                continue
            left = tuple(
                n
                for n, p in module.named_parameters(recurse=False)
                if p.requires_grad and id(p) not in covered
            )
            if left:
                add(name, module, ReplayRule(left))
        missing = _grouped_by_type(
            model,
            [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in covered],
        )
        if reasons or missing:
            parts = []
            if missing:
                parts.append(
                    "no per-example clipping rule for these trainable parameters, by module "
                    "type: " + "; ".join(missing)
                )
            if reasons:
                parts.append("modules that cannot be clipped exactly: " + "; ".join(reasons))
            raise UnsupportedModelError(
                "dptrain refuses to train this model: "
                + ". ".join(parts)
                + ". Freeze them (requires_grad=False), replace the modules, or register a "
                "rule with dptrain.clipping.register_rule." + _recurrent_hint(model, covered)
            )
        return uses

    def _group_params(self) -> dict[str, list[tuple[Use, str]]]:
        """Parameter name -> its uses [(module use, attribute)]; shared parameters have several."""
        by_param: dict[int, list[tuple[Use, str]]] = defaultdict(list)
        names: dict[int, str] = {}
        for use in self._uses.values():
            for attr in use.rule.param_names:
                p = param_of(use.module, attr)
                if is_trainable(p):
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
    def _group_of(param_name: str, uses: list[tuple[Use, str]]) -> str:
        """Per-layer clipping group: the module, or the parameter itself when shared."""
        return uses[0][0].name if len(uses) == 1 else param_name

    @property
    def parameter_names(self) -> list[str]:
        """Names of the parameters the engine clips."""
        return list(self._groups)

    @property
    def module_rules(self) -> dict[str, LayerRule]:
        """{module name: the rule that clips it}, one per clipped module."""
        return {u.name: u.rule for u in self._uses.values()}

    def shard(self, sharding: ParameterSharding, store: GradStore) -> None:
        """Clip a model whose parameters are sharded across ranks (FSDP2).

        ``sharding`` maps each parameter (the shard the optimizer holds) to the tensor
        autograd's graph holds (:mod:`dptrain.distributed.fsdp`); ``store`` takes the
        clipped sums (reduced over the ranks into each rank's shard:
        :mod:`dptrain.distributed.sharded_sums`). Every rank then adds every parameter's
        sum in one order, and the sums are always formed from the records (ghost's
        second backward would go through FSDP's own, unclipped, gradient path).
        """
        if self._open_unit is not None or self._uses_with_calls():
            raise RuntimeError("shard() must be called before the first forward pass")
        # The shards, as registered now: while a module runs (or stays unsharded after
        # its backward) FSDP registers the unsharded parameter in their place.
        self._shards = {name: self.parameter(name) for name in self._groups}
        self._sharding = sharding
        self._store = store

    def _uses_with_calls(self) -> bool:
        return any(u.calls for u in self._uses.values())

    def graph_parameter(self, name: str) -> Tensor:
        """The clipped parameter called ``name`` as autograd's graph holds it: the
        parameter itself, or under FSDP2 the unsharded tensor its module's forward used."""
        p = self.parameter(name)
        return p if self._sharding is None else self._sharding.graph_parameter(p)

    def parameters(self) -> list[nn.Parameter]:
        """The parameters the engine clips (every trainable parameter of the model)."""
        return [self.parameter(name) for name in self._groups]

    # -- hooks ----------------------------------------------------------------------------

    def _root_pre_hook(self, module, args, kwargs):
        if in_backward() or self._probe is not None:
            # activation checkpointing re-runs a forward inside the backward; the
            # independence check re-runs the model (independence.py)
            return
        self._state_before = (
            self._state.snapshot() if torch.is_grad_enabled() and not self._replaying else None
        )
        self._batch_shape = _batch_shape_of(args, kwargs)
        self._root_inputs = detached((args, kwargs))
        self._autocast_copies.clear()
        # The random state this forward starts from: the independence check's re-runs
        # start from it too, so they draw what this forward drew (dropout masks, branches).
        self._root_random_state = independence.random_state(self.model)

    def _root_hook(self, module, args, kwargs, output):
        # the float32 inputs the copies were made from may go now
        self._autocast_copies.clear()
        before, self._state_before = self._state_before, None
        if before is None or in_backward() or self._probe is not None or self._replaying:
            return None
        written = self._state.written(before)
        if written:
            # Refused before any gradient reaches p.grad: the forward itself raises.
            self.clear()
            raise UnsupportedModelError(state_refusal(written))
        return None

    def _make_batch_norm_check(self, name: str):
        def check(module, args):
            if in_backward() or self._replaying or self._probe is not None:
                return None
            # Also under no_grad inside a training forward (a frozen front end): batch
            # statistics mix the examples' inputs to the modules after it.
            training = torch.is_grad_enabled() or self._state_before is not None
            if training and uses_batch_statistics(module):
                self.clear()
                raise UnsupportedModelError(batch_statistics_refusal(name, module))
            return None

        return check

    def _shared_cast(self, module, args, kwargs):
        """Hand a linear layer under autocast the shared bf16 copy of its float32 input
        (records.AutocastCopies.shared), which its product then saves and its record reads,
        instead of a cast of its own."""
        # cheapest tests first: most calls (an adapter's lora_B, a bf16 model) end at one
        x = args[0] if args else None
        if not isinstance(x, Tensor) or x.dtype is not torch.float32:
            return None
        kind = x.device.type
        if not torch.is_autocast_enabled(kind) or torch.get_autocast_dtype(kind) is not (
            torch.bfloat16
        ):
            return None
        if not self._recording():
            return None
        return (self._autocast_copies.shared(x), *args[1:]), kwargs

    def _make_hook(self, use: Use):
        # what the rule says about its records, read once: this hook runs on every call
        rule = use.rule
        replays = getattr(rule, "replays", False)
        from_graph = getattr(rule, "lookup_from_graph", False)
        low_precision_records = getattr(rule, "low_precision_records", False)
        embedding = isinstance(rule, EmbeddingRule)

        def hook(module, args, kwargs, output):
            # A forward re-run inside a backward (activation checkpointing recomputes a
            # block's activations) is not a new call: recording it would count it twice.
            if self._replaying or in_backward():
                return None
            if self._probe is None and not torch.is_grad_enabled():
                return None
            inputs = tensor_inputs(args, kwargs)
            if self._probe is not None:  # a re-run for the independence check: inputs only
                if inputs:
                    summary = independence.summary(inputs[0], self._probe_pool)
                    self._probe.setdefault(use, []).append(summary)
                return None
            full_output, output = output, rule.output_of(module, output)
            if output is None:
                kind = type(full_output).__name__
                use.unrecorded = (
                    f"it has no written rule and returns a {kind}, not a tensor, so the "
                    "generic rule cannot replay it"
                    if isinstance(rule, ReplayRule)
                    else f"its rule found no output tensor in a {kind}"
                )
                return None
            if not output.requires_grad:
                # Its parameters were frozen after the engine was built and its input
                # needs no gradient: this call gives no parameter a gradient to clip.
                return None
            if replays:
                return self._record_replayed(use, module, args, kwargs, output, inputs)
            if not inputs:
                raise UnsupportedModelError(
                    f"module {use.name} ({type(module).__name__}) was called without a tensor "
                    "input: the engine has nothing to compute its per-example gradients from"
                )
            a = rule.recorded_input(module, inputs)
            in_nodes = [grad_node(t) for t in inputs]
            edge_node = None
            if from_graph:
                edge_node = _lookup_node(output, module.weight, in_nodes)
                if edge_node is None:
                    raise UnsupportedModelError(
                        f"module {use.name} ({type(module).__name__}): no embedding lookup of its "
                        "weight was found in its forward, so the rule for it does not apply"
                    )
                a = edge_node._saved_indices
                if edge_node is output.grad_fn:
                    edge_node = None  # the lookup's output is the module's: as a plain Embedding
            if edge_node is not None:
                # Rows scaled (or otherwise changed) after the lookup: record the gradient
                # with respect to the looked-up rows themselves, (*ids.shape, d).
                if a.dim() == 0:
                    raise UnsupportedModelError(
                        f"module {use.name} ({type(module).__name__}) changes the row of a table "
                        "shared by all examples (scalar ids) after looking it up: not supported"
                    )
                edge = GradientEdge(edge_node, 0)
                out_shape = (*a.shape, module.weight.shape[1])
            else:
                edge = output_edge(output)
                out_shape = tuple(output.shape)
            if low_precision_records and edge_node is None:
                a = self._autocast_copies.of(a)
            call_index = len(use.calls)
            use.calls.append(
                Call(
                    index=call_index,
                    # without its graph; one that has none (ids, autocast's copy) as it is:
                    # a detach is an aten op per call and step, for no change
                    a=a.detach() if a.requires_grad else a,
                    edge=edge,
                    out_shape=out_shape,
                    in_nodes=in_nodes,
                    # ids all examples may share ((T,) or (1, T): positions, a soft prompt's
                    # arange(K)): the output stays as the module returned it, and the backward
                    # reads the examples' rows where it is broadcast (shared_table.py)
                    shared=embedding and shared_table.looks_shared(tuple(a.shape), out_shape),
                    low_precision=low_precision(a, output),
                )
            )
            return None

        return hook

    def _record_replayed(self, use: Use, module, args, kwargs, y: Tensor, inputs) -> None:
        """Record a call of a module whose rule replays it (replay.py): all its inputs."""
        try:
            bd = use.rule.batch_dim(module, args, kwargs)
        except ValueError as e:
            raise UnsupportedModelError(f"module {use.name} ({type(module).__name__}): {e}") from e
        a = inputs[0] if inputs else y.new_zeros(y.shape[bd])
        use.calls.append(
            Call(
                index=len(use.calls),
                a=a.detach().movedim(bd, 0) if a.dim() > bd else a.detach(),
                edge=get_gradient_edge(y),
                out_shape=tuple(y.movedim(bd, 0).shape),
                in_nodes=[grad_node(t) for t in inputs],
                batch_dim=bd,
                inputs=detached((args, kwargs)),
                low_precision=low_precision(a, y),
            )
        )

    def _probe_inputs(self, args: tuple, kwargs: dict) -> dict[Use, list]:
        """Run the model on (args, kwargs) without gradients; a summary of each clipped
        module's first input per call (independence.summary). What the last forward
        recorded is left as it was."""
        self._probe = {}
        self._probe_pool = independence.SummaryPool()
        try:
            with torch.no_grad():
                self.model(*args, **kwargs)
            return self._probe
        finally:
            self._probe = None
            self._probe_pool = None

    def detach(self) -> None:
        """Remove the hooks; the model is then an ordinary model again."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.clear()

    def clear(self) -> None:
        """Forget what the last forward recorded."""
        for use in self._uses.values():
            use.calls.clear()
        self._autocast_copies.clear()
        self._norms_sums.clear()
        self._leaves = []  # their nodes hold the leaves (an input that needs a gradient)

    def _recording(self) -> bool:
        """Whether the running forward is one the engine records: with gradients, and not a
        recomputation inside a backward, a rule's replay or an independence re-run."""
        return (
            torch.is_grad_enabled()
            and not in_backward()
            and not self._replaying
            and self._probe is None
        )

    @contextmanager
    def _replaying_calls(self) -> Iterator[None]:
        """While a replaying rule re-runs its module: those forwards are not new calls."""
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False

    # -- the clipped backward -------------------------------------------------------------

    def backward(
        self, losses: Tensor, loss_scale: float = 1.0, units: Tensor | None = None
    ) -> ClipStats:
        """Add sum_i c_i grad L_i to each parameter's ``.grad``; return the clipping figures.

        ``losses`` are the per-example losses (B,) of the last forward pass.
        ``loss_scale`` K: the losses carry a loss scale (mixed precision); clipping
        is then at C K (Li et al. 2022, App. T) and the optimizer unscales.
        ``units``: an id per example (B,); examples with the same id are one privacy unit
        (a user), whose summed gradient is clipped as one (units.py). The figures are then
        per unit, in order of first appearance.

        Python's garbage collector is held off while it runs (:mod:`dptrain._gc`).
        """
        with collector_paused():
            return self._backward(losses, loss_scale, units)

    def _backward(self, losses: Tensor, loss_scale: float, units: Tensor | None) -> ClipStats:
        if losses.dim() != 1:
            raise ValueError(
                f"losses has shape {tuple(losses.shape)}: expected per-example losses of shape (B,)"
            )
        threshold = self.max_grad_norm * check_positive("loss_scale", loss_scale)
        b = losses.shape[0]
        index = None if units is None else unit_index(units, b)
        if self._open_unit is not None:
            raise RuntimeError(
                "a privacy unit spanning several chunks is still open (add_to_unit): call "
                "close_unit() before the next chunk"
            )
        try:
            self._check_untouched_grads()
            live = self._live_calls(losses) if b and losses.requires_grad else {}
            active = [u for u in self._uses.values() if live.get(u)]
            if not active:
                self.clear()
                zeros = torch.zeros(b if index is None else index.num_units)
                return ClipStats(zeros, zeros, self.max_grad_norm)
            shape = self._batch_shape or (b,)
            new_patterns, by_data = self._rows.layouts(active, live, b, shape)
            check = self._rows.needs_full_check(new_patterns, b)
            if self._sharding is not None:
                # Every pass gathers parameters from all ranks, so every rank must run the
                # same passes: one decision for all. Rows the data decide get the full
                # check (its passes depend on b alone, equal on all ranks) on every chunk.
                check = self._sharding.any_rank(
                    check or bool(by_data) or bool(self._rows.selections)
                )
            if check:  # before the output gradients exist: the re-runs need their memory
                independence.run(_CheckView(self), active, b)
            else:  # rows that the data decide: the rows check on every chunk
                by_data += self._rows.below_selections(losses, live, by_data, b, shape)
                if by_data:
                    self_check.rows(_CheckView(self), losses, by_data, retain=True)
            calls = [(u, c) for u in active for c in live[u]]
            # Ghost's second backward would form sum_i c_i g_i in the calls' own precision:
            # in bf16 that sum differs from the one whose norms were clipped (one record
            # moved it by 1.002 C in tests/clipping/test_mixed_precision.py). Such a chunk's
            # sum is formed from the float32 records, as book-keeping forms it.
            self._sum_from_records = (
                self.mode == "book_keeping"
                or self._sharding is not None
                or any(c.low_precision for _, c in calls)
                or any(p.dtype in LOW_PRECISION for p in self.parameters())
            )
            streamed = {u for u in active if self._streaming.streams(u, live[u], b)}
            self.streamed = tuple(u.name for u in active if u in streamed)
            if check:
                # Before the backward whose records are kept: each subset's backward holds
                # its own output gradients only until their parameters are compared, so
                # the check never holds this chunk's records beside the retained graph.
                self_check.run(_CheckView(self), losses, calls, streamed)
                self._rows.checked(new_patterns)
                self.self_checks += 1
            grads = self._streaming.output_gradients(
                losses,
                calls,
                streamed,
                b,
                self._leaves,
                retain=not self._sum_from_records,
            )
            records, self._norms_sums.views = build_records(
                active, live, grads, b, self._replaying_calls
            )
            # the records hold what is needed; the output gradients go as records are freed
            del grads
            if index is not None:  # one row per unit from here on (units.py)
                records = self._regrouped(records, index)
                # streamed modules' per-example gradients, formed already: summed per unit
                self._norms_sums.per_example = _per_unit(self._norms_sums.per_example, index)
                b = index.num_units
        except BaseException:
            self.clear()
            raise
        norms_sq = self._norms_sums.norms_sq(records, keep=self._sum_from_records)
        # What rounding the sums may add, per example (sum_rounding="bounded"): clipped with
        # the norm, so that the rounded contribution stays within C (tensor_cores.py).
        margins = self._norms_sums.rounding_margins()
        if self.clipping == "per_layer":
            factors, total = self._per_layer_factors(norms_sq, threshold, margins)
        else:
            total = (
                torch.stack(list(norms_sq.values())).sum(0).sqrt()
                if norms_sq
                else torch.zeros(b)  # the losses did not depend on any clipped parameter
            )
            margin = _root_sum_sq(margins.values())
            # without margins, the call clip_factors had before them: an override written
            # for (norms, loss_scale) keeps working where nothing rounds
            factors = (
                self.clip_factors(total, loss_scale)
                if margin is None
                else self.clip_factors(total, loss_scale, margin)
            )
        if not self._sum_from_records:
            self.clear()
            weights = factors if index is None else factors[index.inverse.to(factors.device)]
            # inputs=: only the clipped parameters; one made trainable after the engine was
            # built would get sum_i c_i g_i with c_i computed without it (not clipped).
            # (a parameter frozen since the engine was built needs no gradient)
            inputs = [p for p in self.parameters() if p.requires_grad]
            if inputs:
                (losses * weights.to(losses.dtype).detach()).sum().backward(inputs=inputs)
        else:
            self._book_keeping(records, factors)
            self.clear()
        self._mark_grads()
        return ClipStats(total.detach() / loss_scale, factors.detach(), self.max_grad_norm)

    def clip_factors(
        self, norms: Tensor, loss_scale: float = 1.0, margins: Tensor | None = None
    ) -> Tensor:
        """Flat or automatic clip factors for gradient norms (at C K, K the loss scale);
        ``margins``: what the sums' rounding may add to each scaled example's norm."""
        if self.clipping == "per_layer":
            raise ValueError("clipping='per_layer' has a factor per group, not one per norm")
        threshold = self.max_grad_norm * loss_scale
        if self.clipping == "flat":
            return flat_factors(norms, threshold, margins)
        return automatic_factors(norms, threshold, self.gamma * loss_scale, margins)

    def _regrouped(self, records, index: UnitIndex) -> dict[Use, tuple[Tensor, Tensor]]:
        """The records with one row per unit: its examples' tokens concatenated (units.py)."""
        out = {}
        for use, (a, g) in records.items():
            views = self._norms_sums.views
            if getattr(use.rule, "raw_layout", False) and use not in views:
                # channels-first (B, C, *spatial): unfold to (B, L, d) tokens first
                a, g = use.rule.unfold(use.module, a, g)
                views[use] = use.rule.unfolded_view()
            out[use] = (index.regroup(a), index.regroup(g))
        return out

    # -- a privacy unit spanning several chunks ------------------------------------------

    def add_to_unit(self, losses: Tensor) -> None:
        """Add the gradient of ``losses.sum()``, unclipped, to the open unit's sum.

        For a privacy unit (a user) whose examples do not fit in one chunk: every
        example of ``losses`` belongs to that one unit. Its summed gradient is held
        (one copy of the clipped parameters) until :meth:`close_unit` clips it as one.
        The whole gradient of the unit's loss is taken by autograd, so any use of a
        parameter, in any module, is included in the norm: this is exact for any model.
        """
        if losses.dim() != 1:
            raise ValueError(
                f"losses has shape {tuple(losses.shape)}: expected per-example losses of shape (B,)"
            )
        self.clear()  # the recorded calls are not needed: autograd gives the unit's gradient
        if self._open_unit is None:
            self._check_untouched_grads()
            self._open_unit = {}
        if not losses.requires_grad:
            return
        # (a parameter frozen since the engine was built needs no gradient)
        names = [n for n in self._groups if self.graph_parameter(n).requires_grad]
        grads = torch.autograd.grad(
            losses.sum(), [self.graph_parameter(n) for n in names], allow_unused=True
        )
        for name, grad in zip(names, grads, strict=True):
            if grad is not None:
                grad = upcast(grad.detach())
                held = self._open_unit.get(name)
                self._open_unit[name] = grad if held is None else held.add_(grad)

    def close_unit(self, loss_scale: float = 1.0) -> ClipStats:
        """Clip the open unit's summed gradient as one and add it to ``p.grad``."""
        if self._open_unit is None:
            raise RuntimeError("close_unit() without add_to_unit(): no privacy unit is open")
        held, self._open_unit = self._open_unit, None
        threshold = self.max_grad_norm * check_positive("loss_scale", loss_scale)
        norms_sq = {n: g.pow(2).sum().reshape(1) for n, g in held.items()}
        if not norms_sq:
            if self._sharding is not None:  # every rank reduces every sum (collectives)
                self._add_sums(())
                self._mark_grads()
            zeros = torch.zeros(1)
            return ClipStats(zeros, torch.ones(1), self.max_grad_norm)
        if self.clipping == "per_layer":
            factors, total = self._per_layer_factors(norms_sq, threshold)
        else:
            total = torch.stack(list(norms_sq.values())).sum(0).sqrt()
            factors = self.clip_factors(total, loss_scale)
        self._add_sums(
            (name, grad * self._factor_for(name, factors)) for name, grad in held.items()
        )
        self._mark_grads()
        return ClipStats(total.detach() / loss_scale, factors.detach(), self.max_grad_norm)

    # -- which rows are examples ----------------------------------------------------------

    def _live_calls(self, losses: Tensor) -> dict[Use, list[Call]]:
        """The recorded calls the losses depend on, after checking every parameter use.

        One walk over the losses' autograd graph (:mod:`dptrain.clipping.graph_check`):
        refuses reentrant checkpointing and any clipped parameter used outside its
        modules' recorded calls. Calls outside the graph (an evaluation forward with
        gradients enabled, a forward whose losses were not passed) are ignored.
        """
        ids = {name: id(self.graph_parameter(name)) for name in self._groups}
        # (the other leaves are kept for the backward, which requests them: streaming.py)
        uses_of, reentrant, seen, self._leaves = parameter_uses([losses.grad_fn], set(ids.values()))
        if reentrant:
            raise UnsupportedModelError(
                "dptrain refuses to train this model: it uses reentrant activation checkpointing "
                "(torch.utils.checkpoint with use_reentrant=True), whose recomputation runs a "
                "nested backward that adds unclipped gradients to p.grad. Use non-reentrant "
                "checkpointing: torch.utils.checkpoint.checkpoint(..., use_reentrant=False), or "
                "for a Hugging Face model gradient_checkpointing_enable("
                "gradient_checkpointing_kwargs={'use_reentrant': False})."
            )
        live: dict[Use, list[Call]] = {}
        inside: dict[int, dict[int, object]] = {}  # nodes held: their ids stay theirs
        for use in self._uses.values():
            calls = [c for c in use.calls if id(c.edge.node) in seen]
            if calls:
                live[use] = calls
                nodes = inside[id(use)] = {}
                for c in calls:
                    interior(c.edge.node, c.in_nodes, into=nodes)
        self._rows.read_graph(seen, set().union(*inside.values()))
        outside = {}
        for name, uses in self._groups.items():
            for node in uses_of.get(ids[name], ()):
                k = id(node)
                if not any(k in inside.get(id(u), ()) for u, _ in uses):
                    outside.setdefault(name, type(node).__name__)
        if outside:
            where = ", ".join(self._describe_use(name, node) for name, node in outside.items())
            raise UnsupportedModelError(
                "dptrain refuses to train this model: parameters used outside the forward "
                f"of the module that owns them: {where}. Their gradient through that use would "
                "escape per-example clipping. Move the computation into a module the engine "
                "clips (e.g. an nn.Linear), or register a rule for the module that uses them."
            )
        # Tables shared by all examples: their rows per example, where the batch is broadcast
        shared_table.resolve(live, seen, losses.shape[0])
        return live

    def _describe_use(self, name: str, node: str) -> str:
        use = self._groups[name][0][0]
        why = f"; {use.unrecorded}" if use.unrecorded else ""
        return f"{name} ({type(use.module).__name__}, in {node}{why})"

    # -- p.grad is the engine's alone until the step --------------------------------------

    def _mark_grads(self) -> None:
        self._store.mark(self.parameters())

    def _check_untouched_grads(self) -> None:
        """Refuse a ``p.grad`` the engine did not write (a plain backward, a stale gradient);
        note the parameters frozen since the engine was built (they get no gradient)."""
        touched, frozen = [], []
        for name in self._groups:
            p = self.parameter(name)
            if p.grad is not None and not self._store.wrote(p):
                touched.append(name)
            if not p.requires_grad:
                frozen.append(name)
        self._norms_sums.frozen = frozenset(frozen)
        if self._sharding is not None:  # FSDP's gradient sync is off: a plain backward
            # leaves its unclipped gradient in the unsharded parameters
            touched += [
                name
                for name in self._groups
                if (g := self.graph_parameter(name)) is not self.parameter(name)
                and g.grad is not None
            ]
        if touched:
            raise UnclippedGradientError(
                f"p.grad of {', '.join(touched)} holds a gradient the clipping engine did not "
                "write (a loss.backward() outside the engine, or a gradient left from the last "
                "step): it would reach the optimizer unclipped. Instead of loss.backward(), pass "
                "the per-example losses (reduction='none', one per record) to "
                "private.backward(losses) (ClippingEngine.backward), e.g. "
                "private.backward(F.cross_entropy(model(x), y, reduction='none')). Call "
                "optimizer.zero_grad() before each logical batch and pass every loss through "
                "the engine."
            )

    def check_gradients(self, params: list[nn.Parameter] | None = None) -> None:
        """Before a step: every ``p.grad`` is the engine's clipped sum, untouched since.

        ``params``: the optimizer's parameters; each trainable one, and each trainable
        parameter of the model, must be clipped by this engine (one made trainable after
        the engine was built is not). Raises
        :class:`UnsupportedModelError` otherwise (the DP optimizer calls this).
        """
        if self._open_unit is not None:
            raise RuntimeError(
                "a privacy unit spanning several chunks was never closed (add_to_unit without "
                "close_unit): its gradient is not in p.grad; process every chunk of the batch"
            )
        mine = {id(p) for p in self.parameters()}
        by_id = {id(p): n for n, p in self.model.named_parameters()}
        # The optimizer's and the model's: one the optimizer does not hold still leaves
        # the step with a gradient anything else may read (a second optimizer, a logger).
        candidates = {id(p): p for p in [*(params or []), *self.model.parameters()]}
        strays = [
            by_id.get(i, f"tensor of shape {tuple(p.shape)}")
            for i, p in candidates.items()
            if p.requires_grad and i not in mine
        ]
        if strays:
            raise UnsupportedModelError(
                f"trainable parameters the clipping engine does not clip: {', '.join(strays)} "
                "(made trainable after the engine was built?): they would be updated with "
                "noise only, or with unclipped gradients. Freeze them, or build the engine "
                "(make_private) after choosing what to train."
            )
        self._check_untouched_grads()

    # -- per-example gradients formed during the backward (streamed modules) -------------

    def _per_layer_factors(
        self,
        norms_sq: dict[str, Tensor],
        threshold: float,
        margins: dict[str, Tensor] | None = None,
    ):
        scale = threshold / self.max_grad_norm
        group_sq: dict[str, Tensor] = {}
        group_margins: dict[str, list[Tensor]] = {}
        for name, sq in norms_sq.items():
            gname = self._group_of(name, self._groups[name])
            group_sq[gname] = group_sq.get(gname, 0) + sq
            if margins and name in margins:
                group_margins.setdefault(gname, []).append(margins[name])
        factors = {
            gname: flat_factors(
                sq.sqrt(),
                self.layer_max_grad_norms[gname] * scale,
                _root_sum_sq(group_margins.get(gname, ())),
            )
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
        """sum_i c_i grad_i from the stored (a, g), added into ``p.grad`` one parameter at a
        time, each module's record freed once its parameters are done."""
        self._add_sums(
            self._norms_sums.drain(records, lambda name: self._factor_for(name, factors))
        )

    def _add_sums(self, sums: Iterable[tuple[str, Tensor]]) -> None:
        """Add each (parameter name, clipped sum) to its ``p.grad``, in the groups' order.

        A sharded model's store reduces every sum over the ranks (a collective): every
        rank then adds every clipped parameter in that order, None where its records
        reached none (a rank whose batch skipped an expert, for instance).
        """
        if self._sharding is not None:
            sums = _every_name(sums, list(self._groups))
        try:
            for name, grad in sums:
                self._store.add(self.parameter(name), grad)
                del grad
        finally:
            self._store.flush()

    def clipped_sum(self, p: nn.Parameter) -> Tensor | None:
        """The clipped sum the engine accumulated for ``p`` since its ``p.grad`` was last
        cleared: ``p.grad`` itself, or, for a float16/bfloat16 parameter, the float32 sum
        of which ``p.grad`` is the rounded copy. Noise it and divide in that precision,
        then cast (``DPOptimizer.add_noise``); None where ``p.grad`` is None.

        The float32 sum is returned only while ``p.grad`` is the copy the engine wrote
        (same tensor, same version); otherwise it is dropped and ``p.grad`` is returned.
        """
        return self._store.clipped_sum(p)

    def release_sums(self) -> None:
        """Drop the float32 sums kept beside low-precision ``p.grad`` (and a sharded
        model's reduced shards): the optimizer calls it once it has noised them and
        written the result into ``p.grad``. :meth:`clipped_sum` returns ``p.grad`` after."""
        self._store.release()

    def parameter(self, name: str) -> nn.Parameter:
        """The clipped parameter called ``name`` (see :attr:`parameter_names`): under
        FSDP2 the shard the optimizer holds (:meth:`graph_parameter`: autograd's)."""
        if self._sharding is not None:
            return self._shards[name]
        module, attr = self._groups[name][0]
        return param_of(module.module, attr)


class _CheckView:
    """The engine as its checks see it (:mod:`dptrain.clipping.check_interface`)."""

    def __init__(self, engine: ClippingEngine):
        self._engine = engine
        self.model = engine.model
        self.sums_from_records = engine._sum_from_records
        self.root_inputs = engine._root_inputs
        self.root_random_state = engine._root_random_state
        self.sizes_by_data = engine._rows.sizes_by_data
        self.lockstep = engine._sharding is not None

    def parameters_of(self, uses) -> list[str]:
        mine = {id(u) for u in uses}
        frozen = self._engine._norms_sums.frozen  # no gradient to compare
        return [
            n
            for n, owners in self._engine._groups.items()
            if n not in frozen and any(id(u) in mine for u, _ in owners)
        ]

    def parameter(self, name: str) -> Tensor:
        return self._engine.graph_parameter(name)

    def owners(self, name: str) -> list[Use]:
        return [u for u, _ in self._engine._groups[name]]

    def records(self, calls: list, grads: list, b: int) -> dict:
        uses = list(dict.fromkeys(u for u, _ in calls))
        live = {u: [c for v, c in calls if v is u] for u in uses}
        order = {id(c): g for (_, c), g in zip(calls, grads, strict=True)}
        ordered = tuple(order[id(c)] for u in uses for c in live[u])
        records, views = build_records(uses, live, ordered, b, self._engine._replaying_calls)
        self._engine._norms_sums.views.update(views)
        return records

    def weighted_sum(self, name: str, records: dict, weights: Tensor, cache: dict, formed=()):
        return self._engine._norms_sums.weighted_sum(name, records, weights, cache, formed)

    def accumulation_bound(self, name: str, records: dict, weights: Tensor):
        return self._engine._norms_sums.accumulation_bound(name, records, weights)

    def probe(self, args: tuple, kwargs: dict) -> dict:
        return self._engine._probe_inputs(args, kwargs)


def _casts_as_linear(use: Use) -> bool:
    """Whether the module is a plain ``nn.Linear`` (its own forward: ``F.linear``, which
    autocast casts to its dtype) recorded in the compute dtype: its input may be handed
    to it already cast (ClippingEngine._shared_cast) with the same result."""
    m = use.module
    return (
        type(m) is nn.Linear
        and getattr(use.rule, "low_precision_records", False)
        and not getattr(use.rule, "replays", False)
        and "forward" not in vars(m)
    )


def _root_sum_sq(parts: Iterable[Tensor]) -> Tensor | None:
    """sqrt(sum_k r_k^2) elementwise over per-example bounds r_k; None for none. The
    bounds of different parameters bound orthogonal parts of a gradient."""
    parts = list(parts)
    if not parts:
        return None
    # one stacked reduction: 4 ops a step, not 2 per parameter
    return torch.linalg.vector_norm(torch.stack(parts), dim=0)


def _every_name(
    sums: Iterable[tuple[str, Tensor]], names: list[str]
) -> Iterator[tuple[str, Tensor | None]]:
    """(name, sum) for every name in ``names``' order; None for a name ``sums`` (a
    subsequence in that order) skips."""
    pending = iter(sums)
    nxt = next(pending, None)
    for name in names:
        if nxt is not None and nxt[0] == name:
            yield nxt
            nxt = next(pending, None)
        else:
            yield name, None
    if nxt is not None:
        raise RuntimeError(f"clipped sum of {nxt[0]!r} out of the parameters' order")


def _per_unit(per_example: dict[Use, dict[str, Tensor]], index: UnitIndex) -> dict:
    """Per-example gradients {name: (B, *shape)} per module summed over each unit's
    examples, {name: (U, *shape)}: a unit's gradient is the sum of its examples'."""
    if index.trivial:
        return per_example
    out = {}
    for use, grads in per_example.items():
        out[use] = {}
        for name, v in grads.items():
            inverse = index.inverse.to(v.device)
            # in float32 for gradients kept in bf16 (streaming.Slots): a bf16 index_add
            # may accumulate in bf16 (PyTorch's CPU kernel does)
            v = upcast(v)
            out[use][name] = v.new_zeros((index.num_units, *v.shape[1:])).index_add_(0, inverse, v)
    return out


def _lookup_node(output: Tensor, weight: Tensor, stop_nodes: list):
    """The ``embedding`` autograd node of ``weight`` inside a module call, or None."""
    stop = {id(n) for n in stop_nodes if n is not None}
    # Nodes held, not only their ids: a freed wrapper's id can be reused (graph_check).
    stack, seen = [output.grad_fn], {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen[id(node)] = node
        if type(node).__name__ == "EmbeddingBackward0" and any(
            getattr(n, "variable", None) is weight for n, _ in node.next_functions
        ):
            return node
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return None


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


def _grouped_by_type(model: nn.Module, param_names: list[str]) -> list[str]:
    """'Type (n modules: path patterns; parameters a, b)' per module type, in model order.

    Layer indices are folded into '*' so that a 30-layer model's 61 norm weights read
    as three patterns, not 61 names.
    """
    groups: dict[str, dict[str, dict]] = {}
    for name in param_names:
        module_name, _, attr = name.rpartition(".")
        kind = _owner_type(model, name)
        g = groups.setdefault(kind, {"modules": {}, "attrs": {}})
        g["modules"][module_name or "<model>"] = None
        g["attrs"][attr] = None
    out = []
    for kind, g in groups.items():
        by_pattern: dict[str, list[str]] = {}
        for m in g["modules"]:
            folded = ".".join("*" if part.isdigit() else part for part in m.split("."))
            by_pattern.setdefault(folded, []).append(m)
        patterns = [p if len(ms) > 1 else ms[0] for p, ms in by_pattern.items()]
        n = len(g["modules"])
        out.append(
            f"{kind} ({n} module{'s' if n > 1 else ''}: {', '.join(patterns)}; "
            f"parameter{'s' if len(g['attrs']) > 1 else ''} {', '.join(g['attrs'])})"
        )
    return out


def _recurrent_hint(model: nn.Module, covered: set[int]) -> str:
    """Where torch's recurrent layers are refused: the drop-in replacements to use."""
    kinds = {
        type(m)
        for m in model.modules()
        if isinstance(m, nn.RNNBase)
        and any(p.requires_grad and id(p) not in covered for p in m.parameters())
    }
    hints = [
        f" For nn.{t.__name__}: dptrain.models.DP{t.__name__} is a drop-in replacement built "
        f"from nn.Linear layers (DP{t.__name__}.from_torch copies a one-way nn.{t.__name__}'s "
        "weights)."
        for t in (nn.GRU, nn.LSTM)
        if t in kinds
    ]
    others = sorted(t.__name__ for t in kinds if t not in (nn.GRU, nn.LSTM))
    if others:
        hints.append(
            f" For {', '.join(others)}: no drop-in replacement; dptrain.models.DPGRU and "
            "DPLSTM, or a cell built from nn.Linear layers, can be clipped."
        )
    return "".join(hints)


def _owner_type(model: nn.Module, param_name: str) -> str:
    module_name = param_name.rpartition(".")[0]
    return type(model.get_submodule(module_name)).__name__ if module_name else type(model).__name__


def _check_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is not allowed: expected one of {list(allowed)}")
