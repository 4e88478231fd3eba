"""A tiny private training run for the distributed tests, checkpointed after every step.

    python tests/_distributed_run.py --out DIR [--steps 6] [--stall-at K] [--dropout P]
    torchrun --nproc_per_node 2 tests/_distributed_run.py --out DIR ...

Resumes from ``DIR/ckpt.pt`` when it exists. ``--stall-at K`` stops in the
middle of step K (after the clipped backward, before ``optimizer.step()``),
prints ``STALL <pid>`` and sleeps, so a test can kill the process there. At the end
rank 0 writes ``DIR/final.pt``: the flattened parameters and the ledger.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from dptrain.checkpoint import load_checkpoint, save_checkpoint
from dptrain.distributed import init_distributed, make_private_distributed
from dptrain.losses import per_example_cross_entropy
from dptrain.models import GPT, GPTConfig


def build(dropout: float = 0.0, init_seed: int = 0):
    """The tiny tied GPT (float64), its AdamW and 64 random sequences of 8 tokens."""
    torch.manual_seed(init_seed)
    cfg = GPTConfig(
        vocab_size=40,
        max_seq_len=8,
        n_layer=1,
        n_head=2,
        d_model=16,
        d_mlp=32,
        tie_embeddings=True,
        dropout=dropout,
    )
    model = GPT(cfg).double()
    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, 40, (64, 9), generator=g)
    data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2), data


def flat_parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def run(out: str, steps: int = 6, stall_at: int | None = None, dropout: float = 0.0) -> dict:
    """Train (resuming from ``out/ckpt.pt`` if present); return rank 0's final state."""
    ctx = init_distributed(timeout=30)
    model, opt, data = build(dropout, init_seed=0)
    private = make_private_distributed(
        model,
        opt,
        data,
        batch_size=16,
        max_grad_norm=0.5,
        steps=steps,
        noise_multiplier=1.0,
        global_physical_batch_size=4,
        seed=5,
    )
    ckpt = Path(out) / "ckpt.pt"
    if ckpt.exists():
        load_checkpoint(ckpt, private)
    for batch in private.data_loader:
        private.optimizer.zero_grad()
        for x, y in batch.chunks:
            private.backward(per_example_cross_entropy(model(x), y))
        if batch.step == stall_at:
            # One write per line: the two workers share the pipe, and print() may
            # write the text and the newline separately.
            sys.stdout.write(f"STALL {os.getpid()}\n")
            sys.stdout.flush()
            time.sleep(600)
        private.optimizer.step()
        save_checkpoint(ckpt, private)
        if ctx.is_main:
            sys.stdout.write(f"SAVED {batch.step}\n")
            sys.stdout.flush()
    final = {"params": flat_parameters(model), "ledger": private.ledger.state_dict()}
    if ctx.is_main:
        torch.save(final, Path(out) / "final.pt")
    return final


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--stall-at", type=int, default=None)
    parser.add_argument("--dropout", type=float, default=0.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    run(args.out, args.steps, args.stall_at, args.dropout)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
