"""The main demo: a private sentiment classifier that is nearly as good as a non-private one.

``dptrain demo [--out FOLDER] [key=value ...]`` (``make demo``), 1-3
minutes on 2 CPU cores, on packaged data only. It writes to ``runs/demo``, or to a
fresh ``runs/demo-<YYYYmmdd-HHMMSS>`` while that holds an earlier run (the command
line's ``claim_run_folder``: a run's ledgers are never written over):

1. **setup**: the packaged Rotten Tomatoes reviews (10,246 train / 1,281 dev /
   1,281 test, fixed split) and the packaged all-MiniLM-L6-v2 as a *public*
   pretrained encoder, frozen. The encoder reads every review once; its
   representations are cached in ``<out>/cache`` (the slow part, ~2 minutes).
2. **train**: a linear probe on those representations, through
   ``dptrain train classify``: without privacy (``nonprivate-head``) and with
   DP-Adam (``dpsgd-head``: Poisson batches, per-example clipping, Gaussian
   noise, calibrated by PLD) at each epsilon of ``epsilons``. Each run keeps
   its best epoch by dev accuracy; the test split is scored once per run.
3. **baseline**: what needs no training data at all: always answering the
   majority class of the training labels (scored on the same test split).
4. **report**: ``table.md`` (test accuracy, the epsilon spent as PLD, RDP and
   GDP count it, delta, noise, steps, time), ``accuracy_vs_epsilon.png``,
   ``summary.json``, each run's folder (``<out>/<method>/<tag>/``: config,
   ledger, results), and the guarantee printed in words.

Why this task: it is what dptrain is for in one picture. A private model
trained on sensitive text with a checkable (epsilon, delta), far above what
no training gives and close to the non-private model, in minutes. The
earlier demo (DPFormer on MovieLens) stays as ``dptrain experiment dpformer
--config dpformer_demo``.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dptrain.config import (
    ConfigError,
    convert_values,
    read_config_values,
    save_config,
    split_config_values,
)
from dptrain.recipes.classify import ClassifyTrainConfig, train_classify

__all__ = ["DemoConfig", "load_demo_config", "run_demo"]

#: ClassifyTrainConfig fields the demo sets per run (not settable as shared training keys).
_PER_RUN = ("method", "epsilon", "out", "feature_cache", "progress")


@dataclass
class DemoConfig:
    """The demo's runs; ``train`` holds ClassifyTrainConfig fields shared by every run."""

    epsilons: tuple[float, ...] = (1.0, 3.0, 8.0)
    """Target epsilons of the private probe (PLD, delta = 1/N^1.1)."""
    out: str = "runs/demo"
    """Output folder of the demo."""
    progress: bool = True
    """Show a progress bar on stderr."""
    train: dict[str, Any] = field(default_factory=dict)
    """Shared ClassifyTrainConfig settings (e.g. ``data``, ``encoder``, ``epochs``, ``seed``)."""

    def __post_init__(self) -> None:
        if not self.epsilons or any(not e > 0 for e in self.epsilons):
            raise ValueError(
                f"epsilons={list(self.epsilons)!r} is not allowed: expected a non-empty list of "
                "numbers > 0"
            )
        fixed = sorted(set(self.train) & set(_PER_RUN))
        if fixed:
            raise ConfigError(f"{fixed} are set by the demo for each run: remove them")

    def runs(self) -> list[ClassifyTrainConfig]:
        """The non-private probe, then one private probe per epsilon (checked here)."""
        out = Path(self.out)
        shared = {"feature_cache": str(out / "cache"), "progress": self.progress, **self.train}
        runs = [
            ClassifyTrainConfig(**shared, method="nonprivate-head", out=str(out / "nonprivate"))
        ]
        for eps in self.epsilons:
            runs.append(
                ClassifyTrainConfig(
                    **shared, method="dpsgd-head", epsilon=eps, out=str(out / f"eps{eps:g}")
                )
            )
        return runs


def load_demo_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> DemoConfig:
    """Demo keys (``epsilons``, ``out``, ``progress``) and shared training keys, checked."""
    own_fields = {"epsilons", "out", "progress"}
    train_fields = {f.name for f in dataclasses.fields(ClassifyTrainConfig)} - set(_PER_RUN)
    own, train = split_config_values(
        read_config_values(path, overrides), own_fields, train_fields, grid_label="the demo's"
    )
    cfg = DemoConfig(
        **convert_values(DemoConfig, own), train=convert_values(ClassifyTrainConfig, train)
    )
    cfg.runs()  # every run's settings are checked before anything runs
    return cfg


