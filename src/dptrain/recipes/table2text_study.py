"""Study: batch size x learning rate on E2E at epsilon 3 (Li et al. 2022, Figure 2).

``dptrain study e2e-heatmap [--config FILE] [key=value ...]`` trains the
table-to-text recipe (:func:`dptrain.recipes.table2text.train_table2text`) for
every (batch size, learning rate) of the grid at one target epsilon and a
*fixed number of epochs* (Li et al.'s compute-bound setting: a larger batch
means fewer, less noisy steps), then writes to ``out``:

- ``table.md``: the heat map as a table (rows: learning rate, high at the top as
  in Li et al.; columns: batch size and its sampling rate q = B/N), cells the
  *validation* BLEU (beam search) of the best epoch by validation loss, mean
  over seeds; the same for test BLEU when ``decode_test`` is on; then one row
  per run with the noise multiplier, steps, mean gradient SNR over the first
  30 steps (Li et al. Fig. 3b), epsilon spent and wall time;
- ``summary.json``: every run's results;
- ``heatmap.png``: validation BLEU over the grid (Li et al. Figure 2);
- ``snr_vs_bleu.png``: validation BLEU against the mean early gradient SNR
  (Li et al. Figure 3b).

Keys of :class:`Table2TextStudyConfig` set the grid; every other key is a
:class:`~dptrain.recipes.table2text.Table2TextConfig` field applied to every run
(``batch_size``, ``lr``, ``epsilon``, ``seed`` and ``out`` are the grid's).
Selection-style reporting: the grid is read on validation BLEU; the test split
is decoded only if ``decode_test=true`` (default off: it is not needed to read
the figure, and looking at test scores over a grid is a selection on test).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from dptrain.config import (
    ConfigError,
    config_to_dict,
    convert_values,
    read_config_values,
    split_config_values,
)
from dptrain.recipes._grid import run_all
from dptrain.recipes.table2text import Table2TextConfig, train_table2text

__all__ = [
    "Table2TextStudyConfig",
    "load_table2text_study_config",
    "plot_heatmap",
    "plot_snr_vs_bleu",
    "results_table",
    "run_table2text_study",
]

_GRID_KEYS = ("batch_size", "lr", "epsilon", "seed", "out", "progress", "save_checkpoint")
# Training settings the study uses unless the user sets them (see the YAML config).
_STUDY_DEFAULTS = {"decode_test": False, "epochs": 10, "num_threads": 1}


@dataclass
class Table2TextStudyConfig:
    """The grid; ``train`` holds the training settings shared by every run."""

    batch_sizes: tuple[int, ...] = (16, 64, 256, 1024)
    """Expected logical batch sizes B (q = B / N; N ~ 3.9k training pairs on E2E dev)."""
    lrs: tuple[float, ...] = (1e-4, 3e-4, 1e-3, 3e-3)
    """Learning rates of the grid."""
    epsilon: float = 3.0
    """Target epsilon of every run."""
    seeds: int = 1
    """Training seeds per cell (0 .. seeds-1)."""
    workers: int = 1
    """Runs in parallel (processes); give each run num_threads=1."""
    out: str = "runs/table2text_study"
    """Output folder of the grid."""
    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Table2TextConfig fields (not batch_size / lr / epsilon / seed / out), as given."""

    def __post_init__(self) -> None:
        for name, values, kind in (
            ("batch_sizes", self.batch_sizes, int),
            ("lrs", self.lrs, float),
        ):
            ok = values and all(
                isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in values
            )
            if kind is int:
                ok = ok and all(isinstance(v, int) for v in values)
            if not ok:
                what = "integers >= 1" if kind is int else "numbers > 0"
                raise ValueError(
                    f"{name}={list(values)!r} is not allowed: expected a non-empty list of {what}"
                )
        if not (isinstance(self.epsilon, int | float) and self.epsilon > 0):
            raise ValueError(f"epsilon={self.epsilon!r} is not allowed: expected a number > 0")
        for name in ("seeds", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} is not allowed: expected an integer >= 1")
        clash = sorted(set(self.train) & set(_GRID_KEYS))
        if clash:
            raise ConfigError(
                f"training key(s) {clash} are set by the grid (batch_sizes, lrs, epsilon, seeds, "
                "out)"
            )
        self.run_configs()  # every run's settings are checked before any runs

    def run_configs(self) -> list[Table2TextConfig]:
        """Every run of the grid: batch size, then learning rate, then seed."""
        out = Path(self.out)
        shared = {**_STUDY_DEFAULTS, **self.train}
        return [
            Table2TextConfig(
                **shared,
                batch_size=b,
                lr=float(lr),
                epsilon=float(self.epsilon),
                seed=seed,
                out=str(out / f"B{b}_lr{lr:g}" / f"seed{seed}"),
                progress=False,
                save_checkpoint=False,
            )
            for b in self.batch_sizes
            for lr in self.lrs
            for seed in range(self.seeds)
        ]


