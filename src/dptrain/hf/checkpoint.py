"""The DP part of a Trainer checkpoint: ``dptrain_state.json`` beside Trainer's files.

Trainer already saves, in each ``checkpoint-<step>`` folder, the optimizer's
``state_dict`` as ``optimizer.pt``; DPTrainer's optimizer state *is* the DP
optimizer's (the wrapped optimizer, the ledger, the noise generators and seed,
the steps taken), so the ledger and the noise stream travel with Trainer's own
file. What Trainer does not know about is written here: the Poisson sampler's
state (generator and batches drawn) and the plan, plus a copy of the ledger for
people and tools reading the folder.

On resume the plan must be the one the checkpoint was saved under, and before
the first batch the sampler, the optimizer and the ledger must stand at the same
step (:func:`check_in_step`): a checkpoint whose ``optimizer.pt`` was not loaded
(``save_only_model=True``) would otherwise restart the ledger at 0.

A run on an FSDP2-sharded model has no ``optimizer.pt``: each rank holds a shard of
the weights and of the wrapped optimizer's state, which ``torch.save`` on the
writing rank would not see. Its checkpoint folder holds instead ``dptrain_shards/``,
a sharded checkpoint of :func:`dptrain.checkpoint.save_checkpoint` (every rank its
shards of the model and the optimizer through ``torch.distributed.checkpoint``,
rank 0 the DP optimizer's ledger, steps and seed, the sampler and the RNG states),
written and read by :func:`save_shards` / :func:`load_shards` on every rank.
``dptrain consolidate <checkpoint>/dptrain_shards`` turns it into a plain folder too.
"""

from __future__ import annotations

import json
import os
from typing import Any

from dptrain._atomic import write_json_atomically
from dptrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from dptrain.distributed import DistributedConfigError
from dptrain.distributed.sharded_checkpoint import is_sharded_checkpoint
from dptrain.hf.errors import PrivacyCheckpointError
from dptrain.hf.plan import PrivacyPlan
from dptrain.privacy_engine import PrivateTraining

__all__ = [
    "SHARDS_DIR",
    "STATE_FILE",
    "check_in_step",
    "check_resumable",
    "load_shards",
    "restore_sampler",
    "save_shards",
    "save_state",
]

#: The DP state DPTrainer adds to each Trainer checkpoint folder.
STATE_FILE = "dptrain_state.json"
#: A sharded run's model, optimizer and DP state (a dptrain sharded checkpoint directory).
SHARDS_DIR = "dptrain_shards"
# What Trainer writes the (unsharded) optimizer state to.
_OPTIMIZER_FILE = "optimizer.pt"
_STATE_VERSION = 1


def save_state(folder: str, plan: PrivacyPlan, private: PrivateTraining) -> None:
    """Write ``folder/dptrain_state.json`` atomically (a temporary file renamed over it)."""
    state = {
        "format_version": _STATE_VERSION,
        "plan": plan.as_dict(),
        "steps_taken": private.optimizer.steps_taken,
        "sampler": private.data_loader.state_dict(),
        "ledger": private.ledger.state_dict(),
    }
    write_json_atomically(os.path.join(folder, STATE_FILE), state, durable=True)


def restore_sampler(folder: str, plan: PrivacyPlan, private: PrivateTraining) -> int:
    """Load the checkpoint's sampler state into ``private``; return the steps it was saved at.

    Refused (:class:`PrivacyCheckpointError`) without the file, or under another plan.
    """
    path = os.path.join(folder, STATE_FILE)
    if not os.path.isfile(path):
        raise PrivacyCheckpointError(
            f"checkpoint {folder!r} has no {STATE_FILE}: it was not written by a DPTrainer, or "
            "its saving was interrupted. Resuming from it would restart the ledger and the "
            "sampling; resume from an earlier checkpoint"
        )
    with open(path, encoding="utf-8") as f:
        state: dict[str, Any] = json.load(f)
    if state.get("format_version") != _STATE_VERSION:
        raise PrivacyCheckpointError(
            f"{path}: format_version={state.get('format_version')!r} is not supported: "
            f"expected {_STATE_VERSION}"
        )
    diffs = plan.mismatches(state["plan"])
    if diffs:
        raise PrivacyCheckpointError(
            f"checkpoint {folder!r} was saved under another privacy plan (a resumed run must "
            "keep the dataset, batch size, steps, noise and clipping it started with): "
            + "; ".join(diffs)
        )
    private.data_loader.load_state_dict(state["sampler"])
    return int(state["steps_taken"])


