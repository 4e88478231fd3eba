"""DPTrainer on a model the user sharded with FSDP2 (``fully_shard``), two gloo processes.

One spawn runs every scenario of :mod:`tests.hf._fsdp_run` (a tied 2-layer Llama from a
config, sharded per decoder layer and at the root); the reference is DPTrainer in one
process, unsharded, with the same seed and expected batch. A second spawn, of fresh
processes, resumes the checkpointed run from its step-2 checkpoint. Every comparison is
of whole (gathered) parameters.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from packaging.version import Version
from transformers import __version__ as transformers_version

from dptrain.clipping import UnsupportedModelError
from dptrain.distributed import spawn
from dptrain.hf.errors import PrivacyCheckpointError
from dptrain.hf.trainer import (
    SHARDED_MODELS_SINCE,
    check_trainer_takes_sharded_models,
)
from tests.hf import _fsdp_run, fsdp_checks


@pytest.mark.parametrize("version", ["5.17.0", "5.18.2", "4.57.1"])
def test_a_transformers_that_wraps_sharded_models_in_ddp_is_refused_by_name(version):
    with pytest.raises(
        UnsupportedModelError, match=rf"transformers >= 5\.19 \(installed: {version}"
    ):
        check_trainer_takes_sharded_models(version)


@pytest.mark.parametrize("version", ["5.19.0", "5.24.0", "6.0.0.dev0"])
def test_a_transformers_that_takes_sharded_models_is_let_through(version):
    check_trainer_takes_sharded_models(version)


needs_sharded_models = pytest.mark.skipif(
    Version(transformers_version) < Version(SHARDED_MODELS_SINCE),
    reason=f"DPTrainer on a sharded model needs transformers >= {SHARDED_MODELS_SINCE}",
)

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(ranks, the one-process reference, the output folder): one spawn of 2 processes."""
    folder = tmp_path_factory.mktemp("fsdp")
    ranks = spawn(_fsdp_run.scenarios, 2, (str(folder),), timeout=120, join_timeout=900)
    # 2 records per chunk x 2 accumulation x 2 processes = 4 x 2 x 1: B = 8 in both
    reference = _fsdp_run.train(str(folder / "one"), False, 4)
    return ranks, reference, folder


@needs_sharded_models
def test_sharded_run_equals_one_process(runs):
    ranks, one, _ = runs
    assert one["world_size"] == 1 and one["optimizer"] == "DPOptimizer"
    moved = max(float((one["params"][n] - one["initial"][n]).abs().max()) for n in one["params"])
    assert moved > 1e-3  # the steps did move the weights: the comparison below means something
    for quiet, *_ in ranks:
        assert quiet["world_size"] == 2 and quiet["global_step"] == 3
        assert quiet["optimizer"] == "ShardedDPOptimizer"
        assert quiet["ledger"] == one["ledger"]
        assert quiet["params"].keys() == one["params"].keys()
        # Trainer evaluated the sharded model after step 2 (the final weights above show
        # that it did not disturb the steps after it) and at the end. Its distributed
        # evaluation averages per-batch losses over an evenly padded split, not the
        # one-process batches, so its figure agrees to ~1e-3 only (the weights' own
        # per-record losses agree to 5e-7: checked by hand)
        assert len(quiet["eval_loss"]) == len(one["eval_loss"]) == 2
        assert quiet["eval_loss"] == ranks[0][0]["eval_loss"]
        assert quiet["eval_loss"] == pytest.approx(one["eval_loss"], abs=5e-3)
        for name, value in one["params"].items():
            # the same clipped sums (float32, summed in another order) and the same steps
            torch.testing.assert_close(quiet["params"][name], value, rtol=0, atol=1e-6, msg=name)


@needs_sharded_models
def test_every_rank_runs_the_same_chunks(runs):
    ranks, _, _ = runs
    pads = [quiet["padding"] for quiet, *_ in ranks]
    assert [len(p) for p in pads[0]] == [len(p) for p in pads[1]]  # chunks per step
    # a rank with the smaller share pads its last chunk (rows of weight 0): exercised here
    assert any(sum(step) for p in pads for step in p)


@needs_sharded_models
def test_noise_is_added_once_and_agrees_across_ranks(runs):
    ranks, _, _ = runs
    (quiet, noised0, *_), (_, noised1, *_) = ranks
    fsdp_checks.assert_noise_added_once(quiet, noised0, noised1)


@needs_sharded_models
def test_save_model_writes_the_gathered_weights_and_privacy_json(runs):
    ranks, _, folder = runs
    fsdp_checks.assert_saved_gathered(folder, ranks[0][1])


