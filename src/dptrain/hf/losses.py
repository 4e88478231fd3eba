"""Per-example losses of Hugging Face models, from their logits and the labels.

The clipping engine needs L_i for each example i of a chunk, (B,). A Hugging Face
model asked for its loss returns one number for the batch (a mean over all tokens
of all examples), which cannot be clipped per example; worse, computing it runs the
loss code inside ``forward``. So the labels are taken out of the inputs, the model
runs without them (no internal loss), and each example's loss is computed here from
the logits:

- causal LMs (every class transformers' ``AutoModelForCausalLM`` maps to, e.g.
  ``GPT2LMHeadModel``; else ``loss_type`` ``ForCausalLM`` or a decoder-only
  ``ForConditionalGeneration``): the logits at t are scored against ``labels[t + 1]``
  (the HF shift);
- masked LMs, token classification and encoder-decoder models (T5, BART): position t
  against ``labels[t]`` (an encoder-decoder gets ``decoder_input_ids`` made from the
  labels, as its own forward would);
- sequence classification: cross-entropy per example, or per-example MSE for
  regression (``num_labels == 1``) and per-example binary cross-entropy for
  multi-label problems, as HF chooses them from ``config.problem_type``.

-100 labels and positions whose ``attention_mask`` is 0 belong to no example's loss.
Each example's token losses are averaged over its own scored tokens (``"mean"``,
an example with none has loss 0) or summed (``"sum"``). This is not HF's batch mean
(which weights examples by their token counts); the gradient of the mean over a batch
of equal-length examples is the same.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dptrain.losses import per_example_cross_entropy

__all__ = ["per_example_hf_loss", "seq2seq_decoder_inputs", "task_of"]

#: ``fn(outputs, labels, inputs) -> (B,)``: a custom per-example loss for DPTrainer (labels:
#: the label tensor, or a dict of them for a model with several label names).
PerExampleLossFunc = Callable[[Any, Any, Mapping[str, Any]], Tensor]

_CAUSAL = ("ForCausalLM", "ForConditionalGeneration")
_TOKENS = ("ForMaskedLM", "ForTokenClassification")
_SEQUENCE = (
    "ForSequenceClassification",
    "ForImageClassification",
    "ForAudioClassification",
    "ForVideoClassification",
)
_SUFFIX = re.compile(r"For[A-Z][A-Za-z]*$")

# transformers' auto-model mappings (model_type -> class name): the tasks they name. A class
# listed under two tasks (XLMWithLMHeadModel: causal and masked LM) is decided by neither.
_MAPPINGS = (
    ("causal_lm", ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",)),
    ("seq2seq", ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",)),
    (
        "tokens",
        ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES"),
    ),
    (
        "sequence",
        (
            "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
            "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
            "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
            "MODEL_FOR_VIDEO_CLASSIFICATION_MAPPING_NAMES",
        ),
    ),
)
# Listed as causal LMs, but their own loss scores position t against labels[t] (no shift):
# XLNet's permutation LM. Left to the fallback rules, which call them unknown.
_UNSHIFTED_LM_HEADS = frozenset({"XLNetLMHeadModel"})


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


@functools.lru_cache(maxsize=1)
def _tasks_by_class() -> dict[str, str]:
    """Class name -> task, from transformers' auto-model mappings ({} without transformers)."""
    try:
        from transformers.models.auto import modeling_auto
    except ImportError:
        return {}
    found: dict[str, set[str]] = {}
    for task, names in _MAPPINGS:
        for name in names:
            for value in getattr(modeling_auto, name, {}).values():
                for cls in value if isinstance(value, tuple | list) else (value,):
                    found.setdefault(cls, set()).add(task)
    return {
        cls: next(iter(tasks))
        for cls, tasks in found.items()
        if len(tasks) == 1 and cls not in _UNSHIFTED_LM_HEADS
    }


def _task_from_mappings(base: nn.Module) -> str | None:
    """The task transformers' auto-model mappings give the model's class (or the nearest
    transformers class it subclasses); None when they do not list it."""
    tasks = _tasks_by_class()
    for cls in type(base).__mro__:
        if cls.__module__.startswith("transformers.") and cls.__name__ in tasks:
            return tasks[cls.__name__]
    return None


