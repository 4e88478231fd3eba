"""Small offline causal-LM pieces for tests: a byte-level BPE tokenizer with a chat
template, and a tiny Llama saved as a Hugging Face folder.

The tokenizer adds ``<s>`` before a text, ends texts with ``</s>``, pads with
``<pad>`` and renders chats with :data:`CHAT_TEMPLATE`; it is trained on a few
sentences (:data:`CORPUS` unless others are given), and byte-level BPE encodes
any text all the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["CHAT_TEMPLATE", "CORPUS", "SPECIALS", "make_small_tokenizer", "save_tiny_llama"]

# Each message on its own line; the loss is on an assistant turn's content and its
# "<|end|>\n" (what the turn adds after the generation prompt "<|assistant|>\n").
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIALS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
CORPUS = [
    "what is the answer? the answer is yes",
    "the cat sat on the mat. Summarise: a cat on a mat",
    "hello world, how are you today? fine thanks",
]


def make_small_tokenizer(
    chat_template: str | None = CHAT_TEMPLATE,
    pad: bool = True,
    corpus: Sequence[str] = CORPUS,
    vocab_size: int = 400,
):
    """A ``PreTrainedTokenizerFast`` built offline (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(corpus) * 4, trainer)
    core.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", core.token_to_id("<s>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>" if pad else None,
        chat_template=chat_template,
    )


def save_tiny_llama(
    folder: str | Path, tokenizer=None, *, tie: bool = True, layers: int = 2, seed: int = 0
) -> Path:
    """A randomly initialised ``LlamaForCausalLM`` (hidden 16, GQA 2:1) and its tokenizer,
    saved with ``save_pretrained`` into ``folder``; the input/output embedding tied by default,
    as SmolLM2's is."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_small_tokenizer() if tokenizer is None else tokenizer
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        tie_word_embeddings=tie,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    folder = Path(folder)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
