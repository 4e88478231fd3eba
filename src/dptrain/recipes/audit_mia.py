"""Recipe: membership inference with shadow models (``dptrain audit mia``).

LiRA (Carlini et al., S&P 2022; :mod:`dptrain.audit.lira`) where shadow models
are cheap: the private linear probe on a frozen pretrained encoder
(``dptrain train classify method=dpsgd-head``). Against the guarantee it
measures what an attacker who sees the trained probe's outputs learns about
membership, at each epsilon and without DP.

1. **setup** (checks first, nothing trained before they pass): the frozen
   encoder's pooled features of a *pool* of ``pool`` training texts (a seeded
   subset of the training split) and of the test split, computed once by
   :func:`dptrain.recipes.classify.frozen_encoder_features` (the packaged
   all-MiniLM-L6-v2 on Rotten Tomatoes by default) and cached in
   ``out/features``; or ``data=synthetic``, random Gaussian features with a
   noisy linear label (tests, and a run without the encoder). The design:
   ``shadows`` (M, even) models, each example IN for exactly M/2 of them, the
   half drawn at random per example (the paper's design: every example has IN
   and OUT models, each model trains on about half the pool).
2. **train**: for each guarantee in ``epsilons`` (``null`` = non-private), the
   M probes (``nn.Linear(hidden, classes)``, Adam), each on its half: private
   ones through :func:`dptrain.privacy_engine.make_private` (Poisson sampling,
   clipping at ``max_norm``, noise calibrated by PLD to (epsilon, delta) with
   delta from the expected half size N = pool / 2), the non-private one with
   shuffled minibatches of the same size, the same epochs and learning rate, no
   clipping and no noise. Each model's logit-scaled confidence of the true label
   on every pool example (:func:`dptrain.audit.logit_confidence`) and its loss
   are kept; a progress bar counts the models.
3. **attack**: every model in turn is the target, the other M - 1 its shadows
   (:func:`dptrain.audit.lira_leave_one_out`): online LiRA with a global and
   with per-example variances, offline LiRA, and the loss threshold (Yeom et
   al.: no shadows); the M x n (score, membership) pairs of each attack make one
   ROC curve: TPR at ``fprs`` (0.1%, 1%), AUC, balanced accuracy, beside what
   (epsilon, delta)-DP allows (:func:`dptrain.audit.dp_tpr_bound`).
4. **save** in ``out``: ``results.json`` (the ``mia`` section), ``table.md``,
   ``roc.png`` (log-log, one curve per epsilon, the diagonal and the DP bounds),
   ``scores.npz`` (the statistics and the design, to try other attacks) and
   ``config.yaml``. ``flagged`` (and exit code 1 from the command) when an
   attack's operating point lies above the DP bound beyond sampling error (95%
   Clopper-Pearson intervals; see :func:`_above_bound` for what they assume).

A linear probe on good features generalizes well and leaks little on average,
so the defaults let the non-private one overfit: a small pool (500 texts, 250
per model), 100 epochs of Adam at lr 0.01, no weight decay (train accuracy
about 1.0, test about 0.68). The same settings train the private probes. With
a pool of 1,000 the non-private leak halves at 0.1% FPR. The measured numbers
are in ``docs/audit.md``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from scipy import stats
from torch import Tensor, nn
from tqdm.auto import tqdm

from dptrain._checks import check_in_interval, check_int, check_positive
from dptrain.audit.lira import (
    attack_metrics,
    dp_tpr_bound,
    lira_leave_one_out,
    logit_confidence,
    loss_scores,
    plot_roc,
    roc_curve,
)
from dptrain.config import ConfigError, load_config, save_config
from dptrain.losses import per_example_cross_entropy
from dptrain.privacy_engine import make_private
from dptrain.recipes._common import DELTA_RULES, check_choice, check_epsilons, resolve_delta

__all__ = [
    "ATTACKS",
    "MIAAuditConfig",
    "load_mia_config",
    "run_mia_audit",
]

#: The attacks every run scores, by the name results.json and table.md use.
ATTACKS: tuple[str, ...] = (
    "lira-online-global",
    "lira-online",
    "lira-offline",
    "loss-threshold",
)
_ATTACK_LABELS = {
    "lira-online-global": "LiRA online, global variance",
    "lira-online": "LiRA online, per-example variance",
    "lira-offline": "LiRA offline, global variance",
    "loss-threshold": "loss threshold (no shadows)",
}
_VARIANCES = ("auto", "global", "per-example")
# Carlini et al. fit per-example variances from about 64 shadow models up, one global
# variance below (their "fixed variance" ablation); "auto" follows them for the plot.
_PER_EXAMPLE_FROM = 64


@dataclass
class MIAAuditConfig:
    """``dptrain audit mia`` settings (``key=value`` overrides)."""

    data: str = "rotten-tomatoes"
    """``rotten-tomatoes``, ``womens-clothing``, a CSV/TSV/JSONL/Parquet path (text, label)
    or ``synthetic`` (random features, no encoder)."""
    text_col: str = "text"
    """Column of the texts in a data file."""
    label_col: str = "label"
    """Column of the labels in a data file."""
    encoder: str = "minilm"
    """``minilm`` (the packaged all-MiniLM-L6-v2) or a local Hugging Face model folder."""
    pooling: str = "mean"
    """How the encoder's token states become one feature vector: ``mean``, ``cls`` or ``pooler``."""
    max_length: int = 128
    """Most tokens per text fed to the encoder."""
    pool: int = 500
    """Examples the attack targets: a seeded subset of the training split; each model
    trains on about half of it (250 texts by default: small, so that the non-private
    probe overfits and the attack has something to find)."""
    shadows: int = 16
    """M models per epsilon (even, >= 6: every example has >= 2 IN and 2 OUT shadows
    when one of them is the target)."""
    epsilons: list[float | None] = dataclasses.field(default_factory=lambda: [1.0, 8.0, None])
    """Guarantees to attack: a target epsilon, or null for the non-private probe."""
    delta: float | str = "1/N^1.1"
    """delta of every private probe; a rule of N = pool / 2 or a number."""
    epochs: int = 100
    """Passes over its training half for every probe."""
    batch_size: int = 64
    """Expected batch size (Poisson for the private probes, exact for the non-private one)."""
    max_norm: float = 1.0
    """C, the clipping norm of the private probes' per-example gradients."""
    lr: float = 0.01
    """Adam's learning rate, every probe."""
    weight_decay: float = 0.0
    """Adam's weight decay, every probe."""
    variance: str = "auto"
    """The online LiRA curve of roc.png: ``global``, ``per-example`` or ``auto`` (global
    below 64 shadows, as the paper advises); results.json has both."""
    fprs: list[float] = dataclasses.field(default_factory=lambda: [0.001, 0.01])
    """False-positive rates at which the TPR is reported."""
    synthetic_dim: int = 32
    """Feature dimension of ``data=synthetic``."""
    split_seed: int = 0
    """Fixes the train/dev/test split and the pool."""
    seed: int = 0
    """Fixes the design (who is IN where), the probes' initialization, sampling and noise."""
    num_threads: int = 0
    """torch threads; 0 leaves torch's default."""
    out: str = "runs/audit-mia"
    """Output folder of the run."""
    progress: bool = True
    """Show a progress bar on stderr."""

    def __post_init__(self) -> None:
        check_int("pool", self.pool, 4)
        check_int("shadows", self.shadows, 6)
        if self.shadows % 2:
            raise ValueError(
                f"shadows={self.shadows} is not allowed: expected an even number, so that "
                "every example is IN for exactly half of the models"
            )
        check_epsilons(self.epsilons)
        if isinstance(self.delta, str):
            check_choice("delta", self.delta, DELTA_RULES)
        else:
            check_in_interval("delta", self.delta, 0.0, 1.0)
        check_int("epochs", self.epochs, 1)
        check_int("batch_size", self.batch_size, 1)
        if self.batch_size > self.pool // 2:
            raise ValueError(
                f"batch_size={self.batch_size} is not allowed with pool={self.pool}: expected "
                f"at most pool / 2 = {self.pool // 2}, the size of a model's training half"
            )
        check_positive("max_norm", self.max_norm)
        check_positive("lr", self.lr)
        check_in_interval("weight_decay", self.weight_decay, 0.0, math.inf, low_open=False)
        check_choice("variance", self.variance, _VARIANCES)
        if not self.fprs:
            raise ValueError("fprs=[] is not allowed: expected false-positive rates in (0, 1)")
        for f in self.fprs:
            check_in_interval("fprs", f, 0.0, 1.0)
        check_int("max_length", self.max_length, 2)
        check_int("synthetic_dim", self.synthetic_dim, 1)
        check_int("split_seed", self.split_seed, 0)
        check_int("seed", self.seed, 0)
        check_int("num_threads", self.num_threads, 0)

    @property
    def headline_attack(self) -> str:
        """The online LiRA variant drawn in roc.png."""
        variance = self.variance
        if variance == "auto":
            variance = "global" if self.shadows < _PER_EXAMPLE_FROM else "per-example"
        return "lira-online-global" if variance == "global" else "lira-online"


