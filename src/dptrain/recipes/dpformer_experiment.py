"""Experiment: the DPFormer paper's Table 1 on the packaged data, every run through the recipe.

``dptrain experiment dpformer [--config FILE] [key=value ...]`` trains every
model at every epsilon (and without privacy) for several seeds with
:func:`dptrain.recipes.seqrec.train_seqrec`, then writes to ``out``:

- ``table.md``: test NDCG@10 and HIT@10, mean +- std over seeds, rows GRU,
  LSTM, Transformer without parameter sharing, vanilla Transformer, DPFormer
  and DPFormer's relative improvement over the vanilla Transformer, columns
  epsilon and non-private (shaped like the paper's Table 1), plus the
  most-popular baseline, the wall time and the command;
- ``summary.json``: every run's results;
- ``ndcg_vs_epsilon.png``: NDCG@10 against epsilon per model.

Keys of :class:`DPFormerExperimentConfig` set the grid; every other key is a
:class:`~dptrain.recipes.seqrec.SeqRecTrainConfig` field applied to all runs.
Each run is chosen on validation NDCG@10 (best epoch); the test split is
scored once per run.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from dptrain.config import (
    config_to_dict,
    convert_values,
    read_config_values,
    split_config_values,
)
from dptrain.recipes._grid import run_all
from dptrain.recipes.seqrec import MODELS, SeqRecTrainConfig, train_seqrec

__all__ = ["DPFormerExperimentConfig", "load_experiment_config", "run_dpformer_experiment"]

_ROW_NAMES = {
    "gru": "GRU",
    "lstm": "LSTM",
    "transformer-untied": "Transformer (w/o PS)",
    "transformer": "Vanilla Transformer",
    "dpformer": "DPFormer",
    "most-popular": "Most popular",
}


@dataclass
class DPFormerExperimentConfig:
    """The grid; the training settings shared by every run are in ``train``."""

    models: tuple[str, ...] = ("gru", "lstm", "transformer-untied", "transformer", "dpformer")
    """Models of the grid (see ``train seqrec``'s ``model``)."""
    epsilons: tuple[float, ...] = (3.0, 5.0, 8.0, 10.0)
    """Target epsilons of the grid."""
    nonprivate: bool = True
    """Also train every model without privacy."""
    most_popular: bool = True
    """Also score the most-popular-items baseline."""
    seeds: int = 5
    """Training seeds per cell (0 .. seeds-1)."""
    workers: int = 1
    """Runs in parallel (processes); with workers > 1 give each run num_threads=1."""
    out: str = "runs/dpformer"
    """Output folder of the grid."""
    train: SeqRecTrainConfig = dataclasses.field(default_factory=SeqRecTrainConfig)
    """Training settings shared by every run: any key of ``dptrain train seqrec``, given flat."""

    def __post_init__(self) -> None:
        bad = [m for m in self.models if m not in MODELS or m == "most-popular"]
        if bad or not self.models:
            raise ValueError(
                f"models={list(self.models)!r} is not allowed: expected a non-empty list from "
                f"{[m for m in MODELS if m != 'most-popular']} (most-popular: most_popular=true)"
            )
        if not self.epsilons and not self.nonprivate:
            raise ValueError("epsilons=[] with nonprivate=false: nothing to run")
        for e in self.epsilons:
            if not e > 0:
                raise ValueError(f"epsilons contains {e!r}: expected positive numbers")
        for name in ("seeds", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} is not allowed: expected an integer >= 1")


def load_experiment_config(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> DPFormerExperimentConfig:
    """Split YAML keys and overrides between the grid and the shared training config."""
    grid_fields = {f.name for f in dataclasses.fields(DPFormerExperimentConfig)} - {"train"}
    train_fields = {f.name for f in dataclasses.fields(SeqRecTrainConfig)}
    grid_values, train_values = split_config_values(
        read_config_values(path, overrides), grid_fields, train_fields
    )
    train = SeqRecTrainConfig(**convert_values(SeqRecTrainConfig, train_values))
    grid = _GridOnly(**convert_values(_GridOnly, grid_values))
    return DPFormerExperimentConfig(**dataclasses.asdict(grid), train=train)


@dataclass
class _GridOnly:
    models: tuple[str, ...] = DPFormerExperimentConfig.models
    epsilons: tuple[float, ...] = DPFormerExperimentConfig.epsilons
    nonprivate: bool = True
    most_popular: bool = True
    seeds: int = 5
    workers: int = 1
    out: str = "runs/dpformer"


def _runs(cfg: DPFormerExperimentConfig) -> list[tuple[str, float | None, int]]:
    columns: list[float | None] = [*cfg.epsilons, *([None] if cfg.nonprivate else [])]
    models = [*cfg.models, *(["most-popular"] if cfg.most_popular else [])]
    return [(m, e, s) for m in models for e in columns for s in range(cfg.seeds)]


def run_dpformer_experiment(
    cfg: DPFormerExperimentConfig, command: str = "dptrain experiment dpformer"
) -> dict[str, Any]:
    """Run the grid; return the summary (also written to ``cfg.out``)."""
    t0 = time.perf_counter()
    out = Path(cfg.out)
    configs = []
    for model, eps, seed in _runs(cfg):
        tag = "nonprivate" if eps is None else f"eps{eps:g}"
        configs.append(
            dataclasses.replace(
                cfg.train,
                model=model,
                epsilon=eps,
                seed=seed,
                out=str(out / model / tag / f"seed{seed}"),
                progress=False,
                save_checkpoints=False,
            )
        )
    bar = tqdm(total=len(configs), desc="runs", unit="run")
    results = run_all(
        train_seqrec,
        configs,
        cfg.workers,
        bar,
        lambda c: {"model": c.model, "eps": c.epsilon, "seed": c.seed},
    )
    bar.close()
    wall = time.perf_counter() - t0
    summary = {
        "config": {
            **config_to_dict(_GridOnly(**_grid_values(cfg))),
            "train": config_to_dict(cfg.train),
        },
        "command": command,
        "wall_time_s": wall,
        "runs": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    table = results_table(results, cfg, wall, command)
    (out / "table.md").write_text(table)
    plot_ndcg_vs_epsilon(results, cfg, out / "ndcg_vs_epsilon.png")
    return summary


def _grid_values(cfg: DPFormerExperimentConfig) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(_GridOnly)}


def _cell(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def _collect(results, model: str, eps: float | None, key: str) -> list[float]:
    return [
        r[key]
        for r in results
        if r["model"] == model
        and (r["target_epsilon"] == eps if eps is not None else not r["private"])
    ]


def results_table(results, cfg: DPFormerExperimentConfig, wall_s: float, command: str) -> str:
    """Markdown: NDCG@10 and HIT@10 tables shaped like the DPFormer paper's Table 1."""
    columns: list[float | None] = [*cfg.epsilons, *([None] if cfg.nonprivate else [])]
    header = ["model", *[f"ε = {e:g}" if e is not None else "non-private" for e in columns]]
    models = [*cfg.models, *(["most-popular"] if cfg.most_popular else [])]
    first = results[0] if results else {}
    lines = [
        f"Data: {first.get('data', '?')} ({first.get('n_train_records', '?')} training records, "
        f"{first.get('n_items', '?')} items; {first.get('privacy_unit', '?')}-level DP). "
        f"Test split, best epoch by validation NDCG@10; mean ± std over {cfg.seeds} seed(s). "
        f"delta = {cfg.train.delta}, accountant {cfg.train.accountant}. "
        f"Wall time {wall_s / 60:.1f} min. Command: `{command}`",
        "",
    ]
    for key, label in (("ndcg@10", "NDCG@10"), ("hit@10", "HIT@10")):
        lines += [f"### {label}", "", "| " + " | ".join(header) + " |"]
        lines.append("| --- |" + " ---: |" * len(columns))
        for m in models:
            cells = [_cell(_collect(results, m, e, key)) for e in columns]
            lines.append(f"| {_ROW_NAMES[m]} | " + " | ".join(cells) + " |")
        if "dpformer" in models and "transformer" in models:
            cells = []
            for e in columns:
                a = _collect(results, "dpformer", e, key)
                b = _collect(results, "transformer", e, key)
                if a and b and statistics.mean(b) > 0:
                    cells.append(f"{100 * (statistics.mean(a) / statistics.mean(b) - 1):+.1f}%")
                else:
                    cells.append("-")
            lines.append(
                "| Relative improvement (DPFormer vs vanilla) | " + " | ".join(cells) + " |"
            )
        lines.append("")
    return "\n".join(lines)


def plot_ndcg_vs_epsilon(results, cfg: DPFormerExperimentConfig, path: Path) -> None:
    """NDCG@10 (mean +- std over seeds) against epsilon; non-private as a marker at the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = sorted(cfg.epsilons)
    x_np = (max(eps) * 1.35) if eps else 1.0
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    models = [*cfg.models, *(["most-popular"] if cfg.most_popular else [])]
    for i, m in enumerate(models):
        color = f"C{i}"
        ys = [_collect(results, m, e, "ndcg@10") for e in eps]
        pts = [
            (e, statistics.mean(v), statistics.pstdev(v)) for e, v in zip(eps, ys, strict=True) if v
        ]
        if pts:
            ax.errorbar(
                [p[0] for p in pts],
                [p[1] for p in pts],
                yerr=[p[2] for p in pts],
                marker="o",
                ms=4,
                capsize=3,
                color=color,
                label=_ROW_NAMES[m],
                ls=":" if m == "most-popular" else "-",
            )
        np_vals = _collect(results, m, None, "ndcg@10")
        if cfg.nonprivate and np_vals:
            ax.errorbar(
                [x_np],
                [statistics.mean(np_vals)],
                yerr=[statistics.pstdev(np_vals)],
                marker="s",
                ms=5,
                capsize=3,
                color=color,
                label=None if pts else _ROW_NAMES[m],
            )
    ticks = [*eps, *([x_np] if cfg.nonprivate else [])]
    ax.set_xticks(ticks, [f"{e:g}" for e in eps] + (["non-private"] if cfg.nonprivate else []))
    ax.set_xlabel("ε (target, whole run)")
    ax.set_ylabel("test NDCG@10 (full ranking)")
    first = results[0] if results else {}
    ax.set_title(f"{first.get('data', '')}: NDCG@10 against ε ({cfg.seeds} seed(s))")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
