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

After the noise, canary j is observed at every step: ``x_tj``, the noised sum at
k_j (the update rescaled by q N) times the canary's sign at that step. The mechanism
the accountant describes releases exactly these noised sums, so a run that is
(epsilon, delta)-DP per record is so per canary, and any score computed from the
observations alone (never from the inclusion bits) turns into a lower bound on
epsilon by :func:`dptrain.audit.one_run.audit_scores`. This audits the clip
factors, the noise, the sampling rate the optimizer is told and the ledger (a
ledger that under-counts steps claims too small an epsilon); it does not audit the
engine's per-example norms or the data sampler (canaries neither pass through the
model nor are drawn by the sampler): the black-box audit does.

**Signs.** A canary's gradient changes sign from step to step: at steps 2i and
2i + 1 it is ``+-norm`` and ``-+norm`` (the sign drawn per canary and pair). A
record may have any gradient at any step, so the guarantee covers such canaries;
what it buys is that noise which repeats from one step to the next (a generator
reseeded every step) cancels in the signed sum, while independent noise does not.

**Scores** (:data:`SCORES`), each a function of the observations alone:

- ``"sum"``: ``sum_t x_tj``, Steinke et al.'s white-box score.
- ``"per-step"``: the log-likelihood ratio of "present" against "absent" with a
  noise variance estimated per step from all canaries' observations,
  ``v_t = Var_j(x_tj) - mu^2 pi (1 - pi)`` (``mu`` = min(norm, C), what a correctly
  clipped canary adds; ``pi = q / 2`` the share of canaries present), summed over
  steps: ``log(1 - q + q exp((x mu - mu^2 / 2) / v_t))``. A step whose noise is
  missing or small gets a large weight and separates its canaries.
