"""``DPTrainer``: ``transformers.Trainer`` with DP-SGD (Poisson batches, per-example clipping,
noise once per update, a ledger of every step).

    trainer = DPTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                        privacy_args=PrivacyArguments(target_epsilon=8, target_delta=1e-5,
                                                      max_grad_norm=1.0))
    trainer.train()
    trainer.save_model()          # weights + privacy.json + a model-card section

How it sits in Trainer's loop (read against transformers 5.23), and why
------------------------------------------------------------------

* **One logical batch per Trainer "batch".** The logical batch is Poisson-sampled with
  expected size B = per_device_train_batch_size x gradient_accumulation_steps x
  world_size, so its size is random; Trainer's gradient accumulation takes a fixed
  number of fixed-size batches per update and cannot carry it. DPTrainer's training
  loader yields one :class:`~dptrain.hf.data.PoissonStep` (the logical batch, cut
  into chunks of per_device_train_batch_size records) per optimizer update, and the
  Trainer it runs sees gradient_accumulation_steps = 1. So Trainer's step counter,
  learning-rate schedule, logging, evaluation and saving all count optimizer
  updates, which are exactly the ledger's steps.
* **The whole private step happens inside ``training_step``**: every chunk's
  per-example losses go through the clipping engine, then the DP optimizer adds the
  noise once, steps the optimizer Trainer chose (``args.optim`` or ``optimizers=``)
  and records the step. Trainer then calls ``optimizer.step()`` on a facade whose
  step does nothing (the update is done) and steps the LR scheduler. Everything
  Trainer does between ``training_step`` and its ``optimizer.step()`` call (the
  gradient norm it logs, callbacks' ``on_pre_optimizer_step``, gradient clipping)
  therefore sees only the noised gradient: the un-noised clipped sum never leaves
  ``training_step``, whatever a Trainer version does there. Trainer's own clipping
  (``args.max_grad_norm``) is switched off (logged): clipping the *sum* would bound
  nothing per example and would rescale the noise.
* **The DP state is built in ``create_optimizer``**, where Trainer makes its
  optimizer: that optimizer (with its param groups and weight decay) is wrapped by
  :func:`~dptrain.make_private` (one process) or
  :func:`~dptrain.distributed.make_private_distributed` (several).
* **Checkpoints.** The DP optimizer's ``state_dict`` (the wrapped optimizer's, the
  ledger, the noise generators, steps taken) is what Trainer saves as its
  ``optimizer.pt``; the sampler's state and the plan go to ``dptrain_state.json`` in
  the same folder. Resuming loads both and checks that the plan is the same
  (:class:`~dptrain.hf.errors.PrivacyCheckpointError` otherwise): the same ledger,
  noise and sampling stream continue. Trainer is told to skip no data on resume
  (``ignore_data_skip``): skipping would draw batches; the restored sampler already
  stands at the right step.
* **A model sharded with FSDP2** (``fully_shard`` by the user, before DPTrainer gets
  it) goes through :func:`~dptrain.distributed.make_private_distributed`'s sharded
  path: per-example clipping on the gathered weights, each clipped sum reduced into
  the rank's shard, equal chunks on every rank (padding rows of weight 0), keyed
  noise (:mod:`dptrain.distributed.sharded_optimizer`; with ``secure_mode``, each
  rank's coordinates from the OS's CSPRNG and rank 0's batches broadcast), users of
  ``group_by`` packed whole per rank (one larger than a chunk accumulated over the
  same number of parts on every rank). Trainer treats it as
  "sharded at load time": no DDP wrapper (its construction would broadcast rank 0's
  shards over the others'), no move; ``save_model`` gathers the shards.
* **accelerate's FSDP2 plugin** (``fsdp=`` / ``fsdp_config=``, or ``accelerate
  launch``) would shard the model in ``accelerator.prepare(model, optimizer)``, after
  ``create_optimizer`` has built the clipping and the private optimizer on the
  unsharded parameters. DPTrainer therefore shards it when it is built, with
  accelerate's own ``fsdp2_prepare_model`` (:meth:`DPTrainer._shard_with_accelerate`),
  and from there takes the path of a model the user sharded: ``prepare`` finds an FSDP2
  model and leaves it, and its optimizer, as they are (docs/hf.md, FSDP2).
* **Checkpoints of a sharded run** have no ``optimizer.pt`` (``torch.save`` on the
  writing rank would keep only its shards of the optimizer state): every rank writes
  its shards of the model and the optimizer, with the DP state, to ``dptrain_shards/``
  through ``torch.distributed.checkpoint`` (:func:`~dptrain.hf.checkpoint.save_shards`);
  resuming reads the weights from there too, each rank its shards, rather than loading
  the gathered ``model.safetensors`` into sharded parameters. ``load_best_model_at_end`` is refused for the same reason.

The TrainingArguments the Trainer runs with are a copy of the given ones with
``gradient_accumulation_steps=1``, ``max_grad_norm=0``, ``max_steps`` = the planned
steps and ``ignore_data_skip=True``; the given ones are kept in ``trainer.user_args``.
"""

from __future__ import annotations

