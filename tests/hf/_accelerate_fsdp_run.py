"""DPTrainer under accelerate's FSDP2 plugin, for tests/hf/test_accelerate_fsdp.py
(module-level, so spawn can pickle it): the tied 2-layer Llama of
tests/distributed/fsdp_run.py, unsharded, handed to DPTrainer with
``fsdp="full_shard"`` and ``fsdp_config={"fsdp_version": 2, ...}`` (or, as under
``accelerate launch``, the plugin's environment variables), so that accelerate's
``fsdp2_prepare_model`` shards it.

accelerate 1.15 enables its FSDP plugin only for multi-accelerator distributed types
(accelerate/state.py, ``AcceleratorState.__init__``: MULTI_GPU, MULTI_XPU, ...) and
ignores it on MULTI_CPU. :func:`fsdp_on_cpu` makes it take the FSDP path there too, in
the test processes only: after accelerate's own ``__init__``, it does what that
``__init__`` does for a multi-GPU state with a plugin (distributed type FSDP, the
mixed precision set on the plugin, the plugin kept). Everything after that (the plugin,
``fsdp2_prepare_model``, ``Accelerator.prepare``) is accelerate's code, unpatched.

Also a script, for docs/hf.md: ``torchrun --nproc_per_node 2 -m tests.hf._accelerate_fsdp_run
OUT`` (gloo on CPU) prints what :func:`train` reports.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from tests.hf import _fsdp_run

# accelerate's transformer-based wrapping, per decoder layer (what a user writes)
FSDP_CONFIG = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}

# what `accelerate launch --config_file fsdp2.yaml` puts in the environment (accelerate's
# commands/launch.py, prepare_multi_gpu_env) for fsdp_version 2 and transformer-based
# wrapping of LlamaDecoderLayer; FSDP_STATE_DICT_TYPE left out (FSDP2's default:
# SHARDED_STATE_DICT)
LAUNCH_ENV = {
    "ACCELERATE_USE_FSDP": "true",
    "FSDP_VERSION": "2",
    "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
    "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer",
    "FSDP_RESHARD_AFTER_FORWARD": "true",
    "FSDP_OFFLOAD_PARAMS": "false",
}


def fsdp_on_cpu() -> None:
    """Make accelerate honour its FSDP plugin on MULTI_CPU (gloo): tests only, see above."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    if getattr(original, "_fsdp_on_cpu", False):
        return

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        shared = AcceleratorState._shared_state
        was_initialized = bool(shared) and shared != PartialState._shared_state
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if was_initialized or plugin is None or self.distributed_type != DistributedType.MULTI_CPU:
            return
        # accelerate/state.py, the multi-accelerator branch, verbatim in effect
        self.distributed_type = DistributedType.FSDP
        if self._mixed_precision != "no":
            plugin.set_mixed_precision(self._mixed_precision)
        self.fsdp_plugin = plugin
        PartialState._shared_state["distributed_type"] = self.distributed_type

    init._fsdp_on_cpu = True  # type: ignore[attr-defined]
    AcceleratorState.__init__ = init  # type: ignore[method-assign]


def train(
    output_dir: str,
    per_device: int = 2,
    save: bool = False,
    launch_env: bool = False,
    from_launcher: bool = False,
    patch: bool = True,
    lora: bool = False,
    arguments: dict[str, Any] | None = None,
    **privacy: Any,
) -> dict[str, Any]:
    """3 DPTrainer updates with accelerate's FSDP2 plugin sharding the model (as
    :func:`tests.hf._fsdp_run.train`, whose one-process run is the reference).
    ``launch_env``: the plugin from accelerate launch's environment, not fsdp=."""
    from tests.hf import tiny

    if patch:
        fsdp_on_cpu()
    settings: dict[str, Any] = {
        "eval_strategy": "steps",
        "eval_steps": 2,
        "per_device_eval_batch_size": 3,
    }
    if launch_env:
        os.environ.update(LAUNCH_ENV)
    elif not from_launcher:
        settings.update(fsdp="full_shard", fsdp_config=dict(FSDP_CONFIG))
    settings.update(arguments or {})
    try:
        trainer = _fsdp_run._trainer(
            output_dir,
            False,
            per_device,
            settings,
            eval_dataset=tiny.lm_records(11, seed=3),
            lora=lora,
            **privacy,
        )
        sharded_before = _sharded(trainer.model)
        trainer.train()
        if save:
            trainer.save_model()
    finally:
        for name in LAUNCH_ENV if launch_env else ():
            os.environ.pop(name, None)
    full = _fsdp_run.full
    return {
        "world_size": trainer.args.world_size,
        "fsdp_enabled": trainer.is_fsdp_enabled,
        "sharded_before_train": sharded_before,
        "groups": _groups(trainer.model),
        "global_step": trainer.state.global_step,
        "ledger": trainer.privacy.ledger.state_dict(),
        "params": {n: full(p) for n, p in trainer.model.named_parameters() if p.requires_grad},
        "optimizer": type(trainer.privacy.optimizer).__name__,
        "padding": trainer.padding,
        "eval_loss": [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h],
    }


def lora_and_ram_efficient_loading(output_dir: str) -> tuple[dict, dict]:
    """LoRA adapters (ghost clipping) under the plugin, then the plugin with
    ``cpu_ram_efficient_loading`` (accelerate shards on the meta device and loads rank
    0's weights into the shards), both at sigma ~ 0."""
    lora = train(f"{output_dir}/lora", lora=True, mode="ghost")
    config = {**FSDP_CONFIG, "cpu_ram_efficient_loading": True}
    arguments = {"fsdp": "full_shard", "fsdp_config": config}
    try:
        ram = train(f"{output_dir}/ram", arguments=arguments)
    finally:
        # (TrainingArguments set it for the process, for from_pretrained to read)
        os.environ.pop("FSDP_CPU_RAM_EFFICIENT_LOADING", None)
    return lora, ram


