"""Checkpoint and resume a private training run, in one process or several.

    private = make_private(model, optimizer, data, ...)  # or make_private_distributed
    if os.path.exists("ckpt.pt"):
        load_checkpoint("ckpt.pt", private)   # model, optimizer, sampler, noise, ledger
    for batch in private.data_loader:
        ...
        private.optimizer.step()
        save_checkpoint("ckpt.pt", private)   # between steps; every rank takes part

One file holds the model, the optimizer (with the noise generator and the
ledger), the sampler, every rank's torch RNG state, the run's configuration
and what the caller adds (``extra``). With several processes rank 0 writes
(atomically) and reads (then broadcasts), after the ranks have checked that
their states agree; with one process the same calls do the same without a
process group. A resumed run draws the same remaining batches and noise and
continues the ledger: a crash never resets the budget.

A sharded run (an FSDP2 model, :class:`~dptrain.distributed.sharded_optimizer.ShardedDPOptimizer`)
is saved as a directory instead (:mod:`dptrain.distributed.sharded_checkpoint`): the
model and the wrapped optimizer through ``torch.distributed.checkpoint``, every rank
writing its own shards, and the rest (ledger, sampler, steps, seed, every rank's RNG
state, configuration, ``extra``) by rank 0. Same calls, same guarantees; the sharded
noise is keyed by (seed, ledger step, parameter), so it has no generator state to save.
:func:`~dptrain.distributed.consolidate.consolidate_checkpoint` (``dptrain consolidate``)
turns such a directory into a plain Hugging Face folder with its ``privacy.json``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dptrain._atomic import fsync_directory
from dptrain.data.poisson import PoissonBatchSampler
from dptrain.distributed import sharded_checkpoint
from dptrain.distributed.collectives import _broadcast_object, _describe, _raise_on_every_rank
from dptrain.distributed.consolidate import consolidate_checkpoint, describe_model
from dptrain.distributed.context import DistributedConfigError, _rank_and_world
from dptrain.distributed.fingerprint import _short
from dptrain.distributed.sharded_optimizer import ShardedDPOptimizer
from dptrain.privacy_engine import PrivateTraining

__all__ = ["CheckpointError", "consolidate_checkpoint", "load_checkpoint", "save_checkpoint"]

log = logging.getLogger(__name__)

_CHECKPOINT_VERSION = 1
_CHECKPOINT_KIND = "dptrain-checkpoint"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read, or the ranks' states differ."""