import copy
import logging
import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
import transformers
from torch import Tensor, nn
from transformers import ProgressCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer import SCHEDULER_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from dptrain import make_private
from dptrain.clipping import ClippingEngine, UnsupportedModelError
from dptrain.data.poisson import group_records
from dptrain.distributed import make_private_distributed
from dptrain.distributed.fsdp import FSDPSharding, is_fsdp2, refuse_fsdp1
from dptrain.distributed.sharded_sums import ShardedGradStore
from dptrain.hf.arguments import PrivacyArguments
from dptrain.hf.checkpoint import (
    check_in_step,
    check_resumable,
    load_shards,
    restore_sampler,
    save_shards,
    save_state,
)
from dptrain.hf.data import (
    DropColumns,
    PoissonStep,
    PoissonTrainLoader,
    check_map_style,
    column_values,
)
from dptrain.hf.errors import (
    DPTrainerError,
    MissingLabelsError,
    PrivacyArgumentsError,
    PrivacyCheckpointError,
    SamplingConflictError,
    UnsupportedTrainingArgumentsError,
)
from dptrain.hf.losses import (
    PerExampleLossFunc,
    per_example_hf_loss,
    seq2seq_decoder_inputs,
    task_of,
)
from dptrain.hf.plan import PrivacyPlan, make_plan
from dptrain.hf.report import base_model_of, privacy_report, write_privacy_report
from dptrain.optim import DPOptimizer
from dptrain.privacy_engine import PrivateTraining, check_optimizer_matches
from dptrain.progress import EpsilonCurve, plan_text

__all__ = ["DPTrainer"]

log = logging.getLogger(__name__)


class _UpdateDoneInTrainingStep(torch.optim.Optimizer):
    """The optimizer Trainer holds: the DP optimizer's state and groups, a no-op ``step``.

    The private update (noise once, the wrapped optimizer's step, the ledger record)
    already happened in :meth:`DPTrainer.training_step`; see the module docstring for
    why it happens there. Checkpoints (``state_dict`` / ``load_state_dict``), param
    groups (the LR scheduler) and ``zero_grad`` are the DP optimizer's.
    """

    def __init__(self, dp_optimizer: torch.optim.Optimizer):
        # Not calling Optimizer.__init__: state and groups are the DP optimizer's.
        self.dp_optimizer = dp_optimizer
        self._optimizer_step_pre_hooks: dict = {}
        self._optimizer_step_post_hooks: dict = {}

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.dp_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.dp_optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.dp_optimizer.state

    @property
    def defaults(self):  # type: ignore[override]
        return self.dp_optimizer.defaults

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.dp_optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure=None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError(
                "closure= is not supported: a DP step must not re-evaluate the loss on the batch"
            )

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self.dp_optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:  # type: ignore[override]
        self.dp_optimizer.load_state_dict(state)

    def __repr__(self) -> str:
        return f"UpdateDoneInTrainingStep({self.dp_optimizer!r})"


class _PrivacyCallback(TrainerCallback):
    """Keeps Trainer's epoch in expected passes and stops cleanly when the budget is spent."""

    def __init__(self, trainer: DPTrainer):
        self.trainer = trainer
        self.reported = False

    def on_step_end(self, args, state, control, **kwargs):
        plan = self.trainer.privacy_plan
        # Trainer counts epochs in loader lengths and restarts the count on resume
        # (it skips no batches); the expected number of passes is steps x q.
        state.epoch = state.global_step * plan.sample_rate
        self._show_epsilon()
        if self.trainer.budget_spent() and not self.reported:
            # Trainer's own max_steps (the planned steps) usually stops it here too; the
            # budget is what decides, and the line says so.
            self.reported = True
            control.should_training_stop = True
            line = (
                f"privacy budget spent: {self.trainer.privacy.optimizer.steps_taken} steps, "
                f"epsilon {self.trainer.epsilon():.4g} at delta {plan.target_delta:g} "
                f"({plan.accountant}, per {plan.privacy_unit}); training stops"
            )
            # A default run shows WARNING and above only (transformers' verbosity too), and
            # this is the one line a user must see: printed then, as Trainer prints its
            # metrics; logged instead where INFO reaches a handler (no line twice).
            if log.isEnabledFor(logging.INFO):
                log.info(line)
            elif state.is_world_process_zero:
                print(line, flush=True)
        return control

    def _show_epsilon(self) -> None:
        """epsilon spent on Trainer's progress bar, at every step (an upper bound from the
        plan's curve, exact at its evaluated steps; dptrain.progress.EpsilonCurve)."""
        curve, private = self.trainer._epsilon_curve, self.trainer.privacy
        if curve is None or private is None:
            return
        steps = min(private.ledger.num_steps, curve.steps)
        for callback in self.trainer.callback_handler.callbacks:
            bar = getattr(callback, "training_bar", None)
            if isinstance(callback, ProgressCallback) and bar is not None:
                bar.set_postfix(eps=f"<={curve(steps):.2f}", refresh=False)


_NO_RESHARD = (
    "reshard_after_forward=False (fsdp='shard_grad_op') is not allowed with DPTrainer under "
    "FSDP: the layers would keep their gathered weights registered after "
    "the forward, which the clipping's check of state written by the forward refuses; use "
    "fsdp='full_shard' (reshard_after_forward=True)"
)


