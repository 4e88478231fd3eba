"""Whole models against the oracle: the reference GPT (tied and untied) and HF
BERT, RoBERTa and GPT-2 built from small configs (random weights, no download)."""

import pytest
import torch

from dptrain.losses import per_example_cross_entropy
from dptrain.models import GPT, GPTConfig
from tests.clipping.oracle_check import assert_engine_matches_oracle

MODES = ["book_keeping", "ghost"]


def gpt_case(tied: bool, dtype=torch.float64, batch=4, seq=6, device="cpu"):
    torch.manual_seed(1)
    cfg = GPTConfig(
        vocab_size=23,
        max_seq_len=16,
        n_layer=2,
        n_head=2,
        d_model=8,
        d_mlp=16,
        tie_embeddings=tied,
        padding_idx=0,
    )
    model = GPT(cfg).to(dtype)
    ids = torch.randint(0, 23, (batch, seq + 1))
    ids[0, -3:] = 0  # padding at the end of one example
    x, y = ids[:, :-1], ids[:, 1:].clone()
    y[y == 0] = -100
    model, x, y = model.to(device), x.to(device), y.to(device)

    def losses_of(sl):
        return per_example_cross_entropy(model(x[sl]), y[sl])

    return model, losses_of, batch


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("norm_method", ["auto", "ghost", "instantiate"])
def test_reference_gpt(mode, tied, norm_method):
    model, losses_of, b = gpt_case(tied)
    assert_engine_matches_oracle(model, losses_of, b, mode=mode, norm_method=norm_method)


@pytest.mark.parametrize("tied", [False, True])
def test_reference_gpt_float32(tied):
    model, losses_of, b = gpt_case(tied, dtype=torch.float32)
    assert_engine_matches_oracle(model, losses_of, b, mode="book_keeping", dtype=torch.float32)


@pytest.mark.parametrize("clipping", ["automatic", "per_layer"])
@pytest.mark.parametrize("tied", [False, True])
def test_reference_gpt_other_clipping_functions(clipping, tied):
    model, losses_of, b = gpt_case(tied)
    assert_engine_matches_oracle(model, losses_of, b, mode="book_keeping", clipping=clipping)


@pytest.mark.parametrize("batch", [0, 1])
def test_reference_gpt_tiny_batches(batch):
    model, losses_of, _ = gpt_case(True, batch=max(batch, 1))
    assert_engine_matches_oracle(model, losses_of, batch, mode="book_keeping")


def test_sequence_of_one_token():
    model, losses_of, b = gpt_case(True, seq=1)
    assert_engine_matches_oracle(model, losses_of, b, mode="book_keeping")


# -- Hugging Face models -------------------------------------------------------------------

transformers = pytest.importorskip("transformers")

SMALL = dict(
    vocab_size=40,
    hidden_size=8,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=16,
    max_position_embeddings=32,
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)


def hf_inputs(batch=3, seq=7, vocab=40, pad=1):
    torch.manual_seed(2)
    ids = torch.randint(3, vocab, (batch, seq))
    mask = torch.ones(batch, seq, dtype=torch.long)
    ids[0, -2:] = pad
    mask[0, -2:] = 0  # a padded example
    return ids, mask


def classifier_case(model):
    model = model.double().eval()
    ids, mask = hf_inputs()
    labels = torch.tensor([0, 1, 1])

    def losses_of(sl):
        out = model(input_ids=ids[sl], attention_mask=mask[sl])
        return per_example_cross_entropy(out.logits, labels[sl])

    return model, losses_of, ids.shape[0]


@pytest.mark.parametrize("mode", MODES)
def test_hf_bert_classifier(mode):
    cfg = transformers.BertConfig(**SMALL, num_labels=2, pad_token_id=1)
    model, losses_of, b = classifier_case(transformers.BertForSequenceClassification(cfg))
    assert_engine_matches_oracle(model, losses_of, b, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_hf_roberta_classifier(mode):
    cfg = transformers.RobertaConfig(
        **{**SMALL, "max_position_embeddings": 40}, num_labels=2, pad_token_id=1
    )
    model, losses_of, b = classifier_case(transformers.RobertaForSequenceClassification(cfg))
    assert_engine_matches_oracle(model, losses_of, b, mode=mode)


@pytest.mark.parametrize(
    ("mode", "clipping"),
    [*((m, "flat") for m in MODES), ("book_keeping", "per_layer")],
)
def test_hf_bert_masked_lm_with_tied_decoder(mode, clipping):
    # Per-layer: the decoder's weight (tied, its own group) and its bias (the decoder's
    # group) get different factors from one module record.
    cfg = transformers.BertConfig(**SMALL, pad_token_id=1)
    model = transformers.BertForMaskedLM(cfg).double().eval()
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    ids, mask = hf_inputs()
    labels = ids.clone()
    labels[:, ::2] = -100

    def losses_of(sl):
        out = model(input_ids=ids[sl], attention_mask=mask[sl])
        return per_example_cross_entropy(out.logits, labels[sl], attention_mask=mask[sl])

    assert_engine_matches_oracle(model, losses_of, ids.shape[0], mode=mode, clipping=clipping)


@pytest.mark.parametrize("mode", MODES)
def test_hf_gpt2_lm_head_tied(mode):
    cfg = transformers.GPT2Config(
        vocab_size=40,
        n_positions=32,
        n_embd=8,
        n_layer=2,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    ids, mask = hf_inputs()
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)

    def losses_of(sl):
        out = model(input_ids=ids[sl], attention_mask=mask[sl])
        return per_example_cross_entropy(out.logits[:, :-1], labels[sl])

    assert_engine_matches_oracle(model, losses_of, ids.shape[0], mode=mode)
