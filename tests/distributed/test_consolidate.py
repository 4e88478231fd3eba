"""Consolidation's choices and refusals, in one process: a sharded-checkpoint directory
written here by :func:`~dptrain.distributed.sharded_checkpoint.save_sharded` from an
unsharded model (DCP's layout is the same). The consolidation of a real 2-rank FSDP2
run is tested in tests/distributed/test_fsdp_checkpoint.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dptrain import privacy_record
from dptrain.accounting import PrivacyLedger, make_accountant
from dptrain.distributed.consolidate import consolidate_checkpoint, describe_model
from dptrain.distributed.sharded_checkpoint import save_sharded
from tests.distributed.fsdp_run import llama

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(model: nn.Module, target_delta: float | None) -> dict:
    ledger = PrivacyLedger()
    ledger.record(0.1, 1.0, 20)
    return {
        "step": 20,
        "world_size": 2,
        "config": {
            "dataset_size": 100,
            "steps": 30,
            "noise_multiplier": 1.0,
            "max_grad_norm": 0.5,
            "privacy_unit": "example",
        },
        "ledger": ledger.state_dict(),
        "model_info": describe_model(model),
        "target_delta": target_delta,
        "accountant": "rdp",
    }


def _checkpoint(tmp_path, model: nn.Module, target_delta: float | None = 1e-5):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return save_sharded(tmp_path / "ckpt", model, opt, _state(model, target_delta)).parent


def test_the_run_s_delta_and_accountant_state_the_guarantee(tmp_path):
    from transformers import AutoModelForCausalLM

    model = llama()
    out = consolidate_checkpoint(_checkpoint(tmp_path, model), tmp_path / "model")
    record = privacy_record.read(out)
    ledger = PrivacyLedger.from_state_dict(record.ledger)
    assert (record.accountant, record.delta) == ("rdp", 1e-5)
    assert record.epsilon == make_accountant("rdp", ledger).epsilon(1e-5)
    assert record.training["steps_taken"] == 20 and record.training["planned_steps"] == 30
    loaded = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, t in model.state_dict().items():
        assert torch.equal(loaded[name], t), name


def test_a_run_without_target_delta_needs_delta(tmp_path):
    model = llama()
    ckpt = _checkpoint(tmp_path, model, target_delta=None)
    with pytest.raises(ValueError, match=r"delta=None: the run was configured without a "):
        consolidate_checkpoint(ckpt, tmp_path / "model")
    assert not (tmp_path / "model").exists()
    out = consolidate_checkpoint(ckpt, tmp_path / "model", delta=1e-6, accountant="pld")
    record = privacy_record.read(out)
    assert (record.delta, record.accountant) == (1e-6, "pld")


def test_a_model_that_is_not_a_transformers_one_is_refused_by_name(tmp_path):
    model = nn.Linear(3, 2)
    assert describe_model(model) is None
    ckpt = _checkpoint(tmp_path, model)
    with pytest.raises(ValueError, match=r"not a transformers model .*dcp_to_torch_save"):
        consolidate_checkpoint(ckpt, tmp_path / "model")
    assert not (tmp_path / "model").exists()
