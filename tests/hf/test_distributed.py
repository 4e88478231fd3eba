"""DPTrainer in two processes on gloo (CPU): the ranks stay identical, the noise is added
once (the run equals the one-process run with the same seed and expected batch), and the
ledger counts optimizer updates."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dptrain.distributed import spawn
from tests.hf._dist_run import train_tiny

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def test_two_processes_equal_one_process(tmp_path):
    # B = 2 per device x 2 accumulation x 2 processes = 8 = 4 x 2 x 1 in one process.
    ranks = spawn(train_tiny, 2, args=(str(tmp_path / "two"), 2), timeout=60, join_timeout=300)
    one = train_tiny(str(tmp_path / "one"), 4)
    assert [r["world_size"] for r in ranks] == [2, 2] and one["world_size"] == 1
    assert ranks[0]["optimizer"] == "DistributedDPOptimizer"
    assert [r["chunk"] for r in ranks] == [2, 2] and one["chunk"] == 4
    for r in ranks:
        assert r["global_step"] == 3 and r["ledger"] == one["ledger"]
        assert r["ledger"]["segments"] == [
            {"sample_rate": 8 / 40, "noise_multiplier": 1.0, "count": 3}
        ]
    for name, value in one["params"].items():
        # every rank holds the same parameters (one reduced buffer) ...
        torch.testing.assert_close(
            ranks[1]["params"][name], ranks[0]["params"][name], rtol=0, atol=0
        )
        # ... and they are the one-process run's up to the order of the sums: noise drawn
        # once, on rank 0 (twice would move them by ~sqrt(2) noise, ~1e-2 here)
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=0, atol=1e-6, msg=name)


def test_two_processes_user_level_equal_one_process(tmp_path):
    # Each rank takes whole users of the shared batch (4 of 12 users expected per step).
    args = (str(tmp_path / "two"), 1, "book_keeping", True)
    ranks = spawn(train_tiny, 2, args=args, timeout=60, join_timeout=300)
    one = train_tiny(str(tmp_path / "one"), 2, "book_keeping", True)
    for r in ranks:
        assert r["ledger"] == one["ledger"]
        assert r["ledger"]["privacy_unit"] == "user"
        assert r["ledger"]["segments"] == [
            {"sample_rate": 4 / 12, "noise_multiplier": 1.0, "count": 3}
        ]
    for name, value in one["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=0, atol=1e-6, msg=name)
