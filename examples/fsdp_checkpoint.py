"""A private FSDP2 run that checkpoints every step, survives being stopped, and is consolidated.

    torchrun --standalone --nproc_per_node 2 examples/fsdp_checkpoint.py --out runs/fsdp \\
        --stop-after 2                     # stops after step 2, as a killed run would
    torchrun --standalone --nproc_per_node 2 examples/fsdp_checkpoint.py --out runs/fsdp
                                           # resumes from runs/fsdp/ckpt at step 2
    dptrain consolidate runs/fsdp/ckpt runs/fsdp/model   # Hugging Face folder + privacy.json

The model is a small tied Llama built from a config, sharded the usual way
(``fully_shard`` per decoder layer, then the root); the records are random token
sequences. The lines that make the run resumable are marked ``# ckpt``: load the
checkpoint if there is one, save after every step. A sharded run's checkpoint is a
directory (each rank writes its own shards); ``save_checkpoint`` replaces it atomically,
so a run killed at any moment resumes from its last completed save.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

from dptrain.checkpoint import load_checkpoint, save_checkpoint
from dptrain.distributed import init_distributed, make_private_distributed
from dptrain.losses import per_example_cross_entropy

VOCAB, SEQ, RECORDS = 256, 32, 512


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/fsdp", help="run folder (the checkpoint: OUT/ckpt)")
    parser.add_argument("--steps", type=int, default=4, help="private steps in all")
    parser.add_argument("--stop-after", type=int, help="stop after this step (a killed run)")
    args = parser.parse_args()
    ctx = init_distributed()
    logging.basicConfig(
        level=logging.INFO if ctx.rank == 0 else logging.WARNING, format="%(message)s"
    )

    torch.manual_seed(0)  # the same initial model on every rank, before sharding
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=True,
        )
    )
    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)

    ids = torch.randint(0, VOCAB, (RECORDS, SEQ + 1), generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
    private = make_private_distributed(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        data,
        batch_size=64,
        max_grad_norm=1.0,
        steps=args.steps,
        target_epsilon=8.0,
        target_delta=1e-5,
        max_physical_batch_size=16,
        seed=0,
    )
    ckpt = Path(args.out) / "ckpt"
    if ckpt.exists():  # ckpt
        load_checkpoint(ckpt, private)  # ckpt
    for batch in private.data_loader:
        private.optimizer.zero_grad()
        for x, y in batch.chunks:
            logits = model(input_ids=x.to(ctx.device)).logits
            private.backward(per_example_cross_entropy(logits, y.to(ctx.device)))
        private.optimizer.step()
        save_checkpoint(ckpt, private)  # ckpt
        if ctx.rank == 0:
            print(f"step {batch.step + 1}: epsilon {private.epsilon():.3f}, saved {ckpt}")
        if args.stop_after is not None and batch.step + 1 == args.stop_after:
            break


if __name__ == "__main__":
    main()
