"""Poisson-sampled logical batches, split into physical chunks.

The privacy of DP-SGD is counted by the accountants in
:mod:`dptrain.accounting` as a *Poisson-subsampled* Gaussian mechanism: at
every step each record joins the batch independently with probability
``sample_rate`` (q). The amplification by subsampling that the accountants
credit holds only if batches really are drawn that way, so this module draws
them exactly like that:

- the batch size is random (Binomial(N, q)), not fixed;
- a batch may be empty; it is yielded like any other (the step still releases
  noise) and is never skipped or redrawn, since skipping or redrawing would
  change the sampling distribution the accountant assumes;
- q may change from step to step (a growing batch size, Anil et al. 2021);
  the q actually used at each step is reported so that the privacy ledger can
  record it (:meth:`dptrain.accounting.PrivacyLedger.record`).

A logical batch ("mega-batch") may be far larger than what fits through the
model at once; :func:`split_physical` cuts it into physical chunks whose
clipped gradients are summed before the one noisy update.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import default_collate

from dptrain._checks import check_int, check_sample_rate
from dptrain.generators import restore_generator
from dptrain.secure_random import secure_uniform

__all__ = [
    "ChunkUnits",
    "DPDataLoader",
    "LogicalBatch",
    "PoissonBatchSampler",
    "order_for_chunks",
    "pack_units",
    "split_physical",
]

_FORMAT_VERSION = 1

#: Records drawn per call to ``torch.rand``; bounds the sampler's memory
#: (8 bytes a record) for very large datasets. Part of the random stream: do
#: not change it, or seeds and checkpoints no longer reproduce their batches.
_BLOCK = 1 << 22

_MAX_SEED = 2**64 - 1

SampleRate = float | Callable[[int], float]


def _make_generator(
    generator: torch.Generator | None, seed: int | None
) -> tuple[torch.Generator, int | None]:
    """The generator to draw from and the seed it was started from (None if unknown)."""
    if generator is not None and seed is not None:
        raise ValueError(
            f"generator={generator!r} and seed={seed!r} are both given: pass at most one"
        )
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"generator={generator!r} is not allowed: expected a torch.Generator")
        if generator.device.type != "cpu":
            raise ValueError(
                f"generator={generator!r} is on device {generator.device}: expected a CPU generator"
            )
        # The caller's generator may already have advanced: its seed alone
        # does not identify the stream, so none is reported.
        return generator, None
    g = torch.Generator()
    if seed is None:
        return g, g.seed()  # from the OS; kept so that a run can log it
    seed = check_int("seed", seed, minimum=0)
    if seed > _MAX_SEED:
        raise ValueError(f"seed={seed!r} is outside the allowed range [0, 2**64 - 1]")
    g.manual_seed(seed)
    return g, seed


class PoissonBatchSampler:
    """Logical batches of record indices drawn by Poisson sampling.

    Iterating yields ``steps`` batches (each a sorted ``list[int]``); record
    ``i`` is in a batch independently of every other record and every other
    step, with probability q = :meth:`sample_rate_at` (step). This is the
    sampling the subsampled-Gaussian accountants assume. Batches may be empty
    and are yielded all the same.

    The sampler stands for a whole training run: ``steps`` batches in all. It
    remembers how many it has drawn, so a second ``iter()`` continues where
    the first stopped, and a sampler restored by :meth:`load_state_dict`
    continues the exact sequence of a checkpointed one.

    Membership is decided by ``torch.rand(..., dtype=torch.float64) < q``:
    with 53 random bits the inclusion probability exceeds q by less than
    2**-53 (float32 would overshoot by up to 2**-24, which is large next to
    the small q of big datasets).

    Args:
        dataset_size: number of records N (>= 1).
        sample_rate: q in (0, 1], or a function ``step -> q`` for a schedule
            (step counts from 0). A schedule's q is checked when its step is
            drawn.
        steps: number of logical batches (>= 0).
        generator: a CPU ``torch.Generator`` to draw from. Its seed is not
            known to the sampler, so :attr:`seed` is None.
        seed: an explicit seed in [0, 2**64 - 1]. With neither ``generator``
            nor ``seed``, a generator is seeded from the OS.
        secure: draw membership from the OS's CSPRNG (:func:`dptrain.secure_random.
            secure_uniform`, the same 53-bit grid) instead of a seeded torch generator:
            no seed exists that predicts the batches. Not reproducible, so neither
            ``generator`` nor ``seed`` may be given.

    Attributes:
        seed: the seed the generator started from (log it to reproduce a
            run), or None when ``generator`` was given.
    """

    def __init__(
        self,
        dataset_size: int,
        sample_rate: SampleRate,
        steps: int,
        generator: torch.Generator | None = None,
        *,
        seed: int | None = None,
        secure: bool = False,
    ):
        if secure and (generator is not None or seed is not None):
            raise ValueError(
                f"secure=True with generator={generator!r}, seed={seed!r}: secure sampling "
                "draws from the OS's CSPRNG and cannot be seeded; drop the seed / generator"
            )
        self.secure = secure
        self.dataset_size = check_int("dataset_size", dataset_size, minimum=1)
        self.steps = check_int("steps", steps, minimum=0)
        if callable(sample_rate):
            self._sample_rate: SampleRate = sample_rate
        else:
            self._sample_rate = check_sample_rate(sample_rate)
        self.generator, self.seed = _make_generator(generator, seed)
        self._steps_drawn = 0

    @classmethod
    def from_seed(
        cls, dataset_size: int, sample_rate: SampleRate, steps: int, seed: int
    ) -> PoissonBatchSampler:
        """A sampler whose generator starts from the integer ``seed``."""
        return cls(dataset_size, sample_rate, steps, seed=seed)

    # -- sampling ------------------------------------------------------------------

    def sample_rate_at(self, step: int) -> float:
        """q used at ``step`` (from 0); a schedule's bad q raises, naming the step."""
        step = check_int("step", step, minimum=0)
        if callable(self._sample_rate):
            return check_sample_rate(self._sample_rate(step), name=f"sample_rate(step={step})")
        return self._sample_rate  # type: ignore[return-value]

    @property
    def steps_drawn(self) -> int:
        """Number of batches drawn so far (the index of the next step)."""
        return self._steps_drawn

    def _draw(self) -> tuple[int, float, list[int]]:
        """Draw the next batch: (step, q, indices). The caller checks steps remain."""
        step = self._steps_drawn
        q = self.sample_rate_at(step)  # raises before the generator moves
        indices: list[int] = []
        for start in range(0, self.dataset_size, _BLOCK):
            n = min(_BLOCK, self.dataset_size - start)
            if self.secure:
                u = secure_uniform(n)
            else:
                u = torch.rand(n, generator=self.generator, dtype=torch.float64)
            hits = torch.nonzero(u < q).flatten()
            indices.extend((hits + start).tolist())
        self._steps_drawn = step + 1
        return step, q, indices

    def __iter__(self) -> Iterator[list[int]]:
        while self._steps_drawn < self.steps:
            _, _, indices = self._draw()
            yield indices

    def __len__(self) -> int:
        return self.steps

    def __repr__(self) -> str:
        q = "schedule" if callable(self._sample_rate) else f"{self._sample_rate:g}"
        return (
            f"PoissonBatchSampler(dataset_size={self.dataset_size}, sample_rate={q}, "
            f"steps={self.steps}, steps_drawn={self._steps_drawn}, seed={self.seed})"
        )

    # -- checkpoints ---------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """A plain-Python (JSON-safe) snapshot: generator state and steps drawn.

        The sample rate is not saved (a schedule is code): pass the same one to
        the sampler that loads this state.
        """
        return {
            "format_version": _FORMAT_VERSION,
            "dataset_size": self.dataset_size,
            "steps_drawn": self._steps_drawn,
            "seed": self.seed,
            "generator_state": self.generator.get_state().tolist(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`): the same batches follow."""
        version = state.get("format_version")
        if version != _FORMAT_VERSION:
            raise ValueError(
                f"sampler format_version={version!r} is not supported: expected {_FORMAT_VERSION}"
            )
        if state["dataset_size"] != self.dataset_size:
            raise ValueError(
                f"state dataset_size={state['dataset_size']!r} does not match this sampler's "
                f"dataset_size={self.dataset_size}"
            )
        steps_drawn = check_int("steps_drawn", state["steps_drawn"], minimum=0)
        if steps_drawn > self.steps:
            raise ValueError(
                f"steps_drawn={steps_drawn!r} is not allowed: expected an integer <= "
                f"steps={self.steps}"
            )
        restore_generator(self.generator, state["generator_state"])
        self.seed = state["seed"]
        self._steps_drawn = steps_drawn


def group_records(
    unit_ids: Sequence[Any], dataset_size: int, name: str = "unit_ids"
) -> list[list[int]]:
    """The record indices of each unit, units in order of first appearance (``name``: the
    argument's name in errors)."""
    if len(unit_ids) != dataset_size:
        raise ValueError(
            f"{name} has {len(unit_ids)} entries for a dataset of {dataset_size} records: "
            "expected one id per record"
        )
    members: dict[Any, list[int]] = {}
    for i, u in enumerate(unit_ids):
        key = u.item() if isinstance(u, torch.Tensor) else u
        try:
            members.setdefault(key, []).append(i)
        except TypeError as e:
            raise ValueError(
                f"{name}[{i}]={u!r} is not allowed: expected a hashable id (int or str)"
            ) from e
    return list(members.values())


def order_for_chunks(
    indices: Sequence[int],
    chunk_key: Callable[[int], float] | None,
    unit_members: Sequence[Sequence[int]] | None = None,
) -> list[int]:
    """A logical batch's records (or units) sorted by ``chunk_key`` before it is chunked.

    Sorting by length puts sequences of similar length in one chunk, so a chunk padded to
    its longest row carries less padding. The batch's records, and so the clipped sum and
    the guarantee, are unchanged: only which records share a forward pass. A unit (user)
    is placed by the largest key among its records. None keeps the sampled order.
    """
    if chunk_key is None:
        return list(indices)
    if unit_members is None:
        return sorted(indices, key=chunk_key)
    return sorted(indices, key=lambda u: max(map(chunk_key, unit_members[u])))


def split_physical(indices: Sequence[int], max_physical_batch_size: int) -> list[list[int]]:
    """Cut a logical batch into consecutive chunks of at most ``max_physical_batch_size``.

    Order is kept; an empty logical batch gives ``[]`` (no chunk, but the step
    still happens: its update is noise alone).
    """
    size = check_int("max_physical_batch_size", max_physical_batch_size, minimum=1)
    return [list(indices[i : i + size]) for i in range(0, len(indices), size)]


@dataclass(frozen=True)
class ChunkUnits:
    """The privacy units (users) of one physical chunk, for user-level clipping.

    Attributes:
        ids: (b,) for each record of the chunk, the index of its unit among the
            logical batch's units; records with the same id are clipped as one sum.
        part, parts: a unit with more records than a chunk holds is cut into
            ``parts`` chunks of its own, of which this is number ``part`` (from 0);
            ``parts == 1``: every unit of the chunk is whole in it.
    """

    ids: torch.Tensor
    part: int = 0
    parts: int = 1


def pack_units(
    units: Sequence[Sequence[int]], max_physical_batch_size: int
) -> list[tuple[list[int], ChunkUnits]]:
    """Cut a logical batch of units (each a list of record indices) into physical chunks.

    Units are packed whole, in order, into chunks of at most
    ``max_physical_batch_size`` records, so the engine can clip each unit's sum
    within its chunk; a unit larger than a chunk gets consecutive chunks of its own
    (clipped once, after its last part). Returns (record indices, units) per chunk.
    """
    size = check_int("max_physical_batch_size", max_physical_batch_size, minimum=1)
    out: list[tuple[list[int], ChunkUnits]] = []
    records: list[int] = []
    ids: list[int] = []

    def flush() -> None:
        if records:
            out.append((list(records), ChunkUnits(torch.tensor(ids, dtype=torch.long))))
            records.clear()
            ids.clear()

    for j, members in enumerate(units):
        n = len(members)
        if n > size:
            flush()
            parts = split_physical(members, size)
            for k, part in enumerate(parts):
                out.append(
                    (part, ChunkUnits(torch.full((len(part),), j, dtype=torch.long), k, len(parts)))
                )
            continue
        if len(records) + n > size:
            flush()
        records.extend(members)
        ids.extend([j] * n)
    flush()
    return out


@dataclass
class LogicalBatch:
    """One private step's data.

    Attributes:
        chunks: the collated physical chunks, in order (empty for an empty batch).
        size: number of records in the logical batch (the sum over chunks).
        sample_rate: q this step was drawn with; record it in the privacy ledger.
        step: index of the step, from 0.
        units: with user-level sampling, the units of each chunk (see
            :class:`ChunkUnits`); None when every record is its own unit.
        num_units: number of units (users) in the batch; ``size`` when records are units.
    """

    chunks: list[Any]
    size: int
    sample_rate: float
    step: int
    # keyword-only: subclasses (the distributed RankBatch) add fields without defaults
    units: list[ChunkUnits] | None = field(default=None, kw_only=True)
    num_units: int | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        if self.num_units is None:
            self.num_units = self.size

    def __iter__(self) -> Iterator[Any]:
        # An Opacus habit, ``for x, y in private.data_loader``, unpacks the batch. Yielding
        # the chunks instead would make that loop run, one optimizer step per chunk: many
        # more steps than the ledger plans, each on part of a Poisson batch. So refuse it,
        # and say what to write.
        raise TypeError(
            "a LogicalBatch is one private step, not (inputs, labels): iterate its physical "
            "chunks, `for batch in private.data_loader: for x, y in batch.chunks: "
            "private.backward(per_example_losses)`, then private.optimizer.step() once per "
            "batch (docs/migrating_from_opacus.md)"
        )


class DPDataLoader:
    """Poisson-sampled logical batches of a map-style dataset, as physical chunks.

    Each iteration yields a :class:`LogicalBatch` whose chunks are
    ``collate_fn([dataset[i] for i in chunk])`` for the chunks of
    :func:`split_physical`. Batch sizes are random and may be zero (see
    :class:`PoissonBatchSampler`); train on every batch, empty ones included,
    and record ``batch.sample_rate`` for each step. No worker processes.

    Every chunk of a logical batch is collated when the batch is yielded, so a
    logical batch must fit in host memory (chunks bound only what goes through
    the model at once).

    Args:
        dataset: supports ``len()`` and ``dataset[i]``.
        sample_rate: q in (0, 1] or a schedule ``step -> q``.
        steps: number of logical batches.
        max_physical_batch_size: most records per chunk (>= 1).
        collate_fn: turns a list of records into a chunk;
            default ``torch.utils.data.default_collate``.
        generator, seed, secure: as for :class:`PoissonBatchSampler`.
        unit_ids: one id (any hashable) per record for user-level DP: the units
            (users) are Poisson-sampled with rate q, each bringing all its records,
            and chunks are packed by unit (:func:`pack_units`); ``dataset_size`` and
            the expected batch size then count units.
        chunk_key: record index -> sort key (e.g. its length): each logical batch is
            sorted by it before chunking (:func:`order_for_chunks`); None: sampled order.
    """

    def __init__(
        self,
        dataset: Any,
        sample_rate: SampleRate,
        steps: int,
        max_physical_batch_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        generator: torch.Generator | None = None,
        *,
        seed: int | None = None,
        unit_ids: Sequence[Any] | None = None,
        chunk_key: Callable[[int], float] | None = None,
        secure: bool = False,
    ):
        self.dataset = dataset
        self.chunk_key = chunk_key
        n = check_int("len(dataset)", len(dataset), minimum=1)
        self.max_physical_batch_size = check_int(
            "max_physical_batch_size", max_physical_batch_size, minimum=1
        )
        self.collate_fn = default_collate if collate_fn is None else collate_fn
        self.unit_members = None if unit_ids is None else group_records(unit_ids, n)
        self.dataset_size = n if self.unit_members is None else len(self.unit_members)
        self.sampler = PoissonBatchSampler(
            self.dataset_size, sample_rate, steps, generator, seed=seed, secure=secure
        )

    @property
    def seed(self) -> int | None:
        """The sampler's seed (None when a generator was given)."""
        return self.sampler.seed

    def expected_batch_size(self, step: int) -> float:
        """Mean logical batch size at ``step`` in units: q * (number of records or units)."""
        return self.sampler.sample_rate_at(step) * self.dataset_size

    def __iter__(self) -> Iterator[LogicalBatch]:
        sampler = self.sampler
        while sampler.steps_drawn < sampler.steps:
            step, q, indices = sampler._draw()
            indices = order_for_chunks(indices, self.chunk_key, self.unit_members)
            if self.unit_members is None:
                chunks = [
                    self.collate_fn([self.dataset[i] for i in chunk])
                    for chunk in split_physical(indices, self.max_physical_batch_size)
                ]
                yield LogicalBatch(chunks=chunks, size=len(indices), sample_rate=q, step=step)
                continue
            packed = pack_units(
                [self.unit_members[u] for u in indices], self.max_physical_batch_size
            )
            yield LogicalBatch(
                chunks=[self.collate_fn([self.dataset[i] for i in recs]) for recs, _ in packed],
                size=sum(len(recs) for recs, _ in packed),
                sample_rate=q,
                step=step,
                units=[units for _, units in packed],
                num_units=len(indices),
            )

    def __len__(self) -> int:
        return len(self.sampler)

    def state_dict(self) -> dict[str, Any]:
        """The sampler's state (see :meth:`PoissonBatchSampler.state_dict`)."""
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`: the same logical batches follow."""
        self.sampler.load_state_dict(state)
