"""DPTrainer against the engine: the same steps as make_private, the ledger, logs, schedule."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

pytest.importorskip("transformers")

from transformers import default_data_collator

from dptrain import make_private
from dptrain.hf import DPTrainer, DPTrainerError, PrivacyArguments, PrivacyArgumentsError
from dptrain.losses import per_example_cross_entropy
from tests.hf import tiny

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

SEED = 3


def _reference_params(
    trainer: DPTrainer,
    records: list,
    *,
    steps: int,
    batch: int,
    chunk: int,
    sigma: float,
    lr: float,
) -> dict[str, torch.Tensor]:
    """make_private + per-example losses by hand, with Trainer's SGD param groups."""
    model = tiny.llama()
    decay = set(trainer.get_decay_parameter_names(model))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [
        {"params": [p for n, p in named if n in decay], "weight_decay": 0.0},
        {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
    ]
    private = make_private(
        model,
        torch.optim.SGD(groups, lr=lr),
        records,
        batch_size=batch,
        max_grad_norm=1.0,
        steps=steps,
        noise_multiplier=sigma,
        max_physical_batch_size=chunk,
        collate_fn=default_data_collator,
        seed=SEED,
    )
    for logical in private.data_loader:
        private.optimizer.zero_grad()
        for inputs in logical.chunks:
            labels = inputs.pop("labels")
            logits = model(**inputs).logits
            private.backward(
                per_example_cross_entropy(
                    logits[:, :-1], labels[:, 1:], attention_mask=inputs["attention_mask"][:, 1:]
                )
            )
        private.optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_steps_equal_make_private_with_gradient_accumulation(tmp_path, caplog):
    """GA = 2: B = 4 x 2 records per logical batch, chunks of 4; every parameter after 4
    updates equals make_private's with the same seed (same batches, same noise), and the
    ledger holds one step per optimizer update. Trainer's own clipping is off, with a note."""
    tiny.quiet_transformers()
    records = tiny.lm_records(40)
    args = tiny.training_args(
        str(tmp_path), gradient_accumulation_steps=2, max_steps=4, max_grad_norm=0.5
    )
    with caplog.at_level(logging.INFO, logger="dptrain.hf"):
        trainer = DPTrainer(
            model=tiny.llama(),
            args=args,
            train_dataset=records,
            privacy_args=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-5, seed=SEED),
        )
    assert any("max_grad_norm=0.5 is not applied" in r.message for r in caplog.records)
    assert trainer.args.max_grad_norm == 0 and trainer.user_args.max_grad_norm == 0.5
    assert trainer.args.gradient_accumulation_steps == 1  # Trainer sees one batch per update
    assert trainer.user_args.gradient_accumulation_steps == 2
    out = trainer.train()
    private = trainer.privacy
    assert out.global_step == 4
    assert private.optimizer.steps_taken == 4
    assert private.ledger.num_steps == 4
    assert [(s.sample_rate, s.noise_multiplier, s.count) for s in private.ledger.segments] == [
        (8 / 40, 1.0, 4)
    ]
    ref = _reference_params(trainer, records, steps=4, batch=8, chunk=4, sigma=1.0, lr=0.05)
    got = dict(trainer.model.named_parameters())
    for name, value in ref.items():
        torch.testing.assert_close(got[name].detach(), value, rtol=0, atol=0, msg=name)


def test_epsilon_in_every_log_schedule_per_update_and_budget_ends_cleanly(tmp_path, caplog):
    """epsilon (and the steps it is for) in every training log record; the linear LR
    schedule decays once per optimizer update, not per chunk; the planned steps are the
    budget: train() returns (no error) and says so in a log line; a second train() without
    a checkpoint is refused by name."""
    tiny.quiet_transformers()
    args = tiny.training_args(
        str(tmp_path),
        gradient_accumulation_steps=2,
        max_steps=6,
        lr_scheduler_type="linear",
        logging_steps=1,
    )
    trainer = DPTrainer(
        model=tiny.llama(),
        args=args,
        train_dataset=tiny.lm_records(40),
        privacy_args=PrivacyArguments(target_epsilon=8.0, target_delta=1e-5, seed=SEED),
    )
    with caplog.at_level(logging.INFO, logger="dptrain.hf"):
        out = trainer.train()
    steps = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["dp_steps"] for h in steps] == [1, 2, 3, 4, 5, 6]
    eps = [h["epsilon"] for h in steps]
    assert all(a < b for a, b in itertools.pairwise(eps))
    assert eps[-1] == pytest.approx(trainer.epsilon()) and eps[-1] <= 8.0
    assert [h["learning_rate"] for h in steps] == pytest.approx(
        [0.05 * (6 - k) / 6 for k in range(6)]
    )
    assert trainer.state.log_history[-1]["epsilon"] == pytest.approx(eps[-1])
    assert out.global_step == 6 and trainer.budget_spent()
    assert trainer.privacy.optimizer.max_steps == 6
    assert any("privacy budget spent" in r.message for r in caplog.records)
    with pytest.raises(DPTrainerError, match="already called"):
        trainer.train()


