"""The DP optimizer of an FSDP2-sharded model: each rank noises the shards it owns.

By the step, each rank's ``p.grad`` holds its shard of the clipped sum reduced
over all ranks (:mod:`dptrain.distributed.sharded_sums`). Noise is added once
per coordinate, by the rank that owns the coordinate, so the noised update is
sum_r S_r + z with one Gaussian draw z of std sigma C per coordinate, as in
one process.

Where the noise comes from. Parameter ``name``'s flattened coordinates are cut into
blocks of :data:`NOISE_BLOCK`; block j's noise at ledger step t is drawn from a generator
seeded with SHA-256(seed, t, name, j) (:func:`noise_seed`, :func:`keyed_noise`). Each
rank draws the blocks its shard overlaps (a dim-0 shard is one contiguous range of the
flattened parameter) and keeps its shard's coordinates. So:

- no two ranks add the same draw (each adds the coordinates it owns, and the
  shards are disjoint), and no step reuses another's (t is the ledger's step:
  a continued ledger continues the keys too);
- the noised update does not depend on the number of ranks or the sharding: the
  blocks are fixed by the parameter, so 1, 2 or 4 processes given the same seed
  produce the same noise, coordinate by coordinate (tests/distributed/test_fsdp.py);
- there is no generator state to checkpoint: a resumed run redraws the same keys.

The cost: a rank draws its shard plus at most the two partial blocks at its shard's
ends, per parameter (a parameter smaller than a block is drawn whole by every rank that
holds part of it). A placement other than one dim-0 shard (not what ``fully_shard``
makes) falls back to drawing the whole parameter and keeping the shard's coordinates.

``secure_mode`` (noise from the OS's CSPRNG, :mod:`dptrain.secure_random`) has no
keys: each rank draws the noise of the coordinates it owns, and only those, with
:func:`~dptrain.secure_random.secure_normal` (the one-process secure draw), from its
own process's ``os.urandom``. Each coordinate is still noised once, by its owner;
the streams of different ranks and steps are independent draws of the kernel's
CSPRNG, never a function of a seed; and the noised update depends on the sharding only
through which rank drew which coordinate. Rank 0 draws the Poisson batches and
broadcasts them (:mod:`dptrain.distributed.sampling`).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from dptrain._checks import check_positive
from dptrain.accounting import PrivacyLedger
from dptrain.optim import DPOptimizer, PrivacyBudgetExhaustedError, StepMetrics
from dptrain.secure_random import secure_normal

__all__ = ["NOISE_BLOCK", "ShardedDPOptimizer", "keyed_noise", "noise_seed"]

#: Coordinates per noise key (module docstring): large enough that seeding a generator
#: per block costs nothing against the draw, small enough that a rank draws little
#: beyond its shard.
NOISE_BLOCK = 1 << 20


def noise_seed(seed: int, step: int, name: str, block: int = 0) -> int:
    """The generator seed of block ``block`` of parameter ``name``'s noise at ledger step
    ``step``: 63 bits of SHA-256 over (seed, step, name, block), so distinct (step, name,
    block) never share a stream."""
    key = f"dptrain/fsdp-noise/{seed}/{step}/{name}/{block}"
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") >> 1


def keyed_noise(
    seed: int,
    step: int,
    name: str,
    numel: int,
    start: int,
    stop: int,
    std: float,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Coordinates [start, stop) of parameter ``name``'s flattened noise N(0, std^2) at
    ledger step ``step`` (``numel`` coordinates in all): the same values whichever range
    is asked for, since each block of :data:`NOISE_BLOCK` has its own key."""
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"start={start}, stop={stop}: expected 0 <= start <= stop <= {numel}")
    out = torch.empty(stop - start, dtype=dtype, device=device)
    for j in range(start // NOISE_BLOCK, -(-stop // NOISE_BLOCK)):
        lo, hi = j * NOISE_BLOCK, min((j + 1) * NOISE_BLOCK, numel)
        gen = torch.Generator(device=device)
        gen.manual_seed(noise_seed(seed, step, name, j))
        block = torch.empty(hi - lo, dtype=dtype, device=device).normal_(0.0, std, generator=gen)
        a, b = max(lo, start), min(hi, stop)
        out[a - start : b - start] = block[a - lo : b - lo]
    return out


class ShardedDPOptimizer(DPOptimizer):
    """:class:`~dptrain.optim.DPOptimizer` for sharded (``DTensor``) parameters.

    ``step()`` on every rank after every rank's engine has added its chunks:

    1. rank 0 checks the budget (``max_steps``) and its decision is all-reduced, so
       every rank stops at the same step (:class:`~dptrain.optim.PrivacyBudgetExhaustedError`);
    2. each rank adds, to each shard it holds, that shard's coordinates of the keyed
       noise N(0, sigma^2 C^2 K^2) (module docstring), in float32 for a bf16 parameter,
       divides by K q N, casts to p's dtype and steps the wrapped optimizer (which updates
       the shards);
    3. the ledger records the step on every rank (the same (q, sigma) everywhere).

    Args:
        as for :class:`~dptrain.optim.DPOptimizer`, with:
        names: each trainable parameter's name (the noise key), by ``id(p)``.
        seed: the noise seed, an integer, the same on every rank.
        group: the process group the shards live on (default: the default group).

    ``last_metrics`` norms are over the whole model (one all-reduce of two numbers).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        sample_rate: float,
        names: dict[int, str],
        ledger: PrivacyLedger | None = None,
        seed: int | None = None,
        max_steps: int | None = None,
        group: Any = None,
        engine: Any = None,
        secure_mode: bool = False,
    ):
        if not secure_mode and (
            seed is None or isinstance(seed, bool) or not isinstance(seed, int)
        ):
            raise ValueError(
                f"seed={seed!r} is not allowed for a sharded model: expected an integer, the "
                "same on every rank (the noise is keyed by it; make_private_distributed shares "
                "rank 0's)"
            )
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            sample_rate=sample_rate,
            ledger=ledger,
            seed=None if secure_mode else seed,
            max_steps=max_steps,
            engine=engine,
            secure_mode=secure_mode,
        )
        self.names = dict(names)
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        missing = [tuple(p.shape) for p in self.params() if id(p) not in self.names]
        if missing:
            raise ValueError(
                f"names= lacks parameters of shapes {missing}: every parameter the optimizer "
                "updates needs its name (the key of its noise)"
            )

    def all_reduce_clipped_sums(self) -> None:
        """Nothing to do: the engine's store reduced each sum into its shard already."""

    def add_noise(self, loss_scale: float = 1.0) -> StepMetrics:
        """p.grad <- (reduced shard + the shard's noise) / (K q N) for every parameter."""
        k = check_positive("loss_scale", loss_scale)
        std = self.noise_multiplier * self.max_grad_norm * k
        params = [p for p in self.params() if p.requires_grad]
        sums = [self.clipped_sum(p) for p in params]
        step = self.ledger.num_steps
        signal_sq = torch.zeros((), dtype=torch.float64)
        noise_sq = torch.zeros((), dtype=torch.float64)
        for p, s in zip(params, sums, strict=True):
            noise = self._noise(p, s, std, step)
            signal_sq += _local_sq(s)
            noise_sq += _local_sq(noise)
            s.add_(noise).div_(k * self.expected_batch_size)
            if s is not p.grad:  # cast to p's dtype after the noise (post-processing)
                p.grad = s.to(p.dtype)
        self._sums.clear()
        if self.engine is not None:
            self.engine.release_sums()
        totals = torch.stack([signal_sq, noise_sq]).to(self._collective_device())
        if dist.is_initialized():
            dist.all_reduce(totals, group=self.group)
        return StepMetrics(
            step=self.steps_taken,
            sample_rate=self.sample_rate,
            noise_multiplier=self.noise_multiplier,
            clipped_sum_norm=math.sqrt(float(totals[0])) / k,
            noise_norm=math.sqrt(float(totals[1])) / k,
        )

    def _noise(self, p: nn.Parameter, s: Tensor, std: float, step: int) -> Tensor:
        """This rank's coordinates of parameter p's noise at ``step``, laid out as ``s``."""
        local = s.to_local() if isinstance(s, DTensor) else s
        if self.secure_mode:
            mine = secure_normal(local.shape, std, dtype=local.dtype, device=local.device)
            if not isinstance(s, DTensor):
                return mine
            return DTensor.from_local(
                mine, s.device_mesh, s.placements, run_check=False, shape=s.shape, stride=s.stride()
            )
        name = self.names[id(p)]
        rows = _dim0_rows(s) if isinstance(s, DTensor) else (0, s.shape[0] if s.dim() else 1)
        if rows is not None:  # this rank's rows: one range of the flattened parameter
            per_row = math.prod(s.shape[1:])
            mine = keyed_noise(
                self.seed,
                step,
                name,
                s.numel(),
                rows[0] * per_row,
                rows[1] * per_row,
                std,
                dtype=local.dtype,
                device=local.device,
            ).view(local.shape)
            if not isinstance(s, DTensor):
                return mine
            return DTensor.from_local(
                mine, s.device_mesh, s.placements, run_check=False, shape=s.shape, stride=s.stride()
            )
        # another layout: the whole draw, then Replicate -> the shard's placements keeps
        # this rank's coordinates (no communication)
        full = keyed_noise(
            self.seed,
            step,
            name,
            s.numel(),
            0,
            s.numel(),
            std,
            dtype=local.dtype,
            device=local.device,
        ).view(s.shape)
        whole = DTensor.from_local(
            full, s.device_mesh, [Replicate()] * s.device_mesh.ndim, run_check=False
        )
        return whole.redistribute(s.device_mesh, s.placements)

    def step(self, closure=None, loss_scale: float = 1.0) -> StepMetrics:  # type: ignore[override]
        """Noise each shard once, step every rank's shards, record the step."""
        if closure is not None:
            raise ValueError(
                "closure= is not supported: a DP step must not re-evaluate the loss on the batch"
            )
        stop = self.rank == 0 and self.max_steps is not None and self.steps_taken >= self.max_steps
        flag = torch.tensor([1.0 if stop else 0.0], device=self._collective_device())
        if dist.is_initialized():
            dist.all_reduce(flag, group=self.group)
        if float(flag) != 0.0:
            self.zero_grad(set_to_none=True)
            raise PrivacyBudgetExhaustedError(
                f"the privacy budget allows {self.max_steps} steps and all are taken; rank 0 "
                f"stopped every rank (epsilon is computed from the ledger: {self.ledger!r})"
            )
        return super().step(None, loss_scale)

    def _collective_device(self) -> torch.device:
        """Where this step's small collectives run (NCCL takes CUDA tensors only)."""
        for p in self.params():
            return (p.to_local() if isinstance(p, DTensor) else p).device
        return torch.device("cpu")

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + ", sharded)"


def _dim0_rows(s: DTensor) -> tuple[int, int] | None:
    """The rows [r0, r1) of ``s`` this rank holds, for one dim-0 shard on a 1-D mesh (what
    fully_shard makes: torch.chunk's split, ceil(n / W) rows a rank, the last ones
    shorter or empty); None for any other layout, or a local shard that is not exactly
    those rows, contiguous."""
    if s.device_mesh.ndim != 1 or len(s.placements) != 1:
        return None
    placement = s.placements[0]
    if not (isinstance(placement, Shard) and placement.dim == 0) or s.dim() == 0:
        return None
    n, world = s.shape[0], s.device_mesh.size()
    rank = s.device_mesh.get_local_rank()
    size = -(-n // world)
    r0 = min(rank * size, n)
    r1 = min(r0 + size, n)
    local = s.to_local()
    if tuple(local.shape) != (r1 - r0, *s.shape[1:]) or not local.is_contiguous():
        return None
    return r0, r1


def _local_sq(t: Tensor) -> Tensor:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.detach().double().pow(2).sum()
