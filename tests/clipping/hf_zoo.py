"""A zoo of tiny float64 Hugging Face models for the clipping tests.

Each entry of :data:`FAMILIES` builds, from a config (random weights, nothing is
downloaded), a seeded float64 model in train mode with every dropout set to 0
and ``attn_implementation="eager"``, together with a batch maker and a
per-example loss::

    case = FAMILIES["llama"]()
    kwargs, labels = case.make_batch(4, 8, 0)
    out = case.model(**kwargs)
    L = case.losses(out, labels)  # (B,)

Token batches are right-padded (example 0 is full length, the last one is the
shortest) with an ``attention_mask``; the losses are computed here from the
logits (labels are never passed to the model, so HF's mean-reduced loss is not
used): token-level cross-entropy summed over the non-padding targets of each
example (the decoder's for seq2seq), or cross-entropy of the class label for
classifiers. :func:`per_example_losses` runs any rows of a batch alone: the same
data in sub-batches, e.g. one example at a time (the batch-size-1 oracle); row
i run alone gives row i's loss in the full batch to float64 rounding.

Precision, for tolerances: HF computes parts of these "float64" models in
float32 (the eager softmax of the decoder-only families, OPT and ViT; Mixtral's
router softmax; every RMSNorm's normalisation). The Gemma RMSNorms multiply by
(1 + weight) in float32 too, so their weight gradients are float32-accurate
(~1e-7 relative between batched and one-by-one backward passes). Gradients that
are zero in exact arithmetic (attention key biases) are rounding noise, up to
~1e-10 where the softmax is float32.

``transformers`` is imported at module level: test modules should call
``pytest.importorskip("transformers")`` before importing this one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor, nn

__all__ = [
    "FAMILIES",
    "IGNORE_INDEX",
    "Batch",
    "ZooCase",
    "class_losses",
    "per_example_losses",
    "slice_batch",
    "token_losses",
]

#: Label of a target that counts in no loss (padding, the last position).
IGNORE_INDEX = -100
#: Vocabulary size of every tiny language model; ids below ``_FIRST_ID`` are special.
VOCAB = 64
_FIRST_ID = 3
_NUM_LABELS = 3
_MAX_POSITIONS = 64
_IMAGE_SIZE = 8
#: Sliding-window size of the families that have one (shorter than the test sequences).
_WINDOW = 4

#: What ``make_batch`` returns: the model's keyword arguments and the labels.
Batch = tuple[dict[str, Tensor], Tensor]


@dataclass
class ZooCase:
    """One tiny model with its data and per-example loss."""

    name: str
    model: nn.Module
    """float64, train mode, no dropout."""
    make_batch: Callable[[int, int, int], Batch]
    """(batch_size, seq_len, seed) -> (model kwargs, labels); seq_len is ignored by images."""
    losses: Callable[[Any, Tensor], Tensor]
    """(model output, labels) -> per-example losses (B,)."""


# -- losses ---------------------------------------------------------------------------------


def token_losses(out: Any, labels: Tensor) -> Tensor:
    """Cross-entropy of ``out.logits`` (B, T, V) against ``labels`` (B, T), summed per example.

    Targets equal to :data:`IGNORE_INDEX` count nothing.
    """
    logits = out.logits
    tokens = F.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="none"
    )
    return tokens.view(labels.shape).sum(1)


def class_losses(out: Any, labels: Tensor) -> Tensor:
    """Cross-entropy of ``out.logits`` (B, C) against class ids ``labels`` (B,)."""
    return F.cross_entropy(out.logits, labels, reduction="none")


# -- batches --------------------------------------------------------------------------------


def _lengths(
    batch_size: int, seq_len: int, gen: torch.Generator, max_padding: int | None = None
) -> Tensor:
    """Valid lengths (B,): example 0 full, the last one the shortest, the rest random.

    At least 2 tokens (one next-token target), at most ``max_padding`` padding tokens.
    """
    shortest = min(seq_len, max(2, seq_len // 2))
    if max_padding is not None:
        shortest = max(shortest, seq_len - max_padding)
    lengths = torch.randint(shortest, seq_len + 1, (batch_size,), generator=gen)
    if batch_size > 0:
        lengths[0] = seq_len
    if batch_size > 1:
        lengths[-1] = shortest
    return lengths


def _padded_tokens(
    batch_size: int,
    seq_len: int,
    gen: torch.Generator,
    pad_id: int,
    max_padding: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Right-padded ids (B, T) and their attention mask (B, T) of 0/1 (long)."""
    ids = torch.randint(_FIRST_ID, VOCAB, (batch_size, seq_len), generator=gen)
    positions = torch.arange(seq_len).expand(batch_size, -1)
    lengths = _lengths(batch_size, seq_len, gen, max_padding)
    mask = (positions < lengths[:, None]).long()
    return ids.masked_fill(mask == 0, pad_id), mask


