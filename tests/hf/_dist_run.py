"""A tiny DPTrainer run for the multi-process test (module-level, so spawn can pickle it).

Also a script: ``python -m tests.hf._dist_run OUT`` (one process) or
``torchrun --nproc_per_node 2 -m tests.hf._dist_run OUT`` (two processes, gloo on CPU).
"""

from __future__ import annotations

import sys
from typing import Any

SEED = 13


def train_tiny(
    output_dir: str,
    per_device_train_batch_size: int,
    mode: str = "book_keeping",
    group_by: bool = False,
) -> dict[str, Any]:
    """Train the tiny Llama 3 steps (expected batch per_device x 2 x world); rank 0's result.
    ``group_by``: user-level DP, the records of the user-level test (12 users, 1-6 records)."""
    import torch

    from dptrain.hf import DPTrainer, PrivacyArguments
    from tests.hf import tiny

    tiny.quiet_transformers()
    if group_by:
        from tests.hf.test_user_level import _as_dataset, _user_records

        dataset = _as_dataset(_user_records())
    else:
        dataset = tiny.lm_records(40)
    trainer = DPTrainer(
        model=tiny.llama(),
        args=tiny.training_args(
            output_dir,
            per_device_train_batch_size=per_device_train_batch_size,
            gradient_accumulation_steps=2,
            max_steps=3,
            optim="adamw_torch",
        ),
        train_dataset=dataset,
        privacy_args=PrivacyArguments(
            noise_multiplier=1.0,
            target_delta=1e-5,
            seed=SEED,
            mode=mode,
            group_by="user_id" if group_by else None,
        ),
    )
    trainer.train()
    return {
        "world_size": trainer.args.world_size,
        "global_step": trainer.state.global_step,
        "ledger": trainer.privacy.ledger.state_dict(),
        "params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "optimizer": type(trainer.privacy.optimizer).__name__,
        "chunk": trainer.privacy.data_loader.loader.max_physical_batch_size,
        "sum": float(sum(torch.sum(p.detach()) for p in trainer.model.parameters())),
    }


if __name__ == "__main__":
    result = train_tiny(sys.argv[1], per_device_train_batch_size=2)
    print({k: v for k, v in result.items() if k != "params"})