def _check_fsdp_plugin(
    source: str,
    version: Any,
    cpu_offload: bool,
    activation_checkpointing: bool,
    param_dtype: torch.dtype | None,
) -> None:
    """Refuse the settings of accelerate's FSDP plugin that DPTrainer cannot train privately.

    ``source`` names where they came from (``fsdp_config`` of TrainingArguments, or the
    environment ``accelerate launch`` sets), so that the message says what to change.
    """
    if version is not None and int(version) != 2:
        raise UnsupportedTrainingArgumentsError(
            f"{source}: fsdp_version={version!r} is not allowed with DPTrainer: FSDP1 "
            "(FullyShardedDataParallel) flattens parameters so that no module holds its own "
            "weight, and dptrain cannot clip it. Use FSDP2: fsdp_version 2 (fsdp_config="
            '{"fsdp_version": 2, ...}, or fsdp_version: 2 in the accelerate config)'
        )
    if cpu_offload:
        raise UnsupportedTrainingArgumentsError(
            f"{source}: cpu_offload / offload_params=True is not allowed with DPTrainer: "
            "dptrain does not support FSDP2's CPU offload (the clipped sums are reduced on the "
            "parameters' device); turn the offload off"
        )
    if activation_checkpointing:
        raise UnsupportedTrainingArgumentsError(
            f"{source}: activation_checkpointing=True is not allowed with DPTrainer: "
            "accelerate wraps the decoder layers in a checkpoint wrapper after DPTrainer has "
            "built its per-example clipping on them; leave it False"
        )
    if param_dtype is not None and param_dtype != torch.float32:
        raise UnsupportedTrainingArgumentsError(
            f"{source}: mixed precision (bf16=True, or mixed_precision: bf16 in the accelerate "
            "config) is not allowed with DPTrainer under FSDP: accelerate turns it into FSDP2's "
            f"MixedPrecisionPolicy(param_dtype={param_dtype}), which dptrain's clipping does "
            "not support. Load the model in bfloat16 (torch_dtype=torch.bfloat16) with "
            "bf16=False, which the clipping supports, or train in float32"
        )


def _check_fsdp_arguments(args: TrainingArguments) -> None:
    """TrainingArguments' ``fsdp=`` / ``fsdp_config=``, checked before accelerate is made."""
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    if not args.fsdp or plugin_args is None:
        return
    if plugin_args.get("reshard_after_forward", True) in (False, 0):
        raise UnsupportedTrainingArgumentsError(f"fsdp_config: {_NO_RESHARD}")
    mixed = "bf16" if args.bf16 else None  # (fp16 is refused on its own)
    _check_fsdp_plugin(
        "fsdp_config",
        plugin_args.get("fsdp_version"),
        bool(plugin_args.get("cpu_offload")),
        bool(plugin_args.get("activation_checkpointing")),
        torch.bfloat16 if mixed else None,
    )


