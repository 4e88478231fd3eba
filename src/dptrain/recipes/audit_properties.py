"""Recipe: property checks of a private run (``dptrain audit properties``).

The self-test's setting: the one-run self-test's ``width`` x ``width`` linear softmax
classifier (here with a bias, so that the noise is checked on two tensors) on ``examples``
random examples, trained by dptrain's own ``make_private`` with Poisson-sampled batches of
expected size ``batch_size`` and C = ``max_grad_norm`` (2 by default: a noise std computed
without C differs from one computed with it only when C != 1). Then
:func:`dptrain.audit.properties.check_properties` runs ``steps`` steps and checks them.

Writes ``results.json``, ``table.md`` and ``config.yaml`` in ``out`` (refused if
``out/results.json`` exists: nothing the user made is overwritten).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dptrain._checks import check_in_interval, check_int, check_positive
from dptrain.audit.properties import DEFAULT_ALPHA, PropertyReport, check_properties
from dptrain.config import ConfigError, load_config, save_config
from dptrain.privacy_engine import PrivateTraining, make_private

__all__ = [
    "PropertiesConfig",
    "load_properties_config",
    "run_properties_audit",
    "self_test_run",
]


@dataclass
class PropertiesConfig:
    """``dptrain audit properties`` settings (``key=value`` overrides)."""

    width: int = 1000
    """d: the classifier is d x d (+ a bias of d), as the one-run self-test's."""
    examples: int = 1000
    """N, the records (random inputs, random labels)."""
    batch_size: int = 100
    """Expected logical batch size q N (Poisson sampling)."""
    steps: int = 20
    """Private steps run for the checks (each a Poisson-sampled logical batch)."""
    max_grad_norm: float = 2.0
    """C; not 1, so that a noise std computed without C shows."""
    epsilon: float = 8.0
    """Target epsilon over ``steps`` (sigma calibrated by ``accountant``)."""
    noise_multiplier: float = 0.0
    """sigma given directly instead of ``epsilon`` (0: calibrate)."""
    delta: float = 1e-5
    """delta of the target (epsilon, delta)."""
    accountant: str = "pld"
    """Accountant that calibrates sigma: ``pld``, ``rdp`` or ``gdp``."""
    alpha: float = DEFAULT_ALPHA
    """A correct run is flagged with probability below alpha."""
    probe_records: int = 4
    """Records of the first chunk the sensitivity probe scales, one at a time."""
    coordinates: int = 65_536
    """Per tensor, at most this many coordinates are kept for the noise checks."""
    seed: int = 0
    """Fixes the data, sampling and noise."""
    out: str = "runs/audit-properties"
    """Output folder (results.json; an existing one is never overwritten)."""


def load_properties_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> PropertiesConfig:
    """Defaults, then the YAML ``path``, then ``key=value`` overrides; values checked."""
    cfg = load_config(PropertiesConfig, path, overrides)
    check_int("width", cfg.width, 2)
    check_int("examples", cfg.examples, 1)
    check_int("steps", cfg.steps, 2)
    check_positive("max_grad_norm", cfg.max_grad_norm)
    check_positive("epsilon", cfg.epsilon)
    check_in_interval("noise_multiplier", cfg.noise_multiplier, 0.0, math.inf, low_open=False)
    check_in_interval("delta", cfg.delta, 0.0, 1.0)
    check_in_interval("alpha", cfg.alpha, 0.0, 1.0)
    check_int("probe_records", cfg.probe_records, 1)
    check_int("coordinates", cfg.coordinates, 1)
    check_int("seed", cfg.seed, 0)
    if not 1 <= cfg.batch_size <= cfg.examples:
        raise ConfigError(
            f"batch_size={cfg.batch_size!r} is not allowed: expected an expected batch size in "
            f"[1, examples={cfg.examples}]"
        )
    if (Path(cfg.out) / "results.json").exists():
        raise ConfigError(
            f"out={cfg.out!r} already holds results.json: choose another out= (nothing is "
            "overwritten)"
        )
    return cfg


def self_test_run(cfg: PropertiesConfig) -> PrivateTraining:
    """The self-test's model and data, made private as ``cfg`` says."""
    gen = torch.Generator().manual_seed(cfg.seed)
    d = cfg.width
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = nn.Linear(d, d)
    x = torch.randn(cfg.examples, d, generator=gen) / math.sqrt(d)
    y = torch.randint(0, d, (cfg.examples,), generator=gen)
    return make_private(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        torch.utils.data.TensorDataset(x, y),
        batch_size=cfg.batch_size,
        max_grad_norm=cfg.max_grad_norm,
        steps=cfg.steps,
        target_epsilon=None if cfg.noise_multiplier else cfg.epsilon,
        noise_multiplier=cfg.noise_multiplier or None,
        target_delta=cfg.delta,
        accountant=cfg.accountant,
        seed=cfg.seed,
    )


def run_properties_audit(cfg: PropertiesConfig, progress: bool = True) -> PropertyReport:
    """Build the self-test run, check it, save ``results.json`` / ``table.md``; the report."""
    out = Path(cfg.out)
    private = self_test_run(cfg)
    try:
        report = check_properties(
            private,
            steps=cfg.steps,
            alpha=cfg.alpha,
            probe_records=cfg.probe_records,
            max_coordinates=cfg.coordinates,
            seed=cfg.seed,
            restore=False,
            progress=progress,
        )
    finally:
        private.engine.detach()
    report.setting = "self-test: " + report.setting
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    results: dict[str, Any] = report.to_dict()
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(f"Setting: {report.setting}.\n\n{report.table()}\n")
    return report
