"""Property checks of a private run: cheap tests that the mechanism is the one the accountant
describes, run on the user's own model, data, engine and optimizer for a few steps.

An audit (:mod:`dptrain.audit.one_run`) bounds epsilon from below and can only see what its
canaries pass through; a property check tests one assumption of the proof directly
(Abadi et al. 2016, Algorithm 1; Mironov et al. 2019 for the sampled Gaussian mechanism the
accountants compose):

(a) **noise independent across steps**: the noise of step t, recovered as the noised
    gradient minus the clipped sum / (q N), is uncorrelated with that of every other step.
    For two independent isotropic Gaussian vectors of n coordinates the sample correlation r
    has (1 + r) / 2 ~ Beta((n - 1) / 2, (n - 1) / 2) exactly; every pair of steps is tested,
    per tensor and over all tensors, Bonferroni-corrected. The same test on named streams
    (:func:`independent_streams`) checks per-rank noise generators.
(b) **per-tensor noise std = sigma C / (q N)**: sum_t sum_i e_ti^2 / s_t^2 ~ chi^2(T n) for
    each tensor, and sum_i e_ti^2 / s_t^2 ~ chi^2(n) for each tensor and step (a std that
    varies by step: a divisor taken from the realised batch size); two-sided, Bonferroni.
(c) **realised batch sizes ~ Binomial(N, q_t)**: each size goes through the randomised
    probability integral transform of Binomial(N, q_t) (exactly uniform under the claim,
    however small N q) and then Phi^-1, giving z_t iid N(0, 1); their mean (a sampler at the
    wrong rate) and sum of squares (fixed-size batches: too little spread) are tested.
(d) **one record moves the clipped sum by at most C**: the sensitivity probe scales one
    record's loss by 0, 1, 10, 1e3 and 1e6 in a real chunk and compares the engine's clipped
    sums pairwise (the same forward randomness each time).
(e) **ledger steps = optimizer steps**, each recorded with the step's q and the claimed sigma;
    and the engine clips at the C the optimizer's noise is calibrated to.

The statistical checks (a)-(c) share the significance level ``alpha`` (default 1e-3): each
is flagged when its Bonferroni-adjusted p-value is below alpha / 3, so a correct run is
flagged with probability below alpha (union bound). (d) and (e) are exact (pass/fail, with
a relative slack of 1e-4 for float32 rounding in (d)).

The report is not differentially private: the probe reads clipped sums and the batch sizes
reveal N. Run the checks on data you may reveal (the CLI's self-test) or treat the report as
a non-private release.
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from scipy import stats
from torch import Tensor, nn

from dptrain._checks import check_in_interval, check_int
from dptrain.losses import per_example_cross_entropy

__all__ = [
    "DEFAULT_ALPHA",
    "PROBE_SCALES",
    "PropertyCheck",
    "PropertyReport",
    "batch_size_test",
    "check_properties",
    "independent_streams",
    "noise_std_test",
    "sensitivity_probe",
    "steps_independent",
]

DEFAULT_ALPHA = 1e-3
"""Probability that a correct run is flagged, at most (shared by the statistical checks)."""

STATISTICAL_CHECKS = 3
"""(a), (b), (c): each is compared with alpha / 3."""

PROBE_SCALES = (0.0, 1.0, 10.0, 1e3, 1e6)
"""The probed record's loss multipliers (0 removes it; 1e6 pushes its gradient far past C)."""

MAX_TOTAL_COORDINATES = 2**21
"""Coordinates kept over all tensors at most (each tensor keeps at least 1,000)."""

PROBE_SLACK = 1e-4
"""Relative slack of the sensitivity probe: float32 sums of clipped gradients round by ~1e-7."""

PASS, FLAG, NOT_RUN = "pass", "FLAGGED", "not run"

PROBE_NAME = "one record moves the clipped sum by <= C"
PROBE_MEANING = (
    "a record's gradient reaches the sum unclipped or clipped above C (clipping off, at 2C, "
    "per batch, rows that are not records): sensitivity exceeds the noise's C"
)


