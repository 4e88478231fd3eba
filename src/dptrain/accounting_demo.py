"""The accounting demo (``make demo`` / ``dptrain demo``).

What a user of the papers asks first, computed on the settings the papers use:

1. DP-SGD at q = 256/60,000: epsilon after each epoch under PLD, RDP and the
   GDP CLT, and the noise each accountant calibrates for epsilon = 3.
2. DP-FP in the paper's own SST-2 setting: the GDP-CLT calibration gives
   epsilon 1.73, PLD and RDP of the same 202,016 steps say otherwise.
3. An increasing batch-size schedule (Anil et al.) calibrated as one ledger.
4. The cost of a 10-trial hyperparameter search.

Writes ``accounting_demo.png`` (epsilon vs epochs; sigma vs target epsilon)
and ``accounting_demo.json`` into the output folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm import tqdm

from dptrain._table import format_table
from dptrain.accounting import (
    ACCOUNTANTS,
    PrivacyLedger,
    calibrate_dpfp,
    calibrate_noise,
    composition_of_ledger,
    epsilon_of_schedule,
    make_accountant,
    repeat_and_select,
    sample_rate_from_batch,
    steps_from_epochs,
)

__all__ = ["run_demo"]

DELTA = 1e-5
N_TRAIN, BATCH, SIGMA = 60_000, 256, 1.1


def _quiet(*_: object, **__: object) -> None:
    """``print`` when the tables are not wanted (``--json``)."""


def run_demo(out_dir: str | Path = "runs/demo", *, show: bool = True) -> dict[str, object]:
    """Print the demo tables (``show``), save the plot and JSON under ``out_dir``; return
    the figures (with the privacy unit and delta every figure is for)."""
    say = print if show else _quiet
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    q = sample_rate_from_batch(BATCH, N_TRAIN)
    unit = PrivacyLedger()
    # the keys `dptrain epsilon --json` uses for the same quantities
    report: dict[str, object] = {
        "delta": DELTA,
        "privacy_unit": unit.privacy_unit,
        "neighbouring": unit.neighbouring,
    }

    # 1. epsilon vs epochs at a fixed sigma.
    epochs = [1, 2, 5, 10, 20, 30, 50]
    curve = {name: [] for name in ACCOUNTANTS}
    for e in tqdm(epochs, desc="epsilon vs epochs", unit="point"):
        steps = steps_from_epochs(e, q)
        ledger = PrivacyLedger.from_schedule([(q, steps)], SIGMA)
        for name in ACCOUNTANTS:
            curve[name].append(make_accountant(name, ledger).epsilon(DELTA))
    say(f"\n1. DP-SGD, q = {BATCH}/{N_TRAIN}, sigma = {SIGMA}, delta = {DELTA:g}")
    say(
        format_table(
            ["epochs", "pld", "rdp", "gdp (approx.)"],
            [[e, *(curve[n][i] for n in ACCOUNTANTS)] for i, e in enumerate(epochs)],
        )
    )
    report["epsilon_vs_epochs"] = {"epochs": epochs, **curve}

    # Calibrated sigma vs target epsilon, 30 epochs.
    targets = [1.0, 2.0, 3.0, 5.0, 8.0]
    steps30 = steps_from_epochs(30, q)
    sigmas = {name: [] for name in ACCOUNTANTS}
    for t in tqdm(targets, desc="calibrating sigma", unit="target"):
        for name in ACCOUNTANTS:
            sigmas[name].append(
                calibrate_noise(
                    t, DELTA, sample_rate=q, steps=steps30, accountant=name
                ).noise_multiplier
            )
    say(f"\n   sigma for a target epsilon, 30 epochs ({steps30} steps)")
    say(
        format_table(
            ["target eps", "pld", "rdp", "gdp (approx.)", "pld eps of gdp sigma"],
            [
                [
                    t,
                    *(sigmas[n][i] for n in ACCOUNTANTS),
                    epsilon_of_schedule(sigmas["gdp"][i], DELTA, [(q, steps30)]),
                ]
                for i, t in enumerate(targets)
            ],
        )
    )
    report["sigma_vs_target"] = {"targets": targets, **sigmas}

    # 2. DP-FP, the paper's SST-2 setting.
    n_sst2, b, m = 67_349, 32, 32
    t_steps = steps_from_epochs(3, b / n_sst2)
    rows = []
    for name in ("gdp", "pld"):
        cal = calibrate_dpfp(
            1.73,
            1 / (2 * n_sst2),
            sample_rate=b / (m * n_sst2),
            steps=t_steps,
            micro_batches=m,
            clip=1.0,
            accountant=name,
        )
        rows.append(
            [
                name + (" (paper)" if name == "gdp" else ""),
                cal.noise_multiplier,
                cal.epsilons["gdp"],
                cal.epsilons["pld"],
                cal.epsilons["rdp"],
            ]
        )
    say(f"\n2. DP-FP, SST-2 (N={n_sst2}, B={b}, M={m}, 3 epochs, delta=1/(2N)), target 1.73")
    say(format_table(["calibrated by", "sigma/C", "gdp eps", "pld eps", "rdp eps"], rows))
    report["dpfp_sst2"] = rows

    # 3. Growing batch size: 4 stages quadrupling the batch, one sigma.
    schedule = [(q * k, 500) for k in (1, 2, 4, 8)]
    cal = calibrate_noise(3.0, DELTA, schedule=schedule)
    say("\n3. Growing batch (q x1, x2, x4, x8; 500 steps each), target epsilon 3")
    say(f"   sigma = {cal.noise_multiplier:.4f} (PLD epsilon {cal.epsilon:.4f})")
    report["growing_batch_sigma"] = cal.noise_multiplier

    # 4. Hyperparameter search: 10 trials of the 30-epoch run at epsilon 3.
    trial = PrivacyLedger.from_schedule([(q, steps30)], sigmas["pld"][targets.index(3.0)])
    costs = [
        composition_of_ledger(trial, 10, DELTA),
        repeat_and_select(trial, 10, DELTA, "poisson"),
        repeat_and_select(trial, 10, DELTA, "logarithmic"),
    ]
    say("\n4. Search over 10 settings, each trial epsilon 3 (PLD)")
    say(
        format_table(
            ["method", "epsilon", "delta"], [[c.method, c.epsilon, c.delta] for c in costs]
        )
    )
    report["search_cost"] = {c.method: c.epsilon for c in costs}

    _plot(out / "accounting_demo.png", epochs, curve, targets, sigmas, rows[0])
    (out / "accounting_demo.json").write_text(json.dumps(report, indent=2))
    say(f"\nwrote {out / 'accounting_demo.png'} and {out / 'accounting_demo.json'}")
    return report


def _plot(path: Path, epochs, curve, targets, sigmas, dpfp_paper_row) -> None:
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.4))
    styles = {"pld": "-o", "rdp": "-s", "gdp": "--^"}
    labels = {"pld": "PLD", "rdp": "RDP", "gdp": "GDP CLT (approximate)"}
    for name in ACCOUNTANTS:
        ax1.plot(epochs, curve[name], styles[name], label=labels[name])
        ax2.plot(targets, sigmas[name], styles[name], label=labels[name])
    ax1.set(
        xlabel="epochs",
        ylabel=f"epsilon (delta = {DELTA:g})",
        title=f"DP-SGD, q = {BATCH}/{N_TRAIN}, sigma = {SIGMA}",
    )
    ax2.set(
        xlabel="target epsilon",
        ylabel="calibrated noise multiplier sigma",
        title="Noise for a target, 30 epochs",
    )
    # DP-FP: the paper's GDP-calibrated sigma, counted by each accountant.
    _, sigma_c, eps_gdp, eps_pld, eps_rdp = dpfp_paper_row
    bars = ax3.bar(
        ["GDP CLT\n(paper's claim)", "PLD", "RDP"],
        [eps_gdp, eps_pld, eps_rdp],
        color=["tab:green", "tab:blue", "tab:orange"],
    )
    ax3.bar_label(bars, fmt="%.2f")
    ax3.set(
        ylabel="epsilon of the same 202,016 steps",
        title=f"DP-FP on SST-2, paper's sigma/C = {sigma_c:.3f}",
    )
    ax3.grid(alpha=0.3, axis="y")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