def load_mia_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> MIAAuditConfig:
    """Defaults, then the YAML ``path``, then ``key=value`` overrides; values checked."""
    return load_config(MIAAuditConfig, path, overrides)


# -- setup: the features -------------------------------------------------------------------------


@dataclass
class _Features:
    pool_x: Tensor  # (n, k) float32
    pool_y: Tensor  # (n,) int64
    test_x: Tensor
    test_y: Tensor
    n_classes: int
    description: str


def _synthetic_features(cfg: MIAAuditConfig) -> _Features:
    """Gaussian features and a noisy linear label: a probe can fit them but not perfectly."""
    gen = torch.Generator().manual_seed(cfg.split_seed)
    d = cfg.synthetic_dim
    w = torch.randn(d, generator=gen)

    def draw(n: int) -> tuple[Tensor, Tensor]:
        x = torch.randn(n, d, generator=gen)
        logit = x @ w / math.sqrt(d) * 2.0 + torch.randn(n, generator=gen)
        return x, (logit > 0).long()

    pool_x, pool_y = draw(cfg.pool)
    test_x, test_y = draw(max(cfg.pool, 200))
    return _Features(
        pool_x, pool_y, test_x, test_y, 2, f"synthetic: {d}-dimensional Gaussian features"
    )


def _features(cfg: MIAAuditConfig) -> _Features:
    if cfg.data == "synthetic":
        return _synthetic_features(cfg)
    from dptrain.recipes.classify import ClassifyTrainConfig, frozen_encoder_features

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # The method only decides how a head is trained; the features are the same for all.
    classify_cfg = ClassifyTrainConfig(
        data=cfg.data,
        text_col=cfg.text_col,
        label_col=cfg.label_col,
        train_size=cfg.pool,
        split_seed=cfg.split_seed,
        encoder=cfg.encoder,
        pooling=cfg.pooling,
        max_length=cfg.max_length,
        method="nonprivate",
        feature_cache=str(Path(cfg.out) / "features"),
        progress=False,
    )
    try:
        data, feats = frozen_encoder_features(classify_cfg)
    except FileNotFoundError as err:  # a packaged encoder or corpus that is not installed
        raise ConfigError(f"data={cfg.data!r}, encoder={cfg.encoder!r}: {err}") from None
    return _Features(
        feats["train"].float(),
        data.train_labels.long(),
        feats["test"].float(),
        data.split("test")[1].long(),
        data.n_classes,
        f"{data.name}: {cfg.pool} training texts, {cfg.encoder} {cfg.pooling}-pooled features "
        f"({feats['train'].shape[1]} dimensions), frozen",
    )


