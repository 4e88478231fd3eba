"""The classify recipe end to end on a tiny word-level BERT and a 60-row CSV (seconds per
run): the five methods, both objectives, the feature cache, bad input and the config."""

from __future__ import annotations

import csv
import inspect
import json
import math
import re
import shutil

import pytest
import torch
import yaml

from dptrain.accounting import PLDAccountant, PrivacyLedger, sample_rate_from_batch
from dptrain.config import ConfigError, load_config
from dptrain.privacy_record import read as read_record
from dptrain.recipes import classify
from dptrain.recipes.classify import METHODS, ClassifyTrainConfig, train_classify

transformers = pytest.importorskip("transformers")
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5

EPS = 1.0
BATCH, M = 8, 4
N_ROWS, N_TRAIN = 60, 48  # 80 / 10 / 10 stratified split of 30 + 30 rows
STEPS = math.floor(1 / sample_rate_from_batch(BATCH, N_TRAIN))  # one epoch: 6 steps
DELTA = 1 / N_TRAIN**1.1
LABEL_WORDS = ["terrible", "great"]  # label 0 (negative), label 1 (positive)
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]

NOUNS = ["movie", "film", "story", "plot", "cast", "ending"]
GOOD = ["wonderful", "great", "lovely", "brilliant", "fun"]
BAD = ["terrible", "awful", "boring", "dull", "bad"]


def _rows() -> list[tuple[str, int]]:
    rows = []
    for i, noun in enumerate(NOUNS):
        for j, (good, bad) in enumerate(zip(GOOD, BAD, strict=True)):
            end = " ." if (i + j) % 2 else ""
            rows.append((f"the {noun} was {good}{end}", 1))
            rows.append((f"the {noun} was {bad} and i left{end}", 0))
    assert len(rows) == N_ROWS
    return rows


def _write_csv(path, rows) -> str:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text", "label"])
        writer.writerows(rows)
    return str(path)


def _vocab() -> list[str]:
    words = {w for text, _ in _rows() for w in text.split()}
    words |= {*LABEL_WORDS, "it", "was", "."}
    return SPECIAL + sorted(words)


def _save_tokenizer(folder) -> None:
    vocab = _vocab()
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    init = inspect.signature(transformers.BertTokenizerFast.__init__).parameters
    if "vocab" in init:  # transformers >= 5 ignores vocab_file=: give the vocabulary itself
        tokenizer = transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})
    else:
        tokenizer = transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    assert tokenizer.tokenize("The plot was terrible.") == ["the", "plot", "was", "terrible", "."]
    tokenizer.save_pretrained(folder)