def _next_token_labels(ids: Tensor, mask: Tensor) -> Tensor:
    """labels[:, t] = ids[:, t + 1] where that token is not padding, else IGNORE_INDEX."""
    labels = torch.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX)
    return labels


def _causal_lm_batch(
    pad_id: int, sliding_window: int | None = None
) -> Callable[[int, int, int], Batch]:
    """Next-token batches. With a sliding window w, at most w - 1 padding tokens: a padding
    query further than w from the last real token would have no key left, and HF's eager
    attention (softmax upcast to float32: float64's min -> -inf) makes such a row NaN,
    which reaches real tokens through 0 * NaN in the next layer and in the backward."""
    max_padding = None if sliding_window is None else sliding_window - 1

    def make(batch_size: int, seq_len: int, seed: int) -> Batch:
        gen = torch.Generator().manual_seed(seed)
        ids, mask = _padded_tokens(batch_size, seq_len, gen, pad_id, max_padding)
        return {"input_ids": ids, "attention_mask": mask}, _next_token_labels(ids, mask)

    return make


def _seq2seq_batch(pad_id: int) -> Callable[[int, int, int], Batch]:
    """Encoder ids and decoder ids, both right-padded; labels: the next decoder token."""

    def make(batch_size: int, seq_len: int, seed: int) -> Batch:
        gen = torch.Generator().manual_seed(seed)
        ids, mask = _padded_tokens(batch_size, seq_len, gen, pad_id)
        dec, dec_mask = _padded_tokens(batch_size, seq_len, gen, pad_id)
        kwargs = {
            "input_ids": ids,
            "attention_mask": mask,
            "decoder_input_ids": dec,
            "decoder_attention_mask": dec_mask,
        }
        return kwargs, _next_token_labels(dec, dec_mask)

    return make


def _classifier_batch(pad_id: int, token_types: bool = False) -> Callable[[int, int, int], Batch]:
    """Right-padded ids with a class label each (and segment ids for BERT)."""

    def make(batch_size: int, seq_len: int, seed: int) -> Batch:
        gen = torch.Generator().manual_seed(seed)
        ids, mask = _padded_tokens(batch_size, seq_len, gen, pad_id)
        kwargs = {"input_ids": ids, "attention_mask": mask}
        if token_types:  # segment A then segment B
            split = torch.randint(1, seq_len + 1, (batch_size, 1), generator=gen)
            kwargs["token_type_ids"] = (torch.arange(seq_len) >= split).long() * mask
        return kwargs, torch.randint(0, _NUM_LABELS, (batch_size,), generator=gen)

    return make


def _image_batch(batch_size: int, seq_len: int, seed: int) -> Batch:
    """Gaussian 3 x 8 x 8 images with a class label each."""
    del seq_len  # the image size fixes the number of patches
    gen = torch.Generator().manual_seed(seed)
    pixels = torch.randn(
        batch_size, 3, _IMAGE_SIZE, _IMAGE_SIZE, generator=gen, dtype=torch.float64
    )
    return {"pixel_values": pixels}, torch.randint(0, _NUM_LABELS, (batch_size,), generator=gen)


