"""The DP optimizer over W processes: clipped sums all-reduced, noise added once on rank 0."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from dptrain._checks import check_positive
from dptrain.accounting import PrivacyLedger
from dptrain.distributed.collectives import _flat_collective
from dptrain.distributed.context import _rank_and_world
from dptrain.generators import canonical_device, restore_generator
from dptrain.noise import add_noise_, divide_and_publish, noise_blocks, total_norm
from dptrain.optim import DPOptimizer, PrivacyBudgetExhaustedError, StepMetrics

__all__ = ["DistributedDPOptimizer"]


class DistributedDPOptimizer(DPOptimizer):
    """:class:`~dptrain.optim.DPOptimizer` over W processes: all-reduce, noise once on rank 0.

    ``step()`` on every rank, after every rank's engine has added its clipped
    sums into ``p.grad``:

    1. rank 0 checks the budget (``max_steps``, its ledger) and, if a step is
       allowed, adds N(0, sigma^2 C^2 K^2) to its clipped sums (K: loss scale),
       drawn as the one-process optimizer draws it (float32 for a bf16/fp16
       parameter: the engine's float32 sum; ``p.grad`` gets the result cast);
    2. all ranks all-reduce (SUM) the gradients in flattened buckets, with
       rank 0's stop flag alongside; if rank 0 said stop, every rank raises
       :class:`~dptrain.optim.PrivacyBudgetExhaustedError`;
    3. every rank divides by K q N, steps the wrapped optimizer and records the
       step in its ledger (rank 0's ledger is the one checkpoints keep).

    With W = 1 this is exactly :class:`~dptrain.optim.DPOptimizer`.

    Args:
        optimizer, noise_multiplier, max_grad_norm, expected_batch_size,
        sample_rate, ledger, max_steps: as for DPOptimizer (``max_steps`` is
            read on rank 0 only).
        seed: the noise seed (rank 0 draws the noise). Give every rank the same
            value; with W > 1 an integer is required.
        group: the process group (default: the default group).
        bucket_cap_mb: size of the flattened all-reduce buckets.
        engine: the clipping engine, as for DPOptimizer (gradients checked before the step).

    ``last_metrics`` is exact on rank 0 (the clipped-sum norm is recovered by
    redrawing the noise from the generator state it started from); on the
    other ranks, which never see the noise, its norms are NaN.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        sample_rate: float,
        ledger: PrivacyLedger | None = None,
        seed: int | None = None,
        max_steps: int | None = None,
        group: Any = None,
        bucket_cap_mb: float = 25.0,
        engine: Any = None,
    ):
        self.rank, self.world_size = _rank_and_world(group)
        if self.world_size > 1 and (
            seed is None or isinstance(seed, bool) or not isinstance(seed, int)
        ):
            raise ValueError(
                f"seed={seed!r} is not allowed with world_size={self.world_size}: expected an "
                "integer, the same on every rank (make_private_distributed shares rank 0's)"
            )
        super().__init__(
            optimizer,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            expected_batch_size=expected_batch_size,
            sample_rate=sample_rate,
            ledger=ledger,
            seed=seed,
            max_steps=max_steps,
            engine=engine,
        )
        self.group = group
        self.bucket_cap_bytes = int(check_positive("bucket_cap_mb", bucket_cap_mb) * 2**20)

    def all_reduce_clipped_sums(self) -> None:
        """Refused with W > 1: call :meth:`step`, which reduces and adds the noise once."""
        if self.world_size > 1:
            raise RuntimeError(
                "all_reduce_clipped_sums() is not allowed on its own with world_size > 1: call "
                "step(), which adds the noise on rank 0 before the all-reduce"
            )

    def add_noise(self, loss_scale: float = 1.0) -> StepMetrics:
        """Refused with W > 1 (noise on every rank would be sqrt(W) too much): call :meth:`step`."""
        if self.world_size > 1:
            raise RuntimeError(
                "add_noise() is not allowed on its own with world_size > 1: every rank would add "
                "noise; call step(), which adds it once"
            )
        return super().add_noise(loss_scale)

    def step(self, closure=None, loss_scale: float = 1.0) -> StepMetrics:  # type: ignore[override]
        """All-reduce the clipped sums with rank 0's noise, step every rank, record the step."""
        if self.world_size == 1:
            return super().step(closure, loss_scale)
        if closure is not None:
            raise ValueError(
                "closure= is not supported: a DP step must not re-evaluate the loss on the batch"
            )
        k = check_positive("loss_scale", loss_scale)
        self.check_clipped_gradients()
        params = [p for p in self.params() if p.requires_grad]
        self._sums.clear()
        # at least float32 (a bf16 parameter's float32 sum): reduced and noised so, cast after
        sums = [self.clipped_sum(p) for p in params]
        device = params[0].device if params else torch.device("cpu")
        stop = self.rank == 0 and self.max_steps is not None and self.steps_taken >= self.max_steps
        std = self.noise_multiplier * self.max_grad_norm * k
        start_states: dict[torch.device, Tensor] = {}
        noise_sq = math.nan
        if self.rank == 0 and not stop:
            for p in params:
                start_states.setdefault(p.device, self._generator_for(p.device).get_state())
            noise_sq = total_norm(add_noise_(sums, std, self._generator_for)) ** 2
        # Rank 0's decision rides in the first gradient bucket (same device and dtype).
        dtype = sums[0].dtype if sums else torch.float32
        flag = torch.tensor([1.0 if stop else 0.0], dtype=dtype, device=device)
        group = self.group
        _flat_collective(
            [flag, *sums],
            self.bucket_cap_bytes,
            lambda flat: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group, async_op=True),
        )
        if float(flag) != 0.0:
            # The reduced sums hold every rank's un-noised data: drop them.
            self.zero_grad(set_to_none=True)
            raise PrivacyBudgetExhaustedError(
                f"the privacy budget allows {self.max_steps} steps and all are taken; rank 0 "
                f"stopped every rank (epsilon is computed from rank 0's ledger: {self.ledger!r})"
            )
        signal_sq = math.nan
        if self.rank == 0:
            signal_sq = self._signal_sq(params, sums, start_states, std)
        divide_and_publish(params, sums, k * self.expected_batch_size)
        self._sums.clear()
        if self.engine is not None:
            self.engine.release_sums()
        self.original_optimizer.step()
        self.ledger.record(self.sample_rate, self.noise_multiplier)
        metrics = StepMetrics(
            step=self.steps_taken,
            sample_rate=self.sample_rate,
            noise_multiplier=self.noise_multiplier,
            clipped_sum_norm=math.sqrt(max(signal_sq, 0.0)) / k
            if not math.isnan(signal_sq)
            else math.nan,
            noise_norm=math.sqrt(noise_sq) / k if not math.isnan(noise_sq) else math.nan,
        )
        self.steps_taken += 1
        self.last_metrics = metrics
        return metrics

    def _signal_sq(
        self,
        params: list[nn.Parameter],
        sums: list[Tensor],
        start_states: dict[torch.device, Tensor],
        std: float,
    ) -> float:
        """||reduced sum - noise||^2, redrawing the noise from the states it started from."""
        gens = {}
        for d, state in start_states.items():
            gens[canonical_device(d)] = restore_generator(torch.Generator(device=d), state)
        total = 0.0
        for block, noise in noise_blocks(sums, std, lambda d: gens[canonical_device(d)]):
            for i, z in zip(block, noise, strict=True):
                total += _sq_norm(sums[i].detach() - z)
        return total

    def load_state_dict(self, state: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a DPOptimizer state; CUDA noise generators follow this rank's CUDA device."""
        cuda = [p.device for p in self.params() if p.device.type == "cuda"]
        gens = {}
        for key, gen_state in state["generators"].items():
            if torch.device(key).type == "cuda" and cuda:
                key = str(cuda[0])
            gens[key] = gen_state
        super().load_state_dict({**state, "generators": gens})

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", rank={self.rank}, world_size={self.world_size})"


def _sq_norm(t: Tensor) -> float:
    t = t.detach()
    if t.dtype in (torch.float16, torch.bfloat16):
        t = t.float()
    return float(torch.linalg.vector_norm(t)) ** 2