- ``"per-tensor"``: the same with the variance estimated per step and per tensor
  (tensors with fewer than :data:`MIN_CANARIES_PER_TENSOR` canaries use the step's):
  noise missing from some tensors separates the canaries on them.

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
from dptrain.audit.one_run import (
    METHODS,
    OneRunAudit,
    audit_scores,
    one_run_audit,
    steinke_ceiling,
)

__all__ = ["DEFAULT_NORM_IN_C", "MIN_CANARIES_PER_TENSOR", "SCORES", "GradientCanaries"]

#: The canaries' norm before clipping, in units of C, unless given.
DEFAULT_NORM_IN_C = 10.0
#: The scores every white-box audit reports, in this order.
SCORES: tuple[str, ...] = ("sum", "per-step", "per-tensor")
#: A tensor with fewer canaries uses the step's pooled noise estimate: a variance from a
#: handful of values would be too noisy to weigh a step by.
MIN_CANARIES_PER_TENSOR = 100
# A variance estimate at or below 0 (a step or tensor without noise) is raised to this
# share of mu^2: the likelihood ratio is then huge and of the right sign for every canary.
_VAR_FLOOR = 1e-12


def _noise_variance(x: torch.Tensor, mu: float, present_share: float) -> float:
    """Var(x) less the spread the present canaries add (mu with probability pi)."""
    v = float(x.var()) - mu * mu * present_share * (1.0 - present_share)
    return max(v, _VAR_FLOOR * mu * mu)


def _log_likelihood_ratio(x: torch.Tensor, mu: float, var: float, q: float) -> torch.Tensor:
    """log of [q N(x; mu, var) + (1 - q) N(x; 0, var)] / N(x; 0, var): included (sampled
    with probability q, then adding mu) against left out."""
    shift = (x * mu - 0.5 * mu * mu) / var
    if q >= 1.0:
        return shift
    return torch.logaddexp(torch.full_like(x, math.log1p(-q)), shift + math.log(q))


class GradientCanaries:
    """``m`` Dirac canary gradients, included with probability 1/2; attach to a DP optimizer.

    Args:
        params: the trainable parameters (the canaries' coordinates are drawn among them).
        m: number of canaries (>= 2, at most the number of coordinates).
        norm: each canary gradient's norm before clipping (default:
            :data:`DEFAULT_NORM_IN_C` times the optimizer's C at attach time: above C, so
            that clipping which is off or too loose lets them in larger; at exactly C
            such a bug would not touch them).
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
        #: Each score of :data:`SCORES` per canary (higher: more likely included).
        self.score_by_name = {name: torch.zeros(self.m, dtype=torch.float64) for name in SCORES}
        self.steps = 0
        self.sampled = torch.zeros(self.m, dtype=torch.long)
        #: q of every observed step, and the noise std estimated at it (pooled, in units
        #: of the clipped sum: sigma C for a correct step).
        self.sample_rates: list[float] = []
        self.noise_std: list[float] = []
        self._pair_signs = torch.ones(self.m, dtype=torch.float64)
        self._signs = self._pair_signs

    @property
    def signs(self) -> torch.Tensor:
        """Each canary's sign at the current (or last) step: +-1, flipped at the second
        step of each pair."""
        return self._signs

    @property
    def scores(self) -> torch.Tensor:
        """The ``"sum"`` score: sum over steps of the signed observations."""
        return self.score_by_name["sum"]

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
            self.norm = DEFAULT_NORM_IN_C * float(optimizer.max_grad_norm)
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
        if self.steps % 2 == 0:  # a new pair of steps: new signs, flipped at the next step
            flip = torch.rand(self.m, generator=self._gen, dtype=torch.float64) < 0.5
            self._pair_signs = 1.0 - 2.0 * flip.double()
            self._signs = self._pair_signs
        else:
            self._signs = -self._pair_signs
        factor = float(optimizer.engine.clip_factors(torch.tensor([self.norm]))[0])
        value = self.norm * factor
        for i, which, flat in self._groups:
            p = self.params[i]
            s = optimizer.clipped_sum(p)  # at least float32: a bf16 p.grad would round
            add = present[which].double() * self._signs[which] * value
            s.view(-1).index_add_(0, flat.to(p.device), add.to(s.dtype).to(p.device))

    def after_noise(self, optimizer: Any) -> None:
        """Observe the noised sum at each canary's coordinate (the update times q N, times
        the canary's sign) and add each score's share of this step."""
        scale = optimizer.expected_batch_size
        x = torch.empty(self.m, dtype=torch.float64)
        for i, which, flat in self._groups:
            got = self.params[i].grad.detach().reshape(-1)[flat.to(self.params[i].device)]
            x[which] = got.double().cpu() * scale
        x *= self._signs
        q = float(optimizer.sample_rate)
        # what a correctly clipped canary adds: the auditor's model, not the engine's factor
        mu = min(self.norm, float(optimizer.max_grad_norm))
        share = q / 2.0  # included with probability 1/2, then sampled with probability q
        pooled = _noise_variance(x, mu, share)
        per_tensor = torch.empty_like(x)
        for _, which, _ in self._groups:
            xs = x[which]
            var = _noise_variance(xs, mu, share) if len(xs) >= MIN_CANARIES_PER_TENSOR else pooled
            per_tensor[which] = _log_likelihood_ratio(xs, mu, var, q)
        self.score_by_name["sum"] += x
        self.score_by_name["per-step"] += _log_likelihood_ratio(x, mu, pooled, q)
        self.score_by_name["per-tensor"] += per_tensor
        self.sample_rates.append(q)
        self.noise_std.append(math.sqrt(pooled))
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
        score: str = "sum",
        tests: int = 1,
    ) -> OneRunAudit:
        """One score's epsilon lower bound (:func:`dptrain.audit.one_run.one_run_audit`),
        at ``confidence`` for a family of ``tests`` tests."""
        self._check_observed()
        if score not in SCORES:
            raise ValueError(f"score={score!r} is not allowed: expected one of {list(SCORES)}")
        return one_run_audit(
            self.score_by_name[score].numpy(),
            self.included.numpy(),
            delta,
            confidence,
            k_plus,
            k_minus,
            method=method,
            tests=tests,
            score=score,
        )

    def full_batch(self) -> bool:
        """Whether every observed step had q = 1 (the per-canary mechanism is then exactly
        Gaussian, and the Gaussian f-DP analysis valid)."""
        return bool(self.sample_rates) and all(q == 1.0 for q in self.sample_rates)

    def methods(self) -> tuple[str, ...]:
        """The analyses valid for this run: both for full batches, Steinke et al.'s alone
        under Poisson sampling (the trade-off curve is then not Gaussian)."""
        return METHODS if self.full_batch() else ("steinke2023",)

    def audits(
        self, delta: float, confidence: float = 0.95, *, tests: int | None = None
    ) -> list[OneRunAudit]:
        """Every score under every valid analysis (:meth:`methods`), one family at
        ``confidence`` (Bonferroni over ``tests``, default the audits made here)."""
        self._check_observed()
        return audit_scores(
            {name: t.numpy() for name, t in self.score_by_name.items()},
            self.included.numpy(),
            delta,
            confidence,
            methods=self.methods(),
            tests=tests,
        )

    def _check_observed(self) -> None:
        if self.steps == 0:
            raise ValueError("no step was observed: attach the canaries before training")

    def report(
        self,
        claimed_epsilon: float | None,
        delta: float,
        ledger: Any = None,
        confidence: float = 0.95,
    ) -> dict[str, Any]:
        """The audit section of a recipe's ``results.json`` (and of the self-test).

        Every score (:data:`SCORES`) under every valid analysis, Bonferroni-corrected
        together; the Gaussian f-DP analysis only where every step (and every step of
        the ``ledger``, when given) has q = 1. ``status``: ``"flagged"`` (a bound above
        the claim: the run is not as private as claimed), ``"not flagged"`` or
        ``"no claim"`` (``claimed_epsilon`` None: nothing to test). ``ceiling`` is the
        largest bound Steinke et al.'s analysis could give here
        (:func:`dptrain.audit.one_run.steinke_ceiling`); under Poisson sampling a claim
        above it cannot be flagged, and ``reach`` says so.
        """
        full = self.full_batch() and (
            ledger is None or all(seg.sample_rate == 1.0 for seg in ledger.segments)
        )
        methods = METHODS if full else ("steinke2023",)
        audits = audit_scores(
            {name: t.numpy() for name, t in self.score_by_name.items()},
            self.included.numpy(),
            delta,
            confidence,
            methods=methods,
        )
        tests = len(audits)
        flagged = claimed_epsilon is not None and any(a.epsilon > claimed_epsilon for a in audits)
        ceiling = None if full else steinke_ceiling(self.m, delta, confidence, tests)
        status = "no claim" if claimed_epsilon is None else "flagged" if flagged else "not flagged"
        reach = (
            f"this audit cannot flag a claim above {ceiling:.2f} (Steinke et al.'s bound with "
            f"{self.m} canaries at delta {delta:g}; the Gaussian analysis needs full batches)"
            if ceiling is not None and claimed_epsilon is not None and claimed_epsilon > ceiling
            else ""
        )
        return {
            "kind": "white-box one-run audit (Dirac canary gradients, Steinke et al. 2023)",
            "canaries": self.m,
            "steps_observed": self.steps,
            "claimed_epsilon": claimed_epsilon,
            "delta": delta,
            "confidence": confidence,
            "correction": (
                f"Bonferroni over {tests} tests ({len(SCORES)} scores x {len(methods)} "
                f"analyses): each at level {(1 - confidence) / tests:.3g}"
            ),
            # per analysis, the largest over the scores (each already Bonferroni-corrected)
            "lower_bounds": {m: max(a.epsilon for a in audits if a.method == m) for m in methods},
            "lower_bounds_by_score": {f"{a.score}/{a.method}": a.epsilon for a in audits},
            "audits": [a.to_dict() for a in audits],
            "flagged": flagged,
            "status": status,
            "ceiling": ceiling,
            "reach": reach,
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
