"""The one-run audits' table for docs/audit.md: correct runs, broken mechanisms.

Setting (tests/audit/test_gradient_canaries.py): full-batch DP-GD (q = 1) of a d x d
linear softmax classifier on 64 random examples, 10 steps, C = 1, delta = 1e-5, one Dirac
canary per weight, 95% confidence. The broken mechanisms are the test-only faults of
tests/audit/faults.py (never reachable from dptrain's API).

    PYTHONPATH=src:. python benchmarks/audit_reach.py --out runs/audit-reach
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tests.audit import faults
from tests.audit.test_gradient_canaries import DELTA, GDP, audited_run

from dptrain.audit import one_run_audit
from dptrain.recipes.audit_one_run import OneRunAuditConfig, blackbox_run

CASES = [
    # (label, target epsilon, fault, canary norm, d)
    ("correct", 1.0, None, None, 1000),
    ("correct", 3.0, None, None, 1000),
    ("correct", 8.0, None, None, 1000),
    ("correct, canaries of norm 10 C", 8.0, None, 10.0, 1000),
    ("noise / 1.5", 8.0, lambda: faults.noise_divided_by(1.5), None, 1000),
    ("noise / 2", 8.0, lambda: faults.noise_divided_by(2.0), None, 1000),
    ("noise / 4", 8.0, lambda: faults.noise_divided_by(4.0), None, 1000),
    ("clipping off (canaries of norm 10 C)", 8.0, faults.clipping_off, 10.0, 1000),
    ("ledger records half the steps", 8.0, faults.ledger_records_half, None, 1000),
    ("ledger records half the steps", 8.0, faults.ledger_records_half, None, 2000),
    ("correct", 8.0, None, None, 2000),
]


#: The black-box setting (tests/audit/test_blackbox.py): (label, target epsilon, fault).
BLACKBOX = [
    ("black-box: correct", 1.0, None),
    ("black-box: correct", 3.0, None),
    ("black-box: correct", 8.0, None),
    ("black-box: noise / 2", 8.0, lambda: faults.noise_divided_by(2.0)),
    ("black-box: noise / 4", 8.0, lambda: faults.noise_divided_by(4.0)),
    ("black-box: rows mixed (tokens read as examples)", 8.0, faults.rows_mixed),
]


def _blackbox_row(label: str, eps: float, fault) -> dict:
    cfg = OneRunAuditConfig(mode="blackbox", epsilon=eps, delta=DELTA)
    start = time.perf_counter()
    with fault() if fault else contextlib.nullcontext():
        claimed, scores, included = blackbox_run(cfg, progress=False)
    run_s = time.perf_counter() - start
    start = time.perf_counter()
    steinke = one_run_audit(scores, included, DELTA, 0.95)
    gdp = one_run_audit(scores, included, DELTA, 0.95, method=GDP)
    return {
        "case": label,
        "target_epsilon": eps,
        "canaries": len(scores),
        "claimed_epsilon": claimed,
        "steinke_epsilon": steinke.epsilon,
        "gdp_mu": gdp.mu,
        "gdp_epsilon": gdp.epsilon,
        "flagged": gdp.epsilon > claimed or steinke.epsilon > claimed,
        "separation": None,
        "train_s": run_s,
        "audit_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/audit-reach")
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for label, eps, fault, norm, d in CASES:
        start = time.perf_counter()
        claimed, canaries = audited_run(eps, fault=fault, canary_norm=norm, d=d)
        run_s = time.perf_counter() - start
        start = time.perf_counter()
        steinke = canaries.audit(DELTA)
        gdp = canaries.audit(DELTA, method=GDP)
        audit_s = time.perf_counter() - start
        row = {
            "case": label,
            "target_epsilon": eps,
            "canaries": canaries.m,
            "claimed_epsilon": claimed,
            "steinke_epsilon": steinke.epsilon,
            "gdp_mu": gdp.mu,
            "gdp_epsilon": gdp.epsilon,
            "flagged": gdp.epsilon > claimed or steinke.epsilon > claimed,
            "separation": canaries.separation(),
            "train_s": run_s,
            "audit_s": audit_s,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    for label, eps, fault in BLACKBOX:
        rows.append(_blackbox_row(label, eps, fault))
        print(json.dumps(rows[-1]), flush=True)
    (out / "table.json").write_text(json.dumps(rows, indent=1))
    lines = [
        "| case | canaries | claimed epsilon | Steinke et al. lower bound | GDP mu lower bound "
        "| GDP epsilon lower bound | flagged | train s | audit s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['canaries']:,} | {r['claimed_epsilon']:.2f} | "
            f"{r['steinke_epsilon']:.2f} | {r['gdp_mu']:.3f} | {r['gdp_epsilon']:.2f} | "
            f"{'**yes**' if r['flagged'] else 'no'} | {r['train_s']:.1f} | {r['audit_s']:.1f} |"
        )
    (out / "table.md").write_text("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(8, 6.5))
    names = [f"{r['case']}\n(eps {r['target_epsilon']:g}, m {r['canaries']:.0e})" for r in rows]
    y = range(len(rows))
    ax.barh([i + 0.2 for i in y], [r["claimed_epsilon"] for r in rows], 0.4, label="claimed")
    ax.barh([i - 0.2 for i in y], [r["gdp_epsilon"] for r in rows], 0.4, label="GDP lower bound")
    ax.scatter(
        [r["steinke_epsilon"] for r in rows],
        y,
        color="k",
        marker="|",
        s=200,
        label="Steinke et al. lower bound",
        zorder=3,
    )
    ax.set_yticks(list(y), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("epsilon at delta = 1e-5")
    ax.set_title("One-run audits: a lower bound above the claim proves a bug")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "audit_reach.png", dpi=120)
    print((out / "table.md").read_text())


if __name__ == "__main__":
    main()
