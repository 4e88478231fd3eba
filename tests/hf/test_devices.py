"""DPTrainer at bf16 and float32, with and without gradient accumulation, resumed from
a checkpoint, on the CPU and (where one exists) on a CUDA device.

On CUDA accelerate moves the optimizer's state (the noise generators' states with it) to
the GPU when it wraps the optimizer, and Trainer loads a checkpoint's optimizer state
with ``map_location`` the GPU: both used to fail before the first step (issue 27)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dptrain.hf import DPTrainer, PrivacyArguments
from tests.hf import tiny

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

STEPS = 4
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# The CPU runs the new combination (bf16 autocast, accumulation) only, and as a slow test
# (about 14 s on 2 busy cores: bf16 matrix products are slow on CPUs): float32 resumes are
# tests/hf/test_checkpoint.py's. On CUDA every combination.
CASES = [
    pytest.param("cpu", True, 2, marks=pytest.mark.slow),
    *(
        pytest.param("cuda", bf16, accumulation, marks=CUDA)
        for bf16 in (False, True)
        for accumulation in (1, 2)
    ),
]


def _trainer(output_dir, device: str, bf16: bool, accumulation: int, **overrides) -> DPTrainer:
    settings = {
        "max_steps": STEPS,
        "optim": "adamw_torch",
        "use_cpu": device == "cpu",
        "bf16": bf16,
        "gradient_accumulation_steps": accumulation,
        "per_device_train_batch_size": 8 // accumulation,
    }
    settings.update(overrides)
    return DPTrainer(
        model=tiny.llama(),
        args=tiny.training_args(str(output_dir), **settings),
        train_dataset=tiny.lm_records(40),
        privacy_args=PrivacyArguments(target_delta=1e-5, noise_multiplier=1.0, seed=11),
    )


def _params(trainer: DPTrainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("device, bf16, accumulation", CASES)
def test_trains_and_resumes_where_it_stopped(tmp_path, device, bf16, accumulation):
    tiny.quiet_transformers()
    out = tmp_path / "run"
    whole = _trainer(out, device, bf16, accumulation, save_strategy="steps", save_steps=2)
    whole.train()
    assert whole.privacy.optimizer.steps_taken == STEPS
    assert next(whole.model.parameters()).device.type == device
    expected = _params(whole)
    start = _params(_trainer(tmp_path / "start", device, bf16, accumulation))
    # the noise alone (sigma C / B = 1/8 per coordinate, AdamW's first steps ~lr) moves
    # every weight matrix: a run that trained must be far from its start
    assert max((expected[n] - start[n]).abs().max() for n in start) > 1e-2

    # a run stopped after step 2 left what the whole run saved there
    resumed = _trainer(
        tmp_path / "resumed", device, bf16, accumulation, save_strategy="steps", save_steps=2
    )
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.privacy.ledger == whole.privacy.ledger
    # Same batches, same noise: equal up to kernel order on a GPU (a noise stream restarted
    # from its seed would differ by the noise's size, ~lr per step).
    atol = 0.0 if device == "cpu" else 1e-3
    for name, value in _params(resumed).items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=atol, msg=name)
