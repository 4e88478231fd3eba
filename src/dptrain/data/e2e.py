"""Table-to-text data: the cleaned E2E NLG data (Novikova et al. 2017; Dušek et al. 2019).

E2E pairs a restaurant "meaning representation" (a flat table,
``name[Alimentum], area[city centre], familyFriendly[no]``) with a human-written
description. Li et al. (2022, §5.2) fine-tune GPT-2 on it under DP; one record
(the privacy unit) is one (table, text) pair.

What is available offline (``../shared/data/e2e/``, CC BY-SA 4.0) is the
*cleaned* E2E dev and test sets (``devel-fixed.no-ol.csv``: 4,299 pairs over
1,484 tables; ``test-fixed.csv``: 4,693 pairs over 1,847 tables), with no
training split. :func:`load_e2e` therefore trains on the dev set: it splits the
dev pairs *by table* into train and validation (no table on both sides, so
validation measures generation for unseen tables, as the E2E test does) and
uses the test file as the test split. A folder that also holds the cleaned
training file ``train-fixed.no-ol.csv`` is used as published instead (train =
train file, validation = dev, test = test).

Any other table-to-text data can be read with :func:`read_table_text` from a
CSV or JSONL file with a table column and a text column.
"""

from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from pathlib import Path

from dptrain._checks import check_in_interval, check_int

__all__ = [
    "E2E_COLUMNS",
    "E2E_FILES",
    "E2ESplits",
    "default_e2e_dir",
    "load_e2e",
    "read_table_text",
    "split_by_table",
]

#: The table (meaning representation) and text (reference) columns of the E2E CSV files.
E2E_COLUMNS = ("mr", "ref")
#: The file names of the cleaned E2E release (Dušek et al. 2019) that :func:`load_e2e` reads.
E2E_FILES = {
    "train": "train-fixed.no-ol.csv",
    "dev": "devel-fixed.no-ol.csv",
    "test": "test-fixed.csv",
}
_SUFFIXES = (".csv", ".jsonl")


@dataclass
class E2ESplits:
    """Train / validation / test (table, text) pairs and where they came from.

    ``source`` says which file each split was drawn from (e.g. that the dev set
    is used for training for lack of a training split).
    """

    train: list[tuple[str, str]]
    valid: list[tuple[str, str]]
    test: list[tuple[str, str]]
    source: str

    @property
    def summary(self) -> dict[str, object]:
        """Sizes (pairs and distinct tables) of each split, and the source; for data.json."""
        out: dict[str, object] = {"source": self.source}
        for name in ("train", "valid", "test"):
            pairs = getattr(self, name)
            out[f"{name}_pairs"] = len(pairs)
            out[f"{name}_tables"] = len({t for t, _ in pairs})
        return out


def default_e2e_dir() -> Path | None:
    """``../shared/data/e2e`` next to the repository (or the working directory), if it exists."""
    repo = Path(__file__).resolve().parents[3]  # src/dptrain/data/e2e.py -> repository root
    for base in (repo, Path.cwd()):
        folder = base.parent / "shared" / "data" / "e2e"
        if (folder / E2E_FILES["dev"]).is_file():
            return folder
    return None


