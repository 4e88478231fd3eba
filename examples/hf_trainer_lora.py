"""LoRA fine-tuning of SmolLM2 with the Hugging Face Trainer, made differentially private.

This is a stock transformers + peft script. Making it private means importing DPTrainer,
building it instead of Trainer and giving it the privacy arguments (the lines marked
``# DP`` below):

    -from transformers import Trainer
    +from dptrain.hf import DPTrainer, PrivacyArguments                           # DP
    ...
    -trainer = Trainer(model=model, args=training_args, train_dataset=train,
    -                  data_collator=collator)
    +trainer = DPTrainer(model=model, args=training_args, train_dataset=train,   # DP
    +                    data_collator=collator,
    +                    privacy_args=PrivacyArguments(target_epsilon=8.0,       # DP
    +                                                  target_delta=1e-5, max_grad_norm=1.0))

Everything else (TrainingArguments, the LoRA config, the collator, ``train()``,
``save_model()``, ``generate``) is unchanged. The records are synthetic support notes
of 48 customers; ``--user-level`` protects each customer's notes together
(``PrivacyArguments(group_by="user_id")``) instead of each note.

    python examples/hf_trainer_lora.py --output-dir runs/hf-lora      # SmolLM2-135M, CPU
    python examples/hf_trainer_lora.py --tiny --max-steps 3           # a tiny Llama, seconds

The model is the packaged SmolLM2-135M-Instruct (``dptrain.models.load_pretrained_lm``,
offline); with ``--tiny``, or when that package is not installed, a 1-layer Llama built
from a config and a character tokenizer whose vocabulary is fixed in advance (a
vocabulary learnt from the private texts would itself leak them).
"""

from __future__ import annotations

import argparse
import logging
import random
import string
from typing import Any

import datasets
import peft
from transformers import (
    DataCollatorForLanguageModeling,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    TrainingArguments,
)

from dptrain.hf import DPTrainer, PrivacyArguments  # DP (was: from transformers import Trainer)
from dptrain.models import load_pretrained_lm, smollm2_available

CUSTOMERS = 48
DEVICES = ["router", "laptop", "printer", "phone", "tablet", "smart TV"]
PROBLEMS = ["drops the connection", "will not boot", "shows error 42", "overheats", "is slow"]
FIXES = ["a firmware update", "a factory reset", "a new cable", "replacing the battery"]


def support_notes(seed: int = 0) -> list[dict[str, Any]]:
    """Synthetic support notes, 1 to 5 per customer: ``text`` and ``user_id``."""
    rng = random.Random(seed)
    notes = []
    for customer in range(CUSTOMERS):
        for _ in range(rng.randint(1, 5)):
            text = (
                f"Customer {customer:03d}: the {rng.choice(DEVICES)} {rng.choice(PROBLEMS)}. "
                f"Solved by {rng.choice(FIXES)}."
            )
            notes.append({"text": text, "user_id": f"c{customer:03d}"})
    return notes


def char_tokenizer() -> PreTrainedTokenizerFast:
    """A character tokenizer over a fixed alphabet (no vocabulary learnt from the data)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    alphabet = list(string.ascii_letters + string.digits + string.punctuation + " ")
    vocab = {token: i for i, token in enumerate(specials + alphabet)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def load_model(tiny: bool, num_layers: int | None) -> tuple[Any, Any]:
    """SmolLM2 and its tokenizer, or a 1-layer Llama (hidden 16) with a character tokenizer."""
    if not tiny and smollm2_available():
        model, tokenizer = load_pretrained_lm(num_layers=num_layers)
        return model, tokenizer
    tokenizer = char_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config), tokenizer


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="runs/hf-lora")
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama from a config")
    parser.add_argument("--num-layers", type=int, default=None, help="keep SmolLM2's first N")
    parser.add_argument("--epochs", type=float, default=3.0)
    parser.add_argument("--max-steps", type=int, default=-1)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--user-level", action="store_true", help="protect each customer")
    parser.add_argument("--seed", type=int, default=None, help="sampling and noise seed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    model, tokenizer = load_model(args.tiny, args.num_layers)
    model = peft.get_peft_model(
        model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    model.print_trainable_parameters()

    train = datasets.Dataset.from_list(support_notes()).map(
        lambda r: tokenizer(r["text"] + tokenizer.eos_token, truncation=True, max_length=64),
        remove_columns=["text"],
    )
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=4,  # expected logical batch 32 (Poisson-sampled)
        num_train_epochs=args.epochs,
        max_steps=args.max_steps,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        logging_steps=5,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    privacy_args = PrivacyArguments(  # DP
        target_epsilon=args.epsilon,
        target_delta=1e-5,
        max_grad_norm=1.0,
        group_by="user_id" if args.user_level else None,
        seed=args.seed,
    )
    trainer = DPTrainer(  # DP (was: Trainer)
        model=model,
        args=training_args,
        train_dataset=train,
        data_collator=collator,
        privacy_args=privacy_args,  # DP
    )
    trainer.train()
    trainer.save_model()  # LoRA adapter + privacy.json + the model card's privacy section
    tokenizer.save_pretrained(args.output_dir)

    prompt = tokenizer("Customer 007: the", return_tensors="pt")
    output = trainer.model.generate(**prompt, max_new_tokens=20, do_sample=False)
    sample = tokenizer.decode(output[0], skip_special_tokens=True)
    epsilon = trainer.epsilon()
    print(f"epsilon = {epsilon:.3f} at delta = 1e-5 per {trainer.privacy_plan.privacy_unit}")
    print(f"sample: {sample!r}")
    return {
        "epsilon": epsilon,
        "steps": trainer.state.global_step,
        "privacy_unit": trainer.privacy_plan.privacy_unit,
        "output_dir": args.output_dir,
        "sample": sample,
    }


if __name__ == "__main__":
    main()
