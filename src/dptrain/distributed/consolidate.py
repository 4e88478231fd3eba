"""A sharded (FSDP2) checkpoint as a plain Hugging Face model folder, with its privacy record.

    dptrain consolidate runs/fsdp/ckpt runs/fsdp/model     # or, from Python:
    consolidate_checkpoint("runs/fsdp/ckpt", "runs/fsdp/model")

In one process, without a process group: the model is rebuilt from the class and
configuration the checkpoint recorded (:func:`describe_model`, called at save time),
its full (unsharded) weights are read from every rank's shards
(``torch.distributed.checkpoint.load(..., no_dist=True)`` reshards into full tensors),
and the folder is written with ``save_pretrained`` (config.json + safetensors) and
``privacy.json`` (:mod:`dptrain.privacy_record`), whose epsilon is the checkpoint's
ledger's. A LoRA (peft) model is merged into its base (``merge_and_unload``): the
folder is the plain fine-tuned model, which ``from_pretrained`` loads without peft.

Memory: the whole model, in the dtype it was trained in, in this process's RAM.
"""

from __future__ import annotations

import importlib
import json
import os
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from dptrain.distributed.sharded_checkpoint import read_state
from dptrain.privacy_record import PrivacyRecord

__all__ = ["consolidate_checkpoint", "describe_model"]

PRODUCER = "dptrain consolidate"


def describe_model(model: nn.Module) -> dict[str, Any] | None:
    """What :func:`consolidate_checkpoint` needs to rebuild ``model`` (a transformers model,
    possibly wrapped by peft): its class, its configuration and parameter dtype, and a
    peft model's adapter configuration. None for a model that is not a transformers one."""
    peft_config = getattr(model, "peft_config", None)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None
    dtype = next((p.dtype for p in base.parameters()), torch.float32)
    adapters = None
    if isinstance(peft_config, dict) and peft_config:
        # plain JSON types (enums as their values, sets as lists): a checkpoint is read
        # with torch.load(weights_only=True), which unpickles no foreign class
        adapters = {
            name: json.loads(json.dumps(c.to_dict(), default=sorted))
            for name, c in peft_config.items()
        }
    cls = type(base)
    # FSDP2 swaps each sharded module's class for FSDP<class>: record the user's class
    while cls.__name__.startswith("FSDP") and len(cls.__bases__) > 1:
        cls = cls.__bases__[1]
    return {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "config": json.loads(config.to_json_string(use_diff=False)),
        "dtype": str(dtype).removeprefix("torch."),
        "peft": adapters,
    }


def _rebuild(info: dict[str, Any]) -> nn.Module:
    module_name, _, class_name = info["class"].rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    config = cls.config_class.from_dict(dict(info["config"]))
    model = cls(config).to(getattr(torch, info["dtype"]))
    if info.get("peft"):
        from peft import LoraConfig, get_peft_model
        from peft.config import PeftConfig

        (name, adapter), *more = info["peft"].items()
        if more:
            raise ValueError(
                f"the checkpoint's model has {len(more) + 1} peft adapters: consolidation "
                "merges one"
            )
        adapter_config = PeftConfig.from_peft_type(**adapter)
        if not isinstance(adapter_config, LoraConfig):
            raise ValueError(
                f"peft adapter {name!r} is a {type(adapter_config).__name__}: consolidation "
                "merges LoRA adapters only"
            )
        model = get_peft_model(model, adapter_config, adapter_name=name)
    return model


def _privacy_record(
    state: dict[str, Any], model: nn.Module, delta: float, accountant: str, source: Path
) -> PrivacyRecord:
    from dptrain.accounting import PrivacyLedger, make_accountant
    from dptrain.hf.report import NOT_COVERED, base_model_of

    ledger = PrivacyLedger.from_state_dict(state["ledger"])
    epsilon = make_accountant(accountant, ledger).epsilon(delta) if ledger.num_steps else 0.0
    config = state["config"]
    unit = config["privacy_unit"]
    return PrivacyRecord(
        private=True,
        statement=(
            f"({epsilon:.4g}, {delta:.3g})-DP for the training data at the {unit} level "
            f"({accountant} accountant)"
        ),
        privacy_unit=unit,
        producer=PRODUCER,
        epsilon=epsilon,
        delta=delta,
        accountant=accountant,
        epsilon_by_accountant={accountant: epsilon},
        neighbouring=f"training sets that differ by adding or removing one {unit}",
        covers=[
            "the trained weights and everything computed from them alone (outputs, "
            "generations), as released after the steps in the ledger"
        ],
        not_covered=list(NOT_COVERED),
        training={
            "steps_taken": state["step"],
            "planned_steps": config["steps"],
            "noise_multiplier": config["noise_multiplier"],
            "max_grad_norm": config["max_grad_norm"],
            "num_records": config["dataset_size"],
            "world_size": state["world_size"],
            "sharding": "FSDP2",
        },
        base_model=base_model_of(model),
        ledger=ledger.state_dict(),
    )


def consolidate_checkpoint(
    path: str | os.PathLike,
    out: str | os.PathLike,
    *,
    delta: float | None = None,
    accountant: str | None = None,
) -> Path:
    """Write the sharded checkpoint at ``path`` as a Hugging Face folder ``out``; returns it.

    ``out``: config.json, the full weights as safetensors (``save_pretrained``) and
    privacy.json. ``delta``: the delta of the stated epsilon (default: the run's
    ``target_delta``; required when the run gave a noise multiplier instead);
    ``accountant``: default the run's. ``out`` must not exist or be an empty directory
    (it is written beside it and renamed into place: a reader never sees half of it).
    """
    source = Path(path)
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"out={str(out)!r} exists and is not an empty directory: consolidation writes a "
            "new folder and overwrites nothing; give a new path"
        )
    directory, state = read_state(source)
    info = state.get("model_info")
    if info is None:
        raise ValueError(
            f"path={str(source)!r}: the checkpoint's model is not a transformers model (no "
            "configuration recorded), so there is no Hugging Face folder to write; "
            "torch.distributed.checkpoint.format_utils.dcp_to_torch_save(path/"
            f"{directory.name}, FILE) gives its full state dict"
        )
    delta = state.get("target_delta") if delta is None else delta
    if delta is None:
        raise ValueError(
            "delta=None: the run was configured without a target_delta (a noise multiplier "
            "given directly), so the checkpoint names none; give the delta its epsilon is "
            "to be stated at (--delta 1e-5)"
        )
    accountant = accountant or state.get("accountant") or "pld"
    model = _rebuild(info)
    full = {"model": model.state_dict()}
    # no process group: DCP reads every rank's shards into these full-shape tensors, which
    # are the model's own (state_dict shares their storage)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(full, checkpoint_id=directory, no_dist=True)
    model.load_state_dict(full["model"])
    record = _privacy_record(state, model, delta, accountant, source)
    if info.get("peft"):
        model = model.merge_and_unload()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{secrets.token_hex(4)}"
    try:
        model.save_pretrained(tmp)
        record.write(tmp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
