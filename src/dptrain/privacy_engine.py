"""``make_private``: a model, an optimizer and data in; their private versions out.

    private = make_private(model, optimizer, dataset, batch_size=256, max_grad_norm=1.0,
                           target_epsilon=3.0, target_delta=1e-5, epochs=3)
    for batch in private.data_loader:                 # Poisson-sampled logical batches
        private.optimizer.zero_grad()
        for x, y in batch.chunks:                     # physical chunks bound the memory
            private.backward(per_example_cross_entropy(model(x), y))
        private.optimizer.step()                      # noise once, step, ledger records
    print(private.epsilon())

The noise comes either from a target (epsilon, delta) over the planned steps
(calibrated with the chosen accountant) or from a given noise multiplier.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from dptrain._checks import check_delta, check_int, check_positive
from dptrain.accounting import (
    PrivacyLedger,
    calibrate_noise_multiplier,
    make_accountant,
    sample_rate_from_batch,
    steps_from_epochs,
)
from dptrain.clipping.engine import ClippingEngine, ClipStats
from dptrain.data import ChunkUnits, DPDataLoader, LogicalBatch
from dptrain.data.hf_datasets import with_torch_rows
from dptrain.data.poisson import group_records
from dptrain.optim import DPOptimizer
from dptrain.supported import check_model_supported, refuse_unsupported_autocast

__all__ = ["PrivateTraining", "check_optimizer_matches", "make_private"]

log = logging.getLogger(__name__)


def check_optimizer_matches(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer whose parameters are not exactly the model's trainable ones."""
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    in_opt = {id(p): p for g in optimizer.param_groups for p in g["params"]}
    missing = [n for i, n in trainable.items() if i not in in_opt]
    foreign = [f"tensor of shape {tuple(p.shape)}" for i, p in in_opt.items() if i not in trainable]
    if missing or foreign:
        parts = []
        if missing:
            parts.append(
                "trainable model parameters the optimizer does not update: " + ", ".join(missing)
            )
        if foreign:
            parts.append(
                "optimizer parameters that are not trainable parameters of the model: "
                + ", ".join(foreign)
            )
        raise ValueError("optimizer and model do not match: " + "; ".join(parts))


def _segments(rates: list[float], steps: int) -> list[tuple[float, int]]:
    """Run-length (q, steps) segments of a per-step rate list (one rate: constant)."""
    if len(rates) == 1:
        return [(rates[0], steps)]
    return [(q, len(list(run))) for q, run in itertools.groupby(rates)]


class _PrivateLoader:
    """Iterates the DP data loader and tells the optimizer each step's sample rate.

    With user-level units it also keeps the units of the current batch's chunks, in
    order, for :meth:`PrivateTraining.backward` to take one per chunk.
    """

    def __init__(self, loader: DPDataLoader, optimizer: DPOptimizer):
        self.loader = loader
        self.optimizer = optimizer
        self.pending_units: collections.deque[ChunkUnits] = collections.deque()
        # rows of padding at the end of each chunk (equal chunks on a sharded model)
        self.pending_padding: collections.deque[int] = collections.deque()

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[LogicalBatch]:
        for batch in self.loader:
            self.optimizer.set_sample_rate(batch.sample_rate, self.loader.dataset_size)
            self.pending_units = collections.deque(batch.units or [])
            self.pending_padding = collections.deque(getattr(batch, "padding", None) or [])
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


def _without_padding(stats: ClipStats, keep: int) -> ClipStats:
    return ClipStats(stats.norms[:keep], stats.factors[:keep], stats.max_grad_norm)


