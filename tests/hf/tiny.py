"""Tiny models and data for the DPTrainer tests (models built from configs, d = 16).

float32 like the models Trainer scripts train (tests/clipping/hf_zoo.py has float64
ones, d = 32, for the engine's exactness checks; the tests here use those where they
only need a model the engine refuses or an encoder-decoder).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

VOCAB = 32
SEQ = 8


def llama(seed: int = 0, layers: int = 1) -> Any:
    """A 1-layer Llama causal LM, hidden size 16, no dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config)


def gpt2_classifier(seed: int = 0, num_labels: int = 3) -> Any:
    """A 1-layer GPT-2 sequence classifier, n_embd 16, no dropout."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=16,
        n_layer=1,
        n_head=2,
        n_positions=32,
        num_labels=num_labels,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2ForSequenceClassification(config)


def lm_records(n: int = 40, seed: int = 0, pad_last: int = 2) -> list[dict[str, torch.Tensor]]:
    """Causal-LM records: random tokens, the last ``pad_last`` of every other record padded
    (attention 0, label -100)."""
    g = torch.Generator().manual_seed(seed)
    records = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (SEQ,), generator=g)
        mask = torch.ones(SEQ, dtype=torch.long)
        labels = ids.clone()
        if i % 2 and pad_last:
            ids[-pad_last:] = 0
            mask[-pad_last:] = 0
            labels[-pad_last:] = -100
        records.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return records


def classification_records(n: int = 40, seed: int = 0) -> list[dict[str, Any]]:
    """Sequence-classification records with an integer ``label`` (Trainer's collator renames it)."""
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "input_ids": torch.randint(3, VOCAB, (SEQ,), generator=g),
            "attention_mask": torch.ones(SEQ, dtype=torch.long),
            "label": int(torch.randint(0, 3, (1,), generator=g)),
        }
        for _ in range(n)
    ]


def training_args(output_dir: str, **overrides: Any) -> Any:
    """CPU TrainingArguments for fast tests (no reports, no progress bars, no saving)."""
    from transformers import TrainingArguments

    settings: dict[str, Any] = {
        "output_dir": output_dir,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 2,
        "max_steps": 4,
        "learning_rate": 0.05,
        "optim": "sgd",
        "lr_scheduler_type": "constant",
        # epsilon is computed at every logging step (a PLD evaluation, ~0.1 s)
        "logging_steps": 100,
        "report_to": [],
        "use_cpu": True,
        "save_strategy": "no",
        "disable_tqdm": True,
        "seed": 0,
    }
    settings.update(overrides)
    return TrainingArguments(**settings)


def quiet_transformers() -> None:
    """Keep transformers' info lines out of test output."""
    logging.getLogger("transformers").setLevel(logging.WARNING)
