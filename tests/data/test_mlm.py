"""Masked-LM data: BERT's masking rates and rules, chunk layout, the split, the cache."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from dptrain.data.mlm import (
    IGNORE_INDEX,
    MLMCollator,
    chunk_token_ids,
    load_mlm_data,
    load_mlm_tokenizer,
    mask_tokens,
)

PAD, CLS, SEP, MASK, UNK = 0, 5, 4, 6, 1
SPECIALS = (0, 1, 2, 3, 4, 5, 6)
VOCAB = 50


def _batch(rows=400, width=32, seed=0):
    """[CLS] random tokens [SEP] then padding of random length, like real chunks."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(7, VOCAB, (rows, width), generator=g)
    lengths = torch.randint(4, width - 1, (rows,), generator=g)
    for i, n in enumerate(lengths.tolist()):
        ids[i, 0] = CLS
        ids[i, n + 1] = SEP
        ids[i, n + 2 :] = PAD
    return ids


def _mask(ids, gen, prob=0.15):
    return mask_tokens(
        ids,
        mask_token_id=MASK,
        special_ids=SPECIALS,
        vocab_size=VOCAB,
        mask_prob=prob,
        generator=gen,
    )


def _within(count, n, p, sigmas=5.0):
    """|count - n p| within ``sigmas`` binomial standard deviations."""
    return abs(count - n * p) <= sigmas * math.sqrt(n * p * (1 - p))


def test_masking_rates_and_the_80_10_10_rule():
    ids = _batch()
    maskable = ~torch.isin(ids, torch.tensor(SPECIALS))
    gen = torch.Generator().manual_seed(1)
    n_maskable = selected = as_mask = as_random = unchanged = 0
    for _ in range(20):  # many draws: the rates are over ~100k maskable tokens
        inputs, labels = _mask(ids, gen)
        sel = labels != IGNORE_INDEX
        n_maskable += int(maskable.sum())
        selected += int(sel.sum())
        as_mask += int((inputs[sel] == MASK).sum())
        changed = sel & (inputs != ids) & (inputs != MASK)
        as_random += int(changed.sum())
        unchanged += int((sel & (inputs == ids)).sum())
        # labels: the original id exactly at selected positions, -100 elsewhere
        assert torch.equal(labels[sel], ids[sel])
        assert bool((labels[~sel] == IGNORE_INDEX).all())
        # unselected positions are untouched; specials and padding never selected
        assert torch.equal(inputs[~sel], ids[~sel])
        assert not bool(sel[~maskable].any())
        # a random replacement is never a special token
        assert not bool(torch.isin(inputs[changed], torch.tensor(SPECIALS)).any())
    assert _within(selected, n_maskable, 0.15)
    k = VOCAB - len(SPECIALS)  # a random draw equals the original with probability 1/k
    assert _within(as_mask, selected, 0.8)
    assert _within(as_random, selected, 0.1 * (1 - 1 / k))
    assert _within(unchanged, selected, 0.1 + 0.1 / k)
    assert as_mask + as_random + unchanged == selected


def test_masking_rate_follows_mask_prob():
    ids = _batch(rows=300)
    maskable = int((~torch.isin(ids, torch.tensor(SPECIALS))).sum())
    _, labels = _mask(ids, torch.Generator().manual_seed(3), prob=0.4)
    assert _within(int((labels != IGNORE_INDEX).sum()), maskable, 0.4)


def test_collator_masks_afresh_and_fixed_seed_repeats():
    ids = _batch(rows=50)
    gen = torch.Generator().manual_seed(0)
    collate = MLMCollator(
        pad_token_id=PAD, mask_token_id=MASK, special_ids=SPECIALS, vocab_size=VOCAB, generator=gen
    )
    records = [(row,) for row in ids]
    _, a_attention, a_labels = collate(records)
    _, _, b_labels = collate(records)
    assert not torch.equal(a_labels, b_labels)  # every use of an example draws new masks
    assert torch.equal(a_attention, (ids != PAD).long())
    # the same seed gives the same masks (what fixed validation masks rely on)
    x1 = _mask(ids, torch.Generator().manual_seed(9))
    x2 = _mask(ids, torch.Generator().manual_seed(9))
    assert torch.equal(x1[0], x2[0]) and torch.equal(x1[1], x2[1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mask_prob": 0.0}, "mask_prob"),
        ({"mask_prob": 1.0}, "mask_prob"),
        ({"vocab_size": 7}, "every id is a special token"),
    ],
)
def test_mask_tokens_bad_input(kwargs, match):
    args = {"mask_token_id": MASK, "special_ids": SPECIALS, "vocab_size": VOCAB}
    with pytest.raises(ValueError, match=match):
        mask_tokens(_batch(rows=2), **{**args, **kwargs})
    with pytest.raises(ValueError, match="input_ids"):
        mask_tokens(_batch(rows=2).float(), **args)


