"""Hugging Face integration: ``DPTrainer`` (a private ``transformers.Trainer``) and
``PrivacyArguments``.

    from dptrain.hf import DPTrainer, PrivacyArguments

    trainer = DPTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                        privacy_args=PrivacyArguments(target_epsilon=8, target_delta=1e-5,
                                                      max_grad_norm=1.0))
    trainer.train()
    trainer.save_model()      # + privacy.json and a model-card section

Needs ``transformers`` (``pip install 'dptrain[hf]'``). See docs/hf.md.

Modules: :mod:`~dptrain.hf.arguments` (PrivacyArguments), :mod:`~dptrain.hf.plan`
(sample rate, steps and noise before training), :mod:`~dptrain.hf.data` (the Poisson
batches Trainer's loop carries), :mod:`~dptrain.hf.losses` (per-example losses from
logits), :mod:`~dptrain.hf.trainer` (DPTrainer), :mod:`~dptrain.hf.report`
(privacy.json and the model card), :mod:`~dptrain.hf.errors`.
"""

from dptrain.hf.arguments import PrivacyArguments
from dptrain.hf.errors import (
    DPTrainerError,
    MissingLabelsError,
    NoiseMultiplierTooLargeError,
    PrivacyArgumentsError,
    PrivacyCheckpointError,
    SamplingConflictError,
    UnsupportedTrainingArgumentsError,
)
from dptrain.hf.losses import per_example_hf_loss
from dptrain.hf.plan import PrivacyPlan
from dptrain.hf.trainer import DPTrainer

__all__ = [
    "DPTrainer",
    "DPTrainerError",
    "MissingLabelsError",
    "NoiseMultiplierTooLargeError",
    "PrivacyArguments",
    "PrivacyArgumentsError",
    "PrivacyCheckpointError",
    "PrivacyPlan",
    "SamplingConflictError",
    "UnsupportedTrainingArgumentsError",
    "per_example_hf_loss",
]
