"""DPTrainer on an FSDP2-sharded model, for tests/hf/test_fsdp.py (module-level, so spawn
can pickle it): the tied 2-layer Llama of tests/distributed/fsdp_run.py, sharded by the
user with ``fully_shard`` per decoder layer and at the root before DPTrainer gets it.

Also a script, for docs/hf.md: ``torchrun --nproc_per_node 2 -m tests.hf._fsdp_run OUT``
(gloo on CPU); ``OUT --checkpointed`` runs :func:`checkpointed`, ``OUT2 --resume
OUT/checkpoint-2`` resumes it (:func:`resumed`); both print a digest of the parameters.
"""

from __future__ import annotations

import os
import sys
from typing import Any

SEED = 13
C = 0.05


def full(t: Any) -> Any:
    """The whole tensor (gathered from every rank's shard), float64, detached."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double().clone()


def _trainer(
    output_dir: str,
    sharded: bool | str,
    per_device: int,
    arguments: dict[str, Any] | None = None,
    device: str = "cpu",
    lora: bool = False,
    eval_dataset: Any = None,
    users: bool = False,
    **privacy: Any,
) -> Any:
    import torch

    from dptrain.hf import DPTrainer, PrivacyArguments
    from tests.distributed import fsdp_run
    from tests.hf import tiny

    class Recording(DPTrainer):
        """Keeps each update's padding rows (equal chunks on every rank)."""

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            self.padding: list[list[int]] = []

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.padding.append(list(getattr(inputs.batch, "padding", None) or []))
            return super().training_step(model, inputs, num_items_in_batch)

    tiny.quiet_transformers()
    # TrainingArguments joins the process group (under torchrun), which fully_shard's mesh needs
    settings: dict[str, Any] = {
        "per_device_train_batch_size": per_device,
        "gradient_accumulation_steps": 2,
        "max_steps": 3,
        "learning_rate": 0.5,
    }
    settings.update(arguments or {})
    args = tiny.training_args(output_dir, **settings)
    with torch.device(device):
        model = fsdp_run.llama(lora)
    if sharded == "layers":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (args.world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
    elif sharded:
        model = fsdp_run.shard(model)
    settings = dict(noise_multiplier=1e-12, max_grad_norm=C, target_delta=1e-5, seed=SEED)
    # PLD cannot discretise the privacy loss at sigma ~ 0; RDP's epsilon stays finite
    settings["accountant"] = "rdp"
    settings.update(privacy)
    return Recording(
        model=model,
        args=args,
        train_dataset=user_records() if users else tiny.lm_records(40),
        eval_dataset=eval_dataset,
        privacy_args=PrivacyArguments(**settings),
    )


def user_records() -> Any:
    """The records of tests/hf/test_user_level.py: 12 users of 1 to 6 records, a
    ``user_id`` column (users larger than a chunk of 2 or 4 records among them)."""
    from tests.hf.test_user_level import _as_dataset, _user_records

    return _as_dataset(_user_records())


def train(
    output_dir: str,
    sharded: bool,
    per_device: int,
    save: bool = False,
    lora: bool = False,
    users: bool = False,
    **privacy: Any,
) -> dict[str, Any]:
    """3 DPTrainer updates (SGD, expected batch per_device x 2 x world); the initial and
    final trainable parameters (gathered, by name), the ledger and what the run used.
    ``lora``: LoRA r4 on q/v, only the adapters trainable. ``users``: user-level DP over
    :func:`user_records` (``group_by="user_id"``)."""
    from tests.hf import tiny

    # evaluated after step 2 (engine attached, between private steps) and at the end;
    # 11 records: the ranks get unequal shares
    trainer = _trainer(
        output_dir,
        sharded,
        per_device,
        {"eval_strategy": "steps", "eval_steps": 2, "per_device_eval_batch_size": 3},
        lora=lora,
        eval_dataset=tiny.lm_records(11, seed=3),
        users=users,
        **({"group_by": "user_id"} if users else {}),
        **privacy,
    )
    initial = {n: full(p) for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    if save:
        trainer.save_model()
    return {
        "world_size": trainer.args.world_size,
        "global_step": trainer.state.global_step,
        "ledger": trainer.privacy.ledger.state_dict(),
        "initial": initial,
        "params": {n: full(p) for n, p in trainer.model.named_parameters() if p.requires_grad},
        "optimizer": type(trainer.privacy.optimizer).__name__,
        "secure": (
            trainer.privacy.optimizer.secure_mode,
            trainer.privacy.data_loader.loader.sampler.secure,
        ),
        "padding": trainer.padding,
        "epsilon": trainer.epsilon(),
        "eval_loss": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
    }


# 4 AdamW steps with a linear learning-rate decay and noise, a checkpoint after each: what
# a resumed run must restore is the weights, Adam's moments and step, the scheduler, the
# ledger, the sampler and the noise keys
CHECKPOINTED = {
    "max_steps": 4,
    "optim": "adamw_torch",
    "learning_rate": 0.01,
    "lr_scheduler_type": "linear",
    "save_strategy": "steps",
    "save_steps": 1,
}
NOISED = {"noise_multiplier": 1.0, "accountant": "pld"}


def _outcome(trainer: Any) -> dict[str, Any]:
    return {
        "global_step": trainer.state.global_step,
        "ledger": trainer.privacy.ledger.state_dict(),
        "params": {n: full(p) for n, p in trainer.model.named_parameters() if p.requires_grad},
        "steps_run": len(trainer.padding),
        "learning_rates": [h["learning_rate"] for h in trainer.state.log_history if "loss" in h],
    }


def checkpointed(output_dir: str, lora: bool = False) -> dict[str, Any]:
    """The uninterrupted sharded run of :data:`CHECKPOINTED`, which saves after every step
    (``lora``: LoRA adapters, ghost clipping)."""
    trainer = _checkpointed_trainer(output_dir, lora)
    trainer.train()
    return _outcome(trainer)


def resumed(output_dir: str, checkpoint: str, lora: bool = False) -> dict[str, Any]:
    """The same run, a new model and DPTrainer resuming from ``checkpoint`` (call in fresh
    processes: nothing of the saving run is left in memory)."""
    trainer = _checkpointed_trainer(output_dir, lora)
    trainer.train(resume_from_checkpoint=checkpoint)
    return _outcome(trainer)


def _checkpointed_trainer(output_dir: str, lora: bool) -> Any:
    arguments = {**CHECKPOINTED, "logging_steps": 1}
    mode = {"mode": "ghost"} if lora else {}
    return _trainer(output_dir, True, 2, arguments, lora=lora, **NOISED, **mode)


def full_weights(folder: str) -> dict[str, Any]:
    """The weights a checkpoint folder's model.safetensors holds (gathered), float64."""
    from safetensors.torch import load_file

    return {n: t.double() for n, t in load_file(f"{folder}/model.safetensors").items()}


REFUSED = {
    "best_model": (
        {
            "save_strategy": "steps",
            "eval_strategy": "steps",
            "load_best_model_at_end": True,
        },
        {},
    ),
    "resume": ({}, {}),
    "device": ({}, {}),  # sharded on the meta device, trained on the CPU
    "root": ({}, {}),  # the decoder layers sharded, the root not
}


def refusal(output_dir: str, kind: str) -> str:
    """The error DPTrainer raises for a sharded model with ``kind``'s setting (its message)."""
    arguments, privacy = REFUSED[kind]
    try:
        device = "meta" if kind == "device" else "cpu"
        sharded = "layers" if kind == "root" else True
        trainer = _trainer(output_dir, sharded, 2, arguments, device, **privacy)
        if kind == "resume":
            # a folder without dptrain_shards/ (as save_only_model=True leaves one)
            os.makedirs(f"{output_dir}/checkpoint-1", exist_ok=True)
            trainer.train(resume_from_checkpoint=f"{output_dir}/checkpoint-1")
    except Exception as exc:  # the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return ""


def scenarios(output_dir: str) -> tuple[dict, dict, dict, dict]:
    """One process group's runs: sigma ~ 0, sigma = 1 (then save_model), the refusals, and
    the checkpointed run (:func:`checkpointed`)."""
    quiet = train(f"{output_dir}/quiet", True, 2)
    noised = train(f"{output_dir}/noised", True, 2, save=True, **NOISED)
    refusals = {k: refusal(f"{output_dir}/{k}", k) for k in REFUSED}
    return quiet, noised, refusals, checkpointed(f"{output_dir}/checkpointed")


def users_and_secure(output_dir: str) -> tuple[dict, dict]:
    """User-level DP (``group_by``) at sigma ~ 0, and secure_mode at sigma = 1, on the
    sharded model."""
    users = train(f"{output_dir}/users", True, 2, users=True)
    secure = train(f"{output_dir}/secure", True, 2, secure_mode=True, seed=None, **NOISED)
    return users, secure


def lora_ghost(output_dir: str) -> dict:
    """LoRA adapters on the sharded model, ghost clipping, sigma ~ 0."""
    return train(output_dir, True, 2, lora=True, mode="ghost")


def _digest(params: dict[str, Any]) -> str:
    """A short digest of the parameters' bytes (float64 copies of the float32 values)."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(params):
        h.update(name.encode())
        h.update(params[name].float().numpy().tobytes())
    return h.hexdigest()[:16]


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[2] in ("--checkpointed", "--resume"):
        # the checkpointed run, or its resumption from the checkpoint given after --resume
        if sys.argv[2] == "--checkpointed":
            outcome = checkpointed(sys.argv[1])
        else:
            outcome = resumed(sys.argv[1], sys.argv[3])
        shown = {k: v for k, v in outcome.items() if k not in ("params", "ledger")}
        print({**shown, "params_sha256": _digest(outcome["params"])})
    else:
        result = train(sys.argv[1], True, 2, save=True, noise_multiplier=1.0, accountant="pld")
        print({k: v for k, v in result.items() if k not in ("params", "initial")})
