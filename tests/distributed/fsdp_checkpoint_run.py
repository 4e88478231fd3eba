"""The FSDP2 runs that tests/distributed/test_fsdp_checkpoint.py compares (2 gloo processes).

One training run, several ways: STEPS noised Adam steps on the tied Llama of
:mod:`tests.distributed.fsdp_run` with attention dropout (so every rank's RNG state
matters), sharded per decoder layer and at the root. :func:`first_spawn` trains it
without checkpoints, with a checkpoint after every step, and stopped after STOP_AFTER
steps (the killed run); :func:`second_spawn` is a fresh group of processes that
resumes the stopped run to STEPS. Every rank returns full (gathered) parameters.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dptrain.checkpoint import load_checkpoint, save_checkpoint
from dptrain.distributed import make_private_distributed
from tests.distributed.fsdp_run import data, full, llama, loss_of, shard

STEPS, STOP_AFTER = 3, 1
SIGMA, C, SEED, DELTA = 1.0, 0.05, 11, 1e-5


def build(noise_multiplier: float = SIGMA, lora: bool = False):
    """A fresh sharded model, its Adam and its private training (same seed: same run)."""
    model = shard(llama(lora))
    base = model.get_base_model() if lora else model
    for layer in base.model.layers:  # dropout draws from each rank's torch RNG
        layer.self_attn.attention_dropout = 0.1
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    private = make_private_distributed(
        model,
        opt,
        data(),
        batch_size=9,
        max_grad_norm=C,
        steps=STEPS,
        noise_multiplier=noise_multiplier,
        target_delta=DELTA,
        max_physical_batch_size=3,
        seed=SEED,
    )
    return model, private


def train(model: nn.Module, private, ckpt: Path | None = None, stop_after: int | None = None):
    for batch in private.data_loader:
        private.optimizer.zero_grad()
        for x, y, w in batch.chunks:
            private.backward(loss_of(model, x, y) * w)
        private.optimizer.step()
        if ckpt is not None:
            save_checkpoint(ckpt, private, extra={"step": batch.step + 1})
        if stop_after is not None and batch.step + 1 == stop_after:
            return


def result(model: nn.Module, private) -> dict:
    return {
        "params": {n: full(p) for n, p in model.named_parameters()},
        "ledger": private.ledger.state_dict(),
        "steps": private.optimizer.steps_taken,
    }


def _refusal(call) -> str:
    try:
        call()
    except Exception as exc:  # the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return ""


def first_spawn(out: str) -> dict:
    """Uninterrupted (no checkpoint), uninterrupted saving every step, stopped after
    STOP_AFTER steps (saving every step, the first save before any step), LoRA saving
    every step (for consolidation); refusals."""
    out_dir = Path(out)
    model, private = build()
    train(model, private)
    plain = result(model, private)

    model, private = build()
    train(model, private, ckpt=out_dir / "full")
    saving = result(model, private)

    model, private = build()
    save_checkpoint(out_dir / "stopped", private)  # step 0: Adam has no state yet
    train(model, private, ckpt=out_dir / "stopped", stop_after=STOP_AFTER)
    stopped = result(model, private)

    model, private = build(lora=True)
    train(model, private, ckpt=out_dir / "lora")
    lora = result(model, private)

    user_file, user_dir = out_dir / "notes.txt", out_dir / "mine"
    refusals = {
        "file": _refusal(lambda: save_checkpoint(user_file, private)),
        "directory": _refusal(lambda: save_checkpoint(user_dir, private)),
        "one_file_checkpoint": _refusal(lambda: load_checkpoint(out_dir / "run.pt", private)),
    }
    return {
        "plain": plain,
        "saving": saving,
        "stopped": stopped,
        "lora": lora,
        "refusals": refusals,
    }


def second_spawn(out: str) -> dict:
    """Fresh processes: resume the stopped run to STEPS; a run of another sigma refused."""
    out_dir = Path(out)
    model, private = build()
    extra = load_checkpoint(out_dir / "stopped", private)
    resumed_at = private.ledger.num_steps
    train(model, private)
    resumed = result(model, private)
    _, other = build(noise_multiplier=2 * SIGMA)
    refusal = _refusal(lambda: load_checkpoint(out_dir / "stopped", other))
    return {"resumed": resumed, "resumed_at": resumed_at, "extra": extra, "refusal": refusal}


def other_world_spawn(out: str) -> dict:
    """Another world size resumes the 2-rank stopped run: its full parameters right after
    loading (DCP resharded them), and the ledger once it has trained to STEPS."""
    model, private = build()
    load_checkpoint(Path(out) / "stopped", private)
    loaded = result(model, private)
    train(model, private)
    return {"loaded": loaded, "final": result(model, private)}
