"""Trained tokenizers: round trips, special tokens, unknown pieces, save/load, bad input."""

import pytest

from dptrain.data.tokenizer import (
    SPECIAL_TOKENS,
    load_tokenizer,
    train_tokenizer,
    unknown_pieces,
)

TEXTS = [
    "The Eagle is a coffee shop near Burger King.",
    "Alimentum is not family-friendly, and is near the Burger King in the city centre.",
    "There is a cheap restaurant called The Wrestlers, rated 5 out of 5.",
] * 20


@pytest.mark.parametrize("kind", ["bpe", "wordpiece"])
def test_special_tokens_are_set_and_distinct(kind):
    tok = train_tokenizer(TEXTS, kind=kind, vocab_size=120)
    ids = {role: getattr(tok, role + "_id") for role in SPECIAL_TOKENS}
    assert all(isinstance(i, int) for i in ids.values()), ids
    assert len(set(ids.values())) == len(SPECIAL_TOKENS)
    for role, token in SPECIAL_TOKENS.items():
        assert getattr(tok, role) == token
    # no special token is added by encoding itself: the recipes place them
    assert not set(tok("The Eagle")["input_ids"]) & set(ids.values())


def test_bpe_round_trips_text_exactly():
    tok = train_tokenizer(TEXTS, kind="bpe", vocab_size=200)
    for text in (TEXTS[0], TEXTS[1], "Burger King near the Eagle, 5 out of 5."):
        assert tok.decode(tok(text)["input_ids"]) == text


def test_wordpiece_lowercases_and_round_trips_words():
    tok = train_tokenizer(TEXTS, kind="wordpiece", vocab_size=200)
    assert tok.decode(tok("The EAGLE coffee")["input_ids"]) == "the eagle coffee"


def test_vocab_size_bounds_the_vocabulary():
    small = train_tokenizer(TEXTS, kind="bpe", vocab_size=80)
    large = train_tokenizer(TEXTS, kind="bpe", vocab_size=300)
    assert len(small) <= 80 < len(large)


def test_unknown_pieces_names_what_cannot_be_encoded():
    tok = train_tokenizer(TEXTS, kind="bpe", vocab_size=200)
    assert unknown_pieces(tok, "The Eagle near Burger King") == []
    # "Z", a lower-case "b" and the CJK characters never occur in the training texts
    assert not any("Z" in t or "b" in t for t in TEXTS)
    assert unknown_pieces(tok, "Zebra 東京") == ["Z", "b", "東", "京"]


def test_save_and_load_give_the_same_encoding(tmp_path):
    tok = train_tokenizer(TEXTS, kind="bpe", vocab_size=150)
    tok.save_pretrained(tmp_path / "tok")
    again = load_tokenizer(tmp_path / "tok")
    assert again(TEXTS[1])["input_ids"] == tok(TEXTS[1])["input_ids"]
    assert again.pad_token == SPECIAL_TOKENS["pad_token"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kind": "unigram"}, r"kind='unigram' is not allowed"),
        ({"vocab_size": 10}, r"vocab_size=10 is not allowed"),
    ],
)
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        train_tokenizer(TEXTS, **kwargs)


def test_empty_texts_and_missing_folder_are_refused(tmp_path):
    with pytest.raises(ValueError, match="texts is empty"):
        train_tokenizer([], kind="bpe")
    with pytest.raises(ValueError, match="expected a local tokenizer folder"):
        load_tokenizer(tmp_path / "nope")


def test_bpe_splits_punctuation_from_words():
    tok = train_tokenizer(TEXTS, kind="bpe", vocab_size=200)
    with_comma = tok("near Burger King, rated")["input_ids"]
    without = tok("near Burger King rated")["input_ids"]
    # the same tokens for "King" in both, plus one token for the comma
    assert len(with_comma) == len(without) + 1
    assert tok.convert_ids_to_tokens(with_comma)[3] == ","


@pytest.mark.parametrize("kind", ["bpe", "wordpiece"])
def test_training_is_deterministic(kind):
    # HF's own WordPiece trainer breaks ties in hash order: it failed this test
    first = train_tokenizer(TEXTS, kind=kind, vocab_size=200).get_vocab()
    for _ in range(3):
        assert train_tokenizer(TEXTS, kind=kind, vocab_size=200).get_vocab() == first


def test_wordpiece_encodes_every_word_of_known_characters():
    tok = train_tokenizer(TEXTS, kind="wordpiece", vocab_size=100)
    # an unseen word made of seen characters splits into pieces, never [UNK]
    ids = tok("cafe kingburger")["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == "cafe kingburger"
