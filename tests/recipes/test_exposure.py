"""The exposure audit end to end on a tiny synthetic E2E folder (seconds), configs and bad input."""

from __future__ import annotations

import csv
import itertools
import json
import math
from types import SimpleNamespace

import pytest
import torch

from dptrain.accounting import PLDAccountant, PrivacyLedger
from dptrain.audit import Canary, CanarySet
from dptrain.config import ConfigError
from dptrain.data.tokenizer import train_tokenizer
from dptrain.recipes import configs_dir
from dptrain.recipes.exposure import (
    ExposureAuditConfig,
    _score_canaries,
    load_exposure_config,
    run_exposure_audit,
    summarize_exposures,
)

NAMES = ["Alimentum", "Aromi", "Bibimbap", "Cotto", "Giraffe", "Loch", "Strada", "Wildwood"]
AREAS = ["riverside", "centre"]
FOODS = ["Chinese", "English", "French", "Indian", "Italian"]

TINY_TRAIN = {
    "n_layer": 1,
    "n_embd": 16,
    "n_head": 2,
    "vocab_size": 200,
    "max_len": 48,
    "epochs": 1,
    "batch_size": 16,
    "max_physical_batch_size": 16,
    "eval_batch_size": 64,
}


def _e2e_folder(path):
    """devel-fixed.no-ol.csv and test-fixed.csv with E2E's columns, 40 tables x 2 texts."""
    path.mkdir(exist_ok=True)
    rows = []
    for i, (name, area, food) in enumerate(
        (n, a, f) for n in NAMES for a in AREAS for f in FOODS[:3]
    ):
        table = f"name[{name}], food[{food}], area[{area}]"
        rows.append((table, f"{name} serves {food} food in the {area} area."))
        rows.append((table, f"In the {area} area, {name} has {food} food ({i})."))
    for fname, part in (("devel-fixed.no-ol.csv", rows), ("test-fixed.csv", rows[:10])):
        with (path / fname).open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["mr", "ref", "fixed", "orig_mr"])
            for table, text in part:
                w.writerow([table, text, 0, table])
    return path


def _overrides(tmp_path, *extra):
    return [
        f"data={_e2e_folder(tmp_path / 'e2e')}",
        f"out={tmp_path / 'audit'}",
        "repetitions=[1, 3]",
        "canaries_per_repetition=2",
        "subvocab_size=4",
        "secret_length=3",
        "n_samples=100",
        "exact_max_space=100",
        "epsilons=null,3",
        "progress=false",
        *(f"train.{k}={v}" for k, v in TINY_TRAIN.items()),
        *extra,
    ]


