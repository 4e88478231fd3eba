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
"""

from __future__ import annotations

import json
import os
from typing import Any

from dptrain._atomic import write_json_atomically
from dptrain.hf.errors import PrivacyCheckpointError
from dptrain.hf.plan import PrivacyPlan
from dptrain.privacy_engine import PrivateTraining

__all__ = ["STATE_FILE", "check_in_step", "restore_sampler", "save_state"]

#: The DP state DPTrainer adds to each Trainer checkpoint folder.
STATE_FILE = "dptrain_state.json"
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
