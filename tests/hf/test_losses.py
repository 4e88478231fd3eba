"""Per-example losses from logits and labels, against Hugging Face's own loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")

from transformers import default_data_collator

from dptrain.hf import per_example_hf_loss
from dptrain.hf.losses import task_of
from tests.clipping import hf_zoo
from tests.hf import tiny


def _run(model, batch):
    inputs = dict(batch)
    labels = inputs.pop("labels")
    return per_example_hf_loss(model, model(**inputs), labels, inputs), labels


def test_causal_lm_shifts_and_excludes_padding():
    """Each record's loss is HF's loss on that record alone without its padding: the shift
    is HF's, and padded positions (attention 0, label -100) count for nothing."""
    model = tiny.llama().eval()
    records = tiny.lm_records(6, pad_last=3)
    losses, _ = _run(model, default_data_collator(records))
    for i, r in enumerate(records):
        keep = int(r["attention_mask"].sum())
        ids, labels = r["input_ids"][None, :keep], r["labels"][None, :keep]
        expected = model(input_ids=ids, labels=labels).loss
        torch.testing.assert_close(losses[i], expected, rtol=1e-5, atol=1e-6)
    # padding with real-looking labels but attention 0 is excluded too
    padded = [dict(r, labels=r["input_ids"].clone()) for r in records]
    again, _ = _run(model, default_data_collator(padded))
    torch.testing.assert_close(again, losses, rtol=1e-5, atol=1e-6)


def test_sequence_classification_is_cross_entropy_per_example():
    model = tiny.gpt2_classifier().eval()
    batch = default_data_collator(tiny.classification_records(6))  # 'label' -> 'labels'
    assert task_of(model) == "sequence"
    losses, labels = _run(model, batch)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    torch.testing.assert_close(losses, F.cross_entropy(logits, labels, reduction="none"))
    torch.testing.assert_close(losses.mean(), model(**batch).loss)


def test_seq2seq_uses_unshifted_labels_and_decoder_inputs_from_labels():
    model = hf_zoo.t5().model.eval()
    assert task_of(model) == "seq2seq"
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, hf_zoo.VOCAB, (4, 6), generator=g)
    labels = torch.randint(3, hf_zoo.VOCAB, (4, 5), generator=g)
    decoder = model.prepare_decoder_input_ids_from_labels(labels=labels)
    out = model(input_ids=ids, decoder_input_ids=decoder)
    losses = per_example_hf_loss(model, out, labels, {"input_ids": ids})
    torch.testing.assert_close(losses.mean(), model(input_ids=ids, labels=labels).loss)


def test_sum_reduction_and_unknown_task():
    model = tiny.llama().eval()
    records = tiny.lm_records(4, pad_last=0)
    batch = default_data_collator(records)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    mean = per_example_hf_loss(model, out, batch["labels"], inputs)
    total = per_example_hf_loss(model, out, batch["labels"], inputs, reduction="sum")
    torch.testing.assert_close(total, mean * (tiny.SEQ - 1))

    class Custom(torch.nn.Module):
        def forward(self, input_ids):
            return {"logits": torch.zeros(*input_ids.shape, 5)}

    with pytest.raises(ValueError, match="per_example_loss_func"):
        per_example_hf_loss(Custom(), Custom()(batch["input_ids"]), batch["labels"], inputs)


# Tiny causal LMs of the families the engine trains (built from configs, no downloads).
_DECODER = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    max_position_embeddings=32,
)
_FAMILIES = {
    "GPT2LMHeadModel": (
        "GPT2Config",
        dict(n_embd=16, n_layer=1, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0),
    ),
    "LlamaForCausalLM": ("LlamaConfig", _DECODER),
    "Qwen2ForCausalLM": ("Qwen2Config", _DECODER),
    "Qwen3ForCausalLM": ("Qwen3Config", dict(_DECODER, head_dim=8)),
    "MistralForCausalLM": ("MistralConfig", _DECODER),
    "GemmaForCausalLM": ("GemmaConfig", dict(_DECODER, head_dim=8)),
    "Gemma2ForCausalLM": ("Gemma2Config", dict(_DECODER, head_dim=8)),
    "Phi3ForCausalLM": ("Phi3Config", _DECODER),
    "OPTForCausalLM": (
        "OPTConfig",
        dict(
            hidden_size=16,
            ffn_dim=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=32,
            word_embed_proj_dim=16,
            dropout=0.0,
        ),
    ),
    "GPTNeoXForCausalLM": (
        "GPTNeoXConfig",
        dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=32,
        ),
    ),
    "FalconForCausalLM": (
        "FalconConfig",
        dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2),
    ),
    "BloomForCausalLM": ("BloomConfig", dict(hidden_size=16, n_layer=1, n_head=2)),
    "Starcoder2ForCausalLM": ("Starcoder2Config", _DECODER),
    "OlmoForCausalLM": ("OlmoConfig", _DECODER),
}


def _family_model(name: str):
    import transformers

    config_name, settings = _FAMILIES[name]
    config = getattr(transformers, config_name)(
        vocab_size=tiny.VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2, **settings
    )
    torch.manual_seed(0)
    return getattr(transformers, name)(config)


@pytest.mark.parametrize("name", sorted(_FAMILIES))
def test_every_causal_lm_family_trains_a_private_step_with_labels(tmp_path, name):
    """Each family is a causal LM by transformers' own auto-model mapping (GPT-2's
    ...LMHeadModel has no For... suffix and no loss_type): each record's loss is HF's own
    shifted loss on that record, and DPTrainer takes a private step on labelled records."""
    from dptrain.hf import DPTrainer, PrivacyArguments

    tiny.quiet_transformers()
    model = _family_model(name)
    assert task_of(model) == "causal_lm"
    records = tiny.lm_records(16, pad_last=0)
    model.eval()
    losses, _ = _run(model, default_data_collator(records[:4]))
    for i, r in enumerate(records[:4]):
        expected = model(input_ids=r["input_ids"][None], labels=r["labels"][None]).loss
        torch.testing.assert_close(losses[i], expected, rtol=1e-5, atol=1e-6)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = DPTrainer(
        model=model.train(),
        args=tiny.training_args(str(tmp_path), max_steps=1, gradient_accumulation_steps=1),
        train_dataset=tiny.lm_records(16),
        privacy_args=PrivacyArguments(noise_multiplier=1.0, target_delta=1e-5, seed=0),
    )
    trainer.train()
    assert trainer.privacy.ledger.num_steps == 1
    unchanged = [n for n, p in model.named_parameters() if torch.equal(before[n], p)]
    assert unchanged == []


def test_a_class_the_mappings_list_under_two_tasks_is_decided_by_the_fallback_rules():
    """XLMWithLMHeadModel is both a causal and a masked LM in transformers' mappings, and
    XLNet's LM head scores unshifted labels: neither is guessed a shifted causal LM."""
    from transformers import XLNetConfig, XLNetLMHeadModel

    model = XLNetLMHeadModel(
        XLNetConfig(vocab_size=32, d_model=16, n_layer=1, n_head=2, d_inner=32)
    )
    assert task_of(model) == "unknown"
