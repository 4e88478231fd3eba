"""The directory of a sharded (FSDP2) checkpoint: every rank writes its shards, rank 0 the rest.

Layout (``path`` is a directory)::

    path/latest.json              which state is current (written last, atomically)
    path/step-00000005-1a2b3c4d/  one complete state:
        .metadata, __0_0.distcp, __1_0.distcp, ...   torch.distributed.checkpoint (DCP):
                                  the model and the wrapped optimizer, each rank its shards
        dptrain.pt                rank 0: ledger, sampler, DP optimizer, RNG states, config

A save writes a new state into a hidden temporary directory, renames it into place,
then points ``latest.json`` at it (a temporary file renamed over it) and only then
removes the states it replaced. A run killed at any moment leaves ``latest.json``
naming a complete state: the previous one or the new one. POSIX cannot rename a
directory over a non-empty one, hence the pointer rather than a rename of ``path``.

``path`` must be on a file system every rank sees (as DCP requires: rank 0 writes
the metadata, every rank its shards, and a load reads any rank's). The small state
is read by rank 0 and broadcast. Loading reshards: a checkpoint written by W ranks
loads on any number of ranks, or in one process without a process group
(:mod:`dptrain.distributed.consolidate`).

Nothing here knows what the small state holds (:mod:`dptrain.checkpoint` builds it);
errors are raised on every rank alike, as ``ValueError`` (a path dptrain will not
write into, a directory that is not a sharded checkpoint) or ``OSError``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from dptrain._atomic import fsync_directory, write_json_atomically
from dptrain.distributed.collectives import _broadcast_object, _describe
from dptrain.distributed.context import _rank_and_world

__all__ = [
    "FORMAT_VERSION",
    "KIND",
    "POINTER_FILE",
    "STATE_FILE",
    "is_sharded_checkpoint",
    "load_shards",
    "read_state",
    "save_sharded",
    "state_directory",
]

KIND = "dptrain-sharded-checkpoint"
FORMAT_VERSION = 1
POINTER_FILE = "latest.json"
STATE_FILE = "dptrain.pt"
_STATE_PREFIX = "step-"


def is_sharded_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a directory holding a sharded checkpoint (its ``latest.json``)."""
    return (Path(path) / POINTER_FILE).is_file()


def _read_pointer(path: Path) -> dict[str, Any]:
    try:
        pointer = json.loads((path / POINTER_FILE).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path / POINTER_FILE} is not readable JSON ({_describe(exc)})") from None
    if not isinstance(pointer, dict) or pointer.get("kind") != KIND:
        raise ValueError(f"{path / POINTER_FILE} is not a dptrain sharded checkpoint's pointer")
    if pointer.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"format_version={pointer.get('format_version')!r} is not supported: expected "
            f"{FORMAT_VERSION} (a newer dptrain may have written it)"
        )
    return pointer


def state_directory(path: str | os.PathLike) -> Path:
    """The directory of the current state of the sharded checkpoint at ``path``."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"path={str(path)!r} is not a directory: no sharded checkpoint there")
    if not is_sharded_checkpoint(path):
        raise ValueError(
            f"path={str(path)!r} has no {POINTER_FILE}: not a dptrain sharded checkpoint"
        )
    directory = path / str(_read_pointer(path)["state"])
    if not (directory / STATE_FILE).is_file():
        raise ValueError(f"{directory} lacks {STATE_FILE}: the checkpoint is incomplete")
    return directory


def _prepare(path: Path, step: int) -> tuple[Path, Path]:
    """(temporary directory, final directory) of a new state; refuses a path that holds
    anything but a sharded checkpoint (a file, a user's directory): never written into."""
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"path={str(path)!r} is a file: a sharded (FSDP2) checkpoint is a directory; "
            "give a new path (the file was left as it is)"
        )
    if path.is_dir() and any(path.iterdir()) and not is_sharded_checkpoint(path):
        raise ValueError(
            f"path={str(path)!r} is a non-empty directory that is not a dptrain sharded "
            "checkpoint (no latest.json): dptrain does not write into it; give a new or "
            "empty directory"
        )
    if path.is_dir() and is_sharded_checkpoint(path):
        _read_pointer(path)  # refuse to replace what this version cannot read
    path.mkdir(parents=True, exist_ok=True)
    name = f"{_STATE_PREFIX}{step:08d}-{secrets.token_hex(4)}"
    tmp = path / f".{name}.tmp"
    tmp.mkdir()
    return tmp, path / name


