"""Decode a `train table2text` run's saved LoRA model again: precision, batch, beams.

    python benchmarks/e2e_decode.py runs/e2e-full/epsnull --amp off
    python benchmarks/e2e_decode.py runs/e2e-grid/epsnull --tables 400 --batch-size 128
    python benchmarks/e2e_decode.py runs/e2e-grid/epsnull --tables 200 --beams 5

Loads the run's config.yaml and adapter (``model/``), decodes its test tables (the first
``--tables``) with its decode settings unless overridden, and prints one JSON line: the
wall time and BLEU / ROUGE-L. Behind decoding in float32 whatever the run's ``amp``,
in batches of 128, and the beam-5 figures on a subset (docs/lm.md, "E2E with a
pretrained model").
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dptrain.config import load_config
from dptrain.data.e2e import load_e2e
from dptrain.recipes.table2text import (
    Table2TextConfig,
    _pretrained_model,
    decode,
    group_references,
    score_generations,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a table2text run folder with model/")
    parser.add_argument("--amp", choices=("off", "bf16"), default="off")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=None, help="default: the run's")
    parser.add_argument("--tables", type=int, default=None, help="the first N test tables")
    parser.add_argument("--merge", action="store_true", help="merge the LoRA weights first")
    parser.add_argument("--beams", type=int, default=1, help="beam size (1: greedy)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(Table2TextConfig, args.run / "config.yaml")
    if cfg.pretrained is None or cfg.lora_r == 0:
        raise SystemExit(f"{args.run}: expected a LoRA run of a pretrained model")
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    model, tokenizer, _ = _pretrained_model(cfg)
    set_peft_model_state_dict(model, load_file(args.run / "model" / "adapter_model.safetensors"))
    model.eval()
    if args.merge:
        model = model.merge_and_unload()
    splits = load_e2e(cfg.data, valid_fraction=cfg.valid_fraction, seed=cfg.split_seed)
    grouped = group_references(splits.test)[: args.tables or cfg.max_test_tables]
    t0 = time.perf_counter()
    texts = decode(
        model,
        tokenizer,
        [t for t, _ in grouped],
        num_beams=args.beams,
        max_new_tokens=cfg.max_new_tokens,
        no_repeat_ngram_size=cfg.no_repeat_ngram_size,
        batch_size=args.batch_size or cfg.eval_batch_size,
        batching=cfg.decode_batching,
        amp=args.amp,
    )
    wall = time.perf_counter() - t0
    scores = score_generations(texts, [r for _, r in grouped])
    print(
        json.dumps(
            {
                "amp": args.amp,
                "merged": args.merge,
                "beams": args.beams,
                "batch_size": args.batch_size or cfg.eval_batch_size,
                "tables": len(grouped),
                "decode_s": wall,
                **scores,
            }
        )
    )


if __name__ == "__main__":
    main()