@dataclass
class PrivateTraining:
    """What :func:`make_private` returns."""

    model: nn.Module
    optimizer: DPOptimizer
    data_loader: _PrivateLoader
    engine: ClippingEngine
    ledger: PrivacyLedger
    noise_multiplier: float
    target_delta: float | None
    accountant: str
    steps: int
    privacy_unit: str = "example"
    by_user: bool = False
    """Whether records are grouped into units by ``user_ids`` (clipped per unit)."""
    # records (not padding) of the open unit so far (a sharded model's user larger than a chunk)
    _unit_rows: int = field(default=0, init=False, repr=False)

    def backward(self, per_example_losses: Tensor) -> ClipStats:
        """Clip this chunk's per-example gradients and add them to the step's sum.

        With ``user_ids`` (user-level DP) the chunks must be passed in the batch's order: each
        call takes the next chunk's units (:class:`~dptrain.data.ChunkUnits`) and clips
        each user's summed gradient as one; a user cut across chunks is clipped at its
        last chunk (the figures of the other parts are empty).
        """
        if self.data_loader.pending_padding:
            return self._backward_padded(per_example_losses)
        if not self.by_user:
            return self.engine.backward(per_example_losses)
        pending = self.data_loader.pending_units
        if not pending:
            raise RuntimeError(
                "user-level DP: backward() was called for more chunks than the logical "
                "batch has; call it once per chunk of private.data_loader's batch, in order"
            )
        units = pending[0]
        if per_example_losses.shape != units.ids.shape:
            raise ValueError(
                f"per_example_losses has shape {tuple(per_example_losses.shape)}, but the next "
                f"chunk of the batch holds {units.ids.shape[0]} records: pass the chunks in order"
            )
        pending.popleft()
        if units.parts == 1:
            return self.engine.backward(per_example_losses, units=units.ids)
        self.engine.add_to_unit(per_example_losses)
        if units.part == units.parts - 1:
            return self.engine.close_unit()
        empty = torch.zeros(0)
        return ClipStats(empty, empty, self.engine.max_grad_norm)

    def _backward_padded(self, per_example_losses: Tensor) -> ClipStats:
        """A chunk whose last rows are padding (every rank of a sharded model runs the same
        chunks): their losses are multiplied by 0 before the engine's backward, so their
        rows of every output gradient, and their clipped gradients, are exactly zero."""
        pad = self.data_loader.pending_padding.popleft()
        b = per_example_losses.shape[0]
        if per_example_losses.dim() != 1 or b < pad:
            raise ValueError(
                f"per_example_losses has shape {tuple(per_example_losses.shape)}, but the next "
                f"chunk of the batch ends in {pad} rows of padding: pass the chunks in order, "
                "one loss per record"
            )
        # multiplied even where nothing is padded: every rank's graph has the same shape
        # (the engine's checks run on new graph shapes, and all ranks must run them alike)
        keep = torch.ones(b, dtype=per_example_losses.dtype, device=per_example_losses.device)
        keep[b - pad :] = 0
        if not self.by_user:
            return _without_padding(self.engine.backward(per_example_losses * keep), b - pad)
        units = self.data_loader.pending_units.popleft()
        if units.ids.shape != (b,):
            raise ValueError(
                f"per_example_losses has shape {tuple(per_example_losses.shape)}, but the next "
                f"chunk of the batch holds {units.ids.shape[0]} records: pass the chunks in order"
            )
        if units.parts > 1:
            # a part of a user larger than a chunk (padded with copies of its own records),
            # or on a rank without such a user at this slot, padding alone: every rank
            # accumulates one unit over the same parts and clips it at the same last part
            self.engine.add_to_unit(per_example_losses * keep)
            self._unit_rows += b - pad
            if units.part < units.parts - 1:
                empty = torch.zeros(0)
                return ClipStats(empty, empty, self.engine.max_grad_norm)
            stats = self.engine.close_unit()
            rows, self._unit_rows = self._unit_rows, 0
            return _without_padding(stats, 1 if rows else 0)
        # user-level: the padding rows are one unit of their own, the chunk's last
        stats = self.engine.backward(per_example_losses * keep, units=units.ids)
        users = int(units.ids.unique().numel()) - (1 if pad else 0)
        return _without_padding(stats, users)

    def epsilon(self, delta: float | None = None, accountant: str | None = None) -> float:
        """epsilon spent so far (from the ledger), at ``delta`` (default: the target delta)."""
        delta = self.target_delta if delta is None else delta
        if delta is None:
            raise ValueError("delta=None: give delta= (no target_delta was set)")
        return make_accountant(accountant or self.accountant, self.ledger).epsilon(delta)


def _batch_size_of(data: Any, batch_size: Any) -> int | Callable[[int], int]:
    """B from ``batch_size=`` or, when it is None, from the DataLoader ``data``."""
    loader_batch = data.batch_size if isinstance(data, torch.utils.data.DataLoader) else None
    if batch_size is None:
        if loader_batch is None:
            raise ValueError(
                "batch_size=None: give batch_size= (the expected logical batch size B; "
                "q = B / N), or pass a DataLoader built with batch_size=B"
            )
        return loader_batch
    # 1 is DataLoader's default, indistinguishable from "not given": batch_size= decides
    if loader_batch not in (None, 1, batch_size) and not callable(batch_size):
        raise ValueError(
            f"batch_size={batch_size!r} and the DataLoader's batch_size={loader_batch} differ: "
            "give the expected logical batch size once (either is enough)"
        )
    return batch_size


