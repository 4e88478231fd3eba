"""E2E table-to-text data: reading, the by-table split and bad input (no /work/shared needed)."""

from __future__ import annotations

import csv
import json

import pytest

from dptrain.data import e2e
from dptrain.data.e2e import (
    E2E_COLUMNS,
    E2E_FILES,
    load_e2e,
    read_table_text,
    split_by_table,
)


def write_csv(path, rows, columns=("mr", "ref", "fixed", "orig_mr")):
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(columns)
        for table, text in rows:
            writer.writerow([table, text, 0, table][: len(columns)])


def make_pairs(n_tables, refs_per_table, prefix="T"):
    return [
        (f"name[{prefix}{i}], area[city centre]", f"{prefix}{i} is in the centre, text {j}.")
        for i in range(n_tables)
        for j in range(refs_per_table)
    ]


@pytest.fixture
def e2e_folder(tmp_path):
    write_csv(tmp_path / E2E_FILES["dev"], make_pairs(20, 3, "D"))
    write_csv(tmp_path / E2E_FILES["test"], make_pairs(5, 2, "X"))
    return tmp_path


def test_read_csv_keeps_order_strips_and_drops_empty(tmp_path):
    path = tmp_path / "t.csv"
    write_csv(path, [(" name[A] ", " A text. "), ("name[B]", ""), ("name[C]", "C, with comma")])
    assert read_table_text(path) == [("name[A]", "A text."), ("name[C]", "C, with comma")]


def test_read_jsonl_with_other_column_names(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"table": "a[1]", "text": "one", "extra": 1}, {"table": "b[2]", "text": "two"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    got = read_table_text(path, table_col="table", text_col="text")
    assert got == [("a[1]", "one"), ("b[2]", "two")]


def test_missing_columns_are_named_with_the_columns_found(tmp_path):
    path = tmp_path / "t.csv"
    write_csv(path, [("a", "b")], columns=("meaning", "ref"))
    with pytest.raises(ValueError) as err:
        read_table_text(path)
    msg = str(err.value)
    assert "'mr' (table_col)" in msg and "'meaning'" in msg and "'ref'" in msg
    assert "(text_col)" not in msg  # only the missing one is named missing
    jsonl = tmp_path / "t.jsonl"
    jsonl.write_text(json.dumps({"x": 1}) + "\n")
    with pytest.raises(ValueError, match=r"'mr' \(table_col\), 'ref' \(text_col\).*'x'"):
        read_table_text(jsonl)


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="unknown file suffix"):
        read_table_text(tmp_path / "t.txt")
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_table_text(tmp_path / "absent.csv")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"mr": "a", "ref": "b"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        read_table_text(bad)


def test_split_by_table_has_no_overlap_and_keeps_every_pair():
    pairs = make_pairs(50, 3)
    train, valid = split_by_table(pairs, 0.1, seed=3)
    assert {t for t, _ in train}.isdisjoint({t for t, _ in valid})
    assert sorted(train + valid) == sorted(pairs)
    assert len({t for t, _ in valid}) == 5  # round(0.1 * 50) tables, all their pairs
    assert len(valid) == 15
    assert split_by_table(pairs, 0.1, seed=3) == (train, valid)  # seeded
    assert split_by_table(pairs, 0.1, seed=4) != (train, valid)
    # at least one validation table when the fraction is positive
    assert len({t for t, _ in split_by_table(make_pairs(3, 1), 0.01, 0)[1]}) == 1


def test_load_e2e_splits_dev_by_table(e2e_folder):
    splits = load_e2e(str(e2e_folder), valid_fraction=0.2, seed=0)
    assert len(splits.valid) == 4 * 3 and len(splits.train) == 16 * 3
    assert {t for t, _ in splits.train}.isdisjoint({t for t, _ in splits.valid})
    assert len(splits.test) == 10 and all(t.startswith("name[X") for t, _ in splits.test)
    assert "dev set" in splits.source and "used for training" in splits.source
    summary = splits.summary
    assert summary["train_tables"] == 16 and summary["test_tables"] == 5
    assert E2E_COLUMNS == ("mr", "ref")


def test_load_e2e_uses_a_training_file_when_there_is_one(e2e_folder):
    write_csv(e2e_folder / E2E_FILES["train"], make_pairs(7, 1, "R"))
    splits = load_e2e(str(e2e_folder))
    assert len(splits.train) == 7 and len(splits.valid) == 60
    assert E2E_FILES["train"] in splits.source


def test_missing_data_asks_for_a_path(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"data=PATH.*devel-fixed.no-ol.csv"):
        load_e2e(str(tmp_path / "absent"))
    (tmp_path / E2E_FILES["dev"]).write_text("mr,ref\na,b\n")
    with pytest.raises(ValueError, match=r"test-fixed.csv not found"):
        load_e2e(str(tmp_path))
    monkeypatch.setattr(e2e, "default_e2e_dir", lambda: None)
    with pytest.raises(ValueError, match=r"data='e2e'.*not found; give data=PATH"):
        load_e2e("e2e")


def test_default_dir_is_none_or_holds_the_dev_file():
    folder = e2e.default_e2e_dir()
    assert folder is None or (folder / E2E_FILES["dev"]).is_file()