@dataclass
class PropertyCheck:
    """One check: its verdict, the (adjusted) p-value where it is statistical, what it means."""

    name: str
    status: str
    """``pass``, ``FLAGGED`` or ``not run`` (``detail`` says why)."""
    meaning: str
    """One line: what a flag means."""
    detail: str = ""
    """The measured figure behind the verdict."""
    p_value: float | None = None
    """Bonferroni-adjusted within the check; None for the exact checks."""
    level: float | None = None
    """The significance level the p-value is compared with."""

    @property
    def flagged(self) -> bool:
        """Whether this check flagged the run."""
        return self.status == FLAG


@dataclass
class PropertyReport:
    """What :func:`check_properties` returns."""

    checks: list[PropertyCheck]
    steps: int
    alpha: float
    seconds: float
    setting: str = ""
    batch_sizes: list[int] = field(default_factory=list)

    @property
    def flagged(self) -> bool:
        """Whether any check flagged the run."""
        return any(c.flagged for c in self.checks)

    @property
    def complete(self) -> bool:
        """Whether every check ran."""
        return all(c.status != NOT_RUN for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``results.json``)."""
        return {
            "setting": self.setting,
            "steps": self.steps,
            "alpha": self.alpha,
            "flagged": self.flagged,
            "complete": self.complete,
            "seconds": self.seconds,
            "batch_sizes": self.batch_sizes,
            "checks": [asdict(c) for c in self.checks],
        }

    def table(self) -> str:
        """A markdown table of the checks and the verdict."""
        lines = [
            "| check | result | p-value (level) | measured | a flag means |",
            "| --- | --- | ---: | --- | --- |",
        ]
        for c in self.checks:
            p = "exact" if c.p_value is None else f"{c.p_value:.3g} ({c.level:.2g})"
            lines.append(f"| {c.name} | {c.status} | {p} | {c.detail} | {c.meaning} |")
        if self.flagged:
            verdict = "FLAGGED: the run is not the mechanism its ledger claims"
        elif not self.complete:
            verdict = "not flagged, but some checks did not run: they prove nothing"
        else:
            verdict = "nothing flagged"
        lines += [
            "",
            f"{self.steps} steps; a correct run is flagged with probability < {self.alpha:g} "
            f"(each statistical check at {self.alpha / STATISTICAL_CHECKS:.2g}, Bonferroni "
            f"within). {verdict}.",
        ]
        return "\n".join(lines)


# -- the statistical tests, on arrays ---------------------------------------------------------


def _two_sided(cdf: float, sf: float) -> float:
    return float(min(1.0, 2.0 * min(cdf, sf)))


def _pair_p_values(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two-sided p-values and correlations of every pair of rows of ``x`` (k, n), n >= 3,
    under independent isotropic Gaussian rows; a zero row gives no pair (p = 1)."""
    n = x.shape[1]
    norms = np.linalg.norm(x, axis=1)
    ok = norms > 0
    unit = np.where(ok[:, None], x / np.where(ok, norms, 1.0)[:, None], 0.0)
    r = np.clip(unit @ unit.T, -1.0, 1.0)
    i, j = np.triu_indices(len(x), 1)
    r = r[i, j]
    a = (n - 1) / 2.0
    u = (1.0 + r) / 2.0
    p = np.minimum(1.0, 2.0 * np.minimum(stats.beta.cdf(u, a, a), stats.beta.sf(u, a, a)))
    p = np.where(ok[i] & ok[j], p, 1.0)
    return p, r


