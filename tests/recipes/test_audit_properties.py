"""``dptrain audit properties`` as a user meets it: the self-test's report and its exit codes
(0 nothing flagged, 1 flagged, 2 could not run)."""

from __future__ import annotations

import json

import pytest

from dptrain.cli import main
from tests.audit.property_faults import FAULTS

# sigma given: the checks, not the calibration, are under test (epsilon is the default's)
SMALL = ["width=24", "examples=300", "batch_size=30", "steps=12", "noise_multiplier=1.0"]


def test_the_self_test_passes_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["audit", "properties", *SMALL, f"out={out}", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert not results["flagged"] and results["complete"]
    assert results["steps"] == 12 and len(results["batch_sizes"]) == 12
    assert [c["status"] for c in results["checks"]] == ["pass"] * 6
    assert json.loads((out / "results.json").read_text()) == results
    table = (out / "table.md").read_text()
    assert table.startswith("Setting: self-test: 12 steps of Linear (600 trainable coordinates")
    assert "nothing flagged" in table


def test_the_human_report_is_the_table(tmp_path, capsys):
    assert main(["audit", "properties", *SMALL, f"out={tmp_path / 'run'}"]) == 0
    printed = capsys.readouterr().out
    assert "| batch sizes ~ Binomial(N, q) | pass |" in printed
    assert f"results: {tmp_path / 'run'}/results.json" in printed


@pytest.mark.parametrize(
    "name", ["same noise every step", "noise std without C", "fixed-size shuffled batches"]
)
def test_a_broken_mechanism_exits_1(name, tmp_path, capsys):
    fault, check = FAULTS[name]
    with fault():
        code = main(["audit", "properties", *SMALL, f"out={tmp_path / 'run'}", "--json"])
    assert code == 1
    results = json.loads(capsys.readouterr().out)
    assert results["flagged"]
    assert any(c["name"].startswith(check) and c["status"] == "FLAGGED" for c in results["checks"])


@pytest.mark.parametrize(
    ("arg", "message"),
    [
        ("batch_size=301", "batch_size=301 is not allowed"),
        ("steps=1", "steps=1"),
        ("alpha=1.5", "alpha=1.5"),
        ("max_grad_norm=0", "max_grad_norm=0"),
    ],
)
def test_bad_input_exits_2_naming_it(arg, message, tmp_path, capsys):
    assert main(["audit", "properties", *SMALL, arg, f"out={tmp_path / 'run'}"]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_an_earlier_report_is_not_overwritten(tmp_path, capsys):
    (tmp_path / "results.json").write_text("mine")
    assert main(["audit", "properties", *SMALL, f"out={tmp_path}"]) == 2
    assert "already holds results.json" in capsys.readouterr().err
    assert (tmp_path / "results.json").read_text() == "mine"


def test_a_crash_exits_2_not_1(tmp_path, capsys, monkeypatch):
    import dptrain.recipes.audit_properties as recipe

    def broken(*args, **kwargs):
        raise RuntimeError("engine exploded")

    monkeypatch.setattr(recipe, "check_properties", broken)
    assert main(["audit", "properties", *SMALL, f"out={tmp_path / 'run'}"]) == 2
    assert "could not run: RuntimeError: engine exploded" in capsys.readouterr().err
