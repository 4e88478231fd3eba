"""White-box one-run audit: Dirac canary gradients through the clipping and noise path.

Steinke, Nasr & Jagielski (NeurIPS 2023, "Privacy auditing with one (1) training
run", the white-box setting): the auditor adds ``m`` canary *gradients* to
training and observes every noised update. Here canary j is a Dirac gradient,
``norm`` times the unit vector of one coordinate k_j of the flattened trainable
parameters (coordinates drawn without replacement). It is included in the run
with probability 1/2 (drawn once, independently per canary); an included canary
then joins each step like a record of the data set:

- it is Poisson-sampled with the step's rate q (the optimizer's ``sample_rate``),
- its gradient is clipped by the engine's own clipping function
  (:meth:`dptrain.clipping.ClippingEngine.clip_factors`; ``norm`` above C is cut
  to C), and added to the clipped sums before the noise,
- the optimizer adds the noise, divides by q N and steps as always.

After the noise, canary j's score grows by the noised sum at k_j (the update
rescaled by q N). The mechanism the accountant describes releases exactly these
noised sums, so a run that is (epsilon, delta)-DP per record is so per canary,
and :func:`dptrain.audit.one_run.one_run_audit` turns the scores into a lower
bound on epsilon. This audits the clip factors, the noise, the sampling rate
and the ledger (a ledger that under-counts steps claims too small an epsilon);
it does not audit the engine's per-example norms (canaries do not pass through
the model): the black-box audit does.

Dirac canaries on distinct coordinates do not interfere with each other, and real
gradients at a random coordinate are small next to C, so the scores of included
and left-out canaries separate by about (number of steps it was sampled) x C
against noise sigma C sqrt(steps): with full-batch steps (q = 1) the per-canary
mechanism is sqrt(T) / sigma-GDP, which the accountant's epsilon describes tightly.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from dptrain._checks import check_int, check_positive
from dptrain.audit.one_run import OneRunAudit, one_run_audit

__all__ = ["GradientCanaries"]


class GradientCanaries:
    """``m`` Dirac canary gradients, included with probability 1/2; attach to a DP optimizer.

    Args:
        params: the trainable parameters (the canaries' coordinates are drawn among them).
        m: number of canaries (>= 2, at most the number of coordinates).
        norm: each canary gradient's norm before clipping (default: exactly the
            optimizer's C at attach time; larger values test that clipping cuts them).
        seed: fixes the coordinates, the inclusions and the per-step sampling.

    Use::

        canaries = GradientCanaries(model.parameters(), m=10_000, seed=0)
        canaries.attach(private.optimizer)
        ...  # train as usual
        result = canaries.audit(delta=1e-5)
    """

    def __init__(
        self,
        params: Any,
        m: int,
        *,
        norm: float | None = None,
        seed: int = 0,
    ):
        self.params = [p for p in params if p.requires_grad]
        sizes = [p.numel() for p in self.params]
        total = sum(sizes)
        self.m = check_int("m", m, 2)
        if self.m > total:
            raise ValueError(
                f"m={m!r} is not allowed: the trainable parameters have {total} coordinates, "
                "one per canary"
            )
        self.norm = None if norm is None else check_positive("norm", norm)
        self._gen = torch.Generator().manual_seed(check_int("seed", seed, 0))
        coords = torch.randperm(total, generator=self._gen)[: self.m]
        self.included = torch.rand(self.m, generator=self._gen, dtype=torch.float64) < 0.5
        # canary j -> (parameter, flat index): grouped by parameter for one index op each
        offsets = np.cumsum([0, *sizes])
        owner = np.searchsorted(offsets, coords.numpy(), side="right") - 1
        self._groups = [
            (i, torch.from_numpy(np.nonzero(owner == i)[0]), coords[owner == i] - int(offsets[i]))
            for i in range(len(self.params))
            if (owner == i).any()
        ]
        self.scores = torch.zeros(self.m, dtype=torch.float64)
        self.steps = 0
        self.sampled = torch.zeros(self.m, dtype=torch.long)

    def attach(self, optimizer: Any) -> GradientCanaries:
        """Make ``optimizer`` (a :class:`dptrain.optim.DPOptimizer`) add and observe the
        canaries at every step."""
        if not hasattr(optimizer, "audit_hook"):
            raise ValueError(
                f"optimizer={type(optimizer).__name__} has no audit hook: expected a "
                "dptrain DPOptimizer (e.g. make_private(...).optimizer)"
            )
        if getattr(optimizer, "world_size", 1) > 1:
            # the multi-process step noises and reduces in its own order, without the hook
            raise ValueError(
                f"white-box canaries on {optimizer.world_size} processes are not supported: "
                "audit a one-process run of the same configuration"
            )
        engine = getattr(optimizer, "engine", None)
        if engine is None or engine.clipping == "per_layer":
            raise ValueError(
                "white-box canaries need the optimizer's clipping engine with flat or automatic "
                "clipping (per-layer clipping has a factor per group, not one per gradient)"
            )
        ours = {id(p) for p in self.params}
        if not ours <= {id(p) for p in optimizer.params()}:
            raise ValueError("the canaries' parameters are not all updated by this optimizer")
        if self.norm is None:
            self.norm = float(optimizer.max_grad_norm)
        optimizer.audit_hook = self
        return self

    # -- the hook the optimizer calls -----------------------------------------------------

    def before_noise(self, optimizer: Any) -> None:
        """Add each included canary, Poisson-sampled at the step's rate, clipped by the
        engine's clipping function, to the clipped sums."""
        q = optimizer.sample_rate
        drawn = torch.rand(self.m, generator=self._gen, dtype=torch.float64) < q
        present = drawn & self.included
        self.sampled += present.long()
        factor = float(optimizer.engine.clip_factors(torch.tensor([self.norm]))[0])
        value = self.norm * factor
        for i, which, flat in self._groups:
            p = self.params[i]
            s = optimizer.clipped_sum(p)  # at least float32: a bf16 p.grad would round
            add = present[which].to(s.dtype) * value
            s.view(-1).index_add_(0, flat.to(p.device), add.to(p.device))

    def after_noise(self, optimizer: Any) -> None:
        """Score += the noised sum at each canary's coordinate (the update times q N)."""
        scale = optimizer.expected_batch_size
        for i, which, flat in self._groups:
            got = self.params[i].grad.detach().reshape(-1)[flat.to(self.params[i].device)]
            self.scores[which] += got.double().cpu() * scale
        self.steps += 1

    # -- the result -----------------------------------------------------------------------

    def audit(
        self,
        delta: float,
        confidence: float = 0.95,
        *,
        method: str = "steinke2023",
        k_plus: int | None = None,
        k_minus: int | None = None,
    ) -> OneRunAudit:
        """The epsilon lower bound from the scores (:func:`dptrain.audit.one_run.one_run_audit`)."""
        if self.steps == 0:
            raise ValueError("no step was observed: attach the canaries before training")
        return one_run_audit(
            self.scores.numpy(),
            self.included.numpy(),
            delta,
            confidence,
            k_plus,
            k_minus,
            method=method,
        )

    def report(
        self, claimed_epsilon: float, delta: float, ledger: Any, confidence: float = 0.95
    ) -> dict[str, Any]:
        """The audit section of a recipe's ``results.json``.

        Steinke et al.'s bound always; the Gaussian f-DP one only where every step of the
        ``ledger`` has q = 1 (full batches: the per-canary mechanism is then exactly
        Gaussian, so its epsilon is a valid lower bound; under Poisson sampling it is not).
        """
        full_batch = all(seg.sample_rate == 1.0 for seg in ledger.segments)
        methods = ["steinke2023", "mahloujifar2025-gdp"] if full_batch else ["steinke2023"]
        audits = [self.audit(delta, confidence, method=m) for m in methods]
        return {
            "kind": "white-box one-run audit (Dirac canary gradients, Steinke et al. 2023)",
            "canaries": self.m,
            "steps_observed": self.steps,
            "claimed_epsilon": claimed_epsilon,
            "delta": delta,
            "confidence": confidence,
            "lower_bounds": {a.method: a.epsilon for a in audits},
            "flagged": any(a.epsilon > claimed_epsilon for a in audits),
            "separation": self.separation(),
            "note": (
                "the canaries were added to this run's updates (each included one on one "
                "coordinate, like one more clipped record): audit a run, ship one trained "
                "without audit=true"
            ),
        }

    def separation(self) -> float:
        """(mean score in - mean score out) / (sd of the scores out): how far apart the two
        groups are, in noise units (a diagnostic; sqrt(T)/sigma for full-batch steps)."""
        s_in, s_out = self.scores[self.included], self.scores[~self.included]
        if len(s_in) == 0 or len(s_out) < 2:
            return math.nan
        return float((s_in.mean() - s_out.mean()) / s_out.std())
