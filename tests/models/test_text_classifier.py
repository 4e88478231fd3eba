"""The text classifier pieces on tiny random Hugging Face BERTs (no download): pooling,
mask positions, the label-word head, the DP-FP layer in train/eval mode, and per-example
clipping of the whole classifier (called with a batch dict) against the oracle."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.dpfp import DPForwardLayer
from dptrain.models.text_classifier import (
    POOLINGS,
    LabelWordHead,
    PooledEncoder,
    TextClassifier,
    last_positions,
    mask_positions,
)
from tests.clipping.oracle_check import assert_engine_matches_oracle

transformers = pytest.importorskip("transformers")

VOCAB, HIDDEN, PAD, MASK = 30, 8, 0, 4
MODES = ["book_keeping", "ghost"]


def bert_config(**overrides) -> transformers.BertConfig:
    return transformers.BertConfig(
        **{
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "intermediate_size": 16,
            "max_position_embeddings": 32,
            "hidden_dropout_prob": 0.0,
            "attention_probs_dropout_prob": 0.0,
            "pad_token_id": PAD,
            **overrides,
        }
    )


def tiny_bert(seed: int = 0, **kwargs) -> transformers.BertModel:
    torch.manual_seed(seed)
    return transformers.BertModel(bert_config(), **kwargs).double().eval()


def tiny_mlm(seed: int = 0) -> transformers.BertForMaskedLM:
    torch.manual_seed(seed)
    return transformers.BertForMaskedLM(bert_config()).double().eval()


def padded_batch() -> dict[str, torch.Tensor]:
    """3 rows of width 7: row 0 has 3 padding tokens, row 2 has 1; a [MASK] in every row."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, VOCAB, (3, 7), generator=g)
    mask = torch.ones(3, 7, dtype=torch.long)
    ids[0, 4:], mask[0, 4:] = PAD, 0
    ids[2, 6:], mask[2, 6:] = PAD, 0
    ids[0, 2] = ids[1, 5] = ids[2, 1] = MASK
    return {"input_ids": ids, "attention_mask": mask}


def states_of(bert, batch) -> torch.Tensor:
    with torch.no_grad():
        return bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])


# -- pooling ------------------------------------------------------------------------------