@pytest.fixture(scope="module")
def resumed(runs):
    """Fresh processes resume the checkpointed run from its step-2 checkpoint (~25 s)."""
    folder = runs[2]
    checkpoint = str(folder / "checkpointed" / "checkpoint-2")
    args = (str(folder / "resumed"), checkpoint)
    return spawn(_fsdp_run.resumed, 2, args, timeout=120, join_timeout=900)


@needs_sharded_models
def test_checkpoints_of_a_sharded_run_hold_shards_not_a_rank_0_optimizer(runs):
    folder = runs[2] / "checkpointed"
    for step in (1, 2, 3, 4):
        checkpoint = folder / f"checkpoint-{step}"
        # optimizer.pt would hold rank 0's shards only (torch.save on the writing rank)
        assert not (checkpoint / "optimizer.pt").exists()
        shards = checkpoint / "dptrain_shards"
        pointer = json.loads((shards / "latest.json").read_text())
        assert pointer["step"] == step and pointer["world_size"] == 2
        state = shards / pointer["state"]
        # each rank wrote its own shards of the model and of Adam's moments
        assert sorted(p.name for p in state.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
        for name in ("model.safetensors", "scheduler.pt", "dptrain_state.json", "privacy.json"):
            assert (checkpoint / name).is_file(), name
        assert {p.name for p in checkpoint.glob("rng_state_*.pth")} == {
            "rng_state_0.pth",
            "rng_state_1.pth",
        }
        saved = json.loads((checkpoint / "dptrain_state.json").read_text())
        assert saved["steps_taken"] == step
        assert saved["ledger"]["segments"] == [
            {"sample_rate": 0.2, "noise_multiplier": 1.0, "count": step}
        ]


@needs_sharded_models
def test_resumed_sharded_run_equals_the_uninterrupted_run_bit_for_bit(runs, resumed):
    whole = [rank[3] for rank in runs[0]]
    for run, again in zip(whole, resumed, strict=True):
        assert run["global_step"] == again["global_step"] == 4
        assert run["steps_run"] == 4 and again["steps_run"] == 2  # it did resume at step 2
        assert again["ledger"] == run["ledger"]
        assert again["ledger"]["segments"] == [
            {"sample_rate": 0.2, "noise_multiplier": 1.0, "count": 4}
        ]
        # the linear decay continued where it stopped (the scheduler was restored); the
        # first two records are the checkpoint's log history, the last two the resumed run's
        assert run["learning_rates"] == [0.01, 0.0075, 0.005, 0.0025]
        assert again["learning_rates"] == run["learning_rates"]
        assert again["params"].keys() == run["params"].keys()
        for name, value in run["params"].items():
            # Adam's moments and step, the noise keys, the batches, the weights: all restored
            assert torch.equal(again["params"][name], value), name
    # the steps after the checkpoint moved the weights (a resume that loaded the final
    # weights, or no step at all, would not be told apart otherwise)
    before = _fsdp_run.full_weights(str(runs[2] / "checkpointed" / "checkpoint-2"))
    assert any(not torch.equal(before[n], v) for n, v in whole[0]["params"].items())


@needs_sharded_models
def test_an_unsharded_run_refuses_a_sharded_checkpoint(runs, tmp_path):
    checkpoint = runs[2] / "checkpointed" / "checkpoint-2"
    trainer = _fsdp_run._trainer(str(tmp_path), False, 4, dict(_fsdp_run.CHECKPOINTED))
    with pytest.raises(PrivacyCheckpointError) as err:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    message = str(err.value)
    assert "FSDP2-sharded" in message and "dptrain consolidate" in message
    assert trainer.state.global_step == 0


@needs_sharded_models
def test_a_sharded_checkpoint_consolidates_to_its_gathered_weights(runs, tmp_path):
    from transformers import LlamaForCausalLM

    from dptrain.checkpoint import consolidate_checkpoint

    checkpoint = runs[2] / "checkpointed" / "checkpoint-2"
    consolidate_checkpoint(checkpoint / "dptrain_shards", tmp_path / "out")
    merged = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    saved = _fsdp_run.full_weights(str(checkpoint))
    for name, p in merged.named_parameters():
        assert torch.equal(p.detach().double(), saved[name]), name
    report = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert [s["count"] for s in report["ledger"]["segments"]] == [2]


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("best_model", ["load_best_model_at_end=True", "FSDP2-sharded", "from_pretrained"]),
        ("resume", ["PrivacyCheckpointError", "checkpoint-1", "no dptrain_shards/"]),
        ("device", ["sharded on meta", "train on cpu", "init_device_mesh('cpu'"]),
        ("root", ["UnsupportedModelError", "LlamaForCausalLM", "fully_shard(model)"]),
    ],
)
@needs_sharded_models
def test_unsupported_settings_with_a_sharded_model_are_refused(runs, kind, words):
    message = runs[0][0][2][kind]
    assert message, f"{kind} was accepted"
    for word in words:
        assert word in message, message