def check_in_step(private: PrivateTraining, resumed_steps: int | None) -> None:
    """The sampler's batches drawn, the optimizer's steps and the ledger's steps agree."""
    drawn = private.data_loader.loader.sampler.steps_drawn
    taken = private.optimizer.steps_taken
    ledger = private.ledger.num_steps
    if drawn == taken == ledger:
        return
    hint = (
        " (the checkpoint's optimizer state, which holds the ledger, was not loaded: was it "
        "saved with save_only_model=True?)"
        if resumed_steps and taken == 0
        else ""
    )
    raise PrivacyCheckpointError(
        f"the sampler has drawn {drawn} batches, the DP optimizer has taken {taken} steps and "
        f"the ledger holds {ledger}: they must agree{hint}; resuming otherwise would lose "
        "steps from the ledger"
    )


def save_shards(folder: str, private: PrivateTraining) -> None:
    """A sharded run's model, optimizer and DP state into ``folder/dptrain_shards``; call on
    every rank (:func:`dptrain.checkpoint.save_checkpoint`'s sharded layout)."""
    save_checkpoint(os.path.join(folder, SHARDS_DIR), private)


def load_shards(folder: str, private: PrivateTraining) -> None:
    """Restore :func:`save_shards` into ``private`` (each rank its shards of the model and the
    optimizer, the ledger, steps, sampler and RNG states); call on every rank."""
    try:
        load_checkpoint(os.path.join(folder, SHARDS_DIR), private)
    except (CheckpointError, DistributedConfigError) as exc:
        raise PrivacyCheckpointError(f"checkpoint {folder!r}: {exc}") from exc


def check_resumable(folder: str, sharded: bool) -> None:
    """Refuse, before anything is loaded, a checkpoint whose layout this run cannot resume:
    a sharded run needs ``dptrain_shards/`` (without it neither its weights nor its ledger
    would be restored), and an unsharded run cannot read one (no ``optimizer.pt``). An
    unsharded checkpoint without ``optimizer.pt`` is refused by :func:`check_in_step`.
    """
    if not os.path.isdir(folder):
        raise PrivacyCheckpointError(
            f"resume_from_checkpoint={folder!r} is not a directory: no checkpoint to resume"
        )
    shards = is_sharded_checkpoint(os.path.join(folder, SHARDS_DIR))
    optimizer = os.path.isfile(os.path.join(folder, _OPTIMIZER_FILE))
    if sharded and not shards:
        why = (
            "it was saved by an unsharded run (its optimizer.pt holds whole tensors); resume "
            "it unsharded, or start the sharded run from its weights with from_pretrained"
            if optimizer
            else "it was saved with save_only_model=True, or its saving was interrupted; "
            "resume from an earlier checkpoint"
        )
        raise PrivacyCheckpointError(
            f"checkpoint {folder!r} has no {SHARDS_DIR}/, which a run on an FSDP2-sharded "
            f"model resumes its weights, optimizer state and ledger from: {why}"
        )
    if not sharded and shards:
        raise PrivacyCheckpointError(
            f"checkpoint {folder!r} was saved by a run on an FSDP2-sharded model (its "
            f"optimizer state and ledger are in {SHARDS_DIR}/), and this run's model is not "
            "sharded: resume it with the model sharded the same way (fully_shard), or "
            f"consolidate it (dptrain consolidate {os.path.join(folder, SHARDS_DIR)}) to "
            "start an unsharded run from its weights"
        )
