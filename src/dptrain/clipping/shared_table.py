"""Tables shared by all examples: per-example rows found where the batch is broadcast.

An embedding looked up with ids that every example shares (position ids of
shape (T,) or (1, T), a soft prompt's ``arange(K)``) returns one output O,
(T, d) or (1, T, d), for the whole batch. The gradient that reaches O is
already the sum of every example's: at the table, examples cannot be told
apart. They can where O is broadcast over the examples. In

    x + O                       (x of shape (B, T, d): learned positions)
    O.expand(B, -1, -1)         (a hand-written soft prompt)
    O.repeat(B, 1, 1)           (peft's prompt tuning)

the operation's output S has one copy of O per example along dimension 0, so
row i of dL/dS is example i's gradient with respect to its own copy of O (for
``x + O``, dL/dO_i = dL/dS_i exactly). The engine leaves O as the module
returned it (user code sees the module's own shapes), finds these broadcasts on
the losses' autograd graph at the backward (:func:`resolve`), and records the
gradient of S as the call's output gradient, with the ids repeated once per
example: the embedding rule then reads rows as for any (B, T) lookup, and the
exact self-check verifies, the first time the pattern is seen, that row i of
dL/dS carries example i's loss alone.

Between O and the broadcast only operations that keep O's elements in order
are followed (view, reshape, (un)squeeze, a dtype cast, a clone). A broadcast
is ``expand``, ``repeat`` or an addition (a subtraction of ``O`` from
something is not: its sign differs) that copies O along a new or size-1
dimension 0 and leaves its other dimensions as they are. Any other use of O
(as a matrix in ``F.linear``, ``@`` or ``einsum``, multiplied elementwise,
broadcast along another dimension) sums the examples' gradients before they
can be separated: such a call is refused by name at the first backward,
before any gradient is written, with what to do.

Where the ids could also be one per example ((T,) ids with T equal to the
number of examples, or (1, T) ids in a chunk of one) and O is not only
broadcast, the call is read as per-example rows and the self-check decides.
"""

from __future__ import annotations

import dataclasses
import math

from torch.autograd.graph import GradientEdge

from dptrain.clipping.errors import UnsupportedModelError

__all__ = ["looks_shared", "resolve"]

#: Autograd nodes that pass O on with its elements in the same order (same numel).
_IN_ORDER = {
    "AliasBackward0",
    "CloneBackward0",
    "ReshapeAliasBackward0",
    "SqueezeBackward0",
    "SqueezeBackward1",
    "SqueezeBackward2",
    "ToCopyBackward0",
    "UnsafeViewBackward0",
    "UnsqueezeBackward0",
    "ViewBackward0",
}
#: Nodes whose output copies their input along dimension 0 (shapes checked).
_COPIES = {"ExpandBackward0", "RepeatBackward0"}


