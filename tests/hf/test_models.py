"""DPTrainer with peft LoRA, a sequence classifier and datasets.Dataset input; the trained
model stays a plain Hugging Face model (generate, save_pretrained / from_pretrained)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from dptrain.hf import DPTrainer, PrivacyArguments
from dptrain.hf.report import MODEL_CARD_START, PRIVACY_FILE
from tests.hf import tiny

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

NOISE = {"noise_multiplier": 1.0, "target_delta": 1e-5, "seed": 1}


def test_plain_model_saved_with_report_loads_and_generates(tmp_path):
    from transformers import LlamaForCausalLM

    tiny.quiet_transformers()
    model = tiny.llama()
    calls: list[set[str]] = []
    model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(set(kwargs)), with_kwargs=True
    )
    trainer = DPTrainer(
        model=model,
        args=tiny.training_args(str(tmp_path), max_steps=2, eval_strategy="steps", eval_steps=1),
        train_dataset=tiny.lm_records(40),
        eval_dataset=tiny.lm_records(8, seed=1),
        privacy_args=PrivacyArguments(**NOISE),
    )
    trainer.train()
    # Training never gave the model its labels: no internal (batch-mean) loss was computed;
    # evaluation (with the engine's hooks on the model) is Trainer's own, with labels.
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    assert len(evals) == 2 and evals[-1]["dp_steps"] == 2
    assert len([c for c in calls if "labels" in c]) == 2  # one eval batch per evaluation
    assert len([c for c in calls if "labels" not in c]) >= 2
    trainer.save_model()
    report = json.loads((tmp_path / PRIVACY_FILE).read_text())
    assert report["guarantee"]["epsilon"] == pytest.approx(trainer.epsilon())
    assert report["guarantee"]["privacy_unit"] == "example"
    assert report["training"]["steps_taken"] == 2
    assert report["training"]["seed"] == "given (PrivacyArguments.seed)"
    assert "not_covered" in report["guarantee"]
    card = (tmp_path / "README.md").read_text()
    assert MODEL_CARD_START in card and "## Differential privacy" in card
    trainer.save_model()  # saving again replaces the section, not appends a second one
    assert (tmp_path / "README.md").read_text().count(MODEL_CARD_START) == 1

    loaded = LlamaForCausalLM.from_pretrained(tmp_path)
    for (name, p), (_, q) in zip(
        trainer.model.named_parameters(), loaded.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=name)
    assert not trainer.model._forward_hooks  # the engine's hooks are gone after train()
    prompt = torch.tensor([[1, 5, 6]])
    out = trainer.model.generate(prompt, max_new_tokens=3, do_sample=False)
    assert torch.equal(out, loaded.generate(prompt, max_new_tokens=3, do_sample=False))


def test_peft_lora_trains_only_adapters_and_reloads(tmp_path):
    peft = pytest.importorskip("peft")
    tiny.quiet_transformers()
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(tiny.llama(), config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPTrainer(
        model=model,
        args=tiny.training_args(str(tmp_path), max_steps=2),
        train_dataset=tiny.lm_records(40),
        privacy_args=PrivacyArguments(**NOISE),
    )
    trainer.train()
    assert trainer.privacy.ledger.num_steps == 2
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == p.requires_grad, name  # LoRA weights moved, the base did not
    trainer.save_model()
    assert (tmp_path / "adapter_model.safetensors").is_file()
    card = (tmp_path / "README.md").read_text()
    assert MODEL_CARD_START in card and "library_name: peft" in card
    reloaded = peft.PeftModel.from_pretrained(tiny.llama(), tmp_path)
    prompt = torch.tensor([[1, 5, 6]])
    with torch.no_grad():
        torch.testing.assert_close(
            reloaded(prompt).logits, trainer.model(prompt).logits, rtol=1e-6, atol=1e-6
        )
    assert trainer.model.generate(input_ids=prompt, max_new_tokens=2).shape == (1, 5)


def test_sequence_classifier_on_a_datasets_dataset(tmp_path):
    """A datasets.Dataset (python lists, a 'label' column) trains as is; the default
    per-example loss of a classifier is cross-entropy: a per_example_loss_func computing
    it by hand takes exactly the same steps."""
    datasets = pytest.importorskip("datasets")
    tiny.quiet_transformers()
    records = tiny.classification_records(40)
    ds = datasets.Dataset.from_list(
        [{"input_ids": r["input_ids"].tolist(), "label": r["label"]} for r in records]
    )

    def run(**kwargs) -> DPTrainer:
        trainer = DPTrainer(
            model=tiny.gpt2_classifier(),
            args=tiny.training_args(str(tmp_path), max_steps=3),
            train_dataset=ds,
            privacy_args=PrivacyArguments(**NOISE),
            **kwargs,
        )
        trainer.train()
        return trainer

    default = run()
    assert default.privacy.ledger.num_steps == 3 and default.state.global_step == 3
    by_hand = run(
        per_example_loss_func=lambda outputs, labels, inputs: F.cross_entropy(
            outputs.logits, labels, reduction="none"
        )
    )
    for (name, p), (_, q) in zip(
        default.model.named_parameters(), by_hand.model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=name)
