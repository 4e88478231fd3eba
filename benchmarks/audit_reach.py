"""The one-run self-test's table for docs/audit.md: correct runs and broken mechanisms.

Each row is one run of the default self-test's white-box or black-box part
(``dptrain audit one-run``'s settings: white-box full-batch DP-GD of a 1000 x 1000 linear
classifier in 4 tensors, 10 steps, C = 4, 10^6 canaries of norm 10 C; black-box
bag-of-4-tokens classifier, 20,000 canary inputs), audited as the self-test audits it:
every score x analysis with the Bonferroni correction of the self-test's family of 8
tests (6 white-box, 2 black-box), delta = 1e-5, 95% confidence. The broken mechanisms
are the test-only faults of tests/audit/faults.py (never reachable from dptrain's API).
Rows are written to ``OUT/rows.jsonl`` as they finish (a long run can be read early).

    PYTHONPATH=src:. python benchmarks/audit_reach.py --out runs/audit-reach [--only N,M]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path

from tests.audit import faults

from dptrain.audit import audit_scores
from dptrain.recipes.audit_one_run import blackbox_run, load_one_run_config, whitebox_run

TESTS = 8  # the self-test's family
DELTA = 1e-5

#: (label, part, target epsilon, fault name or None, extra overrides)
CASES = [
    ("correct", "white", 8.0, None, []),
    ("correct", "black", 8.0, None, []),
    ("same noise each step", "white", 8.0, "same noise each step", []),
    ("noise on half the tensors", "white", 8.0, "noise on half the tensors", []),
    ("clipping at 2C", "white", 8.0, "clipping at 2C", []),
    ("noise std without C", "white", 8.0, "noise std without C", []),
    ("clipping off", "white", 8.0, "clipping off", []),
    ("per-batch clipping", "white", 8.0, "per-batch clipping", []),
    ("per-batch clipping", "black", 8.0, "per-batch clipping", []),
    ("noise on even steps only (ours)", "white", 8.0, "noise on even steps only", []),
    ("noise on the mean (ours)", "white", 8.0, "noise on the mean", []),
    ("ledger told 2 sigma (ours)", "white", 8.0, "ledger told 2 sigma", []),
    ("each example twice (ours)", "white", 8.0, "each example twice", []),
    ("rows mixed (tokens read as examples)", "black", 8.0, "rows mixed", []),
    ("noise / 4", "white", 8.0, "noise/4", []),
    ("sampler at 4q", "black", 1.0, "sampler at 4q", ["batch_size=1024", "steps=20"]),
    ("correct (Poisson, for the sampler row)", "black", 1.0, None, ["batch_size=1024", "steps=20"]),
    ("correct", "white", 1.0, None, []),
    ("correct", "white", 3.0, None, []),
    ("correct", "black", 1.0, None, []),
    ("correct", "black", 3.0, None, []),
    *[
        (f"correct, seed {s}", part, e, None, [f"seed={s}"])
        for s in (1, 2)
        for e in (1.0, 3.0, 8.0)
        for part in ("white", "black")
    ],
]


def row(label: str, part: str, eps: float, fault: str | None, extra: list[str]) -> dict:
    mode = "whitebox" if part == "white" else "blackbox"
    cfg = load_one_run_config(None, [f"mode={mode}", f"epsilon={eps}", *extra])
    start = time.perf_counter()
    with faults.FAULTS[fault]() if fault else contextlib.nullcontext():
        if part == "white":
            claimed, canaries = whitebox_run(cfg, progress=False)
            scores = {k: v.numpy() for k, v in canaries.score_by_name.items()}
            included, methods = canaries.included.numpy(), canaries.methods()
        else:
            claimed, s, included = blackbox_run(cfg, progress=False)
            scores = {"loss": s}
            methods = ("steinke2023", "mahloujifar2025-gdp")
            if cfg.batch_size != "full":
                methods = ("steinke2023",)
    train_s = time.perf_counter() - start
    start = time.perf_counter()
    found = audit_scores(scores, included, DELTA, 0.95, methods=methods, tests=TESTS)
    return {
        "case": label,
        "run": f"{part}-box",
        "fault": fault,
        "settings": extra,
        "target_epsilon": eps,
        "canaries": len(included),
        "claimed_epsilon": claimed,
        "bounds": {f"{a.score}/{a.method}": a.epsilon for a in found},
        "flagged_by": [f"{a.score}/{a.method}" for a in found if a.epsilon > claimed],
        "train_s": train_s,
        "audit_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/audit-reach")
    parser.add_argument("--only", default="", help="comma-separated row numbers (from 0)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chosen = [int(i) for i in args.only.split(",")] if args.only else range(len(CASES))
    with (out / "rows.jsonl").open("a") as f:
        for i in chosen:
            r = row(*CASES[i])
            print(json.dumps(r), flush=True)
            f.write(json.dumps(r) + "\n")
            f.flush()


if __name__ == "__main__":
    main()