def _independence(groups: Mapping[str, np.ndarray], level: float, what: str) -> PropertyCheck:
    """Pairwise independence of the rows of each group (k, n), Bonferroni over all pairs."""
    ps, worst, worst_name, tested = [], 0.0, "", 0
    for name, x in groups.items():
        if x.shape[0] < 2 or x.shape[1] < 3:
            continue
        p, r = _pair_p_values(np.asarray(x, dtype=np.float64))
        tested += 1
        ps.append(p)
        k = int(np.argmax(np.abs(r)))
        if abs(r[k]) >= abs(worst):
            worst, worst_name = float(r[k]), name
    meaning = (
        f"the noise of different {what} is correlated (e.g. the same noise repeated): updates "
        "can cancel it, and the accountant's composition does not hold"
    )
    name = f"noise independent across {what}"
    if not ps:
        return PropertyCheck(
            name, NOT_RUN, meaning, f"needs >= 2 {what} and a tensor of >= 3 coordinates"
        )
    allp = np.concatenate(ps)
    adjusted = float(min(1.0, allp.min() * len(allp)))
    detail = f"max |r| {abs(worst):.3g} ({worst_name}) over {len(allp)} pairs"
    status = FLAG if adjusted < level else PASS
    return PropertyCheck(name, status, meaning, detail, adjusted, level)


def independent_streams(
    streams: Mapping[str, Tensor | np.ndarray], level: float = DEFAULT_ALPHA / STATISTICAL_CHECKS
) -> PropertyCheck:
    """Test that named noise streams (one vector each: the noise of each rank, of each step)
    are independent: every pair's correlation against its exact null distribution,
    Bonferroni over pairs (see the module docstring, check (a)).

    For data-parallel runs: draw each rank's noise as the rank would (same shapes) and pass
    them here; ranks seeded alike give r = 1 and are flagged.
    """
    level = check_in_interval("level", level, 0.0, 1.0)
    if len(streams) < 2:
        raise ValueError(f"streams has {len(streams)} entries: expected at least 2 to compare")
    rows = [
        np.asarray(torch.as_tensor(v).detach().double().reshape(-1).cpu()) for v in streams.values()
    ]
    if len({len(r) for r in rows}) != 1:
        raise ValueError(
            f"streams have lengths {[len(r) for r in rows]}: expected vectors of one length"
        )
    return _independence({"streams": np.stack(rows)}, level, "streams")


def steps_independent(
    residuals: Mapping[str, np.ndarray], level: float = DEFAULT_ALPHA / STATISTICAL_CHECKS
) -> PropertyCheck:
    """Check (a) on per-tensor noise (steps, coordinates) arrays: each tensor of >= 3
    coordinates and all tensors together."""
    groups = dict(residuals)
    if len(residuals) > 1:
        groups["all tensors"] = np.concatenate(list(residuals.values()), axis=1)
    return _independence(groups, level, "steps")


def noise_std_test(
    residuals: Mapping[str, np.ndarray],
    expected_std: Sequence[float],
    level: float = DEFAULT_ALPHA / STATISTICAL_CHECKS,
) -> PropertyCheck:
    """Check (b): each tensor's noise (steps, coordinates) has std ``expected_std[t]`` at
    step t. Per tensor, over all steps: sum (e / s_t)^2 ~ chi^2(steps x coordinates) (a
    small error in every step); and per tensor and step: chi^2(coordinates) (a std that
    varies from step to step, as dividing by the realised batch size makes it). Two-sided,
    Bonferroni over all these tests."""
    s = np.asarray(expected_std, dtype=np.float64)
    meaning = (
        "the noise of a tensor is not N(0, (sigma C / (q N))^2): too little noise breaks the "
        "guarantee (missing, or its std without C); too much, or varying by step, means a "
        "wrong sigma, C or divisor"
    )
    name = "per-tensor noise std = sigma C / (q N)"
    if not residuals:
        return PropertyCheck(name, NOT_RUN, meaning, "no step was observed")
    pooled, worst_step, ratios, per_step = {}, {}, {}, []
    for tensor, e in residuals.items():
        e = np.asarray(e, dtype=np.float64)
        if e.shape[0] != len(s):
            raise ValueError(
                f"residuals[{tensor!r}] has {e.shape[0]} steps, expected_std {len(s)}: "
                "expected one std per step"
            )
        by_step = ((e / s[:, None]) ** 2).sum(axis=1)
        chi, dof = float(by_step.sum()), e.size
        pooled[tensor] = _two_sided(stats.chi2.cdf(chi, dof), stats.chi2.sf(chi, dof))
        ratios[tensor] = math.sqrt(chi / dof)
        n = e.shape[1]
        p_steps = np.minimum(
            1.0, 2.0 * np.minimum(stats.chi2.cdf(by_step, n), stats.chi2.sf(by_step, n))
        )
        per_step.append(p_steps)
        t = int(np.argmin(p_steps))
        worst_step[tensor] = (t, math.sqrt(by_step[t] / n))
    tests = len(pooled) + sum(len(p) for p in per_step)
    smallest = min(min(pooled.values()), min(float(p.min()) for p in per_step))
    adjusted = float(min(1.0, smallest * tests))
    order = sorted(ratios, key=lambda t: pooled[t])
    detail = "measured / claimed std: " + ", ".join(f"{t} {ratios[t]:.4f}" for t in order[:4])
    if len(ratios) > 4:
        detail += f" (+{len(ratios) - 4} tensors)"
    t, r = worst_step[order[0]]
    detail += f"; furthest step {t}: {r:.4f} ({order[0]})"
    return PropertyCheck(name, FLAG if adjusted < level else PASS, meaning, detail, adjusted, level)


