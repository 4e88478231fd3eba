""":func:`make_private_distributed`: :func:`~dptrain.make_private` on each of W processes.

The ranks first agree on the configuration (fingerprints all-gathered, any
error or difference raised on every rank), the seed and the ledger (rank 0's);
each then builds its private training locally, with a
:class:`~dptrain.distributed.DistributedDPDataLoader` and a
:class:`~dptrain.distributed.DistributedDPOptimizer`, and takes rank 0's
parameters and buffers.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from dptrain._checks import check_positive
from dptrain.accounting import PrivacyLedger
from dptrain.distributed.collectives import _broadcast_module_state, _raise_on_every_rank
from dptrain.distributed.context import DistributedConfigError, _rank_and_world
from dptrain.distributed.fingerprint import _config_fingerprint
from dptrain.distributed.fsdp import FSDPSharding, is_fsdp2, refuse_fsdp1, wrapping
from dptrain.distributed.optimizer import DistributedDPOptimizer
from dptrain.distributed.sampling import DistributedDPDataLoader, _per_rank_chunk
from dptrain.distributed.sharded_optimizer import ShardedDPOptimizer
from dptrain.distributed.sharded_sums import ShardedGradStore
from dptrain.optim import DPOptimizer
from dptrain.privacy_engine import PrivateTraining, _PrivateLoader, make_private

__all__ = ["make_private_distributed"]

log = logging.getLogger(__name__)


def make_private_distributed(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: Any,
    *,
    batch_size: int | Callable[[int], int],
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
    global_physical_batch_size: int | None = None,
    collate_fn: Callable[[list[Any]], Any] | None = None,
    chunk_key: Callable[[int], float] | None = None,
    seed: int | None = None,
    privacy_unit: str | None = None,
    user_ids: Any = None,
    ledger: PrivacyLedger | None = None,
    group: Any = None,
    bucket_cap_mb: float = 25.0,
    secure_mode: bool = False,
) -> PrivateTraining:
    """:func:`~dptrain.make_private` for each of W processes: call it on every rank alike.

    The arguments are :func:`~dptrain.make_private`'s, with:

    Args:
        user_ids: user-level DP as in :func:`~dptrain.make_private`: the same ids on
            every rank; the sampled users are shared out whole among the ranks.
        batch_size: the expected size B of the whole logical batch (all ranks
            together), or a schedule step -> B; q = B / N.
        max_physical_batch_size: most records one rank puts through the model
            at once (default: ceil(B / W)); or
        global_physical_batch_size: the same over all ranks together; it must
            be a multiple of W (each rank takes its W-th part), so that a
            configuration written for one process keeps its chunking.
        seed: the sampling and noise seed; None: rank 0 draws one from the OS
            and every rank uses it (logged on rank 0).
        ledger: continue this ledger (read on rank 0; every rank gets a copy).
        group: the process group (default: the default group; none: one process).
        bucket_cap_mb: size of the flattened all-reduce buckets (on a sharded model:
            of the clipped sums reduce-scattered by one collective).
        secure_mode: as for :func:`~dptrain.make_private` (noise and sampling from the
            OS's CSPRNG; ``seed`` must be None), on an FSDP2-sharded model only: rank 0
            draws each Poisson batch and broadcasts it, and each rank draws the noise of
            the coordinates it owns (:mod:`dptrain.distributed.sharded_optimizer`).

    Before building anything every rank's configuration is checked against
    the others' (:class:`~dptrain.distributed.DistributedConfigError` on every
    rank if a rank refuses its arguments or they differ); then rank 0's
    parameters and buffers are broadcast to all ranks. The model is not
    wrapped in DDP.

    Returns the :class:`~dptrain.PrivateTraining` of this rank, whose
    ``optimizer`` is a :class:`~dptrain.distributed.DistributedDPOptimizer`
    and whose ``data_loader`` yields this rank's
    :class:`~dptrain.distributed.RankBatch` es.
    """
    rank, world = _rank_and_world(group)
    what = "make_private_distributed"
    refuse_fsdp1(model)
    sharded = is_fsdp2(model)
    settings = {
        "batch_size": batch_size,
        "max_grad_norm": max_grad_norm,
        "epochs": epochs,
        "steps": steps,
        "target_epsilon": target_epsilon,
        "target_delta": target_delta,
        "noise_multiplier": noise_multiplier,
        "clipping": clipping,
        "mode": mode,
        "norm_method": norm_method,
        "sum_rounding": sum_rounding,
        "accountant": accountant,
        "max_physical_batch_size": max_physical_batch_size,
        "global_physical_batch_size": global_physical_batch_size,
        "seed": seed,
        "privacy_unit": privacy_unit,
        "user_ids": None if user_ids is None else _digest_ids(user_ids),
        "bucket_cap_mb": bucket_cap_mb,
        "secure_mode": secure_mode,
    }
    if privacy_unit is None:
        privacy_unit = "example" if user_ids is None else "user"
    # 1. Agree on the configuration, the seed and the ledger (one all-gather).
    local_error: BaseException | None = None
    fingerprint: dict[str, str] = {}
    chunk: int | None = None
    try:
        chunk = _per_rank_chunk(max_physical_batch_size, global_physical_batch_size, world)
        _check_secure_mode(secure_mode, seed, sharded)
        check_positive("bucket_cap_mb", bucket_cap_mb)
        fingerprint = _config_fingerprint(model, optimizer, data, settings)
    except Exception as exc:
        local_error = exc
    proposal = None
    if rank == 0:
        # (secure mode has no seed: its noise and batches are drawn from the OS's CSPRNG)
        drawn = seed if seed is not None or secure_mode else torch.Generator().seed()
        ledger0 = ledger if ledger is not None else PrivacyLedger(privacy_unit=privacy_unit)
        proposal = (drawn, ledger0.state_dict())
    payloads = _raise_on_every_rank(what, local_error, fingerprint, group, proposal)
    shared_seed, ledger_state = payloads[0]
    if seed is None and not secure_mode and rank == 0:
        log.info("sampling and noise seed %d (drawn from the OS on rank 0)", shared_seed)
    local_ledger = ledger if ledger is not None else PrivacyLedger(privacy_unit=privacy_unit)
    local_ledger.load_state_dict(ledger_state)

    # 2. Build locally; any failure is raised on every rank.
    local_error = None
    private: PrivateTraining | None = None
    result: PrivateTraining | None = None
    resolved: dict[str, str] = {}
    try:
        with wrapping():  # make_private would hand a sharded model back to this function
            private = make_private(
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
                max_physical_batch_size=chunk,
                collate_fn=collate_fn,
                chunk_key=chunk_key,
                seed=shared_seed,
                privacy_unit=privacy_unit,
                user_ids=user_ids,
                ledger=local_ledger,
                secure_mode=secure_mode,
            )
        base_opt = private.optimizer
        loader = DistributedDPDataLoader.from_loader(
            private.data_loader.loader,
            max_physical_batch_size=chunk,
            group=group,
            equal_chunks=sharded,
        )
        # the one-process optimizer's settings, on the distributed optimizer of either kind
        same = dict(
            noise_multiplier=base_opt.noise_multiplier,
            max_grad_norm=base_opt.max_grad_norm,
            expected_batch_size=base_opt.expected_batch_size,
            sample_rate=base_opt.sample_rate,
            ledger=local_ledger,
            seed=shared_seed,
            max_steps=base_opt.max_steps,
            group=group,
            engine=private.engine,
        )
        dp_optimizer: DPOptimizer
        if sharded:
            engine = private.engine
            sharding = FSDPSharding(model, engine.module_rules)
            sharding.refuse_unsharded({n: engine.parameter(n) for n in engine.parameter_names})
            engine.shard(sharding, ShardedGradStore(int(bucket_cap_mb * 2**20)))
            names = {id(engine.parameter(n)): n for n in engine.parameter_names}
            dp_optimizer = ShardedDPOptimizer(
                base_opt.original_optimizer, names=names, secure_mode=secure_mode, **same
            )
        else:
            dp_optimizer = DistributedDPOptimizer(
                base_opt.original_optimizer, bucket_cap_mb=bucket_cap_mb, **same
            )
        result = PrivateTraining(
            model=model,
            optimizer=dp_optimizer,
            data_loader=_PrivateLoader(loader, dp_optimizer),  # type: ignore[arg-type]
            engine=private.engine,
            ledger=local_ledger,
            noise_multiplier=private.noise_multiplier,
            target_delta=private.target_delta,
            accountant=private.accountant,
            steps=private.steps,
            privacy_unit=private.privacy_unit,
            by_user=private.by_user,
        )
        resolved = {
            "noise_multiplier (resolved)": repr(private.noise_multiplier),
            "steps (resolved)": repr(private.steps),
            "sample_rate (first step)": repr(base_opt.sample_rate),
            "max_steps": repr(base_opt.max_steps),
        }
    except Exception as exc:
        local_error = exc
        if private is not None:
            private.engine.detach()
    try:
        _raise_on_every_rank(what, local_error, resolved, group)
    except DistributedConfigError:
        if private is not None and local_error is None:
            private.engine.detach()
        raise
    assert result is not None
    # 3. Start from rank 0's parameters (a sharded model: its buffers; each rank holds
    # its own shard of the parameters, cut by fully_shard from the same full model).
    _broadcast_module_state(model, group, int(bucket_cap_mb * 2**20), parameters=not sharded)
    if rank == 0:
        log.info(
            "private training on %d process(es): sigma=%.4g, C=%g, q=%.4g, %d steps, "
            "%d records per chunk per rank",
            world,
            result.noise_multiplier,
            max_grad_norm,
            dp_optimizer.sample_rate,
            result.steps,
            result.data_loader.loader.max_physical_batch_size,
        )
    return result


def _check_secure_mode(secure_mode: Any, seed: int | None, sharded: bool) -> None:
    """Refuse secure_mode where it cannot hold: with a seed, or on an unsharded model
    (whose replicated noise is rank 0's seeded draw)."""
    if not isinstance(secure_mode, bool):
        raise ValueError(f"secure_mode={secure_mode!r} is not allowed: expected True or False")
    if not secure_mode:
        return
    if seed is not None:
        raise ValueError(
            f"secure_mode=True with seed={seed!r}: secure noise and sampling come from the "
            "OS's CSPRNG and cannot be seeded (a known seed would let anyone recompute the "
            "noise); drop the seed"
        )
    if not sharded:
        raise ValueError(
            "secure_mode=True is not allowed with make_private_distributed on an unsharded "
            "(replicated) model: its noise is drawn by rank 0 from a seeded generator. "
            "secure_mode is supported in one process (make_private) and on an FSDP2-sharded "
            "model (fully_shard)"
        )


def _digest_ids(user_ids: Any) -> str:
    """A short digest of the user ids, so that ranks can check they were given the same."""
    h = hashlib.sha256()
    for u in user_ids:
        h.update(repr(u.item() if hasattr(u, "item") else u).encode())
        h.update(b"\0")
    return h.hexdigest()[:16]