@dataclass
class _GridOnly:
    batch_sizes: tuple[int, ...] = Table2TextStudyConfig.batch_sizes
    lrs: tuple[float, ...] = Table2TextStudyConfig.lrs
    epsilon: float = 3.0
    seeds: int = 1
    workers: int = 1
    out: str = "runs/table2text_study"


def load_table2text_study_config(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> Table2TextStudyConfig:
    """Split YAML keys and ``key=value`` overrides between the grid and the training settings."""
    grid_fields = {f.name for f in dataclasses.fields(_GridOnly)}
    train_fields = {f.name for f in dataclasses.fields(Table2TextConfig)}
    grid_values, train_values = split_config_values(
        read_config_values(path, overrides),
        grid_fields,
        train_fields,
        train_shown=train_fields - set(_GRID_KEYS),
    )
    grid = _GridOnly(**convert_values(_GridOnly, grid_values))
    train = convert_values(Table2TextConfig, train_values)
    return Table2TextStudyConfig(**dataclasses.asdict(grid), train=train)


def run_table2text_study(
    cfg: Table2TextStudyConfig, command: str = "dptrain study e2e-heatmap"
) -> dict[str, Any]:
    """Run the grid; return the summary (also written to ``cfg.out``)."""
    t0 = time.perf_counter()
    out = Path(cfg.out)
    configs = cfg.run_configs()
    bar = tqdm(total=len(configs), desc="runs", unit="run")
    results = run_all(
        train_table2text,
        configs,
        cfg.workers,
        bar,
        lambda c: {"B": c.batch_size, "lr": f"{c.lr:g}", "seed": c.seed},
    )
    bar.close()
    for run_cfg, r in zip(configs, results, strict=True):
        r["run_folder"] = run_cfg.out
    wall = time.perf_counter() - t0
    summary = {
        "config": {**config_to_dict(_GridOnly(**_grid_values(cfg))), "train": cfg.train},
        "command": command,
        "wall_time_s": wall,
        "runs": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "table.md").write_text(results_table(results, cfg, wall, command))
    plot_heatmap(results, cfg, out / "heatmap.png")
    plot_snr_vs_bleu(results, cfg, out / "snr_vs_bleu.png")
    return summary


def _grid_values(cfg: Table2TextStudyConfig) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(_GridOnly)}


def _runs(results, b: int, lr: float) -> list[dict[str, Any]]:
    return [r for r in results if r["batch_size"] == b and math.isclose(r["lr"], lr)]


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.mean(values) if values else None


def _grid_matrix(results, cfg: Table2TextStudyConfig, key: str) -> list[list[float | None]]:
    """Rows: learning rates from high to low; columns: batch sizes from small to large."""
    lrs = sorted(cfg.lrs, reverse=True)
    bs = sorted(cfg.batch_sizes)
    return [[_mean([r.get(key) for r in _runs(results, b, lr)]) for b in bs] for lr in lrs]


