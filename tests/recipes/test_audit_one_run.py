"""``dptrain audit one-run``: the white-box self-test and the audit of your own scores."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dptrain.cli import main
from dptrain.config import ConfigError
from dptrain.recipes.audit_one_run import load_one_run_config

SMALL = ["width=100", "steps=3", "examples=16"]


def test_whitebox_self_test_passes_and_writes_its_report(tmp_path, capsys):
    assert main(["audit", "one-run", *SMALL, f"out={tmp_path}", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert not results["flagged"]
    assert [a["method"] for a in results["audits"]] == ["steinke2023", "mahloujifar2025-gdp"]
    assert all(a["epsilon"] <= results["claimed_epsilon"] for a in results["audits"])
    assert results["audits"][0]["m"] == 100 * 100
    assert (tmp_path / "table.md").read_text().startswith("Setting: white-box")
    assert json.loads((tmp_path / "results.json").read_text()) == results


def test_poisson_sampled_run_uses_the_general_analysis_only(tmp_path, capsys):
    argv = ["audit", "one-run", *SMALL, "batch_size=4", "canaries=1000", f"out={tmp_path}"]
    assert main([*argv, "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert [a["method"] for a in results["audits"]] == ["steinke2023"]


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


def test_blackbox_self_test_runs(tmp_path, capsys):
    argv = ["audit", "one-run", "mode=blackbox", "width=32", "classes=64", "canaries=400"]
    assert main([*argv, "steps=3", f"out={tmp_path}", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results["setting"].startswith("black-box") and results["audits"][0]["m"] == 400


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("mode=grey", "mode='grey' is not allowed"),
        ("batch_size=abc", "batch_size='abc' is not allowed"),
        ("canaries=20000", "canaries=20000 is not allowed"),
        ("confidence=1.5", "confidence"),
        ("scores=x.csv", "scores= needs claimed_epsilon="),
        ("epsilon=-1", "epsilon"),
    ],
)
def test_bad_input_is_named(override, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        load_one_run_config(None, [*SMALL, override])


def test_missing_scores_file_is_named(tmp_path, capsys):
    argv = ["audit", "one-run", f"scores={tmp_path}/none.csv", "claimed_epsilon=1"]
    assert main([*argv, f"out={tmp_path}"]) == 2
    assert "no such file" in capsys.readouterr().err