def slice_batch(kwargs: dict[str, Tensor], labels: Tensor, rows: slice) -> Batch:
    """The given rows of a batch: every tensor whose first dimension is the batch is sliced."""
    b = labels.shape[0]
    part = {
        k: v[rows] if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == b else v
        for k, v in kwargs.items()
    }
    return part, labels[rows]


def per_example_losses(
    case: ZooCase, batch_size: int, seq_len: int, seed: int, rows: slice
) -> Tensor:
    """Losses of ``rows`` of ``case.make_batch(batch_size, seq_len, seed)``, run on their own.

    ``rows=slice(i, i + 1)`` runs example i alone (the oracle's batch of one);
    ``slice(None)`` runs the whole batch. Padding is kept as in the full batch.
    """
    kwargs, labels = slice_batch(*case.make_batch(batch_size, seq_len, seed), rows)
    return case.losses(case.model(**kwargs), labels)


# -- models ---------------------------------------------------------------------------------


def _finish(
    name: str,
    model: nn.Module,
    make_batch: Callable[[int, int, int], Batch],
    losses: Callable[[Any, Tensor], Tensor],
) -> ZooCase:
    """float64, train mode, and a check that nothing drops out."""
    model = model.to(torch.float64).train()
    _check_no_dropout(model)
    return ZooCase(name, model, make_batch, losses)


def _check_no_dropout(model: nn.Module) -> None:
    """Every dropout probability of the config (also functional dropout) and of the modules is 0."""
    config = getattr(model, "config", None)
    if config is not None:
        for key, value in config.to_dict().items():
            if ("drop" in key or key == "router_jitter_noise") and isinstance(value, float):
                assert value == 0.0, f"{type(model).__name__}: config {key}={value}"
    for name, module in model.named_modules():
        if isinstance(module, nn.Dropout):
            assert module.p == 0.0, f"{name}: dropout p={module.p}"


