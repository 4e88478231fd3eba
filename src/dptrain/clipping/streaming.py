"""Per-example gradients formed during the backward, as output gradients arrive.

For modules whose per-example gradients are no larger than the record they come
from (LoRA's ``lora_A``/``lora_B`` with r << T, norm layers' d-vectors), the
engine forms them the moment the module's output gradient ``g`` exists and lets
``g`` and the recorded input go, as a non-private backward would: "streamed"
modules. The others' output gradients are captured and handed back at the end
of the backward (:meth:`Streaming.output_gradients`).

Which modules may stream follows from structure (their rule and parameters,
:func:`streamable_uses`); whether one does in a backward follows from shapes
(:meth:`Streaming.streams`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge

from dptrain.clipping.errors import UnsupportedModelError
from dptrain.clipping.precision import LOW_PRECISION
from dptrain.clipping.records import (
    Call,
    Use,
    example_rows,
    examples_first,
    for_rule,
    own_params,
)
from dptrain.clipping.rules import LayerRule, is_trainable, param_of
from dptrain.clipping.tensor_cores import mm_f32, round_down_bf16, tensor_cores

__all__ = ["PerExampleGrads", "Slots", "Streaming", "streamable_uses"]

#: At most this many entries (b x slot size x slots) per run of equal-sized slots
#: (Slots): the temporary of a run's squared norms, 16 MB in float32.
_NORM_RUN = 1 << 22
#: A buffer of streamed per-example gradients (a chunk of Slots) holds at least this many
#: bytes: above glibc's largest mmap threshold (32 MiB on 64-bit), so that each is mapped
#: on its own and freeing it leaves no hole in the heap.
_CHUNK_BYTES = 32 << 20
#: ... and a storage dtype's slots are cut into at most this many chunks: the step's peak
#: can hold one chunk more than the backward has reached, 1/32 of the slots.
_CHUNKS = 32


def streamable_uses(uses: list[Use], shared: set[int]) -> set[Use]:
    """Modules whose per-example gradients may be formed during the backward: a written
    rule that reads rows of (a, g) with ``a`` the module's first argument and g its
    output's gradient (not a replay, a raw channels-first layout, a lookup read from
    the graph or a rule that changes the call), and parameters of their own (a shared
    or tied one, ``shared`` by id, needs every use's record together)."""
    return {
        u
        for u in uses
        if not getattr(u.rule, "replays", False)
        and not getattr(u.rule, "raw_layout", False)
        and not getattr(u.rule, "lookup_from_graph", False)
        and u.rule.forward_pre_hook is None
        and type(u.rule).recorded_input is LayerRule.recorded_input
        and own_params(u)
        and not any(id(p) in shared for p in own_params(u))
    }


class Streaming:
    """Which modules stream, the taps that make autograd reach them, and the backward of
    sum_i L_i that forms their per-example gradients on the way.

    Args:
        uses: the engine's clipped modules.
        shared: ids of parameters with several uses (never streamed).
        ghost: whether a module's norm is ghost-computed from given (a, g) (then its
            per-example gradients are never instantiated, so it does not stream).
        per_example: where streamed modules' per-example gradients go, {use: {name:
            (b, *shape)}} (the dict the norms and sums read).
    """

    def __init__(
        self,
        uses: list[Use],
        shared: set[int],
        ghost: Callable[[Use, Tensor, Tensor], bool],
        per_example: Callable[[], dict[Use, dict[str, Tensor]]],
    ):
        self.streamable = streamable_uses(uses, shared)
        # those whose rule may read an operand their output's node saved (saved_operand)
        self._saves = {
            u for u in self.streamable if type(u.rule).saved_operand is not LayerRule.saved_operand
        }
        self._ghost = ghost
        self._per_example = per_example
        self._choices: dict[tuple, bool] = {}  # streams' answers by shapes
        # A leaf per device that inputs needing no gradient of streamable modules are tied
        # to (Tap): requested in the backward, it makes autograd run their nodes.
        self._anchors: dict[torch.device, Tensor] = {}

    def tap(self, use: Use, recording: Callable[[], bool]):
        """A forward pre-hook that ties the module's input to the anchor where the input
        needs no gradient (LoRA's lowest lora_A, a first layer): a streamed call's output
        node runs only if autograd has a requested input below it, and there is none
        below such a call otherwise (output_gradients). Other inputs are left alone: the
        graph below them reaches a requested input already, and a Python node on the
        residual stream of every layer perturbs glibc's heap (+120-150 MB resident for
        SmolLM2 full fine-tuning, with the same bytes allocated). ``recording()``: whether
        this forward is one the engine records (not a recomputation, replay or re-run)."""

        def hook(module, args, kwargs):
            if not recording() or not args or not isinstance(args[0], Tensor):
                return None
            x = args[0]
            if x.requires_grad or not x.is_floating_point() or not own_params(use):
                return None
            anchor = self._anchors.get(x.device)
            if anchor is None:
                anchor = self._anchors[x.device] = torch.zeros((), device=x.device).requires_grad_()
            return (Tap.apply(x, anchor), *args[1:]), kwargs

        return hook

    def streams(self, use: Use, calls: list[Call], b: int) -> bool:
        """Whether ``use``'s per-example gradients are formed as its output gradients arrive.

        Yes where the engine instantiates them anyway (not ghost-normed) and they are
        no larger than the record they replace: b * numel(parameters) <= numel(a) + numel(g)
        (LoRA's lora_A / lora_B with r << T, norm layers' d-vectors). Book-keeping keeps
        them until the clip factors are known in either case; streaming lets a and g go
        during the backward instead of holding both until its end.
        """
        if use not in self.streamable or b == 0:
            return False
        # the same shapes give the same answer (about 0.25 ms a module to work out)
        key = (use, b, tuple((c.a_shape, c.out_shape) for c in calls))
        if key not in self._choices:
            self._choices[key] = self._streams_for_shapes(use, calls, b)
        return self._choices[key]

    def _streams_for_shapes(self, use: Use, calls: list[Call], b: int) -> bool:
        # The record build_records would make, as shapes only (meta tensors: no memory).
        parts = [
            example_rows(use, c.a.to("meta"), torch.empty(c.out_shape, device="meta"), b)
            for c in calls
        ]
        a = torch.cat([p[0] for p in parts], 1)
        g = torch.cat([p[1] for p in parts], 1)
        if self._ghost(use, a, g):
            return False
        # no larger (a tie, which the linear rule instantiates, holds as much either way
        # and streamed lets the record go during the backward)
        return b * sum(p.numel() for p in own_params(use)) <= a.numel() + g.numel()

    def output_gradients(
        self,
        losses: Tensor,
        calls: list[tuple[Use, Call]],
        streamed: set[Use],
        b: int,
        leaves: list,
        *,
        retain: bool,
    ) -> tuple:
        """One backward of sum_i L_i: each call's output gradient g, examples first, or None
        for the calls of ``streamed`` modules.

        The output gradients of the other calls are captured (autograd hands them all
        back at the end). For a streamed module, a pre-hook on its output's node forms
        the per-example gradients from (a, g) the moment g exists, into
        ``per_example()``, and lets g (and the recorded input) go, as a non-private
        backward would. Autograd runs only the nodes on a path to a requested input, so
        the ``leaves`` the graph reaches other than the clipped parameters are requested
        too: the anchors (tap; they get no gradient) and any input that needs a gradient
        (HF's enable_input_require_grads), whose gradients are dropped. Below a streamed
        call lies one of them or a captured call; the missed check makes sure.
        (Requesting the streamed modules' parameters would run the nodes too, but hand
        their summed gradients to any hook on them, and keeping those small gradients
        while a retained graph holds every activation fragments the heap: +280 MB
        resident for SmolLM2 LoRA on the checked chunk, with glibc.)
        """
        wanted = [c.edge for u, c in calls if u not in streamed]
        if streamed:
            wanted += [GradientEdge(node, 0) for node in leaves]
        by_node: dict[int, tuple] = {}
        for u, c in calls:
            if u in streamed:
                by_node.setdefault(id(c.edge.node), (c.edge.node, []))[1].append((u, c))
        slots = Slots(
            [u for u in dict.fromkeys(u for u, _ in calls) if u in streamed],
            b,
            stored_as=_stored_as(calls, streamed),
        )
        fired: set[Call] = set()
        per_example = self._per_example()
        if by_node and isinstance(per_example, PerExampleGrads):
            per_example.slots = slots

        def stream(node_calls):
            def hook(grad_outputs):
                for u, c in node_calls:
                    fired.add(c)
                    self._stream(u, c, grad_outputs[c.edge.output_nr], b, slots, per_example)

            return hook

        handles = [node.register_prehook(stream(cs)) for node, cs in by_node.values()]
        try:
            got = torch.autograd.grad(losses.sum(), wanted, allow_unused=True, retain_graph=retain)
        finally:
            for h in handles:
                h.remove()
        # Every streamed call lies on the losses' graph with a requested input below it, so
        # autograd ran its node; one it did not would lose that gradient without a sign.
        missed = [u.name for u, c in calls if u in streamed and c not in fired]
        if missed:
            raise UnsupportedModelError(
                f"no output gradient reached {', '.join(sorted(set(missed)))} during the "
                "backward, though the losses depend on it: its per-example gradients could "
                "not be formed"
            )
        got = iter(got)
        grads = tuple(None if u in streamed else next(got) for u, _ in calls)
        return examples_first([c for _, c in calls], grads)

    def _stream(
        self, use: Use, call: Call, g: Tensor | None, b: int, slots, per_example: dict
    ) -> None:
        """Form ``call``'s per-example gradients from (a, g) and add them to the module's
        (in ``slots``, the buffers of all streamed modules; ``per_example``, the dict the
        norms and sums read)."""
        if g is None:  # this call did not reach the loss
            return
        rule, module = use.rule, use.module
        # An operand the output's node saved, where the rule forms the gradients from it
        # with less work (an RMSNorm's n(x)); read here, in that node's pre-hook, so it is
        # the tensor the node is about to use (LayerRule.saved_operand).
        saved = rule.saved_operand(module, call.edge.node) if use in self._saves else None
        if saved is not None:
            x, rows = example_rows(use, saved, g, b)
            form = rule.per_example_from_saved
        else:
            x, rows = for_rule(rule, *example_rows(use, call.a, g, b))
            form = rule.per_example_into
        acc = per_example.get(use)
        grads = form(module, x, rows, {} if acc is not None else slots.destinations(use, rows))
        if acc is None:
            # the module's first call of this backward: formed in its slots where the rule can
            per_example[use] = slots.hold(use, grads)
        else:
            for k, v in grads.items():
                acc[k].add_(v)
        call.a = None  # its last reader: the input goes when autograd frees it


def _stored_as(calls: list[tuple[Use, Call]], streamed: set[Use]) -> dict[Use, torch.dtype]:
    """The streamed modules whose per-example gradients are kept in bf16 (Slots): a rule
    whose gradients are products of its record's operands (``keeps_record_precision``)
    where every call of this backward computed in bf16 on a bf16 record."""
    bf16: dict[Use, bool] = {}
    for u, c in calls:
        if u in streamed and u.rule.keeps_record_precision:
            ok = c.low_precision and c.a is not None and c.a.dtype == torch.bfloat16
            bf16[u] = bf16.get(u, True) and ok
    return {u: torch.bfloat16 for u, ok in bf16.items() if ok}


#: Device types on which a streamed module's per-example gradients are formed in their
#: slot of a buffer of slots (:meth:`Slots.destinations`). CUDA writes a batched GEMM's
#: output at any stride between examples, saving a copy's launch; the CPU's ``bmm`` into
#: such a strided slot ran up to twice as long as the product and a copy (Llama-sized
#: shapes, 2 cores), and a launch costs it nothing. ``benchmarks/launch_count.py`` adds
#: "cpu" to count launches as on CUDA.
SLOT_DEVICES: set[str] = {"cuda"}


class Slots:
    """Buffers for the per-example gradients of every streamed module of a backward: a few
    large tensors, each allocated as the backward reaches its first module.

    They are formed one module at a time while the backward runs and kept until its
    end. As separate tensors, these hundreds of small allocations, made while a retained
    graph (the checked chunk) holds every activation, land above each layer's freed
    temporaries and pin them: glibc's heap then grew by about 260 MB over SmolLM2 LoRA's
    30 layers (resident memory that is never returned), against none with one buffer.
    One buffer for all of them, allocated at the first module's gradients, has the
    opposite fault where the slots are large: the backward's first modules are the last
    layer's, so the whole buffer joins every activation still held (at B 4, T 512, the
    810 MB of a 135M Llama's instantiated linear layers raised the step's peak from
    1.07x to 1.29x the non-private one, ``benchmarks/step_peaks.py``). So the slots are
    laid out in the order the backward fills them (the reverse of the forward's) and
    cut into consecutive **chunks** of at least :data:`_CHUNK_BYTES` (and at most
    :data:`_CHUNKS` of them per storage dtype), each one buffer allocated when its first
    slot is filled: the buffers grow as the backward frees the activations, and each is
    large enough to be mapped on its own rather than carved from the heap. Each module's
    are copied into their slot (or formed in it, :meth:`destinations`), so nothing keeps
    a temporary (or a view of g) alive.

    A buffer is (b, width): example i's gradients of its streamed parameters side by
    side in row i, a parameter's slot a block of columns. The weighted sums of a buffer's
    slots are then one matrix-vector product, and their squared norms one reduction per
    run of equal-sized slots (:meth:`weighted_sums`, :meth:`squared_norms`), where per
    parameter each took 3-4 aten ops (hundreds of launches a step for LoRA).

    ``stored_as``: modules whose per-example gradients are kept in bf16 (a linear layer
    on bf16 records: its gradient is a product of two bf16 operands, which autograd
    itself returns in bf16), in buffers of their own. Half the bytes of float32: at B 16,
    T 512 a 135M Llama's streamed attention projections hold 1.7 GB in float32. Their
    norms and weighted sums read the stored bf16 values (the norm is of what is summed,
    so one example still moves the sum by at most C); the sums' factors are rounded
    down to 8 bits, as for the records' clipped sums, so that every product is exact in
    float32 (:func:`_weighted_columns`).
    """

    def __init__(self, uses: list[Use], b: int, stored_as: dict[Use, torch.dtype] | None = None):
        self.b = b
        stored_as = stored_as or {}
        sizes: dict[tuple[Use, str], int] = {}
        # each slot's per-example shape, for a rule to form its gradients in (destinations)
        self.shapes: dict[tuple[Use, str], tuple[int, ...]] = {}
        kind: dict[tuple[Use, str], torch.dtype | None] = {}  # None: as the rule forms them
        for use in reversed(uses):  # ``uses`` in forward order; the backward fills the last first
            for name in use.rule.param_names:
                p = param_of(use.module, name)
                if is_trainable(p):
                    sizes[(use, name)] = p.numel()
                    self.shapes[(use, name)] = (b, *p.shape)
                    kind[(use, name)] = stored_as.get(use)
        self.runs: list[tuple[list[tuple[Use, str]], int]] = []
        # per chunk: its storage dtype (None: the first gradient's) and its runs (indices
        # into runs) in the buffer's column order
        self._chunks: list[tuple[torch.dtype | None, list[int]]] = []
        for dtype in dict.fromkeys(kind.values()):
            keys = [key for key in sizes if kind[key] == dtype]
            item = 2 if dtype in LOW_PRECISION else 4  # a rule's own dtype: float32 at most
            limit = max(_CHUNK_BYTES, -(-b * item * sum(sizes[k] for k in keys) // _CHUNKS))
            chunk: list[tuple[Use, str]] = []
            held = 0  # the open chunk's bytes
            for key in keys:
                chunk.append(key)
                held += b * item * sizes[key]
                if held >= limit:
                    self._add_chunk(dtype, chunk, sizes)
                    chunk, held = [], 0
            if chunk:
                self._add_chunk(dtype, chunk, sizes)
        self.slots: dict[tuple[Use, str], int] = {  # columns
            key: n for keys, n in self.runs for key in keys
        }
        self._chunk_of = {
            key: i
            for i, (_, runs) in enumerate(self._chunks)
            for r in runs
            for key in self.runs[r][0]
        }
        self.buffers: list[Tensor | None] = [None] * len(self._chunks)  # allocated when reached
        self.blocks: dict[tuple[Use, str], Tensor] = {}
        self._run_views: list[Tensor | None] = [None] * len(self.runs)  # (b, n, size)
        # the view of its slot handed out per (use, name): whether a per-example gradient
        # lives in a buffer (hold() gives one that does not fit its slot a copy of its own)
        self.views: dict[tuple[Use, str], Tensor] = {}
        # the slot views offered to a rule to form its gradients in (destinations)
        self.offered: dict[tuple[Use, str], Tensor] = {}

    def _add_chunk(self, dtype, keys: list[tuple[Use, str]], sizes: dict) -> None:
        # Equal-sized slots side by side, in runs of at most _NORM_RUN entries: a run's
        # squared norms are one reduction over its (b, n, size) view, where a pow and a
        # sum per slot made 50 of the 1,550 aten ops of a Llama step (full fine-tuning,
        # docs/engine_benchmark.md). The run bounds that reduction's temporary.
        by_size: dict[int, list[tuple[Use, str]]] = {}
        for key in keys:
            by_size.setdefault(sizes[key], []).append(key)
        runs = []
        for n, same in by_size.items():
            per_run = max(1, _NORM_RUN // max(1, self.b * n))
            for i in range(0, len(same), per_run):
                runs.append(len(self.runs))
                self.runs.append((same[i : i + per_run], n))
        self._chunks.append((dtype, runs))

    def destinations(self, use: Use, like: Tensor) -> dict[str, Tensor]:
        """{name: ``use``'s slot, shaped (b, *param.shape)} for a rule to form its
        per-example gradients in (``LayerRule.per_example_into``), on :data:`SLOT_DEVICES`.
        A bf16 slot's buffer is allocated here, on ``like``'s device (the record's); one
        whose dtype ``stored_as`` left open waits for its first gradient, which is copied
        (the buffer's dtype and device are then that gradient's)."""
        if like.device.type not in SLOT_DEVICES:
            return {}
        out = {}
        for name in use.rule.param_names:
            key = (use, name)
            i = self._chunk_of.get(key)
            if i is None:
                continue
            if self.buffers[i] is None and self._chunks[i][0] is not None:
                self._allocate(i, like)
            block = self.blocks.get(key)
            if block is not None and block.device == like.device:
                out[name] = self.offered[key] = block.view(self.shapes[key])
        return out

    def hold(self, use: Use, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """``grads`` copied into ``use``'s slots (a copy of its own where one does not
        fit); a gradient the rule formed in its slot (:meth:`destinations`) stays. A
        slot stored in bf16 takes a float32 gradient rounded to nearest."""
        out = {}
        for name, v in grads.items():
            key = (use, name)
            if v is self.offered.pop(key, None):
                out[name] = self.views[key] = v
                continue
            i = self._chunk_of.get(key)
            if i is None or self.slots[key] * self.b != v.numel():
                out[name] = v.clone()
                continue
            if self.buffers[i] is None:
                self._allocate(i, v)
            buffer, dtype = self.buffers[i], self._chunks[i][0]
            if v.device != buffer.device or (dtype is None and v.dtype != buffer.dtype):
                out[name] = v.clone()
                continue
            block = self.blocks[key]
            out[name] = block if block.shape == v.shape else block.view(v.shape)
            out[name].copy_(v)
            self.views[key] = out[name]
        return out

    def _allocate(self, i: int, like: Tensor) -> None:
        dtype, mine = self._chunks[i]
        widths = [len(self.runs[r][0]) * self.runs[r][1] for r in mine]
        buffer = self.buffers[i] = like.new_empty(
            (self.b, sum(widths)), dtype=like.dtype if dtype is None else dtype
        )
        # every slot's columns, (b, size) each: one split into runs and one unbind per
        # run, not a slice per slot
        for r, piece in zip(mine, buffer.split(widths, 1), strict=True):
            keys, n = self.runs[r]
            self._run_views[r] = view = piece.view(self.b, len(keys), n)
            self.blocks.update(zip(keys, view.unbind(1), strict=True))

    def holds(self, use: Use, name: str, v: Tensor) -> bool:
        """Whether ``v`` is the slot view handed out for ``use``'s ``name``."""
        return self.views.get((use, name)) is v

    def weighted_sums(self, factors: Tensor) -> dict[tuple[Use, str], Tensor]:
        """{(use, name): sum_i factors[i] * grad_i} of every filled slot, in float32 for a
        bf16 store: one product per buffer (the factors rounded down once for them all)."""
        out = {}
        rounded: dict[tuple, Tensor] = {}
        for buffer, (_, runs) in zip(self.buffers, self._chunks, strict=True):
            if buffer is None:
                continue
            keys = [key for r in runs for key in self.runs[r][0]]
            at = (buffer.dtype, buffer.device)
            if at not in rounded:
                rounded[at] = _column_factors(factors, buffer)
            flat = _weighted_columns(buffer, rounded[at])
            for key, piece in zip(keys, flat.split([self.slots[k] for k in keys]), strict=True):
                if key in self.views:
                    shape = self.views[key].shape[1:]
                    out[key] = piece if piece.shape == shape else piece.view(shape)
        return out

    def squared_norms(self) -> dict[tuple[Use, str], Tensor]:
        """{(use, name): (b,) squared norms of the per-example gradients} of every filled
        slot: one reduction per run of equal-sized slots (float32 sums of the same
        squares as slot by slot, in another order; of a bf16 store's values as stored)."""
        out = {}
        for view, (keys, _) in zip(self._run_views, self.runs, strict=True):
            if view is None or not any(key in self.views for key in keys):
                continue
            if view.dtype in LOW_PRECISION:  # squares and sums in float32, no copy of the run
                norms = torch.linalg.vector_norm(view, dim=2, dtype=torch.float32).square()
            else:
                norms = view.pow(2).sum(2)
            out.update(
                (k, sq) for k, sq in zip(keys, norms.unbind(1), strict=True) if k in self.views
            )
        return out


def _column_factors(factors: Tensor, buffer: Tensor) -> Tensor:
    """The factors a buffer's rows are summed with (:func:`_weighted_columns`), (1, b):
    for a bf16 buffer rounded down to 8 significant bits (``round_down_bf16``: c' <= c, an
    example's contribution only shrinks), so that each product is exact in float32."""
    if buffer.dtype not in LOW_PRECISION:
        return factors.to(buffer.device, buffer.dtype)[None]
    return round_down_bf16(factors).to(buffer.device, buffer.dtype)[None]


def _weighted_columns(buffer: Tensor, c: Tensor) -> Tensor:
    """sum_i c[0, i] * buffer[i] over the rows of a (b, n) buffer, as an (n,) vector, with
    ``c`` from :func:`_column_factors`.

    A bf16 buffer's products are exact in float32 (its factors have 8 significant bits)
    and summed in float32 (tensor cores on CUDA); off CUDA in column blocks, whose
    upcasts are transient (a float32 copy of the whole buffer would be its size twice
    over)."""
    if buffer.dtype not in LOW_PRECISION:
        return torch.mv(buffer.T, c[0])
    if tensor_cores(c, buffer):
        return mm_f32(c, buffer)[0]
    out = torch.empty(buffer.shape[1], dtype=torch.float32, device=buffer.device)
    step = max(1, _NORM_RUN // max(1, buffer.shape[0]))
    for start in range(0, buffer.shape[1], step):
        out[start : start + step] = mm_f32(c, buffer[:, start : start + step])[0]
    return out


class PerExampleGrads(dict):
    """{use: {name: (b, *shape) per-example gradients}}, and the :class:`Slots` whose
    buffers hold the streamed modules' (None until a module streams)."""

    slots: Slots | None = None


class Tap(torch.autograd.Function):
    """Identity on a streamable module's input x that also leads to the anchor, a leaf:
    requesting the anchor's gradient makes autograd run the module's nodes, so the
    pre-hook on its output node sees g, while nothing else is requested or kept. The
    anchor gets no gradient (None), and x's gradient passes through unchanged.
    """

    @staticmethod
    def forward(ctx, x: Tensor, anchor: Tensor) -> Tensor:
        ctx.set_materialize_grads(False)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor | None):
        return (grad if ctx.needs_input_grad[0] else None), None