def read_table_text(
    path: str | Path, table_col: str = "mr", text_col: str = "ref"
) -> list[tuple[str, str]]:
    """(table, text) pairs from a CSV (header row) or JSONL (one object per line) file.

    Leading/trailing whitespace is stripped; rows whose table or text is empty
    are dropped (they carry no training signal and no reference).

    Raises:
        ValueError: the file lacks ``table_col`` or ``text_col`` (the message names
            the missing column(s) and the columns found), or has an unknown suffix.
        FileNotFoundError: no such file.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in _SUFFIXES:
        raise ValueError(
            f"path={str(path)!r} is not allowed: unknown file suffix {path.suffix!r}; "
            f"expected one of {', '.join(_SUFFIXES)}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"path={str(path)!r}: no such file")
    if suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            columns = list(reader.fieldnames or [])
            _check_columns(path, columns, table_col, text_col)
            rows = list(reader)
    else:
        rows = []
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{path}: line {number} is not valid JSON ({err})") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{path}: line {number} is not a JSON object")
                rows.append(row)
        columns = list(dict.fromkeys(k for row in rows for k in row))
        _check_columns(path, columns, table_col, text_col)
        absent = [i for i, row in enumerate(rows, 1) if table_col not in row or text_col not in row]
        if absent:
            raise ValueError(
                f"{path}: {len(absent)} record(s) lack {table_col!r} or {text_col!r} "
                f"(first: record {absent[0]})"
            )
    pairs = [(str(r[table_col] or "").strip(), str(r[text_col] or "").strip()) for r in rows]
    return [(t, x) for t, x in pairs if t and x]


def _check_columns(path: Path, columns: list[str], table_col: str, text_col: str) -> None:
    wanted = {"table_col": table_col, "text_col": text_col}
    missing = [f"{col!r} ({arg})" for arg, col in wanted.items() if col not in columns]
    if missing:
        found = ", ".join(repr(c) for c in columns) or "none"
        raise ValueError(
            f"{path} is missing column(s) {', '.join(missing)}; found columns: {found}. "
            "A table-to-text file needs a table column and a text column: name them with "
            "table_col= and text_col="
        )


def split_by_table(
    pairs: list[tuple[str, str]], valid_fraction: float, seed: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Split ``pairs`` into (train, valid) so that no table is on both sides.

    A seeded shuffle of the distinct tables; ``round(valid_fraction * tables)``
    of them (at least one when the fraction is > 0 and there are two or more
    tables) go to validation with all their pairs. Order within a split is the
    input order.
    """
    check_in_interval("valid_fraction", valid_fraction, 0.0, 1.0, low_open=False)
    tables = sorted({t for t, _ in pairs})
    random.Random(seed).shuffle(tables)
    n_valid = round(valid_fraction * len(tables))
    if valid_fraction > 0 and len(tables) >= 2:
        n_valid = min(max(n_valid, 1), len(tables) - 1)
    held = set(tables[:n_valid])
    return [p for p in pairs if p[0] not in held], [p for p in pairs if p[0] in held]


def load_e2e(data: str, *, valid_fraction: float = 0.1, seed: int = 0) -> E2ESplits:
    """The E2E splits from a folder of the cleaned release (see the module docstring).

    Args:
        data: a folder holding ``devel-fixed.no-ol.csv`` and ``test-fixed.csv`` (and
            optionally ``train-fixed.no-ol.csv``), or ``"e2e"`` for
            :func:`default_e2e_dir`.
        valid_fraction: the share of the dev *tables* held out for validation when
            the dev set is used for training.
        seed: the seed of that split.
    """
    check_int("seed", seed, 0)
    if data == "e2e":
        folder = default_e2e_dir()
        if folder is None:
            raise ValueError(
                "data='e2e' is not allowed here: the E2E data (../shared/data/e2e next to the "
                "repository) was not found; give data=PATH, a folder holding "
                f"{E2E_FILES['dev']} and {E2E_FILES['test']} (the cleaned E2E release)"
            )
    else:
        folder = Path(data)
    missing = [E2E_FILES[k] for k in ("dev", "test") if not (folder / E2E_FILES[k]).is_file()]
    if not folder.is_dir() or missing:
        raise ValueError(
            f"data={str(data)!r} is not allowed: expected 'e2e' or data=PATH, a folder holding "
            f"{E2E_FILES['dev']} and {E2E_FILES['test']}"
            + (f" ({', '.join(missing)} not found in {folder})" if folder.is_dir() else "")
        )
    dev = read_table_text(folder / E2E_FILES["dev"], *E2E_COLUMNS)
    test = read_table_text(folder / E2E_FILES["test"], *E2E_COLUMNS)
    if (folder / E2E_FILES["train"]).is_file():
        train = read_table_text(folder / E2E_FILES["train"], *E2E_COLUMNS)
        source = (
            f"{folder}: train = {E2E_FILES['train']}, valid = {E2E_FILES['dev']}, "
            f"test = {E2E_FILES['test']}"
        )
        return E2ESplits(train=train, valid=dev, test=test, source=source)
    check_in_interval("valid_fraction", valid_fraction, 0.0, 1.0)
    train, valid = split_by_table(dev, valid_fraction, seed)
    source = (
        f"{folder}: no training split available, so the E2E dev set ({E2E_FILES['dev']}) is "
        f"used for training, split by table into train and valid (valid_fraction="
        f"{valid_fraction:g}, seed={seed}, no table in both); test = {E2E_FILES['test']}"
    )
    return E2ESplits(train=train, valid=valid, test=test, source=source)
