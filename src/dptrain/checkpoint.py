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

from dptrain.data.poisson import PoissonBatchSampler
from dptrain.distributed.collectives import _broadcast_object, _describe, _raise_on_every_rank
from dptrain.distributed.context import DistributedConfigError, _rank_and_world
from dptrain.distributed.fingerprint import _short
from dptrain.privacy_engine import PrivateTraining

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]

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

    The ranks first compare digests of their model, optimizer state, ledger and
    sampler: if they differ, no file is written and :class:`CheckpointError`
    is raised on every rank.
    """
    rank, world = _rank_and_world(group)
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
            "model": _digest(private.model.state_dict()),
            "optimizer": _digest(opt.original_optimizer.state_dict()),
            "ledger": _digest(private.ledger.state_dict()),
            "steps_taken": repr(opt.steps_taken),
            "sampler": _digest(sampler.state_dict()),
        }
    except Exception as exc:
        local_error = exc
    rng_states = _raise_on_every_rank(
        "save_checkpoint", local_error, parts, group, _rng_state(), error_type=CheckpointError
    )
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
    with contextlib.suppress(OSError):  # make the rename itself durable
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
    """
    rank, _ = _rank_and_world(group)
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