def batch_size_test(
    sizes: Sequence[int],
    dataset_size: int,
    sample_rates: Sequence[float],
    level: float = DEFAULT_ALPHA / STATISTICAL_CHECKS,
    seed: int = 0,
) -> PropertyCheck:
    """Check (c): realised logical batch sizes n_t ~ Binomial(N, q_t), independently.

    z_t = Phi^-1(F(n_t - 1) + V_t P(n_t)), V_t ~ U(0, 1) from ``seed`` (the randomised
    probability integral transform: exactly U(0, 1) under the claim, for any N and q), so
    z_t ~ N(0, 1) iid. Two tests, Bonferroni over both: sum z_t / sqrt(T) ~ N(0, 1) (a
    sampler at another rate) and sum z_t^2 ~ chi^2(T) (two-sided: fixed-size batches have
    too little spread, a mixture too much).
    """
    n = check_int("dataset_size", dataset_size, 1)
    k = np.asarray(sizes, dtype=np.int64)
    q = np.asarray(sample_rates, dtype=np.float64)
    name = "batch sizes ~ Binomial(N, q)"
    meaning = (
        "the sampler does not draw each record independently with the recorded q (another "
        "rate, fixed-size batches): the accountant's amplification by sampling does not apply"
    )
    if len(k) != len(q):
        raise ValueError(f"sizes has {len(k)} entries, sample_rates {len(q)}: expected one each")
    if len(k) < 2:
        return PropertyCheck(name, NOT_RUN, meaning, "needs at least 2 steps")
    if (k < 0).any() or (k > n).any():
        return PropertyCheck(name, FLAG, meaning, f"a batch size outside [0, N={n}]: {k.tolist()}")
    lower = stats.binom.cdf(k - 1, n, q)
    mass = stats.binom.pmf(k, n, q)
    v = np.random.default_rng(seed).random(len(k))
    u = np.clip(lower + v * mass, 1e-300, 1.0 - 1e-16)
    z = stats.norm.ppf(u)
    t = len(z)
    p_mean = 2.0 * stats.norm.sf(abs(z.sum()) / math.sqrt(t))
    chi = float((z**2).sum())
    p_spread = _two_sided(stats.chi2.cdf(chi, t), stats.chi2.sf(chi, t))
    adjusted = float(min(1.0, 2.0 * min(p_mean, p_spread)))
    expected = float((n * q).mean())
    detail = (
        f"mean size {k.mean():.4g} vs N q {expected:.4g}; spread z^2 {chi / t:.3g} of 1 "
        f"(p mean {p_mean:.2g}, p spread {p_spread:.2g})"
    )
    return PropertyCheck(name, FLAG if adjusted < level else PASS, meaning, detail, adjusted, level)


# -- the sensitivity probe -------------------------------------------------------------------


