"""DP forward propagation (DP-FP): noise on the representation, not on the gradients.

Du, Mi et al., "DP-Forward / DP-FP: differentially private forward propagation
for fine-tuning large language models", Algorithm 1 ("DP-FP Training"):

1. calibrate sigma from (epsilon, delta), T steps and M micro-batches
   (:func:`dptrain.accounting.calibrate_dpfp`);
2. for t = 1..T, for m = 1..M "in parallel": sample micro-batch x_m by an
   independent Bernoulli(p) trial for every record, p = B / (M D);
   x~_m = Clip(h(x_m); C) + N(0, sigma^2 I_k); w <- optimizer(x~_m, w).

This module provides the three pieces: :class:`DPForwardLayer` (clip + noise
between the encoder's pooled representation and the head),
:class:`BernoulliMicroBatches` (line 5's sampling) and :class:`DPFPTrainer`
(one Algorithm-1 step, recorded in a :class:`~dptrain.accounting.PrivacyLedger`).

Scope (DESIGN.md, "DP-FP scope"). DP-FP releases Clip(h(x_i), C) + noise for
every sampled example. Labels are NOT protected. With a frozen encoder the
trained head is post-processing of the noisy representations (and the labels),
so the accounted guarantee covers it. When the encoder is fine-tuned (the
paper's setting) its gradients flow back through h(x) and depend on the raw
inputs: encoder updates are OUTSIDE the formal guarantee. The accounting
treats each micro-batch as one Poisson-subsampled Gaussian mechanism of
sensitivity C, as the paper does, although one noisy row per sampled example
is released (not one noisy sum): that is a modelling assumption, stated in
every report (:meth:`DPFPTrainer.privacy_scope`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from dptrain._checks import check_int, check_positive, check_real_at_least
from dptrain.accounting import PrivacyLedger, make_accountant
from dptrain.data.poisson import PoissonBatchSampler

__all__ = [
    "BernoulliMicroBatches",
    "DPFPStepResult",
    "DPFPTrainer",
    "DPForwardLayer",
]

log = logging.getLogger(__name__)

_MAX_SEED = 2**64 - 1


def _noise_dtype(dtype: torch.dtype) -> torch.dtype:
    """Noise is drawn in float32 at least (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class DPForwardLayer(nn.Module):
    """Clip each representation row to L2 norm <= C, then add N(0, (noise_multiplier C)^2 I_k).

    Placed between an encoder's pooled representation (B, k) and the head
    (Algorithm 1, line 6). In training mode it returns
    ``h * min(1, C / ||h||) + N(0, sigma^2 I_k)`` row by row, sigma =
    ``noise_multiplier * max_norm``; in eval mode it is the identity (the
    paper adds no noise at inference: only the training data is protected).

    The noise comes from a ``torch.Generator`` the layer owns, one per device,
    each started from :attr:`seed` (explicit, or drawn from the OS and logged),
    drawn in float32 at least and added on the input's device; the result has
    the input's dtype.

    Args:
        max_norm: C > 0.
        noise_multiplier: sigma / C >= 0 (0: clipping only, no privacy).
        seed: an integer in [0, 2**64 - 1], or None to draw one from the OS.
    """

    def __init__(self, max_norm: float, noise_multiplier: float, *, seed: int | None = None):
        super().__init__()
        self.max_norm = check_positive("max_norm", max_norm)
        self.noise_multiplier = check_real_at_least("noise_multiplier", noise_multiplier, 0.0)
        if seed is None:
            seed = torch.Generator().seed()
            log.info("DPForwardLayer: noise seed %d drawn from the OS", seed)
        else:
            seed = check_int("seed", seed, minimum=0)
            if seed > _MAX_SEED:
                raise ValueError(f"seed={seed!r} is outside the allowed range [0, 2**64 - 1]")
            log.info("DPForwardLayer: noise seed %d", seed)
        self.seed: int = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @property
    def noise_std(self) -> float:
        """sigma = noise_multiplier * max_norm, per coordinate."""
        return self.noise_multiplier * self.max_norm

    def generator(self, device: torch.device | str) -> torch.Generator:
        """The layer's generator on ``device`` (created from :attr:`seed` on first use)."""
        device = torch.device(device)
        if device.type != "cpu" and device.index is None:
            device = torch.device(device.type, torch.empty(0, device=device).device.index)
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generators[device] = g
        return g

    def clip(self, h: Tensor) -> Tensor:
        """Each row scaled by min(1, C / ||row||): rows within C are returned unchanged."""
        self._check_input(h)
        norms = torch.linalg.vector_norm(h.to(_noise_dtype(h.dtype)), dim=1, keepdim=True)
        factor = (self.max_norm / norms.clamp_min(1e-30)).clamp(max=1.0)
        return h * factor.to(h.dtype)

    def forward(self, h: Tensor) -> Tensor:
        if not self.training:
            return h
        clipped = self.clip(h)
        if self.noise_multiplier == 0.0:
            return clipped
        work = _noise_dtype(h.dtype)
        noise = torch.randn(
            h.shape, generator=self.generator(h.device), device=h.device, dtype=work
        )
        return (clipped.to(work) + noise * self.noise_std).to(h.dtype)

    @staticmethod
    def _check_input(h: object) -> None:
        if not isinstance(h, Tensor):
            raise ValueError(f"input={type(h).__name__} is not allowed: expected a Tensor (B, k)")
        if h.dim() != 2:
            raise ValueError(
                f"input shape={tuple(h.shape)} is not allowed: expected a pooled "
                "representation of shape (B, k)"
            )
        if not h.is_floating_point():
            raise ValueError(f"input dtype={h.dtype} is not allowed: expected a floating dtype")

    def extra_repr(self) -> str:
        return (
            f"max_norm={self.max_norm:g}, noise_multiplier={self.noise_multiplier:g}, "
            f"seed={self.seed}"
        )


class BernoulliMicroBatches:
    """Algorithm 1, line 5: M micro-batches per step, each an independent Bernoulli(p) subset.

    Every record joins every micro-batch independently with probability
    p = B / (M D) (B the expected total batch size, D the dataset size), so a
    micro-batch's size is Binomial(D, p) (mean B / M) and may be 0; empty
    micro-batches are yielded like any other, never skipped or redrawn. The
    draws are those of a :class:`~dptrain.data.PoissonBatchSampler` of
    ``steps * M`` batches at rate p, grouped M at a time.

    Iterating yields ``steps`` lists, each of M sorted index lists. The
    sampler stands for the whole run: a second ``iter()`` continues.

    Args:
        dataset_size: D >= 1.
        batch_size: B > 0, the expected number of records per step (all M
            micro-batches together); B <= M D.
        micro_batches: M >= 1.
        steps: T >= 0.
        seed: fixes the draws; None draws a seed from the OS (see :attr:`seed`).
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: float,
        micro_batches: int,
        steps: int,
        *,
        seed: int | None = None,
    ):
        self.dataset_size = check_int("dataset_size", dataset_size, minimum=1)
        self.batch_size = check_positive("batch_size", batch_size)
        self.micro_batches = check_int("micro_batches", micro_batches, minimum=1)
        self.steps = check_int("steps", steps, minimum=0)
        p = self.batch_size / (self.micro_batches * self.dataset_size)
        if p > 1.0:
            raise ValueError(
                f"batch_size={batch_size!r} is not allowed: expected batch_size <= "
                f"micro_batches * dataset_size = {self.micro_batches * self.dataset_size} "
                "(p = B / (M D) must be <= 1)"
            )
        self.p = p
        self._sampler = PoissonBatchSampler(
            self.dataset_size, p, self.steps * self.micro_batches, seed=seed
        )
        log.info("BernoulliMicroBatches: p=%.6g, seed %s", p, self._sampler.seed)

    @property
    def seed(self) -> int | None:
        """The seed the draws started from (log it to reproduce a run)."""
        return self._sampler.seed

    @property
    def steps_drawn(self) -> int:
        return self._sampler.steps_drawn // self.micro_batches

    def __iter__(self) -> Iterator[list[list[int]]]:
        inner = iter(self._sampler)
        while self.steps_drawn < self.steps:
            yield [next(inner) for _ in range(self.micro_batches)]

    def __len__(self) -> int:
        return self.steps

    def __repr__(self) -> str:
        return (
            f"BernoulliMicroBatches(dataset_size={self.dataset_size}, p={self.p:g}, "
            f"micro_batches={self.micro_batches}, steps={self.steps}, seed={self.seed})"
        )


@dataclass
class DPFPStepResult:
    """What one Algorithm-1 step did.

    Attributes:
        loss: mean over the non-empty micro-batches of each one's mean loss
            (nan when all M were empty).
        micro_batch_sizes: the M sizes, empties included.
        updated: whether the optimizer stepped (False when all M were empty).
    """

    loss: float
    micro_batch_sizes: list[int]
    updated: bool


class DPFPTrainer:
    """One Algorithm-1 step at a time: M micro-batches through the DP-FP layer, one update.

    Reading of "for m = 1..M in parallel do ... w <- optimizer(x~_m, w)".
    "In parallel" means the M micro-batches of step t are all computed from
    the same weights w_t, so their updates cannot be applied one after the
    other; and the paper counts T updates ("updates T steps"). This trainer
    therefore takes ONE optimizer step per Algorithm-1 step, on the average
    of the M micro-batch gradients: each micro-batch contributes the gradient
    of its own mean loss, and the average is over the non-empty micro-batches
    (an empty micro-batch released nothing and has no loss; dividing by M
    instead would rescale the step by a random factor). With the paper's
    B = M, a micro-batch holds one record on average, so this is close to the
    mean per-example loss of the step. If all M micro-batches are empty, no
    optimizer step is taken (the gradients would be zero; stateful optimizers
    would still move). Privacy is unaffected by this choice: every update is
    computed from the noisy representations and the labels only (the frozen
    mode), and the ledger records every micro-batch either way.

    Ledger: each micro-batch, empty or not, is recorded as one subsampled
    Gaussian step ``record(p, noise_multiplier)``, so T steps record T * M
    events, matching :meth:`dptrain.accounting.DPFPCalibration.ledger`.

    Args:
        encoder: callable on a collated batch's inputs, returning the pooled
            representation (B, k).
        head: maps the (noisy) representation to the loss's input.
        dp_layer: the :class:`DPForwardLayer` between them.
        optimizer: updates the head (and the encoder when trainable).
        loss_fn: ``loss_fn(head_output, targets)`` -> scalar mean loss.
        dataset: map-style: ``len()`` and ``dataset[i]``.
        collate_fn: list of records -> ``(inputs, targets)``.
        sample_rate: p, the Bernoulli rate the micro-batches were drawn with.
        micro_batches: M.
        encoder_trainable: False (default): the encoder is frozen
            (``requires_grad_(False)``, run under ``no_grad``), and the
            guarantee covers the trained head. True: the paper's fine-tuning,
            whose encoder updates are outside the formal guarantee.
        ledger: record into this ledger (a new one if None).
        fuse_micro_batches: False (default): run the M micro-batches one after
            the other, as Algorithm 1 is written. True: concatenate the step's
            micro-batches and run the encoder, the DP-FP layer and the head
            once, then take each micro-batch's mean loss on its own rows. The
            update is the same function of the same weights and the noise has
            the same distribution (the DP-FP layer clips and noises row by
            row), so the two are equivalent for encoders whose rows do not
            interact (Transformers; not BatchNorm); fusing is much faster when
            micro-batches hold about one record each (B = M). Needs tensor
            targets.
    """

    def __init__(
        self,
        encoder: nn.Module,
        head: nn.Module,
        dp_layer: DPForwardLayer,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], Tensor],
        dataset: Any,
        collate_fn: Callable[[list[Any]], tuple[Any, Any]],
        *,
        sample_rate: float,
        micro_batches: int,
        encoder_trainable: bool = False,
        ledger: PrivacyLedger | None = None,
        fuse_micro_batches: bool = False,
    ):
        if not isinstance(dp_layer, DPForwardLayer):
            raise ValueError(
                f"dp_layer={type(dp_layer).__name__} is not allowed: expected a DPForwardLayer"
            )
        if dp_layer.noise_multiplier <= 0:
            raise ValueError(
                f"noise_multiplier={dp_layer.noise_multiplier!r} is not allowed: expected a "
                "number > 0 for DPFPTrainer (without noise there is no guarantee to account)"
            )
        if not isinstance(encoder_trainable, bool):
            raise ValueError(
                f"encoder_trainable={encoder_trainable!r} is not allowed: expected True or False"
            )
        self.encoder = encoder
        self.head = head
        self.dp_layer = dp_layer
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.dataset = dataset
        self.collate_fn = collate_fn
        self.sample_rate = check_positive("sample_rate", sample_rate)
        if self.sample_rate > 1.0:
            raise ValueError(f"sample_rate={sample_rate!r} is outside the allowed range (0, 1]")
        self.micro_batches = check_int("micro_batches", micro_batches, minimum=1)
        self.encoder_trainable = encoder_trainable
        if not isinstance(fuse_micro_batches, bool):
            raise ValueError(
                f"fuse_micro_batches={fuse_micro_batches!r} is not allowed: expected True or False"
            )
        self.fuse_micro_batches = fuse_micro_batches
        self.ledger = ledger if ledger is not None else PrivacyLedger()
        self.steps_taken = 0
        optimized = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if encoder_trainable:
            if not any(id(p) in optimized for p in encoder.parameters()):
                raise ValueError(
                    "encoder_trainable=True is not allowed here: the optimizer holds none of "
                    "the encoder's parameters"
                )
        else:
            encoder.requires_grad_(False)
        log.info(
            "DPFPTrainer: encoder_trainable=%s, p=%.6g, M=%d, C=%g, noise_multiplier=%g, "
            "noise seed %d",
            encoder_trainable,
            self.sample_rate,
            self.micro_batches,
            dp_layer.max_norm,
            dp_layer.noise_multiplier,
            dp_layer.seed,
        )

    @classmethod
    def from_sampler(
        cls,
        sampler: BernoulliMicroBatches,
        encoder: nn.Module,
        head: nn.Module,
        dp_layer: DPForwardLayer,
        optimizer: torch.optim.Optimizer,
        loss_fn: Callable[[Any, Any], Tensor],
        dataset: Any,
        collate_fn: Callable[[list[Any]], tuple[Any, Any]],
        **kwargs: Any,
    ) -> DPFPTrainer:
        """A trainer whose p and M are the sampler's."""
        if sampler.dataset_size != len(dataset):
            raise ValueError(
                f"sampler dataset_size={sampler.dataset_size} is not allowed: expected "
                f"len(dataset)={len(dataset)}"
            )
        return cls(
            encoder,
            head,
            dp_layer,
            optimizer,
            loss_fn,
            dataset,
            collate_fn,
            sample_rate=sampler.p,
            micro_batches=sampler.micro_batches,
            **kwargs,
        )

    def representation(self, inputs: Any) -> Tensor:
        """The encoder's pooled representation; without autograd when the encoder is frozen."""
        if self.encoder_trainable:
            return self.encoder(inputs)
        with torch.no_grad():
            return self.encoder(inputs)

    def step(self, micro_batch_indices: Sequence[Sequence[int]]) -> DPFPStepResult:
        """One Algorithm-1 step on M micro-batches of record indices (see the class docstring)."""
        if len(micro_batch_indices) != self.micro_batches:
            raise ValueError(
                f"len(micro_batch_indices)={len(micro_batch_indices)} is not allowed: expected "
                f"micro_batches={self.micro_batches}"
            )
        sizes = [len(ix) for ix in micro_batch_indices]
        nonempty = sum(1 for s in sizes if s > 0)
        self.head.train()
        self.dp_layer.train()
        if self.encoder_trainable:
            self.encoder.train()
        self.optimizer.zero_grad(set_to_none=True)
        # The mechanism runs for every micro-batch, empty or not (Algorithm 1, line 6).
        for _ in micro_batch_indices:
            self.ledger.record(self.sample_rate, self.dp_layer.noise_multiplier)
        if self.fuse_micro_batches:
            total = self._fused_backward(micro_batch_indices, nonempty)
        else:
            total = 0.0
            for indices in micro_batch_indices:
                if not indices:
                    continue
                inputs, targets = self.collate_fn([self.dataset[i] for i in indices])
                noisy = self.dp_layer(self.representation(inputs))
                loss = self.loss_fn(self.head(noisy), targets)
                (loss / nonempty).backward()
                total += float(loss.detach())
        self.steps_taken += 1
        if nonempty == 0:
            return DPFPStepResult(float("nan"), sizes, updated=False)
        self.optimizer.step()
        return DPFPStepResult(total / nonempty, sizes, updated=True)

    def _fused_backward(self, micro_batch_indices: Sequence[Sequence[int]], nonempty: int) -> float:
        """All non-empty micro-batches in one pass; returns the sum of their mean losses."""
        groups = [list(ix) for ix in micro_batch_indices if ix]
        if not groups:
            return 0.0
        inputs, targets = self.collate_fn([self.dataset[i] for ix in groups for i in ix])
        if not isinstance(targets, Tensor):
            raise ValueError(
                f"targets of type {type(targets).__name__} is not allowed with "
                "fuse_micro_batches=True: expected a Tensor whose rows follow the records"
            )
        output = self.head(self.dp_layer(self.representation(inputs)))
        losses = []
        start = 0
        for ix in groups:
            rows = slice(start, start + len(ix))
            losses.append(self.loss_fn(output[rows], targets[rows]))
            start += len(ix)
        loss = torch.stack(losses)
        (loss.sum() / nonempty).backward()
        return float(loss.detach().sum())

    def fit(self, sampler: BernoulliMicroBatches) -> list[DPFPStepResult]:
        """Run the sampler's remaining steps; its p and M must be this trainer's."""
        if sampler.p != self.sample_rate or sampler.micro_batches != self.micro_batches:
            raise ValueError(
                f"sampler p={sampler.p!r}, micro_batches={sampler.micro_batches} is not allowed: "
                f"expected p={self.sample_rate!r}, micro_batches={self.micro_batches}"
            )
        return [self.step(micro) for micro in sampler]

    @torch.no_grad()
    def predict(self, inputs: Any) -> Tensor:
        """Head output at inference: encoder -> DP-FP layer in eval mode (identity) -> head."""
        self.encoder.eval()
        self.dp_layer.eval()
        self.head.eval()
        return self.head(self.dp_layer(self.encoder(inputs)))

    def privacy_scope(self, delta: float | None = None, accountant: str = "rdp") -> str:
        """What the run's guarantee covers, in words (print it with every DP-FP result).

        With ``delta``, the epsilon of the recorded ledger under ``accountant`` is included.
        """
        layer = self.dp_layer
        mode = (
            "encoder_trainable=True (the paper's fine-tuning): the head is post-processing of "
            "the noisy representations, but the ENCODER's updates use gradients that depend on "
            "the raw inputs and are OUTSIDE the formal guarantee"
            if self.encoder_trainable
            else "encoder_trainable=False (frozen encoder): the trained head is post-processing "
            "of the noisy representations and the labels, so it is covered by the guarantee"
        )
        lines = [
            "DP-FP (Du & Mi et al., Algorithm 1): privacy scope",
            f"- mode: {mode}.",
            "- labels are NOT protected: the guarantee covers the inputs' representations only.",
            "- modelling assumption: each micro-batch is accounted as one Poisson-subsampled "
            "Gaussian mechanism of sensitivity C, as in the paper, although DP-FP releases one "
            "noisy row per sampled example (not one noisy sum); the number of rows reveals the "
            "micro-batch size.",
            f"- mechanism: C={layer.max_norm:g}, noise_multiplier={layer.noise_multiplier:g} "
            f"(noise std {layer.noise_std:g}), p={self.sample_rate:.6g}, "
            f"M={self.micro_batches}, steps={self.steps_taken}, noise seed {layer.seed}.",
            f"- ledger: {self.ledger.num_steps} subsampled Gaussian events (T*M), "
            f"unit={self.ledger.privacy_unit!r}, neighbouring={self.ledger.neighbouring!r}.",
        ]
        if delta is not None:
            eps = make_accountant(accountant, self.ledger).epsilon(delta)
            approx = " (CLT, approximate)" if accountant == "gdp" else ""
            lines.append(f"- epsilon={eps:.4g} at delta={delta:g} ({accountant}{approx}).")
        return "\n".join(lines)
