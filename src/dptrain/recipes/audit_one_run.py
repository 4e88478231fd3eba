"""Recipe: the one-run privacy audit (``dptrain audit one-run``).

Four uses, one report:

- **self-test** (default, ``mode=selftest``): the white-box run and the black-box run
  below, audited as one family (Bonferroni over every score, analysis and run).
- **white-box** (``mode=whitebox``): train the reference setting with dptrain's own
  ``make_private`` and ``m`` Dirac canary gradients
  (:class:`dptrain.audit.GradientCanaries`), scored three ways (their sum, a per-step
  and a per-tensor likelihood ratio) and turned into epsilon lower bounds
  (:func:`dptrain.audit.audit_scores`), beside the epsilon the ledger claims. The
  setting makes the claim exactly Gaussian, so both analyses apply: full-batch DP-GD
  (``batch_size=full``, q = 1, every step observed) of a ``width`` x ``width`` linear
  softmax classifier held in ``tensors`` weight tensors, on ``examples`` random
  examples, ``steps`` steps, clipping norm ``max_grad_norm`` (4: not 1, so that a
  noise std computed without C shows), canaries of norm ``canary_norm`` x C (10:
  above C, so that clipping that is off or too loose shows), one canary per weight
  unless ``canaries`` says fewer. ``batch_size=N`` (an integer) audits
  Poisson-sampled steps instead (then only Steinke et al.'s analysis is valid).
- **black-box** (``mode=blackbox``): canary *inputs* (bags of ``tokens`` copies of a
  random vector, random labels) as records of the data set of a zero-initialised
  bag-of-tokens linear classifier, drawn by the real sampler, clipped by the real
  engine, noised by the real optimizer, and scored by their loss on the final model.
- **your own canaries**: ``scores=FILE`` (CSV or JSONL with columns ``score`` and
  ``included``, one row per canary, from any pipeline) skips the training and
  audits those scores against ``claimed_epsilon``.

A lower bound above the claim proves that the mechanism does not do what the
accountant assumes. ``status`` is ``"flagged"``, ``"not flagged"`` or ``"no claim"``
(sigma <= 0.1: no epsilon is computed, nothing is tested); the command exits 1, 0
and 2 for them.

1. setup: the config (:class:`OneRunAuditConfig`), checked; 2. train, with a
progress bar; 3. audit: every score and analysis at ``confidence`` as one family;
4. save: ``results.json``, ``table.md``, ``config.yaml`` in ``out``.
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
from dptrain.audit.one_run import METHODS, one_run_audit, steinke_ceiling
from dptrain.config import ConfigError, load_config, save_config
from dptrain.losses import per_example_cross_entropy
from dptrain.privacy_engine import make_private

__all__ = [
    "MODES",
    "NO_CLAIM_SIGMA",
    "BagClassifier",
    "OneRunAuditConfig",
    "SplitLinear",
    "blackbox_run",
    "load_one_run_config",
    "run_one_run_audit",
    "whitebox_run",
]

MODES = ("selftest", "whitebox", "blackbox")
#: At or below this noise multiplier no epsilon is computed (its PLD would not fit in
#: memory): the run makes no claim, and the audit has nothing to test.
NO_CLAIM_SIGMA = 0.1


@dataclass
class OneRunAuditConfig:
    """``dptrain audit one-run`` settings (``key=value`` overrides)."""

    mode: str = "selftest"
    """``selftest`` (both runs below, one family of tests), ``whitebox`` (canary
    gradients, every noised sum observed) or ``blackbox`` (canary inputs in the training
    data, scored by their loss on the final model)."""
    epsilon: float = 8.0
    """Target epsilon of the run (sigma calibrated by ``accountant``)."""
    noise_multiplier: float = 0.0
    """sigma given directly instead of ``epsilon`` (0: calibrate to ``epsilon``)."""
    delta: float = 1e-5
    """delta of the run and of the lower bounds."""
    steps: int = 10
    """Training steps of the audited run."""
    width: int = 0
    """Input width d (0: 1000 white-box, where the classifier is d x d; 512 black-box; the
    self-test's two runs take it both, or their own defaults)."""
    tensors: int = 4
    """White-box: the d x d classifier's weights in this many tensors (rows split)."""
    max_grad_norm: float = 4.0
    """C. Not 1 by default: a noise std computed without C would be invisible at C = 1."""
    classes: int = 1024
    """Black-box: number of classes of the bag-of-tokens classifier."""
    tokens: int = 4
    """Black-box: tokens per example (a canary repeats one vector)."""
    canaries: int = 0
    """m; 0: one per weight (width^2) white-box, 20,000 black-box (both runs of the
    self-test take a value given)."""
    examples: int = 64
    """Non-canary training examples."""
    batch_size: str = "full"
    """``full`` (q = 1) or the expected batch size (Poisson sampling)."""
    canary_norm: float = 10.0
    """White-box canary gradient norm before clipping, in units of C (above 1: clipping
    must cut it; at 1 clipping switched off would not show)."""
    confidence: float = 0.95
    """Confidence of the epsilon lower bounds, for all of them together (Bonferroni)."""
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
    if cfg.width == 0 and cfg.mode != "selftest":
        cfg.width = 1000 if cfg.mode == "whitebox" else 512
    if cfg.canaries == 0 and cfg.mode == "blackbox":
        cfg.canaries = 20_000
    check_int("classes", cfg.classes, 2)
    check_int("tokens", cfg.tokens, 1)
    check_positive("epsilon", cfg.epsilon)
    check_in_interval("noise_multiplier", cfg.noise_multiplier, 0.0, math.inf, low_open=False)
    check_in_interval("delta", cfg.delta, 0.0, 1.0)
    check_int("steps", cfg.steps, 1)
    if cfg.mode != "selftest" or cfg.width != 0:
        check_int("width", cfg.width, 2)
    check_int("tensors", cfg.tensors, 1)
    check_positive("max_grad_norm", cfg.max_grad_norm)
    check_positive("canary_norm", cfg.canary_norm)
    check_int("canaries", cfg.canaries, 0)
    check_int("examples", cfg.examples, 1)
    check_in_interval("confidence", cfg.confidence, 0.0, 1.0)
    if cfg.batch_size != "full":
        try:
            size = int(cfg.batch_size)
        except ValueError:
            size = 0
        # the black-box data set is the examples and the included canaries (about half)
        most = cfg.examples if cfg.mode != "blackbox" else cfg.examples + cfg.canaries // 3
        if not 1 <= size <= most:
            raise ConfigError(
                f"batch_size={cfg.batch_size!r} is not allowed: expected 'full' or an expected "
                f"batch size in [1, {most}] (examples={cfg.examples}"
                + (f" and a third of canaries={cfg.canaries})" if cfg.mode == "blackbox" else ")")
            )
    whitebox = cfg.mode != "blackbox"
    if whitebox and cfg.tensors > (cfg.width or 1000):
        raise ConfigError(
            f"tensors={cfg.tensors} is not allowed: the classifier has width={cfg.width or 1000} rows "
            "to split among them"
        )
    if whitebox and cfg.canaries > (cfg.width or 1000) ** 2:
        raise ConfigError(
            f"canaries={cfg.canaries} is not allowed: the white-box classifier has width^2 = "
            f"{(cfg.width or 1000) ** 2} coordinates, one per canary"
        )
    if cfg.scores and cfg.claimed_epsilon <= 0:
        raise ConfigError(
            "scores= needs claimed_epsilon= (> 0): the epsilon your run claims, to compare with"
        )
    return cfg


class SplitLinear(nn.Module):
    """``x -> W x`` (no bias) with W's rows held in ``tensors`` parameters of near-equal
    size: one function, several tensors, so that noise missing from some of them can
    show in a per-tensor score."""

    def __init__(self, width: int, out: int, tensors: int):
        super().__init__()
        sizes = [out // tensors + (i < out % tensors) for i in range(tensors)]
        self.parts = nn.ModuleList(nn.Linear(width, n, bias=False) for n in sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def whitebox_run(
    cfg: OneRunAuditConfig, progress: bool = True
) -> tuple[float | None, GradientCanaries]:
    """Train the reference setting with canaries: (epsilon the ledger claims, canaries)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    d = cfg.width or 1000
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = SplitLinear(d, d, cfg.tensors)
    x = torch.randn(cfg.examples, d, generator=gen) / math.sqrt(d)
    y = torch.randint(0, d, (cfg.examples,), generator=gen)
    canaries = GradientCanaries(
        model.parameters(),
        cfg.canaries or d * d,
        norm=cfg.canary_norm * cfg.max_grad_norm,
        seed=cfg.seed + 1,
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
        logits = self.proj(x)
        # x1: the same sum, but its backward hands the engine a materialised (B, T, classes)
        # gradient; .sum(1) alone gives a stride-0 expanded one, on which the engine's
        # ghost-norm bmm runs about 50x slower on CPU (1.35 s against 0.02 s per chunk)
        return (logits * logits.new_ones(1, logits.shape[1], 1)).sum(1)


def blackbox_run(
    cfg: OneRunAuditConfig, progress: bool = True
) -> tuple[float | None, np.ndarray, np.ndarray]:
    """Train with canary inputs: (epsilon the ledger claims, scores, included).

    Canary j is ``tokens`` copies of a random vector of norm 2 C with a random label
    (norm 2 C: each token's gradient alone exceeds C, so clipping per token instead of
    per example would let a canary in ``tokens`` times, and clipping that is off or
    loose lets in up to 2 C ``tokens``); each is a record of the data set with
    probability 1/2, beside ``examples`` records drawn the same way, and goes through
    the sampler, the engine and the optimizer as they do. Its score is minus its loss
    on the final model. The learning rate is 0.5 / C^2, which makes the run the same
    for every C (inputs, clipped sums and noise all scale with C).
    """
    gen = torch.Generator().manual_seed(cfg.seed)
    d, t, m = cfg.width or 512, cfg.tokens, cfg.canaries or 20_000
    c = cfg.max_grad_norm

    def bags(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        v = torch.randn(n, d, generator=gen)
        v = 2.0 * c * v / v.norm(dim=1, keepdim=True)
        return v[:, None, :].expand(n, t, d).contiguous(), torch.randint(
            0, cfg.classes, (n,), generator=gen
        )

    x_real, y_real = bags(cfg.examples)
    x_can, y_can = bags(m)
    included = torch.rand(m, generator=gen, dtype=torch.float64) < 0.5
    x = torch.cat([x_real, x_can[included]])
    y = torch.cat([y_real, y_can[included]])
    model = BagClassifier(d, cfg.classes)
    claimed = _private_run(cfg, model, x, y, lr=0.5 / c**2, desc="black-box run", progress=progress)
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
        max_grad_norm=cfg.max_grad_norm,
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
    no_claim = 0 < cfg.noise_multiplier <= NO_CLAIM_SIGMA
    return None if no_claim else private.epsilon()


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


def _whitebox_part(cfg: OneRunAuditConfig, progress: bool) -> dict[str, Any]:
    claimed, canaries = whitebox_run(cfg, progress)
    d = cfg.width or 1000
    return {
        "run": "white-box",
        "setting": (
            f"white-box: {d}x{d} linear classifier in {cfg.tensors} tensors, {cfg.examples} "
            f"examples, {cfg.steps} steps, batch {cfg.batch_size}, C = {cfg.max_grad_norm:g}, "
            f"{canaries.m} Dirac canaries of norm {cfg.canary_norm:g} C"
        ),
        "claimed_epsilon": claimed,
        "scores": {name: t.numpy() for name, t in canaries.score_by_name.items()},
        "included": canaries.included.numpy(),
        "methods": canaries.methods(),
        "separation": canaries.separation(),
    }


def _blackbox_part(cfg: OneRunAuditConfig, progress: bool) -> dict[str, Any]:
    claimed, scores, included = blackbox_run(cfg, progress)
    d = cfg.width or 512
    return {
        "run": "black-box",
        "setting": (
            f"black-box: bag-of-{cfg.tokens}-tokens linear classifier ({d} -> {cfg.classes}), "
            f"{cfg.examples} examples + canaries, {cfg.steps} steps, batch {cfg.batch_size}, "
            f"C = {cfg.max_grad_norm:g}, {len(scores)} canary inputs scored by loss"
        ),
        "claimed_epsilon": claimed,
        "scores": {"loss": scores},
        "included": included,
        "methods": METHODS if cfg.batch_size == "full" else ("steinke2023",),
        "separation": None,
    }


def run_one_run_audit(cfg: OneRunAuditConfig, progress: bool = True) -> dict[str, Any]:
    """Train (self-test, white-box, black-box) or read the scores; audit every score under
    every valid analysis as one family of tests; save; the results."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    start = time.perf_counter()
    parts: list[dict[str, Any]] = []
    if cfg.scores:
        scores, included = _read_scores(cfg.scores)
        parts.append(
            {
                "run": "your scores",
                "setting": f"scores from {cfg.scores}",
                "claimed_epsilon": cfg.claimed_epsilon,
                "scores": {"score": scores},
                "included": included,
                "methods": METHODS,
                "separation": None,
            }
        )
    else:
        if cfg.mode in ("selftest", "whitebox"):
            parts.append(_whitebox_part(cfg, progress))
        if cfg.mode in ("selftest", "blackbox"):
            parts.append(_blackbox_part(cfg, progress))
    train_s = time.perf_counter() - start
    # one family: "flagged" is "any bound above its claim", so every test pays for the others
    tests = sum(len(p["scores"]) * len(p["methods"]) for p in parts)
    audits: list[dict[str, Any]] = []
    flagged = False
    for p in parts:
        for name, s in p["scores"].items():
            for method in p["methods"]:
                a = one_run_audit(
                    s,
                    p["included"],
                    cfg.delta,
                    cfg.confidence,
                    method=method,
                    tests=tests,
                    score=name,
                )
                claim = p["claimed_epsilon"]
                over = claim is not None and a.epsilon > claim
                flagged |= over
                audits.append(
                    {"run": p["run"], "claimed_epsilon": claim, "flagged": over, **asdict(a)}
                )
    no_claim = [p["run"] for p in parts if p["claimed_epsilon"] is None]
    status = "no claim" if no_claim else ("flagged" if flagged else "not flagged")
    ceilings = {
        p["run"]: steinke_ceiling(len(p["included"]), cfg.delta, cfg.confidence, tests)
        for p in parts
        if p["methods"] == ("steinke2023",) and p["claimed_epsilon"] is not None
    }
    results = {
        "setting": "; ".join(p["setting"] for p in parts),
        "claimed_epsilon": parts[0]["claimed_epsilon"],
        "claims": {p["run"]: p["claimed_epsilon"] for p in parts},
        "delta": cfg.delta,
        "confidence": cfg.confidence,
        "correction": (
            f"Bonferroni over {tests} tests (every score x analysis x run): each at level "
            f"{(1 - cfg.confidence) / tests:.3g}, so that a correct mechanism is flagged with "
            f"probability at most {1 - cfg.confidence:.3g}"
        ),
        "separation": parts[0]["separation"],
        "audits": audits,
        "flagged": flagged and not no_claim,
        "status": status,
        "ceilings": ceilings,
        "seconds": {"train": train_s, "audit": time.perf_counter() - start - train_s},
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(_table(results, no_claim))
    return results


def _table(results: dict[str, Any], no_claim: list[str]) -> str:
    lines = [
        f"Setting: {results['setting']}; delta {results['delta']:g}, confidence "
        f"{results['confidence']:g} for all tests together ({results['correction']}).",
        "",
        "| run | score | method | claimed epsilon | epsilon lower bound | mu lower bound "
        "| guesses r | correct v | flagged |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for a in results["audits"]:
        mu = "" if a["mu"] is None else f"{a['mu']:.3f}"
        claim = "none" if a["claimed_epsilon"] is None else f"{a['claimed_epsilon']:.3f}"
        lines.append(
            f"| {a['run']} | {a['score']} | {a['method']} | {claim} | {a['epsilon']:.3f} | {mu} "
            f"| {a['r']} | {a['v']} | {'**yes**' if a['flagged'] else 'no'} |"
        )
    lines.append("")
    if no_claim:
        lines.append(
            f"NO CLAIM ({', '.join(no_claim)}): noise_multiplier <= {NO_CLAIM_SIGMA} computes "
            "no epsilon, so there is nothing to test the bounds against (exit code 2)."
        )
    elif results["flagged"]:
        lines.append(
            "FLAGGED: a lower bound exceeds the claim, the mechanism is not as private as "
            "claimed (exit code 1)."
        )
    else:
        lines.append("Not flagged: every lower bound is at most its claim (exit code 0).")
    for run, ceiling in results["ceilings"].items():
        claim = results["claims"][run]
        if claim > ceiling:
            lines.append(
                f"Reach ({run}): Steinke et al.'s bound cannot exceed {ceiling:.2f} here, below "
                f"the claim {claim:.2f}: this run could not have been flagged whatever it leaks "
                "(use full batches, fewer steps or a smaller claim to audit it)."
            )
    return "\n".join(lines) + "\n"