def sensitivity_probe(
    engine: Any,
    losses_of: Callable[[], Tensor],
    max_grad_norm: float,
    records: int = 4,
    *,
    units: Tensor | None = None,
    slack: float = PROBE_SLACK,
) -> PropertyCheck:
    """Check (d): scaling one record's loss by each of :data:`PROBE_SCALES` moves the
    engine's clipped sum by at most C (``max_grad_norm``), for the first ``records`` records
    (or units, with ``units``: an id per record, as the engine takes them).

    ``losses_of()`` runs the forward again and returns the chunk's per-example losses; it must
    be deterministic (same dropout masks). The engine's ``p.grad`` is cleared before and after.
    """
    params = engine.parameters()
    name, meaning = PROBE_NAME, PROBE_MEANING

    def clear() -> None:
        for p in params:
            p.grad = None

    worst = 0.0
    probed = 0
    try:
        for r in range(records):
            sums = []
            for lam in PROBE_SCALES:
                clear()
                losses = losses_of()
                if r >= losses.shape[0] or (units is not None and r > int(units.max())):
                    break
                scale = torch.ones_like(losses)
                scale[(units == units.unique()[r]) if units is not None else r] = lam
                engine.backward(losses * scale, units=units)
                sums.append(
                    torch.cat(
                        [
                            (s if s is not None else torch.zeros_like(p)).detach().reshape(-1)
                            for p in params
                            for s in [engine.clipped_sum(p)]
                        ]
                    ).double()
                )
            if len(sums) < len(PROBE_SCALES):
                break
            probed += 1
            for x, y in itertools.combinations(sums, 2):
                worst = max(worst, float((x - y).norm()))
    finally:
        clear()
    if probed == 0:
        return PropertyCheck(name, NOT_RUN, meaning, "the probed chunk holds no record")
    bound = max_grad_norm * (1 + slack)
    detail = (
        f"max move {worst / max_grad_norm:.4f} C over {probed} records x {len(PROBE_SCALES)} scales"
    )
    return PropertyCheck(name, FLAG if worst > bound else PASS, meaning, detail)


# -- a real run -------------------------------------------------------------------------------


class _Observer:
    """The optimizer's audit hook: for chosen coordinates of each tensor, the noise of each
    step, e = noised gradient - clipped sum / ``divisor`` (q N, set before each step: the
    claim's divisor, not the optimizer's); forwards to a hook already there."""

    def __init__(self, params: list[nn.Parameter], picks: list[Tensor], previous: Any):
        self.params, self.picks, self.previous = params, picks, previous
        self.divisor = math.nan
        self._sums: list[Tensor] = []
        self.noise: list[list[np.ndarray]] = []

    def before_noise(self, optimizer: Any) -> None:
        if self.previous is not None:
            self.previous.before_noise(optimizer)  # its canaries are part of the sum
        self._sums = [
            optimizer.clipped_sum(p).detach().reshape(-1)[i.to(p.device)].double().cpu()
            for p, i in zip(self.params, self.picks, strict=True)
        ]

    def after_noise(self, optimizer: Any) -> None:
        self.noise.append(
            [
                (
                    p.grad.detach().reshape(-1)[i.to(p.device)].double().cpu() - s / self.divisor
                ).numpy()
                for p, i, s in zip(self.params, self.picks, self._sums, strict=True)
            ]
        )
        self._sums = []
        if self.previous is not None:
            self.previous.after_noise(optimizer)


def _default_loss(model: nn.Module, chunk: Any) -> Tensor:
    if not (isinstance(chunk, Sequence) and len(chunk) == 2):
        raise ValueError(
            f"the chunks are {type(chunk).__name__}, not (inputs, targets): pass loss_fn= "
            "(model, chunk) -> per-example losses"
        )
    x, y = chunk
    return per_example_cross_entropy(model(x), y)


def _ledger_steps(ledger: Any) -> list[tuple[float, float]]:
    return [(s.sample_rate, s.noise_multiplier) for s in ledger.segments for _ in range(s.count)]


