"""Experiment: DP-FP against DP-SGD and non-private fine-tuning, every run through the recipe.

``dptrain experiment dpfp [--config FILE] [key=value ...]`` trains every method
at every epsilon (and the non-private baseline) for several seeds with
:func:`dptrain.recipes.classify.train_classify`, optionally sweeps DP-FP's clipping
norm C and number of micro-batches M at one epsilon (the DP-FP paper's Figures 2
and 3), then writes to ``out``:

- ``table.md``: test accuracy, mean +- std over seeds, one row per method and one
  column per epsilon (plus non-private), with the mean wall time per run and the
  privacy scope of each method; the sweep tables; the command and total time;
- ``summary.json``: every run's results;
- ``accuracy_vs_epsilon.png`` and, with sweeps, ``accuracy_vs_clip.png`` and
  ``accuracy_vs_micro_batches.png``.

Keys of :class:`DPFPExperimentConfig` set the grid; every other key is a
:class:`~dptrain.recipes.classify.ClassifyTrainConfig` field applied to every run
(``method``, ``epsilon`` and ``seed`` are the grid's). Every method is calibrated
to the same target epsilon (PLD unless ``accountant`` says otherwise), and every
run is chosen on dev accuracy; the test split is scored once per run.
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
    ConfigError,
    config_to_dict,
    convert_values,
    read_config_values,
    split_config_values,
)
from dptrain.recipes._grid import run_all
from dptrain.recipes.classify import (
    METHODS,
    NON_PRIVATE_METHODS,
    ClassifyTrainConfig,
    train_classify,
)

__all__ = ["DPFPExperimentConfig", "load_dpfp_experiment_config", "run_dpfp_experiment"]

_ROW_NAMES = {
    "nonprivate": "Non-private fine-tuning",
    "nonprivate-head": "Non-private, head only (frozen encoder)",
    "dpsgd": "DP-SGD (DP-Adam), full fine-tuning",
    "dpsgd-head": "DP-SGD, head only (frozen encoder)",
    "dpfp": "DP-FP, frozen encoder",
    "dpfp-finetune": "DP-FP, encoder fine-tuned (paper)",
}
_GRID_KEYS = ("method", "epsilon", "seed", "out", "progress", "save_checkpoint")


@dataclass
class DPFPExperimentConfig:
    """The grid; ``train`` holds the user's training settings shared by every run."""

    methods: tuple[str, ...] = tuple(m for m in METHODS if m != "nonprivate-head")
    """Methods of the grid (see ``train classify --method``)."""
    epsilons: tuple[float, ...] = (1.0, 3.0, 8.0)
    """Target epsilons of the grid."""
    seeds: int = 3
    """Training seeds per cell (0 .. seeds-1)."""
    clip_sweep: tuple[float, ...] = ()
    """DP-FP clipping norms C to sweep at ``sweep_epsilon`` (Figure 2 analogue)."""
    micro_batch_sweep: tuple[int, ...] = ()
    """DP-FP micro-batch counts M to sweep at ``sweep_epsilon`` (Figure 3 analogue)."""
    sweep_method: str = "dpfp"
    """Method of the clipping / micro-batch sweeps: ``dpfp`` or ``dpfp-finetune``."""
    sweep_epsilon: float = 3.0
    """Target epsilon of the sweeps."""
    workers: int = 1
    """Runs in parallel (processes); with workers > 1 give each run num_threads=1."""
    out: str = "runs/dpfp"
    """Output folder of the grid."""
    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    """ClassifyTrainConfig fields (not method / epsilon / seed), as given."""
    per_method: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    """Settings for one method only (YAML), e.g. ``{dpsgd: {batch_size: 128}}``."""

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(
                f"methods={list(self.methods)!r} is not allowed: expected a non-empty list "
                f"from {list(METHODS)}"
            )
        if self.sweep_method not in ("dpfp", "dpfp-finetune"):
            raise ValueError(
                f"sweep_method={self.sweep_method!r} is not allowed: expected 'dpfp' or "
                "'dpfp-finetune'"
            )
        for e in (*self.epsilons, self.sweep_epsilon):
            if not e > 0:
                raise ValueError(f"epsilon {e!r} in the grid is not allowed: expected > 0")
        if any(m not in NON_PRIVATE_METHODS for m in self.methods) and not self.epsilons:
            raise ValueError("epsilons=[] is not allowed with private methods in the grid")
        for c in self.clip_sweep:
            if not c > 0:
                raise ValueError(f"clip_sweep contains {c!r}: expected positive numbers")
        for m in self.micro_batch_sweep:
            if isinstance(m, bool) or not isinstance(m, int) or m < 1:
                raise ValueError(f"micro_batch_sweep contains {m!r}: expected integers >= 1")
        for name in ("seeds", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} is not allowed: expected an integer >= 1")
        for method, settings in self.per_method.items():
            if method not in METHODS or not isinstance(settings, dict):
                raise ConfigError(
                    f"per_method key {method!r} is not allowed: expected a mapping from a method "
                    f"in {list(METHODS)} to its settings"
                )
            clash = sorted(set(settings) & set(_GRID_KEYS))
            if clash:
                raise ConfigError(f"per_method.{method} sets {clash}: those are the grid's")
            self.per_method[method] = convert_values(ClassifyTrainConfig, settings)
        grid_set = sorted(set(self.train) & set(_GRID_KEYS))
        if grid_set:
            raise ConfigError(
                f"training key(s) {grid_set} are set by the grid (methods, epsilons, seeds, out)"
            )
        for config in self.run_configs():  # every run's settings are checked before any runs
            del config

    def sweep_base(self) -> ClassifyTrainConfig:
        """The sweep method's run at the sweep epsilon with the shared settings (C and M fixed)."""
        own = self.per_method.get(self.sweep_method, {})
        return ClassifyTrainConfig(
            **{**self.train, **own, "method": self.sweep_method, "epsilon": self.sweep_epsilon}
        )

    def run_configs(self) -> list[ClassifyTrainConfig]:
        """Every run of the grid, the main grid first, then the sweeps (no duplicates)."""
        out = Path(self.out)
        base = {"feature_cache": str(out / "cache"), **self.train}
        runs: dict[tuple, ClassifyTrainConfig] = {}

        def add(folder: Path, method: str, eps: float | None, seed: int, **extra: Any) -> None:
            own = self.per_method.get(method, {})
            values = {**base, **own, **extra, "method": method, "epsilon": eps, "seed": seed}
            run = ClassifyTrainConfig(
                **values, out=str(folder / f"seed{seed}"), progress=False, save_checkpoint=False
            )
            # Resolved settings: a sweep point equal to a main-grid run is not run twice.
            key = json.dumps({**dataclasses.asdict(run), "out": None}, sort_keys=True)
            runs.setdefault(key, run)

        for method in self.methods:
            columns = [None] if method in NON_PRIVATE_METHODS else list(self.epsilons)
            for eps in columns:
                tag = method if eps is None else f"eps{eps:g}"
                for seed in range(self.seeds):
                    add(out / method / tag, method, eps, seed)
        for c in self.clip_sweep:
            for seed in range(self.seeds):
                add(
                    out / "sweep_clip" / f"C{c:g}",
                    self.sweep_method,
                    self.sweep_epsilon,
                    seed,
                    max_norm=c,
                )
        for m in self.micro_batch_sweep:
            for seed in range(self.seeds):
                add(
                    out / "sweep_micro_batches" / f"M{m}",
                    self.sweep_method,
                    self.sweep_epsilon,
                    seed,
                    micro_batches=m,
                )
        return list(runs.values())


