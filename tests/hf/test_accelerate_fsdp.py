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

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from dptrain.distributed import spawn
from dptrain.hf import DPTrainer, PrivacyArguments
from dptrain.hf.errors import UnsupportedTrainingArgumentsError
from tests.hf import _accelerate_fsdp_run, _fsdp_run, fsdp_checks, tiny

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
    fsdp_checks.assert_noise_added_once(quiet, noised0, noised1)


def test_save_model_writes_the_gathered_weights_and_privacy_json(runs):
    ranks, _, folder = runs
    fsdp_checks.assert_saved_gathered(folder, ranks[0][1])


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


@pytest.mark.slow
def test_a_plugin_sharded_run_resumes_bit_for_bit(tmp_path):
    # ~70 s on 2 loaded cores: two spawns of 2 processes (the run, then the resumption)
    run = spawn(
        _accelerate_fsdp_run.checkpointed,
        2,
        (str(tmp_path / "run"),),
        timeout=120,
        join_timeout=900,
    )
    checkpoint = tmp_path / "run" / "checkpoint-2"
    # every rank wrote its shards; the gathered weights too, whatever state_dict_type says
    assert not (checkpoint / "optimizer.pt").exists()
    assert (checkpoint / "model.safetensors").is_file()
    assert (checkpoint / "dptrain_shards" / "latest.json").is_file()
    args = (str(tmp_path / "resumed"), str(checkpoint))
    again = spawn(_accelerate_fsdp_run.resumed, 2, args, timeout=120, join_timeout=900)
    for whole, resumed_rank in zip(run, again, strict=True):
        assert whole["global_step"] == resumed_rank["global_step"] == 4
        assert whole["steps_run"] == 4 and resumed_rank["steps_run"] == 2
        assert resumed_rank["ledger"] == whole["ledger"]
        assert resumed_rank["learning_rates"] == whole["learning_rates"]
        assert resumed_rank["params"].keys() == whole["params"].keys()
        for name, value in whole["params"].items():
            assert torch.equal(resumed_rank["params"][name], value), name
    before = _fsdp_run.full_weights(str(checkpoint))
    assert any(not torch.equal(before[n], v) for n, v in run[0]["params"].items())


@pytest.mark.slow
def test_lora_and_ram_efficient_loading_under_the_plugin_equal_one_process(tmp_path):
    # ~70 s on 2 loaded cores: one spawn of 2 processes, two one-process references
    runs = spawn(
        _accelerate_fsdp_run.lora_and_ram_efficient_loading,
        2,
        (str(tmp_path / "two"),),
        timeout=120,
        join_timeout=900,
    )
    lora_one = _fsdp_run.train(str(tmp_path / "lora"), False, 4, lora=True, mode="ghost")
    one = _fsdp_run.train(str(tmp_path / "one"), False, 4)
    assert all("lora_" in n for n in lora_one["params"])  # only the adapters train
    for lora, ram in runs:
        for sharded, reference in ((lora, lora_one), (ram, one)):
            assert sharded["fsdp_enabled"] and sharded["sharded_before_train"]
            assert sharded["optimizer"] == "ShardedDPOptimizer"
            assert sharded["ledger"] == reference["ledger"]
            assert sharded["params"].keys() == reference["params"].keys()
            for name, value in reference["params"].items():
                torch.testing.assert_close(
                    sharded["params"][name], value, rtol=0, atol=1e-6, msg=name
                )


# an FSDP2 config as `accelerate config` writes it (SHARDED_STATE_DICT: save_model still
# writes the gathered weights)
ACCELERATE_CONFIG = """\
compute_environment: LOCAL_MACHINE
distributed_type: FSDP
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_reshard_after_forward: true
  fsdp_offload_params: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_cpu_ram_efficient_loading: false
mixed_precision: 'no'
machine_rank: 0
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""


@pytest.mark.slow
def test_accelerate_launch_with_an_fsdp2_config_reaches_the_sharded_path(tmp_path):
    # ~35 s: `accelerate launch` starts 2 CPU processes (gloo); the script applies the
    # test's patch (accelerate ignores the plugin on CPU otherwise) and takes the plugin
    # from the environment the launcher set
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    config = tmp_path / "fsdp2.yaml"
    config.write_text(ACCELERATE_CONFIG)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    for name in ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["-m", "tests.hf._accelerate_fsdp_run", str(out), "--launched"]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((out / f"result_{rank}.json").read_text()) for rank in (0, 1)]
    for result in results:
        assert result["fsdp_enabled"] and result["sharded_before_train"]
        assert result["world_size"] == 2 and result["optimizer"] == "ShardedDPOptimizer"
        assert "model.layers.0" in result["groups"] and "<root>" in result["groups"]
        assert result["ledger"]["segments"] == [
            {"sample_rate": 0.2, "noise_multiplier": 1.0, "count": 3}
        ]
    assert (out / "model.safetensors").is_file()
    report = json.loads((out / "privacy.json").read_text())
    assert report["ledger"] == results[0]["ledger"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_plugin_on_one_cuda_process_equals_the_cpu_run(tmp_path):
    # accelerate's own FSDP2 path on a GPU (no patch), one nccl process: a smoke test of
    # the CUDA path against the one-process CPU run (float32 kernels of another device)
    (cuda,) = spawn(
        _accelerate_fsdp_run.on_cuda,
        1,
        (str(tmp_path / "cuda"),),
        backend="nccl",
        timeout=120,
        join_timeout=600,
    )
    one = _fsdp_run.train(str(tmp_path / "one"), False, 4)
    assert cuda["fsdp_enabled"] and cuda["sharded_before_train"]
    assert cuda["optimizer"] == "ShardedDPOptimizer" and cuda["ledger"] == one["ledger"]
    for name, value in one["params"].items():
        torch.testing.assert_close(cuda["params"][name], value, rtol=0, atol=1e-5, msg=name)
