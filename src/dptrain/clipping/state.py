"""State a training forward writes, and batch statistics: both leak past the per-step bound.

Per-example clipping bounds what one record adds to *this* step's clipped sum.
A forward that writes the model's state from the batch (a queue of keys, a
running mean, ``nn.Embedding(max_norm=...)`` renormalising the looked-up rows of
its weight in place) carries the record into every later step, unclipped and
without noise: whatever step t wrote is read by all of step t+1's examples, so
one record in step t moves step t+1's clipped sum without bound. No per-step
check can see this.

:class:`StateWatch` notes, per buffer and parameter of every module, the tensor
bound to the name and its version counter (bumped by every in-place write), so
that both ``self.buf[i] = x`` / ``self.buf.mul_(m)`` and rebinding
``self.buf = torch.cat(...)`` are seen, and so are names added or removed. The
engine takes a snapshot when a training forward starts and compares when it
ends (:class:`~dptrain.clipping.ClippingEngine`); the cost is one pass over the
modules' parameter and buffer dicts each way, nothing proportional to sizes.
Not seen: plain Python attributes that are neither buffers nor parameters, state
kept outside the model, writes made outside the model's forward (loss code, the
training loop), writes through ``.data`` (which has a version counter of its own),
and writes a native kernel makes without declaring them (torch's BatchNorm kernel
updates its running mean and variance so: BatchNorm is refused by its mode).

BatchNorm that normalises by the statistics of the batch (training mode, or
``track_running_stats=False``) mixes the examples within a step; the engine
refuses it when it runs in a training forward (:func:`uses_batch_statistics`).
In eval mode with running statistics it is per example and writes nothing.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import Tensor, nn

__all__ = [
    "StateSnapshot",
    "StateWatch",
    "Written",
    "batch_statistics_refusal",
    "state_refusal",
    "uses_batch_statistics",
]


@dataclass(frozen=True)
class Written:
    """A buffer or parameter a forward wrote."""

    module_name: str
    """Qualified name of the owning module ('' for the model itself)."""
    module: nn.Module
    attr: str
    kind: str
    """'buffer' or 'parameter'."""
    how: str
    """'written in place', 'rebound to another tensor', 'added' or 'removed'."""

    @property
    def name(self) -> str:
        return f"{self.module_name}.{self.attr}" if self.module_name else self.attr


@dataclass(frozen=True)
class StateSnapshot:
    """Every parameter's and buffer's name, tensor and version counter at one moment.

    Flat lists, so that comparing two costs a few list comparisons done in C (0.24
    ms for a 30-layer Llama); the tensors are held, not their ids, because a buffer
    rebound and freed during the forward could hand its id to the next one bound."""

    sizes: list[int]
    """Entries per dict (a module's parameters, then its buffers, module by module)."""
    names: list[str]
    tensors: list[Tensor | None]
    versions: list[int]
    """The version of each tensor that is not None."""


class StateWatch:
    """Which buffers and parameters of a model were written between two moments."""

    def __init__(self, model: nn.Module) -> None:
        # Modules are fixed when the engine is built (its hooks are too); their parameter
        # and buffer dicts are read afresh each time, so names bound later are seen.
        self._slots: list[tuple[str, nn.Module, str, dict]] = [
            (name, m, kind, d)
            for name, m in model.named_modules()
            for kind, d in (("parameter", m._parameters), ("buffer", m._buffers))
        ]
        self._dicts = [d for *_, d in self._slots]

    def snapshot(self) -> StateSnapshot:
        """Every parameter's and buffer's tensor and version counter, now."""
        dicts = self._dicts
        tensors = [t for d in dicts for t in d.values()]
        return StateSnapshot(
            [len(d) for d in dicts], [k for d in dicts for k in d], tensors, _versions(tensors)
        )

    def written(self, before: StateSnapshot) -> list[Written]:
        """The buffers and parameters written in place, rebound, added or removed since
        ``before`` (a :meth:`snapshot` of this watch)."""
        now = self.snapshot()
        if (
            now.names == before.names
            and now.sizes == before.sizes
            and all(map(operator.is_, now.tensors, before.tensors))
            and now.versions == before.versions
        ):
            return []  # the common case, decided in C
        out: list[Written] = []
        old = _entries(before)
        for (name, m, kind, d), was in zip(self._slots, old, strict=True):
            for attr, (t, v) in was.items():
                if attr not in d:
                    out.append(Written(name, m, attr, kind, "removed"))
                elif d[attr] is not t:
                    out.append(Written(name, m, attr, kind, "rebound to another tensor"))
                elif _version(t) != v:
                    out.append(Written(name, m, attr, kind, "written in place"))
            out.extend(Written(name, m, attr, kind, "added") for attr in d if attr not in was)
        return out


def _entries(snapshot: StateSnapshot) -> list[dict[str, tuple[Tensor | None, int]]]:
    """The snapshot per dict: {name: (tensor, version)}."""
    versions = iter(snapshot.versions)
    flat = [
        (k, (t, -1 if t is None else next(versions)))
        for k, t in zip(snapshot.names, snapshot.tensors, strict=True)
    ]
    out, start = [], 0
    for n in snapshot.sizes:
        out.append(dict(flat[start : start + n]))
        start += n
    return out


def _versions(tensors: list[Tensor | None]) -> list[int]:
    try:
        return [t._version for t in tensors if t is not None]
    except RuntimeError:  # an inference tensor has no version counter (nor can it be written)
        return [_version(t) for t in tensors if t is not None]


def _version(t: Tensor | None) -> int:
    if t is None:
        return -1
    try:
        return t._version
    except RuntimeError:
        return -1


def state_refusal(written: list[Written]) -> str:
    """The refusal for state a training forward wrote: each buffer or parameter by name,
    with its module's type, and what to do."""
    # Several layers writing the same state read as one entry (30 layers, not 90 names).
    listed: dict[tuple[str, str], list[str]] = {}
    advice: dict[str, None] = {}
    for w in written:
        what = f"{w.kind} of {type(w.module).__name__}, {w.how}"
        folded = ".".join("*" if part.isdigit() else part for part in w.name.split("."))
        listed.setdefault((folded, what), []).append(w.name)
        advice[_advice(w)] = None
    entries = []
    for (_, what), names in listed.items():
        if len(names) == 1:
            entries.append(f"{names[0]} ({what})")
        else:  # '*' where the layer index differs, the index where all share it
            parts = zip(*(n.split(".") for n in names), strict=True)
            name = ".".join(p[0] if len(set(p)) == 1 else "*" for p in parts)
            entries.append(f"{name} ({what}; {len(names)} modules)")
    return (
        "dptrain refuses to train this model: its training forward wrote state that later "
        "steps read, so a record of this step would reach the next steps' clipped sums "
        "through it, unclipped and without noise: " + "; ".join(entries) + ". " + " ".join(advice)
    )


def _advice(w: Written) -> str:
    m = w.module
    if isinstance(m, nn.Embedding) and m.max_norm is not None and w.attr == "weight":
        return (
            f"Embedding(max_norm={m.max_norm:g}): max_norm renormalises the rows of the tokens "
            "in the batch in place, without noise: construct the embedding without max_norm."
        )
    if isinstance(m, nn.modules.batchnorm._NormBase) and w.kind == "buffer":
        return (
            f"{type(m).__name__} updates its running statistics from the batch: construct it "
            "with track_running_stats=False, or call .eval() on it to freeze them."
        )
    if w.attr.endswith("inv_freq") and "Rotary" in type(m).__name__:
        return (
            f"{type(m).__name__}: a rotary embedding whose frequencies follow the sequence "
            "length of each batch (Hugging Face's 'dynamic' RoPE keeps the longest seen, "
            "'longrope' picks its factors by the batch's longest sequence) is not supported: "
            "use a rope_type with fixed frequencies."
        )
    if w.kind == "parameter":
        return (
            "A parameter may change only by the optimizer's noised step: do not write or "
            "rebind parameters in forward (registering a torch parametrization there, as "
            "peft's target_parameters does at every call, writes the weight too)."
        )
    return (
        "For a queue, a cache or a running statistic: keep such state outside the model, or "
        "update it from noised quantities after the optimizer step."
    )


def uses_batch_statistics(module: nn.Module) -> bool:
    """Whether a BatchNorm normalises by the statistics of the batch when called now
    (torch's own test: training mode, or no running statistics to use)."""
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and (
        module.training or module.running_mean is None or module.running_var is None
    )


def batch_statistics_refusal(name: str, module: nn.Module) -> str:
    """The refusal for a BatchNorm that normalises by the batch in a training forward."""
    tracked = module.running_mean is not None and module.running_var is not None
    why = "in training mode" if module.training else "without running statistics"
    return (
        f"dptrain refuses to train this model: {name or '<model>'} ({type(module).__name__}) "
        f"ran {why} in a training forward: it normalises every example by the mean and "
        "variance of the whole batch (mixing the examples, so per-example gradients do not "
        "exist)"
        + (" and updates its running statistics from them" if tracked else "")
        + ". "
        + (
            "Call .eval() on it to use its frozen running statistics (per example; its weight "
            "and bias may stay trainable; model.train() sets it back to training mode)"
            if tracked
            else "Construct it with track_running_stats=True and load running statistics, "
            "then call .eval() on it"
        )
        + ", or replace it with GroupNorm or LayerNorm."
    )
