"""Every refused configuration is a named error raised by DPTrainer(...) or
PrivacyArguments(...), before any step."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from dptrain import UnsupportedModelError
from dptrain.hf import (
    DPTrainer,
    MissingLabelsError,
    NoiseMultiplierTooLargeError,
    PrivacyArguments,
    PrivacyArgumentsError,
    SamplingConflictError,
    UnsupportedTrainingArgumentsError,
)
from tests.clipping import hf_zoo
from tests.hf import tiny

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

NOISE = {"noise_multiplier": 1.0, "target_delta": 1e-5}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_delta": 1e-5}, "give exactly one"),
        ({"target_epsilon": 3.0, "noise_multiplier": 1.0, "target_delta": 1e-5}, "exactly one"),
        ({"target_epsilon": 3.0}, "target_delta=None"),
        ({"target_epsilon": -1.0, "target_delta": 1e-5}, "target_epsilon=-1.0"),
        ({**NOISE, "target_delta": 1.5}, "target_delta=1.5"),
        ({**NOISE, "max_grad_norm": 0.0}, "max_grad_norm=0.0"),
        ({**NOISE, "clipping": "hard"}, "clipping='hard'"),
        ({**NOISE, "mode": "opacus"}, "mode='opacus'"),
        ({**NOISE, "sum_rounding": "fast"}, "sum_rounding='fast'"),
        ({**NOISE, "accountant": "moments"}, "accountant='moments'"),
        ({**NOISE, "clipping": "per_layer", "mode": "ghost"}, "per_layer"),
        ({**NOISE, "group_by": "user_id", "privacy_unit": "example"}, "privacy_unit='example'"),
        ({**NOISE, "seed": -1}, "seed=-1"),
    ],
)
def test_privacy_arguments_refused(kwargs, match):
    with pytest.raises(PrivacyArgumentsError, match=match):
        PrivacyArguments(**kwargs)


def test_privacy_arguments_from_the_command_line():
    from transformers import HfArgumentParser

    argv = ["--target_epsilon", "3", "--target_delta", "1e-5", "--group_by", "user_id"]
    parsed, rest = HfArgumentParser(PrivacyArguments).parse_args_into_dataclasses(
        [*argv, "--output_dir", "out"], return_remaining_strings=True
    )
    assert parsed == PrivacyArguments(target_epsilon=3.0, target_delta=1e-5, group_by="user_id")
    assert rest == ["--output_dir", "out"] and parsed.unit == "user"


def _build(tmp_path, *, model=None, records=None, privacy=None, **overrides):
    return DPTrainer(
        model=model if model is not None else tiny.llama(),
        args=tiny.training_args(str(tmp_path), **overrides),
        train_dataset=records if records is not None else tiny.lm_records(40),
        privacy_args=privacy if privacy is not None else PrivacyArguments(**NOISE),
    )


def test_privacy_args_required(tmp_path):
    with pytest.raises(PrivacyArgumentsError, match="privacy_args=None"):
        DPTrainer(model=tiny.llama(), args=tiny.training_args(str(tmp_path)), train_dataset=[])


def test_dataset_without_labels(tmp_path):
    records = [{k: v for k, v in r.items() if k != "labels"} for r in tiny.lm_records(40)]
    with pytest.raises(MissingLabelsError, match=r"no 'labels'.*DataCollatorForLanguageModeling"):
        _build(tmp_path, records=records)


def test_model_the_engine_refuses_has_the_engines_message(tmp_path):
    """DeBERTa-v2's relative-position table is read outside its module: the engine finds it
    on a backward; DPTrainer's construction runs one (discarded) so it is refused here."""
    model = hf_zoo.deberta_v2().model
    with pytest.raises(UnsupportedModelError, match="rel_embeddings"):
        _build(tmp_path, model=model, records=tiny.classification_records(8))
    assert all(p.grad is None for p in model.parameters())


def test_model_with_batchnorm_refused(tmp_path):
    class WithBatchNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(tiny.VOCAB, 8)
            self.norm = torch.nn.BatchNorm1d(8)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, input_ids, attention_mask=None, labels=None):
            return {"logits": self.head(self.norm(self.embed(input_ids).mean(1)))}

    with pytest.raises(UnsupportedModelError, match="BatchNorm"):
        _build(tmp_path, model=WithBatchNorm(), records=tiny.classification_records(8))


def test_noise_above_the_bound_is_refused_naming_it(tmp_path):
    privacy = PrivacyArguments(target_epsilon=0.01, target_delta=1e-5)
    with pytest.raises(NoiseMultiplierTooLargeError, match="max_noise_multiplier=100"):
        _build(tmp_path, privacy=privacy, max_steps=200)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"train_sampling_strategy": "group_by_length"}, "group_by_length"),
        ({"train_sampling_strategy": "sequential"}, "sequential"),
        ({"dataloader_drop_last": True}, "dataloader_drop_last"),
    ],
)
def test_dataloader_options_that_break_poisson_sampling(tmp_path, overrides, match):
    with pytest.raises(SamplingConflictError, match=match):
        _build(tmp_path, **overrides)


def test_custom_sampler_refused(tmp_path):
    class MySampler(DPTrainer):
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    with pytest.raises(SamplingConflictError, match="_get_train_sampler is overridden"):
        MySampler(
            model=tiny.llama(),
            args=tiny.training_args(str(tmp_path)),
            train_dataset=tiny.lm_records(40),
            privacy_args=PrivacyArguments(**NOISE),
        )


def test_iterable_dataset_refused(tmp_path):
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(tiny.lm_records(40))

    with pytest.raises(SamplingConflictError, match="map-style"):
        _build(tmp_path, records=Stream())


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
        ({"auto_find_batch_size": True}, "auto_find_batch_size"),
        ({"per_device_train_batch_size": 32}, "larger than the 40 examples"),
    ],
)
def test_training_arguments_refused(tmp_path, overrides, match):
    with pytest.raises(UnsupportedTrainingArgumentsError, match=match):
        _build(tmp_path, **overrides)


def test_mean_loss_function_refused(tmp_path):
    with pytest.raises(UnsupportedTrainingArgumentsError, match="per_example_loss_func"):
        DPTrainer(
            model=tiny.llama(),
            args=tiny.training_args(str(tmp_path)),
            train_dataset=tiny.lm_records(40),
            privacy_args=PrivacyArguments(**NOISE),
            compute_loss_func=lambda outputs, labels, num_items_in_batch=None: outputs.logits.sum(),
        )


def test_group_by_column_missing(tmp_path):
    privacy = PrivacyArguments(**NOISE, group_by="user_id")
    with pytest.raises(PrivacyArgumentsError, match="group_by='user_id'"):
        _build(tmp_path, privacy=privacy)


def test_given_optimizer_must_be_plain_and_match_the_model(tmp_path):
    model = tiny.llama()
    partial = torch.optim.SGD(list(model.parameters())[:2], lr=0.1)
    with pytest.raises(UnsupportedTrainingArgumentsError, match="does not update"):
        DPTrainer(
            model=model,
            args=tiny.training_args(str(tmp_path)),
            train_dataset=tiny.lm_records(40),
            privacy_args=PrivacyArguments(**NOISE),
            optimizers=(partial, None),
        )
