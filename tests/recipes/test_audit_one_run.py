"""``dptrain audit one-run``: the self-test (white-box and black-box runs), the audit of your
own scores, and the exit codes: 0 nothing flagged, 1 flagged, 2 could not run or no claim."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dptrain.cli import main
from dptrain.config import ConfigError
from dptrain.recipes import audit_one_run
from dptrain.recipes.audit_one_run import load_one_run_config
from tests.audit import faults

SMALL = ["width=100", "steps=3", "examples=16"]
SMALL_SELFTEST = [*SMALL, "classes=64", "canaries=2000"]


def test_selftest_passes_and_writes_its_report(tmp_path, capsys):
    assert main(["audit", "one-run", *SMALL_SELFTEST, f"out={tmp_path}", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["status"] == "not flagged" and not results["flagged"]
    runs = [(a["run"], a["score"], a["method"]) for a in results["audits"]]
    gdp = "mahloujifar2025-gdp"
    assert runs == [
        ("white-box", score, method)
        for score in ("sum", "per-step", "per-tensor")
        for method in ("steinke2023", gdp)
    ] + [("black-box", "loss", "steinke2023"), ("black-box", "loss", gdp)]
    assert all(a["tests"] == 8 and a["epsilon"] <= a["claimed_epsilon"] for a in results["audits"])
    assert "Bonferroni over 8 tests" in results["correction"]
    assert results["audits"][0]["m"] == 2000
    table = (tmp_path / "table.md").read_text()
    assert table.startswith("Setting: white-box") and "exit code 0" in table
    assert json.loads((tmp_path / "results.json").read_text()) == results


def test_poisson_sampled_run_uses_the_general_analysis_only(tmp_path, capsys):
    argv = ["audit", "one-run", "mode=whitebox", *SMALL, "batch_size=4", "canaries=1000"]
    assert main([*argv, f"out={tmp_path}", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert {a["method"] for a in results["audits"]} == {"steinke2023"}
    # 1000 canaries at delta 1e-5 certify at most ~2.7 by Steinke et al.: the claim of 8
    # cannot be flagged, and the table says so
    assert results["ceilings"]["white-box"] < results["claimed_epsilon"]
    assert "could not have been flagged" in (tmp_path / "table.md").read_text()


def test_a_broken_mechanism_exits_1(tmp_path, capsys):
    # 4 steps: the noise of every pair of steps cancels in the signed scores
    argv = ["audit", "one-run", "mode=whitebox", *SMALL, "steps=4", "epsilon=4", f"out={tmp_path}"]
    with faults.same_noise_each_step():
        assert main(argv) == 1
    assert "FLAGGED" in capsys.readouterr().out


def test_your_own_scores_are_audited_and_a_leak_is_flagged(tmp_path, capsys):
    rng = np.random.default_rng(0)
    included = rng.random(2000) < 0.5
    scores = included * 10.0 + rng.normal(size=2000)  # the canaries are plain to see
    lines = [
        json.dumps({"score": float(s), "included": bool(i)})
        for s, i in zip(scores, included, strict=True)
    ]
    (tmp_path / "scores.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["audit", "one-run", f"scores={tmp_path / 'scores.jsonl'}", "claimed_epsilon=1"]
    assert main([*argv, f"out={tmp_path / 'out'}"]) == 1  # exit 1: flagged
    assert "FLAGGED" in capsys.readouterr().out


def test_a_run_without_a_claim_says_so_and_exits_2(tmp_path, capsys):
    argv = ["audit", "one-run", "mode=whitebox", *SMALL, "noise_multiplier=0.05"]
    assert main([*argv, f"out={tmp_path}"]) == 2
    out = capsys.readouterr()
    assert "NO CLAIM" in out.out and "makes no privacy claim" in out.err
    assert json.loads((tmp_path / "results.json").read_text())["status"] == "no claim"


def test_a_crash_exits_2_not_1(tmp_path, capsys, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(audit_one_run, "whitebox_run", broken)
    assert main(["audit", "one-run", "mode=whitebox", *SMALL, f"out={tmp_path}"]) == 2
    assert "could not run (RuntimeError: out of memory)" in capsys.readouterr().err


def test_blackbox_self_test_runs(tmp_path, capsys):
    argv = ["audit", "one-run", "mode=blackbox", "width=32", "classes=64", "canaries=400"]
    assert main([*argv, "steps=3", f"out={tmp_path}", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["setting"].startswith("black-box") and results["audits"][0]["m"] == 400
    assert "C = 4" in results["setting"]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("mode=grey", "mode='grey' is not allowed"),
        ("batch_size=abc", "batch_size='abc' is not allowed"),
        ("canaries=20000", "canaries=20000 is not allowed"),
        ("confidence=1.5", "confidence"),
        ("scores=x.csv", "scores= needs claimed_epsilon="),
        ("epsilon=-1", "epsilon"),
        ("max_grad_norm=0", "max_grad_norm"),
        ("canary_norm=-1", "canary_norm"),
        ("tensors=101", "tensors=101 is not allowed"),
    ],
)
def test_bad_input_is_named(override, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        load_one_run_config(None, [*SMALL, override])


def test_bad_input_exits_2(tmp_path, capsys):
    assert main(["audit", "one-run", "max_grad_norm=-1", f"out={tmp_path}"]) == 2
    assert "max_grad_norm" in capsys.readouterr().err


def test_missing_scores_file_is_named(tmp_path, capsys):
    argv = ["audit", "one-run", f"scores={tmp_path}/none.csv", "claimed_epsilon=1"]
    assert main([*argv, f"out={tmp_path}"]) == 2
    assert "no such file" in capsys.readouterr().err