def _design(cfg: MIAAuditConfig, n: int) -> np.ndarray:
    """(M, n) bool: each example IN for exactly M / 2 models, a random half per example."""
    rng = np.random.default_rng(cfg.seed)
    ranks = rng.random((cfg.shadows, n)).argsort(axis=0).argsort(axis=0)
    return ranks < cfg.shadows // 2


# -- train ---------------------------------------------------------------------------------------


@dataclass
class _Trained:
    phi: np.ndarray  # (M, n) logit-scaled confidence of the true label
    neg_loss: np.ndarray  # (M, n) minus the loss
    test_accuracy: list[float]
    train_accuracy: list[float]
    noise_multipliers: list[float]
    steps: list[int]
    seconds: float


def _train_probe(
    cfg: MIAAuditConfig,
    x: Tensor,
    y: Tensor,
    n_classes: int,
    epsilon: float | None,
    delta: float,
    seed: int,
) -> tuple[nn.Module, float, int]:
    """One probe on (x, y): (model, noise multiplier (0 without DP), steps)."""
    torch.manual_seed(seed)
    model = nn.Linear(x.shape[1], n_classes)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    data = torch.utils.data.TensorDataset(x, y)
    if epsilon is None:
        loader = torch.utils.data.DataLoader(
            data,
            batch_size=cfg.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(seed),
        )
        steps = 0
        for _ in range(cfg.epochs):
            for xb, yb in loader:
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(model(xb), yb).backward()
                optimizer.step()
                steps += 1
        return model, 0.0, steps
    private = make_private(
        model,
        optimizer,
        data,
        batch_size=cfg.batch_size,
        max_grad_norm=cfg.max_norm,
        epochs=cfg.epochs,
        target_epsilon=epsilon,
        target_delta=delta,
        accountant="pld",
        seed=seed,
    )
    for batch in private.data_loader:
        private.optimizer.zero_grad(set_to_none=True)
        for xb, yb in batch.chunks:
            private.backward(per_example_cross_entropy(model(xb), yb))
        private.optimizer.step()
    return model, private.noise_multiplier, private.steps