def on_cuda(output_dir: str) -> dict[str, Any]:
    """:func:`train` on the CUDA device of a one-process nccl group, accelerate's FSDP2
    path unpatched (MULTI_GPU); expected batch 4 x 2 x 1 = 8. Tensors come back on the CPU."""
    result = train(output_dir, per_device=4, patch=False, arguments={"use_cpu": False})
    result["params"] = {n: t.cpu() for n, t in result["params"].items()}
    return result


def _sharded(model: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return all(isinstance(p, DTensor) for p in model.parameters())


def _groups(model: Any) -> list[str]:
    """The names of the modules accelerate made FSDP2 modules."""
    from torch.distributed.fsdp import FSDPModule

    return [n or "<root>" for n, m in model.named_modules() if isinstance(m, FSDPModule)]


# what DPTrainer refuses in the plugin accelerate launch's environment makes (fsdp_config's
# own settings are refused before accelerate is made: tests/hf/test_accelerate_fsdp.py)
REFUSED: dict[str, dict[str, str]] = {
    "fsdp1": {"FSDP_VERSION": "1"},
    "offload": {"FSDP_OFFLOAD_PARAMS": "true"},
    "bf16": {"ACCELERATE_MIXED_PRECISION": "bf16"},
    "no_reshard": {"FSDP_RESHARD_AFTER_FORWARD": "false"},
    "checkpointing": {"FSDP_ACTIVATION_CHECKPOINTING": "true"},
}


def refusal(output_dir: str, kind: str) -> str:
    """The error DPTrainer raises for ``kind``'s setting under the plugin (its message)."""
    fsdp_on_cpu()
    env = {**LAUNCH_ENV, **REFUSED[kind]}
    os.environ.update(env)
    try:
        _fsdp_run._trainer(output_dir, False, 2)
    except Exception as exc:  # the test reads the message
        return f"{type(exc).__name__}: {exc}"
    finally:
        for name in env:
            os.environ.pop(name, None)
    return ""


def _checkpointed_trainer(output_dir: str) -> Any:
    fsdp_on_cpu()
    arguments = {
        **_fsdp_run.CHECKPOINTED,
        "logging_steps": 1,
        "fsdp": "full_shard",
        "fsdp_config": dict(FSDP_CONFIG),
    }
    return _fsdp_run._trainer(output_dir, False, 2, arguments, **_fsdp_run.NOISED)


def checkpointed(output_dir: str) -> dict[str, Any]:
    """:data:`tests.hf._fsdp_run.CHECKPOINTED` (AdamW, linear decay, noise, a checkpoint
    after every step) under the plugin, uninterrupted."""
    trainer = _checkpointed_trainer(output_dir)
    trainer.train()
    return _fsdp_run._outcome(trainer)


def resumed(output_dir: str, checkpoint: str) -> dict[str, Any]:
    """The same run, a new model and DPTrainer resuming from ``checkpoint`` (fresh processes)."""
    trainer = _checkpointed_trainer(output_dir)
    trainer.train(resume_from_checkpoint=checkpoint)
    return _fsdp_run._outcome(trainer)


def unpatched(output_dir: str) -> dict[str, Any]:
    """DPTrainer with fsdp= where accelerate ignores the plugin (MULTI_CPU, before
    :func:`fsdp_on_cpu`): whether FSDP is on, and what DPTrainer logged."""
    import logging

    from accelerate.state import AcceleratorState

    assert not getattr(AcceleratorState.__init__, "_fsdp_on_cpu", False)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("dptrain.hf.trainer")
    handler = Keep(logging.WARNING)
    logger.addHandler(handler)
    try:
        settings = {"fsdp": "full_shard", "fsdp_config": dict(FSDP_CONFIG)}
        trainer = _fsdp_run._trainer(output_dir, False, 2, settings)
    finally:
        logger.removeHandler(handler)
    return {"fsdp_enabled": trainer.is_fsdp_enabled, "log": lines}


def scenarios(output_dir: str) -> tuple[dict, dict, dict, dict, dict]:
    """One process group's runs: sigma ~ 0 and sigma = 1 (then save_model) under fsdp=,
    sigma ~ 0 with the plugin from accelerate launch's environment, the refusals, and
    (first, before the patch) fsdp= where accelerate ignores it."""
    ignored = unpatched(f"{output_dir}/ignored")
    quiet = train(f"{output_dir}/quiet")
    noised = train(f"{output_dir}/noised", save=True, **_fsdp_run.NOISED)
    launched = train(f"{output_dir}/launched", launch_env=True)
    refusals = {k: refusal(f"{output_dir}/{k}", k) for k in REFUSED}
    return quiet, noised, launched, refusals, ignored


if __name__ == "__main__":
    import json

    # `--launched`: under `accelerate launch` with an FSDP2 config, the plugin from the
    # environment it set (no fsdp= here)
    launched = "--launched" in sys.argv[2:]
    if launched:
        fsdp_on_cpu()
    result = train(sys.argv[1], save=True, from_launcher=launched, **_fsdp_run.NOISED)
    shown = {k: v for k, v in result.items() if k not in ("params", "padding")}
    # each rank's report, whole (the ranks' printed lines may interleave)
    with open(f"{sys.argv[1]}/result_{os.environ.get('RANK', '0')}.json", "w") as f:
        json.dump(shown, f)
    print(shown, flush=True)
