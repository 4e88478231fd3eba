"""Checks shared by the DPTrainer FSDP2 tests (a model the user sharded, and one
accelerate's plugin sharded): what both runs must show the same way."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.hf import _fsdp_run


def assert_noise_added_once(quiet: dict, noised0: dict, noised1: dict) -> None:
    """Both ranks hold the same noised model and ledger, and the noise is there once.

    The same batches with and without noise (``quiet``: sigma ~ 0): the difference is
    the 3 steps' noise, lr sigma C / B per step and coordinate (N(0, sigma^2 C^2) on each
    summed coordinate, divided by the expected batch 8), plus the small drift of the
    trajectories. Noise drawn on both ranks (twice) would give sqrt(2) times as much;
    none, about 0."""
    for name, value in noised0["params"].items():
        torch.testing.assert_close(noised1["params"][name], value, rtol=0, atol=0, msg=name)
    assert noised0["ledger"] == noised1["ledger"]
    assert noised0["ledger"]["segments"] == [
        {"sample_rate": 0.2, "noise_multiplier": 1.0, "count": 3}
    ]
    diff = torch.cat(
        [(noised0["params"][n] - quiet["params"][n]).flatten() for n in quiet["params"]]
    )
    expected = 0.5 * 1.0 * _fsdp_run.C / 8 * math.sqrt(3)
    ratio = float(diff.std()) / expected
    assert 0.85 < ratio < 1.2, ratio


def assert_saved_gathered(folder: Path, noised: dict) -> None:
    """``save_model`` wrote the gathered weights (equal to the run's) and privacy.json."""
    from transformers import LlamaForCausalLM

    saved = LlamaForCausalLM.from_pretrained(folder / "noised")
    for name, p in saved.named_parameters():
        torch.testing.assert_close(p.detach().double(), noised["params"][name], rtol=0, atol=0)
    report = json.loads((folder / "noised" / "privacy.json").read_text())
    assert report["training"]["steps_taken"] == 3 and report["training"]["world_size"] == 2
    assert report["ledger"] == noised["ledger"]
