"""`dptrain generate`: synthetic records from a `train lm` model, with the model's guarantee."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from dptrain.cli import main
from dptrain.privacy_record import read as read_record
from dptrain.recipes.generate import GenerateConfig, generate_records, load_generator, run_generate
from dptrain.recipes.lm_finetune import LMFinetuneConfig, train_lm
from tests.lm_helpers import make_small_tokenizer, save_tiny_llama

WORDS = ["red", "blue", "green", "gold"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama DP-trained by `train lm`, fully and with LoRA, on labelled reviews."""
    root = tmp_path_factory.mktemp("gen")
    rows = [
        {"prompt": f"Review ({lab}):", "completion": f" {WORDS[i % 4]} is {lab}."}
        for i in range(40)
        for lab in ("good", "bad")
    ]
    tok = make_small_tokenizer(corpus=[r["prompt"] + r["completion"] for r in rows])
    save_tiny_llama(root / "tiny", tok)
    pd.DataFrame(rows).to_json(root / "data.jsonl", orient="records", lines=True)
    folders = {}
    for name, lora_r in (("full", 0), ("lora", 4)):
        cfg = LMFinetuneConfig(
            data=str(root / "data.jsonl"),
            model=str(root / "tiny"),
            lora_r=lora_r,
            steps=2,
            batch_size=8,
            max_physical_batch_size=8,
            eval_every=2,
            max_length=24,
            num_generations=0,
            seed=0,
            epsilon=8.0,
            progress=False,
            out=str(root / name),
        )
        train_lm(cfg)
        folders[name] = root / name / "model"
    return folders


def _cfg(folder, tmp_path, **kw) -> GenerateConfig:
    values = dict(
        model=str(folder),
        n=5,
        prompt="Review ({label}):",
        labels=("good", "bad"),
        max_new_tokens=6,
        batch_size=2,
        progress=False,
        out=str(tmp_path / "gen"),
    )
    values.update(kw)
    return GenerateConfig(**values)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_generates_labelled_records_with_the_models_guarantee(trained, tmp_path, kind):
    cfg = _cfg(trained[kind], tmp_path)
    report = run_generate(cfg)
    privacy = read_record(trained[kind])
    assert report["epsilon"] == privacy.epsilon and report["delta"] == privacy.delta
    assert "post-processing" in report["guarantee"]
    assert report["guarantee"].startswith(privacy.statement)
    # the records carry the model's record, by post-processing
    carried = read_record(tmp_path / "gen")
    assert carried.producer == "dptrain generate" and carried.epsilon == privacy.epsilon
    assert carried.ledger == privacy.ledger is not None
    rows = [json.loads(x) for x in (tmp_path / "gen" / "synthetic.jsonl").read_text().splitlines()]
    assert [r["label"] for r in rows] == ["good", "bad", "good", "bad", "good"]
    assert all(isinstance(r["text"], str) for r in rows)
    assert report["tokens_generated"] > 0
    # seeded: the same settings give the same records
    assert run_generate(cfg)["tokens_generated"] == report["tokens_generated"]
    again = [json.loads(x) for x in (tmp_path / "gen" / "synthetic.jsonl").read_text().splitlines()]
    assert again == rows


def test_an_adapter_is_loaded_onto_its_base_and_used(trained, tmp_path):
    import peft

    from dptrain.models.pretrained import load_pretrained_lm

    model, _, privacy = load_generator(trained["lora"])
    base, _ = load_pretrained_lm(privacy.base_model.id)
    reference = peft.PeftModel.from_pretrained(base, trained["lora"]).eval()
    ids = torch.tensor([[1, 5, 7, 9]])
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, reference(input_ids=ids).logits
        plain = load_pretrained_lm(privacy.base_model.id)[0](input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, plain, atol=1e-5)  # the adapter changed the model


