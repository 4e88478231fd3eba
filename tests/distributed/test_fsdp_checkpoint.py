"""Sharded (FSDP2) checkpoints: a stopped run resumed in fresh processes ends bit-identical
to the uninterrupted one; consolidation into a Hugging Face folder with privacy.json.

Two spawns of 2 gloo processes (:mod:`tests.distributed.fsdp_checkpoint_run`), shared
by the module: the first trains without checkpoints, with a checkpoint after every
step, stopped after STOP_AFTER steps, and LoRA; the second, fresh processes, resumes
the stopped run. Consolidation runs here, in one process without a process group.
"""

from __future__ import annotations

import json

import pytest
import torch

from dptrain import privacy_record
from dptrain.accounting import PrivacyLedger, make_accountant
from dptrain.distributed import spawn
from dptrain.distributed.consolidate import consolidate_checkpoint
from dptrain.distributed.sharded_checkpoint import POINTER_FILE, STATE_FILE
from tests.distributed import fsdp_checkpoint_run as run
from tests.distributed.fsdp_run import llama


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_ckpt")
    (out / "notes.txt").write_text("the user's notes")
    (out / "mine").mkdir()
    (out / "mine" / "data.txt").write_text("the user's data")
    torch.save({"not": "a checkpoint"}, out / "run.pt")
    first = spawn(run.first_spawn, 2, (str(out),), timeout=120, join_timeout=900)
    second = spawn(run.second_spawn, 2, (str(out),), timeout=120, join_timeout=900)
    return out, first, second


def _assert_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, t in a.items():
        assert torch.equal(t, b[name]), (name, float((t - b[name]).abs().max()))


def test_stopped_run_resumed_in_new_processes_is_bit_identical(runs):
    _, first, second = runs
    for rank in range(2):
        plain = first[rank]["plain"]
        resumed = second[rank]["resumed"]
        assert second[rank]["resumed_at"] == run.STOP_AFTER
        assert first[rank]["stopped"]["steps"] == run.STOP_AFTER
        assert resumed["steps"] == run.STEPS
        _assert_equal(resumed["params"], plain["params"])
        assert resumed["ledger"] == plain["ledger"]
        assert second[rank]["extra"] == {"step": run.STOP_AFTER}
    # the stopped run did move: resuming from its initialisation would not match
    name = "model.embed_tokens.weight"
    assert not torch.equal(first[0]["stopped"]["params"][name], first[0]["plain"]["params"][name])


def test_saving_after_every_step_leaves_the_run_unchanged(runs):
    _, first, _ = runs
    for rank in range(2):
        _assert_equal(first[rank]["saving"]["params"], first[rank]["plain"]["params"])
        assert first[rank]["saving"]["ledger"] == first[rank]["plain"]["ledger"]


def test_the_directory_holds_one_complete_state(runs):
    out, _, _ = runs
    ckpt = out / "full"
    pointer = json.loads((ckpt / POINTER_FILE).read_text())
    assert pointer["step"] == run.STEPS and pointer["world_size"] == 2
    entries = sorted(p.name for p in ckpt.iterdir())
    assert entries == sorted([POINTER_FILE, pointer["state"]])  # the replaced states are gone
    state = ckpt / pointer["state"]
    names = {p.name for p in state.iterdir()}
    assert {STATE_FILE, ".metadata", "__0_0.distcp", "__1_0.distcp"} <= names


def test_nothing_the_user_made_is_overwritten(runs):
    out, first, _ = runs
    refusals = first[0]["refusals"]
    assert "notes.txt' is a file" in refusals["file"], refusals["file"]
    assert (out / "notes.txt").read_text() == "the user's notes"
    assert "not a dptrain sharded checkpoint" in refusals["directory"], refusals["directory"]
    assert sorted(p.name for p in (out / "mine").iterdir()) == ["data.txt"]
    assert refusals["one_file_checkpoint"].startswith("CheckpointError: path="), refusals
    assert "is not a sharded checkpoint" in refusals["one_file_checkpoint"]


