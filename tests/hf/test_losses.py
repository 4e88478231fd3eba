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