def test_records_follow_the_labels_in_turn(trained, tmp_path):
    model, tokenizer, _ = load_generator(trained["full"])
    cfg = _cfg(trained["full"], tmp_path, n=7, labels=("a", "b", "c"))
    records = generate_records(model, tokenizer, cfg)
    assert [r["label"] for r in records] == ["a", "b", "c", "a", "b", "c", "a"]


def test_cli(trained, tmp_path, capsys):
    out = tmp_path / "cli"
    code = main(
        [
            "generate",
            f"model={trained['full']}",
            "n=3",
            "prompt=Review:",
            f"out={out}",
            "max_new_tokens=4",
            "progress=false",
        ]
    )
    assert code == 0
    assert "post-processing" in capsys.readouterr().out
    lines = (out / "synthetic.jsonl").read_text().splitlines()
    assert len(lines) == 3 and set(json.loads(lines[0])) == {"text"}


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"n": 0}, "n=0"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 1.5}, "top_p=1.5"),
        ({"prompt": "Review:"}, "the prompt must say where the label goes"),
        ({"labels": ("a", "a")}, "a label is repeated"),
        ({"device": "tpu"}, "device='tpu'"),
    ],
)
def test_bad_settings_are_named(trained, tmp_path, kw, message):
    with pytest.raises(ValueError, match=message):
        _cfg(trained["full"], tmp_path, **kw)


def test_a_model_without_privacy_record_is_refused(tmp_path):
    folder = save_tiny_llama(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"has no privacy\.json"):
        GenerateConfig(model=str(folder))
    with pytest.raises(ValueError, match="model is required"):
        GenerateConfig()
    with pytest.raises(ValueError, match="no such folder"):
        GenerateConfig(model=str(tmp_path / "absent"))


def test_the_public_packaged_model_generates_with_epsilon_zero(trained, tmp_path, monkeypatch):
    # the packaged SmolLM2 stands in as the tiny base: what is checked is the guarantee,
    # which must say no private data was read, not the model's text
    from dptrain.models.pretrained import SMOLLM2, load_pretrained_lm
    from dptrain.recipes import generate

    tiny = trained["full"].parent.parent / "tiny"
    monkeypatch.setattr(generate, "load_pretrained_lm", lambda name: load_pretrained_lm(tiny))
    report = run_generate(_cfg(SMOLLM2, tmp_path))
    assert report["epsilon"] == 0.0 and report["delta"] == 0.0
    assert report["guarantee"].startswith(f"no private data: the public pretrained model {SMOLLM2}")
    lines = (tmp_path / "gen" / "synthetic.jsonl").read_text().splitlines()
    assert [json.loads(x)["label"] for x in lines] == ["good", "bad", "good", "bad", "good"]
    # any other folder without privacy.json is still refused
    with pytest.raises(ValueError, match=r"has no privacy\.json"):
        GenerateConfig(model=str(tiny))


def test_chat_prompt_is_the_rendered_user_turn_with_the_assistant_turn_opened(trained, tmp_path):
    from dptrain.recipes.generate import _prompt_ids
    from tests.lm_helpers import CHAT_TEMPLATE

    model, tokenizer, _ = load_generator(trained["full"])
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = _prompt_ids(tokenizer, "Write a good review.", chat=True)
    assert all(isinstance(i, int) for i in ids)
    want = "<s><|user|>\nWrite a good review.<|end|>\n<|assistant|>\n"
    assert tokenizer.decode(ids) == want
    assert ids == tokenizer(want, add_special_tokens=False)["input_ids"]
    cfg = _cfg(trained["full"], tmp_path, chat=True, prompt="Write a {label} review.")
    records = generate_records(model, tokenizer, cfg)
    assert [r["label"] for r in records] == ["good", "bad", "good", "bad", "good"]
    # the system turn as train lm's system_prompt= made it
    ids = _prompt_ids(tokenizer, "Hi.", chat=True, system_prompt="Be kind.")
    assert (
        tokenizer.decode(ids)
        == "<s><|system|>\nBe kind.<|end|>\n<|user|>\nHi.<|end|>\n<|assistant|>\n"
    )


# -- models saved by DPTrainer -----------------------------------------------------------------