def test_a_run_of_another_configuration_is_refused(runs):
    _, _, second = runs
    message = second[0]["refusal"]
    assert message.startswith("DistributedConfigError"), message
    assert "noise_multiplier=1.0 in the checkpoint, 2.0 in this run" in message


def _expected_epsilon(ledger: dict) -> float:
    return make_accountant("pld", PrivacyLedger.from_state_dict(ledger)).epsilon(run.DELTA)


def test_consolidated_folder_loads_with_from_pretrained_and_equals_the_run(runs, tmp_path, capsys):
    """Through the command line, as a user runs it; the weights are the gathered ones."""
    from transformers import AutoModelForCausalLM

    from dptrain.cli import main

    out, first, _ = runs
    model_dir = tmp_path / "model"
    assert main(["consolidate", str(out / "full"), str(model_dir)]) == 0
    stdout = capsys.readouterr().out
    assert f"model: {model_dir}" in stdout
    saved = first[0]["saving"]
    assert {p.name for p in model_dir.iterdir()} >= {"config.json", "model.safetensors"}
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    state = model.state_dict()
    for name, t in saved["params"].items():
        assert torch.equal(state[name].double(), t), name
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    record = privacy_record.read(model_dir)
    assert record.private and record.privacy_unit == "example"
    assert record.ledger == saved["ledger"]
    assert record.delta == run.DELTA
    assert record.epsilon == pytest.approx(_expected_epsilon(saved["ledger"]), rel=1e-9)
    assert record.training["steps_taken"] == run.STEPS
    assert f"{record.epsilon:.4g}" in stdout


def test_consolidated_lora_is_the_merged_model(runs, tmp_path):
    """The LoRA run's folder is a plain Llama whose logits are the adapted model's."""
    from transformers import AutoModelForCausalLM

    out, first, _ = runs
    model_dir = consolidate_checkpoint(out / "lora", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(model_dir)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    adapted = llama(lora=True)
    trained = first[0]["lora"]["params"]
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            p.copy_(trained[name])
    # the adapters moved (lora_B starts at 0): the merge has something to merge
    assert any(float(trained[n].abs().max()) > 0 for n in trained if "lora_B" in n)
    ids = torch.arange(8).reshape(1, 8) % 48
    adapted.eval()
    merged.eval()
    with torch.no_grad():
        expected = adapted(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
    assert privacy_record.read(model_dir).training["steps_taken"] == run.STEPS


def test_consolidation_refuses_to_overwrite_and_names_the_argument(runs, tmp_path, capsys):
    from dptrain.cli import main

    out, _, _ = runs
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"out=.*taken' exists and is not an empty directory"):
        consolidate_checkpoint(out / "full", taken)
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]
    new = str(tmp_path / "new")
    for args, words in [
        ([str(out / "mine"), new], "no latest.json: not a dptrain sharded checkpoint"),
        ([str(out / "notes.txt"), new], "checkpoint='" + str(out / "notes.txt")),
        ([str(out / "full"), new, "--delta", "2"], "--delta=2.0 is not allowed"),
        ([str(out / "full"), str(taken)], "exists and is not an empty directory"),
    ]:
        assert main(["consolidate", *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith("dptrain consolidate: error: ") and words in err, err
    assert not (tmp_path / "new").exists()


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 4])
def test_another_world_size_resumes_the_sharded_checkpoint(runs, world):
    """DCP reshards: the loaded parameters are the stopped run's exactly; the run continues
    its ledger (sampling and keyed noise do not depend on W; dropout's streams do, so the
    final parameters are not compared)."""
    out, first, _ = runs
    ranks = spawn(run.other_world_spawn, world, (str(out),), timeout=120, join_timeout=900)
    for rank in ranks:
        _assert_equal(rank["loaded"]["params"], first[0]["stopped"]["params"])
        assert rank["loaded"]["steps"] == run.STOP_AFTER
        assert rank["final"]["ledger"] == first[0]["plain"]["ledger"]