def looks_shared(ids_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> bool:
    """Whether an embedding call's ids may be shared by all examples: (T,) ids with a
    (T, d) output, or (1, T) ids with a (1, T, d) output."""
    if len(ids_shape) == 1:
        return len(out_shape) == 2 and out_shape[0] == ids_shape[0]
    return len(ids_shape) == 2 and ids_shape[0] == 1 and out_shape[:2] == ids_shape


def resolve(live: dict, graph: dict[int, object], b: int) -> None:
    """Give every live call of a shared table its per-example rows, in place.

    ``live``: {module use: [recorded calls]} (engine._live_calls); a call marked
    ``shared`` in the forward is replaced by one call per broadcast of its output, each
    with the ids expanded to (b, T) and the broadcast's output as its output edge.
    ``graph``: {id: node} of every node of the losses' graph. Raises
    :class:`~dptrain.clipping.UnsupportedModelError` naming every shared table whose
    output is used otherwise, unless its ids may be one per example (then the call stays
    as recorded, read as rows, and the exact self-check decides).
    """
    pending = [(use, call) for use, calls in live.items() for call in calls if call.shared]
    if not pending:
        return
    users = _users(graph.values())
    refused = []
    for use, call in pending:
        found, other = _broadcasts(call.edge.node, call.edge.output_nr, call.out_shape, users)
        wrong = [s for _, s in found if s[0] != b]
        if found and not other and not wrong:
            ids = call.a.reshape(1, -1).expand(b, -1)
            copies = [
                dataclasses.replace(
                    call, a=ids, edge=edge, out_shape=s, expanded_to=b, shared=False
                )
                for edge, s in found
            ]
            calls = live[use]
            k = calls.index(call)
            live[use] = calls[:k] + copies + calls[k + 1 :]
        elif call.a.shape[0] != b:
            refused.append(_why(use, call, b, other, wrong))
        # else: ids of length b may be per-example rows; the self-check decides
    if refused:
        raise UnsupportedModelError(
            "dptrain refuses to train this model: "
            + "; ".join(refused)
            + ". The engine cannot clip such a table per example: the examples' gradients "
            "with respect to its output are summed where it is used. Give every example its "
            "own rows: look the ids up with a batch dimension, table(ids.expand(B, -1)) of "
            "shape (B, K), and use the (B, K, d) output per example (torch.bmm or einsum over "
            "the batch); or use the output only by broadcasting it over the examples along "
            "dimension 0 (x + table(ids), table(ids).expand(B, -1, -1), .repeat(B, 1, 1)), "
            "which is clipped exactly. A weight used as a matrix belongs in an nn.Linear."
        )


def _users(nodes) -> dict[int, list[tuple[object, int, int]]]:
    """{id of a node: [(node that uses its output, input slot, output number)]}."""
    users: dict[int, list] = {}
    for node in nodes:
        for slot, (nxt, nr) in enumerate(node.next_functions):
            if nxt is not None and not hasattr(nxt, "variable"):
                users.setdefault(id(nxt), []).append((node, slot, nr))
    return users


def _broadcasts(node, output_nr: int, shape: tuple, users) -> tuple[list, list[str]]:
    """([(edge, shape)] of the broadcasts of ``node``'s output over dimension 0, [names of
    the nodes that use it otherwise]), following operations that keep its elements in order."""
    found, other = [], []
    for user, slot, nr in users.get(id(node), []):
        if nr != output_nr:
            continue
        name = type(user).__name__
        out = _output_shape(user)
        if out is None:
            other.append(name)
        elif name in _IN_ORDER and math.prod(out) == math.prod(shape):
            more, also = _broadcasts(user, 0, out, users)
            found += more
            other += also
        elif _copies_along_dim0(shape, out) and _passes_unchanged(user, name, slot):
            found.append((GradientEdge(user, 0), out))
        else:
            other.append(f"{name} (output {out})")
    return found, other


def _output_shape(node) -> tuple[int, ...] | None:
    """The shape of the first output of the forward operation behind ``node`` (None if
    autograd keeps no plain shape for it)."""
    try:
        return tuple(int(n) for n in node._input_metadata[0].shape)
    except (AttributeError, IndexError, RuntimeError, TypeError):
        return None


def _copies_along_dim0(shape: tuple, out: tuple) -> bool:
    """Whether ``out`` is ``shape`` copied along a new or size-1 dimension 0, all others kept."""
    if len(out) == len(shape) + 1:
        return out[1:] == tuple(shape)
    return len(out) == len(shape) >= 1 and shape[0] == 1 and out[1:] == tuple(shape[1:])


def _passes_unchanged(node, name: str, slot: int) -> bool:
    """Whether the gradient with respect to input ``slot`` of ``node`` is its output's
    gradient, copies summed (expand, repeat, or an addition with factor 1)."""
    if name in _COPIES:
        return True
    if name == "AddBackward0":  # self + alpha * other
        return slot == 0 or getattr(node, "_saved_alpha", None) == 1
    if name == "SubBackward0":  # self - alpha * other
        return slot == 0
    return False


def _why(use, call, b: int, other: list[str], wrong: list[tuple]) -> str:
    uses = list(dict.fromkeys(other))
    if wrong:
        uses += [f"a broadcast to {s}, whose dimension 0 is not the {b} examples" for s in wrong]
    if not uses:
        uses = ["nothing the engine could follow to the examples"]
    return (
        f"module {use.name} ({type(use.module).__name__}) looks up ids of shape "
        f"{tuple(call.a.shape)} shared by all {b} examples, and its output "
        f"{tuple(call.out_shape)} is used by {', '.join(uses)}"
    )