def _check_accelerate_plugin(plugin: Any) -> None:
    """The FSDP plugin accelerate made (from fsdp_config, or from ``accelerate launch``'s
    environment: ACCELERATE_USE_FSDP, FSDP_VERSION, FSDP_OFFLOAD_PARAMS, ...)."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if getattr(plugin, "reshard_after_forward", True) is False:
        raise UnsupportedTrainingArgumentsError(f"accelerate's FSDP plugin: {_NO_RESHARD}")
    policy = getattr(plugin, "mixed_precision_policy", None)
    _check_fsdp_plugin(
        "accelerate's FSDP plugin",
        getattr(plugin, "fsdp_version", 1),
        isinstance(getattr(plugin, "cpu_offload", None), CPUOffloadPolicy),
        bool(getattr(plugin, "activation_checkpointing", False)),
        getattr(policy, "param_dtype", None),
    )


def _check_training_args(args: TrainingArguments) -> None:
    """Refuse TrainingArguments that would break the sampling or the private step."""
    if getattr(args, "group_by_length", False):
        raise SamplingConflictError(
            "group_by_length=True is not allowed: grouping records by length replaces the "
            "Poisson sampling the accountant assumes (each record in each batch independently)"
        )
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy != "random":
        raise SamplingConflictError(
            f"train_sampling_strategy={strategy!r} is not allowed: DPTrainer samples every "
            "logical batch by Poisson sampling (the accountant's assumption); leave it 'random'"
        )
    if args.dataloader_drop_last:
        raise SamplingConflictError(
            "dataloader_drop_last=True is not allowed: a Poisson batch has a random size and is "
            "never cut or dropped (dropping would change the sampling the accountant assumes)"
        )
    refused = {
        "fp16": (
            args.fp16,
            "its GradScaler unscales and may skip steps after the noise is added; "
            "use bf16 or float32",
        ),
        "auto_find_batch_size": (
            args.auto_find_batch_size,
            "it restarts the loop with another batch size, which changes the plan the noise "
            "was calibrated for",
        ),
        "label_smoothing_factor": (
            args.label_smoothing_factor != 0,
            "per-example losses are plain cross-entropy",
        ),
        "deepspeed": (bool(args.deepspeed), "DeepSpeed owns the backward and the optimizer step"),
    }
    for name, (bad, why) in refused.items():
        if bad:
            raise UnsupportedTrainingArgumentsError(
                f"{name}={getattr(args, name)!r} is not allowed with DPTrainer: {why}"
            )
    optim = str(getattr(args.optim, "value", args.optim))
    if "lomo" in optim or "layerwise" in optim:
        raise UnsupportedTrainingArgumentsError(
            f"optim={optim!r} is not allowed with DPTrainer: it updates parameters during the "
            "backward, before the gradients are clipped and noised"
        )
    if args.n_gpu > 1:
        raise UnsupportedTrainingArgumentsError(
            f"n_gpu={args.n_gpu} (torch DataParallel) is not allowed: launch one process per "
            "device with torchrun instead"
        )
    _check_fsdp_arguments(args)


#: The first transformers whose Trainer takes a model already sharded with fully_shard
#: ("distributed loading": no DDP wrapper, no move); 5.17 and 5.18 wrap it in DDP, whose
#: construction fails on DTensor parameters (seen on 5.17, GPU session 2026-11-27; 5.19 and
#: 5.24 pass tests/hf/test_fsdp.py).
SHARDED_MODELS_SINCE = "5.19"


def check_trainer_takes_sharded_models(version: str) -> None:
    """Refuse a transformers ``version`` whose Trainer cannot train a model the user
    sharded with FSDP2, naming what to do instead."""
    from packaging.version import Version

    if Version(version) < Version(SHARDED_MODELS_SINCE):
        raise UnsupportedModelError(
            f"the model is sharded with fully_shard, which DPTrainer supports with "
            f"transformers >= {SHARDED_MODELS_SINCE} (installed: {version}; its Trainer wraps "
            "an already-sharded model in DistributedDataParallel, which fails on its DTensor "
            "parameters): upgrade transformers, or pass the unsharded model and let "
            "accelerate shard it (TrainingArguments(fsdp=..., fsdp_config={'fsdp_version': 2}) or "
            "`accelerate launch` with an FSDP2 config)"
        )


def _check_sharded_model(model: nn.Module, args: TrainingArguments) -> bool:
    """Whether ``model`` is sharded with FSDP2; refuses what DPTrainer cannot do with it.

    FSDP1 (``FullyShardedDataParallel``) is refused with
    :func:`dptrain.distributed.fsdp.refuse_fsdp1`'s message, which points to FSDP2; what
    the engine cannot clip under sharding is refused when the probe builds it.
    """
    refuse_fsdp1(model)
    if not is_fsdp2(model):
        return False
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        # Without a root FSDP module each sharded layer acts as its own root and leaves
        # its gathered weights registered after the forward; the engine would refuse
        # them as "rebound in forward", which does not say what to do.
        raise UnsupportedModelError(
            f"the model ({type(model).__name__}) has FSDP2-sharded submodules but is not "
            "sharded itself: shard the root too, fully_shard(model) after "
            "fully_shard(layer) for each decoder layer (it also holds the embedding and "
            "the final norm)"
        )
    check_trainer_takes_sharded_models(transformers.__version__)
    local = next((p.to_local() for p in model.parameters() if hasattr(p, "to_local")), None)
    if local is not None and (
        local.device.type != args.device.type
        or (local.device.index is not None and args.device.index not in (None, local.device.index))
    ):
        # Trainer would move the sharded model to its device, which FSDP2 does not support
        raise UnsupportedTrainingArgumentsError(
            f"the model is sharded on {local.device}, but TrainingArguments train on "
            f"{args.device}: shard it on the training device (init_device_mesh("
            f"{args.device.type!r}, (world_size,)) and the model on {args.device}), or set "
            "use_cpu to match"
        )
    if args.load_best_model_at_end:
        # Trainer would load the best checkpoint's whole tensors into the sharded
        # parameters with load_state_dict, which FSDP2's DTensors do not take.
        raise UnsupportedTrainingArgumentsError(
            "load_best_model_at_end=True is not allowed with an FSDP2-sharded model: Trainer "
            "loads the best checkpoint's whole weights into the model, which does not fit "
            "sharded parameters; leave it False and load the chosen checkpoint's folder with "
            "from_pretrained (every checkpoint holds the gathered weights)"
        )
    return True


class DPTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with DP-SGD under ``privacy_args``.

    Args:
        model, args, data_collator, train_dataset, eval_dataset, processing_class, **kwargs:
            as for ``Trainer`` (``train_dataset`` is required: the plan needs its size).
        privacy_args: the guarantee (:class:`~dptrain.hf.PrivacyArguments`).
        per_example_loss_func: ``fn(outputs, labels, inputs) -> (B,)`` losses, for a model
            whose per-example loss :func:`~dptrain.hf.losses.per_example_hf_loss` cannot
            tell (the model is then called without labels, as always).

    Raises, before training (see :mod:`dptrain.hf.errors`):
        PrivacyArgumentsError, SamplingConflictError, UnsupportedTrainingArgumentsError,
        NoiseMultiplierTooLargeError, MissingLabelsError, and the engine's
        UnsupportedModelError for a model it cannot clip exactly.

    Attributes:
        privacy_plan: the :class:`~dptrain.hf.plan.PrivacyPlan` (q, steps, sigma, ...).
        privacy: the :class:`~dptrain.PrivateTraining` of the run (None before train()).
        user_args: the TrainingArguments as given (``args`` is the copy Trainer runs with).
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: TrainingArguments | None = None,
        data_collator: Any = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        *,
        privacy_args: PrivacyArguments | None = None,
        per_example_loss_func: PerExampleLossFunc | None = None,
        **kwargs: Any,
    ):
        if not isinstance(privacy_args, PrivacyArguments):
            raise PrivacyArgumentsError(
                f"privacy_args={privacy_args!r} is not allowed: expected PrivacyArguments(...) "
                "(target_epsilon or noise_multiplier, target_delta, max_grad_norm, ...)"
            )
        for name, why in (
            ("model_init", "pass model=; a model re-created by train() is not the one checked"),
            (
                "compute_loss_func",
                "it returns one loss for the batch; pass per_example_loss_func= instead",
            ),
        ):
            if kwargs.get(name) is not None:
                raise UnsupportedTrainingArgumentsError(
                    f"{name}= is not allowed with DPTrainer: {why}"
                )
        if args is None:
            args = TrainingArguments(output_dir="tmp_trainer")
        _check_training_args(args)
        sharded = _check_sharded_model(model, args) if model is not None else False
        self._check_no_custom_sampler()
        num_records = check_map_style(train_dataset)
        unit_ids = None
        num_units = num_records
        if privacy_args.group_by is not None:
            unit_ids = column_values(train_dataset, privacy_args.group_by)
            num_units = len(group_records(unit_ids, num_records, f"column {privacy_args.group_by}"))
        world_size = args.world_size
        plan = make_plan(
            privacy_args,
            num_units=num_units,
            num_records=num_records,
            per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps,
            world_size=world_size,
            max_steps=args.max_steps,
            num_train_epochs=args.num_train_epochs,
        )
        # Set before Trainer.__init__, which may call overridden methods.
        self.privacy_args = privacy_args
        self.privacy_plan: PrivacyPlan = plan
        self.per_example_loss_func = per_example_loss_func
        self.user_args = args
        self.privacy: PrivateTraining | None = None
        self._unit_ids = unit_ids
        self._sharded = sharded
        self._resume_dir: str | None = None
        self._resumed_steps: int | None = None
        self._epsilon_cache: tuple[int, float] | None = None
        self._epsilon_curve: EpsilonCurve | None = None
        super().__init__(
            model=model,
            args=self._internal_args(args, plan),
            data_collator=data_collator,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        if self.is_fsdp_enabled:
            # accelerate's FSDP plugin, from fsdp= / fsdp_config= or `accelerate launch`
            _check_accelerate_plugin(self.accelerator.state.fsdp_plugin)
            if not sharded:
                sharded = self._shard_with_accelerate()
                self._sharded = sharded
        elif args.fsdp:
            log.warning(
                "TrainingArguments.fsdp / fsdp_config are not applied: accelerate enables its "
                "FSDP plugin only on several accelerators (distributed type here: %s); the "
                "model trains unsharded, with the same guarantee",
                self.accelerator.state.distributed_type,
            )
        if sharded and not self.is_fsdp_enabled:
            # A model already sharded with fully_shard is what Trainer calls "sharded at
            # load time": it then neither wraps it in DDP (whose construction would
            # broadcast rank 0's shards over the others') nor moves it, and gathers the
            # shards to save it.
            self.is_distributed_loading_by_transformers = True
        self._user_optimizer = self.optimizer
        if self.optimizer is not None:
            self._check_given_optimizer(self.optimizer)
        self._task = task_of(self.model)
        self._label_keys = self._check_labels(train_dataset)
        self._probe_engine(train_dataset)
        self.add_callback(_PrivacyCallback(self))

    # -- set-up -----------------------------------------------------------------------------

    @staticmethod
    def _internal_args(args: TrainingArguments, plan: PrivacyPlan) -> TrainingArguments:
        """The copy of ``args`` Trainer runs with (see the module docstring)."""
        if args.max_grad_norm and args.max_grad_norm > 0:
            log.info(
                "TrainingArguments.max_grad_norm=%g is not applied: DPTrainer clips each %s's "
                "gradient to PrivacyArguments.max_grad_norm=%g instead (clipping the noised sum "
                "again would rescale the noise)",
                args.max_grad_norm,
                plan.privacy_unit,
                plan.max_grad_norm,
            )
        for name, value, why in (
            (
                "dataloader_num_workers",
                args.dataloader_num_workers,
                "batches are collated in the training process",
            ),
            (
                "data_seed",
                args.data_seed,
                "the Poisson sampling is seeded by PrivacyArguments.seed",
            ),
        ):
            if value:
                log.info("TrainingArguments.%s=%r is not used: %s", name, value, why)
        internal = copy.copy(args)
        internal.gradient_accumulation_steps = 1
        internal.max_grad_norm = 0.0
        internal.max_steps = plan.steps
        internal.ignore_data_skip = True
        return internal

    def _shard_with_accelerate(self) -> bool:
        """Shard the model now, as accelerate's FSDP2 plugin would in ``train()``.

        Trainer hands the model to accelerate (``accelerator.prepare(model, optimizer)``)
        after ``create_optimizer``, where DPTrainer builds the per-example clipping and the
        sharded private optimizer: both must see the sharded parameters. So the model is
        sharded here with accelerate's own function (the same per-layer groups, tail group
        and root as prepare makes); prepare later finds an FSDP2 module and leaves it as
        it is, and maps the optimizer's parameters onto themselves. Sharding here also lets
        the model go through every check of a model the user sharded, and the probe, before
        any step.
        """
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model
        from torch.distributed.fsdp import FSDPModule

        self.model = fsdp2_prepare_model(self.accelerator, self.model)
        self.model_wrapped = self.model
        for module in self.model.modules():
            if module is not self.model and isinstance(module, FSDPModule):
                # accelerate keeps its tail unit (final norm, embedding, head) gathered
                # after the forward; the engine's check of state the forward wrote would
                # see those weights rebound. Resharded like the decoder layers (one more
                # all-gather of the tail in the backward), they are back in place after it.
                module.set_reshard_after_forward(True, recurse=False)
        return _check_sharded_model(self.model, self.user_args)

    def _check_no_custom_sampler(self) -> None:
        cls = type(self)
        for name in ("get_train_dataloader", "_get_train_sampler"):
            mine = getattr(DPTrainer, name, None)
            if mine is not None and getattr(cls, name, mine) is not mine:
                raise SamplingConflictError(
                    f"{cls.__name__}.{name} is overridden: a custom training sampler or "
                    "dataloader would replace the Poisson sampling the accountant assumes"
                )

    def _check_given_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizers=(opt, ...)``: a plain optimizer of exactly the trainable parameters."""
        if isinstance(optimizer, DPOptimizer):
            raise UnsupportedTrainingArgumentsError(
                "optimizers=(DPOptimizer, ...) is not allowed: DPTrainer makes the optimizer "
                "private itself; pass the plain optimizer (a second wrapper would add the "
                "noise twice)"
            )
        try:
            check_optimizer_matches(self.model, optimizer)
        except ValueError as exc:
            raise UnsupportedTrainingArgumentsError(f"optimizers=: {exc}") from None

    def _training_collator(self) -> Any:
        collate = self._get_collator_with_removed_columns(
            self.data_collator, description="training"
        )
        if self.privacy_args.group_by is not None:
            collate = DropColumns(collate, [self.privacy_args.group_by])
        return collate

    def _check_labels(self, dataset: Any) -> list[str]:
        """The label keys of the collated batches (refused when absent)."""
        names = list(self.label_names or ["labels"])
        if len(names) != 1 and self.per_example_loss_func is None:
            raise MissingLabelsError(
                f"the model takes several label tensors {names}: pass per_example_loss_func= "
                "(the default per-example losses need one)"
            )
        batch = self._training_collator()([dataset[0]])
        missing = [k for k in names if not isinstance(batch, Mapping) or k not in batch]
        if missing:
            keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
            raise MissingLabelsError(
                f"the training batches have no {', '.join(map(repr, missing))} (collated keys: "
                f"{keys}, collator {type(self.data_collator).__name__}): per-example losses "
                "need labels. Add a 'labels' (or 'label') column, or a collator that makes them "
                "(for a causal LM: DataCollatorForLanguageModeling(tokenizer, mlm=False))"
            )
        return names

    def _probe_engine(self, dataset: Any) -> None:
        """The engine's refusals now, with its own message, rather than inside train().

        Some are found when the engine is built (a parameter no rule covers), others only
        on a forward (BatchNorm in training mode, state written by the forward) or a
        backward (a parameter used outside its module, reentrant checkpointing): one
        record goes through a clipped backward whose result is
        discarded (nothing is released, no step is taken). The random state, the model's
        mode and its gradients are left as they were.
        """
        plan = self.privacy_plan
        engine = ClippingEngine(
            self.model,
            plan.max_grad_norm,
            clipping=plan.clipping,
            mode=plan.mode,
            sum_rounding=self.privacy_args.sum_rounding,
        )
        if self._sharded:
            # as training will clip it (a collective: every rank probes the same record)
            engine.shard(FSDPSharding(self.model, engine.module_rules), ShardedGradStore())
        was_training = self.model.training
        device = self.args.device
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                self.model.train()
                chunk = self._prepare_inputs(self._training_collator()([dataset[0]]))
                engine.backward(self.compute_per_example_loss(self.model, chunk))
        finally:
            engine.detach()
            self.model.train(was_training)
            for p in self.model.parameters():
                p.grad = None

    # -- the private state ------------------------------------------------------------------

    def get_train_dataloader(self) -> PoissonTrainLoader:  # type: ignore[override]
        """One :class:`~dptrain.hf.data.PoissonStep` per optimizer update (module docstring)."""
        return PoissonTrainLoader(
            self.train_dataset,
            self.privacy_plan.steps_per_epoch,
            source=lambda: self.privacy,
            before_first=self._check_resumed_state,
            budget_spent=self.budget_spent,
        )

    def get_total_train_batch_size(self, args: TrainingArguments) -> int:
        """The expected logical batch B (Trainer's logs and throughput figures)."""
        return self.privacy_plan.expected_batch_size

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """Trainer's optimizer (``args.optim`` or ``optimizers=``), made private."""
        if self.privacy is not None:
            return self.optimizer
        base = super().create_optimizer(model)
        self.privacy = self._make_private(base)
        self.optimizer = _UpdateDoneInTrainingStep(self.privacy.optimizer)
        return self.optimizer

    def _make_private(self, optimizer: torch.optim.Optimizer) -> PrivateTraining:
        plan = self.privacy_plan
        common: dict[str, Any] = {
            "batch_size": plan.expected_batch_size,
            "max_grad_norm": plan.max_grad_norm,
            "steps": plan.steps,
            "noise_multiplier": plan.noise_multiplier,
            "target_delta": plan.target_delta,
            "clipping": plan.clipping,
            "mode": plan.mode,
            "sum_rounding": self.privacy_args.sum_rounding,
            "accountant": plan.accountant,
            "max_physical_batch_size": plan.physical_batch_size,
            "collate_fn": self._training_collator(),
            "seed": self.privacy_args.seed,
            "privacy_unit": plan.privacy_unit,
        }
        if plan.world_size > 1:
            if self.privacy_args.secure_mode and not self._sharded:
                # replicas: rank 0 draws the noise and every rank the same batches from one
                # shared seed, which is what secure mode does away with
                raise PrivacyArgumentsError(
                    f"secure_mode=True is not allowed with {plan.world_size} processes on an "
                    "unsharded (DDP) model: the ranks agree on each batch and noise through "
                    "a shared seed; train in one process, or shard the model with FSDP2 "
                    "(fully_shard), whose ranks draw secure noise for their own shards"
                )
            private = make_private_distributed(
                self.model,
                optimizer,
                self.train_dataset,
                user_ids=self._unit_ids,
                secure_mode=self.privacy_args.secure_mode,
                **common,
            )
        else:
            private = make_private(
                self.model,
                optimizer,
                self.train_dataset,
                user_ids=self._unit_ids,
                secure_mode=self.privacy_args.secure_mode,
                **common,
            )
        if plan.target_epsilon is not None:
            # The calibrated noise meets the target for exactly the planned steps.
            private.optimizer.max_steps = plan.steps
        if self._resume_dir is not None:
            self._resumed_steps = restore_sampler(self._resume_dir, plan, private)
        self._epsilon_curve = EpsilonCurve(
            [(plan.sample_rate, plan.noise_multiplier, plan.steps)],
            plan.target_delta,
            plan.accountant,
        )
        if self.is_world_process_zero():
            # Before the first step, where a user sees it (an INFO log is hidden by default).
            print(
                plan_text(
                    units=plan.num_units,
                    unit=plan.privacy_unit,
                    sample_rate=plan.sample_rate,
                    expected_batch=plan.expected_batch_size,
                    steps=plan.steps,
                    noise_multiplier=plan.noise_multiplier,
                    max_grad_norm=plan.max_grad_norm,
                    clipping=plan.clipping,
                    delta=plan.target_delta,
                    delta_rule=None,
                    accountant=plan.accountant,
                    target_epsilon=plan.target_epsilon,
                ),
                file=sys.stderr,
                flush=True,
            )
        log.info(
            "DP training: %d steps, Poisson rate q=%.4g (expected batch %d of %d %ss, chunks of "
            "%d records), noise multiplier %.4g, clipping norm %g, %d process(es)",
            plan.steps,
            plan.sample_rate,
            plan.expected_batch_size,
            plan.num_units,
            plan.privacy_unit,
            plan.physical_batch_size,
            plan.noise_multiplier,
            plan.max_grad_norm,
            plan.world_size,
        )
        return private

    def budget_spent(self) -> bool:
        """True once the target epsilon allows no further step."""
        if self.privacy is None:
            return False
        opt = self.privacy.optimizer
        return opt.max_steps is not None and opt.steps_taken >= opt.max_steps

    def epsilon(self, delta: float | None = None, accountant: str | None = None) -> float:
        """epsilon spent so far, at ``delta`` (default: the target delta)."""
        if self.privacy is None or self.privacy.ledger.num_steps == 0:
            return 0.0
        if delta is not None or accountant is not None:
            return self.privacy.epsilon(delta, accountant)
        steps = self.privacy.ledger.num_steps
        if self._epsilon_cache is None or self._epsilon_cache[0] != steps:
            self._epsilon_cache = (steps, self.privacy.epsilon())
        return self._epsilon_cache[1]

    def privacy_report(self) -> dict[str, Any]:
        """The guarantee so far, the plan and the ledger (what ``privacy.json`` holds)."""
        if self.privacy is None:
            raise DPTrainerError("no privacy report before train(): no step was taken")
        return privacy_report(
            self.privacy_plan,
            self.privacy.ledger,
            steps_taken=self.privacy.optimizer.steps_taken,
            seeded=self.privacy_args.seed is not None,
            base_model=base_model_of(self.model),
        )

    # -- one optimizer update ---------------------------------------------------------------

    def compute_per_example_loss(self, model: nn.Module, inputs: Mapping[str, Any]) -> Tensor:
        """L_i of one chunk, (B,): the model runs without labels; see :mod:`dptrain.hf.losses`.

        ``per_example_loss_func`` gets the labels (a dict of them when the model takes
        several, e.g. question answering's start and end positions) and the model's inputs.
        """
        inputs = dict(inputs)
        popped = {k: inputs.pop(k) for k in self._label_keys}
        labels = popped[self._label_keys[0]] if len(popped) == 1 else popped
        if self._task == "seq2seq" and "decoder_input_ids" not in inputs:
            inputs["decoder_input_ids"] = seq2seq_decoder_inputs(model, labels)
        outputs = model(**inputs)
        if self.per_example_loss_func is not None:
            return self.per_example_loss_func(outputs, labels, inputs)
        return per_example_hf_loss(
            model, outputs, labels, inputs, reduction=self.privacy_args.loss_reduction
        )

    def training_step(  # type: ignore[override]
        self,
        model: nn.Module,
        inputs: Any,
        num_items_in_batch: Any = None,
    ) -> Tensor:
        """Clip every chunk of the logical batch, then noise once and step (module docstring).

        Returns the mean per-record loss of the batch (0 for an empty batch), for logs.
        """
        if not isinstance(inputs, PoissonStep):
            raise TypeError(
                f"DPTrainer.training_step got {type(inputs).__name__}: expected a PoissonStep "
                "from DPTrainer's own training loader"
            )
        private = self.privacy
        assert private is not None
        # The engine's hooks sit on the model itself; a DistributedDataParallel wrapper
        # (accelerate's, under torchrun) is bypassed, so its hooks never all-reduce
        # unclipped gradients (DDP only reduces after a forward through the wrapper).
        net = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        net.train()
        private.optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float32, device=self.args.device)
        # rows of padding at the end of each chunk (a sharded model: every rank runs the
        # same chunks); the engine gives them weight 0, and the logged loss leaves them out
        padding = getattr(inputs.batch, "padding", None) or [0] * len(inputs.batch.chunks)
        for chunk, pad in zip(inputs.batch.chunks, padding, strict=True):
            chunk = self._prepare_inputs(chunk)
            with self.compute_loss_context_manager():
                losses = self.compute_per_example_loss(net, chunk)
            private.backward(losses)
            total += losses.detach()[: losses.shape[0] - pad].float().sum()
        private.optimizer.step()
        return total / max(inputs.batch.size, 1)

    def floating_point_ops(self, inputs: Any) -> int:
        """Trainer's FLOP estimate, summed over the chunks of a logical batch."""
        if not isinstance(inputs, PoissonStep):
            return super().floating_point_ops(inputs)
        total = 0
        for chunk in inputs.batch.chunks:
            total += int(super().floating_point_ops(chunk))
        return total

    # -- train, log, save, resume -----------------------------------------------------------

    def train(  # type: ignore[override]
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        **kwargs: Any,
    ):
        """Trainer's ``train``, privately; ends cleanly when the planned steps (the budget)
        are spent. A second call needs ``resume_from_checkpoint`` (the ledger continues
        from the checkpoint)."""
        if trial is not None:
            raise UnsupportedTrainingArgumentsError(
                "trial= (hyperparameter search) is not allowed with DPTrainer: every trial "
                "spends privacy on the same data; see dptrain search-cost"
            )
        if resume_from_checkpoint is False:
            resume_from_checkpoint = None
        if resume_from_checkpoint is True:
            resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
            if resume_from_checkpoint is None:
                raise PrivacyCheckpointError(
                    f"resume_from_checkpoint=True: no checkpoint in {self.args.output_dir!r}"
                )
        if resume_from_checkpoint is not None:
            check_resumable(str(resume_from_checkpoint), self._sharded)
        if self.privacy is not None:
            if resume_from_checkpoint is None:
                raise DPTrainerError(
                    f"train() was already called: this run's ledger holds "
                    f"{self.privacy.ledger.num_steps} steps. Pass resume_from_checkpoint= to "
                    "continue from a checkpoint (its ledger continues), or build a new DPTrainer"
                )
            self._drop_private_state()
        self._resume_dir = resume_from_checkpoint
        try:
            return super().train(
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        finally:
            if self.privacy is not None:
                # The model is a plain model again (generate, evaluation, save_pretrained).
                self.privacy.engine.detach()
                plan = self.privacy_plan
                log.info(
                    "DP training ended after %d of %d steps: epsilon %.4g at delta %g (%s, per %s)",
                    self.privacy.optimizer.steps_taken,
                    plan.steps,
                    self.epsilon(),
                    plan.target_delta,
                    plan.accountant,
                    plan.privacy_unit,
                )

    def _drop_private_state(self) -> None:
        assert self.privacy is not None
        self.privacy.engine.detach()
        self.privacy = None
        self.optimizer = self._user_optimizer
        self._epsilon_cache = None
        self._resumed_steps = None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Trainer's ``log`` with ``epsilon`` (and the steps it is for) in every record."""
        if self.privacy is not None:
            logs = {**logs, "epsilon": self.epsilon(), "dp_steps": self.privacy.ledger.num_steps}
        if start_time is None:
            super().log(logs)
        else:
            super().log(logs, start_time)

    def _save_checkpoint(self, model: nn.Module, trial: Any, *args: Any, **kwargs: Any) -> None:
        # (*args: transformers 4.x also passes the evaluation metrics.)
        super()._save_checkpoint(model, trial, *args, **kwargs)
        if self.privacy is None or not self.args.should_save:
            return
        # The folder Trainer just wrote (named as Trainer._save_checkpoint names it).
        folder = os.path.join(
            self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        save_state(folder, self.privacy_plan, self.privacy)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Trainer's ``optimizer.pt`` and ``scheduler.pt``; a sharded run writes
        ``dptrain_shards/`` instead of ``optimizer.pt`` (every rank its shards, module
        docstring), since ``torch.save`` on the writing rank would keep its shards only."""
        if not self._sharded:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        assert self.privacy is not None
        save_shards(output_dir, self.privacy)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Trainer's loading; a sharded run restores its weights, optimizer state and DP state
        from the checkpoint's ``dptrain_shards/`` (every rank its shards) instead."""
        if not self._sharded or checkpoint is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        assert self.privacy is not None
        load_shards(checkpoint, self.privacy)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_from_checkpoint(
        self, resume_from_checkpoint: str, model: nn.Module | None = None
    ) -> None:
        """Trainer's loading of the weights; a sharded model's come from ``dptrain_shards/``
        with the optimizer's (:meth:`_load_optimizer_and_scheduler`), each rank reading its
        shards: Trainer would load whole tensors into the sharded parameters."""
        if not self._sharded:
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _check_resumed_state(self) -> None:
        """Before the first batch: the ledger, the optimizer and the sampler agree."""
        assert self.privacy is not None
        check_in_step(self.privacy, self._resumed_steps)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer's ``save_model``, plus ``privacy.json`` and the model card's privacy section.

        Under accelerate's FSDP plugin the weights are gathered as for a model the user
        sharded (:meth:`_save`): Trainer's FSDP branch writes no weights at all for
        ``state_dict_type`` SHARDED_STATE_DICT (accelerate launch's default), and a
        checkpoint's shards are in its ``dptrain_shards/`` anyway.
        """
        if self._sharded and self.is_fsdp_enabled:
            self._save(output_dir or self.args.output_dir)
            if self.args.push_to_hub and not _internal_call:
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        else:
            super().save_model(output_dir, _internal_call)
        if self.privacy is not None and self.args.should_save:
            write_privacy_report(output_dir or self.args.output_dir, self.privacy_report())

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """Trainer's ``_save``; a sharded model's weights are gathered first (every rank
        takes part, the writing rank gets the whole tensors, on the CPU)."""
        if self._sharded and state_dict is None:
            from torch.distributed.checkpoint.state_dict import (
                StateDictOptions,
                get_model_state_dict,
            )

            state_dict = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            if not self.args.should_save:
                return  # (only here for the gather)
        super()._save(output_dir, state_dict=state_dict)

    def create_model_card(self, *args: Any, **kwargs: Any) -> None:
        """Trainer's model card, with the privacy section (Trainer rewrites README.md)."""
        super().create_model_card(*args, **kwargs)
        if self.privacy is not None and self.is_world_process_zero():
            write_privacy_report(self.args.output_dir, self.privacy_report())
