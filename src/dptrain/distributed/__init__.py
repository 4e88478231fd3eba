"""Multi-process data-parallel DP training on ``torch.distributed``, noise added once per step.

    ctx = init_distributed()                        # torchrun's environment, or one process
    model = GPT(cfg).to(ctx.device)
    private = make_private_distributed(model, torch.optim.AdamW(model.parameters()), data,
                                       batch_size=1024, max_grad_norm=1.0, steps=1000,
                                       noise_multiplier=1.0, max_physical_batch_size=32, seed=0)
    if os.path.exists("ckpt.pt"):
        load_checkpoint("ckpt.pt", private)         # model, optimizer, sampler, noise, ledger
    for batch in private.data_loader:               # this rank's share of the logical batch
        private.optimizer.zero_grad()
        for x, y in batch.chunks:
            private.backward(per_example_cross_entropy(model(x.to(ctx.device)), y.to(ctx.device)))
        private.optimizer.step()                    # all-reduce, noise once, step, ledger
        save_checkpoint("ckpt.pt", private)         # rank 0 writes; every rank takes part

Launch with ``torchrun --nproc_per_node N script.py`` (or run ``python script.py``:
without torchrun's environment the same code trains in one process), or from
Python with :func:`spawn` (N local processes; the tests use it).

The scheme (see ``docs/distributed.md`` for the argument that it is exact)
--------------------------------------------------------------------------

Sampling. Every rank runs the *same* :class:`~dptrain.data.PoissonBatchSampler`
over the *whole* dataset (same seed on every rank, so the same global Bernoulli
mask at every step), and keeps the positions ``rank, rank + W, rank + 2W, ...``
of the sorted logical batch (:func:`shard_indices`; W = world size). The union
over ranks is therefore exactly the logical batch one process would draw with
that seed: a Poisson sample of rate q of the whole dataset, disjointly split.
Splitting the realised batch by position (rather than by record index) gives
every rank ceil(B/W) or floor(B/W) records, so no rank waits for a luckier one;
the split is a deterministic function of the sampled set and releases nothing.
Each rank cuts its share into physical chunks of ``max_physical_batch_size``.

Clipping. Each rank clips per example with its own
:class:`~dptrain.clipping.ClippingEngine` (book-keeping or ghost mode, phantom
clipping of tied embeddings): ``p.grad`` holds the rank's sum of clipped
per-example gradients. The model is *not* wrapped in
``DistributedDataParallel``: its hooks would all-reduce (and average) the
unclipped gradients of every backward pass. The clipped sums are reduced by
:class:`DistributedDPOptimizer` with ``torch.distributed.all_reduce(SUM)`` on
flattened buckets, once per logical step.

Noise. Rank 0 adds N(0, sigma^2 C^2 I) to its clipped sum *before* the
all-reduce; the other ranks add nothing. The reduced sum is
``sum_r S_r + z = S + z`` with one draw z: std sigma*C, not sqrt(W) sigma*C.
Why rank 0 rather than "every rank adds the same shared-seed noise after the
all-reduce":

- the noise exists on one rank only, so nothing depends on W generators
  producing bit-identical numbers (not guaranteed across CPU instruction sets
  or GPU models); if they differed under the shared-seed scheme, the ranks'
  models would depend on several independent noise draws of the same sum, and
  the accountant's "one Gaussian draw per step" would no longer describe the
  training;
- every rank receives the same reduced buffer from the collective, so the
  parameters stay identical by construction;
- the exact un-noised global sum never exists in any process;
- the noise generator state, like the ledger, lives on rank 0 and is saved
  with rank 0's checkpoint.

Rank 0 draws the noise exactly as :class:`~dptrain.optim.DPOptimizer` does in
one process (same generator, seed, order and shapes), so W processes and one
process given the same seed produce the same parameters up to float rounding.
Every rank then divides by the expected batch size q N and steps its optimizer.

Ledger and stopping. Every rank records each step in its ledger (the same
(q, sigma) everywhere), but rank 0's is the one that counts: at start every
rank loads rank 0's ledger, rank 0 alone decides whether the budget allows
another step and sends that decision with the gradient all-reduce (one extra
number, no extra collective), so all ranks raise
:class:`~dptrain.optim.PrivacyBudgetExhaustedError` at the same step; rank 0's
ledger is saved in the checkpoint.

No hangs. :func:`init_distributed` sets a timeout (default 60 s) on the process
group, so a collective that a rank never joins fails with an error instead of
waiting forever. :func:`make_private_distributed` checks on every rank before
building anything: each rank's local errors and a fingerprint of its
configuration (batch size, q schedule, sigma or the target, C, seed, modes,
dataset size, model parameter count and layout, optimizer hyper-parameters,
library versions) are all-gathered, and any error or difference is raised on
every rank as :class:`DistributedConfigError`, naming the ranks.

Layout
------

- :mod:`~dptrain.distributed.context`: :func:`init_distributed`,
  :class:`DistributedContext`, :class:`DistributedConfigError`;
- :mod:`~dptrain.distributed.collectives`: object and flattened-tensor
  collectives, errors raised on every rank;
- :mod:`~dptrain.distributed.sampling`: :func:`shard_indices`,
  :class:`DistributedDPDataLoader`, :class:`RankBatch`;
- :mod:`~dptrain.distributed.optimizer`: :class:`DistributedDPOptimizer`;
- :mod:`~dptrain.distributed.fingerprint`: what the ranks must agree on;
- :mod:`~dptrain.distributed.setup`: :func:`make_private_distributed`;
- :mod:`~dptrain.distributed.launcher`: :func:`spawn`, :class:`DistributedRunError`;
- a model sharded with FSDP2 (``fully_shard``; ``docs/distributed.md``, "Sharded
  models"): :mod:`~dptrain.distributed.fsdp` (how the engine sees it),
  :mod:`~dptrain.distributed.sharded_sums` (clipped sums reduce-scattered into the
  shards), :mod:`~dptrain.distributed.sharded_optimizer` (:class:`ShardedDPOptimizer`:
  keyed noise on each rank's shards).

Checkpoints (:func:`save_checkpoint`, :func:`load_checkpoint`,
:class:`CheckpointError`) live in :mod:`dptrain.checkpoint`, as they serve
one-process runs as well; they are re-exported here.
"""