def _build(cls: type[nn.Module], config: Any, seed: int) -> nn.Module:
    """The model with weights drawn from ``seed``; the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return cls(config)


#: The shared config of the decoder-only language models.
_DECODER: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=_MAX_POSITIONS,
    attention_dropout=0.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    use_cache=False,
    attn_implementation="eager",
)


def llama(tied: bool = False, seed: int = 0, **overrides: Any) -> ZooCase:
    """Llama: RMSNorm, RoPE, GQA (4 query heads, 2 kv heads), SwiGLU MLP.

    ``overrides``: further or other ``LlamaConfig`` fields, e.g. ``attention_bias=True``.
    """
    config = transformers.LlamaConfig(**{**_DECODER, **overrides}, tie_word_embeddings=tied)
    model = _build(transformers.LlamaForCausalLM, config, seed)
    return _finish("llama-tied" if tied else "llama", model, _causal_lm_batch(0), token_losses)


def llama_classifier(seed: int = 0) -> ZooCase:
    """Llama with a sequence-classification head (``score``, read at the last non-padding token)."""
    config = transformers.LlamaConfig(**_DECODER, num_labels=_NUM_LABELS)
    model = _build(transformers.LlamaForSequenceClassification, config, seed)
    return _finish("llama-classifier", model, _classifier_batch(0), class_losses)


def qwen2(seed: int = 0) -> ZooCase:
    """Qwen2: q/k/v biases; layer 0 full attention, layer 1 sliding window 4."""
    config = transformers.Qwen2Config(
        **_DECODER, use_sliding_window=True, sliding_window=_WINDOW, max_window_layers=1
    )
    model = _build(transformers.Qwen2ForCausalLM, config, seed)
    return _finish("qwen2", model, _causal_lm_batch(0, _WINDOW), token_losses)


def qwen3(seed: int = 0) -> ZooCase:
    """Qwen3: per-head q_norm/k_norm RMSNorms; layer 1 sliding window 4."""
    config = transformers.Qwen3Config(
        **_DECODER, use_sliding_window=True, sliding_window=_WINDOW, max_window_layers=1
    )
    model = _build(transformers.Qwen3ForCausalLM, config, seed)
    return _finish("qwen3", model, _causal_lm_batch(0, _WINDOW), token_losses)


def mistral(seed: int = 0) -> ZooCase:
    """Mistral: Llama with a sliding window (4) on every layer."""
    config = transformers.MistralConfig(**_DECODER, sliding_window=_WINDOW)
    model = _build(transformers.MistralForCausalLM, config, seed)
    return _finish("mistral", model, _causal_lm_batch(0, _WINDOW), token_losses)


def mixtral(seed: int = 0) -> ZooCase:
    """Mixtral: sparse MoE MLP, 4 experts, top-2 routing, no router jitter."""
    config = transformers.MixtralConfig(
        **_DECODER,
        num_local_experts=4,
        num_experts_per_tok=2,
        router_jitter_noise=0.0,
        sliding_window=None,
        # the default "grouped_mm" has no float64 kernel (torch.nn.functional.grouped_mm)
        experts_implementation="eager",
    )
    model = _build(transformers.MixtralForCausalLM, config, seed)
    return _finish("mixtral", model, _causal_lm_batch(0), token_losses)


def phi3(seed: int = 0) -> ZooCase:
    """Phi-3: fused qkv_proj and gate_up_proj, partial rotary (1/2), sliding window 4."""
    config = transformers.Phi3Config(
        **{k: v for k, v in _DECODER.items() if k != "head_dim"},
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        sliding_window=_WINDOW,
        partial_rotary_factor=0.5,
    )
    model = _build(transformers.Phi3ForCausalLM, config, seed)
    return _finish("phi3", model, _causal_lm_batch(0, _WINDOW), token_losses)


def gemma(seed: int = 0) -> ZooCase:
    """Gemma: (1 + w) RMSNorm in float32, embedding scaled by sqrt(d), tied head."""
    config = transformers.GemmaConfig(**_DECODER, hidden_activation="gelu_pytorch_tanh")
    model = _build(transformers.GemmaForCausalLM, config, seed)
    return _finish("gemma", model, _causal_lm_batch(0), token_losses)


def gemma2(seed: int = 0) -> ZooCase:
    """Gemma 2: sandwich norms, sliding window 4 / full layers, logit softcapping 50 / 30."""
    config = transformers.Gemma2Config(**_DECODER, sliding_window=_WINDOW, query_pre_attn_scalar=8)
    model = _build(transformers.Gemma2ForCausalLM, config, seed)
    return _finish("gemma2", model, _causal_lm_batch(0, _WINDOW), token_losses)


def gemma3(seed: int = 0) -> ZooCase:
    """Gemma 3 (text only): q/k norms, sliding (local RoPE) then full layer, sliding window 4."""
    config = transformers.Gemma3TextConfig(
        **_DECODER,
        sliding_window=_WINDOW,
        query_pre_attn_scalar=8,
        layer_types=["sliding_attention", "full_attention"],
    )
    model = _build(transformers.Gemma3ForCausalLM, config, seed)
    return _finish("gemma3", model, _causal_lm_batch(0, _WINDOW), token_losses)


def t5(
    seed: int = 0,
    attn_implementation: str = "eager",
    model_class: str = "T5ForConditionalGeneration",
) -> ZooCase:
    """T5: relative attention buckets (8, max distance 16), gated-GELU FFN, tied scaled head
    (``model_class="MT5ForConditionalGeneration"``: mT5, the same layers under other names)."""
    config_class = getattr(transformers, model_class.replace("ForConditionalGeneration", "Config"))
    config = config_class(
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        dropout_rate=0.0,
        classifier_dropout=0.0,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    model = _build(getattr(transformers, model_class), config, seed)
    return _finish("t5", model, _seq2seq_batch(0), token_losses)


def opt(seed: int = 0) -> ZooCase:
    """OPT: learned positions (offset 2, from the mask's cumsum), project_in/out (16 <-> 32)."""
    config = transformers.OPTConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        word_embed_proj_dim=16,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=_MAX_POSITIONS,
        dropout=0.0,
        attention_dropout=0.0,
        layerdrop=0.0,
        pad_token_id=1,
        bos_token_id=2,
        eos_token_id=2,
        use_cache=False,
        attn_implementation="eager",
    )
    model = _build(transformers.OPTForCausalLM, config, seed)
    return _finish("opt", model, _causal_lm_batch(1), token_losses)