def load_dpfp_experiment_config(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> DPFPExperimentConfig:
    """Split YAML keys and overrides between the grid and the shared training settings."""
    grid_fields = {f.name for f in dataclasses.fields(DPFPExperimentConfig)} - {
        "train",
        "per_method",
    }
    train_fields = {f.name for f in dataclasses.fields(ClassifyTrainConfig)}
    values = read_config_values(path, overrides)
    per_method = values.pop("per_method", None) or {}
    if not isinstance(per_method, dict):
        raise ConfigError(f"per_method={per_method!r} is not allowed: expected a mapping")
    grid_values, train_values = split_config_values(values, grid_fields, train_fields)
    grid = _GridOnly(**convert_values(_GridOnly, grid_values))
    # Training values are type-checked against the recipe's fields and kept as given:
    # each run resolves its own method's defaults (DPFPExperimentConfig checks every run).
    train = convert_values(ClassifyTrainConfig, train_values)
    return DPFPExperimentConfig(**dataclasses.asdict(grid), train=train, per_method=per_method)


@dataclass
class _GridOnly:
    methods: tuple[str, ...] = DPFPExperimentConfig.methods
    epsilons: tuple[float, ...] = DPFPExperimentConfig.epsilons
    seeds: int = 3
    clip_sweep: tuple[float, ...] = ()
    micro_batch_sweep: tuple[int, ...] = ()
    sweep_method: str = "dpfp"
    sweep_epsilon: float = 3.0
    workers: int = 1
    out: str = "runs/dpfp"


def run_dpfp_experiment(
    cfg: DPFPExperimentConfig, command: str = "dptrain experiment dpfp"
) -> dict[str, Any]:
    """Run the grid; return the summary (also written to ``cfg.out``)."""
    t0 = time.perf_counter()
    out = Path(cfg.out)
    configs = cfg.run_configs()
    bar = tqdm(total=len(configs), desc="runs", unit="run")
    results: list[dict[str, Any]] = []
    # A frozen-encoder run first, alone: it fills the feature cache the others read.
    first = next((i for i, c in enumerate(configs) if c.method in ("dpfp", "dpsgd-head")), None)
    if first is not None:
        results_first = train_classify(configs[first])
        bar.update(1)
    rest = [c for i, c in enumerate(configs) if i != first]
    rest_results = run_all(
        train_classify,
        rest,
        cfg.workers,
        bar,
        lambda c: {"method": c.method, "eps": c.epsilon, "seed": c.seed},
    )
    bar.close()
    results = rest_results if first is None else [results_first, *rest_results]
    for run_cfg, r in zip(
        [*([configs[first]] if first is not None else []), *rest], results, strict=True
    ):
        r["run_folder"] = run_cfg.out
    wall = time.perf_counter() - t0
    summary = {
        "config": {
            **config_to_dict(_GridOnly(**_grid_values(cfg))),
            "train": cfg.train,
            "per_method": cfg.per_method,
        },
        "command": command,
        "wall_time_s": wall,
        "runs": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "table.md").write_text(results_table(results, cfg, wall, command))
    plot_accuracy_vs_epsilon(results, cfg, out / "accuracy_vs_epsilon.png")
    if cfg.clip_sweep:
        plot_sweep(results, cfg, "max_norm", out / "accuracy_vs_clip.png")
    if cfg.micro_batch_sweep:
        plot_sweep(results, cfg, "micro_batches", out / "accuracy_vs_micro_batches.png")
    return summary


def _grid_values(cfg: DPFPExperimentConfig) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(_GridOnly)}