def _digest(obj: Any, h: Any = None) -> str:
    """A stable digest of nested dicts/lists/tensors/scalars (tensor bytes included)."""
    top = h is None
    h = hashlib.sha256() if h is None else h
    if isinstance(obj, Tensor):
        t = obj.detach().reshape(-1).cpu().contiguous()
        h.update(f"T{t.dtype}{t.numel()}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(b"{")
        for key in sorted(obj, key=repr):
            h.update(repr(key).encode())
            _digest(obj[key], h)
        h.update(b"}")
    elif isinstance(obj, list | tuple):
        h.update(b"[")
        for item in obj:
            _digest(item, h)
        h.update(b"]")
    else:
        h.update(repr(obj).encode())
    return h.hexdigest()[:16] if top else ""


def _sampler_of(private: PrivateTraining) -> PoissonBatchSampler:
    return private.data_loader.loader.sampler


def _run_config(private: PrivateTraining) -> dict[str, Any]:
    """What a resumed run must share with the run that saved the checkpoint."""
    sampler = _sampler_of(private)
    rates = [sampler.sample_rate_at(t) for t in range(sampler.steps)]
    return {
        "dataset_size": sampler.dataset_size,
        "steps": sampler.steps,
        "sample_rates": _short(repr(rates), limit=80),
        "noise_multiplier": private.optimizer.noise_multiplier,
        "max_grad_norm": private.optimizer.max_grad_norm,
        "privacy_unit": private.ledger.privacy_unit,
    }


def _is_sharded(private: PrivateTraining) -> bool:
    """Whether ``private`` trains an FSDP2-sharded model (each rank holds shards)."""
    return isinstance(private.optimizer, ShardedDPOptimizer)


def _rng_state() -> dict[str, Any]:
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return {"cpu": torch.get_rng_state(), "cuda": cuda}


def save_checkpoint(
    path: str | os.PathLike,
    private: PrivateTraining,
    *,
    extra: dict[str, Any] | None = None,
    group: Any = None,
) -> None:
    """Save the whole training state to ``path``; call between steps, on every rank.

    Saved (by rank 0, atomically: a temporary file renamed over ``path``):
    the model, the optimizer (wrapped optimizer's state, steps taken, noise seed
    and generator state, rank 0's ledger), the sampler (generator state, steps
    drawn), every rank's torch RNG state (dropout), the run's configuration and
    ``extra`` (e.g. an LR scheduler's ``state_dict()``; plain types and tensors).
    Works for :func:`~dptrain.make_private` and
    :func:`~dptrain.distributed.make_private_distributed`.

    A sharded (FSDP2) run writes the directory ``path`` instead: each rank its shards of
    the model and the wrapped optimizer (``torch.distributed.checkpoint``), rank 0 the
    rest; a new state is written beside the current one and ``path/latest.json`` is
    moved to it last (:mod:`dptrain.distributed.sharded_checkpoint`), so a run killed
    while saving keeps its previous checkpoint. ``path`` must be on a file system every
    rank sees; a file or a non-empty directory that is not a sharded checkpoint is
    refused (:class:`CheckpointError`), never written into.

    The ranks first compare digests of their model, optimizer state (not under
    sharding: each rank holds other shards), ledger, steps, noise seed and sampler: if
    they differ, nothing is written and :class:`CheckpointError` is raised on every rank.
    """
    rank, world = _rank_and_world(group)
    sharded = _is_sharded(private)
    local_error: BaseException | None = None
    parts: dict[str, str] = {}
    try:
        opt = private.optimizer
        sampler = _sampler_of(private)
        if sampler.steps_drawn != opt.steps_taken:
            raise ValueError(
                f"save_checkpoint was called in the middle of a step: the sampler has drawn "
                f"{sampler.steps_drawn} batches and the optimizer has taken {opt.steps_taken} "
                "steps; save between steps (after optimizer.step())"
            )
        parts = {
            "ledger": _digest(private.ledger.state_dict()),
            "steps_taken": repr(opt.steps_taken),
            "seed": repr(opt.seed),
            "sampler": _digest(sampler.state_dict()),
        }
        if not sharded:  # a sharded run's ranks hold different shards of these
            parts["model"] = _digest(private.model.state_dict())
            parts["optimizer"] = _digest(opt.original_optimizer.state_dict())
    except Exception as exc:
        local_error = exc
    rng_states = _raise_on_every_rank(
        "save_checkpoint", local_error, parts, group, _rng_state(), error_type=CheckpointError
    )
    if sharded:
        _save_sharded(Path(path), private, world, rng_states, extra, group)
        return
    status = None
    if rank == 0:
        try:
            state = {
                "kind": _CHECKPOINT_KIND,
                "format_version": _CHECKPOINT_VERSION,
                "world_size": world,
                "step": private.optimizer.steps_taken,
                "config": _run_config(private),
                "model": private.model.state_dict(),
                "optimizer": private.optimizer.state_dict(),
                "sampler": _sampler_of(private).state_dict(),
                "ledger": private.ledger.state_dict(),
                "rng": rng_states,
                "extra": {} if extra is None else extra,
            }
            _atomic_save(state, Path(path))
        except Exception as exc:
            status = f"could not write checkpoint path={str(path)!r}: {_describe(exc)}"
            log.error("%s", status)
    status = _broadcast_object(status, group)
    if status is not None:
        raise CheckpointError(f"rank 0 {status}")


def _save_sharded(
    path: Path,
    private: PrivateTraining,
    world: int,
    rng_states: list[Any],
    extra: dict[str, Any] | None,
    group: Any,
) -> None:
    opt = private.optimizer
    dp_state = opt.state_dict()
    del dp_state["optimizer"]  # the wrapped optimizer's shards go through DCP
    state = {
        "kind": _CHECKPOINT_KIND,
        "format_version": _CHECKPOINT_VERSION,
        "layout": "sharded",
        "world_size": world,
        "step": opt.steps_taken,
        "config": _run_config(private),
        "dp_optimizer": dp_state,
        "sampler": _sampler_of(private).state_dict(),
        "ledger": private.ledger.state_dict(),
        "rng": rng_states,
        "extra": {} if extra is None else extra,
        # for consolidation into a Hugging Face folder with its privacy record
        "model_info": describe_model(private.model),
        "target_delta": private.target_delta,
        "accountant": private.accountant,
    }
    try:
        sharded_checkpoint.save_sharded(
            path, private.model, opt.original_optimizer, state, group=group
        )
    except ValueError as exc:  # a path that is not a sharded checkpoint: refused by name
        raise CheckpointError(str(exc)) from exc
    except OSError as exc:
        raise CheckpointError(
            f"could not write sharded checkpoint path={str(path)!r}: {exc}"
        ) from exc


def _atomic_save(state: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    fsync_directory(path.parent)  # make the rename itself durable


def load_checkpoint(
    path: str | os.PathLike, private: PrivateTraining, *, group: Any = None
) -> dict[str, Any]:
    """Restore a :func:`save_checkpoint` into ``private``; call on every rank; returns ``extra``.

    Rank 0 reads the file and broadcasts it (no shared file system needed).
    ``private`` must come from the same configuration (same dataset size,
    steps, sample rates, sigma, C, privacy unit), else
    :class:`~dptrain.distributed.DistributedConfigError` on every rank; the
    world size may differ (sampling and noise do not depend on it), only the
    per-rank RNG states used by dropout are then not restored. The restored
    ledger continues: a crash never resets the budget.

    A sharded (FSDP2) run loads a sharded checkpoint's directory: rank 0 reads the
    small state and broadcasts it, every rank reads its shards (resharded by
    ``torch.distributed.checkpoint`` if the world size changed). A sharded checkpoint
    resumes a sharded run only, and a one-file checkpoint an unsharded run only
    (:class:`CheckpointError` otherwise).
    """
    rank, _ = _rank_and_world(group)
    sharded = _is_sharded(private)
    # rank 0's view of the path decides (the other ranks may not see a one-file checkpoint)
    seen = (sharded_checkpoint.is_sharded_checkpoint(path), os.path.exists(path))
    on_disk, exists = _broadcast_object(seen if rank == 0 else None, group)
    if sharded and not exists:
        raise CheckpointError(f"path={str(path)!r} does not exist: no checkpoint to resume")
    if on_disk != sharded:
        what = "a sharded (FSDP2) checkpoint directory" if on_disk else "not a sharded checkpoint"
        run = "a sharded (FSDP2) run" if sharded else "an unsharded run"
        hint = (
            "consolidate it (dptrain consolidate) to start an unsharded run from its weights"
            if on_disk
            else "a sharded run saves and resumes a directory (save_checkpoint on that run)"
        )
        raise CheckpointError(f"path={str(path)!r} is {what}, and this is {run}: {hint}")
    directory: Path | None = None
    if sharded:
        try:
            directory, state = sharded_checkpoint.read_state(path, group=group)
        except ValueError as exc:
            raise CheckpointError(f"rank 0 {exc}") from exc
    else:
        state = _read_file(path, rank, group)
    saved, current = state["config"], _run_config(private)
    diffs = [
        f"{k}={saved.get(k)!r} in the checkpoint, {current[k]!r} in this run"
        for k in current
        if saved.get(k) != current[k]
    ]
    if diffs:
        raise DistributedConfigError(
            f"checkpoint path={str(path)!r} does not match this run (a resumed run must use "
            "the configuration it was saved with): " + "; ".join(diffs)
        )
    if directory is not None:
        opt = private.optimizer
        # the DP wrapper's own state (ledger, steps, seed, rates); the wrapped optimizer's
        # current state goes round unchanged, then its shards come from the checkpoint
        opt.load_state_dict(
            {**state["dp_optimizer"], "optimizer": opt.original_optimizer.state_dict()}
        )
        try:
            sharded_checkpoint.load_shards(
                directory, private.model, opt.original_optimizer, group=group
            )
        except Exception as exc:
            raise CheckpointError(
                f"could not load the shards of path={str(path)!r} ({directory.name}): "
                f"{_describe(exc)}"
            ) from exc
    else:
        private.model.load_state_dict(state["model"])
        private.optimizer.load_state_dict(state["optimizer"])
    private.data_loader.load_state_dict(state["sampler"])
    rank_now, world_now = _rank_and_world(group)
    if state["world_size"] == world_now:
        rng = state["rng"][rank_now]
        torch.set_rng_state(rng["cpu"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    elif rank_now == 0:
        log.warning(
            "checkpoint saved with %d process(es), resumed with %d: sampling and noise continue "
            "exactly; dropout's random streams do not",
            state["world_size"],
            world_now,
        )
    if rank_now == 0:
        log.info("resumed from %s at step %d (%r)", path, state["step"], private.ledger)
    return state.get("extra", {})


def _read_file(path: str | os.PathLike, rank: int, group: Any) -> dict[str, Any]:
    """A one-file checkpoint, read by rank 0 and broadcast."""
    loaded: tuple[str | None, dict[str, Any] | None] = (None, None)
    if rank == 0:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(state, dict) or state.get("kind") != _CHECKPOINT_KIND:
                raise ValueError("not a dptrain checkpoint (no kind='dptrain-checkpoint')")
            version = state.get("format_version")
            if version != _CHECKPOINT_VERSION:
                raise ValueError(
                    f"format_version={version!r} is not supported: expected {_CHECKPOINT_VERSION}"
                )
            loaded = (None, state)
        except Exception as exc:
            loaded = (f"could not read checkpoint path={str(path)!r}: {_describe(exc)}", None)
    error, state = _broadcast_object(loaded, group)
    if error is not None or state is None:
        raise CheckpointError(f"rank 0 {error}")
    return state