def _train_all(
    cfg: MIAAuditConfig,
    feats: _Features,
    keep: np.ndarray,
    epsilon: float | None,
    delta: float,
    bar: Any,
) -> _Trained:
    start = time.perf_counter()
    m_count, n = keep.shape
    phi = np.empty((m_count, n))
    neg_loss = np.empty((m_count, n))
    test_acc, train_acc, sigmas, steps = [], [], [], []
    label = "none" if epsilon is None else f"{epsilon:g}"
    for m in range(m_count):
        rows = torch.from_numpy(np.flatnonzero(keep[m]))
        # the same seed for model m at every epsilon: the guarantees differ, not the draws
        model, sigma, n_steps = _train_probe(
            cfg,
            feats.pool_x[rows],
            feats.pool_y[rows],
            feats.n_classes,
            epsilon,
            delta,
            cfg.seed * 100_003 + m,
        )
        with torch.no_grad():
            logits = model(feats.pool_x).double()
            test_pred = model(feats.test_x).argmax(1)
        phi[m] = logit_confidence(logits, feats.pool_y)
        neg_loss[m] = loss_scores(logits, feats.pool_y)
        test_acc.append(float((test_pred == feats.test_y).float().mean()))
        train_acc.append(float((logits[rows].argmax(1) == feats.pool_y[rows]).float().mean()))
        sigmas.append(sigma)
        steps.append(n_steps)
        bar.update(1)
        bar.set_postfix(epsilon=label, test_acc=f"{np.mean(test_acc):.3f}")
    return _Trained(phi, neg_loss, test_acc, train_acc, sigmas, steps, time.perf_counter() - start)


# -- attack --------------------------------------------------------------------------------------


def _attack_scores(trained: _Trained, keep: np.ndarray) -> dict[str, np.ndarray]:
    """(M, n) scores of every attack; every model the target once (leave-one-out)."""
    online_global, _ = lira_leave_one_out(trained.phi, keep, global_variance=True)
    online, _ = lira_leave_one_out(trained.phi, keep)
    offline, _ = lira_leave_one_out(trained.phi, keep, attack="offline", global_variance=True)
    return {
        "lira-online-global": online_global,
        "lira-online": online,
        "lira-offline": offline,
        "loss-threshold": trained.neg_loss,
    }


def _above_bound(
    scores: np.ndarray, keep: np.ndarray, fpr_target: float, epsilon: float, delta: float
) -> dict[str, float] | None:
    """The operating point at ``fpr_target`` when it lies above the DP bound beyond doubt.

    A point estimate above :func:`dp_tpr_bound` may be luck (a few members among
    a few hundred non-members), so the check is two-sided Clopper-Pearson at 95%:
    the lower end of the TPR against the bound at the upper end of the FPR. The
    intervals treat the (model, example) pairs as independent, which they are
    not quite (the same models and examples recur), so read it as a strong hint,
    not as a proof; the one-run audit is the statistically valid lower bound.
    """
    fpr, tpr, _ = roc_curve(scores, keep)
    n_pos, n_neg = int(keep.sum()), int((~keep).sum())
    best = int(np.flatnonzero(fpr <= fpr_target)[np.argmax(tpr[fpr <= fpr_target])])
    tp, fp = round(tpr[best] * n_pos), round(fpr[best] * n_neg)
    tpr_low = float(stats.beta.ppf(0.025, tp, n_pos - tp + 1)) if tp > 0 else 0.0
    fpr_high = float(stats.beta.ppf(0.975, fp + 1, n_neg - fp)) if fp < n_neg else 1.0
    if tpr_low <= float(dp_tpr_bound(fpr_high, epsilon, delta)):
        return None
    return {"fpr": fpr_target, "tpr": float(tpr[best]), "tpr_low": tpr_low, "fpr_high": fpr_high}


