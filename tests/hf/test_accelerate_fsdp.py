"""DPTrainer under accelerate's FSDP2 plugin (``fsdp=`` / ``fsdp_config=``, and the
environment ``accelerate launch`` sets), two gloo processes.

accelerate shards the unsharded tied Llama itself (its ``fsdp2_prepare_model``: a unit
per decoder layer, the tail, the root); the spawned processes make accelerate honour the
plugin on CPU (:func:`tests.hf._accelerate_fsdp_run.fsdp_on_cpu`, test-only). The
reference is DPTrainer in one process, unsharded, with the same seed and expected batch,
as in tests/hf/test_fsdp.py for a model the user shards.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dptrain.distributed import spawn
from dptrain.hf import DPTrainer, PrivacyArguments
from dptrain.hf.errors import UnsupportedTrainingArgumentsError
from tests.hf import _accelerate_fsdp_run, _fsdp_run, tiny

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(ranks, the one-process reference, the output folder): one spawn of 2 processes."""
    folder = tmp_path_factory.mktemp("accelerate_fsdp")
    ranks = spawn(_accelerate_fsdp_run.scenarios, 2, (str(folder),), timeout=120, join_timeout=900)
    # 2 records per chunk x 2 accumulation x 2 processes = 4 x 2 x 1: B = 8 in both
    reference = _fsdp_run.train(str(folder / "one"), False, 4)
    return ranks, reference, folder


@pytest.mark.parametrize("run", [0, 2], ids=["fsdp_config", "accelerate_launch_env"])
def test_plugin_sharded_run_equals_one_process(runs, run):
    ranks, one, _ = runs
    assert one["world_size"] == 1 and one["optimizer"] == "DPOptimizer"
    moved = max(float((one["params"][n] - one["initial"][n]).abs().max()) for n in one["params"])
    assert moved > 1e-3  # the steps did move the weights: the comparison below means something
    for rank in ranks:
        sharded = rank[run]
        assert sharded["fsdp_enabled"] and sharded["sharded_before_train"]
        assert sharded["world_size"] == 2 and sharded["global_step"] == 3
        assert sharded["optimizer"] == "ShardedDPOptimizer"
        assert sharded["ledger"] == one["ledger"]
        assert sharded["params"].keys() == one["params"].keys()
        # Trainer's distributed evaluation averages per-batch losses over an evenly padded
        # split (tests/hf/test_fsdp.py): agrees to ~1e-3 only
        assert sharded["eval_loss"] == pytest.approx(one["eval_loss"], abs=5e-3)
        for name, value in one["params"].items():
            # the same clipped sums (float32, summed in another order) and the same steps
            torch.testing.assert_close(sharded["params"][name], value, rtol=0, atol=1e-6, msg=name)


def test_accelerate_made_the_units(runs):
    ranks, _, _ = runs
    for rank in ranks:
        for run in (rank[0], rank[2]):
            # accelerate's own wrapping: each decoder layer, the embedding and the tail
            # (final norm, head; the tied embedding is in the tail's unit), the root
            assert run["groups"] == [
                "<root>",
                "model.embed_tokens",
                "model.layers.0",
                "model.layers.1",
                "model.norm",
                "lm_head",
            ]


def test_noise_is_added_once_and_agrees_across_ranks(runs):
    ranks, _, _ = runs
    (quiet, noised0, *_), (_, noised1, *_) = ranks
    for name, value in noised0["params"].items():
        torch.testing.assert_close(noised1["params"][name], value, rtol=0, atol=0, msg=name)
    assert noised0["ledger"] == noised1["ledger"]
    assert noised0["ledger"]["segments"] == [
        {"sample_rate": 0.2, "noise_multiplier": 1.0, "count": 3}
    ]
    # as in tests/hf/test_fsdp.py: the 3 steps' noise, lr sigma C / B per coordinate and
    # step; noise drawn on both ranks would give sqrt(2) times as much, none about 0
    diff = torch.cat(
        [(noised0["params"][n] - quiet["params"][n]).flatten() for n in quiet["params"]]
    )
    expected = 0.5 * 1.0 * _fsdp_run.C / 8 * math.sqrt(3)
    ratio = float(diff.std()) / expected
    assert 0.85 < ratio < 1.2, ratio


def test_save_model_writes_the_gathered_weights_and_privacy_json(runs):
    from transformers import LlamaForCausalLM

    ranks, _, folder = runs
    noised = ranks[0][1]
    saved = LlamaForCausalLM.from_pretrained(folder / "noised")
    for name, p in saved.named_parameters():
        torch.testing.assert_close(p.detach().double(), noised["params"][name], rtol=0, atol=0)
    report = json.loads((folder / "noised" / "privacy.json").read_text())
    assert report["training"]["steps_taken"] == 3 and report["training"]["world_size"] == 2
    assert report["ledger"] == noised["ledger"]


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("fsdp1", ["fsdp_version=1", "FSDP1", "fsdp_version 2"]),
        ("offload", ["cpu_offload", "CPU offload"]),
        ("bf16", ["mixed precision", "param_dtype=torch.bfloat16", "torch_dtype=torch.bfloat16"]),
        ("no_reshard", ["reshard_after_forward=False", "fsdp='full_shard'"]),
        ("checkpointing", ["activation_checkpointing=True"]),
    ],
)
def test_plugin_settings_from_accelerate_launch_are_refused_by_name(runs, kind, words):
    message = runs[0][0][3][kind]
    assert message.startswith("UnsupportedTrainingArgumentsError: accelerate's FSDP plugin")
    for word in words:
        assert word in message, message


def _trainer(tmp_path, **arguments):
    return DPTrainer(
        model=tiny.llama(),
        args=tiny.training_args(str(tmp_path), **arguments),
        train_dataset=tiny.lm_records(40),
        privacy_args=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-5),
    )


@pytest.mark.parametrize(
    ("fsdp", "config", "arguments", "words"),
    [
        ("full_shard", {"fsdp_version": 1}, {}, ["fsdp_config: fsdp_version=1", "FSDP1"]),
        ("full_shard offload", {}, {}, ["fsdp_config: cpu_offload", "turn the offload off"]),
        ("full_shard", {"activation_checkpointing": True}, {}, ["activation_checkpointing"]),
        ("shard_grad_op", {}, {}, ["reshard_after_forward=False", "fsdp='full_shard'"]),
        ("full_shard", {}, {"bf16": True}, ["fsdp_config: mixed precision", "bf16=True"]),
    ],
)
def test_fsdp_config_settings_are_refused_before_accelerate(
    tmp_path, fsdp, config, arguments, words
):
    with pytest.raises(UnsupportedTrainingArgumentsError) as err:
        _trainer(tmp_path, fsdp=fsdp, fsdp_config=config, **arguments)
    for word in words:
        assert word in str(err.value), str(err.value)


def test_fsdp_that_accelerate_ignores_trains_unsharded_and_says_so(runs):
    # gloo processes without the test's patch: accelerate leaves its plugin off on MULTI_CPU
    for rank in runs[0]:
        ignored = rank[4]
        assert not ignored["fsdp_enabled"]
        (line,) = ignored["log"]
        assert "fsdp / fsdp_config are not applied" in line and "MULTI_CPU" in line
        assert "same guarantee" in line