def _majority_accuracy(run: ClassifyTrainConfig) -> tuple[float, str]:
    from dptrain.recipes.classify import load_classification_data

    data = load_classification_data(run)
    majority = int(torch.bincount(data.train_labels).argmax())
    accuracy = float((data.test_labels == majority).float().mean())
    return accuracy, data.label_names[majority]


def run_demo(cfg: DemoConfig, command: str = "dptrain demo") -> dict[str, Any]:
    """Run the demo; write and return the summary."""
    t0 = time.perf_counter()
    out = Path(cfg.out)
    runs = cfg.runs()
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    baseline, majority_label = _majority_accuracy(runs[0])
    results = []
    for i, run in enumerate(runs):
        what = "non-private" if run.epsilon is None else f"epsilon {run.epsilon:g}"
        # stderr, with the bars: stdout is the results (a table, or --json's one line)
        print(f"[{i + 1}/{len(runs)}] linear probe, {what}", file=sys.stderr, flush=True)
        results.append(train_classify(run))
    summary = {
        "majority_class": {"label": majority_label, "accuracy": baseline},
        "runs": results,
        "wall_time_s": time.perf_counter() - t0,
        "command": command,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "table.md").write_text(_table(summary))
    _plot(summary, out / "accuracy_vs_epsilon.png")
    return summary


def guarantee(result: dict[str, Any]) -> str:
    """One private run's guarantee in words."""
    return (
        f"({result['epsilon']:.2f}, {result['delta']:.2g})-DP for each review of the "
        f"{result['n_train']:,} training reviews, labels included (PLD accountant over "
        f"{result['steps']} steps, noise multiplier {result['noise_multiplier']:.3f}, "
        f"C = {result['max_norm']:g}); the encoder is the public pretrained model"
    )


def _encoder_name(result: dict[str, Any]) -> str:
    return "all-MiniLM-L6-v2" if result["encoder"] == "minilm" else Path(result["encoder"]).name


def _table(summary: dict[str, Any]) -> str:
    base = summary["majority_class"]
    runs = summary["runs"]
    first = runs[0]
    lines = [
        f"# Private sentiment classifier: {first['data']}, frozen {_encoder_name(first)} + "
        "linear probe",
        "",
        f"{first['n_train']:,} training reviews, test accuracy on {first['n_test']:,} held-out "
        f"reviews (best epoch by dev accuracy). Wall time {summary['wall_time_s'] / 60:.1f} min. "
        f"Command: `{summary['command']}`",
        "",
        "| model | test accuracy | epsilon (PLD) | RDP / GDP epsilon | delta | noise multiplier "
        "| steps | train time |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        f"| no training (always '{base['label']}') | {base['accuracy']:.3f} | 0 | - | - | - "
        "| 0 | - |",
    ]
    for r in runs:
        if r["target_epsilon"] is None:
            lines.append(
                f"| non-private probe | {r['accuracy']:.3f} | inf | - | - | 0 | {r['steps']} "
                f"| {r['train_time_s']:.1f} s |"
            )
            continue
        by = r["epsilon_by_accountant"]
        lines.append(
            f"| DP probe, target epsilon {r['target_epsilon']:g} | {r['accuracy']:.3f} "
            f"| {r['epsilon']:.2f} | {by['rdp']:.2f} / {by['gdp']:.2f} | {r['delta']:.2g} "
            f"| {r['noise_multiplier']:.3f} | {r['steps']} | {r['train_time_s']:.1f} s |"
        )
    private = [r for r in runs if r["target_epsilon"] is not None]
    lines += ["", "Guarantees:"] + [f"- {guarantee(r)}" for r in private]
    return "\n".join(lines) + "\n"


def _plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    runs = summary["runs"]
    private = sorted(
        (r for r in runs if r["target_epsilon"] is not None), key=lambda r: r["epsilon"]
    )
    fig, ax = plt.subplots(figsize=(6.0, 3.8))
    ax.plot(
        [r["epsilon"] for r in private],
        [r["accuracy"] for r in private],
        marker="o",
        label="DP linear probe (DP-Adam)",
    )
    for r in runs:
        if r["target_epsilon"] is None:
            ax.axhline(r["accuracy"], color="k", ls="--", lw=1, label="non-private probe")
    base = summary["majority_class"]
    ax.axhline(base["accuracy"], color="tab:red", ls=":", lw=1.5, label="no training (majority)")
    ax.set_xscale("log")
    ax.set_xticks([r["epsilon"] for r in private], [f"{r['epsilon']:.2g}" for r in private])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("epsilon spent (PLD, log scale)")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{runs[0]['data']}: frozen {_encoder_name(runs[0])} + linear probe")
    ax.grid(alpha=0.3)
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