def _cell(values: list[float], digits: int = 3) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _main_runs(results, cfg: DPFPExperimentConfig) -> list[dict[str, Any]]:
    """The runs of the main grid (method defaults for C and M), without sweep-only runs."""
    return [r for r in results if "/sweep_" not in r.get("run_folder", "").replace("\\", "/")]


def _select(results, method: str, eps: float | None, **match: Any) -> list[dict[str, Any]]:
    return [
        r
        for r in results
        if r["method"] == method
        and (r["target_epsilon"] == eps)
        and all(r.get(k) == v for k, v in match.items())
    ]


def _sweep_runs(results, cfg: DPFPExperimentConfig, key: str, value: float) -> list[dict]:
    """Runs of the sweep over ``key`` at ``value``, the other swept setting at its base value."""
    base = cfg.sweep_base()
    fixed = {"max_norm": base.max_norm, "micro_batches": base.micro_batches}
    fixed[key] = value
    return _select(results, cfg.sweep_method, cfg.sweep_epsilon, **fixed)


def results_table(results, cfg: DPFPExperimentConfig, wall_s: float, command: str) -> str:
    """Markdown: accuracy per method x epsilon, wall time per run, scope; then the sweeps."""
    main = _main_runs(results, cfg)
    first = results[0] if results else {}
    header = [
        "method",
        *[f"ε = {e:g}" for e in cfg.epsilons],
        "non-private",
        "wall / run",
        "privacy scope",
    ]
    lines = [
        f"Data: {first.get('data', '?')} ({first.get('n_train', '?')} training texts, "
        f"{first.get('n_dev', '?')} dev, {first.get('n_test', '?')} test); encoder "
        f"{first.get('encoder', '?')} ({first.get('objective', '?')} objective). "
        f"Test accuracy of the best epoch by dev accuracy, mean ± std over {cfg.seeds} seed(s); "
        f"every private method calibrated to the target ε with "
        f"{cfg.train.get('accountant', 'pld')} and reported by PLD (delta "
        f"{first.get('delta', '?'):.3g} for private runs). "
        f"Wall time {wall_s / 60:.1f} min. Command: `{command}`",
        "",
        "| " + " | ".join(header) + " |",
        "| --- |" + " ---: |" * (len(cfg.epsilons) + 2) + " --- |",
    ]
    for m in cfg.methods:
        runs = [r for r in main if r["method"] == m]
        if m in NON_PRIVATE_METHODS:
            cells = ["-"] * len(cfg.epsilons) + [_cell([r["accuracy"] for r in runs])]
        else:
            cells = [_cell([r["accuracy"] for r in _select(main, m, e)]) for e in cfg.epsilons]
            cells.append("-")
        wall = statistics.mean(r["wall_time_s"] for r in runs) if runs else float("nan")
        scope = runs[0]["privacy_scope"] if runs else ""
        lines.append(f"| {_ROW_NAMES[m]} | " + " | ".join(cells) + f" | {wall:.0f} s | {scope} |")
    lines.append("")
    private = [r for r in main if r["method"] not in NON_PRIVATE_METHODS]
    if private:
        lines += [
            "PLD ε actually spent (max over runs) and noise multiplier per method and target:",
            "",
            "| method | target ε | PLD ε | RDP ε | GDP ε (CLT) | noise multiplier | steps | "
            "ledger events |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for m in cfg.methods:
            for e in cfg.epsilons:
                runs = _select(main, m, e)
                if not runs:
                    continue
                r = runs[0]
                eb = r["epsilon_by_accountant"]
                lines.append(
                    f"| {m} | {e:g} | {max(x['epsilon'] for x in runs):.3f} | {eb['rdp']:.3f} | "
                    f"{eb['gdp']:.3f} | {r['noise_multiplier']:.4g} | {r['steps']} | "
                    f"{r['ledger_events']} |"
                )
        lines.append("")
    for key, values, label in (
        ("max_norm", cfg.clip_sweep, "clipping norm C"),
        ("micro_batches", cfg.micro_batch_sweep, "micro-batches M"),
    ):
        if not values:
            continue
        lines += [
            f"Sweep of the {label}: {cfg.sweep_method} at ε = {cfg.sweep_epsilon:g}",
            "",
            f"| {key} | test accuracy | dev accuracy | noise multiplier |",
            "| ---: | ---: | ---: | ---: |",
        ]
        for v in values:
            runs = _sweep_runs(results, cfg, key, v)
            sigma = f"{runs[0]['noise_multiplier']:.4g}" if runs else "-"
            lines.append(
                f"| {v:g} | {_cell([r['accuracy'] for r in runs])} | "
                f"{_cell([r['dev_accuracy'] for r in runs])} | {sigma} |"
            )
        lines.append("")
    return "\n".join(lines)


def plot_accuracy_vs_epsilon(results, cfg: DPFPExperimentConfig, path: Path) -> None:
    """Test accuracy (mean +- std over seeds) against epsilon per method; non-private as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    main = _main_runs(results, cfg)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, m in enumerate(cfg.methods):
        if m in NON_PRIVATE_METHODS:
            acc = [r["accuracy"] for r in main if r["method"] == m]
            if acc:
                ax.axhline(statistics.mean(acc), color="k", ls="--", lw=1, label=_ROW_NAMES[m])
            continue
        pts = []
        for e in sorted(cfg.epsilons):
            acc = [r["accuracy"] for r in _select(main, m, e)]
            if acc:
                pts.append((e, statistics.mean(acc), statistics.pstdev(acc)))
        if pts:
            ax.errorbar(
                [p[0] for p in pts],
                [p[1] for p in pts],
                yerr=[p[2] for p in pts],
                marker="o",
                ms=4,
                capsize=3,
                color=f"C{i}",
                label=_ROW_NAMES[m],
            )
    ax.set_xscale("log")
    ax.set_xticks(list(cfg.epsilons), [f"{e:g}" for e in cfg.epsilons])
    ax.xaxis.set_minor_formatter(NullFormatter())  # only the grid's epsilons are labelled
    ax.set_xlabel("ε (target, PLD, whole run)")
    ax.set_ylabel("test accuracy")
    first = results[0] if results else {}
    ax.set_title(f"{first.get('data', '')}: accuracy against ε ({cfg.seeds} seed(s))")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_sweep(results, cfg: DPFPExperimentConfig, key: str, path: Path) -> None:
    """Test accuracy against C or M for the sweep method at the sweep epsilon."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    values = cfg.clip_sweep if key == "max_norm" else cfg.micro_batch_sweep
    pts = []
    for v in sorted(values):
        acc = [r["accuracy"] for r in _sweep_runs(results, cfg, key, v)]
        if acc:
            pts.append((v, statistics.mean(acc), statistics.pstdev(acc)))
    fig, ax = plt.subplots(figsize=(5.6, 3.8))
    ax.errorbar(
        [p[0] for p in pts],
        [p[1] for p in pts],
        yerr=[p[2] for p in pts],
        marker="o",
        ms=4,
        capsize=3,
    )
    ax.set_xscale("log")
    ax.set_xticks([p[0] for p in pts], [f"{p[0]:g}" for p in pts])
    ax.xaxis.set_minor_formatter(NullFormatter())
    label = "clipping norm C" if key == "max_norm" else "micro-batches M"
    ax.set_xlabel(label)
    ax.set_ylabel("test accuracy")
    ax.set_title(
        f"{_ROW_NAMES[cfg.sweep_method]}, ε = {cfg.sweep_epsilon:g}: accuracy vs {label}",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