def _row(
    cfg: MIAAuditConfig,
    epsilon: float | None,
    delta: float,
    trained: _Trained,
    scores: dict[str, np.ndarray],
    keep: np.ndarray,
) -> dict[str, Any]:
    metrics = {name: attack_metrics(scores[name], keep, cfg.fprs) for name in ATTACKS}
    bound, above = None, []
    if epsilon is not None:
        bound = {f"{f:g}": float(dp_tpr_bound(f, epsilon, delta)) for f in cfg.fprs}
        for name in ATTACKS:
            for f in cfg.fprs:
                point = _above_bound(scores[name], keep, f, epsilon, delta)
                if point is not None:
                    above.append({"attack": name, **point})
    return {
        "epsilon": epsilon,
        "delta": None if epsilon is None else delta,
        "noise_multiplier": float(np.mean(trained.noise_multipliers)),
        "steps": float(np.mean(trained.steps)),
        "test_accuracy": float(np.mean(trained.test_accuracy)),
        "train_accuracy": float(np.mean(trained.train_accuracy)),
        "dp_tpr_bound": bound,
        "above_dp_bound": above,
        "attacks": {name: m.to_dict() for name, m in metrics.items()},
        "train_seconds": trained.seconds,
    }


# -- save ----------------------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.2f}%"