def test_chunk_layout_and_tails():
    tokens = [list(range(10, 10 + 13)), [7, 8], list(range(30, 36))]
    rows = chunk_token_ids(
        tokens, 8, cls_token_id=CLS, sep_token_id=SEP, pad_token_id=PAD, min_chunk_tokens=3
    )
    # article 1: 13 tokens -> pieces of 6, 6, 1 (the 1-token tail dropped); article 2: 2 < 3
    # dropped; article 3: exactly one full piece.
    assert rows.tolist() == [
        [CLS, 10, 11, 12, 13, 14, 15, SEP],
        [CLS, 16, 17, 18, 19, 20, 21, SEP],
        [CLS, 30, 31, 32, 33, 34, 35, SEP],
    ]
    rows = chunk_token_ids(
        [[7, 8, 9]], 8, cls_token_id=CLS, sep_token_id=SEP, pad_token_id=PAD, min_chunk_tokens=2
    )
    assert rows.tolist() == [[CLS, 7, 8, 9, SEP, PAD, PAD, PAD]]
    assert chunk_token_ids([[]], 8, cls_token_id=5, sep_token_id=4, pad_token_id=0).shape == (0, 8)


def _articles(n=40, seed=0):
    rng = np.random.default_rng(seed)
    words = [f"w{i}" for i in range(30)]
    texts = [" ".join(rng.choice(words, size=60)) + " ." for _ in range(n)]
    return texts


def test_load_splits_by_article_and_trains_the_tokenizer_on_train_only(tmp_path):
    texts = _articles()
    # a word that only held-out articles contain must not be in the trained vocabulary
    data0 = load_mlm_data(articles=texts, vocab_size=64, max_len=16, seed=0)
    s = data0.summary
    assert s["train_articles"] + s["valid_articles"] + s["test_articles"] == 40
    assert s["valid_articles"] == s["test_articles"] == 4
    from dptrain.data.news import _split_articles

    train, _, test = _split_articles(40, 0.1, 0.1, 0)
    secret = "zyxwvutsrq"

    def vocab_with_secret_in(article: int):
        texts2 = list(texts)
        texts2[article] = (secret + " ") * 30
        return load_mlm_data(articles=texts2, vocab_size=200, max_len=16, seed=0)

    assert secret in vocab_with_secret_in(int(train[0])).tokenizer.get_vocab()  # the control
    data = vocab_with_secret_in(int(test[0]))
    assert secret not in data.tokenizer.get_vocab()
    assert "w1" in data.tokenizer.get_vocab()
    # layout of every chunk
    for ids in (data.train_ids, data.valid_ids, data.test_ids):
        assert ids.shape[1] == 16 and len(ids) > 0
        assert bool((ids[:, 0] == data.cls_token_id).all())
    assert data.mask_token_id not in data.train_ids
    # fixed validation masks: the same for the same seed, different for another
    a = data.fixed_masks("valid", 0)
    b = data.fixed_masks("valid", 0)
    c = data.fixed_masks("valid", 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not torch.equal(a[2], c[2])
    assert len(data.fixed_masks("test", 0, limit=3)[0]) == 3
    with pytest.raises(ValueError, match="split='train'"):
        data.fixed_masks("train", 0)


def test_cache_returns_the_same_data(tmp_path):
    texts = _articles(n=20)
    first = load_mlm_data(articles=texts, vocab_size=64, max_len=16, cache_dir=tmp_path)
    second = load_mlm_data(articles=texts, vocab_size=64, max_len=16, cache_dir=tmp_path)
    assert "from_cache" in second.summary and "from_cache" not in first.summary
    assert torch.equal(first.train_ids, second.train_ids)
    assert torch.equal(first.test_ids, second.test_ids)
    assert first.tokenizer.get_vocab() == second.tokenizer.get_vocab()
    assert second.special_ids == first.special_ids
    # other settings: another entry
    third = load_mlm_data(articles=texts, vocab_size=64, max_len=12, cache_dir=tmp_path)
    assert "from_cache" not in third.summary and third.train_ids.shape[1] == 12


def test_reads_a_user_file_and_refuses_bad_input(tmp_path):
    path = tmp_path / "corpus.csv"
    pd.DataFrame({"title": ["t"] * 20, "text": _articles(n=20)}).to_csv(path, index=False)
    data = load_mlm_data(path, vocab_size=64, max_len=16)
    assert data.name == "corpus" and len(data.train_ids) > 0
    bad = tmp_path / "bad.csv"
    pd.DataFrame({"body": ["x"]}).to_csv(bad, index=False)
    with pytest.raises(ValueError, match="missing the column 'text'"):
        load_mlm_data(bad)
    with pytest.raises(ValueError, match="tokenizer="):
        load_mlm_data(articles=["a b c"], tokenizer=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="no chunk"):
        load_mlm_data(articles=["a b"] * 5, vocab_size=64, max_len=16, min_chunk_tokens=8)
    with pytest.raises(ValueError, match="tokenizer="):
        load_mlm_tokenizer(tmp_path / "nowhere")


def test_a_saved_tokenizer_loads_back(tmp_path):
    data = load_mlm_data(articles=_articles(n=20), vocab_size=64, max_len=16)
    data.tokenizer.save_pretrained(str(tmp_path / "tok"))
    again = load_mlm_data(articles=_articles(n=20), tokenizer=str(tmp_path / "tok"), max_len=16)
    assert torch.equal(again.train_ids, data.train_ids)
    assert "local tokenizer" in again.tokenizer_scope
