"""The seqrec recipe end to end on a small hand-made interaction file (seconds), and bad input."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from dptrain.accounting import PLDAccountant, PrivacyLedger
from dptrain.config import load_config
from dptrain.privacy_record import read as read_record
from dptrain.recipes.seqrec import SeqRecTrainConfig, resolve_delta, train_seqrec


def _interactions(path, n_users=40, n_items=12, per_user=8, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    for u in range(n_users):
        items = rng.choice(n_items, size=per_user, replace=False)
        rows += [(f"u{u}", int(i) + 100, 1_000 + t) for t, i in enumerate(items)]
    pd.DataFrame(rows, columns=["user_id", "item_id", "timestamp"]).to_csv(path, index=False)
    return path


def _cfg(tmp_path, **kw):
    base = {
        "data": str(_interactions(tmp_path / "inter.csv")),
        "max_len": 6,
        "epochs": 2,
        "batch_size": 16,
        "d_model": 8,
        "progress": False,
        "out": str(tmp_path / "run"),
    }
    base.update(kw)
    return SeqRecTrainConfig(**base)


@pytest.mark.parametrize("model", ["dpformer", "transformer", "transformer-untied", "gru", "lstm"])
def test_private_run_writes_the_run_folder(tmp_path, model, capsys):
    cfg = _cfg(tmp_path, model=model, epsilon=8.0)
    results = train_seqrec(cfg)
    plan = capsys.readouterr().err  # printed before the first step
    assert "private plan" in plan and f"{results['noise_multiplier']:.4g}" in plan
    out = tmp_path / "run"
    for name in ("config.yaml", "data.json", "ledger.json", "metrics.jsonl", "results.json"):
        assert (out / name).is_file(), name
    for name in (
        "checkpoints/best.pt",
        "checkpoints/last.pt",
        "plots/valid_ndcg.png",
        "plots/epsilon.png",
    ):
        assert (out / name).is_file(), name
    saved = json.loads((out / "results.json").read_text())
    for key in ("ndcg@10", "hit@10", "mrr", "epsilon", "delta", "model"):
        assert key in saved
    assert saved["model"] == model and results["model"] == model
    assert "audit" not in saved  # audit=false (the default)
    assert 0.0 <= saved["ndcg@10"] <= saved["hit@10"] <= 1.0
    assert saved["delta"] == pytest.approx(1 / 40**1.1)
    # The ledger on disk is the whole run: its epsilon is the one reported, within the target.
    ledger = PrivacyLedger.from_json((out / "ledger.json").read_text())
    assert PLDAccountant(ledger).epsilon(saved["delta"]) == pytest.approx(saved["epsilon"])
    assert saved["epsilon"] <= 8.0
    # the privacy record beside the checkpoints: the same guarantee and the whole ledger
    record = read_record(out)
    assert record.private and record.producer == "dptrain train seqrec"
    assert (record.epsilon, record.delta) == (saved["epsilon"], saved["delta"])
    assert record.ledger == ledger.state_dict()
    training_steps = sum(s.count for s in ledger.segments if s.sample_rate < 1.0)
    assert training_steps == saved["steps"]
    has_histogram = any(s.sample_rate == 1.0 for s in ledger.segments)
    assert has_histogram == (model == "dpformer")  # frequencies=dp by default
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["epoch"] for x in lines] == [1, 2]
    assert lines[-1]["epsilon"] == pytest.approx(saved["epsilon"])
    # the resolved config reloads to the same settings
    assert load_config(SeqRecTrainConfig, out / "config.yaml") == cfg


def test_audit_section_in_results(tmp_path):
    cfg = _cfg(tmp_path, model="dpformer", audit=True, audit_canaries=1000)
    results = train_seqrec(cfg)
    audit = results["audit"]
    assert audit["canaries"] == 1000 and audit["steps_observed"] == results["steps"]
    # Poisson steps (and the histogram) in the ledger: Steinke et al.'s bound only
    assert set(audit["lower_bounds"]) == {"steinke2023"}
    assert not audit["flagged"] and audit["claimed_epsilon"] == results["epsilon"]
    assert json.loads((tmp_path / "run" / "results.json").read_text())["audit"] == audit


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"epsilon": None}, r"audit=true is not allowed with a non-private run \(epsilon=null\)"),
        ({"model": "most-popular"}, "audit=true is not allowed with model='most-popular'"),
        ({"audit_canaries": 1}, "audit_canaries=1 is not allowed"),
    ],
)
def test_audit_bad_config(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _cfg(tmp_path, audit=True, **kwargs)


def test_nonprivate_and_most_popular(tmp_path):
    r = train_seqrec(_cfg(tmp_path, model="transformer", epsilon=None))
    assert r["epsilon"] == float("inf") and r["delta"] == 0.0
    mp = train_seqrec(_cfg(tmp_path, model="most-popular", epsilon=1.0, out=str(tmp_path / "mp")))
    assert mp["epsilon"] <= 1.0 and mp["steps"] == 0
    ledger = PrivacyLedger.from_json((tmp_path / "mp" / "ledger.json").read_text())
    assert [(s.sample_rate, s.count) for s in ledger.segments] == [(1.0, 1)]


def test_train_frequencies_are_labelled_outside_the_guarantee(tmp_path):
    r = train_seqrec(_cfg(tmp_path, model="dpformer", frequencies="train"))
    assert "NOT covered by the DP guarantee" in r["frequencies"]


def test_delta_rules():
    assert resolve_delta("1/N^1.1", 1000) == pytest.approx(1000**-1.1)
    assert resolve_delta("1/(2N)", 1000) == pytest.approx(5e-4)
    assert resolve_delta(1e-6, 1000) == 1e-6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "bert"}, "model='bert' is not allowed: expected one of"),
        ({"delta": "1/N"}, "delta='1/N' is not allowed: expected one of"),
        ({"frequencies": "public"}, "frequencies='public' is not allowed"),
        ({"d_model": 10, "n_head": 4}, "d_model=10 is not allowed with n_head=4"),
        ({"epochs": 0}, "epochs=0"),
    ],
)
def test_bad_config(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        _cfg(tmp_path, **kwargs)


def _write(tmp_path, df, name="bad.csv"):
    path = tmp_path / name
    df.to_csv(path, index=False)
    return str(path)


def test_bad_data_errors_write_nothing(tmp_path):
    out = tmp_path / "run"
    good = pd.read_csv(_interactions(tmp_path / "good.csv"))
    cases = [
        (good.drop(columns=["timestamp"]), "timestamp"),
        (good.assign(timestamp="yesterday"), "timestamp"),
    ]
    for df, message in cases:
        cfg = _cfg(tmp_path, data=_write(tmp_path, df), out=str(out))
        with pytest.raises(ValueError, match=message):
            train_seqrec(cfg)
        assert not out.exists()
    short = pd.DataFrame({"user_id": ["a", "a", "b"], "item_id": [1, 2, 1], "timestamp": [1, 2, 3]})
    cfg = _cfg(tmp_path, data=_write(tmp_path, short), min_count=1, out=str(out))
    with pytest.raises(ValueError, match="at least 3"):
        train_seqrec(cfg)
    assert not out.exists()
    with pytest.raises(ValueError, match=r"data='nowhere\.csv' is not allowed"):
        train_seqrec(_cfg(tmp_path, data="nowhere.csv", out=str(out)))
    assert not out.exists()


def test_unreachable_epsilon_is_refused_before_writing(tmp_path):
    cfg = _cfg(tmp_path, epsilon=0.001, epochs=50)
    with pytest.raises(ValueError, match=r"epsilon=0.001 cannot be reached for epochs=50"):
        train_seqrec(cfg)
    assert not (tmp_path / "run").exists()


def test_packaged_config_loads():
    from dptrain.recipes import configs_dir

    for path in configs_dir().glob("seqrec*.yaml"):
        cfg = load_config(SeqRecTrainConfig, path)
        assert cfg.model in ("dpformer", "transformer")
        assert set(yaml.safe_load(path.read_text())) <= set(vars(cfg))


def test_cli_train_json_prints_the_results_with_the_privacy_keys(tmp_path, capsys):
    from dptrain.cli import main

    data = _interactions(tmp_path / "inter.csv")
    argv = ["train", "seqrec", "--json", f"data={data}", "model=gru", "max_len=6", "epochs=1"]
    argv += ["batch_size=16", "d_model=8", "progress=false", f"out={tmp_path / 'r'}"]
    assert main(argv) == 0
    (line,) = capsys.readouterr().out.strip().splitlines()  # one JSON line, nothing else
    printed = json.loads(line)
    saved = json.loads((tmp_path / "r" / "results.json").read_text())
    assert printed["run_folder"] == str(tmp_path / "r")
    # the keys `dptrain epsilon --json` uses for the same quantities
    assert printed["privacy_unit"] == saved["privacy_unit"] == "user"  # a user's sequence
    assert printed["epsilon"] == saved["epsilon"]
    assert printed["delta"] == saved["delta"] > 0
