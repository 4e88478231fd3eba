"""The sharded checkpoint's directory, in one process (DCP without a process group).

What the spawned FSDP2 runs (tests/distributed/test_fsdp_checkpoint.py) do not reach:
a save that fails half-way keeps the previous state current, stale temporaries and
replaced states are removed and nothing else, and an optimizer without state is not
stepped by saving.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

from dptrain.distributed import sharded_checkpoint as sc

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model_and_adam(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model(torch.ones(5, 4)).pow(2).sum().backward()
    opt.step()


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_round_trip_restores_the_model_and_the_optimizer_exactly(tmp_path):
    model, opt = _model_and_adam()
    _step(model, opt)
    sc.save_sharded(tmp_path / "ckpt", model, opt, {"step": 1, "note": "mine"})
    _step(model, opt)
    expected = _params(model)

    other, other_opt = _model_and_adam(seed=1)
    directory, state = sc.read_state(tmp_path / "ckpt")
    assert state == {"step": 1, "note": "mine"}
    sc.load_shards(directory, other, other_opt)
    _step(other, other_opt)
    for a, b in zip(_params(other), expected, strict=True):
        assert torch.equal(a, b)


def test_saving_before_the_first_step_does_not_step_the_optimizer(tmp_path):
    """DCP's get_state_dict would create Adam's state with one zero-lr step (step count 1)."""
    model, opt = _model_and_adam()
    sc.save_sharded(tmp_path / "ckpt", model, opt, {"step": 0})
    assert not opt.state
    _step(model, opt)
    reference, ref_opt = _model_and_adam()
    _step(reference, ref_opt)
    for a, b in zip(_params(model), _params(reference), strict=True):
        assert torch.equal(a, b)

    resumed, resumed_opt = _model_and_adam(seed=1)
    directory, _ = sc.read_state(tmp_path / "ckpt")
    sc.load_shards(directory, resumed, resumed_opt)
    assert not resumed_opt.state
    _step(resumed, resumed_opt)
    for a, b in zip(_params(resumed), _params(reference), strict=True):
        assert torch.equal(a, b)


def test_a_failed_save_keeps_the_previous_state(tmp_path, monkeypatch):
    ckpt = tmp_path / "ckpt"
    model, opt = _model_and_adam()
    _step(model, opt)
    first = sc.save_sharded(ckpt, model, opt, {"step": 1})
    saved = _params(model)
    _step(model, opt)

    rename = os.rename

    def crash(src, dst):
        # the new state's directory moving into place, after every shard was written
        if str(src).endswith(".tmp") and os.path.isdir(src):
            raise OSError("disk full")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(OSError, match="disk full"):
        sc.save_sharded(ckpt, model, opt, {"step": 2})
    monkeypatch.undo()
    assert sorted(p.name for p in ckpt.iterdir()) == sorted([first.name, sc.POINTER_FILE])
    directory, state = sc.read_state(ckpt)
    assert directory == first and state == {"step": 1}
    other, other_opt = _model_and_adam(seed=1)
    sc.load_shards(directory, other, other_opt)
    for a, b in zip(_params(other), saved, strict=True):
        assert torch.equal(a, b)


def test_replaced_states_and_stale_temporaries_go_the_users_files_stay(tmp_path):
    ckpt = tmp_path / "ckpt"
    model, opt = _model_and_adam()
    sc.save_sharded(ckpt, model, opt, {"step": 0})
    (ckpt / ".step-00000007-deadbeef.tmp").mkdir()  # a save killed mid-write
    (ckpt / "README.md").write_text("the user's notes")
    (ckpt / "plots").mkdir()
    _step(model, opt)
    last = sc.save_sharded(ckpt, model, opt, {"step": 1})
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == sorted([last.name, sc.POINTER_FILE, "README.md", "plots"])
    pointer = json.loads((ckpt / sc.POINTER_FILE).read_text())
    assert pointer["state"] == last.name and pointer["step"] == 1


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_a_path_that_is_not_a_checkpoint_is_never_written_into(tmp_path, kind):
    model, opt = _model_and_adam()
    path = tmp_path / "taken"
    if kind == "file":
        path.write_text("mine")
        words = "is a file"
    else:
        path.mkdir()
        (path / "mine.txt").write_text("mine")
        words = "is a non-empty directory that is not a dptrain sharded checkpoint"
    with pytest.raises(ValueError, match=words):
        sc.save_sharded(path, model, opt, {"step": 0})
    if kind == "file":
        assert path.read_text() == "mine"
    else:
        assert [p.name for p in path.iterdir()] == ["mine.txt"]


def test_reading_a_directory_that_is_not_a_checkpoint_names_it(tmp_path):
    with pytest.raises(ValueError, match=r"has no latest.json: not a dptrain sharded checkpoint"):
        sc.read_state(tmp_path)
    (tmp_path / sc.POINTER_FILE).write_text(json.dumps({"kind": "other"}))
    with pytest.raises(ValueError, match=r"not a dptrain sharded checkpoint's pointer"):
        sc.read_state(tmp_path)