def test_audit_smoke_run_writes_the_table(tmp_path):
    cfg = load_exposure_config(None, _overrides(tmp_path))
    result = run_exposure_audit(cfg, "dptrain audit exposure (test)")
    out = tmp_path / "audit"
    for name in (
        "table.md",
        "summary.json",
        "exposures.jsonl",
        "exposure.png",
        "canaries.json",
        "config.yaml",
        "data.json",
        "tokenizer/tokenizer.json",
        "nonprivate_seed0/results.json",
        "eps3_seed0/results.json",
        "eps3_seed0/ledger.json",
    ):
        assert (out / name).is_file(), name
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(result))

    # every canary inserted exactly r times into one training set: 2 x 1 + 2 x 3 records
    data = json.loads((out / "data.json").read_text())
    assert data["canary_records"] == 8
    assert data["train_pairs_with_canaries"] == data["train_pairs"] + 8

    rows = [json.loads(x) for x in (out / "exposures.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4  # two models x four canaries
    ceiling = math.log2(4**3)
    for row in rows:
        assert math.isfinite(row["exposure"]) and row["exposure"] >= 0
        assert 0.0 <= row["exposure_rank_sampled"] <= ceiling + 1e-9
        assert 0.0 <= row["exposure_rank_exact"] <= ceiling + 1e-9  # |R| = 64 <= 100
        assert row["max_exposure"] == pytest.approx(ceiling)
        assert row["log_ppl"] > 0
    # the same canaries under both models
    by_model = {g: [r["secret"] for r in rows if r["guarantee"] == g] for g in result["guarantees"]}
    assert by_model["non-private"] == by_model["epsilon = 3"]

    assert result["guarantees"] == ["non-private", "epsilon = 3"]
    for g in result["guarantees"]:
        assert set(result["exposure"][g]) == {"1", "3"}
        assert all(cell["n"] == 2 for cell in result["exposure"][g].values())
    private = next(r for r in result["runs"] if r["target_epsilon"] == 3.0)
    ledger = PrivacyLedger.from_json((out / "eps3_seed0/ledger.json").read_text())
    assert PLDAccountant(ledger).epsilon(private["delta"]) == pytest.approx(private["epsilon"])
    assert private["epsilon"] <= 3.0
    table = (out / "table.md").read_text()
    assert "| Guarantee | r = 1 | r = 3 |" in table
    assert "| non-private |" in table and "| epsilon = 3 |" in table
    assert "Exact rank exposure" in table
    # the resolved config reloads to the same settings
    assert load_exposure_config(out / "config.yaml") == cfg


def test_summarize_exposures_mean_and_sample_std():
    rows = [
        {"guarantee": "g", "repetitions": 1, "exposure": 1.0},
        {"guarantee": "g", "repetitions": 1, "exposure": 3.0},
        {"guarantee": "g", "repetitions": 10, "exposure": 5.0},
        {"guarantee": "g", "repetitions": 10, "exposure": None},
    ]
    s = summarize_exposures(rows)
    assert s["g"]["1"] == {"mean": 2.0, "std": pytest.approx(math.sqrt(2.0)), "min": 1.0,
                           "max": 3.0, "n": 2}  # fmt: skip
    assert s["g"]["10"]["n"] == 1 and s["g"]["10"]["std"] == 0.0


def test_packaged_config_and_train_overrides():
    cfg = load_exposure_config(
        configs_dir() / "exposure.yaml", ["train.lr=1e-3", "train={batch_size: 128}", "seeds=0,1"]
    )
    assert cfg.repetitions == [1, 10, 100] and cfg.epsilons == [None, 3.0]
    assert cfg.train == {"epochs": 10, "lr": 1e-3, "batch_size": 128}
    assert cfg.seeds == [0, 1] and cfg.space_size == 10**5
    run = cfg.run_config(3.0, 1, tmp := configs_dir())  # the per-run Table2TextConfig
    assert (run.epsilon, run.seed, run.lr, run.epochs, run.out) == (3.0, 1, 1e-3, 10, str(tmp))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["train.epsilon=3"], r"set by the audit \(epsilon: set epsilons\)"),
        (["train.seed=1"], "set seeds"),
        (["train.learning_rate=1"], "train: unknown config key"),
        (["train.lr=fast"], "lr='fast' is not allowed"),
        (["epsilon=3"], "unknown config key"),
        (["n_samples=50"], "n_samples=50 is not allowed"),
        (["repetitions=[]"], "repetitions=.. is not allowed"),
        (["epsilons=3,3"], "values repeat"),
        (["train=3"], "expected a mapping"),
        (["train.audit=true"], "train.audit=true is not allowed: the exposure audit does not"),
    ],
)
def test_bad_config_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        load_exposure_config(None, overrides)


def test_bad_train_mapping_is_refused_when_built_directly():
    with pytest.raises(ConfigError, match="set out"):
        ExposureAuditConfig(train={"out": "x"})
    with pytest.raises(ValueError, match="n_head"):  # Table2TextConfig's own checks run too
        ExposureAuditConfig(train={"n_embd": 10, "n_head": 4})