def _rng_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def check_properties(
    private: Any,
    *,
    steps: int = 20,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None = None,
    alpha: float = DEFAULT_ALPHA,
    probe_records: int = 4,
    max_coordinates: int = 65_536,
    seed: int = 0,
    restore: bool = True,
    progress: bool = False,
) -> PropertyReport:
    """Run ``steps`` real private steps of ``private`` and check (a)-(e) (module docstring).

    Args:
        private: what :func:`dptrain.make_private` returned (one process; its data loader,
            engine, optimizer and ledger are the ones exercised), or a
            :class:`dptrain.hf.DPTrainer` before ``train()``: its private state is built as
            ``train()`` builds it, each step is its own ``training_step``, and afterwards the
            state is dropped (the model and the given optimizer restored), so ``train()``
            then starts as if nothing had run (with ``PrivacyArguments.seed`` set, it draws
            the very batches and noise the checks saw: do not release the report with the
            model).
        steps: private steps to run (at most those the loader has left).
        loss_fn: ``(model, chunk) -> per-example losses`` for one physical chunk; default:
            chunks are ``(inputs, targets)`` and the loss is per-example cross-entropy (a
            DPTrainer's own per-example loss for a trainer).
        alpha: a correct run is flagged with probability below ``alpha``.
        probe_records: records of the first non-empty chunk probed by check (d).
        max_coordinates: per tensor, at most this many coordinates (drawn with ``seed``)
            are kept for (a) and (b), and at most 2^21 over all tensors (each keeps at
            least 1,000): memory steps x kept coordinates x 8 bytes.
        seed: fixes the coordinates and the randomisation of (c) (not the run's noise).
        restore: put the model, the optimizer's state, the ledger, the steps taken and the
            sampler back as they were (the noise generators are not: training then draws
            noise the checks never saw). False: the steps stay, as training steps.
        progress: show a progress bar.

    The report is not differentially private (module docstring).
    """
    if _is_trainer(private):
        if not restore:
            raise ValueError(
                "restore=False is not allowed with a DPTrainer: train it with train(), whose "
                "steps Trainer counts; the checks' steps are dropped"
            )
        return _check_trainer(
            private,
            steps=steps,
            loss_fn=loss_fn,
            alpha=alpha,
            probe_records=probe_records,
            max_coordinates=max_coordinates,
            seed=seed,
            progress=progress,
        )
    return _check_run(
        private,
        None,
        steps=steps,
        loss_fn=loss_fn,
        alpha=alpha,
        probe_records=probe_records,
        max_coordinates=max_coordinates,
        seed=seed,
        restore=restore,
        progress=progress,
    )


def _is_trainer(run: Any) -> bool:
    return all(hasattr(run, a) for a in ("training_step", "create_optimizer", "privacy_plan"))


def _check_trainer(trainer: Any, **kw: Any) -> PropertyReport:
    """A DPTrainer: its private state built as train() builds it, each step its own
    training_step, the state dropped afterwards (train() then builds a fresh one)."""
    from dptrain.hf.data import PoissonStep

    if trainer.privacy is not None:
        raise ValueError(
            "this DPTrainer has trained already (its private state exists): run "
            "check_properties on a new DPTrainer, before train()"
        )
    given = trainer.optimizer
    trainer.create_optimizer()
    private = trainer.privacy
    device = trainer.args.device

    def step(batch: Any) -> None:
        trainer.training_step(trainer.model, PoissonStep(batch))

    def loss(model: nn.Module, chunk: Any) -> Tensor:
        return trainer.compute_per_example_loss(model, _to_device(chunk, device))

    was_training = trainer.model.training
    try:
        trainer.model.train()
        return _check_run(private, step, **{**kw, "loss_fn": kw["loss_fn"] or loss}, restore=True)
    finally:
        private.engine.detach()
        trainer.model.train(was_training)
        trainer.privacy = None
        trainer.optimizer = given


def _to_device(chunk: Any, device: torch.device) -> Any:
    if isinstance(chunk, Mapping):
        return {k: _to_device(v, device) for k, v in chunk.items()}
    return chunk.to(device) if isinstance(chunk, Tensor) else chunk


