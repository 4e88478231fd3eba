"""The three masked-LM studies end to end on a tiny synthetic corpus (seconds each)."""

from __future__ import annotations

import json

import pytest

from dptrain.config import ConfigError
from dptrain.recipes import configs_dir
from dptrain.recipes.mlm_studies import STUDIES, load_mlm_study_config, run_mlm_study
from tests.recipes.test_mlm import TINY, _corpus


def _overrides(tmp_path, **kw):
    values = {
        **{k: v for k, v in TINY.items() if k not in ("steps", "warmup_steps", "batch_size")},
        "data": str(_corpus(tmp_path / "corpus.csv")),
        "out": str(tmp_path / "studies"),
        "epsilon": 1.0,  # a larger sigma: the exact PLD of results.json is faster
        "eval_every": 2,
        "snr_batch_sizes": [8, 32],
        "snr_steps": 3,
        "snr_warmup_steps": 1,
        "schedule_batch_size": 32,
        "schedule_growth": 2.0,
        "schedule_steps": 4,
        "schedule_warmup_steps": 2,
        "wd_values": [0.0, 10.0],
        "wd_batch_size": 16,
        "wd_steps": 3,
        "wd_warmup_steps": 1,
        **kw,
    }
    return [f"{k}={json.dumps(v)}" for k, v in values.items()]


# The three studies share the grid, the table and the plot; in the default run one of
# them (weight-decay, the quickest) goes end to end, the others (8-15 s each) with -m slow.
@pytest.mark.parametrize(
    "name",
    [n if n == "weight-decay" else pytest.param(n, marks=pytest.mark.slow) for n in STUDIES],
)
def test_study_writes_table_summary_and_plot(tmp_path, name):
    cfg = load_mlm_study_config(None, _overrides(tmp_path))
    summary = run_mlm_study(name, cfg, command=f"test {name}")
    out = tmp_path / "studies" / name
    assert summary["out"] == str(out)  # each study its own folder: one YAML serves all three
    assert (out / "table.md").is_file() and (out / "summary.json").is_file()
    assert (out / f"{name.replace('-', '_')}.png").is_file()
    table = (out / "table.md").read_text()
    runs = summary["runs"]
    for r in runs:
        assert r["label"] in table
        assert len(r["history"]) == r["steps"]
    # one tokenization for the whole grid: the cache holds one entry
    assert len(list((tmp_path / "studies" / "cache").glob("mlm-*"))) == 1
    if name == "snr":
        assert [r["schedule"] for r in runs] == [
            [{"batch": b, "steps": 3, "sample_rate": b / r["n_train_chunks"]}] for b in (8, 32)
        ]
        # same epsilon and steps: the larger batch runs at the larger sigma
        assert runs[1]["noise_multiplier"] > runs[0]["noise_multiplier"]
    elif name == "batch-schedule":
        assert [r["label"] for r in runs] == ["fixed B=32", "growing B=16->32", "fixed B=16"]
        assert [(s["batch"], s["steps"]) for s in runs[1]["schedule"]] == [
            (16, 1),
            (24, 1),
            (32, 2),
        ]
        target = summary["target_accuracy"]
        assert target == pytest.approx(0.95 * runs[0]["valid_accuracy"])
        for r in runs:  # examples to target: the counter at the first evaluation past the target
            hits = [h for h in r["history"] if h.get("valid_accuracy", -1) >= target]
            want = hits[0]["examples_processed"] if hits else None
            assert r["examples_to_target"] == want
        assert runs[0]["examples_to_target"] is not None  # the reference reaches its own target
        losses = [h["valid_loss"] for h in runs[0]["history"] if "valid_loss" in h]
        assert summary["target_loss"] == pytest.approx(1.05 * min(losses))
        for r in runs:  # the same on validation loss: the first evaluation at or below it
            hits = [h for h in r["history"] if h.get("valid_loss", 1e9) <= summary["target_loss"]]
            assert r["examples_to_target_loss"] == (hits[0]["examples_processed"] if hits else None)
        assert runs[0]["examples_to_target_loss"] is not None
    else:
        assert [r["label"] for r in runs] == ["wd=0", "wd=10", "non-private, wd=0"]
        assert runs[2]["private"] is False
        assert runs[1]["final_param_norm"] < runs[0]["final_param_norm"]


def test_study_config_and_bad_input(tmp_path):
    cfg = load_mlm_study_config(configs_dir() / "mlm_studies.yaml")
    assert cfg.snr_batch_sizes == (128, 512, 2048) and cfg.train.epsilon == 5.0
    assert cfg.train.max_eval_examples == 1000
    with pytest.raises(ConfigError, match="unknown config key"):
        load_mlm_study_config(None, ["snr_batches=[1]"])
    with pytest.raises(ValueError, match="wd_values"):
        load_mlm_study_config(None, ["wd_values=[-1]"])
    with pytest.raises(ValueError, match="snr_warmup_steps"):
        load_mlm_study_config(None, ["snr_steps=2", "snr_warmup_steps=3"])
    with pytest.raises(ValueError, match="study='nope'"):
        run_mlm_study("nope", cfg)
    cfg = load_mlm_study_config(None, _overrides(tmp_path, snr_batch_sizes=[8, 100000]))
    with pytest.raises(ValueError, match="B=100000: expected batch 100000 exceeds"):
        run_mlm_study("snr", cfg)
