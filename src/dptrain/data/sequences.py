"""Next-item sequences for sequential recommendation (SASRec-style), with the data they come from.

DPFormer's recommendation experiments train a causal Transformer to predict a
user's next item from the items before it. The training recipe does not care
where the sequences come from, so every loader in this package (MovieLens
interactions here, next-word prediction in :mod:`dptrain.data.news`) returns the
same :class:`SequenceData` container:

- item ids are ``1..n_items``; ``0`` is padding, in inputs and in targets;
- inputs are LEFT-padded to ``max_len`` so that the last position always holds
  the most recent item (the position whose output scores the next item);
- a training record has a target at every position (teacher forcing), an
  evaluation example has a single target (the held-out next item);
- ``item_counts`` counts the *training records* containing each item, because
  under DP a record is the privacy unit: Re-Attention's effective error needs
  the share of records (not of tokens) in which an item occurs.

The split is SASRec's leave-one-out (Kang & McAuley 2018): for a user with
items ``s_1..s_n`` in time order, ``s_n`` is the test target, ``s_{n-1}`` the
validation target and ``s_1..s_{n-2}`` the training part, in which each item
predicts the next. One user is one training record, so user-level DP is what
DP-SGD over these records gives (``privacy_unit == "user"``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from dptrain._checks import check_int
from dptrain.data._files import check_columns, check_table_path, package_data

__all__ = [
    "INTERACTION_SUFFIXES",
    "PAD",
    "SequenceData",
    "load_interaction_file",
    "load_movielens_100k",
    "movielens_100k_path",
    "preprocess_sasrec",
    "read_interactions",
]

#: File suffixes :func:`read_interactions` understands, with their separators.
INTERACTION_SUFFIXES = (".csv", ".tsv", ".inter", ".parquet")

#: Name of item 0, the padding id.
PAD = "<pad>"

_INTEGER_ID = re.compile(r"[+-]?\d+")


@dataclass
class SequenceData:
    """Padded next-item sequences with a train/validation/test split.

    Attributes:
        name: ``"ml-100k"``, ``"news"`` or the stem of the file read.
        n_items: catalogue size; item ids are ``1..n_items`` and ``0`` is padding.
        max_len: length ``L`` of every input row.
        train_inputs: ``(N, L)`` long, left-padded with 0.
        train_targets: ``(N, L)`` long: the next item at each position, 0 where
            there is no target (padding).
        valid_inputs: ``(Nv, L)`` long, left-padded.
        valid_targets: ``(Nv,)`` long.
        test_inputs: ``(Nt, L)`` long, left-padded.
        test_targets: ``(Nt,)`` long.
        item_counts: ``(n_items + 1,)`` float64: number of training records that
            contain item ``v`` (entry 0, padding, is 0).
        privacy_unit: what one training record is: ``"user"`` or ``"text chunk"``.
        item_names: original id (or word) of item index ``v``; ``item_names[0] == "<pad>"``.
        valid_seen: ``(Nv, n_items + 1)`` bool: items of the example's input history,
            to exclude from full ranking, or None when repeats are legitimate.
        test_seen: as ``valid_seen`` for the test examples.
        summary: sizes and counts of the preprocessing (for logs and reports).
    """

    name: str
    n_items: int
    max_len: int
    train_inputs: Tensor
    train_targets: Tensor
    valid_inputs: Tensor
    valid_targets: Tensor
    test_inputs: Tensor
    test_targets: Tensor
    item_counts: Tensor
    privacy_unit: str
    item_names: list[str]
    valid_seen: Tensor | None = None
    test_seen: Tensor | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def n_train(self) -> int:
        """Number of training records N (the dataset size the accountant sees)."""
        return int(self.train_inputs.shape[0])

    def item_frequencies(self) -> Tensor:
        """Share of training records containing each item: ``item_counts / N`` (float64).

        Entry 0 (padding) is 0. With no training records every share is 0.
        """
        n = self.n_train
        if n == 0:
            return torch.zeros_like(self.item_counts)
        return self.item_counts / n


# -- locating the packaged data ------------------------------------------------------


def movielens_100k_path() -> Path:
    """Path of MovieLens-100k (``ml-100k.inter``) shipped with RecBole's examples.

    Raises FileNotFoundError naming the ``pip install --no-deps recbole==1.2.1``
    that provides it when RecBole is not installed.
    """
    return package_data(
        "recbole", "dataset_example/ml-100k/ml-100k.inter", "MovieLens-100k (ml-100k.inter)"
    )


# -- reading interaction files -------------------------------------------------------


def _first_row(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _parse_timestamps(values: pd.Series, path: Path, column: str) -> np.ndarray:
    """Timestamps as float64 seconds: numbers, or ISO-8601 date-times (seconds since 1970 UTC).

    Only the order of a user's interactions matters, so any numeric scale works;
    date-times are converted to Unix seconds (naive ones read as UTC). A column
    must be all numbers or all date-times.
    """
    if pd.api.types.is_bool_dtype(values):
        raise ValueError(
            f"{path}: column {column!r} holds booleans: expected numbers (e.g. Unix seconds) "
            "or ISO-8601 date-times"
        )
    if pd.api.types.is_datetime64_any_dtype(values):
        times = pd.to_datetime(values, utc=True)
        return ((times - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)).to_numpy(
            dtype=np.float64
        )
    if pd.api.types.is_numeric_dtype(values):
        numbers = values.to_numpy(dtype=np.float64)
        bad = ~np.isfinite(numbers)
        if bad.any():
            i = _first_row(bad)
            raise ValueError(
                f"{path}: column {column!r} has the timestamp {values.iloc[i]!r} "
                f"(data row {i + 1}): expected finite numbers"
            )
        return numbers
    numbers = pd.to_numeric(values, errors="coerce").to_numpy(dtype=np.float64)
    bad_number = ~np.isfinite(numbers)
    if not bad_number.any():
        return numbers
    times = pd.to_datetime(values, format="ISO8601", utc=True, errors="coerce")
    bad_time = times.isna().to_numpy()
    if not bad_time.any():
        return ((times - pd.Timestamp(0, tz="UTC")) / pd.Timedelta(seconds=1)).to_numpy(
            dtype=np.float64
        )
    # Show a value that breaks the reading most rows agree on.
    bad = bad_number if bad_number.sum() <= bad_time.sum() else bad_time
    i = _first_row(bad)
    raise ValueError(
        f"{path}: column {column!r} has the non-numeric timestamp {values.iloc[i]!r} "
        f"(data row {i + 1}): expected numbers (e.g. Unix seconds) or ISO-8601 date-times "
        "in every row"
    )


def _read_table(path: Path) -> pd.DataFrame:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return pd.read_parquet(path)
    sep = "," if suffix == ".csv" else "\t"
    try:
        # Ids are read as text so that "007" stays "007"; only empty cells are missing
        # (an item called "NA" is an item).
        table = pd.read_csv(path, sep=sep, dtype=str, keep_default_na=False, na_values=[""])
    except pd.errors.EmptyDataError:
        raise ValueError(f"{path} is empty: expected a header and at least one row") from None
    if suffix == ".inter":
        # RecBole atomic files type their columns in the header: "user_id:token".
        table.columns = [str(c).split(":", 1)[0] for c in table.columns]
    return table


def read_interactions(
    path: str | Path,
    *,
    user_col: str = "user_id",
    item_col: str = "item_id",
    time_col: str = "timestamp",
) -> pd.DataFrame:
    """Read (user, item, timestamp) interactions from a ``.csv``, ``.tsv``, ``.inter`` or ``.parquet``.

    ``.inter`` is RecBole's tab-separated atomic file; the ``:token``/``:float``
    type suffixes of its header names are dropped, so ``user_id:token`` is
    ``user_id``. Other columns (ratings, ...) are ignored: every interaction
    counts, whatever its rating, as in SASRec's implicit-feedback setting.

    Returns a DataFrame with exactly the columns ``user``, ``item`` (original ids
    as strings, so ``"007"`` and ``"7"`` stay different) and ``timestamp``
    (float64). Timestamps must be all numbers (any scale: only their order is
    used) or all ISO-8601 date-times (converted to Unix seconds, naive ones as UTC).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: unknown suffix; a missing column (naming the file, the column
            and the columns found); an empty value; a non-numeric timestamp (naming
            the column and the first bad value); a file without rows.
    """
    path = Path(path)
    for name, value in (("user_col", user_col), ("item_col", item_col), ("time_col", time_col)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name}={value!r} is not allowed: expected a column name")
    check_table_path(path, INTERACTION_SUFFIXES)
    table = _read_table(path)

    wanted = {"user_col": user_col, "item_col": item_col, "time_col": time_col}
    check_columns(table, path, wanted)
    if len(table) == 0:
        raise ValueError(f"{path} has no rows: expected at least one interaction")

    for col in (user_col, item_col, time_col):
        empty = table[col].isna().to_numpy()
        if empty.any():
            raise ValueError(
                f"{path}: column {col!r} has {int(empty.sum())} empty value(s) (first in data "
                f"row {_first_row(empty) + 1}): expected a value in every row"
            )
    return pd.DataFrame(
        {
            "user": table[user_col].astype(str).to_numpy(dtype=object),
            "item": table[item_col].astype(str).to_numpy(dtype=object),
            "timestamp": _parse_timestamps(table[time_col], path, time_col),
        }
    )


# -- SASRec preprocessing -----------------------------------------------------------


def _sorted_ids(ids: Sequence[str]) -> list[str]:
    """Ids in a deterministic order: numerically when all are integers, else as text."""
    if all(_INTEGER_ID.fullmatch(s) for s in ids):
        return sorted(ids, key=lambda s: (int(s), s))
    return sorted(ids)


def _left_pad(rows: Sequence[np.ndarray], max_len: int) -> Tensor:
    """Stack 1-D sequences into ``(len(rows), max_len)``, keeping the LAST max_len, zeros left."""
    out = np.zeros((len(rows), max_len), dtype=np.int64)
    for i, row in enumerate(rows):
        row = row[-max_len:]
        if len(row):
            out[i, max_len - len(row) :] = row
    return torch.from_numpy(out)


def _seen_matrix(histories: Sequence[np.ndarray], n_items: int) -> Tensor:
    seen = torch.zeros((len(histories), n_items + 1), dtype=torch.bool)
    rows = np.repeat(np.arange(len(histories)), [len(h) for h in histories])
    cols = np.concatenate(histories) if histories else np.zeros(0, dtype=np.int64)
    seen[torch.from_numpy(rows), torch.from_numpy(cols.astype(np.int64))] = True
    return seen


def preprocess_sasrec(
    interactions: pd.DataFrame,
    *,
    min_count: int = 5,
    max_len: int = 50,
    name: str = "interactions",
    privacy_unit: str = "user",
) -> SequenceData:
    """SASRec's preprocessing and leave-one-out split (Kang & McAuley 2018).

    Args:
        interactions: columns ``user``, ``item``, ``timestamp`` (as returned by
            :func:`read_interactions`); other columns are ignored. Repeated
            (user, item) pairs are kept as separate interactions.
        min_count: users and items with fewer interactions are dropped, repeatedly,
            until every remaining user and item has at least ``min_count`` (dropping
            an item can push a user below the threshold and vice versa).
        max_len: inputs keep the LAST ``max_len`` items, left-padded with 0.
        name: recorded in the result.
        privacy_unit: recorded in the result; one user is one training record.

    Each user's items are ordered by timestamp; ties keep the order of the rows.
    Items are numbered ``1..n_items`` in the order of their original ids
    (numeric when all ids are integers), users (the rows of every split) likewise.
    For a user with items ``s_1..s_n``:

    - training record: input ``s_1..s_{n-3}``, targets ``s_2..s_{n-2}``;
    - validation: input ``s_1..s_{n-2}``, target ``s_{n-1}``;
    - test: input ``s_1..s_{n-1}``, target ``s_n``.

    A user with exactly 3 items has an empty training record (all padding, no
    target); it is kept so that N is the number of users.
    ``valid_seen``/``test_seen`` mark the whole input history (not only the last
    ``max_len`` items), which full-sort evaluation excludes from the ranking as
    RecBole does. ``item_counts[v]`` is the number of users whose training part
    ``s_1..s_{n-2}`` contains ``v``.

    Raises:
        ValueError: bad arguments or columns; nothing left after filtering; a user
            with fewer than 3 items after filtering (possible when min_count < 3).
    """
    min_count = check_int("min_count", min_count, minimum=1)
    max_len = check_int("max_len", max_len, minimum=1)
    if not isinstance(interactions, pd.DataFrame):
        raise ValueError(
            f"interactions={type(interactions).__name__} is not allowed: expected a pandas "
            "DataFrame with columns user, item, timestamp (see read_interactions)"
        )
    missing = [c for c in ("user", "item", "timestamp") if c not in interactions.columns]
    if missing:
        found = ", ".join(repr(str(c)) for c in interactions.columns)
        raise ValueError(
            f"interactions is missing column(s) {', '.join(map(repr, missing))}; found columns: "
            f"{found}. Expected user, item, timestamp (see read_interactions)"
        )
    if not pd.api.types.is_numeric_dtype(interactions["timestamp"]) or pd.api.types.is_bool_dtype(
        interactions["timestamp"]
    ):
        raise ValueError(
            f"interactions['timestamp'] has dtype {interactions['timestamp'].dtype}: expected "
            "numbers (read_interactions converts date-times)"
        )
    if len(interactions) == 0:
        raise ValueError("interactions has no rows: expected at least one interaction")

    users = interactions["user"].astype(str).to_numpy(dtype=object)
    items = interactions["item"].astype(str).to_numpy(dtype=object)
    times = interactions["timestamp"].to_numpy(dtype=np.float64)
    if not np.isfinite(times).all():
        i = _first_row(~np.isfinite(times))
        raise ValueError(
            f"interactions['timestamp'] has the value {times[i]!r} (row {i}): expected finite numbers"
        )
    order = np.arange(len(users))
    n_before = len(users)
    users_before = len(pd.unique(users))
    items_before = len(pd.unique(items))

    # Iterate: each pass can create new users/items below the threshold.
    keep = np.ones(n_before, dtype=bool)
    rounds = 0
    while True:
        rounds += 1
        u, it = pd.Series(users[keep]), pd.Series(items[keep])
        ok = (u.map(u.value_counts()) >= min_count).to_numpy() & (
            it.map(it.value_counts()) >= min_count
        ).to_numpy()
        if ok.all():
            break
        keep[np.flatnonzero(keep)[~ok]] = False
        if not keep.any():
            raise ValueError(
                f"no interactions are left after dropping users and items with fewer than "
                f"min_count={min_count} interactions ({n_before} interactions, {users_before} "
                f"users, {items_before} items before): lower min_count or use more data"
            )
    users, items, times, order = users[keep], items[keep], times[keep], order[keep]

    user_ids = _sorted_ids(list(pd.unique(users)))
    item_ids = _sorted_ids(list(pd.unique(items)))
    user_code = pd.Series(users).map({u: i for i, u in enumerate(user_ids)}).to_numpy(np.int64)
    item_code = pd.Series(items).map({v: i + 1 for i, v in enumerate(item_ids)}).to_numpy(np.int64)
    # Sort by user, then time; the row order breaks ties, so the sort is stable by design.
    perm = np.lexsort((order, times, user_code))
    lengths = np.bincount(user_code, minlength=len(user_ids))
    short = np.flatnonzero(lengths < 3)
    if len(short):
        first = short[0]
        raise ValueError(
            f"user {user_ids[first]!r} has {lengths[first]} interaction(s) after filtering with "
            f"min_count={min_count} ({len(short)} user(s) have fewer than 3): at least 3 are "
            "needed (1 train, 1 validation, 1 test); raise min_count to 3 or drop such users"
        )
    sequences = np.split(item_code[perm], np.cumsum(lengths)[:-1])

    n_items = len(item_ids)
    train_in = [s[:-3] for s in sequences]
    train_tg = [s[1:-2] for s in sequences]
    valid_in = [s[:-2] for s in sequences]
    test_in = [s[:-1] for s in sequences]
    item_counts = np.zeros(n_items + 1, dtype=np.float64)
    for s in valid_in:  # the training part s_1..s_{n-2}
        item_counts[np.unique(s)] += 1

    train_targets = _left_pad(train_tg, max_len)
    summary = {
        "name": name,
        "min_count": min_count,
        "max_len": max_len,
        "users_before": users_before,
        "items_before": items_before,
        "interactions_before": n_before,
        "filter_rounds": rounds,
        "users": len(user_ids),
        "items": n_items,
        "interactions": int(lengths.sum()),
        "mean_sequence_length": float(lengths.mean()),
        "max_sequence_length": int(lengths.max()),
        "train_records": len(sequences),
        "train_targets": int((train_targets != 0).sum()),
        "train_records_without_targets": int((lengths == 3).sum()),
        "valid_examples": len(sequences),
        "test_examples": len(sequences),
        "truncated_test_inputs": int((lengths - 1 > max_len).sum()),
    }
    return SequenceData(
        name=name,
        n_items=n_items,
        max_len=max_len,
        train_inputs=_left_pad(train_in, max_len),
        train_targets=train_targets,
        valid_inputs=_left_pad(valid_in, max_len),
        valid_targets=torch.from_numpy(np.array([s[-2] for s in sequences], dtype=np.int64)),
        test_inputs=_left_pad(test_in, max_len),
        test_targets=torch.from_numpy(np.array([s[-1] for s in sequences], dtype=np.int64)),
        item_counts=torch.from_numpy(item_counts),
        privacy_unit=privacy_unit,
        item_names=[PAD, *item_ids],
        valid_seen=_seen_matrix(valid_in, n_items),
        test_seen=_seen_matrix(test_in, n_items),
        summary=summary,
    )


def load_interaction_file(
    path: str | Path,
    *,
    max_len: int = 50,
    min_count: int = 5,
    user_col: str = "user_id",
    item_col: str = "item_id",
    time_col: str = "timestamp",
    name: str | None = None,
) -> SequenceData:
    """Read an interaction file (:func:`read_interactions`) and split it (:func:`preprocess_sasrec`).

    ``name`` defaults to the file's stem; the privacy unit is the user.
    """
    path = Path(path)
    table = read_interactions(path, user_col=user_col, item_col=item_col, time_col=time_col)
    return preprocess_sasrec(
        table, min_count=min_count, max_len=max_len, name=path.stem if name is None else name
    )


def load_movielens_100k(max_len: int = 50, min_count: int = 5) -> SequenceData:
    """MovieLens-100k as in SASRec/DPFormer: 943 users, 1,349 items with ``min_count=5``.

    Read from RecBole's packaged ``ml-100k.inter`` (:func:`movielens_100k_path`);
    every rating counts as an interaction. One user is one training record.
    """
    return load_interaction_file(
        movielens_100k_path(), max_len=max_len, min_count=min_count, name="ml-100k"
    )
