"""What the engine's checks read from the engine: two small interfaces.

The checks (:mod:`dptrain.clipping.self_check`, :mod:`dptrain.clipping.independence`)
decide whether a chunk's records can be trusted; the engine
(:mod:`dptrain.clipping.engine`) records, forms norms and sums. The checks see the
engine only through these protocols, which the engine implements with a small
adapter, so that neither module reaches into the other's private names and a
reader finds in one place everything a verdict depends on.
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor, nn

__all__ = ["Owner", "Reruns", "Sums"]


class Owner(Protocol):
    """A clipped module's record for one check: its name, module and rule."""

    name: str
    module: nn.Module
    rule: Any
    calls: list


class Sums(Protocol):
    """What the rows and completeness checks need: the clipped parameters, and the
    rules' weighted sum of a parameter's per-example gradients from this chunk's records."""

    model: nn.Module
    sums_from_records: bool
    """Whether the clipped sum is formed from the records (book-keeping, or ghost on a
    low-precision chunk); if not, ghost's second backward follows the check."""

    def parameters_of(self, uses) -> list[str]:
        """Names of the clipped parameters of these modules."""

    def records(self, calls: list, grads: list, b: int) -> dict:
        """The records (a, g) of ``calls`` [(module, call)] with these output gradients
        (examples first; None for a call the gradient did not reach), as the engine
        builds them from its own backward."""

    def parameter(self, name: str) -> nn.Parameter:
        """The clipped parameter called ``name`` as autograd's graph holds it (under FSDP2:
        the unsharded parameter its module's forward used)."""

    def owners(self, name: str) -> list[Owner]:
        """The modules whose rules cover parameter ``name``."""

    def weighted_sum(
        self, name: str, records: dict, weights: Tensor, cache: dict, formed=()
    ) -> Tensor:
        """sum_i weights_i grad_i of parameter ``name`` from the records (``cache``: the
        rules' whole-module sums for these weights; ``formed``: modules whose sum is taken
        over per-example gradients formed from the record, as a streamed module's is)."""

    def accumulation_bound(self, name: str, records: dict, weights: Tensor) -> Tensor | None:
        """An elementwise bound on how far autograd's own gradient of ``name`` (for these
        example weights) may lie from the exact sum, where its kernels add many terms in
        low precision; None where they round once."""


class Reruns(Protocol):
    """What the independence check needs: the last training forward and a way to re-run
    the model that records each clipped module's first input per call."""

    model: nn.Module
    root_inputs: tuple | None
    """(args, kwargs) of the last training forward, detached."""
    root_random_state: tuple | None
    """The random state that forward began from."""
    sizes_by_data: bool
    """Whether the losses' graph selects rows by index values anywhere (routing)."""
    lockstep: bool
    """Whether every rank must run the same passes (a sharded model: each forward
    gathers parameters from all ranks), whatever its chunk holds."""

    def probe(self, args: tuple, kwargs: dict) -> dict[Any, list]:
        """Run the model without gradients; {module record: [input summary per call]}."""