def _fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def results_table(results, cfg: Table2TextStudyConfig, wall_s: float, command: str) -> str:
    """Markdown: the validation (and test) BLEU heat maps as tables, then one row per run."""
    first = results[0] if results else {}
    n = first.get("n_train_pairs", "?")
    lrs = sorted(cfg.lrs, reverse=True)
    bs = sorted(cfg.batch_sizes)
    qs = [f"B = {b} (q = {b / n:.3g})" if isinstance(n, int) else f"B = {b}" for b in bs]
    lines = [
        f"# E2E: batch size x learning rate at ε = {cfg.epsilon:g} (Li et al. 2022, Figure 2)",
        "",
        f"N = {n} training pairs (E2E dev minus the validation tables), "
        f"{first.get('epochs', '?')} epochs for every cell (fixed epochs: larger batches take "
        f"fewer steps), C = {first.get('max_grad_norm', '?')}, DP-Adam, "
        f"{first.get('n_parameters', '?')} parameters (from scratch), "
        f"{cfg.seeds} seed(s). Cells: BLEU (beam {first.get('beam_size', '?')}) of the best "
        f"epoch by validation loss on {first.get('valid_tables_decoded', '?')} validation "
        f"tables; mean over seeds. Wall time {wall_s / 60:.1f} min. Command: `{command}`",
        "",
        "## Validation BLEU",
        "",
        "| lr | " + " | ".join(qs) + " |",
        "| ---: |" + " ---: |" * len(bs),
    ]
    for lr, row in zip(lrs, _grid_matrix(results, cfg, "valid_bleu_beam"), strict=True):
        lines.append(f"| {lr:g} | " + " | ".join(_fmt(v) for v in row) + " |")
    lines.append("")
    if any("test_bleu_beam" in r for r in results):
        lines += [
            "## Test BLEU (beam) and ROUGE-L, for reference (not used to read the grid)",
            "",
            "| lr | " + " | ".join(qs) + " |",
            "| ---: |" + " ---: |" * len(bs),
        ]
        bleu = _grid_matrix(results, cfg, "test_bleu_beam")
        rouge = _grid_matrix(results, cfg, "test_rouge_l_beam")
        for lr, rb, rr in zip(lrs, bleu, rouge, strict=True):
            cells = [f"{_fmt(b)} / {_fmt(r)}" for b, r in zip(rb, rr, strict=True)]
            lines.append(f"| {lr:g} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += [
        "## Runs",
        "",
        "| B | lr | seed | noise multiplier | steps | gradient SNR (first 30 steps) | "
        "best epoch | valid loss | valid BLEU | valid ROUGE-L | PLD ε | wall (s) |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['batch_size']} | {r['lr']:g} | {r['seed']} | {r['noise_multiplier']:.4g} | "
            f"{r['steps']} | {_fmt(r.get('gradient_snr_first30'), 3)} | {r['best_epoch']} | "
            f"{_fmt(r.get('valid_loss'), 3)} | {_fmt(r.get('valid_bleu_beam'))} | "
            f"{_fmt(r.get('valid_rouge_l_beam'))} | {_fmt(r.get('epsilon'), 3)} | "
            f"{r['wall_time_s']:.0f} |"
        )
    lines.append("")
    return "\n".join(lines)


def plot_heatmap(results, cfg: Table2TextStudyConfig, path: Path) -> None:
    """Validation BLEU over batch size x learning rate (Li et al. Figure 2), annotated."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lrs = sorted(cfg.lrs, reverse=True)
    bs = sorted(cfg.batch_sizes)
    grid = _grid_matrix(results, cfg, "valid_bleu_beam")
    values = np.array([[np.nan if v is None else v for v in row] for row in grid], dtype=float)
    fig, ax = plt.subplots(figsize=(1.2 * len(bs) + 2.2, 0.8 * len(lrs) + 1.8))
    im = ax.imshow(values, cmap="viridis", aspect="auto")
    finite = values[np.isfinite(values)]
    mid = float(finite.mean()) if finite.size else 0.0
    for i in range(len(lrs)):
        for j in range(len(bs)):
            if np.isfinite(values[i, j]):
                colour = "black" if values[i, j] > mid else "white"
                ax.text(j, i, f"{values[i, j]:.1f}", ha="center", va="center", color=colour)
    ax.set_xticks(range(len(bs)), [str(b) for b in bs])
    ax.set_yticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
    ax.set_xlabel("batch size B")
    ax.set_ylabel("learning rate")
    epochs = results[0].get("epochs", "?") if results else "?"
    ax.set_title(f"E2E validation BLEU, ε = {cfg.epsilon:g}, {epochs} epochs", fontsize=10)
    fig.colorbar(im, ax=ax, label="BLEU")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_snr_vs_bleu(results, cfg: Table2TextStudyConfig, path: Path) -> None:
    """Validation BLEU against the mean gradient SNR of the first 30 steps (Li et al. Fig. 3b)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    for i, lr in enumerate(sorted(cfg.lrs)):
        pts = [
            (r["gradient_snr_first30"], r["valid_bleu_beam"])
            for r in results
            if math.isclose(r["lr"], lr)
            and r.get("gradient_snr_first30")
            and r.get("valid_bleu_beam") is not None
        ]
        if pts:
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=f"C{i}", label=f"lr {lr:g}")
    ax.set_xscale("log")
    ax.set_xlabel("mean gradient SNR, first 30 steps (log)")
    ax.set_ylabel("validation BLEU")
    ax.set_title(f"E2E, ε = {cfg.epsilon:g}: early SNR vs BLEU (larger B -> larger SNR)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