def test_mean_pooling_is_the_masked_average() -> None:
    bert = tiny_bert()
    batch = padded_batch()
    with torch.no_grad():
        got = PooledEncoder(bert, "mean")(batch)
    states = states_of(bert, batch).last_hidden_state
    lengths = batch["attention_mask"].sum(1)
    want = torch.stack([states[i, : lengths[i]].mean(0) for i in range(3)])
    assert got.shape == (3, HIDDEN) and got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_mean_pooling_ignores_padding() -> None:
    bert = tiny_bert()
    pooled = PooledEncoder(bert, "mean")
    ids = torch.tensor([[2, 11, 17, 23, 8, 3]])
    padded = torch.cat([ids, torch.full((1, 5), PAD)], 1)
    attention = torch.cat([torch.ones(1, 6), torch.zeros(1, 5)], 1).long()
    with torch.no_grad():
        alone = pooled({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        with_padding = pooled({"input_ids": padded, "attention_mask": attention})
        # the same row beside a longer one in a batch
        other = torch.randint(5, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
        both = pooled(
            {
                "input_ids": torch.cat([padded, other]),
                "attention_mask": torch.cat([attention, torch.ones(1, 11).long()]),
            }
        )
    torch.testing.assert_close(with_padding, alone, rtol=0, atol=1e-6)
    torch.testing.assert_close(both[:1], alone, rtol=0, atol=1e-6)
    # the padding tokens' states are not zero: averaging them in would change the vector
    states = states_of(bert, {"input_ids": padded, "attention_mask": attention})
    assert (states.last_hidden_state.mean(1) - alone).abs().max() > 1e-3


def test_cls_pooler_and_mask_poolings() -> None:
    bert = tiny_bert()
    batch = padded_batch()
    out = states_of(bert, batch)
    with torch.no_grad():
        cls = PooledEncoder(bert, "cls")(batch)
        pooler = PooledEncoder(bert, "pooler")(batch)
        at_mask = PooledEncoder(bert, "mask", mask_token_id=MASK)(batch)
    assert torch.equal(cls, out.last_hidden_state[:, 0])
    assert torch.equal(pooler, out.pooler_output)
    want = torch.stack([out.last_hidden_state[i, j] for i, j in enumerate([2, 5, 1])])
    assert torch.equal(at_mask, want)
    assert PooledEncoder(bert, "cls").hidden_size == HIDDEN
    assert "pooling='cls'" in repr(PooledEncoder(bert, "cls"))


def test_pooling_arguments_are_checked() -> None:
    bert = tiny_bert()
    assert POOLINGS == ("mean", "cls", "pooler", "mask", "last")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "pooling='max' is not allowed: expected one of ['mean', 'cls', 'pooler', 'mask', "
            "'last']"
        ),
    ):
        PooledEncoder(bert, "max")
    with pytest.raises(ValueError, match=re.escape("pooling='mask' needs mask_token_id=")):
        PooledEncoder(bert, "mask")
    no_pooler = PooledEncoder(tiny_bert(add_pooling_layer=False), "pooler")
    with pytest.raises(ValueError, match=re.escape("pooling='pooler' is not allowed for this")):
        no_pooler(padded_batch())


def test_mask_positions() -> None:
    ids = torch.tensor([[2, MASK, 7, MASK], [2, 7, 7, MASK], [MASK, 2, 2, 2]])
    assert mask_positions(ids, MASK).tolist() == [1, 3, 0]  # the first [MASK] of each row
    ids[1, 3] = 7
    with pytest.raises(
        ValueError,
        match=re.escape(f"input rows [1] have no mask token (id {MASK}): text infilling needs"),
    ):
        mask_positions(ids, MASK)
    with pytest.raises(ValueError, match=re.escape("input rows [1] have no mask token")):
        PooledEncoder(tiny_bert(), "mask", mask_token_id=MASK)(
            {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        )


# -- label-word head ----------------------------------------------------------------------


def test_label_word_head_keeps_the_label_word_columns() -> None:
    mlm = tiny_mlm()
    head = LabelWordHead(mlm.cls, [17, 9, 23])
    h = torch.randn(5, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = head(h)
        full = mlm.cls(h)
    assert full.shape == (5, VOCAB)
    assert torch.equal(got, full[:, [17, 9, 23]])
    assert head.label_word_ids.tolist() == [17, 9, 23]
    assert "label_word_ids" in dict(head.named_buffers())  # moves with .to(device)


@pytest.mark.parametrize("ids", [[], [7], [7, 7], [3, 9, 3]])
def test_label_word_head_refuses_fewer_than_two_or_duplicate_ids(ids) -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(f"label_word_ids={ids} is not allowed: expected >= 2 distinct token ids"),
    ):
        LabelWordHead(tiny_mlm().cls, ids)


def test_infilling_classifier_equals_masked_lm_logits_at_the_mask() -> None:
    mlm = tiny_mlm()
    model = TextClassifier(
        PooledEncoder(mlm.base_model, "mask", mask_token_id=MASK), LabelWordHead(mlm.cls, [11, 6])
    )
    batch = padded_batch()
    with torch.no_grad():
        logits = model(batch)
        full = mlm(**batch).logits  # (B, T, V)
    want = torch.stack([full[i, j][[11, 6]] for i, j in enumerate([2, 5, 1])])
    torch.testing.assert_close(logits, want, rtol=1e-12, atol=1e-12)


# -- DP-FP layer inside the classifier ----------------------------------------------------


def test_dp_layer_noises_in_train_mode_only() -> None:
    bert = tiny_bert()
    torch.manual_seed(1)
    head = nn.Linear(HIDDEN, 2).double()
    layer = DPForwardLayer(0.5, 1.0, seed=0)
    model = TextClassifier(PooledEncoder(bert, "mean"), head, layer)
    plain = TextClassifier(PooledEncoder(bert, "mean"), head)
    assert isinstance(plain.dp_layer, nn.Identity)
    batch = padded_batch()
    with torch.no_grad():
        model.train()
        a, b = model(batch), model(batch)
        clipped_only = head(layer.clip(model.encoder(batch)))
        model.eval()
        c, d = model(batch), model(batch)
        reference = plain(batch)
    assert not torch.allclose(a, b)  # fresh noise at every call
    assert not torch.allclose(a, clipped_only)
    assert torch.equal(c, d)  # eval: no noise, deterministic
    assert torch.equal(c, reference)  # and no clipping either: the identity
    # the noise is the layer's: the same seed gives the same noisy outputs
    again = TextClassifier(PooledEncoder(bert, "mean"), head, DPForwardLayer(0.5, 1.0, seed=0))
    with torch.no_grad():
        assert torch.equal(again.train()(batch), a)


def test_dp_layer_without_noise_is_clipping_in_train_mode() -> None:
    bert = tiny_bert()
    head = nn.Linear(HIDDEN, 2).double()
    layer = DPForwardLayer(0.5, 0.0, seed=0)
    model = TextClassifier(PooledEncoder(bert, "mean"), head, layer).train()
    batch = padded_batch()
    with torch.no_grad():
        pooled = model.encoder(batch)
        assert torch.linalg.vector_norm(pooled, dim=1).min() > 0.5  # every row is clipped
        got = model(batch)
        want = head(pooled * (0.5 / torch.linalg.vector_norm(pooled, dim=1, keepdim=True)))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


# -- per-example clipping of the classifier called with a batch dict ----------------------


def _oracle_case(model: nn.Module, labels: torch.Tensor):
    batch = padded_batch()

    def losses_of(sl):
        inputs = {k: v[sl] for k, v in batch.items()}
        return F.cross_entropy(model(inputs), labels[sl], reduction="none")

    return losses_of


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("pooling", ["mean", "pooler"])
def test_engine_matches_oracle_linear_objective(mode, pooling) -> None:
    # mean pooling leaves a pooler unused (no gradient): use a BERT without one
    bert = tiny_bert(add_pooling_layer=pooling == "pooler")
    torch.manual_seed(4)
    model = TextClassifier(PooledEncoder(bert, pooling), nn.Linear(HIDDEN, 3)).double().eval()
    losses_of = _oracle_case(model, torch.tensor([0, 2, 1]))
    assert_engine_matches_oracle(model, losses_of, 3, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_engine_matches_oracle_infilling_objective_tied_decoder(mode) -> None:
    mlm = tiny_mlm()
    assert mlm.cls.predictions.decoder.weight is mlm.bert.embeddings.word_embeddings.weight
    model = TextClassifier(
        PooledEncoder(mlm.base_model, "mask", mask_token_id=MASK), LabelWordHead(mlm.cls, [11, 6])
    ).eval()
    losses_of = _oracle_case(model, torch.tensor([1, 0, 1]))
    assert_engine_matches_oracle(model, losses_of, 3, mode=mode)


def test_last_pooling_reads_each_rows_last_token_and_refuses_left_padding() -> None:
    attention = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    assert last_positions(attention).tolist() == [2, 0, 3]
    bert = tiny_bert()
    pooled = PooledEncoder(bert, "last").eval()
    ids = torch.randint(5, 30, (3, 4))
    states = bert(input_ids=ids, attention_mask=attention).last_hidden_state
    got = pooled({"input_ids": ids, "attention_mask": attention})
    assert torch.equal(got, states[torch.arange(3), torch.tensor([2, 0, 3])])
    for bad in ([[0, 1, 1, 1]], [[1, 0, 1, 0]], [[0, 0, 0, 0]]):
        with pytest.raises(ValueError, match=r"input rows \[0\] are not padded on the right"):
            last_positions(torch.tensor(bad))
