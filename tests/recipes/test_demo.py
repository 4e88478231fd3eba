"""``dptrain demo`` end to end on the tiny BERT and 60-row CSV of the classify tests:
the runs it makes, the majority baseline, the table, the plot and bad settings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from dptrain.config import ConfigError
from dptrain.recipes.demo import DemoConfig, guarantee, load_demo_config, run_demo
from tests.recipes.test_classify import _bert_config, _rows, _save_tokenizer, _write_csv

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    (root / "enc").mkdir()
    _save_tokenizer(root / "enc")
    torch.manual_seed(0)
    transformers.BertModel(_bert_config()).save_pretrained(root / "enc")
    # 2:1 positive: the majority class is not a coin flip
    rows = _rows() + [(t, y) for t, y in _rows() if y == 1]
    return {
        "data": _write_csv(root / "reviews.csv", rows),
        "encoder": str(root / "enc"),
        "epochs": 2,
        "batch_size": 8,
    }


def test_demo_runs_the_probe_without_and_with_privacy(train, tmp_path, capsys):
    out = tmp_path / "demo"
    cfg = load_demo_config(
        None,
        [f"out={out}", "epsilons=[2,8]", "progress=false"] + [f"{k}={v}" for k, v in train.items()],
    )
    summary = run_demo(cfg, "dptrain demo test")
    runs = summary["runs"]
    assert [(r["method"], r["target_epsilon"]) for r in runs] == [
        ("nonprivate-head", None),
        ("dpsgd-head", 2.0),
        ("dpsgd-head", 8.0),
    ]
    for r in runs[1:]:
        assert 0 < r["epsilon"] <= r["target_epsilon"] * 1.01 and r["noise_multiplier"] > 0
    assert runs[0]["epsilon"] == math.inf and runs[0]["noise_multiplier"] == 0.0
    # every run saw the same representations: the encoder ran once
    assert len(list((out / "cache").iterdir())) == 1
    # the baseline: the training split's majority label, scored on the same test split
    test_labels = json.loads((out / "nonprivate" / "data.json").read_text())["label_counts"]["test"]
    assert summary["majority_class"]["label"] == "1"
    assert summary["majority_class"]["accuracy"] == pytest.approx(
        test_labels["1"] / sum(test_labels.values())
    )
    table = (out / "table.md").read_text()
    assert "| no training (always '1') |" in table and "| non-private probe |" in table
    for r in runs[1:]:
        assert (
            f"| DP probe, target epsilon {r['target_epsilon']:g} | {r['accuracy']:.3f} |" in table
        )
        assert guarantee(r) in table
    assert (out / "accuracy_vs_epsilon.png").stat().st_size > 10_000
    assert json.loads((out / "summary.json").read_text()) == summary
    for tag in ("nonprivate", "eps2", "eps8"):
        assert (out / tag / "results.json").is_file() and (out / tag / "ledger.json").is_file()


def test_guarantee_names_epsilon_delta_and_the_unit():
    text = guarantee(
        {
            "epsilon": 2.99,
            "delta": 1e-5,
            "n_train": 10246,
            "steps": 120,
            "noise_multiplier": 0.793,
            "max_norm": 0.1,
        }
    )
    assert text.startswith("(2.99, 1e-05)-DP for each review of the 10,246 training reviews")
    assert "120 steps" in text and "noise multiplier 0.793" in text and "C = 0.1" in text


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["method=dpsgd"], ConfigError, r"unknown config key\(s\) \['method'\]"),
        (["epsilon=3"], ConfigError, r"unknown config key\(s\) \['epsilon'\]"),
        (["epsilons=[]"], ValueError, r"^epsilons=\[\] is not allowed"),
        (["epsilons=[3, -1]"], ValueError, r"^epsilons=\[3\.0, -1\.0\] is not allowed"),
        (["head_lr=-1"], ValueError, r"^head_lr=-1(\.0)? is not allowed"),
    ],
)
def test_bad_settings_are_refused_before_anything_runs(tmp_path, overrides, error, message):
    with pytest.raises(error, match=message):
        load_demo_config(None, [f"out={tmp_path / 'demo'}", *overrides])
    assert not (tmp_path / "demo").exists()


def test_per_run_keys_cannot_be_shared():
    with pytest.raises(ConfigError, match=r"\['feature_cache'\] are set by the demo"):
        DemoConfig(train={"feature_cache": "x"})


def test_cli_prints_the_table_and_the_guarantee(train, tmp_path, capsys):
    from dptrain.cli import main

    out = tmp_path / "demo"
    shared = [f"{k}={v}" for k, v in train.items()]
    assert main(["demo", "--out", str(out), "epsilons=[8]", "progress=false", *shared]) == 0
    printed = capsys.readouterr().out
    assert (out / "table.md").read_text() in printed
    assert "The epsilon-8 model's guarantee: (" in printed
    assert main(["demo", "--out", str(tmp_path / "bad"), "method=dpsgd"]) == 2
    assert "unknown config key(s) ['method']" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_a_second_demo_never_writes_over_the_first(train, tmp_path, capsys, monkeypatch):
    from dptrain.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["demo", "epsilons=[8]", "progress=false", *[f"{k}={v}" for k, v in train.items()]]
    assert main(args) == 0
    first = tmp_path / "runs" / "demo"
    table = (first / "table.md").read_text()
    ledger = first / "eps8" / "ledger.json"
    before = ledger.read_bytes()
    capsys.readouterr()
    # the default folder holds a run: the second run gets a fresh one, announced
    assert main(args) == 0
    out, err = capsys.readouterr()
    (second,) = (p for p in (tmp_path / "runs").iterdir() if p.name.startswith("demo-"))
    assert f"this run writes to {Path('runs') / second.name}" in err
    assert (second / "table.md").read_text() in out and (second / "eps8" / "ledger.json").is_file()
    assert (first / "table.md").read_text() == table and ledger.read_bytes() == before
    # a folder named with --out is the user's choice: refused while it holds a run
    assert main(["demo", "--out", str(first), *args[1:]]) == 2
    assert "is not allowed: the folder exists" in capsys.readouterr().err
    assert main(["demo", "--out", str(first), "overwrite=true", *args[1:]]) == 0
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["demo", second.name]