from __future__ import annotations

from typing import Any

# A constant, not in __all__; the recipes' launcher refers to it by this path.
from dptrain.distributed.context import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from dptrain.distributed.context import (
    DistributedConfigError,
    DistributedContext,
    init_distributed,
)
from dptrain.distributed.launcher import DistributedRunError, spawn
from dptrain.distributed.optimizer import DistributedDPOptimizer
from dptrain.distributed.sampling import DistributedDPDataLoader, RankBatch, shard_indices
from dptrain.distributed.setup import make_private_distributed
from dptrain.distributed.sharded_optimizer import ShardedDPOptimizer

__all__ = [
    "CheckpointError",
    "DistributedConfigError",
    "DistributedContext",
    "DistributedDPDataLoader",
    "DistributedDPOptimizer",
    "DistributedRunError",
    "RankBatch",
    "ShardedDPOptimizer",
    "init_distributed",
    "load_checkpoint",
    "make_private_distributed",
    "save_checkpoint",
    "shard_indices",
    "spawn",
]

_CHECKPOINT_NAMES = ("CheckpointError", "load_checkpoint", "save_checkpoint")


def __getattr__(name: str) -> Any:
    # dptrain.checkpoint builds on this package's collectives, so importing it here
    # eagerly would be circular whenever dptrain.checkpoint is imported first.
    if name in _CHECKPOINT_NAMES:
        from dptrain import checkpoint

        return getattr(checkpoint, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_CHECKPOINT_NAMES})