def test_unencodable_canary_format_stops_before_training(tmp_path):
    """A local tokenizer that has never seen '|' cannot encode Li et al.'s canary prefix."""
    words = " ".join(NAMES + AREAS + FOODS + ["name", "Type", "area", "serves", "food"])
    tok = train_tokenizer([words, words.lower()] * 5, kind="bpe", vocab_size=120)
    tok.save_pretrained(str(tmp_path / "tok"))
    cfg = load_exposure_config(None, _overrides(tmp_path, f"train.tokenizer={tmp_path / 'tok'}"))
    with pytest.raises(ValueError, match=r"cannot be encoded by the tokenizer.*'\|'"):
        run_exposure_audit(cfg)
    assert not (tmp_path / "audit").exists()  # nothing written


def test_batch_larger_than_the_data_and_missing_data_are_refused(tmp_path):
    cfg = load_exposure_config(None, _overrides(tmp_path, "train.batch_size=5000"))
    with pytest.raises(ValueError, match="batch_size=5000 is not allowed"):
        run_exposure_audit(cfg)
    cfg = load_exposure_config(None, _overrides(tmp_path, "train.max_len=10"))
    with pytest.raises(ValueError, match=r"train.max_len=10 is not allowed.*takes \d+ tokens"):
        run_exposure_audit(cfg)  # a cut secret would be scored on part of its tokens
    assert not (tmp_path / "audit").exists()
    cfg = load_exposure_config(None, [f"data={tmp_path / 'nowhere'}", "progress=false"])
    with pytest.raises(ValueError, match="data=PATH"):
        run_exposure_audit(cfg)


class _BigramLM(torch.nn.Module):
    """A fake causal LM: logits depend on the current token only; ``boost`` favours given pairs."""

    def __init__(self, vocab: int, boost: dict[int, int], strength: float = 8.0):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # text_log_likelihood reads the device
        table = torch.zeros(vocab, vocab)
        for token, nxt in boost.items():
            table[token, nxt] = strength
        self.register_buffer("table", table)

    def forward(self, input_ids, attention_mask=None):
        return SimpleNamespace(logits=self.table[input_ids])


def _toy_canary_set():
    words = ("alpha", "bravo", "charlie", "delta")
    canary = Canary(0, " name : alpha", "bravo charlie delta", 1, ("alpha",), words[1:])
    return CanarySet((canary,), words, 3, " name : {word}", 0, (1,))


def test_scoring_a_model_that_memorized_the_canary():
    """A bigram LM whose only favoured path from [SEP] is the canary's secret: rank 1 of 64."""
    cs = _toy_canary_set()
    tok = train_tokenizer([" ".join(cs.subvocab) + " name :"] * 20, kind="bpe", vocab_size=120)
    ids = {w: tok(" " + w, add_special_tokens=False)["input_ids"] for w in cs.subvocab}
    assert all(len(v) == 1 for v in ids.values())  # one token per word: equal lengths
    path = [tok.sep_token_id, *(ids[w][0] for w in cs.canaries[0].secret_words)]
    cfg = ExposureAuditConfig(n_samples=200, exact_max_space=100, progress=False)
    memorized = _BigramLM(len(tok), dict(itertools.pairwise(path)))
    (row,) = _score_canaries(memorized, tok, cs, cfg, max_len=32, desc="toy")
    assert row["exposure_rank_exact"] == pytest.approx(math.log2(64))  # the first guess
    assert row["exposure_rank_sampled"] == pytest.approx(math.log2(64))
    assert row["exposure"] > math.log2(64) - 1  # the fitted tail puts it far out too
    # a model that favours nothing: every secret tied -> rank (|R| + 1) / 2, no fit possible
    (row,) = _score_canaries(_BigramLM(len(tok), {}), tok, cs, cfg, max_len=32, desc="toy")
    assert row["exposure_rank_exact"] == pytest.approx(math.log2(64) - math.log2(65 / 2))
    assert row["exposure"] is None and row["log_ppl"] == pytest.approx(3 * math.log(len(tok)))