def _publish(path: Path, tmp: Path, final: Path, state: dict[str, Any], world: int) -> None:
    """Rank 0: the small state into ``tmp``, ``tmp`` renamed to ``final``, the pointer moved,
    the replaced states (and temporaries of crashed saves) removed."""
    with open(tmp / STATE_FILE, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_directory(tmp)
    os.rename(tmp, final)
    fsync_directory(path)
    pointer = {
        "kind": KIND,
        "format_version": FORMAT_VERSION,
        "state": final.name,
        "step": state.get("step"),
        "world_size": world,
    }
    write_json_atomically(path / POINTER_FILE, pointer, durable=True)
    fsync_directory(path)
    for entry in path.iterdir():
        # only what a save makes: the user's other files in the directory stay
        ours = entry.name.startswith(_STATE_PREFIX) or (
            entry.name.startswith(f".{_STATE_PREFIX}") and entry.name.endswith(".tmp")
        )
        if ours and entry.is_dir() and entry.name != final.name:
            shutil.rmtree(entry, ignore_errors=True)


def save_sharded(
    path: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    *,
    group: Any = None,
) -> Path:
    """Write a new state of the checkpoint at ``path``; call on every rank; returns its directory.

    ``model`` and ``optimizer`` (the wrapped torch optimizer) go through DCP, each rank
    writing its shards; rank 0 writes its ``state`` (``state["step"]`` names the
    directory) with ``torch.save``. Raises the same error on every rank if any part fails;
    the previous state then stays current and the temporary directory is removed.
    """
    path = Path(path)
    rank, world = _rank_and_world(group)
    plan: tuple[str | None, bool, str | None, str | None] = (None, False, None, None)
    if rank == 0:
        try:
            tmp, final = _prepare(path, int(state["step"]))
            plan = (None, False, str(tmp), str(final))
        except ValueError as exc:  # a path dptrain refuses: the message says why
            plan = (str(exc), True, None, None)
        except Exception as exc:
            plan = (f"could not create a state in {path}: {_describe(exc)}", False, None, None)
    error, refused, tmp_name, final_name = _broadcast_object(plan, group)
    if error is not None:
        raise ValueError(error) if refused else OSError(error)
    tmp, final = Path(str(tmp_name)), Path(str(final_name))
    status: str | None = None
    try:
        dcp.save(_state_dicts(model, optimizer), checkpoint_id=tmp, process_group=group)
    except Exception as exc:
        status = f"writing the shards failed: {_describe(exc)}"
    if status is None and rank == 0:
        try:
            _publish(path, tmp, final, state, world)
        except Exception as exc:
            status = f"rank 0 could not write {final}: {_describe(exc)}"
    status = _broadcast_object(status, group)
    if status is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise OSError(status)
    return final


def read_state(path: str | os.PathLike, *, group: Any = None) -> tuple[Path, dict[str, Any]]:
    """(current state's directory, rank 0's small state), read by rank 0 and broadcast;
    call on every rank (or in one process without a process group)."""
    rank, _ = _rank_and_world(group)
    loaded: tuple[str | None, str | None, dict[str, Any] | None] = (None, None, None)
    if rank == 0:
        try:
            directory = state_directory(path)
            state = torch.load(directory / STATE_FILE, map_location="cpu", weights_only=True)
            loaded = (None, str(directory), state)
        except Exception as exc:
            loaded = (f"could not read path={str(path)!r}: {_describe(exc)}", None, None)
    error, directory_name, state = _broadcast_object(loaded, group)
    if error is not None or state is None:
        raise ValueError(error)
    return Path(str(directory_name)), state


def load_shards(
    directory: str | os.PathLike,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    group: Any = None,
) -> None:
    """Load the model and the wrapped optimizer of a state directory into this run's shards;
    call on every rank (DCP reshards: the saving run's world size may differ)."""
    directory = Path(directory)
    saved = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    if not any(key.startswith("optimizer.") for key in saved):
        # saved before the optimizer had any state (step 0, or a stateless SGD)
        model_state = {"model": get_model_state_dict(model)}
        dcp.load(model_state, checkpoint_id=directory, process_group=group)
        set_model_state_dict(model, model_state["model"])
        return
    model_state, optim_state = get_state_dict(model, optimizer)
    both = {"model": model_state, "optimizer": optim_state}
    dcp.load(both, checkpoint_id=directory, process_group=group)
    set_state_dict(
        model, optimizer, model_state_dict=both["model"], optim_state_dict=both["optimizer"]
    )


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What DCP saves: the model's shards, and the optimizer's if it has any state.

    An optimizer without state is left out: DCP's ``get_state_dict`` would create it by
    stepping the optimizer once with zero gradients and learning rate 0, which moves no
    parameter but counts a step in Adam's state (its bias correction would then differ
    from a run that never saved).
    """
    if not optimizer.state:
        return {"model": get_model_state_dict(model)}
    model_state, optim_state = get_state_dict(model, optimizer)
    return {"model": model_state, "optimizer": optim_state}
