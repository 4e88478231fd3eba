"""Recipe: the one-run privacy audit (``dptrain audit one-run``).

Three uses, one report:

- **white-box self-test** (default): train the reference setting with dptrain's own
  ``make_private`` and ``m`` Dirac canary gradients
  (:class:`dptrain.audit.GradientCanaries`) and turn their scores into epsilon
  lower bounds (:func:`dptrain.audit.one_run_audit`), beside the epsilon the
  ledger claims. The setting makes the claim exactly Gaussian, so both analyses
  apply: full-batch DP-GD (``batch_size=full``, q = 1, every step observed) of a
  ``width`` x ``width`` linear softmax classifier on ``examples`` random examples,
  ``steps`` steps, one canary per weight unless ``canaries`` says fewer. A lower
  bound above the claim proves that this installation does not do what the
  accountant assumes. ``batch_size=N`` (an integer) audits Poisson-sampled
  steps instead (then only Steinke et al.'s analysis is valid).
- **black-box self-test** (``mode=blackbox``): canary *inputs* (bags of ``tokens``
  copies of a random vector, random labels) in the training data of a zero-initialised
  bag-of-tokens linear classifier, scored by their loss on the final model; this
  passes through the whole pipeline, the engine's per-example rows included.
- **your own canaries**: ``scores=FILE`` (CSV or JSONL with columns ``score`` and
  ``included``, one row per canary, from any pipeline) skips the training and
  audits those scores against ``claimed_epsilon``.

1. setup: the config (:class:`OneRunAuditConfig`), checked; 2. train (white-box
only), with a progress bar; 3. audit: both methods at ``confidence``; 4. save:
``results.json``, ``table.md``, ``config.yaml`` in ``out``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from dptrain._checks import check_in_interval, check_int, check_positive
from dptrain.audit.gradient_canaries import GradientCanaries
from dptrain.audit.one_run import METHODS, OneRunAudit, one_run_audit
from dptrain.config import ConfigError, load_config, save_config
from dptrain.losses import per_example_cross_entropy
from dptrain.privacy_engine import make_private

__all__ = [
    "MODES",
    "BagClassifier",
    "OneRunAuditConfig",
    "blackbox_run",
    "load_one_run_config",
    "run_one_run_audit",
    "whitebox_run",
]

MODES = ("whitebox", "blackbox")


@dataclass
class OneRunAuditConfig:
    """``dptrain audit one-run`` settings (``key=value`` overrides)."""

    mode: str = "whitebox"
    """``whitebox`` (canary gradients, every noised sum observed) or ``blackbox`` (canary
    inputs in the training data, scored by their loss on the final model)."""
    epsilon: float = 8.0
    """Target epsilon of the run (sigma calibrated by ``accountant``)."""
    noise_multiplier: float = 0.0
    """sigma given directly instead of ``epsilon`` (0: calibrate to ``epsilon``)."""
    delta: float = 1e-5
    """delta of the run and of the lower bounds."""
    steps: int = 10
    """Training steps of the audited run."""
    width: int = 0
    """Input width d (0: 1000 white-box, where the classifier is d x d; 512 black-box)."""
    classes: int = 1024
    """Black-box: number of classes of the bag-of-tokens classifier."""
    tokens: int = 4
    """Black-box: tokens per example (a canary repeats one vector)."""
    canaries: int = 0
    """m; 0: one per weight (width^2) white-box, 10,000 black-box."""
    examples: int = 64
    """Non-canary training examples."""
    batch_size: str = "full"
    """``full`` (q = 1) or the expected batch size (Poisson sampling)."""
    canary_norm: float = 0.0
    """Canary gradient norm before clipping; 0: exactly C (= 1)."""
    confidence: float = 0.95
    """Confidence of the epsilon lower bounds."""
    accountant: str = "pld"
    """Accountant that calibrates sigma and reports epsilon: ``pld`` (tightest), ``rdp`` or ``gdp`` (approximate)."""
    seed: int = 0
    """Fixes the canaries, sampling and noise."""
    scores: str = ""
    """A CSV/JSONL file of your own canaries (columns score, included): no training."""
    claimed_epsilon: float = 0.0
    """With ``scores``: the epsilon your run claims (compared with the lower bounds)."""
    out: str = "runs/audit-one-run"
    """Output folder of the run."""


def load_one_run_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> OneRunAuditConfig:
    """Defaults, then the YAML ``path``, then ``key=value`` overrides; values checked."""
    cfg = load_config(OneRunAuditConfig, path, overrides)
    if cfg.mode not in MODES:
        raise ConfigError(f"mode={cfg.mode!r} is not allowed: expected one of {MODES}")
    if cfg.width == 0:
        cfg.width = 1000 if cfg.mode == "whitebox" else 512
    if cfg.canaries == 0 and cfg.mode == "blackbox":
        cfg.canaries = 10_000
    check_int("classes", cfg.classes, 2)
    check_int("tokens", cfg.tokens, 1)
    check_positive("epsilon", cfg.epsilon)
    check_in_interval("noise_multiplier", cfg.noise_multiplier, 0.0, math.inf, low_open=False)
    check_in_interval("delta", cfg.delta, 0.0, 1.0)
    check_int("steps", cfg.steps, 1)
    check_int("width", cfg.width, 2)
    check_int("canaries", cfg.canaries, 0)
    check_int("examples", cfg.examples, 1)
    check_in_interval("confidence", cfg.confidence, 0.0, 1.0)
    if cfg.batch_size != "full":
        try:
            size = int(cfg.batch_size)
        except ValueError:
            size = 0
        if not 1 <= size <= cfg.examples:
            raise ConfigError(
                f"batch_size={cfg.batch_size!r} is not allowed: expected 'full' or an expected "
                f"batch size in [1, examples={cfg.examples}]"
            )
    if cfg.mode == "whitebox" and cfg.canaries > cfg.width**2:
        raise ConfigError(
            f"canaries={cfg.canaries} is not allowed: the classifier has width^2 = "
            f"{cfg.width**2} coordinates, one per canary"
        )
    if cfg.scores and cfg.claimed_epsilon <= 0:
        raise ConfigError(
            "scores= needs claimed_epsilon= (> 0): the epsilon your run claims, to compare with"
        )
    return cfg


def whitebox_run(
    cfg: OneRunAuditConfig, progress: bool = True
) -> tuple[float | None, GradientCanaries]:
    """Train the reference setting with canaries: (epsilon the ledger claims, canaries)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    d = cfg.width or 1000
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = nn.Linear(d, d, bias=False)
    x = torch.randn(cfg.examples, d, generator=gen) / math.sqrt(d)
    y = torch.randint(0, d, (cfg.examples,), generator=gen)
    canaries = GradientCanaries(
        model.parameters(), cfg.canaries or d * d, norm=cfg.canary_norm or None, seed=cfg.seed + 1
    )
    claimed = _private_run(
        cfg,
        model,
        x,
        y,
        lr=0.1,
        desc="white-box run",
        progress=progress,
        before=lambda private: canaries.attach(private.optimizer),
    )
    return claimed, canaries