def task_of(model: nn.Module) -> str:
    """``"causal_lm"``, ``"seq2seq"``, ``"tokens"`` or ``"sequence"``; ``"unknown"`` otherwise.

    Read from the model (a peft wrapper is looked through): encoder-decoder configs are
    ``"seq2seq"``; else the task transformers' auto-model mappings
    (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and the masked-LM, seq2seq, token- and
    sequence-classification ones) give the model's class, so every causal LM
    ``AutoModelForCausalLM`` knows is one (``GPT2LMHeadModel`` included); else the model's
    ``loss_type`` (transformers >= 4.46), else the class name's ``For...`` suffix.
    """
    base = _base_model(model)
    config = getattr(base, "config", None)
    if config is not None and getattr(config, "is_encoder_decoder", False):
        return "seq2seq"
    mapped = _task_from_mappings(base)
    if mapped is not None:
        return mapped
    loss_type = getattr(base, "loss_type", None)
    if not isinstance(loss_type, str):
        match = _SUFFIX.search(type(base).__name__)
        loss_type = match.group(0) if match else ""
    if loss_type in _CAUSAL:
        return "causal_lm"
    if loss_type in _TOKENS:
        return "tokens"
    if loss_type in _SEQUENCE:
        return "sequence"
    return "unknown"


def seq2seq_decoder_inputs(model: nn.Module, labels: Tensor) -> Tensor:
    """``decoder_input_ids`` an encoder-decoder builds from its labels when given none."""
    base = _base_model(model)
    prepare = getattr(base, "prepare_decoder_input_ids_from_labels", None)
    if not callable(prepare):
        raise ValueError(
            f"{type(base).__name__} is an encoder-decoder without "
            "prepare_decoder_input_ids_from_labels: put decoder_input_ids in the batch"
        )
    return prepare(labels=labels)


def _logits(outputs: Any) -> Tensor:
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else None
    if logits is None:
        logits = (
            outputs[0] if isinstance(outputs, tuple | list) else getattr(outputs, "logits", None)
        )
    if not isinstance(logits, Tensor):
        raise ValueError(
            f"the model's output ({type(outputs).__name__}) has no logits tensor: pass "
            "per_example_loss_func= to DPTrainer"
        )
    return logits


def _sequence_losses(model: nn.Module, logits: Tensor, labels: Tensor) -> Tensor:
    """Per-example version of HF's ForSequenceClassificationLoss (same problem-type choice)."""
    config = getattr(_base_model(model), "config", None)
    num_labels = getattr(config, "num_labels", logits.shape[-1])
    problem = getattr(config, "problem_type", None)
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        if num_labels == 1:
            return F.mse_loss(logits.view(-1), labels.view(-1).to(logits.dtype), reduction="none")
        values = F.mse_loss(logits, labels.to(logits.dtype), reduction="none")
        return values.reshape(values.shape[0], -1).mean(1)
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1), reduction="none")
    values = F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none")
    return values.reshape(values.shape[0], -1).mean(1)


def per_example_hf_loss(
    model: nn.Module,
    outputs: Any,
    labels: Tensor,
    inputs: Mapping[str, Any],
    *,
    reduction: str = "mean",
) -> Tensor:
    """L_i, (B,), of a Hugging Face model's ``outputs`` (run without labels) against ``labels``.

    ``inputs`` are what the model was called with (``attention_mask`` is read).
    """
    logits = _logits(outputs)
    task = task_of(model)
    mask = inputs.get("attention_mask")
    if task == "sequence" or (task == "unknown" and logits.dim() == 2 and labels.dim() == 1):
        return _sequence_losses(model, logits, labels)
    if logits.dim() != 3 or labels.dim() != 2:
        raise ValueError(
            f"logits of shape {tuple(logits.shape)} and labels of shape {tuple(labels.shape)} "
            f"({type(_base_model(model)).__name__}, task {task!r}): expected (B, T, V) logits "
            "with (B, T) labels, or (B, C) with (B,); pass per_example_loss_func= to DPTrainer"
        )
    if task == "causal_lm":
        if mask is not None and mask.shape != labels.shape:
            mask = None  # e.g. a prefix (image tokens) the labels do not cover
        return per_example_cross_entropy(
            logits[:, :-1],
            labels[:, 1:],
            attention_mask=None if mask is None else mask[:, 1:],
            reduction=reduction,
        )
    if task == "unknown":
        raise ValueError(
            f"{type(_base_model(model)).__name__} is neither a causal LM nor a masked-LM, "
            "token-classification or encoder-decoder model, so whether its labels are shifted "
            "is unknown: pass per_example_loss_func= to DPTrainer"
        )
    # Tokens against their own labels; the encoder's attention mask does not describe
    # an encoder-decoder's decoder positions.
    use_mask = (
        mask if task == "tokens" and mask is not None and mask.shape == labels.shape else None
    )
    return per_example_cross_entropy(logits, labels, attention_mask=use_mask, reduction=reduction)