@pytest.fixture(scope="module")
def more(tmp_path_factory):
    """user-level DP and secure_mode on the sharded model: a second spawn of 2 processes
    (each under 40 s), and the user-level run in one process, unsharded."""
    folder = tmp_path_factory.mktemp("fsdp_more")
    ranks = spawn(_fsdp_run.users_and_secure, 2, (str(folder),), timeout=120, join_timeout=900)
    return ranks, _fsdp_run.train(str(folder / "one"), False, 4, users=True)


@needs_sharded_models
def test_group_by_on_a_sharded_model_equals_one_process(more):
    """PrivacyArguments.group_by on a model sharded with fully_shard: users (1 to 6
    records, chunks of 2 per rank) packed whole per rank, those larger than a chunk
    accumulated over equal parts on every rank; the same steps as one process."""
    ranks, one = more
    assert one["ledger"]["privacy_unit"] == "user"
    moved = max(float((one["params"][n] - one["initial"][n]).abs().max()) for n in one["params"])
    assert moved > 1e-3
    for users, _ in ranks:
        assert users["optimizer"] == "ShardedDPOptimizer" and users["world_size"] == 2
        assert users["ledger"] == one["ledger"]
        for name, value in one["params"].items():
            torch.testing.assert_close(users["params"][name], value, rtol=0, atol=1e-6, msg=name)
    # the same number of chunks on both ranks at every update
    pads = [users["padding"] for users, _ in ranks]
    assert [len(p) for p in pads[0]] == [len(p) for p in pads[1]]


@needs_sharded_models
def test_secure_mode_on_a_sharded_model_trains(more):
    """secure_mode=True with an FSDP2-sharded model: noise and batches from the OS's
    CSPRNG (the noise statistics: tests/distributed/test_fsdp.py), the same ledger on
    every rank, the weights moved."""
    ranks, _ = more
    runs = [secure for _, secure in ranks]
    for run in runs:
        assert run["secure"] == (True, True) and run["optimizer"] == "ShardedDPOptimizer"
        assert run["global_step"] == 3 and run["ledger"] == runs[0]["ledger"]
        assert [len(p) for p in run["padding"]] == [len(p) for p in runs[0]["padding"]]
    assert runs[0]["ledger"]["segments"] == [
        {"sample_rate": 0.2, "noise_multiplier": 1.0, "count": 3}
    ]
    moved = [
        float((runs[0]["params"][n] - runs[0]["initial"][n]).abs().max()) for n in runs[0]["params"]
    ]
    assert min(moved) > 0


@needs_sharded_models
@pytest.mark.slow
def test_lora_ghost_sharded_run_equals_one_process(tmp_path):
    # ~45 s on 2 loaded cores: its own spawn of 2 processes
    ranks = spawn(_fsdp_run.lora_ghost, 2, (str(tmp_path / "two"),), timeout=120, join_timeout=900)
    one = _fsdp_run.train(str(tmp_path / "one"), False, 4, lora=True, mode="ghost")
    assert all("lora_" in n for n in one["params"])  # only the adapters train
    moved = max(float((one["params"][n] - one["initial"][n]).abs().max()) for n in one["params"])
    assert moved > 1e-3
    for rank in ranks:
        assert rank["optimizer"] == "ShardedDPOptimizer" and rank["ledger"] == one["ledger"]
        assert rank["params"].keys() == one["params"].keys()
        for name, value in one["params"].items():
            torch.testing.assert_close(rank["params"][name], value, rtol=0, atol=1e-6, msg=name)


@needs_sharded_models
@pytest.mark.slow
def test_lora_ghost_sharded_run_resumes_bit_for_bit(tmp_path):
    # ~35 s on 2 loaded cores: two spawns of 2 processes (the run, then the resumption)
    run = spawn(
        _fsdp_run.checkpointed, 2, (str(tmp_path / "run"), True), timeout=120, join_timeout=900
    )
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    args = (str(tmp_path / "resumed"), checkpoint, True)
    again = spawn(_fsdp_run.resumed, 2, args, timeout=120, join_timeout=900)
    for whole, resumed_rank in zip(run, again, strict=True):
        assert all("lora_" in n for n in whole["params"])  # only the adapters train
        assert resumed_rank["steps_run"] == 2 and resumed_rank["ledger"] == whole["ledger"]
        assert resumed_rank["params"].keys() == whole["params"].keys()
        for name, value in whole["params"].items():
            assert torch.equal(resumed_rank["params"][name], value), name
