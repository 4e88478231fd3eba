"""The black-box one-run audit (canary inputs scored by loss) sees the whole pipeline: it
catches the engine reading rows that are not examples, which white-box canaries bypass.

Setting (docs/audit.md): full-batch DP-GD of a zero-initialised bag-of-4-tokens linear
classifier (512 -> 1024), 64 records + 10,000 canaries each included with probability
1/2, 10 steps, delta = 1e-5, 95% confidence, Gaussian f-DP analysis.
"""

from __future__ import annotations

import contextlib

import pytest

from dptrain.audit import one_run_audit
from dptrain.recipes.audit_one_run import OneRunAuditConfig, blackbox_run
from tests.audit.faults import noise_divided_by, rows_mixed

DELTA = 1e-5
GDP = "mahloujifar2025-gdp"


def audit(epsilon, fault=None, **kw):
    cfg = OneRunAuditConfig(mode="blackbox", epsilon=epsilon, delta=DELTA, **kw)
    with fault() if fault else contextlib.nullcontext():
        claimed, scores, included = blackbox_run(cfg, progress=False)
    return claimed, one_run_audit(scores, included, DELTA, 0.95, method=GDP)


@pytest.mark.parametrize("epsilon", [1.0, 8.0])
def test_a_correct_run_is_not_flagged(epsilon):
    claimed, result = audit(epsilon)
    assert result.epsilon <= claimed
    if epsilon == 8.0:
        assert result.epsilon >= claimed / 2  # the black-box audit has power too


@pytest.mark.parametrize(
    ("name", "fault"),
    [("rows mixed", rows_mixed), ("noise divided by 4", lambda: noise_divided_by(4.0))],
)
def test_a_broken_pipeline_is_flagged(name, fault):
    claimed, result = audit(8.0, fault)
    assert result.epsilon > claimed, name