def _check_run(
    private: Any,
    step_fn: Callable[[Any], None] | None,
    *,
    steps: int,
    loss_fn: Callable[[nn.Module, Any], Tensor] | None,
    alpha: float,
    probe_records: int,
    max_coordinates: int,
    seed: int,
    restore: bool,
    progress: bool,
) -> PropertyReport:
    """check_properties on a make_private result; ``step_fn(batch)`` runs one private step
    (default: every chunk through ``loss_fn`` and ``private.backward``, then the step)."""
    steps = check_int("steps", steps, 2)
    alpha = check_in_interval("alpha", alpha, 0.0, 1.0)
    probe_records = check_int("probe_records", probe_records, 1)
    max_coordinates = check_int("max_coordinates", max_coordinates, 1)
    for attr in ("optimizer", "data_loader", "engine", "ledger", "model"):
        if not hasattr(private, attr):
            raise ValueError(
                f"private={type(private).__name__} has no {attr!r}: expected what "
                "dptrain.make_private returns"
            )
    opt = private.optimizer
    if getattr(opt, "world_size", 1) > 1:
        raise ValueError(
            f"a run on world_size={opt.world_size} processes is not allowed: its step noises "
            "and reduces without the audit hook; check a one-process run of the same setting "
            "(and the per-rank noise streams with independent_streams)"
        )
    loss_fn = loss_fn or _default_loss
    level = alpha / STATISTICAL_CHECKS
    model = private.model
    engine = private.engine
    start = time.perf_counter()

    params = [p for p in opt.params() if p.requires_grad]
    names = {id(p): n for n, p in model.named_parameters()}
    labels = [names.get(id(p), f"tensor{i}") for i, p in enumerate(params)]
    gen = torch.Generator().manual_seed(seed)
    # memory: steps x kept coordinates x 8 bytes; a model of many tensors keeps fewer of each
    keep = min(max_coordinates, max(1000, MAX_TOTAL_COORDINATES // max(len(params), 1)))
    picks = [
        torch.arange(p.numel())
        if p.numel() <= keep
        else torch.randperm(p.numel(), generator=gen)[:keep].sort().values
        for p in params
    ]
    saved = None
    if restore:
        saved = (
            copy.deepcopy(model.state_dict()),
            copy.deepcopy(opt.state_dict()),
            copy.deepcopy(private.data_loader.state_dict()),
        )
    previous = opt.audit_hook
    observer = _Observer(params, picks, previous)
    ledger_before = private.ledger.num_steps
    taken_before = opt.steps_taken
    n_units = private.data_loader.loader.dataset_size
    sizes: list[int] = []
    rates: list[float] = []
    probe: PropertyCheck | None = None
    batches = iter(private.data_loader)
    try:
        opt.audit_hook = observer
        for _ in _progress(range(steps), progress):
            batch = next(batches, None)
            if batch is None:
                break
            if probe is None and batch.chunks and batch.size:
                probe = _probe(private, batch, loss_fn, probe_records)
            observer.divisor = batch.sample_rate * n_units
            if step_fn is not None:
                step_fn(batch)
            else:
                opt.zero_grad(set_to_none=True)
                for chunk in batch.chunks:
                    private.backward(loss_fn(model, chunk))
                opt.step()
            sizes.append(int(batch.num_units))
            rates.append(float(batch.sample_rate))
        recorded = _ledger_steps(private.ledger)[ledger_before:]
        taken = opt.steps_taken - taken_before
    finally:
        opt.audit_hook = previous
        if saved is not None:
            generators = opt.state_dict()["generators"]
            model.load_state_dict(saved[0])
            opt.load_state_dict({**saved[1], "generators": generators})
            private.data_loader.load_state_dict(saved[2])
        opt.zero_grad(set_to_none=True)
    if len(sizes) < 2:
        raise ValueError(
            f"the data loader had {len(sizes)} steps left: the checks need at least 2 "
            "(build the run with more steps)"
        )

    sigma, c = float(private.noise_multiplier), float(opt.max_grad_norm)
    expected_std = [sigma * c / (q * n_units) for q in rates]
    if len(observer.noise) == len(sizes):
        residuals = {
            label: np.stack([step[k] for step in observer.noise]) for k, label in enumerate(labels)
        }
        noise_checks = [
            steps_independent(residuals, level),
            noise_std_test(residuals, expected_std, level),
        ]
    else:  # the optimizer stepped without its audit hook: the noise was never seen
        why = f"the optimizer's audit hook saw {len(observer.noise)} of {len(sizes)} steps"
        noise_checks = [
            PropertyCheck("noise independent across steps", NOT_RUN, "", why),
            PropertyCheck("per-tensor noise std = sigma C / (q N)", NOT_RUN, "", why),
        ]
    checks = [
        *noise_checks,
        batch_size_test(sizes, n_units, rates, level, seed),
        probe or PropertyCheck(PROBE_NAME, NOT_RUN, PROBE_MEANING, "every batch was empty"),
        _ledger_check(recorded, taken, len(sizes), rates, sigma),
        _one_c(engine, opt),
    ]
    setting = (
        f"{len(sizes)} steps of {type(model).__name__} ({sum(p.numel() for p in params)} "
        f"trainable coordinates in {len(params)} tensors), N {n_units}, q {rates[0]:.4g}, "
        f"sigma {sigma:.4g}, C {c:g}"
    )
    return PropertyReport(
        checks, len(sizes), alpha, time.perf_counter() - start, setting, batch_sizes=sizes
    )


def _progress(it: Any, show: bool) -> Any:
    if not show:
        return it
    from tqdm.auto import tqdm

    return tqdm(it, desc="property checks", unit="step")


def _probe(private: Any, batch: Any, loss_fn: Callable, records: int) -> PropertyCheck:
    """Check (d) on the batch's first chunk, with the run's own engine and C."""
    chunk = batch.chunks[0]
    units = None
    if getattr(private, "by_user", False) and batch.units:
        first = batch.units[0]
        if first.parts != 1:
            return PropertyCheck(
                PROBE_NAME,
                NOT_RUN,
                PROBE_MEANING,
                "the first chunk holds part of a unit cut across chunks",
            )
        units = first.ids
    model = private.model
    devices = _rng_devices(model)
    fork_seed = int(torch.randint(0, 2**31 - 1, (1,)))

    def losses_of() -> Tensor:
        # the same dropout masks for every scale: only the probed record may differ
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(fork_seed)
            return loss_fn(model, chunk)

    private.optimizer.zero_grad(set_to_none=True)
    return sensitivity_probe(
        private.engine, losses_of, float(private.optimizer.max_grad_norm), records, units=units
    )


def _ledger_check(
    recorded: list[tuple[float, float]], taken: int, run: int, rates: list[float], sigma: float
) -> PropertyCheck:
    """Check (e): one ledger entry per optimizer step, each with the step's q and sigma."""
    name = "ledger steps = optimizer steps"
    meaning = (
        "the ledger does not hold every step with its q and sigma: the epsilon it gives "
        "is not the run's"
    )
    problems = []
    if not run == taken == len(recorded):
        problems.append(f"{run} steps run, {taken} optimizer steps, {len(recorded)} recorded")
    else:
        wrong = [
            t
            for t, ((q, s), rate) in enumerate(zip(recorded, rates, strict=True))
            if not (math.isclose(q, rate, rel_tol=1e-12) and math.isclose(s, sigma, rel_tol=1e-12))
        ]
        if wrong:
            t = wrong[0]
            problems.append(
                f"{len(wrong)} steps recorded with other (q, sigma), e.g. step {t}: "
                f"{recorded[t]} for ({rates[t]:g}, {sigma:g})"
            )
    detail = "; ".join(problems) or f"{len(recorded)} of {run} steps, each with its q and sigma"
    return PropertyCheck(name, FLAG if problems else PASS, meaning, detail)


def _one_c(engine: Any, optimizer: Any) -> PropertyCheck:
    """The engine clips at the C the noise is calibrated to."""
    ce, co = float(engine.max_grad_norm), float(optimizer.max_grad_norm)
    same = math.isclose(ce, co, rel_tol=1e-12)
    return PropertyCheck(
        "engine C = noise C",
        PASS if same else FLAG,
        "the engine clips at another C than the noise std sigma C assumes",
        f"engine {ce:g}, optimizer {co:g}",
    )