def test_an_optimizer_given_to_trainer_is_the_one_made_private(tmp_path):
    tiny.quiet_transformers()
    model = tiny.llama()
    mine = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer = DPTrainer(
        model=model,
        args=tiny.training_args(str(tmp_path), max_steps=2),
        train_dataset=tiny.lm_records(40),
        privacy_args=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-5, seed=SEED),
        optimizers=(mine, None),
    )
    trainer.train()
    assert trainer.privacy.optimizer.original_optimizer is mine
    assert all(s["step"] == 2 for s in mine.state.values())  # two updates, both Adam's


def test_secure_mode_trains_from_os_urandom(tmp_path, monkeypatch):
    """PrivacyArguments(secure_mode=True): noise and sampling from os.urandom, no seed."""
    import os

    import dptrain.secure_random as secure_random

    with pytest.raises(PrivacyArgumentsError, match=r"^secure_mode=True with seed=3: "):
        PrivacyArguments(target_epsilon=8.0, target_delta=1e-5, seed=3, secure_mode=True)
    drawn = []
    real_urandom = os.urandom
    monkeypatch.setattr(secure_random.os, "urandom", lambda n: drawn.append(n) or real_urandom(n))
    tiny.quiet_transformers()
    trainer = DPTrainer(
        model=tiny.llama(),
        args=tiny.training_args(str(tmp_path), max_steps=2),
        train_dataset=tiny.lm_records(40),
        privacy_args=PrivacyArguments(target_epsilon=8.0, target_delta=1e-5, secure_mode=True),
    )
    trainer.train()
    assert trainer.privacy.optimizer.secure_mode and trainer.privacy.optimizer.seed is None
    assert trainer.privacy.optimizer.steps_taken == 2
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert sum(drawn) >= 2 * (8 * 40 + 32 * trainable)  # sampling and noise, both steps


def test_the_plan_is_printed_before_the_first_step_and_the_bar_shows_epsilon(tmp_path, capsys):
    """N, q, steps, sigma, C, delta, the accountant and the target epsilon on stderr before
    any step; Trainer's progress bar carries epsilon after every step (never below the
    accountant's figure, exact at the last step)."""
    tiny.quiet_transformers()
    args = tiny.training_args(
        str(tmp_path), gradient_accumulation_steps=1, max_steps=3, disable_tqdm=False
    )
    trainer = DPTrainer(
        model=tiny.llama(),
        args=args,
        train_dataset=tiny.lm_records(40),
        privacy_args=PrivacyArguments(target_epsilon=8.0, target_delta=1e-5, seed=SEED),
    )
    shown = []
    real_step = trainer.training_step

    def step(*a, **kw):  # what stderr holds when each step starts
        shown.append(capsys.readouterr().err)
        return real_step(*a, **kw)

    trainer.training_step = step
    trainer.train()
    plan = trainer.privacy_plan
    first = shown[0]
    for piece in (
        "private plan",
        "40 examples",
        f"{plan.sample_rate:.4g} (expected batch 4)",
        "steps           3",
        f"{plan.noise_multiplier:.4g}",
        "clipping C      1 (flat)",
        "delta           1e-05",
        "accountant      pld",
        "target epsilon  8",
    ):
        assert piece in first, piece
    assert "private plan" not in "".join(shown[1:])  # printed once
    curve = trainer._epsilon_curve
    assert curve is not None and curve(3) >= trainer.epsilon() - 1e-9
    assert all(curve(t) > 0 for t in (1, 2, 3))
    assert f"eps=<={curve(3):.2f}" in capsys.readouterr().err


def test_sum_rounding_reaches_the_clipping_engine(tmp_path):
    privacy = PrivacyArguments(
        target_delta=1e-5, noise_multiplier=1.0, seed=SEED, sum_rounding="bounded"
    )
    trainer = DPTrainer(
        model=tiny.llama(),
        args=tiny.training_args(str(tmp_path), max_steps=1),
        train_dataset=tiny.lm_records(40),
        privacy_args=privacy,
    )
    trainer.create_optimizer()
    assert trainer.privacy.engine.sum_rounding == "bounded"