@pytest.fixture(scope="module")
def trainer_models(tmp_path_factory):
    """A tiny Llama DP-trained by DPTrainer (the stock Trainer path), saved in full and as a
    peft LoRA adapter, each with its tokenizer: what a user's own script writes."""
    import peft
    from transformers import AutoTokenizer

    from dptrain.hf import DPTrainer, PrivacyArguments
    from dptrain.models.pretrained import load_pretrained_lm
    from tests.hf import tiny

    tiny.quiet_transformers()
    root = tmp_path_factory.mktemp("trainer")
    tok = make_small_tokenizer(corpus=[f"Review: {w} is good." for w in WORDS])
    base_folder = save_tiny_llama(root / "base", tok)
    tokenizer = AutoTokenizer.from_pretrained(base_folder)
    records = []
    for w in WORDS * 5:
        x = tokenizer(f"Review: {w} is good.")["input_ids"][:8]
        pad = 8 - len(x)
        records.append(
            {
                "input_ids": torch.tensor(x + [tokenizer.pad_token_id] * pad),
                "attention_mask": torch.tensor([1] * len(x) + [0] * pad),
                "labels": torch.tensor(x + [-100] * pad),
            }
        )
    folders = {}
    for kind in ("full", "lora"):
        model, _ = load_pretrained_lm(base_folder)
        if kind == "lora":
            model = peft.get_peft_model(
                model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
            )
        out = root / kind
        trainer = DPTrainer(
            model=model.train(),
            args=tiny.training_args(str(out), max_steps=2, gradient_accumulation_steps=1),
            train_dataset=records,
            processing_class=tokenizer,
            privacy_args=PrivacyArguments(target_epsilon=4.0, target_delta=1e-5, seed=0),
        )
        trainer.train()
        trainer.save_model()
        folders[kind] = (out, trainer.epsilon())
    return folders


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_generate_reads_a_model_dptrainer_saved(trainer_models, tmp_path, capsys, kind):
    """`dptrain generate` on DPTrainer's output folder: the record is understood (version 2,
    with the base model of an adapter), the records carry the model's epsilon."""
    folder, epsilon = trainer_models[kind]
    record = read_record(folder)
    assert record.producer == "dptrain.hf.DPTrainer" and record.epsilon == epsilon
    if kind == "lora":
        assert record.base_model.id == str(folder.parent / "base")
    out = tmp_path / "gen"
    code = main(
        [
            "generate",
            f"model={folder}",
            "n=3",
            "prompt=Review:",
            f"out={out}",
            "max_new_tokens=4",
            "progress=false",
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert "post-processing" in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["epsilon"] == pytest.approx(epsilon) and report["delta"] == 1e-5
    assert len((out / "synthetic.jsonl").read_text().splitlines()) == 3


def test_generate_reads_dptrainer_version_1_records(trainer_models, tmp_path, capsys):
    """A record written by the earlier DPTrainer (version 1, no base model) still loads: an
    adapter's base comes from its adapter_config.json."""
    import shutil

    folder = shutil.copytree(trainer_models["lora"][0], tmp_path / "v1")
    current = json.loads((folder / "privacy.json").read_text())
    g = current["guarantee"]
    v1 = {
        "format_version": 1,
        "library": "dptrain 0.1.0",
        "guarantee": {
            k: g[k]
            for k in (
                "epsilon",
                "delta",
                "accountant",
                "privacy_unit",
                "neighbouring",
                "not_covered",
            )
        }
        | {"covers": g["covers"][0]},
        "training": current["training"],
        "ledger": current["ledger"],
    }
    (folder / "privacy.json").write_text(json.dumps(v1))
    record = read_record(folder)
    assert record.format_version == 1 and record.epsilon == g["epsilon"]
    assert record.base_model is None and record.covers == g["covers"]
    code = main(["generate", f"model={folder}", "n=2", f"out={tmp_path / 'g'}", "progress=false"])
    assert code == 0, capsys.readouterr().err