def make_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Any,
    *,
    batch_size: int | Callable[[int], int] | None = None,
    max_grad_norm: float,
    epochs: float | None = None,
    steps: int | None = None,
    target_epsilon: float | None = None,
    target_delta: float | None = None,
    noise_multiplier: float | None = None,
    clipping: str = "flat",
    mode: str = "book_keeping",
    norm_method: str = "auto",
    sum_rounding: str = "exact",
    accountant: str = "pld",
    max_physical_batch_size: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    chunk_key: Callable[[int], float] | None = None,
    seed: int | None = None,
    privacy_unit: str | None = None,
    user_ids: Any = None,
    ledger: PrivacyLedger | None = None,
    secure_mode: bool = False,
) -> PrivateTraining:
    """Make ``model``, ``optimizer`` and ``data`` private (DP-SGD / DP-Adam with Poisson sampling).

    Args:
        data: a map-style Dataset (a ``datasets.Dataset`` too: without ``collate_fn`` its
            rows are read as tensors), or a DataLoader whose dataset, collate_fn and
            batch_size are used (its sampler is not: batches are Poisson-sampled anew).
        batch_size: the expected logical batch size B (q = B / N), or a function
            step -> B for a growing batch size (Anil et al. 2021; needs ``steps``):
            calibration and the ledger then follow the schedule step by step. None
            (default): the DataLoader's ``batch_size``, as Opacus' make_private takes it.
        max_grad_norm: the clipping norm C.
        epochs / steps: the training length (one of them).
        target_epsilon, target_delta: calibrate sigma so the planned steps meet them; or
        noise_multiplier: use this sigma (then target_delta is only for reporting).
        clipping, mode, norm_method, sum_rounding: see
            :class:`dptrain.clipping.ClippingEngine`.
        accountant: ``pld`` (default), ``rdp`` or ``gdp`` for calibration and reports.
        max_physical_batch_size: chunk size for memory (default: B).
        chunk_key: record index -> sort key (e.g. its length in tokens): each logical
            batch is sorted by it before it is cut into chunks, so chunks padded to their
            longest row waste less (the batch and the guarantee are unchanged).
        seed: fixes the sampling and the noise; None draws from the OS (logged).
        privacy_unit: what one unit of the guarantee is called in the ledger and every
            report: default ``"example"`` (one record), or ``"user"`` with ``user_ids``
            (a name such as "user" without ``user_ids`` says that each record already
            holds all of one user's data, as a recommender's sequence does).
        user_ids: one id (int or str) per record: user-level DP. Users are
            Poisson-sampled (``batch_size`` is then the expected number of *users* per
            batch, and epochs count passes over the users), each bringing all their
            records, and each user's gradient summed over their records in the batch is
            clipped as one (:mod:`dptrain.clipping.units`), also across chunks.
        ledger: continue an existing ledger (a resumed run).

    Trainable parameters must be float32, float64 or bfloat16 on a CPU or CUDA device,
    and a forward under autocast must autocast to bfloat16 (:mod:`dptrain.supported`);
    anything else is refused with a ValueError naming it.
        secure_mode: draw the noise and the Poisson sampling from the operating system's
            cryptographically secure generator (:mod:`dptrain.secure_random`; Opacus'
            ``secure_mode``): no seed exists that predicts them. Slower noise (0.3-0.6 us
            a coordinate on one CPU thread, 50-90x torch's) and not reproducible, so ``seed``
            must be None.
    """
    batch_size = _batch_size_of(data, batch_size)
    # imported here: dptrain.distributed builds on this module
    from dptrain.distributed import fsdp

    fsdp.refuse_fsdp1(model)
    if fsdp.is_fsdp2(model) and not fsdp.wrapping_now():
        from dptrain.distributed import make_private_distributed

        # a sharded model spans ranks: the same call on every rank, sums reduced in shards
        return make_private_distributed(
            model,
            optimizer,
            data,
            batch_size=batch_size,
            max_grad_norm=max_grad_norm,
            epochs=epochs,
            steps=steps,
            target_epsilon=target_epsilon,
            target_delta=target_delta,
            noise_multiplier=noise_multiplier,
            clipping=clipping,
            mode=mode,
            norm_method=norm_method,
            sum_rounding=sum_rounding,
            accountant=accountant,
            max_physical_batch_size=max_physical_batch_size,
            collate_fn=collate_fn,
            chunk_key=chunk_key,
            seed=seed,
            privacy_unit=privacy_unit,
            user_ids=user_ids,
            ledger=ledger,
            secure_mode=secure_mode,
        )
    if secure_mode and seed is not None:
        raise ValueError(
            f"secure_mode=True with seed={seed!r}: secure noise and sampling come from the "
            "OS's CSPRNG and cannot be seeded (a known seed would let anyone recompute the "
            "noise); drop the seed"
        )
    dataset = getattr(data, "dataset", data)
    if collate_fn is None and isinstance(data, torch.utils.data.DataLoader):
        collate_fn = data.collate_fn
    if collate_fn is None:
        # default_collate would transpose a datasets.Dataset's list columns
        dataset = with_torch_rows(dataset)
    if privacy_unit is None:
        privacy_unit = "example" if user_ids is None else "user"
    if user_ids is not None and privacy_unit == "example":
        raise ValueError(
            "privacy_unit='example' with user_ids: user_ids group several records into one "
            "unit; pass privacy_unit='user' (or the unit's name), or no user_ids"
        )
    n = len(dataset)
    members = None if user_ids is None else group_records(list(user_ids), n, "user_ids")
    if members is not None:
        n = len(members)  # users are what is sampled and counted
    if (epochs is None) == (steps is None):
        raise ValueError(f"epochs={epochs!r}, steps={steps!r}: give exactly one of them")
    if callable(batch_size):
        if steps is None:
            raise ValueError("a batch_size schedule needs steps= (epochs are ambiguous)")
        total_steps = check_int("steps", steps, 1)
        rates = [sample_rate_from_batch(batch_size(t), n) for t in range(total_steps)]
        q = rates[0]
        sample_rate: float | Callable[[int], float] = rates.__getitem__
        first_batch = batch_size(0)
    else:
        q = sample_rate_from_batch(batch_size, n)
        total_steps = (
            steps_from_epochs(epochs, q) if epochs is not None else check_int("steps", steps, 1)
        )
        rates = [q]
        sample_rate = q
        first_batch = batch_size
    schedule = _segments(rates, total_steps)
    if (target_epsilon is None) == (noise_multiplier is None):
        raise ValueError(
            f"target_epsilon={target_epsilon!r}, noise_multiplier={noise_multiplier!r}: "
            "give exactly one of them"
        )
    if target_delta is not None:
        target_delta = check_delta(target_delta, "target_delta")
    if target_epsilon is not None:
        if target_delta is None:
            raise ValueError("target_delta=None: a target_epsilon needs a target_delta")
        sigma = calibrate_noise_multiplier(
            target_epsilon, target_delta, schedule=schedule, accountant=accountant
        )
        log.info(
            "noise multiplier %.4f for (%g, %g)-DP over %d steps at q=%.4g (%s)",
            sigma,
            target_epsilon,
            target_delta,
            total_steps,
            q,
            accountant,
        )
    else:
        sigma = check_positive("noise_multiplier", noise_multiplier)
    check_optimizer_matches(model, optimizer)
    check_model_supported(model)
    engine = ClippingEngine(
        model,
        max_grad_norm,
        clipping=clipping,
        mode=mode,
        norm_method=norm_method,
        sum_rounding=sum_rounding,
    )
    ledger = ledger if ledger is not None else PrivacyLedger(privacy_unit=privacy_unit)
    if ledger.privacy_unit != privacy_unit:
        raise ValueError(
            f"ledger.privacy_unit={ledger.privacy_unit!r} does not match "
            f"privacy_unit={privacy_unit!r}: a ledger counts one unit"
        )
    dp_optimizer = DPOptimizer(
        optimizer,
        noise_multiplier=sigma,
        max_grad_norm=max_grad_norm,
        expected_batch_size=q * n,
        sample_rate=q,
        ledger=ledger,
        seed=seed,
        max_steps=ledger.num_steps + total_steps if target_epsilon is not None else None,
        engine=engine,
        secure_mode=secure_mode,
    )
    loader = DPDataLoader(
        dataset,
        sample_rate,
        total_steps,
        max_physical_batch_size or first_batch,
        collate_fn=collate_fn,
        seed=seed,
        unit_ids=user_ids,
        chunk_key=chunk_key,
        secure=secure_mode,
    )
    # float16 autocast is only visible when the forward runs: refused there, before the
    # backward that would clip it (and so before the first step)
    refuse_unsupported_autocast(model)
    return PrivateTraining(
        model=model,
        optimizer=dp_optimizer,
        data_loader=_PrivateLoader(loader, dp_optimizer),
        engine=engine,
        ledger=ledger,
        noise_multiplier=sigma,
        target_delta=target_delta,
        accountant=accountant,
        steps=total_steps,
        privacy_unit=privacy_unit,
        by_user=user_ids is not None,
    )