class BagClassifier(nn.Module):
    """Linear softmax classifier of a bag of token vectors: logits = sum_t W x_t.

    Zero-initialised: the final model is then the sum of the noised updates alone, so a
    canary's loss is not buried under the random initialisation's (a black-box auditor
    of a real model would score against reference models instead, as LiRA does).
    """

    def __init__(self, width: int, classes: int):
        super().__init__()
        self.proj = nn.Linear(width, classes, bias=False)
        nn.init.zeros_(self.proj.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, d) -> (B, classes)
        return self.proj(x).sum(1)


def blackbox_run(
    cfg: OneRunAuditConfig, progress: bool = True
) -> tuple[float | None, np.ndarray, np.ndarray]:
    """Train with canary inputs: (epsilon the ledger claims, scores, included).

    Canary j is ``tokens`` copies of a random vector of norm 2 with a random label
    (norm 2: each token's gradient alone exceeds C, so clipping per token instead of
    per example would let a canary in ``tokens`` times); each is in the training data
    with probability 1/2, beside ``examples`` records drawn the same way. Its score is
    minus its loss on the final model.
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    d, t, m = cfg.width or 512, cfg.tokens, cfg.canaries or 10_000

    def bags(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        v = torch.randn(n, d, generator=gen)
        v = 2.0 * v / v.norm(dim=1, keepdim=True)
        return v[:, None, :].expand(n, t, d).contiguous(), torch.randint(
            0, cfg.classes, (n,), generator=gen
        )

    x_real, y_real = bags(cfg.examples)
    x_can, y_can = bags(m)
    included = torch.rand(m, generator=gen, dtype=torch.float64) < 0.5
    x = torch.cat([x_real, x_can[included]])
    y = torch.cat([y_real, y_can[included]])
    model = BagClassifier(d, cfg.classes)
    claimed = _private_run(cfg, model, x, y, lr=0.5, desc="black-box run", progress=progress)
    with torch.no_grad():
        scores = -per_example_cross_entropy(model(x_can), y_can)
    return claimed, scores.double().numpy(), included.numpy()


def _private_run(
    cfg: OneRunAuditConfig,
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    lr: float,
    desc: str,
    progress: bool,
    before: Any = None,
) -> float | None:
    """DP-SGD on (x, y) as ``cfg`` says (``before(private)`` first); the epsilon claimed."""
    private = make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=lr),
        torch.utils.data.TensorDataset(x, y),
        batch_size=len(x) if cfg.batch_size == "full" else int(cfg.batch_size),
        max_grad_norm=1.0,
        steps=cfg.steps,
        target_epsilon=None if cfg.noise_multiplier else cfg.epsilon,
        noise_multiplier=cfg.noise_multiplier or None,
        target_delta=cfg.delta,
        accountant=cfg.accountant,
        seed=cfg.seed,
        max_physical_batch_size=2048,
    )
    if before is not None:
        before(private)
    try:
        bar = tqdm(private.data_loader, desc=desc, disable=not progress)
        for logical in bar:
            private.optimizer.zero_grad()
            for xb, yb in logical.chunks:
                private.backward(per_example_cross_entropy(model(xb), yb))
            private.optimizer.step()
            bar.set_postfix(step=private.optimizer.steps_taken)
    finally:
        private.engine.detach()
    # (a near-zero sigma's PLD would not fit in memory: no claim is computed for it)
    return private.epsilon() if cfg.noise_multiplier == 0 or cfg.noise_multiplier > 0.1 else None


def _read_scores(path: str) -> tuple[np.ndarray, np.ndarray]:
    import pandas as pd

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"scores={path!r}: no such file")
    if p.suffix == ".csv":
        table = pd.read_csv(p)
    elif p.suffix in (".jsonl", ".json"):
        table = pd.read_json(p, lines=p.suffix == ".jsonl")
    else:
        raise ConfigError(f"scores={path!r}: expected a .csv or .jsonl file")
    missing = {"score", "included"} - set(table.columns)
    if missing:
        raise ConfigError(
            f"scores={path!r} has columns {list(table.columns)}: expected 'score' and 'included'"
        )
    return table["score"].to_numpy(float), table["included"].to_numpy(bool)


def run_one_run_audit(cfg: OneRunAuditConfig, progress: bool = True) -> dict[str, Any]:
    """Train (white-box) or read the scores, audit with every method, save; the results."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    start = time.perf_counter()
    if cfg.scores:
        scores, included = _read_scores(cfg.scores)
        claimed, separation, setting = cfg.claimed_epsilon, None, f"scores from {cfg.scores}"
    elif cfg.mode == "blackbox":
        claimed, scores, included = blackbox_run(cfg, progress)
        separation = None
        setting = (
            f"black-box: bag-of-{cfg.tokens}-tokens linear classifier ({cfg.width} -> "
            f"{cfg.classes}), {cfg.examples} examples + canaries, {cfg.steps} steps, batch "
            f"{cfg.batch_size}, {len(scores)} canary inputs scored by loss"
        )
    else:
        claimed, canaries = whitebox_run(cfg, progress)
        scores, included = canaries.scores.numpy(), canaries.included.numpy()
        separation = canaries.separation()
        setting = (
            f"white-box: {cfg.width}x{cfg.width} linear classifier, {cfg.examples} examples, "
            f"{cfg.steps} steps, batch {cfg.batch_size}, {len(scores)} Dirac canaries"
        )
    train_s = time.perf_counter() - start
    audits: list[OneRunAudit] = []
    for method in METHODS:
        if method != "steinke2023" and cfg.batch_size != "full" and not cfg.scores:
            continue  # a Poisson-sampled run's trade-off curve is not Gaussian
        audits.append(one_run_audit(scores, included, cfg.delta, cfg.confidence, method=method))
    results = {
        "setting": setting,
        "claimed_epsilon": claimed,
        "delta": cfg.delta,
        "confidence": cfg.confidence,
        "separation": separation,
        "audits": [asdict(a) for a in audits],
        "flagged": claimed is not None and any(a.epsilon > claimed for a in audits),
        "seconds": {"train": train_s, "audit": time.perf_counter() - start - train_s},
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"Setting: {setting}; delta {cfg.delta:g}, confidence {cfg.confidence:g}.",
        "",
        "| method | epsilon lower bound | mu lower bound | guesses r | correct v |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for a in audits:
        mu = "" if a.mu is None else f"{a.mu:.3f}"
        lines.append(f"| {a.method} | {a.epsilon:.3f} | {mu} | {a.r} | {a.v} |")
    verdict = (
        "FLAGGED: a lower bound exceeds the claim, the mechanism is not as private as claimed"
        if results["flagged"]
        else "not flagged: every lower bound is at most the claim"
    )
    if claimed is None:
        verdict, claimed_text = "no claim (sigma near 0: a non-private run)", "none"
    else:
        claimed_text = f"{claimed:.3f}"
    lines += ["", f"Claimed epsilon {claimed_text}: {verdict}."]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    return results
