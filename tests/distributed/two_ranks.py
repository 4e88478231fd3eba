"""The 2-process gloo run that the distributed and checkpoint tests share, and its reference.

Starting processes costs seconds on a small machine, so one spawn of 2 gloo
processes (:func:`spawn_two_ranks`, behind the session-scoped ``two_ranks``
fixture of ``tests/conftest.py``) runs every multi-process scenario; the tests
check its results against the one-process runs done here (:func:`single_process`).
"""

from __future__ import annotations

import datetime
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dptrain.checkpoint import load_checkpoint, save_checkpoint
from dptrain.clipping.precision import upcast
from dptrain.distributed import (
    DistributedConfigError,
    DistributedDPOptimizer,
    make_private_distributed,
    spawn,
)
from dptrain.losses import per_example_cross_entropy
from dptrain.optim import PrivacyBudgetExhaustedError
from dptrain.privacy_engine import make_private
from tests._distributed_run import build, flat_parameters

MODES = ("book_keeping", "ghost")
STEPS = 4
SAVE_AFTER = 2  # checkpoint after this many steps
SIGMA, C, SEED = 1.0, 0.5, 3
NOISE_SIGMA, NOISE_C, NOISE_BATCH = 1.5, 0.7, 10


def batch_schedule(step: int) -> int:
    """A growing batch size: q changes after two steps."""
    return 12 if step < 2 else 20


def config(mode: str) -> dict:
    return dict(
        batch_size=batch_schedule,
        max_grad_norm=C,
        steps=STEPS,
        noise_multiplier=SIGMA,
        mode=mode,
        seed=SEED,
    )


def train(private, model, stop_after: int | None = None, ckpt: Path | None = None) -> None:
    for batch in private.data_loader:
        private.optimizer.zero_grad()
        for x, y in batch.chunks:
            private.backward(per_example_cross_entropy(model(x), y))
        private.optimizer.step()
        if ckpt is not None and batch.step + 1 == SAVE_AFTER:
            save_checkpoint(ckpt, private)
        if stop_after is not None and batch.step + 1 == stop_after:
            return


# -- what every rank of the 2-process run does -------------------------------------------------


def _equivalence_and_resume(out: Path) -> dict:
    results = {}
    for mode in MODES:
        ckpt = out / f"ckpt-{mode}.pt"
        model, opt, data = build()
        private = make_private_distributed(
            model, opt, data, global_physical_batch_size=4, **config(mode)
        )
        train(private, model, ckpt=ckpt)
        full = flat_parameters(model)
        # A fresh run from another initialisation, resumed from the checkpoint.
        model, opt, data = build(init_seed=99)
        private2 = make_private_distributed(
            model, opt, data, global_physical_batch_size=4, **config(mode)
        )
        load_checkpoint(ckpt, private2)
        resumed_from = private2.optimizer.steps_taken
        train(private2, model)
        results[mode] = {
            "full": full,
            "ledger": private.ledger.state_dict(),
            "resumed": flat_parameters(model),
            "resumed_ledger": private2.ledger.state_dict(),
            "resumed_from": resumed_from,
            "metrics": private.optimizer.last_metrics,
        }
    return results


def _step_on_zero_losses(model: nn.Linear, lr: float, inputs: torch.Tensor) -> None:
    """One private step of ``model`` on losses that are all zero: the clipped sums are zero,
    so the step's gradient is rank 0's noise / (q N)."""
    private = make_private_distributed(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        torch.utils.data.TensorDataset(inputs),
        batch_size=NOISE_BATCH,
        max_grad_norm=NOISE_C,
        steps=1,
        noise_multiplier=NOISE_SIGMA,
        seed=11,
    )
    for batch in private.data_loader:
        private.optimizer.zero_grad()
        for (x,) in batch.chunks:
            private.backward(upcast(model(x)).mul(0.0).sum(1))
        private.optimizer.step()


def _noise_once(rank: int) -> dict:
    """Zero clipped gradients: after one SGD(lr=1) step from 0, weight = -noise / (q N)."""
    model = nn.Linear(300, 400, bias=False).double()
    nn.init.zeros_(model.weight)
    _step_on_zero_losses(model, 1.0, torch.randn(40, 300, dtype=torch.float64))
    noise = -model.weight.detach().flatten() * NOISE_BATCH

    # A bf16 model: the sums are reduced and noised in float32, then cast (p.grad bf16).
    lin16 = nn.Linear(30, 20, bias=False).bfloat16()
    _step_on_zero_losses(lin16, 0.0, torch.randn(40, 30).bfloat16())
    grad16 = lin16.weight.grad.detach().clone()

    # The budget is rank 0's: only rank 0 is told max_steps; both ranks stop together.
    lin = nn.Linear(4, 3)
    opt = DistributedDPOptimizer(
        torch.optim.SGD(lin.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=4.0,
        sample_rate=0.1,
        seed=0,
        max_steps=1 if rank == 0 else None,
    )
    opt.step()
    try:
        opt.step()
        stopped = "no error"
    except PrivacyBudgetExhaustedError as exc:
        stopped = str(exc)
    return {"noise": noise, "grad16": grad16, "stopped": stopped, "steps_taken": opt.steps_taken}


def _bad_input(rank: int) -> dict:
    out = {}
    model, opt, data = build()
    kwargs = dict(batch_size=16, max_grad_norm=1.0, steps=2, seed=0)
    try:  # rank 1 was given another sigma
        make_private_distributed(model, opt, data, noise_multiplier=1.0 + rank, **kwargs)
        out["mismatch"] = "no error"
    except DistributedConfigError as exc:
        out["mismatch"] = str(exc)
    try:  # 2 processes cannot share 5 records per chunk evenly
        make_private_distributed(
            model, opt, data, noise_multiplier=1.0, global_physical_batch_size=5, **kwargs
        )
        out["divide"] = "no error"
    except DistributedConfigError as exc:
        out["divide"] = str(exc)
    # Rank 1 never joins: rank 0 must fail after the group's timeout, not hang.
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if rank == 1:
        time.sleep(4)
        return out
    start = time.monotonic()
    try:
        make_private_distributed(model, opt, data, noise_multiplier=1.0, group=group, **kwargs)
        out["timeout"] = "no error"
    except Exception as exc:
        out["timeout"] = f"{type(exc).__name__}: {exc}"
    out["timeout_s"] = time.monotonic() - start
    return out


def _two_rank_worker(out: str) -> dict:
    rank = dist.get_rank()
    return {
        "equivalence": _equivalence_and_resume(Path(out)),
        "noise": _noise_once(rank),
        "bad_input": _bad_input(rank),
    }


def spawn_two_ranks(out: Path) -> list[dict]:
    """Run every scenario on 2 gloo processes (checkpoints written to ``out``); rank order."""
    return spawn(_two_rank_worker, 2, args=(str(out),), timeout=30, join_timeout=240)


def single_process(mode: str, stop_after: int | None = None):
    model, opt, data = build()
    private = make_private(model, opt, data, max_physical_batch_size=4, **config(mode))
    train(private, model, stop_after=stop_after)
    return model, private