def _table(cfg: MIAAuditConfig, mia: dict[str, Any]) -> str:
    fpr_keys = [f"{f:g}" for f in cfg.fprs]
    head = (
        "| epsilon | attack | "
        + " | ".join(f"TPR @ {_pct(f)} FPR" for f in cfg.fprs)
        + " | AUC | balanced acc. | "
        + " | ".join(f"DP bound @ {_pct(f)}" for f in cfg.fprs)
        + " |"
    )
    lines = [
        f"Setting: {mia['setting']}.",
        "",
        head,
        "| ---: | --- | " + " | ".join("---:" for _ in range(2 * len(cfg.fprs) + 2)) + " |",
    ]
    for row in mia["rows"]:
        eps = "none" if row["epsilon"] is None else f"{row['epsilon']:g}"
        bound = row["dp_tpr_bound"]
        bounds = " | ".join("-" if bound is None else _pct(bound[k]) for k in fpr_keys)
        for name, m in row["attacks"].items():
            tprs = " | ".join(_pct(m["tpr_at_fpr"][k]) for k in fpr_keys)
            lines.append(
                f"| {eps} | {_ATTACK_LABELS[name]} | {tprs} | {m['auc']:.3f} | "
                f"{m['balanced_accuracy']:.3f} | {bounds} |"
            )
    lines.append("")
    lines.append(
        "| epsilon | noise multiplier | steps | probe train accuracy | probe test accuracy | "
        "train s |"
    )
    lines.append("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in mia["rows"]:
        eps = "none" if row["epsilon"] is None else f"{row['epsilon']:g}"
        sigma = "-" if row["epsilon"] is None else f"{row['noise_multiplier']:.3f}"
        lines.append(
            f"| {eps} | {sigma} | {row['steps']:.0f} | {row['train_accuracy']:.3f} | "
            f"{row['test_accuracy']:.3f} | {row['train_seconds']:.1f} |"
        )
    above = [(r["epsilon"], a) for r in mia["rows"] for a in r["above_dp_bound"]]
    lines.append("")
    if above:
        lines.append(
            "ABOVE THE DP BOUND (TPR's 95% lower end above the bound at the FPR's upper "
            "end; pairs treated as independent): "
            + "; ".join(
                f"epsilon {e:g}, {a['attack']}, TPR {_pct(a['tpr'])} (>= {_pct(a['tpr_low'])}) "
                f"at FPR {_pct(a['fpr'])} (<= {_pct(a['fpr_high'])})"
                for e, a in above
            )
            + "."
        )
    else:
        lines.append(
            "No measured point lies above what (epsilon, delta)-DP allows beyond sampling "
            "error (95% Clopper-Pearson)."
        )
    s = mia["seconds"]
    lines.append(
        f"Time: features {s['features']:.1f} s, training {s['train']:.1f} s, attacks "
        f"{s['attack']:.1f} s, total {s['total']:.1f} s ({mia['torch_threads']} torch thread(s))."
    )
    return "\n".join(lines) + "\n"


def _plot(
    cfg: MIAAuditConfig,
    curves: dict[float | None, tuple[np.ndarray, np.ndarray]],
    delta: float,
    path: Path,
) -> None:
    named = {("non-private" if e is None else f"epsilon {e:g}"): c for e, c in curves.items()}
    bounds = {f"epsilon {e:g}": (e, delta) for e in curves if e is not None}
    plot_roc(
        named,
        path,
        title=f"{_ATTACK_LABELS[cfg.headline_attack]}\n{cfg.shadows} models, pool "
        f"{cfg.pool}, delta {delta:.2g}",
        bounds=bounds,
        fpr_marks=cfg.fprs,
    )


def run_mia_audit(cfg: MIAAuditConfig) -> dict[str, Any]:
    """Features, shadow probes, attacks, report; returns the ``results.json`` content."""
    t0 = time.perf_counter()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    out = Path(cfg.out)
    feats = _features(cfg)  # bad data / encoder stop here, before any training
    if len(torch.unique(feats.pool_y)) < 2:
        raise ConfigError(f"pool={cfg.pool}: the pool holds one class only; expected at least 2")
    t_features = time.perf_counter() - t0
    n = feats.pool_x.shape[0]
    delta = resolve_delta(cfg.delta, n // 2)
    keep = _design(cfg, n)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")

    rows, curves, arrays = [], {}, {"keep": keep, "labels": feats.pool_y.numpy()}
    train_s = attack_s = 0.0
    bar = tqdm(
        total=len(cfg.epsilons) * cfg.shadows,
        desc="shadow probes",
        unit="model",
        disable=not cfg.progress,
    )
    for epsilon in cfg.epsilons:
        trained = _train_all(cfg, feats, keep, epsilon, delta, bar)
        train_s += trained.seconds
        t_attack = time.perf_counter()
        scores = _attack_scores(trained, keep)
        rows.append(_row(cfg, epsilon, delta, trained, scores, keep))
        fpr, tpr, _ = roc_curve(scores[cfg.headline_attack], keep)
        curves[epsilon] = (fpr, tpr)
        attack_s += time.perf_counter() - t_attack
        key = "none" if epsilon is None else f"{epsilon:g}"
        arrays[f"phi_eps_{key}"] = trained.phi
        arrays[f"neg_loss_eps_{key}"] = trained.neg_loss
    bar.close()

    setting = (
        f"{feats.description}; {cfg.shadows} linear probes per epsilon, each example IN for "
        f"{cfg.shadows // 2}; every probe the target once, the other {cfg.shadows - 1} its "
        f"shadows; Adam lr {cfg.lr:g}, {cfg.epochs} epochs, batch {cfg.batch_size}, C "
        f"{cfg.max_norm:g} (private), weight decay {cfg.weight_decay:g}; delta {delta:.3g}"
    )
    mia: dict[str, Any] = {
        "setting": setting,
        "data": cfg.data,
        "encoder": None if cfg.data == "synthetic" else cfg.encoder,
        "pool": n,
        "shadows": cfg.shadows,
        "delta": delta,
        "fprs": list(cfg.fprs),
        "headline_attack": cfg.headline_attack,
        "attacks": {name: _ATTACK_LABELS[name] for name in ATTACKS},
        "rows": rows,
        "flagged": any(row["above_dp_bound"] for row in rows),
        "torch_threads": torch.get_num_threads(),
    }
    np.savez_compressed(out / "scores.npz", **arrays)
    t_plot = time.perf_counter()
    _plot(cfg, curves, delta, out / "roc.png")
    attack_s += time.perf_counter() - t_plot
    mia["seconds"] = {
        "features": t_features,
        "train": train_s,
        "attack": attack_s,
        "total": time.perf_counter() - t0,
    }
    results = {"mia": mia}
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(_table(cfg, mia))
    return results