def _bert_config() -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=len(_vocab()),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
    )


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The data file and three model folders: masked LM + tokenizer, plain encoder +
    tokenizer (no masked-LM head), masked LM without tokenizer."""
    root = tmp_path_factory.mktemp("classify")
    mlm_dir = root / "mlm"
    mlm_dir.mkdir()
    _save_tokenizer(mlm_dir)
    torch.manual_seed(0)
    transformers.BertForMaskedLM(_bert_config()).save_pretrained(mlm_dir)
    plain_dir = root / "plain"
    plain_dir.mkdir()
    _save_tokenizer(plain_dir)
    transformers.BertModel(_bert_config()).save_pretrained(plain_dir)
    no_tokenizer = root / "no-tokenizer"
    no_tokenizer.mkdir()
    for f in mlm_dir.iterdir():
        if f.name == "config.json" or f.suffix in (".safetensors", ".bin"):
            shutil.copy(f, no_tokenizer / f.name)
    assert not any("token" in f.name or "vocab" in f.name for f in no_tokenizer.iterdir())
    return {
        "data": _write_csv(root / "reviews.csv", _rows()),
        "mlm": str(mlm_dir),
        "plain": str(plain_dir),
        "no_tokenizer": str(no_tokenizer),
        "root": root,
    }


def _config(files, out, **overrides) -> ClassifyTrainConfig:
    method = overrides.get("method", "dpfp")
    base = {
        "data": files["data"],
        "encoder": files["mlm"],
        "epochs": 1,
        "batch_size": BATCH,
        "micro_batches": M,
        "epsilon": None if method.startswith("nonprivate") else EPS,
        "progress": False,
        "out": str(out),
    }
    return ClassifyTrainConfig(**{**base, **overrides})


RUN_FILES = (
    "config.yaml",
    "data.json",
    "ledger.json",
    "metrics.jsonl",
    "results.json",
    "plots/curves.png",
    "checkpoints/best.pt",
)


def _check_run_folder(out, cfg: ClassifyTrainConfig, results: dict) -> dict:
    for name in RUN_FILES:
        assert (out / name).is_file(), name
    saved = json.loads((out / "results.json").read_text())
    assert saved == results
    assert saved["method"] == cfg.method
    assert "audit" not in saved  # audit=false (the default)
    assert 0.0 <= saved["accuracy"] <= 1.0 and 0.0 <= saved["dev_accuracy"] <= 1.0
    assert saved["n_train"] == N_TRAIN and saved["n_dev"] + saved["n_test"] == N_ROWS - N_TRAIN
    assert saved["steps"] == STEPS
    data = json.loads((out / "data.json").read_text())
    assert data["sizes"]["train"] == N_TRAIN
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["epoch"] for x in lines] == [1] and lines[0]["step"] == STEPS
    assert 0.0 <= lines[0]["dev_accuracy"] <= 1.0
    assert lines[0]["dev_accuracy"] == saved["dev_accuracy"]
    # the resolved config reloads to the same settings
    assert load_config(ClassifyTrainConfig, out / "config.yaml") == cfg
    ledger = PrivacyLedger.from_json((out / "ledger.json").read_text())
    if cfg.method.startswith("nonprivate"):
        assert saved["epsilon"] == math.inf and saved["delta"] == 0.0
        assert saved["noise_multiplier"] == 0.0 and saved["epsilon_by_accountant"] == {}
        assert saved["target_epsilon"] is None and saved["calibrated_with"] is None
        assert ledger.num_steps == saved["ledger_events"] == 0
        return saved
    # private: the PLD epsilon of the ledger on disk is the one reported, within the target
    assert saved["delta"] == pytest.approx(DELTA)
    assert math.isfinite(saved["epsilon"]) and 0 < saved["epsilon"] <= EPS * 1.01
    assert PLDAccountant(ledger).epsilon(saved["delta"]) == pytest.approx(saved["epsilon"])
    assert set(saved["epsilon_by_accountant"]) == {"pld", "rdp", "gdp"}
    assert saved["epsilon_by_accountant"]["pld"] == saved["epsilon"]
    assert saved["target_epsilon"] == EPS and saved["calibrated_with"] == "pld"
    per_step = M if cfg.method.startswith("dpfp") else 1
    assert ledger.num_steps == saved["ledger_events"] == STEPS * per_step
    q = BATCH / N_TRAIN / per_step
    assert [(s.sample_rate, s.noise_multiplier) for s in ledger.segments] == [
        (pytest.approx(q), pytest.approx(saved["noise_multiplier"]))
    ]
    assert saved["sample_rate"] == pytest.approx(q)
    # the curve's epsilon is on a coarser (pessimistic) grid than results.json
    assert saved["epsilon"] - 1e-9 <= lines[-1]["epsilon"] <= saved["epsilon"] * 1.05
    return saved


# -- the five methods ---------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
def test_each_method_writes_the_run_folder(files, tmp_path, method):
    out = tmp_path / "run"
    cfg = _config(files, out, method=method)
    saved = _check_run_folder(out, cfg, train_classify(cfg))
    assert saved["objective"] == "linear" and saved["pooling"] == "mean"
    assert saved["micro_batches"] == (M if method.startswith("dpfp") else None)
    scope = saved["privacy_scope"]
    assert scope == classify._SCOPES[method]
    if method in ("dpfp", "dpfp-finetune"):
        assert "labels are NOT protected" in scope
        assert f"{STEPS * M} subsampled Gaussian events" in saved["privacy_scope_detail"]
    assert ("OUTSIDE the formal guarantee" in scope) == (method == "dpfp-finetune")
    record = read_record(out)  # the privacy record beside the checkpoint
    assert record.producer == "dptrain train classify"
    assert record.private == (not method.startswith("nonprivate"))
    if record.private:
        assert (record.epsilon, record.delta) == (saved["epsilon"], saved["delta"])
        assert record.training["noise_multiplier"] == saved["noise_multiplier"]
    state = torch.load(out / "checkpoints" / "best.pt", weights_only=True)
    if method in ("nonprivate-head", "dpsgd-head", "dpfp"):  # frozen: the checkpoint is the head
        assert set(state) == {"weight", "bias"} and state["weight"].shape == (2, 16)
    else:
        assert "encoder.encoder.embeddings.word_embeddings.weight" in state
        assert state["head.weight"].shape == (2, 16)


@pytest.mark.parametrize("method", ["dpsgd", "dpsgd-head"])
def test_audit_section_in_results(files, tmp_path, method):
    cfg = _config(files, tmp_path / "run", method=method, audit=True, audit_canaries=2000)
    results = train_classify(cfg)
    audit = results["audit"]
    # the head alone (dpsgd-head) has 2 x 16 + 2 coordinates: one canary each, no more
    assert audit["canaries"] == (2000 if method == "dpsgd" else 34)
    assert audit["steps_observed"] == results["steps"] == STEPS
    assert set(audit["lower_bounds"]) == {"steinke2023"}  # Poisson steps: not Gaussian
    assert not audit["flagged"] and audit["claimed_epsilon"] == results["epsilon"]
    assert json.loads((tmp_path / "run" / "results.json").read_text())["audit"] == audit


def test_linear_objective_loads_the_encoder_of_a_masked_lm_folder(files):
    # the linear objective loads the folder with AutoModel: a BertForMaskedLM checkpoint
    # gives its encoder (the masked-LM head is dropped, the pooler is new)
    cfg = _config(files, files["root"] / "unused", method="nonprivate")
    tokenizer = classify._load_tokenizer(cfg, classify._encoder_folder(cfg))
    model, objective = classify._load_model(cfg, classify._encoder_folder(cfg), tokenizer, 2, [])
    assert objective == {"objective": "linear", "pooling": "mean"}
    mlm = transformers.BertForMaskedLM.from_pretrained(files["mlm"])
    encoder = model.encoder.encoder
    assert isinstance(encoder, transformers.BertModel)
    want = mlm.bert.state_dict()
    got = encoder.state_dict()
    shared = [k for k in want if k in got]
    assert len(shared) == len(want) > 10
    for k in shared:
        assert torch.equal(got[k], want[k]), k


# -- text infilling -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "method",
    [
        "nonprivate",
        "dpsgd",
        "dpsgd-head",
        "dpfp",
        "dpfp-finetune",
    ],
)
def test_infilling_objective(files, tmp_path, method):
    out = tmp_path / "run"
    cfg = _config(files, out, method=method, objective="infilling", label_words=LABEL_WORDS)
    saved = _check_run_folder(out, cfg, train_classify(cfg))
    assert saved["objective"] == "infilling" and saved["label_words"] == LABEL_WORDS
    assert saved["prompt"] == "It was [MASK]."
    assert saved["label_word_of"] == {"0": "terrible", "1": "great"}  # class name -> word


def test_infilling_reads_the_mask_state_through_the_masked_lm_head(files):
    cfg = _config(files, files["root"] / "unused", objective="infilling", label_words=LABEL_WORDS)
    folder = classify._encoder_folder(cfg)
    tokenizer = classify._load_tokenizer(cfg, folder)
    model, _ = classify._load_model(cfg, folder, tokenizer, 2, ["0", "1"])
    ids = classify._tokenize(cfg, tokenizer, ["the plot was dull"])
    assert tokenizer.convert_ids_to_tokens(ids[0]) == [
        "[CLS]", "the", "plot", "was", "dull", "it", "was", "[MASK]", ".", "[SEP]",
    ]  # fmt: skip
    mlm = transformers.BertForMaskedLM.from_pretrained(files["mlm"]).eval()
    batch = {"input_ids": torch.tensor(ids), "attention_mask": torch.ones(1, len(ids[0])).long()}
    with torch.no_grad():
        got = model.eval()(batch)
        full = mlm(**batch).logits[0, 7]
    word_ids = tokenizer.convert_tokens_to_ids(LABEL_WORDS)
    torch.testing.assert_close(got[0], full[word_ids])


# -- feature cache ------------------------------------------------------------------------


def test_feature_cache_is_reused(files, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    first = train_classify(
        _config(files, tmp_path / "a", method="dpsgd-head", feature_cache=str(cache))
    )
    cached = list(cache.iterdir())
    assert len(cached) == 1 and cached[0].name.startswith("features-")
    assert cached[0].suffix == ".pt"
    feats = torch.load(cached[0], weights_only=True)
    assert {k: v.shape for k, v in feats.items()} == {
        "train": (N_TRAIN, 16),
        "dev": (first["n_dev"], 16),
        "test": (first["n_test"], 16),
    }

    def no_encoder_pass(*args, **kwargs):
        raise AssertionError("the encoder ran: the feature cache was not used")

    monkeypatch.setattr(classify, "_represent", no_encoder_pass)
    second = train_classify(
        _config(files, tmp_path / "b", method="dpsgd-head", feature_cache=str(cache))
    )
    for key in ("accuracy", "dev_accuracy", "best_epoch", "epsilon", "noise_multiplier"):
        assert second[key] == first[key], key
    a = torch.load(tmp_path / "a" / "checkpoints" / "best.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "checkpoints" / "best.pt", weights_only=True)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert list(cache.iterdir()) == cached  # read, not rewritten
    # a different pooling is a different representation: not served from this file
    with pytest.raises(AssertionError, match="the feature cache was not used"):
        train_classify(
            _config(
                files, tmp_path / "c", method="dpsgd-head", pooling="cls", feature_cache=str(cache)
            )
        )


# -- test_data: train on one source, score on another -------------------------------------


def _named_rows() -> list[tuple[str, str]]:
    return [(text, "good" if y else "bad") for text, y in _rows()]


def test_test_data_file_is_the_whole_test_set(files, tmp_path):
    train_file = _write_csv(tmp_path / "train.csv", _named_rows())
    test_rows = [("the cast was fun", "good"), ("the plot was dull", "bad"), ("dull", "bad")]
    test_file = _write_csv(tmp_path / "test.csv", test_rows)
    cfg = _config(
        files, tmp_path / "run", data=train_file, test_data=test_file, method="nonprivate-head"
    )
    data = classify.load_classification_data(cfg)
    assert data.label_names == ["bad", "good"]
    assert data.test_texts == [t for t, _ in test_rows]
    assert [data.label_names[k] for k in data.test_labels.tolist()] == [y for _, y in test_rows]
    # the training file keeps no test split: 90 / 10 train / dev
    assert (data.n_train, len(data.dev_texts)) == (54, 6)
    results = train_classify(cfg)
    assert results["n_test"] == 3 and results["n_train"] == 54
    summary = json.loads((tmp_path / "run" / "data.json").read_text())
    assert summary["test_data"] == {"source": test_file, "split": "all records", "size": 3}


def test_packaged_test_data_labels_are_matched_by_name(files, tmp_path, monkeypatch):
    from dptrain.data import text_classification as tc

    # the packaged set names its labels ["rotten", "fresh"]; the training file's sorted
    # names are ["fresh", "rotten"]: label 0 of one is label 1 of the other
    rows = [(t, "fresh" if y == "good" else "rotten") for t, y in _named_rows()]
    train_file = _write_csv(tmp_path / "train.csv", rows)
    packaged = tc.load_text_file(
        _write_csv(tmp_path / "packaged.csv", rows), label_names=["rotten", "fresh"], seed=0
    )
    monkeypatch.setattr(tc, "load_rotten_tomatoes", lambda seed: packaged)
    cfg = _config(files, tmp_path / "run", data=train_file, test_data="rotten-tomatoes")
    data = classify.load_classification_data(cfg)
    assert data.label_names == ["fresh", "rotten"]
    assert data.test_texts == packaged.test_texts
    names = [data.label_names[k] for k in data.test_labels.tolist()]
    assert names == [packaged.label_names[k] for k in packaged.test_labels.tolist()]
    assert set(names) == {"fresh", "rotten"}
    # other names than the training data's: refused, naming both
    bad = _write_csv(tmp_path / "bad.csv", _named_rows())
    cfg = _config(files, tmp_path / "run2", data=bad, test_data="rotten-tomatoes")
    with pytest.raises(
        ValueError,
        match=r"test_data='rotten-tomatoes' is not allowed .* its "
        r"labels \['rotten', 'fresh'\] are not the training data's \['bad', 'good'\]",
    ):
        classify.load_classification_data(cfg)


# -- bad input ----------------------------------------------------------------------------


def _one_class_csv(root) -> str:
    return _write_csv(root / "one-class.csv", [(text, 1) for text, _ in _rows()])


def _empty_texts_csv(root) -> str:
    return _write_csv(root / "empty.csv", [("   " if i % 2 else "", i % 2) for i in range(20)])


BAD_RUNS = {
    # name: (overrides, with the files dict; the expected message as a regex)
    "label column with one class": (
        lambda f: {"data": _one_class_csv(f["root"])},
        r"one-class\.csv: 60 row\(s\) with a non-empty text have 1 class\(es\) \(found: '1'\): "
        r"expected at least 2 classes",
    ),
    "all texts empty": (
        lambda f: {"data": _empty_texts_csv(f["root"])},
        r"empty\.csv: 0 row\(s\) with a non-empty text have 0 class\(es\)",
    ),
    "data file does not exist": (
        lambda f: {"data": str(f["root"] / "nope.csv")},
        r"data='.*nope\.csv' is not allowed: expected 'rotten-tomatoes', 'womens-clothing' or",
    ),
    "encoder path does not exist": (
        lambda f: {"encoder": str(f["root"] / "nope")},
        r"encoder='.*nope' is not allowed: expected 'minilm' or a local Hugging Face model "
        r"folder with a config\.json",
    ),
    "encoder folder without tokenizer": (
        lambda f: {"encoder": f["no_tokenizer"], "method": "nonprivate"},
        r"encoder='.*no-tokenizer' is not allowed: no tokenizer could be loaded",
    ),
    "batch larger than the training set (dpsgd)": (
        lambda f: {"method": "dpsgd", "batch_size": N_TRAIN + 1},
        rf"batch_size={N_TRAIN + 1} is not allowed: expected at most dataset_size={N_TRAIN}",
    ),
    "batch larger than the training set (dpfp)": (
        lambda f: {"method": "dpfp", "batch_size": 100},
        rf"batch_size=100 is not allowed: expected at most dataset_size={N_TRAIN}",
    ),
    "infilling without a masked-LM head": (
        lambda f: {"encoder": f["plain"], "objective": "infilling", "label_words": LABEL_WORDS},
        r"objective='infilling' is not allowed with encoder='.*plain': it has no pretrained "
        r"masked-LM head",
    ),
    "label word not in the vocabulary": (
        lambda f: {"objective": "infilling", "label_words": ["terrible", "fantastic"]},
        r"label_words entry 'fantastic' is not allowed: it is not one token of the vocabulary "
        r"\(tokenized as \['\[UNK\]'\]\)",
    ),
    "label word of two tokens": (
        lambda f: {"objective": "infilling", "label_words": ["terrible", "great fun"]},
        r"label_words entry 'great fun' is not allowed: it is not one token of the vocabulary "
        r"\(tokenized as \['great', 'fun'\]\)",
    ),
    "one label word per class": (
        lambda f: {"objective": "infilling", "label_words": ["terrible", "great", "fun"]},
        r"label_words=\['terrible', 'great', 'fun'\] is not allowed: expected 2 words",
    ),
    "test data file does not exist": (
        lambda f: {"test_data": str(f["root"] / "nope.csv")},
        r"test_data='.*nope\.csv' is not allowed: expected 'rotten-tomatoes', 'womens-clothing'",
    ),
    "test data with other labels": (
        lambda f: {
            "test_data": _write_csv(f["root"] / "other.csv", [("good", "yes"), ("bad", "no")])
        },
        r"^test_data='.*other\.csv' is not allowed: .*label\(s\) \['no', 'yes'\] not in "
        r"label_names=\['0', '1'\]",
    ),
    "no label words for a user file": (
        lambda f: {"objective": "infilling"},
        r"label_words=None is not allowed for data='.*reviews\.csv' with objective='infilling'",
    ),
}


@pytest.mark.parametrize(
    "name",
    [n for n in BAD_RUNS],
)
def test_bad_input_stops_before_anything_is_written(files, tmp_path, name):
    overrides, message = BAD_RUNS[name]
    out = tmp_path / "run"
    cfg = _config(files, out, **overrides(files))
    with pytest.raises(ValueError, match=message):
        train_classify(cfg)
        raise AssertionError("the run went through")
    assert not out.exists()


BAD_CONFIGS = {
    "micro_batches=0": (
        {"micro_batches": 0},
        r"^micro_batches=0 is not allowed: expected an integer >= 1$",
    ),
    "nonprivate with epsilon": (
        {"method": "nonprivate", "epsilon": 3.0},
        r"^epsilon=3\.0 is not allowed with method='nonprivate': set epsilon=null",
    ),
    "nonprivate-head with epsilon": (
        {"method": "nonprivate-head", "epsilon": 3.0},
        r"^epsilon=3\.0 is not allowed with method='nonprivate-head': set epsilon=null",
    ),
    "nonprivate with max_norm": (
        {"method": "nonprivate", "max_norm": 1.0},
        r"^max_norm=1\.0 is not allowed with method='nonprivate'",
    ),
    "private without epsilon (dpsgd)": (
        {"method": "dpsgd", "epsilon": None},
        r"^epsilon=None is not allowed with method='dpsgd': expected a target epsilon > 0",
    ),
    "private without epsilon (dpfp)": (
        {"method": "dpfp", "epsilon": None},
        r"^epsilon=None is not allowed with method='dpfp'",
    ),
    "epsilon 0": ({"method": "dpsgd", "epsilon": 0.0}, r"^epsilon=0\.0 is not allowed"),
    "lr with dpsgd-head": (
        {"method": "dpsgd-head", "lr": 1e-3},
        r"^lr=0\.001 is not allowed with method='dpsgd-head': the encoder is frozen; set head_lr",
    ),
    "lr with dpfp": (
        {"method": "dpfp", "lr": 1e-3},
        r"^lr=0\.001 is not allowed with method='dpfp'",
    ),
    "unknown method": (
        {"method": "dp-adam"},
        r"^method='dp-adam' is not allowed: expected one of \['nonprivate', 'nonprivate-head', "
        r"'dpsgd', 'dpsgd-head', 'dpfp', 'dpfp-finetune'\]$",
    ),
    "unknown objective": ({"objective": "prompting"}, r"^objective='prompting' is not allowed"),
    "mask pooling for the linear objective": (
        {"pooling": "mask"},
        r"^pooling='mask' is not allowed: expected one of \['mean', 'cls', 'pooler', 'last'\]$",
    ),
    "pooling with infilling": (
        {"objective": "infilling", "pooling": "cls"},
        r"^pooling='cls' is not allowed with objective='infilling'",
    ),
    "prompt without a mask": (
        {"objective": "infilling", "prompt": "It was"},
        r"^prompt='It was' is not allowed: expected a '\[MASK\]' in it$",
    ),
    "batch_size=0": ({"batch_size": 0}, r"^batch_size=0 is not allowed: expected an integer >= 1$"),
    "audit of a non-private run": (
        {"method": "nonprivate", "audit": True},
        r"^audit=true is not allowed with a non-private run \(method='nonprivate'\)",
    ),
    "audit of dpfp": (
        {"method": "dpfp", "audit": True},
        r"^audit=true is not allowed with method='dpfp': DP-FP noises the representations",
    ),
    "audit of dpfp-finetune": (
        {"method": "dpfp-finetune", "audit": True},
        r"^audit=true is not allowed with method='dpfp-finetune'",
    ),
    "audit_canaries=1": (
        {"method": "dpsgd", "audit": True, "audit_canaries": 1},
        r"^audit_canaries=1 is not allowed: expected an integer >= 2$",
    ),
    "bad delta rule": ({"delta": "1/N"}, r"^delta='1/N' is not allowed: expected one of"),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_bad_config_is_refused(files, tmp_path, name):
    overrides, message = BAD_CONFIGS[name]
    with pytest.raises(ValueError, match=message):
        _config(files, tmp_path / "run", **overrides)


# -- YAML config and overrides --------------------------------------------------------------


def test_config_from_yaml_and_overrides(files, tmp_path):
    path = tmp_path / "classify.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "data": files["data"],
                "encoder": files["mlm"],
                "method": "dpfp",
                "epsilon": 3,
                "micro_batches": 4,
                "batch_size": 8,
                "label_words": ["terrible", "great"],
            }
        )
    )
    cfg = load_config(ClassifyTrainConfig, path)
    assert (cfg.method, cfg.epsilon, cfg.micro_batches, cfg.batch_size) == ("dpfp", 3.0, 4, 8)
    assert (cfg.max_norm, cfg.head_lr, cfg.lr) == (1.0, 0.1, None)  # the method's defaults
    assert cfg.label_words == ["terrible", "great"]
    cfg = load_config(
        ClassifyTrainConfig,
        path,
        ["method=dpsgd", "epsilon=8", "lr=1e-4", "label_words=bad,good", "progress=false"],
    )
    assert (cfg.method, cfg.epsilon, cfg.lr, cfg.progress) == ("dpsgd", 8.0, 1e-4, False)
    assert (cfg.max_norm, cfg.head_lr, cfg.batch_size) == (0.1, 0.1, 8)
    assert cfg.label_words == ["bad", "good"]
    # the checks run on the loaded values
    with pytest.raises(ValueError, match=r"^lr=0\.0001 is not allowed with method='dpfp'"):
        load_config(ClassifyTrainConfig, path, ["lr=1e-4"])
    with pytest.raises(ConfigError, match=re.escape("unknown config key(s) ['learning_rate']")):
        load_config(ClassifyTrainConfig, path, ["learning_rate=1e-4"])
    path.write_text(yaml.safe_dump({"method": "dpfp", "epsilon": 3, "micro_batch": 4}))
    with pytest.raises(ConfigError, match=re.escape("unknown config key(s) ['micro_batch']")):
        load_config(ClassifyTrainConfig, path)
    with pytest.raises(ConfigError, match=r"^epochs='many' is not allowed"):
        load_config(ClassifyTrainConfig, None, ["epsilon=3", "epochs=many"])


# -- a causal LM as the encoder (tiny Llama): last-token pooling, label word as next token --


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tests.lm_helpers import make_small_tokenizer, save_tiny_llama

    folder = tmp_path_factory.mktemp("llama") / "tiny"
    corpus = [t for t, _ in _rows()] + [f"{t} It was terrible" for t, _ in _rows()]
    corpus += [f"{t} It was great" for t, _ in _rows()]
    tokenizer = make_small_tokenizer(corpus=corpus, vocab_size=600)
    assert len(tokenizer.tokenize(" great")) == len(tokenizer.tokenize(" terrible")) == 1
    return str(save_tiny_llama(folder, tokenizer))


def test_causal_lm_defaults_and_label_word_head_is_the_next_token(files, llama, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = _config(
        files,
        tmp_path / "x",
        encoder=llama,
        objective="infilling",
        method="dpsgd",
        label_words=LABEL_WORDS,
        lora_r=2,
    )
    assert cfg.causal and cfg.prompt == "It was [MASK]" and cfg.pooling is None
    assert _config(files, tmp_path / "y", encoder=llama).pooling == "last"
    data = classify.load_classification_data(cfg)
    classifier, objective, tokenizer, _ = classify._setup_model(cfg, data)
    assert objective["lora"]["r"] == 2 and objective["label_words"] == LABEL_WORDS
    assert objective["label_word_of"] == dict(zip(data.label_names, LABEL_WORDS, strict=True))
    trainable = {n for n, p in classifier.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # tied LM head stays frozen
    ids = classify._tokenize(cfg, tokenizer, data.train_texts[:4])
    prompt = tokenizer(" It was", add_special_tokens=False)["input_ids"]
    assert all(row[-len(prompt) :] == prompt for row in ids)
    batch, _ = classify._TokenizedTexts(ids, data.train_labels[:4], tokenizer.pad_token_id).collate(
        [(row, torch.tensor(0)) for row in ids]
    )
    # independent reference: the causal LM's own next-token logits after the prompt
    lm = AutoModelForCausalLM.from_pretrained(llama).eval()
    word_ids = [
        tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" " + w)[0]) for w in LABEL_WORDS
    ]
    with torch.no_grad():
        logits = lm(**batch).logits
        last = batch["attention_mask"].sum(1) - 1
        want = logits[torch.arange(4), last][:, word_ids]
        got = classifier.eval()(batch)  # LoRA B starts at zero: the adapters change nothing yet
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("objective", ["linear", "infilling"])
def test_causal_lm_engine_matches_the_oracle(files, llama, tmp_path, objective):
    from tests.clipping.oracle_check import assert_engine_matches_oracle

    cfg = _config(
        files,
        tmp_path / "x",
        encoder=llama,
        objective=objective,
        method="dpsgd",
        label_words=LABEL_WORDS,
        lora_r=2,
    )
    data = classify.load_classification_data(cfg)
    classifier, _, tokenizer, _ = classify._setup_model(cfg, data)
    torch.manual_seed(0)
    for _name, p in classifier.named_parameters():  # LoRA B starts at 0: give it weight
        if p.requires_grad:
            p.data.normal_(0, 0.3)
    classifier = classifier.double().eval()
    texts = classify._TokenizedTexts(
        classify._tokenize(cfg, tokenizer, data.train_texts[:5]),
        data.train_labels[:5],
        tokenizer.pad_token_id,
    )
    inputs, labels = texts.collate([texts[i] for i in range(5)])
    assert len(set(inputs["attention_mask"].sum(1).tolist())) > 1  # lengths differ: padding

    def losses_of(sl):
        return torch.nn.functional.cross_entropy(
            classifier({k: v[sl] for k, v in inputs.items()}), labels[sl], reduction="none"
        )

    assert_engine_matches_oracle(classifier, losses_of, 5, mode="book_keeping")


@pytest.mark.parametrize("objective", ["linear", "infilling"])
def test_causal_lm_lora_runs_end_to_end(files, llama, tmp_path, objective):
    out = tmp_path / "run"
    cfg = _config(
        files,
        out,
        encoder=llama,
        objective=objective,
        method="dpsgd",
        label_words=LABEL_WORDS,
        lora_r=2,
        lr=1e-2,
    )
    saved = _check_run_folder(out, cfg, train_classify(cfg))
    assert saved["objective"] == objective and saved["lora"]["r"] == 2
    state = torch.load(out / "checkpoints" / "best.pt", weights_only=True)
    assert any("lora_A" in k for k in state)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"objective": "infilling", "prompt": "It was [MASK]."},
            r"^prompt='It was \[MASK\]\.' is not allowed with the causal LM encoder=.*'\[MASK\]' "
            r"must end the prompt",
        ),
        (
            {"method": "dpsgd-head", "lora_r": 4},
            r"^lora_r=4 is not allowed with method='dpsgd-head': LoRA adapters train the encoder",
        ),
        ({"method": "dpsgd", "lora_r": 0}, r"^lora_r=0 is not allowed: expected an integer >= 1"),
    ],
)
def test_causal_lm_bad_config(files, llama, tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(files, tmp_path / "x", encoder=llama, label_words=LABEL_WORDS, **overrides)


def test_causal_lm_label_word_of_two_tokens_is_refused(files, llama, tmp_path):
    out = tmp_path / "run"
    cfg = _config(
        files,
        out,
        encoder=llama,
        objective="infilling",
        method="dpsgd",
        label_words=["terrible", "xylophonic"],
    )
    with pytest.raises(
        ValueError,
        match=r"label_words entry 'xylophonic' is not allowed: it is "
        r"not one token of the vocabulary",
    ):
        train_classify(cfg)
    assert not out.exists()


def test_cli_dpfp_shows_progress_while_encoding_and_json_has_the_privacy_keys(
    files, tmp_path, capsys
):
    """`train classify --method dpfp` printed nothing while the frozen encoder ran (45 s on
    Rotten Tomatoes); the pass has a bar on stderr, and --json's one line is the results."""
    from dptrain.cli import main

    out = tmp_path / "run"
    argv = ["train", "classify", "--method", "dpfp", "--json", f"data={files['data']}"]
    argv += [f"encoder={files['mlm']}", "epochs=1", f"batch_size={BATCH}", f"epsilon={EPS}"]
    argv += [f"micro_batches={M}", f"out={out}"]
    assert main(argv) == 0
    stdout, stderr = capsys.readouterr()
    assert "encoding texts (frozen encoder)" in stderr
    assert f"{N_ROWS}/{N_ROWS}" in stderr  # every split's texts counted
    (line,) = stdout.strip().splitlines()
    printed = json.loads(line)
    assert printed["privacy_unit"] == "text" and printed["epsilon"] <= EPS * 1.01
    assert printed == {**json.loads((out / "results.json").read_text()), "run_folder": str(out)}
