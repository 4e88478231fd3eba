"""Studies of Anil et al. (2021) at CPU scale, each a small grid of :func:`train_mlm` runs.

``dptrain study snr|batch-schedule|weight-decay [--config FILE] [key=value ...]``
runs one study and writes ``table.md``, ``summary.json`` and a PNG to
``out/<study>/``:

- ``snr`` (Anil et al. Fig. 3-4): a fixed number of steps at several fixed
  batch sizes B (``snr_batch_sizes``), the same target epsilon: gradient-SNR
  ||sum_i clip(g_i)|| / ||noise|| over the steps and the final masked-token
  accuracy. With the steps fixed, a larger B means a larger q and so a larger
  sigma, but the signal grows like B and the noise only like sigma, so the
  SNR (and the accuracy) should grow with B.
- ``batch-schedule`` (Fig. 5-6): the growing schedule B/g -> B over the
  warm-up (the recipe's linear stages) against a fixed B (and, with
  ``schedule_include_small``, a fixed B/g), the same steps and epsilon:
  the examples processed until the validation accuracy first reaches a target
  (``target_accuracy``, or ``target_fraction`` of the best accuracy of the
  fixed-B run). The paper: the schedule matches fixed-B accuracy with 14%
  fewer examples.
- ``weight-decay`` (§4.4): a sweep of the decoupled weight decay lambda
  (``wd_values``) at one epsilon, and one non-private run without weight
  decay as a reference: the parameter norm over the steps (DP noise inflates
  the norm of scale-invariant weights, which shrinks their effective learning
  rate; weight decay counters it) and the accuracy.

Every run shares the tokenizer and the chunks through the recipe's
``cache_dir`` (default ``out/cache``), so the grid tokenizes once. Keys of
:class:`MLMStudyConfig` set the grids; every other key is a
:class:`~dptrain.recipes.mlm.MLMTrainConfig` field applied to every run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
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
from dptrain.recipes.mlm import MLMTrainConfig, load_mlm_corpus, train_mlm

__all__ = ["STUDIES", "MLMStudyConfig", "load_mlm_study_config", "run_mlm_study"]

#: The study names :func:`run_mlm_study` accepts.
STUDIES = ("snr", "batch-schedule", "weight-decay")


@dataclass
class _StudyGrid:
    """The grid settings (the training settings shared by every run are in ``train``)."""

    snr_batch_sizes: tuple[int, ...] = (128, 512, 2048)
    """snr study: expected batch sizes compared."""
    snr_steps: int = 24
    """snr study: steps per run."""
    snr_warmup_steps: int = 8
    """snr study: warm-up steps per run."""
    schedule_batch_size: int = 512
    """batch-schedule study: final expected batch size B."""
    schedule_growth: float = 4.0
    """batch-schedule study: B grows from B / growth to B."""
    schedule_steps: int = 60
    """batch-schedule study: steps per run."""
    schedule_warmup_steps: int = 20
    """batch-schedule study: warm-up steps (the growth happens over them)."""
    schedule_include_small: bool = True
    """Also run a fixed batch B / growth (the schedule's starting size)."""
    target_accuracy: float | None = None
    """Validation accuracy to reach; null: target_fraction x the fixed-B run's best."""
    target_fraction: float = 0.95
    """Share of the fixed-B run's best validation accuracy taken as the target."""
    wd_values: tuple[float, ...] = (0.0, 0.1, 1.0, 10.0)
    """weight-decay study: decoupled weight decays compared."""
    wd_batch_size: int = 256
    """weight-decay study: expected batch size."""
    wd_steps: int = 60
    """weight-decay study: steps per run."""
    wd_warmup_steps: int = 20
    """weight-decay study: warm-up steps."""
    wd_nonprivate_reference: bool = True
    """weight-decay study: also train without privacy as a reference."""
    workers: int = 1
    """Runs in parallel (spawned processes); with workers > 1 give each run num_threads=1."""
    out: str = "runs/mlm_studies"
    """Output folder; each study writes to <out>/<study>."""

    def __post_init__(self) -> None:
        for name in ("snr_steps", "schedule_steps", "wd_steps", "workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} is not allowed: expected an integer >= 1")
        for steps, warm in (
            ("snr_steps", "snr_warmup_steps"),
            ("schedule_steps", "schedule_warmup_steps"),
            ("wd_steps", "wd_warmup_steps"),
        ):
            w = getattr(self, warm)
            if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= getattr(self, steps):
                raise ValueError(
                    f"{warm}={w!r} is not allowed: expected an integer in [0, {steps}]"
                )
        if not self.snr_batch_sizes or any(b < 1 for b in self.snr_batch_sizes):
            raise ValueError(
                f"snr_batch_sizes={list(self.snr_batch_sizes)!r} is not allowed: expected a "
                "non-empty list of integers >= 1"
            )
        if self.schedule_batch_size < 1:
            raise ValueError(
                f"schedule_batch_size={self.schedule_batch_size!r} is not allowed: expected >= 1"
            )
        if self.wd_batch_size < 1:
            raise ValueError(f"wd_batch_size={self.wd_batch_size!r} is not allowed: expected >= 1")
        if not self.schedule_growth > 1:
            raise ValueError(
                f"schedule_growth={self.schedule_growth!r} is not allowed: expected a number > 1"
            )
        if not self.wd_values or any(v < 0 for v in self.wd_values):
            raise ValueError(
                f"wd_values={list(self.wd_values)!r} is not allowed: expected a non-empty list "
                "of numbers >= 0"
            )
        if self.target_accuracy is not None and not 0 < self.target_accuracy < 1:
            raise ValueError(
                f"target_accuracy={self.target_accuracy!r} is not allowed: expected a number in "
                "(0, 1) or null"
            )
        if not 0 < self.target_fraction <= 1:
            raise ValueError(
                f"target_fraction={self.target_fraction!r} is not allowed: expected (0, 1]"
            )


@dataclass
class MLMStudyConfig(_StudyGrid):
    """The grids of the three studies and the training settings every run shares."""

    train: MLMTrainConfig = dataclasses.field(default_factory=MLMTrainConfig)
    """Training settings shared by every run: any key of ``dptrain train mlm``, given flat."""


def load_mlm_study_config(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> MLMStudyConfig:
    """Split YAML keys and overrides between the grids and the shared training config."""
    grid_fields = {f.name for f in dataclasses.fields(_StudyGrid)}
    train_fields = {f.name for f in dataclasses.fields(MLMTrainConfig)}
    grid_values, train_values = split_config_values(
        read_config_values(path, overrides), grid_fields, train_fields, grid_label="the studies'"
    )
    train = MLMTrainConfig(**convert_values(MLMTrainConfig, train_values))
    grid = _StudyGrid(**convert_values(_StudyGrid, grid_values))
    return MLMStudyConfig(**dataclasses.asdict(grid), train=train)


# -- the grids ---------------------------------------------------------------------------------


def _runs(name: str, cfg: MLMStudyConfig, base: MLMTrainConfig) -> list[tuple[str, MLMTrainConfig]]:
    """(label, config) of every run of study ``name``."""
    rep = dataclasses.replace
    if name == "snr":
        return [
            (
                f"B={b}",
                rep(
                    base,
                    batch_size=b,
                    batch_growth=1.0,
                    batch_schedule=None,
                    steps=cfg.snr_steps,
                    warmup_steps=cfg.snr_warmup_steps,
                ),
            )
            for b in cfg.snr_batch_sizes
        ]
    if name == "batch-schedule":
        b, g = cfg.schedule_batch_size, cfg.schedule_growth
        common = {
            "batch_schedule": None,
            "steps": cfg.schedule_steps,
            "warmup_steps": cfg.schedule_warmup_steps,
        }
        runs = [
            (f"fixed B={b}", rep(base, batch_size=b, batch_growth=1.0, **common)),
            (
                f"growing B={round(b / g)}->{b}",
                rep(base, batch_size=b, batch_growth=g, **common),
            ),
        ]
        if cfg.schedule_include_small:
            runs.append(
                (
                    f"fixed B={round(b / g)}",
                    rep(base, batch_size=round(b / g), batch_growth=1.0, **common),
                )
            )
        return runs
    common = {
        "batch_size": cfg.wd_batch_size,
        "batch_growth": 1.0,
        "batch_schedule": None,
        "steps": cfg.wd_steps,
        "warmup_steps": cfg.wd_warmup_steps,
    }
    runs = [(f"wd={wd:g}", rep(base, weight_decay=wd, **common)) for wd in cfg.wd_values]
    if cfg.wd_nonprivate_reference:
        runs.append(("non-private, wd=0", rep(base, epsilon=None, weight_decay=0.0, **common)))
    return runs


def _slug(label: str) -> str:
    label = label.replace("->", "to")
    return "".join(c if c.isalnum() or c in "=.-" else "_" for c in label)


def run_mlm_study(name: str, cfg: MLMStudyConfig, command: str | None = None) -> dict[str, Any]:
    """Run study ``name`` (one of :data:`STUDIES`); return the summary (also written to disk)."""
    if name not in STUDIES:
        raise ValueError(f"study={name!r} is not allowed: expected one of {list(STUDIES)}")
    command = command or f"dptrain study {name}"
    t0 = time.perf_counter()
    out = Path(cfg.out) / name
    cache = cfg.train.cache_dir or str(Path(cfg.out) / "cache")
    base = dataclasses.replace(cfg.train, cache_dir=cache, progress=False, save_checkpoints=False)
    runs = _runs(name, cfg, base)
    runs = [(label, dataclasses.replace(c, out=str(out / _slug(label)))) for label, c in runs]
    data = load_mlm_corpus(base)  # fills the cache once; spawned workers read it back
    n = len(data.train_ids)
    for label, c in runs:  # refuse a grid whose batches do not fit before any run starts
        biggest = c.batch_size
        if biggest > n:
            raise ValueError(
                f"{label}: expected batch {biggest} exceeds the {n} training examples: expected "
                f"batch sizes <= {n}"
            )
    bar = tqdm(total=len(runs), desc=name, unit="run", disable=not cfg.train.progress)
    train = functools.partial(train_mlm, data=data) if cfg.workers == 1 else train_mlm
    labels = {id(c): label for label, c in runs}
    results = run_all(
        train, [c for _, c in runs], cfg.workers, bar, lambda c: {"run": labels[id(c)]}
    )
    bar.close()
    for (label, c), r in zip(runs, results, strict=True):
        r["label"] = label
        r["history"] = [
            json.loads(line) for line in (Path(c.out) / "metrics.jsonl").read_text().splitlines()
        ]
    extra: dict[str, Any] = {}
    if name == "batch-schedule":
        extra = _reach_target(results, cfg)
    wall = time.perf_counter() - t0
    summary = {
        "study": name,
        "out": str(out),
        "config": {
            **config_to_dict(_StudyGrid(**_grid_values(cfg))),
            "train": config_to_dict(base),
        },
        "command": command,
        "wall_time_s": wall,
        "data": data.summary,
        **extra,
        "runs": results,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    (out / "table.md").write_text(_table(name, results, cfg, summary, wall, command))
    _plot(name, results, summary, out / f"{name.replace('-', '_')}.png")
    return summary


def _grid_values(cfg: MLMStudyConfig) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(_StudyGrid)}


def _reach_target(results: list[dict[str, Any]], cfg: MLMStudyConfig) -> dict[str, Any]:
    """Examples (and steps) each run processed until validation accuracy first hit the target."""
    reference = results[0]  # the fixed-B run
    target = (
        cfg.target_accuracy
        if cfg.target_accuracy is not None
        else cfg.target_fraction * reference["valid_accuracy"]
    )
    for r in results:
        hit = next(
            (h for h in r["history"] if h.get("valid_accuracy", -1.0) >= target),
            None,
        )
        r["examples_to_target"] = hit["examples_processed"] if hit else None
        r["steps_to_target"] = hit["step"] if hit else None
    # the same question on validation loss, which keeps falling while a short run's accuracy
    # still sits at the frequency baseline: within (1 - target_fraction) of the fixed-B
    # run's lowest validation loss
    target_loss = (2.0 - cfg.target_fraction) * min(
        h["valid_loss"] for h in reference["history"] if "valid_loss" in h
    )
    for r in results:
        hit = next(
            (h for h in r["history"] if h.get("valid_loss", math.inf) <= target_loss),
            None,
        )
        r["examples_to_target_loss"] = hit["examples_processed"] if hit else None
        r["steps_to_target_loss"] = hit["step"] if hit else None
    return {
        "target_loss": target_loss,
        "target_loss_rule": (
            f"{2.0 - cfg.target_fraction:g} x lowest validation loss of {reference['label']}"
        ),
        "target_accuracy": target,
        "target_rule": "given"
        if cfg.target_accuracy is not None
        else (f"{cfg.target_fraction:g} x best validation accuracy of {reference['label']}"),
    }


def _fmt(v: Any, spec: str = ".4f") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format(v, spec)
    return str(v)


def _table(name, results, cfg: MLMStudyConfig, summary, wall: float, command: str) -> str:
    t = cfg.train
    r0 = results[0]
    head = (
        f"Masked-LM study `{name}` (Anil et al. 2021) at CPU scale. BertForMaskedLM "
        f"{r0['model']['num_layers']} layers, hidden {r0['model']['hidden_size']}, "
        f"{r0['model']['num_heads']} heads, vocabulary {r0['model']['vocab_size']}, "
        f"{r0['n_params']:,} parameters; {t.max_len}-token chunks of {r0['data']} "
        f"({r0['n_train_chunks']:,} training chunks); target epsilon {t.epsilon}, delta "
        f"{_fmt(r0['delta'], '.3g')} ({t.delta}), accountant {t.accountant}; C = "
        f"{t.max_grad_norm:g}, lr {t.lr:g}, Adam betas ({t.adam_beta1:g}, {t.adam_beta2:g}). "
        f"Validation/test accuracy on {r0['eval_chunks']['valid']}/{r0['eval_chunks']['test']} "
        f"chunks with fixed masks. Wall time {wall / 60:.1f} min. Command: `{command}`"
    )
    lines = [head, ""]
    if name == "snr":
        lines += [
            "| run | q | sigma | steps | examples | mean SNR | SNR first / last step | "
            "valid acc (best) | valid loss | test acc | epsilon (PLD / RDP) | wall s |",
            "| --- |" + " ---: |" * 11,
        ]
        for r in results:
            snr = [h["gradient_snr"] for h in r["history"]]
            lines.append(
                f"| {r['label']} | {r['schedule'][0]['sample_rate']:.4f} | "
                f"{r['noise_multiplier']:.3f} | {r['steps']} | {r['examples_processed']:,} | "
                f"{_fmt(r['mean_gradient_snr'], '.3f')} | {snr[0]:.3f} / {snr[-1]:.3f} | "
                f"{r['valid_accuracy']:.4f} | {r['valid_loss']:.3f} | {r['test_accuracy']:.4f} | "
                f"{_fmt(r['epsilon_pld'], '.3f')} / {_fmt(r['epsilon_rdp'], '.3f')} | "
                f"{r['wall_time_s']:.0f} |"
            )
    elif name == "batch-schedule":
        lines += [
            f"Target validation accuracy {summary['target_accuracy']:.4f} "
            f"({summary['target_rule']}); target validation loss "
            f"{summary['target_loss']:.3f} ({summary['target_loss_rule']}); evaluated every "
            f"{t.eval_every} steps.",
            "",
            "| run | schedule (batch x steps) | sigma | examples (total) | examples to target "
            "acc | steps to target acc | examples to target loss | steps to target loss | "
            "valid acc (best) | valid loss | test acc | mean SNR | epsilon (PLD) |",
            "| --- | --- |" + " ---: |" * 11,
        ]
        for r in results:
            sched = ", ".join(f"{s['batch']}x{s['steps']}" for s in r["schedule"])
            lines.append(
                f"| {r['label']} | {sched} | {r['noise_multiplier']:.3f} | "
                f"{r['examples_processed']:,} | {_fmt(r['examples_to_target'])} | "
                f"{_fmt(r['steps_to_target'])} | {_fmt(r['examples_to_target_loss'])} | "
                f"{_fmt(r['steps_to_target_loss'])} | {r['valid_accuracy']:.4f} | "
                f"{r['valid_loss']:.3f} | {r['test_accuracy']:.4f} | "
                f"{_fmt(r['mean_gradient_snr'], '.3f')} | "
                f"{_fmt(r['epsilon_pld'], '.3f')} |"
            )
    else:
        lines += [
            "| run | weight decay | param norm start -> end | embedding norm start -> end | "
            "valid acc (best) | final valid acc | valid loss | test acc | epsilon (PLD) |",
            "| --- |" + " ---: |" * 8,
        ]
        for r in results:
            lines.append(
                f"| {r['label']} | {r['weight_decay']:g} | {r['initial_param_norm']:.2f} -> "
                f"{r['final_param_norm']:.2f} | {r['initial_embedding_norm']:.2f} -> "
                f"{r['final_embedding_norm']:.2f} | {r['valid_accuracy']:.4f} | "
                f"{r['final_valid_accuracy']:.4f} | {r['valid_loss']:.3f} | "
                f"{r['test_accuracy']:.4f} | "
                f"{_fmt(r['epsilon_pld'], '.3f')} |"
            )
    lines.append("")
    return "\n".join(lines)


def _plot(name: str, results, summary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for i, r in enumerate(results):
        h = r["history"]
        evals = [x for x in h if "valid_accuracy" in x]
        color = f"C{i}"
        if name == "weight-decay":
            left.plot(
                [x["step"] for x in h], [x["param_norm"] for x in h], color=color, label=r["label"]
            )
            right.plot(
                [x["step"] for x in evals],
                [x["valid_accuracy"] for x in evals],
                marker="o",
                ms=3,
                color=color,
                label=r["label"],
            )
        else:
            if r["private"]:
                left.plot(
                    [x["step"] for x in h],
                    [x["gradient_snr"] for x in h],
                    color=color,
                    label=r["label"],
                    lw=1,
                )
            xs = (
                [x["examples_processed"] for x in evals]
                if name == "batch-schedule"
                else [x["step"] for x in evals]
            )
            right.plot(
                xs,
                [x["valid_accuracy"] for x in evals],
                marker="o",
                ms=3,
                color=color,
                label=r["label"],
            )
    if name == "weight-decay":
        left.set_ylabel("parameter norm ||theta||")
        left.set_title("parameter norm over training")
    else:
        left.set_yscale("log")
        left.set_ylabel("gradient-SNR ||clipped sum|| / ||noise||")
        left.set_title("gradient-SNR over training")
    left.set_xlabel("step")
    if name == "batch-schedule":
        right.axhline(summary["target_accuracy"], color="grey", ls="--", lw=1, label="target")
        right.set_xlabel("examples processed")
    else:
        right.set_xlabel("step")
    right.set_ylabel("validation masked-token accuracy")
    right.set_title("accuracy")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
