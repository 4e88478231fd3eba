"""Trainer checkpoints carry the ledger, the noise and the sampler: a run killed and resumed
ends exactly where the uninterrupted run ends."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from transformers import TrainerCallback

from dptrain.hf import DPTrainer, PrivacyArguments, PrivacyCheckpointError
from dptrain.hf.checkpoint import STATE_FILE
from tests.hf import tiny

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

SEED = 5
STEPS = 6


class _KilledError(RuntimeError):
    pass


class _KillAt(TrainerCallback):
    """Stands for a crash: raises out of train() after the given step."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise _KilledError(f"killed after step {self.step}")


def _trainer(
    output_dir, *, callbacks=None, epsilon: float | None = None, sigma: float = 1.0, **overrides
) -> DPTrainer:
    # AdamW with a linear schedule: the optimizer moments and the scheduler must resume too.
    settings = {"max_steps": STEPS, "optim": "adamw_torch", "lr_scheduler_type": "linear"}
    settings.update(overrides)
    noise = {"noise_multiplier": sigma} if epsilon is None else {"target_epsilon": epsilon}
    return DPTrainer(
        model=tiny.llama(),
        args=tiny.training_args(str(output_dir), **settings),
        train_dataset=tiny.lm_records(40),
        privacy_args=PrivacyArguments(target_delta=1e-5, seed=SEED, **noise),
        callbacks=callbacks,
    )


def _params(trainer: DPTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_killed_and_resumed_run_equals_uninterrupted_run(tmp_path):
    tiny.quiet_transformers()
    # A target epsilon: the budget (max_steps of the DP optimizer) must carry over too.
    whole = _trainer(tmp_path / "whole", epsilon=8.0)
    whole.train()
    expected, ledger = _params(whole), whole.privacy.ledger
    # Trainer's optimizer choice (optim="adamw_torch", its weight-decay groups), made private
    assert type(whole.privacy.optimizer.original_optimizer) is torch.optim.AdamW
    assert [g["weight_decay"] for g in whole.privacy.optimizer.param_groups] == [0.0, 0.0]

    out = tmp_path / "killed"
    killed = _trainer(out, callbacks=[_KillAt(5)], epsilon=8.0, save_strategy="steps", save_steps=2)
    with pytest.raises(_KilledError):
        killed.train()
    checkpoint = out / "checkpoint-4"
    state = json.loads((checkpoint / STATE_FILE).read_text())
    assert state["steps_taken"] == 4 and state["sampler"]["steps_drawn"] == 4

    resumed = _trainer(out, epsilon=8.0, save_strategy="steps", save_steps=2)  # a new model
    result = resumed.train(resume_from_checkpoint=str(checkpoint))
    assert result.global_step == STEPS
    assert resumed.privacy.ledger == ledger
    assert resumed.privacy.optimizer.steps_taken == STEPS
    for name, value in _params(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    assert resumed.epsilon() == pytest.approx(whole.epsilon())
    # the killed trainer itself may resume too (its private state is rebuilt from the file)
    killed.remove_callback(_KillAt)
    killed.train(resume_from_checkpoint=str(checkpoint))
    assert killed.privacy.ledger == ledger
    for name, value in _params(killed).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    # resume_from_checkpoint=True finds the last checkpoint; its plan is spent: no step, no error
    again = _trainer(out, epsilon=8.0, save_strategy="steps", save_steps=2)
    again.train(resume_from_checkpoint=True)
    assert again.privacy.ledger == ledger and again.budget_spent()


def test_resume_refuses_another_plan_or_a_checkpoint_without_dp_state(tmp_path):
    tiny.quiet_transformers()
    out = tmp_path / "run"
    first = _trainer(out, save_strategy="steps", save_steps=2, max_steps=2)
    first.train()
    checkpoint = out / "checkpoint-2"
    other = _trainer(out, max_steps=2, sigma=2.0)  # another noise
    with pytest.raises(PrivacyCheckpointError, match="noise_multiplier="):
        other.train(resume_from_checkpoint=str(checkpoint))
    os.remove(checkpoint / STATE_FILE)
    with pytest.raises(PrivacyCheckpointError, match=STATE_FILE):
        _trainer(out, max_steps=2).train(resume_from_checkpoint=str(checkpoint))


def test_resume_without_optimizer_state_is_refused(tmp_path):
    """save_only_model=True writes no optimizer.pt, so no ledger: resuming would restart it."""
    tiny.quiet_transformers()
    out = tmp_path / "run"
    _trainer(out, save_strategy="steps", save_steps=2, max_steps=4, save_only_model=True).train()
    with pytest.raises(PrivacyCheckpointError, match="save_only_model"):
        _trainer(out, max_steps=4).train(resume_from_checkpoint=str(out / "checkpoint-2"))
