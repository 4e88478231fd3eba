"""DP optimizers: clipped sum + Gaussian noise once per logical batch, then any torch step.

``DPOptimizer`` wraps SGD, Adam, AdamW or any ``torch.optim.Optimizer``. During
a logical batch the clipping engine accumulates sum_i c_i grad_i into each
``p.grad`` (over as many physical chunks as needed); :meth:`DPOptimizer.step`
then

1. all-reduces the clipped sums (a no-op in one process; the hook the
   data-parallel trainer overrides),
2. adds N(0, sigma^2 C^2 I) once (Abadi et al. 2016; Li et al. 2022 Alg. 1),
   in at least float32 (a bf16 parameter's sum is the engine's float32 one;
   the cast to bf16 comes after the noise),
3. divides by the expected batch size q N (not the realised one, which would
   leak the batch size),
4. runs the wrapped optimizer's step and records the step in the ledger.

Noise comes from a generator seeded from the OS unless a seed is given; the
seed used is kept in ``seed`` so that it can be logged.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dptrain._checks import check_int, check_positive, check_sample_rate
from dptrain.accounting import PrivacyLedger
from dptrain.clipping.engine import ClippingEngine, ClipStats
from dptrain.clipping.precision import LOW_PRECISION, upcast
from dptrain.generators import canonical_device, restore_generator
from dptrain.noise import add_noise_, divide_and_publish, total_norms
from dptrain.secure_random import secure_normal

__all__ = ["DPOptimizer", "PrivacyBudgetExhaustedError", "StepMetrics", "noisy_clipped_gradient"]

log = logging.getLogger(__name__)


class PrivacyBudgetExhaustedError(RuntimeError):
    """Raised by a step that would go past the steps the privacy budget allows."""


@dataclass
class StepMetrics:
    """What one private step did (log these)."""

    step: int
    sample_rate: float
    noise_multiplier: float
    clipped_sum_norm: float
    """||sum_i c_i g_i|| before noise."""
    noise_norm: float
    """||z|| of the Gaussian noise added."""

    @property
    def gradient_snr(self) -> float:
        """||clipped sum|| / ||noise|| (Anil et al. 2021 §5, gradient-SNR)."""
        return self.clipped_sum_norm / self.noise_norm if self.noise_norm > 0 else math.inf


def _norms(tensors: list[Tensor]) -> list[Tensor]:
    """L2 norm of each tensor (float32 or wider: the sums to noise are), as tensors without
    a graph: no host sync."""
    with torch.no_grad():
        return list(torch._foreach_norm(tensors)) if tensors else []


def _sum_to_noise(engine: ClippingEngine | None, p: torch.nn.Parameter) -> Tensor:
    """The clipped sum of ``p`` to noise, in at least float32: ``p.grad`` itself for a
    float32/float64 parameter (made zero if None), a float32 tensor for a float16/bfloat16
    one (the engine's float32 sum; :func:`dptrain.noise.divide_and_publish` casts after).
    Noising a bf16 sum in bf16 would let rounding move it by more than C."""
    s = engine.clipped_sum(p) if engine is not None else p.grad
    if s is None:
        if p.dtype in LOW_PRECISION:
            return torch.zeros_like(p, dtype=torch.float32)
        p.grad = torch.zeros_like(p)
        return p.grad
    return upcast(s)


def _make_generator(seed: int | None, device: torch.device) -> tuple[torch.Generator, int]:
    g = torch.Generator(device=device)
    if seed is None:
        return g, g.seed()
    g.manual_seed(seed)
    return g, seed


class DPOptimizer(torch.optim.Optimizer):
    """A differentially private wrapper of ``optimizer``.

    Args:
        optimizer: the torch optimizer that takes the noised, averaged gradient.
        noise_multiplier: sigma; the noise std is sigma * max_grad_norm.
        max_grad_norm: C, the clipping norm the engine uses.
        expected_batch_size: q N, the divisor of the noised sum.
        sample_rate: q, recorded in the ledger at every step.
        ledger: the privacy ledger to record into (a new one if None).
        seed: fixes the noise; None draws a seed from the OS (logged either way).
        max_steps: refuse steps beyond this many (the budget's planned steps).
        engine: the clipping engine that fills ``p.grad``; if given, every step first
            checks that each trainable parameter's gradient is the engine's clipped
            sum, untouched since (:meth:`ClippingEngine.check_gradients`).
        secure_mode: draw the noise from the OS's CSPRNG
            (:func:`dptrain.secure_random.secure_normal`) instead of a seeded torch
            generator; cannot be combined with ``seed``.

    LR schedulers can be attached to this object directly: ``param_groups``
    are the wrapped optimizer's.
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
        engine: ClippingEngine | None = None,
        secure_mode: bool = False,
    ):
        if secure_mode and seed is not None:
            raise ValueError(
                f"secure_mode=True with seed={seed!r}: secure noise comes from the OS's "
                "CSPRNG and cannot be seeded (a known seed would let anyone recompute the "
                "noise); drop the seed"
            )
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
            )
        # Not calling Optimizer.__init__: state and groups are the wrapped optimizer's.
        self.original_optimizer = optimizer
        self.noise_multiplier = check_positive("noise_multiplier", noise_multiplier)
        self.max_grad_norm = check_positive("max_grad_norm", max_grad_norm)
        self.expected_batch_size = check_positive("expected_batch_size", expected_batch_size)
        self.sample_rate = check_sample_rate(sample_rate)
        self.ledger = ledger if ledger is not None else PrivacyLedger()
        self.max_steps = None if max_steps is None else check_int("max_steps", max_steps, 0)
        self.steps_taken = 0
        self.engine = engine
        self._seed_arg = seed
        self._generators: dict[torch.device, torch.Generator] = {}
        self.seed: int | None = None
        self.last_metrics: StepMetrics | None = None
        #: An auditor that sees every step (dptrain.audit.gradient_canaries): its
        #: ``before_noise(optimizer)`` may add canary gradients to the clipped sums, its
        #: ``after_noise(optimizer)`` reads the noised gradients. None: no audit.
        self.audit_hook: Any = None
        # This step's clipped sums as they are noised, by parameter id (clipped_sum).
        self._sums: dict[int, Tensor] = {}
        self._optimizer_step_pre_hooks = {}
        self._optimizer_step_post_hooks = {}
        self.secure_mode = secure_mode
        if not secure_mode:  # secure noise has no generator (and no seed to log)
            self._generator_for(torch.device("cpu"))

    # -- delegation so LR schedulers and checkpoints see the wrapped optimizer --------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.original_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.original_optimizer.param_groups = value

    @property
    def state(self):  # type: ignore[override]
        return self.original_optimizer.state

    @property
    def defaults(self):  # type: ignore[override]
        return self.original_optimizer.defaults

    def params(self) -> list[torch.nn.Parameter]:
        """The parameters this optimizer updates."""
        return [p for group in self.param_groups for p in group["params"]]

    def _generator_for(self, device: torch.device) -> torch.Generator:
        device = canonical_device(device)
        if device not in self._generators:
            # One seed for the run; each device's generator starts from it.
            seed = self._seed_arg if self._seed_arg is not None else self.seed
            gen, used = _make_generator(seed, device)
            self._generators[device] = gen
            if self.seed is None:
                self.seed = used
                how = "given explicitly" if self._seed_arg is not None else "drawn from the OS"
                log.info("DP noise seed %d (%s)", used, how)
        return self._generators[device]

    # -- the private step ---------------------------------------------------------------------

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start a logical batch: forget the previous clipped sums."""
        self.original_optimizer.zero_grad(set_to_none=set_to_none)
        self._sums.clear()

    def check_clipped_gradients(self) -> None:
        """Refuse a step on gradients the engine did not clip (no-op without an engine)."""
        if self.engine is not None:
            self.engine.check_gradients(self.params())

    def clipped_sum(self, p: torch.nn.Parameter) -> Tensor:
        """The clipped sum of ``p`` this step will noise, in at least float32 (for a
        float16/bfloat16 parameter, the engine's float32 sum, not the rounded ``p.grad``).
        Add to it in place (an audit's canaries); the noise and the cast to p's dtype
        follow in :meth:`add_noise`."""
        s = self._sums.get(id(p))
        if s is None:
            s = self._sums[id(p)] = _sum_to_noise(self.engine, p)
        return s

    def all_reduce_clipped_sums(self) -> None:
        """Sum the clipped sums over data-parallel workers. One process: nothing to do."""

    def add_noise(self, loss_scale: float = 1.0) -> StepMetrics:
        """p.grad <- (clipped sum + N(0, (sigma C K)^2)) / (K q N) for every parameter.

        ``loss_scale`` K follows Li et al. 2022 App. T: sums clipped at C K get
        noise of std sigma C K, then everything is unscaled by K.
        """
        k = check_positive("loss_scale", loss_scale)
        std = self.noise_multiplier * self.max_grad_norm * k
        params = [p for p in self.params() if p.requires_grad]
        sums = [self.clipped_sum(p) for p in params]
        # The diagnostics stay tensors until the end: one host sync per step, not two per
        # parameter (a GPU would otherwise stall on every parameter).
        signal = _norms(sums)
        if self.secure_mode:
            noise_norms = []
            for s in sums:
                noise = secure_normal(s.shape, std, dtype=s.dtype, device=s.device)
                noise_norms.append(torch.linalg.vector_norm(noise))
                s.add_(noise)
        else:
            # a few draws, adds and norms for all parameters, not three per parameter
            noise_norms = add_noise_(sums, std, self._generator_for)
        divide_and_publish(params, sums, k * self.expected_batch_size)
        self._sums.clear()
        if self.engine is not None:
            self.engine.release_sums()  # noised and published: not needed any more
        signal_norm, noise_norm = total_norms(signal, noise_norms)  # the step's one read
        return StepMetrics(
            step=self.steps_taken,
            sample_rate=self.sample_rate,
            noise_multiplier=self.noise_multiplier,
            clipped_sum_norm=signal_norm / k,
            noise_norm=noise_norm / k,
        )

    def step(self, closure=None, loss_scale: float = 1.0) -> StepMetrics:  # type: ignore[override]
        """Noise the accumulated clipped sums once, step the wrapped optimizer, record the step."""
        if closure is not None:
            raise ValueError(
                "closure= is not supported: a DP step must not re-evaluate the loss on the batch"
            )
        if self.max_steps is not None and self.steps_taken >= self.max_steps:
            raise PrivacyBudgetExhaustedError(
                f"the privacy budget allows {self.max_steps} steps and all are taken "
                f"(epsilon is computed from the ledger: {self.ledger!r})"
            )
        self.check_clipped_gradients()
        self._sums.clear()
        self.all_reduce_clipped_sums()
        if self.audit_hook is not None:
            self.audit_hook.before_noise(self)
        metrics = self.add_noise(loss_scale)
        if self.audit_hook is not None:
            self.audit_hook.after_noise(self)
        self.original_optimizer.step()
        self.ledger.record(self.sample_rate, self.noise_multiplier)
        self.steps_taken += 1
        self.last_metrics = metrics
        return metrics

    def set_sample_rate(self, sample_rate: float, dataset_size: int) -> None:
        """Use rate q from the next step on (a batch-size schedule); the divisor becomes q N."""
        self.sample_rate = check_sample_rate(sample_rate)
        self.expected_batch_size = self.sample_rate * check_int("dataset_size", dataset_size, 1)

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return {
            "optimizer": self.original_optimizer.state_dict(),
            "ledger": self.ledger.state_dict(),
            "steps_taken": self.steps_taken,
            "seed": self.seed,
            "generators": {str(d): g.get_state() for d, g in self._generators.items()},
            "sample_rate": self.sample_rate,
            "expected_batch_size": self.expected_batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:  # type: ignore[override]
        self.original_optimizer.load_state_dict(state["optimizer"])
        self.ledger.load_state_dict(state["ledger"])
        self.steps_taken = state["steps_taken"]
        self.seed = state["seed"]
        self._seed_arg = state["seed"]
        self.sample_rate = state["sample_rate"]
        self.expected_batch_size = state["expected_batch_size"]
        for device, gen_state in state["generators"].items():
            # The state may arrive on the training device (accelerate moves every tensor of
            # an optimizer's state there) or as a list: set_state takes a CPU uint8 tensor.
            restore_generator(self._generator_for(torch.device(device)), gen_state)

    def __repr__(self) -> str:
        return (
            f"DPOptimizer({type(self.original_optimizer).__name__}, sigma={self.noise_multiplier:g}, "
            f"C={self.max_grad_norm:g}, q={self.sample_rate:g}, steps={self.steps_taken})"
        )


def noisy_clipped_gradient(
    engine: ClippingEngine,
    per_example_losses: Tensor,
    *,
    noise_multiplier: float,
    expected_batch_size: float,
    generator: torch.Generator | None = None,
) -> ClipStats:
    """The lower-level API: one call from per-example losses to a private gradient.

    Sets every clipped parameter's ``.grad`` to
    (sum_i c_i grad L_i + N(0, sigma^2 C^2 I)) / expected_batch_size,
    ready for any optimizer's step. Record the step in your ledger yourself
    (``ledger.record(q, sigma)``). ``generator`` None draws fresh OS entropy.
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    divisor = check_positive("expected_batch_size", expected_batch_size)
    params = engine.parameters()
    for p in params:
        p.grad = None
    stats = engine.backward(per_example_losses)
    std = sigma * engine.max_grad_norm
    generators = {canonical_device(generator.device): generator} if generator is not None else {}

    def generator_for(device: torch.device) -> torch.Generator:
        device = canonical_device(device)
        if device not in generators:
            generators[device], _ = _make_generator(None, device)
        return generators[device]

    sums = [_sum_to_noise(engine, p) for p in params]
    add_noise_(sums, std, generator_for)
    divide_and_publish(params, sums, divisor)
    engine.release_sums()  # noised and published, as DPOptimizer does
    return stats