def bart(seed: int = 0) -> ZooCase:
    """BART: learned positions (offset 2), scaled shared embedding (scale_embedding=True)."""
    config = transformers.BartConfig(
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=_MAX_POSITIONS,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        classifier_dropout=0.0,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        scale_embedding=True,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=2,
        use_cache=False,
        attn_implementation="eager",
    )
    model = _build(transformers.BartForConditionalGeneration, config, seed)
    return _finish("bart", model, _seq2seq_batch(1), token_losses)


def vit(seed: int = 0) -> ZooCase:
    """ViT: 8x8 images, 4x4 patches (Conv2d), cls token and position embedding Parameters."""
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        image_size=_IMAGE_SIZE,
        patch_size=4,
        num_channels=3,
        num_labels=_NUM_LABELS,
        attn_implementation="eager",
    )
    model = _build(transformers.ViTForImageClassification, config, seed)
    return _finish("vit", model, _image_batch, class_losses)


def deberta_v2(seed: int = 0) -> ZooCase:
    """DeBERTa-v2: disentangled attention (c2p + p2c, 8 log buckets, shared keys,
    layer-normed relative embeddings), Conv1d layer, no absolute positions."""
    config = transformers.DebertaV2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=_MAX_POSITIONS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pooler_dropout=0.0,
        cls_dropout=0.0,
        relative_attention=True,
        pos_att_type=["p2c", "c2p"],
        position_buckets=8,
        max_relative_positions=_MAX_POSITIONS,
        share_att_key=True,
        norm_rel_ebd="layer_norm",
        position_biased_input=False,
        conv_kernel_size=3,
        conv_act="gelu",
        type_vocab_size=0,
        pooler_hidden_size=32,
        num_labels=_NUM_LABELS,
        pad_token_id=0,
    )
    model = _build(transformers.DebertaV2ForSequenceClassification, config, seed)
    return _finish("deberta-v2", model, _classifier_batch(0), class_losses)


def gpt2(seed: int = 0) -> ZooCase:
    """GPT-2 (reference): Conv1D layers, learned positions, tied head."""
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_positions=_MAX_POSITIONS,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        summary_first_dropout=0.0,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
        attn_implementation="eager",
    )
    model = _build(transformers.GPT2LMHeadModel, config, seed)
    return _finish("gpt2", model, _causal_lm_batch(0), token_losses)


def bert(seed: int = 0) -> ZooCase:
    """BERT (reference): absolute positions, token types, pooler, classifier."""
    config = transformers.BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=_MAX_POSITIONS,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0,
        num_labels=_NUM_LABELS,
        pad_token_id=0,
        attn_implementation="eager",
    )
    model = _build(transformers.BertForSequenceClassification, config, seed)
    return _finish("bert", model, _classifier_batch(0, token_types=True), class_losses)


#: Short name -> builder of a fresh case (seed 0).
FAMILIES: dict[str, Callable[[], ZooCase]] = {
    "llama": llama,
    "llama-tied": lambda: llama(tied=True),
    "qwen2": qwen2,
    "qwen3": qwen3,
    "mistral": mistral,
    "mixtral": mixtral,
    "phi3": phi3,
    "gemma": gemma,
    "gemma2": gemma2,
    "gemma3": gemma3,
    "t5": t5,
    "opt": opt,
    "bart": bart,
    "vit": vit,
    "deberta-v2": deberta_v2,
    "gpt2": gpt2,
    "bert": bert,
}
