"""Tokenizers for the language-model recipes: train one on the training split, or load one.

No pretrained causal-LM tokenizer ships offline, so the recipes train a
subword tokenizer with Hugging Face ``tokenizers`` (Rust, fast, the format
every HF model reads) on the *training* texts only, and save it in the run
folder; any local HF tokenizer folder can be given instead.

Two kinds:

- ``bpe``: byte-pair encoding over whitespace-split words with punctuation
  split off, a ``Metaspace`` pre-tokenizer and decoder so that decoding gives
  back the spacing of the text (GPT-2 style generation output is scored by
  BLEU/ROUGE on the decoded string);
- ``wordpiece``: BERT's WordPiece with lowercasing, for masked-LM pretraining
  (its vocabulary learnt by the deterministic BPE trainer: HF's own
  WordPiece trainer gives a different vocabulary in every process).

Every trained tokenizer has the same special tokens (:data:`SPECIAL_TOKENS`),
so a recipe can rely on ``pad_token``, ``bos_token``, ``eos_token``,
``sep_token``, ``mask_token``, ``cls_token`` and ``unk_token`` being set.
Encoding adds no special tokens by itself (no post-processor): a recipe
places ``[BOS]`` / ``[SEP]`` / ``[EOS]`` / ``[CLS]`` where its format wants them.

A note on privacy: the vocabulary is a function of the training texts, so a
released tokenizer is outside the DP guarantee unless it was trained on public
text. The recipes say so in their results (``tokenizer_scope``).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from dptrain._checks import check_int

__all__ = [
    "SPECIAL_TOKENS",
    "TOKENIZER_KINDS",
    "load_tokenizer",
    "train_tokenizer",
    "unknown_pieces",
]

#: The special tokens of every trained tokenizer, by their HF role.
SPECIAL_TOKENS = {
    "pad_token": "[PAD]",
    "unk_token": "[UNK]",
    "bos_token": "[BOS]",
    "eos_token": "[EOS]",
    "sep_token": "[SEP]",
    "cls_token": "[CLS]",
    "mask_token": "[MASK]",
}

TOKENIZER_KINDS = ("bpe", "wordpiece")


def train_tokenizer(texts: Iterable[str], *, kind: str = "bpe", vocab_size: int = 8000):
    """A ``PreTrainedTokenizerFast`` trained on ``texts`` (see the module docstring).

    Args:
        texts: the training texts (an iterable of strings; read once).
        kind: ``bpe`` (causal LM) or ``wordpiece`` (masked LM, lowercased).
        vocab_size: the largest vocabulary, special tokens included (>= 64); a
            WordPiece vocabulary adds the ``##`` form of characters that only
            occur word-initially (at most the alphabet's size more).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if kind not in TOKENIZER_KINDS:
        raise ValueError(f"kind={kind!r} is not allowed: expected one of {TOKENIZER_KINDS}")
    vocab_size = check_int("vocab_size", vocab_size, 64)
    specials = list(SPECIAL_TOKENS.values())
    unk = SPECIAL_TOKENS["unk_token"]
    if kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token=unk))
        tok.normalizer = normalizers.NFKC()
        # punctuation split from words ("centre," -> "▁centre" ","), so a word has one token
        # sequence wherever it stands; the Metaspace decoder still restores the spacing
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()]
        )
        tok.decoder = decoders.Metaspace()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=specials, show_progress=False
        )
    else:
        # HF's WordPieceTrainer breaks ties between equally frequent merges in hash order,
        # so the same texts give a different vocabulary in every process; its BPE trainer
        # over Metaspace-marked words is deterministic. Train that, then read its vocabulary
        # as WordPiece's: a word-initial piece ("▁ing") is "ing", any other "##ing".
        tok = Tokenizer(models.BPE(unk_token=unk))
        tok.normalizer = normalizers.BertNormalizer(lowercase=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.BertPreTokenizer(), pre_tokenizers.Metaspace()]
        )
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=specials, show_progress=False
        )
    texts = list(texts)
    if not texts:
        raise ValueError("texts is empty: a tokenizer needs training text")
    tok.train_from_iterator(texts, trainer=trainer)
    if kind == "wordpiece":
        tok = _wordpiece_from_metaspace_bpe(tok, specials, unk)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **SPECIAL_TOKENS)


def _wordpiece_from_metaspace_bpe(bpe, specials: list[str], unk: str):
    """A BERT WordPiece tokenizer whose vocabulary is ``bpe``'s, read as word pieces.

    Ids: the special tokens first, then the pieces in the BPE's id order (its
    merge order), each character both word-initial and as a ``##`` continuation
    so that every word of known characters encodes without ``[UNK]``.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    marker = "\u2581"  # Metaspace's word-start mark
    vocab: dict[str, int] = {}
    for token in specials:
        vocab.setdefault(token, len(vocab))
    for token, _ in sorted(bpe.get_vocab().items(), key=lambda item: item[1]):
        if token in specials or token == marker:
            continue
        if token.startswith(marker):
            vocab.setdefault(token[1:], len(vocab))
        else:
            vocab.setdefault("##" + token, len(vocab))
            if len(token) == 1:
                vocab.setdefault(token, len(vocab))
    for token in list(vocab):  # every single character also continues a word
        if len(token) == 1 and token not in specials:
            vocab.setdefault("##" + token, len(vocab))
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    return tok


def load_tokenizer(path: str | Path):
    """A local Hugging Face tokenizer folder (``save_pretrained`` output); never downloads."""
    from transformers import AutoTokenizer

    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"tokenizer={str(path)!r} is not allowed: expected a local tokenizer folder "
            "(save_pretrained output) or 'train'"
        )
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    missing = [role for role in ("pad_token", "eos_token") if getattr(tok, role, None) is None]
    if missing:
        raise ValueError(
            f"tokenizer={str(path)!r} is not allowed: it has no {', '.join(missing)} "
            "(the recipes need padding and an end-of-text token)"
        )
    return tok


def unknown_pieces(tokenizer, text: str) -> list[str]:
    """The parts of ``text`` that ``tokenizer`` can only encode as its unknown token.

    Empty when the text encodes faithfully. Used to refuse canaries (and other
    inputs whose exact tokens matter) that the vocabulary cannot represent.
    """
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    unk_id = tokenizer.unk_token_id
    if unk_id is None:
        return []
    return [
        text[start:end]
        for token_id, (start, end) in zip(enc["input_ids"], enc["offset_mapping"], strict=True)
        if token_id == unk_id
    ]
