"""What DPTrainer hands Trainer's loop: one Poisson-sampled logical batch per "batch".

Trainer's own loop draws ``gradient_accumulation_steps`` fixed-size batches per
optimizer update. A Poisson batch has a random size (Binomial(N, q)), so it does
not cut into a fixed number of fixed-size batches; DPTrainer therefore lets
Trainer see one item per update (a :class:`PoissonStep`, holding the logical
batch already cut into chunks of ``per_device_train_batch_size`` records) with
Trainer's gradient accumulation set to 1, and runs the chunks inside
``training_step``.

:class:`PoissonTrainLoader` is that iterable. It has no sampler of its own: it
draws from the run's :class:`~dptrain.data.DPDataLoader` (or its distributed
shard), whose state is the one checkpoints save. ``len()`` is the steps of one
epoch (N / B), and each ``iter()`` runs to the next epoch boundary of the
sampler's position, so a run resumed mid-epoch continues where the sampler stands
without Trainer skipping (and so drawing) batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from dptrain.data import LogicalBatch
from dptrain.data.hf_datasets import is_hf_dataset
from dptrain.hf.errors import PrivacyArgumentsError, SamplingConflictError

__all__ = [
    "DropColumns",
    "PoissonStep",
    "PoissonTrainLoader",
    "check_map_style",
    "column_values",
]


class PoissonStep:
    """One optimizer update's data, as Trainer's loop carries it.

    Trainer inspects its batches between the loader and ``training_step``
    (``"labels" in batch`` to count tokens, the main input to count FLOPs and
    tokens seen). ``in`` answers False for every key, so those inspections skip
    this object instead of miscounting a logical batch as one chunk; DPTrainer
    counts FLOPs per chunk itself.
    """

    __slots__ = ("batch",)

    def __init__(self, batch: LogicalBatch):
        self.batch = batch

    def __contains__(self, key: object) -> bool:
        return False

    def __repr__(self) -> str:
        return (
            f"PoissonStep(step={self.batch.step}, records={self.batch.size}, "
            f"chunks={len(self.batch.chunks)})"
        )


class PoissonTrainLoader:
    """Trainer's training "dataloader": one :class:`PoissonStep` per optimizer update.

    Args:
        dataset: the training set (Trainer reads ``len(loader.dataset)`` for its logs).
        steps_per_epoch: ``len()``; Trainer's epoch.
        source: returns the run's private training (built when Trainer creates the
            optimizer, after it asked for this loader), or None before that.
        before_first: called once before the first batch of each ``iter()`` (the
            trainer checks that a resumed ledger and sampler agree).
        budget_spent: True once the privacy budget allows no further step.
    """

    def __init__(
        self,
        dataset: Any,
        steps_per_epoch: int,
        source: Callable[[], Any],
        before_first: Callable[[], None],
        budget_spent: Callable[[], bool],
    ):
        self.dataset = dataset
        self.steps_per_epoch = steps_per_epoch
        self._source = source
        self._before_first = before_first
        self._budget_spent = budget_spent

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[PoissonStep]:
        private = self._source()
        if private is None:
            raise RuntimeError(
                "the private state does not exist yet: DPTrainer builds it in create_optimizer(), "
                "which Trainer calls before iterating the training data"
            )
        self._before_first()
        sampler = private.data_loader.loader.sampler
        drawn = sampler.steps_drawn
        end = min(sampler.steps, (drawn // self.steps_per_epoch + 1) * self.steps_per_epoch)
        batches = iter(private.data_loader)
        # Check before drawing: a batch drawn and not trained on would still move the
        # sampler, and the checkpointed stream would no longer match the ledger.
        while sampler.steps_drawn < end and not self._budget_spent():
            batch = next(batches, None)
            if batch is None:
                return
            yield PoissonStep(batch)


class DropColumns:
    """Wraps a collator: removes ``columns`` (the group_by id) from each record first."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any], columns: Sequence[str]):
        self.collate_fn = collate_fn
        self.columns = tuple(columns)

    def __call__(self, records: list[Any]) -> Any:
        return self.collate_fn(
            [
                {k: v for k, v in r.items() if k not in self.columns} if isinstance(r, dict) else r
                for r in records
            ]
        )


def check_map_style(dataset: Any) -> int:
    """``len(dataset)``; a dataset without ``len`` / ``[i]`` (an IterableDataset) is refused."""
    import torch

    if dataset is None:
        raise SamplingConflictError(
            "train_dataset=None: DPTrainer plans the sampling and the noise from the training "
            "set's size, so it needs train_dataset= when it is built"
        )
    if isinstance(dataset, torch.utils.data.IterableDataset) or not (
        hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    ):
        raise SamplingConflictError(
            f"train_dataset of type {type(dataset).__name__} is not allowed: Poisson sampling "
            "picks records by index, so it needs a map-style dataset (len() and [i]), e.g. a "
            "datasets.Dataset or a list; an IterableDataset (or streaming dataset) has neither"
        )
    n = len(dataset)
    if n < 1:
        raise SamplingConflictError("train_dataset is empty: expected at least one record")
    return n


def column_values(dataset: Any, column: str) -> list[Any]:
    """One value per record of ``dataset``'s ``column`` (a datasets.Dataset column, or the
    key ``column`` of each record)."""
    if is_hf_dataset(dataset):
        if column not in dataset.column_names:
            raise PrivacyArgumentsError(
                f"group_by={column!r} is not a column of train_dataset: its columns are "
                f"{dataset.column_names}"
            )
        return list(dataset[column])
    values = []
    for i in range(len(dataset)):
        record = dataset[i]
        if not isinstance(record, dict) or column not in record:
            keys = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise PrivacyArgumentsError(
                f"group_by={column!r}: record {i} of train_dataset has no such key ({keys})"
            )
        value = record[column]
        values.append(value.item() if hasattr(value, "item") else value)
    return values
