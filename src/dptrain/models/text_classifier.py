"""Sentence classification on a pretrained encoder: pooling, optional DP-FP layer, head.

    input_ids, attention_mask (B, T)
      -> encoder (any Hugging Face ``AutoModel``)      last_hidden_state (B, T, k)
      -> pooling: mean | cls | pooler | mask | last    h (B, k)
      -> DP-FP layer (training only: clip to C + noise) h~ (B, k)
      -> head: linear (B, K), or the masked-LM head at the [MASK] position
         restricted to one label word per class (B, K)

The two heads are the two objectives of Li et al. 2022 (section 3.2): a fresh
linear layer on a pooled representation, or "text infilling", where the input
is the text followed by a prompt such as "It was [MASK]." and the logits of the
label words ("terrible", "great") at the [MASK] position are the class logits.
Text infilling reuses the pretrained masked-LM head (whose decoder is tied to
the word embeddings, so the clipping engine uses phantom clipping for it) and
needs a model that has one.

Every module here is a stock ``nn.Module`` that the clipping engine can clip
(HF BERT layers are ``nn.Linear`` / ``nn.Embedding`` / ``nn.LayerNorm``), and
:class:`PooledEncoder` is what :class:`dptrain.dpfp.DPFPTrainer` takes as its
encoder.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from dptrain.dpfp import DPForwardLayer

__all__ = [
    "POOLINGS",
    "LabelWordHead",
    "PooledEncoder",
    "TextClassifier",
    "last_positions",
    "mask_positions",
]

#: Pooling of the token states into one vector per text.
POOLINGS = ("mean", "cls", "pooler", "mask", "last")


def mask_positions(input_ids: Tensor, mask_token_id: int) -> Tensor:
    """(B,) position of the first ``mask_token_id`` in each row; an error names rows without one."""
    is_mask = input_ids == mask_token_id  # (B, T)
    missing = (~is_mask.any(1)).nonzero().flatten()
    if len(missing):
        raise ValueError(
            f"input rows {missing[:5].tolist()} have no mask token (id {mask_token_id}): "
            "text infilling needs the prompt's [MASK] in every input"
        )
    return is_mask.to(torch.int8).argmax(1)


def last_positions(attention_mask: Tensor) -> Tensor:
    """(B,) position of each row's last token; an error names rows not padded on the right
    (or empty), where that token would not be the text's last."""
    lengths = attention_mask.sum(1)  # (B,)
    width = attention_mask.shape[1]
    right_padded = attention_mask.bool() == (
        torch.arange(width, device=lengths.device) < lengths.unsqueeze(1)
    )
    bad = ((~right_padded.all(1)) | (lengths == 0)).nonzero().flatten()
    if len(bad):
        raise ValueError(
            f"input rows {bad[:5].tolist()} are not padded on the right (or are empty): "
            "pooling='last' reads the state of each row's last token"
        )
    return lengths - 1


class PooledEncoder(nn.Module):
    """A Hugging Face encoder and a pooling: a batch dict in, one vector per text out.

    Args:
        encoder: a model called as ``encoder(input_ids=..., attention_mask=...)``
            whose output has ``last_hidden_state`` (B, T, k) (and
            ``pooler_output`` (B, k) for ``pooling="pooler"``).
        pooling: ``mean`` (average of the non-padding token states, the pooling
            sentence-transformers trained all-MiniLM-L6-v2 with), ``cls`` (the
            first token's state), ``pooler`` (the model's pooler output) or
            ``mask`` (the state at the [MASK] token, for text infilling) or
            ``last`` (the state at the last non-padding token: for a causal LM, the
            only one that has read the whole text; needs right padding).
        mask_token_id: the tokenizer's [MASK] id (needed for ``pooling="mask"``).
    """

    def __init__(self, encoder: nn.Module, pooling: str = "mean", mask_token_id: int | None = None):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(
                f"pooling={pooling!r} is not allowed: expected one of {list(POOLINGS)}"
            )
        if pooling == "mask" and mask_token_id is None:
            raise ValueError("pooling='mask' needs mask_token_id= (the tokenizer's [MASK] id)")
        self.encoder = encoder
        self.pooling = pooling
        self.mask_token_id = mask_token_id

    @property
    def hidden_size(self) -> int:
        return int(self.encoder.config.hidden_size)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        ids, attention = batch["input_ids"], batch["attention_mask"]  # (B, T), (B, T)
        out = self.encoder(input_ids=ids, attention_mask=attention)
        if self.pooling == "pooler":
            pooled = getattr(out, "pooler_output", None)
            if pooled is None:
                raise ValueError(
                    "pooling='pooler' is not allowed for this encoder: it has no pooler output "
                    "(use 'mean' or 'cls')"
                )
            return pooled  # (B, k)
        states = out.last_hidden_state  # (B, T, k)
        if self.pooling == "cls":
            return states[:, 0]
        rows = torch.arange(len(ids), device=ids.device)
        if self.pooling == "mask":
            return states[rows, mask_positions(ids, self.mask_token_id)]
        if self.pooling == "last":
            return states[rows, last_positions(attention)]
        weights = attention.to(states.dtype).unsqueeze(-1)  # (B, T, 1)
        # clamp: a row of only padding (not produced by our tokenization) would divide by 0
        return (states * weights).sum(1) / weights.sum(1).clamp_min(1.0)

    def extra_repr(self) -> str:
        return f"pooling={self.pooling!r}"


class LabelWordHead(nn.Module):
    """Text-infilling head: the masked-LM head's logits of one label word per class.

    ``mlm_head`` maps the [MASK] state (B, k) to vocabulary logits (B, V) (for
    BERT: ``BertForMaskedLM.cls``, transform + decoder tied to the word
    embeddings); this module keeps columns ``label_word_ids`` -> (B, K). The
    whole decoder runs (not only the K rows) so that its weight is used inside
    its own module, which is what the clipping engine can clip exactly.
    """

    def __init__(self, mlm_head: nn.Module, label_word_ids: Sequence[int]):
        super().__init__()
        ids = [int(i) for i in label_word_ids]
        if len(ids) < 2 or len(set(ids)) != len(ids):
            raise ValueError(
                f"label_word_ids={ids} is not allowed: expected >= 2 distinct token ids"
            )
        self.mlm_head = mlm_head
        self.register_buffer("label_word_ids", torch.tensor(ids, dtype=torch.long))

    def forward(self, h: Tensor) -> Tensor:
        return self.mlm_head(h).index_select(-1, self.label_word_ids)  # (B, V) -> (B, K)


class TextClassifier(nn.Module):
    """PooledEncoder -> [DPForwardLayer] -> head; logits (B, K).

    ``dp_layer`` (DP-FP, Du & Mi et al.) clips and noises the pooled
    representation in training mode and is the identity in eval mode.
    """

    def __init__(
        self, encoder: PooledEncoder, head: nn.Module, dp_layer: DPForwardLayer | None = None
    ):
        super().__init__()
        self.encoder = encoder
        self.dp_layer = dp_layer if dp_layer is not None else nn.Identity()
        self.head = head

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        return self.head(self.dp_layer(self.encoder(batch)))
