"""The user's own records for fine-tuning a causal language model, tokenized with loss masks.

Reading (:func:`read_lm_records`, or :func:`lm_records_from_rows` for rows in
memory): a ``.jsonl``, ``.csv``, ``.tsv`` or ``.parquet`` file whose records
have one of three formats (:data:`RECORD_FORMATS`), told apart by their columns
unless ``record_format=`` names one:

- ``"prompt_completion"``: columns ``prompt`` and ``completion``; the text is
  ``prompt + completion`` (no separator is added: put one at the end of the
  prompt) and the loss is on the completion only;
- ``"text"``: column ``text``; the loss is on every token;
- ``"chat"``: column ``messages``, a list of ``{"role", "content"}`` objects
  (a JSON string in CSV/TSV/Parquet cells, or a Parquet list of structs), roles
  in :data:`CHAT_ROLES`; rendered with the tokenizer's chat template and the
  loss is on the assistant turns only.

An optional ``user_col`` column (the person a record belongs to, for splits
and user-level privacy) and ``label_col`` column (default ``label``, read only
when present) are carried through to every record and example. One record is
one training example: it is never split into several (the privacy unit stays
the record, or the user).

Tokenizing (:func:`tokenize_lm_records`) gives ``input_ids`` and ``labels``
(HF convention: aligned with ``input_ids``, -100 where the loss must not look;
the model's logits at t predict ``labels[t + 1]``):

- prompt/completion and text are tokenized as one string (so the tokens are
  those the tokenizer gives the whole text), after the tokenizer's leading
  special tokens (e.g. BOS, when it adds one), and end with the tokenizer's EOS
  when it has one. The completion starts at the first token where the
  tokenization of the prompt alone and of the whole text differ (a token merged
  across the boundary counts as completion);
- chat: the conversation is rendered once per prefix of its messages
  (``apply_chat_template(messages[:k], tokenize=False)``); each rendering must
  be a prefix of the next (else a clear error: the template rewrites earlier
  turns). An assistant turn's loss tokens are what its message adds to the
  rendering of the messages before it with the generation prompt
  (``<|im_start|>assistant\\n`` for SmolLM2): its content and what the template
  writes after it up to the next message (the end-of-turn marker, a newline).
  Where that rendering is not a prefix of the turn, the whole turn is learnt,
  header included. A conversation must not start with an assistant message: the
  template's opening (a default system prompt, BOS) could not be told from the
  turn. Templates with ``{% generation %}`` blocks are asked for their own
  assistant mask instead (``return_assistant_tokens_mask``, which needs a fast
  tokenizer; any first message). No EOS is added: the template ends turns.

Truncation to ``max_length`` (see :func:`tokenize_lm_records`): the part before
the loss (the prompt; for chat, everything before the first assistant token) is
cut from the left so that the completion survives whole. A record whose
completion does not fit even with one prompt token left is *too long*, and
``on_too_long`` says what happens: ``"truncate"`` (default; cut and counted,
with a warning), ``"drop"`` (left out, counted, with a warning) or ``"error"``.

Batching: :func:`collate_lm` right-pads a chunk to its longest example;
:func:`dptrain.losses.per_example_lm_loss` is the per-example mean token loss
the clipping engine needs. :func:`split_lm_records` is a seeded train /
validation split by record, or by user when the records have users.
"""

from __future__ import annotations

import json
import math
import random
import re
import warnings
from collections.abc import Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from dptrain._checks import check_in_interval, check_int
from dptrain.data._files import check_table_path, read_table

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "CHAT_ROLES",
    "FORMAT_COLUMNS",
    "IGNORE_INDEX",
    "LM_SUFFIXES",
    "ON_TOO_LONG",
    "RECORD_FORMATS",
    "SYSTEM_PROMPTS",
    "LMExamples",
    "LMRecord",
    "LMRecords",
    "collate_lm",
    "detect_record_format",
    "lm_pad_token_id",
    "lm_records_from_rows",
    "prompt_ids",
    "read_lm_records",
    "render_chat",
    "split_by_group",
    "split_lm_records",
    "tokenize_lm_records",
]

#: The record formats, in the order detection reports them.
RECORD_FORMATS = ("prompt_completion", "text", "chat")
#: The columns each record format reads.
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
    "chat": ("messages",),
}
#: Roles a chat message may have; the loss is on ``"assistant"`` messages only.
CHAT_ROLES = ("system", "user", "assistant", "tool")
#: What :func:`tokenize_lm_records` may do with a record whose completion does not fit.
ON_TOO_LONG = ("truncate", "drop", "error")
#: File suffixes :func:`read_lm_records` understands.
LM_SUFFIXES = (".jsonl", ".csv", ".tsv", ".parquet")
#: ``system_prompt=`` words: the chat template's own system turn, or none at all (any other
#: text is the system prompt itself).
SYSTEM_PROMPTS = ("default", "none")
# A system turn's content no one writes: what the template adds for it is cut out.
_SYSTEM_MARKER = "\x00dptrain-system-marker\x00"
#: The label of a position the loss ignores (``torch.nn.functional.cross_entropy``'s default).
IGNORE_INDEX = -100

# Record rows named in an error or warning: enough to find them, not a wall of numbers.
_ROWS_SHOWN = 10
# {% generation %} / {%- generation -%}: the template marks assistant tokens itself.
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _format_help() -> str:
    return "; ".join(
        f"{name} (column{'s' if len(cols) > 1 else ''} {' and '.join(map(repr, cols))})"
        for name, cols in FORMAT_COLUMNS.items()
    )


# -- records ----------------------------------------------------------------------------


@dataclass(frozen=True)
class LMRecord:
    """One record; the fields of its format are set, the others keep their defaults.

    Attributes:
        row: 1-based position of the record in its source (file order).
        prompt: the prompt (``"prompt_completion"``; may be empty).
        completion: the completion (``"prompt_completion"``; never empty).
        text: the text (``"text"``; never empty).
        messages: ``({"role": ..., "content": ...}, ...)`` (``"chat"``; at least
            one assistant message).
        user: the record's user id as a string (None without ``user_col``).
        label: the value of the label column, as read (None without one).
    """

    row: int
    prompt: str = ""
    completion: str = ""
    text: str = ""
    messages: tuple[dict[str, str], ...] = ()
    user: str | None = None
    label: Any = None


@dataclass
class LMRecords:
    """Records of one format read from one source; a sequence of :class:`LMRecord`.

    Attributes:
        record_format: one of :data:`RECORD_FORMATS`.
        records: the records, in source order.
        source: where they were read from (a path, or a caller's description).
        user_col: the column the user ids were read from (None: no users).
        label_col: the column the labels were read from (None: no labels).
        notes: how the records were obtained (e.g. the split they are).
    """

    record_format: str
    records: list[LMRecord]
    source: str
    user_col: str | None = None
    label_col: str | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> LMRecord:
        return self.records[index]

    def __iter__(self) -> Iterator[LMRecord]:
        return iter(self.records)

    @property
    def users(self) -> list[str] | None:
        """Each record's user id, or None when the records have no users."""
        return None if self.user_col is None else [r.user for r in self.records]  # type: ignore[misc]

    @property
    def summary(self) -> dict[str, Any]:
        """Source, format, number of records (and of users, when there are users); for data.json."""
        out: dict[str, Any] = {
            "source": self.source,
            "record_format": self.record_format,
            "records": len(self.records),
        }
        if self.user_col is not None:
            out["user_col"] = self.user_col
            out["users"] = len({r.user for r in self.records})
        if self.label_col is not None:
            out["label_col"] = self.label_col
        out.update(self.notes)
        return out


def detect_record_format(columns: Sequence[str], source: str = "the records") -> str:
    """The record format whose columns (:data:`FORMAT_COLUMNS`) are all in ``columns``.

    Raises:
        ValueError: no format fits (the message lists the columns found and the
            formats allowed), or several do (then ``record_format=`` must choose).
    """
    present = set(columns)
    fits = [name for name, cols in FORMAT_COLUMNS.items() if set(cols) <= present]
    if len(fits) == 1:
        return fits[0]
    found = ", ".join(repr(str(c)) for c in columns) or "none"
    if not fits:
        raise ValueError(
            f"{source} has no recognised record format: found columns {found}; expected one "
            f"of the formats {_format_help()}"
        )
    raise ValueError(
        f"{source} fits several record formats ({', '.join(fits)}; found columns {found}): "
        f"pass record_format= one of {fits}"
    )


def _missing(value: Any) -> bool:
    return value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value))


def _plain(value: Any) -> Any:
    """A NumPy scalar as the Python scalar it holds (labels read by pandas)."""
    return value.item() if isinstance(value, np.generic) else value


def _string(value: Any, where: str, col: str) -> str:
    if _missing(value):
        return ""
    if not isinstance(value, str):
        raise ValueError(
            f"{where}: column {col!r} holds {type(value).__name__} {value!r}: expected a string"
        )
    return value


def _messages(value: Any, where: str, col: str) -> tuple[dict[str, str], ...]:
    """Validated ``{"role", "content"}`` messages from a list, a JSON string or a Parquet array."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{where}: column {col!r} is a string but not valid JSON ({err}): expected a "
                'list of {"role": ..., "content": ...} objects'
            ) from None
    if isinstance(value, np.ndarray):  # Parquet list<struct> cells come as object arrays
        value = value.tolist()
    if _missing(value) or not isinstance(value, list | tuple) or not value:
        raise ValueError(
            f"{where}: column {col!r} holds {value!r}: expected a non-empty list of "
            '{"role": ..., "content": ...} objects'
        )
    out = []
    for i, message in enumerate(value, 1):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise ValueError(
                f"{where}: message {i} of column {col!r} is {message!r}: expected an object "
                "with 'role' and 'content'"
            )
        role, content = message["role"], message["content"]
        if role not in CHAT_ROLES:
            raise ValueError(
                f"{where}: message {i} has role={role!r}, which is not allowed: expected one "
                f"of {list(CHAT_ROLES)}"
            )
        if not isinstance(content, str):
            raise ValueError(
                f"{where}: message {i} ({role}) has content {content!r}: expected a string"
            )
        # Only role and content reach the template: other keys (tool calls, names)
        # would change what it renders in ways the masks are not checked against.
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        roles = ", ".join(m["role"] for m in out)
        raise ValueError(
            f"{where}: the messages have no assistant turn (roles: {roles}): the loss is on "
            "assistant turns, so every conversation needs at least one"
        )
    return tuple(out)


def _check_column_arg(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{name}={value!r} is not allowed: expected a column name or None")


def _column_names(
    prompt_col: str, completion_col: str, text_col: str, messages_col: str
) -> dict[str, str]:
    """The record columns' names in the user's data: canonical name -> column."""
    names = {
        "prompt": prompt_col,
        "completion": completion_col,
        "text": text_col,
        "messages": messages_col,
    }
    for canonical, column in names.items():
        _check_column_arg(f"{canonical}_col", column)
        if column is None:
            raise ValueError(f"{canonical}_col=None is not allowed: expected a column name")
    taken: dict[str, str] = {}
    for canonical, column in names.items():
        if column in taken:
            raise ValueError(
                f"{canonical}_col={column!r} is not allowed: it is also "
                f"{taken[column]}_col; each record column needs its own name"
            )
        taken[column] = canonical
    return names


def lm_records_from_rows(
    rows: Sequence[Mapping[str, Any]],
    *,
    record_format: str | None = None,
    user_col: str | None = None,
    label_col: str | None = "label",
    source: str = "rows",
    prompt_col: str = "prompt",
    completion_col: str = "completion",
    text_col: str = "text",
    messages_col: str = "messages",
) -> LMRecords:
    """Records from rows in memory (one mapping per record), checked as :func:`read_lm_records` does.

    The columns are the keys found in any row, in order of appearance; a value
    that is absent, None or NaN is missing (an empty prompt; an error elsewhere).
    ``prompt_col``, ``completion_col``, ``text_col`` and ``messages_col`` name the
    record columns when the data calls them otherwise (``prompt_col="question"``).
    Every bad record is found before the error: it names the first
    ``_ROWS_SHOWN`` (10) and counts them all.
    """
    if record_format is not None and record_format not in RECORD_FORMATS:
        raise ValueError(
            f"record_format={record_format!r} is not allowed: expected None (detect it from "
            f"the columns) or one of {list(RECORD_FORMATS)}"
        )
    _check_column_arg("user_col", user_col)
    _check_column_arg("label_col", label_col)
    col = _column_names(prompt_col, completion_col, text_col, messages_col)
    if not rows:
        raise ValueError(f"{source} has no records: expected at least one")
    columns = list(dict.fromkeys(str(k) for row in rows for k in row))
    # Detection reads the canonical names: the user's "question" column is the prompt;
    # a column literally named "prompt" is then nobody's.
    canonical_of = {column: canonical for canonical, column in col.items()}
    renamed = {c for c, column in col.items() if column != c}
    as_canonical = [canonical_of.get(c, f"{c} (not read)" if c in renamed else c) for c in columns]
    if record_format is None:
        try:
            record_format = detect_record_format(as_canonical, source)
        except ValueError as err:
            if not renamed:
                raise
            chosen = ", ".join(f"{c}_col={col[c]!r}" for c in sorted(renamed))
            raise ValueError(f"{err} (with {chosen})") from None
    needed = [col[c] for c in FORMAT_COLUMNS[record_format]]
    missing = [c for c in needed if c not in columns]
    if missing:
        found = ", ".join(map(repr, columns)) or "none"
        raise ValueError(
            f"{source} has no column(s) {', '.join(map(repr, missing))}, which "
            f"record_format={record_format!r} reads; found columns: {found}"
        )
    if user_col is not None:
        if user_col in needed or user_col == label_col:
            raise ValueError(
                f"user_col={user_col!r} is not allowed: it is also the "
                f"{'label' if user_col == label_col else 'record'} column"
            )
        if user_col not in columns:
            found = ", ".join(map(repr, columns)) or "none"
            raise ValueError(
                f"user_col={user_col!r} is not allowed: {source} has no such column; "
                f"found columns: {found}"
            )
    if label_col is not None and label_col not in columns:
        label_col = None  # optional: carried only when the source has it

    records = []
    problems: list[str] = []
    for number, row in enumerate(rows, 1):
        try:
            records.append(_record(row, number, source, record_format, col, user_col, label_col))
        except ValueError as err:
            problems.append(str(err))
    if len(problems) == 1:
        raise ValueError(problems[0])
    if problems:
        # All of them, counted, the first ones named: one error per run of the command
        # would make a user with 30 bad records run it 30 times.
        more = len(problems) - _ROWS_SHOWN
        listed = "\n".join(f"  {p}" for p in problems[:_ROWS_SHOWN])
        raise ValueError(
            f"{len(problems)} of {len(rows)} records of {source} are not usable"
            + (f" (the first {_ROWS_SHOWN} shown)" if more > 0 else "")
            + f":\n{listed}"
            + (f"\n  ... and {more} more" if more > 0 else "")
        )
    return LMRecords(
        record_format=record_format,
        records=records,
        source=source,
        user_col=user_col,
        label_col=label_col,
    )


def _record(
    row: Mapping[str, Any],
    number: int,
    source: str,
    record_format: str,
    col: dict[str, str],
    user_col: str | None,
    label_col: str | None,
) -> LMRecord:
    """Record ``number`` (1-based) of ``row``, or a ValueError naming it and what is wrong."""
    where = f"{source}: record {number}"
    user = None
    if user_col is not None:
        value = row.get(user_col)
        if _missing(value):
            raise ValueError(
                f"{where} has no user in column user_col={user_col!r}: every record needs "
                "one (a record cannot be assigned to a user for the split and user-level "
                "privacy otherwise)"
            )
        # As text, so that the same id read from CSV ("7") and JSONL (7) is one user.
        user = str(_plain(value))
    label = None if label_col is None else _plain(row.get(label_col))
    label = None if _missing(label) else label
    fields: dict[str, Any] = {}
    if record_format == "prompt_completion":
        fields["prompt"] = _string(row.get(col["prompt"]), where, col["prompt"])
        fields["completion"] = _string(row.get(col["completion"]), where, col["completion"])
        if not fields["completion"].strip():
            raise ValueError(
                f"{where} has an empty completion: every prompt/completion record needs a "
                "non-empty completion (the loss is on it)"
            )
    elif record_format == "text":
        fields["text"] = _string(row.get(col["text"]), where, col["text"])
        if not fields["text"].strip():
            raise ValueError(f"{where} has an empty text: every text record needs some text")
    else:
        fields["messages"] = _messages(row.get(col["messages"]), where, col["messages"])
    return LMRecord(row=number, user=user, label=label, **fields)


def read_lm_records(
    path: str | Path,
    *,
    record_format: str | None = None,
    user_col: str | None = None,
    label_col: str | None = "label",
    prompt_col: str = "prompt",
    completion_col: str = "completion",
    text_col: str = "text",
    messages_col: str = "messages",
) -> LMRecords:
    """Records from a ``.jsonl``, ``.csv``, ``.tsv`` or ``.parquet`` file (see the module docstring).

    Args:
        path: the file.
        record_format: one of :data:`RECORD_FORMATS`, or None to detect it from the
            columns (exactly one format's columns must be present).
        user_col: the column holding each record's user id (read as text), or None.
        label_col: the column carried through as each record's label when the file
            has it (None: never).
        prompt_col, completion_col, text_col, messages_col: the names of the record
            columns in this file, when they are not ``prompt``, ``completion``, ``text``
            and ``messages``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: unknown suffix; no (or an ambiguous) record format, naming the
            columns found and the formats allowed; a missing column; a record with an
            empty completion or text, bad messages (not a list of role/content
            objects, an unknown role, no assistant turn) or no user: every such record,
            counted, the first 10 named.
    """
    path = Path(path)
    check_table_path(path, LM_SUFFIXES)
    table = read_table(path)
    # to_dict keeps each cell's value (lists from JSONL, arrays from Parquet).
    rows = table.to_dict("records")
    return lm_records_from_rows(
        rows,
        record_format=record_format,
        user_col=user_col,
        label_col=label_col,
        source=str(path),
        prompt_col=prompt_col,
        completion_col=completion_col,
        text_col=text_col,
        messages_col=messages_col,
    )


# -- splitting ----------------------------------------------------------------------------


def split_by_group(
    groups: Sequence[Hashable], valid_fraction: float, seed: int
) -> tuple[list[int], list[int]]:
    """Seeded (train, valid) positions of ``groups`` with no group on both sides.

    The distinct groups are sorted, shuffled with ``random.Random(seed)``, and the
    first ``round(valid_fraction * groups)`` go to validation with all their
    positions (at least one group when the fraction is > 0 and there are two or
    more groups, and never all of them). Positions are increasing on each side.
    The groups must be mutually comparable (all strings, or all integers).
    """
    check_in_interval("valid_fraction", valid_fraction, 0.0, 1.0, low_open=False)
    seed = check_int("seed", seed, 0)
    distinct = sorted(set(groups))
    random.Random(seed).shuffle(distinct)
    n_valid = round(valid_fraction * len(distinct))
    if valid_fraction > 0 and len(distinct) >= 2:
        n_valid = min(max(n_valid, 1), len(distinct) - 1)
    held = set(distinct[:n_valid])
    train = [i for i, g in enumerate(groups) if g not in held]
    valid = [i for i, g in enumerate(groups) if g in held]
    return train, valid


def split_lm_records(
    records: LMRecords, *, valid_fraction: float = 0.1, seed: int = 0
) -> tuple[LMRecords, LMRecords]:
    """Seeded (train, valid) records: by user when the records have users, else by record.

    With users, all of a user's records are on the same side (validation then
    measures unseen users, and user-level privacy counts each user once); the
    fraction is of users. The split is :func:`split_by_group`'s; records keep their
    order and ``row``. Each side's ``notes`` say how it was made.
    """
    users = records.users
    groups: Sequence[Hashable] = users if users is not None else range(len(records))
    train_idx, valid_idx = split_by_group(groups, valid_fraction, seed)
    unit = "user" if users is not None else "record"
    note = {"split_by": unit, "valid_fraction": float(valid_fraction), "seed": seed}
    return tuple(  # type: ignore[return-value]
        replace(
            records,
            records=[records.records[i] for i in idx],
            notes={**records.notes, **note, "split": name},
        )
        for name, idx in (("train", train_idx), ("valid", valid_idx))
    )


# -- tokenizing ---------------------------------------------------------------------------


@dataclass
class LMExamples:
    """Tokenized examples; a sequence of ``{"input_ids": (T,), "labels": (T,)}`` long tensors.

    ``labels`` is ``input_ids`` with :data:`IGNORE_INDEX` where the loss must not
    look. Batch with ``functools.partial(collate_lm, pad_token_id=examples.pad_token_id)``.

    Attributes:
        examples: one dict per kept record, in record order.
        rows: each example's record ``row``.
        users: each example's user (None when the records have none).
        record_labels: each example's label (None when the records have none).
        pad_token_id: the id :func:`collate_lm` pads with (:func:`lm_pad_token_id`).
        summary: ``record_format``, ``records``, ``examples``, ``max_length``,
            ``on_too_long``, ``prompt_truncated`` (prompt cut, completion whole),
            ``too_long`` (completion did not fit), ``too_long_rows`` (the first
            ones), ``truncated``, ``dropped``, ``tokens``, ``loss_tokens`` (labels
            a shifted loss sees), ``eos_token_id`` (None: no EOS added) and, for
            chat, ``chat_masking`` (``"incremental"`` or ``"generation"``).
    """

    examples: list[dict[str, Tensor]]
    rows: list[int]
    users: list[str] | None
    record_labels: list[Any] | None
    pad_token_id: int
    summary: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return self.examples[index]


def lm_pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokenizer's pad id, else its EOS id (causal LMs often have no pad token).

    Padding positions have attention 0 and label -100, so the id only has to be a
    valid token.
    """
    for name in ("pad_token_id", "eos_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(
        "tokenizer is not allowed: it has neither a pad token nor an EOS token to pad with; "
        "set tokenizer.pad_token first"
    )


def _encode(tokenizer: PreTrainedTokenizerBase, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """The token ids a prompt/completion or text record starts with, for generation:
    the tokenizer's leading special tokens, then ``prompt`` (what training put before
    the completion; ``""`` for text records)."""
    return _leading_special_ids(tokenizer) + (_encode(tokenizer, [prompt])[0] if prompt else [])


def _leading_special_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The tokens the tokenizer puts before a text (BOS for Llama-2-like tokenizers; often none).

    Texts are tokenized without special tokens (so that a prompt's tokens are a
    prefix of its record's), and these are put back in front.
    """
    probe = "a"
    with_special = list(tokenizer(probe, add_special_tokens=True)["input_ids"])
    plain = list(tokenizer(probe, add_special_tokens=False)["input_ids"])
    for start in range(len(with_special) - len(plain) + 1):
        if with_special[start : start + len(plain)] == plain:
            return with_special[:start]
    return []


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _apply_template(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict], gen: bool, where: str
) -> str:
    try:
        return tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=gen
        )
    except Exception as err:  # the template's own errors (e.g. "roles must alternate")
        raise ValueError(f"{where}: the tokenizer's chat template failed: {err}") from err


def _check_system_prompt(system_prompt: Any) -> str:
    if not isinstance(system_prompt, str) or not system_prompt.strip():
        raise ValueError(
            f"system_prompt={system_prompt!r} is not allowed: expected 'default' (the chat "
            "template's own), 'none' (no system turn) or the text of a system prompt"
        )
    return system_prompt


def _with_system(messages: Sequence[dict], system_prompt: str) -> list[dict]:
    """``messages`` with the system turn ``system_prompt`` asks for (a record's own wins)."""
    messages = list(messages)
    if system_prompt in SYSTEM_PROMPTS or (messages and messages[0]["role"] == "system"):
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


def _render(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict],
    gen: bool,
    where: str,
    system_prompt: str = "default",
) -> str:
    """The conversation as the template writes it, with the system turn ``system_prompt``
    asks for (see :func:`render_chat`)."""
    messages = _with_system(messages, system_prompt)
    if system_prompt != "none" or (messages and messages[0]["role"] == "system"):
        return _apply_template(tokenizer, messages, gen, where)
    # No system turn: a template such as SmolLM2's writes its default system prompt
    # whenever the first message is not a system one, and has no switch for it. Render
    # with a marker system turn and cut out exactly that turn, keeping what the template
    # writes before any turn (a BOS such as Llama 3's <|begin_of_text|>).
    first, second = ({"role": "system", "content": _SYSTEM_MARKER + str(k)} for k in (1, 2))
    one = _apply_template(tokenizer, [first], False, where)
    two = _apply_template(tokenizer, [first, second], False, where)
    # a system turn as written after another turn, i.e. without the conversation's opening
    turn = two[len(one) :].replace(second["content"], first["content"])
    text = _apply_template(tokenizer, [first, *messages], gen, where)
    if not (two.startswith(one) and one.endswith(turn) and text.startswith(one)):
        raise ValueError(
            f"{where}: system_prompt='none' is not allowed with this chat template: its "
            "system turn cannot be told apart from the rest of the rendering, so it cannot "
            "be cut out; use 'default' or a system prompt text"
        )
    return one[: len(one) - len(turn)] + text[len(one) :]


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[dict],
    *,
    add_generation_prompt: bool = False,
    system_prompt: str = "default",
) -> str:
    """``messages`` rendered with the tokenizer's chat template, as training renders them.

    ``system_prompt``: ``"default"`` leaves the template alone (SmolLM2's writes "You are
    a helpful AI assistant named SmolLM, trained by Hugging Face" before a conversation
    without a system message); ``"none"`` renders no system turn at all; any other text
    is the system turn of every conversation without one. A record's own system
    message is always kept as it is.
    """
    system_prompt = _check_system_prompt(system_prompt)
    return _render(tokenizer, messages, add_generation_prompt, "render_chat", system_prompt)


def _chat_incremental(
    tokenizer: PreTrainedTokenizerBase,
    messages: tuple[dict[str, str], ...],
    where: str,
    system_prompt: str = "default",
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered conversation and which are assistant tokens (see the module doc)."""
    prefixes = [""]
    for k in range(1, len(messages) + 1):
        text = _render(tokenizer, messages[:k], False, where, system_prompt)
        if not text.startswith(prefixes[-1]):
            raise ValueError(
                f"{where}: the chat template's rendering of the first {k - 1} message(s) is not "
                f"a prefix of its rendering of the first {k} (it rewrites earlier turns, e.g. "
                "drops reasoning or adds a date), so the assistant tokens cannot be located by "
                "rendering message by message; use a template with {% generation %} blocks or "
                "prompt/completion records"
            )
        prefixes.append(text)
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if k == 0:
            # Templates write a default system prompt or BOS with the first message,
            # and there is no shorter rendering to tell them from the header.
            raise ValueError(
                f"{where}: the conversation starts with an assistant message, whose start "
                "cannot be located by rendering message by message; put a system or user "
                "message first"
            )
        start, end = prefixes[k], prefixes[k + 1]
        # The role header belongs to the prompt: at inference the generation prompt
        # writes it and the model writes only what follows.
        header = _render(tokenizer, messages[:k], True, where, system_prompt)
        if header.startswith(start) and end.startswith(header):
            start = header
        spans.append((start, end))
    strings = list(dict.fromkeys([prefixes[-1], *(s for span in spans for s in span)]))
    ids = dict(zip(strings, _encode(tokenizer, strings), strict=True))
    full = ids[prefixes[-1]]
    mask = [False] * len(full)
    for start, end in spans:
        # Where a token straddles a boundary, it goes to the side after it.
        a, b = _common_prefix(ids[start], full), _common_prefix(ids[end], full)
        mask[a:b] = [True] * (b - a)
    return full, mask


def _chat_generation(
    tokenizer: PreTrainedTokenizerBase,
    messages: tuple[dict[str, str], ...],
    where: str,
    system_prompt: str = "default",
) -> tuple[list[int], list[bool]]:
    """The template's own assistant mask (its ``{% generation %}`` blocks)."""
    if system_prompt == "none" and messages[0]["role"] != "system":
        raise ValueError(
            f"{where}: system_prompt='none' is not allowed with a template that has "
            "{% generation %} blocks (its assistant mask comes from the template as it is); "
            "use 'default' or a system prompt text"
        )
    try:
        out = tokenizer.apply_chat_template(
            _with_system(messages, system_prompt),
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
        )
    except Exception as err:
        raise ValueError(f"{where}: the tokenizer's chat template failed: {err}") from err
    return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]


def _fit(
    head: list[int],
    prompt: list[int],
    body: list[int],
    mask: list[bool],
    max_length: int,
    truncate: bool,
) -> tuple[list[int], list[int], str]:
    """``(input_ids, labels, status)`` of one record within ``max_length`` tokens.

    ``head`` (leading special tokens) is always kept; ``prompt`` has no loss;
    ``body`` (the completion, or the conversation from its first assistant token)
    has the loss where ``mask``. Status: ``"fits"``, ``"prompt_truncated"`` (the
    prompt lost tokens on its left, the body is whole) or ``"too_long"`` (the body
    does not fit beside one prompt token; with ``truncate``, the prompt keeps at
    most half the room, its last tokens, and the body its first tokens).
    """
    room = max_length - len(head)
    p, c = len(prompt), len(body)
    if p + c <= room:
        status = "fits"
    elif c + min(p, 1) <= room:
        status = "prompt_truncated"
        prompt = prompt[p - (room - c) :]
    else:
        status = "too_long"
        if truncate:
            keep = min(p, room // 2)
            prompt, body, mask = prompt[p - keep :], body[: room - keep], mask[: room - keep]
    ids = head + prompt + body
    labels = [IGNORE_INDEX] * (len(head) + len(prompt))
    labels += [t if m else IGNORE_INDEX for t, m in zip(body, mask, strict=True)]
    return ids, labels, status


def _parts(
    records: LMRecords,
    tokenizer: PreTrainedTokenizerBase,
    eos: int | None,
    chat_masking: str,
    system_prompt: str = "default",
) -> Iterator[tuple[list[int], list[int], list[bool]]]:
    """``(prompt, body, mask)`` token ids per record, before the head and truncation."""
    fmt = records.record_format
    if fmt == "chat":
        masker = _chat_generation if chat_masking == "generation" else _chat_incremental
        for record in records:
            where = f"{records.source}: record {record.row}"
            ids, mask = masker(tokenizer, record.messages, where, system_prompt)
            if not any(mask):
                raise ValueError(
                    f"{where}: the chat template renders its assistant turns to no tokens, "
                    "so the record has nothing to learn from"
                )
            first = mask.index(True)
            yield ids[:first], ids[first:], mask[first:]
        return
    if fmt == "text":
        prompts = [[] for _ in records.records]
        fulls = _encode(tokenizer, [r.text for r in records])
    else:
        prompts = _encode(tokenizer, [r.prompt for r in records])
        fulls = _encode(tokenizer, [r.prompt + r.completion for r in records])
    for prompt, full in zip(prompts, fulls, strict=True):
        cut = _common_prefix(prompt, full)
        body = full[cut:]
        if eos is not None and (not body or body[-1] != eos):
            body.append(eos)
        yield full[:cut], body, [True] * len(body)


def tokenize_lm_records(
    records: LMRecords,
    tokenizer: PreTrainedTokenizerBase,
    *,
    max_length: int = 512,
    on_too_long: str = "truncate",
    system_prompt: str = "default",
) -> LMExamples:
    """Token ids and loss labels of every record, within ``max_length`` tokens.

    How each format is tokenized and masked is in the module docstring. A record
    longer than ``max_length`` first loses prompt tokens from its left (for chat:
    the tokens before its first assistant token), keeping the completion whole; the
    tokenizer's leading special tokens (BOS) stay. If the completion (with its EOS)
    does not fit even beside one prompt token, the record is *too long* and
    ``on_too_long`` decides:

    - ``"truncate"`` (default): the prompt keeps its last ``min(prompt, room // 2)``
      tokens and the completion its first tokens (no EOS then), ``room`` being
      ``max_length`` less the leading special tokens; a warning counts them.
      ``max_length`` is a budget the user chose, and cutting is what it usually
      means for a tokenizer; the warning and ``summary`` keep it from being silent;
    - ``"drop"``: the record gets no example; a warning counts them (``rows``
      and ``summary`` say which);
    - ``"error"``: a ValueError counting them and naming the first rows.

    Args:
        records: from :func:`read_lm_records` or :func:`lm_records_from_rows`.
        tokenizer: a Hugging Face tokenizer (a fast one for chat templates with
            ``{% generation %}`` blocks); chat records need its ``chat_template``.
        max_length: the most tokens an example may have, >= 2.
        on_too_long: one of :data:`ON_TOO_LONG`.
        system_prompt: chat records only: ``"default"`` (the template's own; SmolLM2's
            adds a 21-token default system prompt to every conversation without a system
            message), ``"none"`` (no system turn) or the text of the system turn to add
            (see :func:`render_chat`).

    Raises:
        ValueError: a bad argument; a tokenizer without a chat template for chat
            records, or without a pad or EOS token; a template that rewrites earlier
            turns or renders no assistant token; too-long records with
            ``on_too_long="error"``.
    """
    max_length = check_int("max_length", max_length, 2)
    system_prompt = _check_system_prompt(system_prompt)
    if on_too_long not in ON_TOO_LONG:
        raise ValueError(
            f"on_too_long={on_too_long!r} is not allowed: expected one of {list(ON_TOO_LONG)}"
        )
    pad = lm_pad_token_id(tokenizer)
    fmt = records.record_format
    summary: dict[str, Any] = {"record_format": fmt}
    chat_masking = ""
    if fmt == "chat":
        template = getattr(tokenizer, "chat_template", None)
        if not template:
            raise ValueError(
                "tokenizer is not allowed for chat records: it has no chat template (set "
                "tokenizer.chat_template, or give prompt/completion records)"
            )
        generation = isinstance(template, str) and _GENERATION_BLOCK.search(template)
        chat_masking = "generation" if generation else "incremental"
        summary["chat_masking"] = chat_masking
        summary["system_prompt"] = system_prompt
        # The template writes the special tokens (and closes turns) itself.
        head, eos = [], None
    else:
        head = _leading_special_ids(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        eos = eos if isinstance(eos, int) else None
    if len(head) >= max_length:
        raise ValueError(
            f"max_length={max_length} is not allowed: the tokenizer puts {len(head)} special "
            "token(s) before every text, leaving no room; expected more"
        )

    examples: list[dict[str, Tensor]] = []
    kept: list[int] = []
    status_rows: dict[str, list[int]] = {"prompt_truncated": [], "too_long": []}
    tokens = loss_tokens = 0
    parts = _parts(records, tokenizer, eos, chat_masking, system_prompt)
    for i, (prompt, body, mask) in enumerate(parts):
        ids, labels, status = _fit(
            head, prompt, body, mask, max_length, truncate=on_too_long == "truncate"
        )
        if status != "fits":
            status_rows[status].append(records.records[i].row)
        if status == "too_long" and on_too_long != "truncate":
            continue
        examples.append(
            {
                "input_ids": torch.tensor(ids, dtype=torch.long),
                "labels": torch.tensor(labels, dtype=torch.long),
            }
        )
        kept.append(i)
        tokens += len(ids)
        # A label at position 0 is never predicted (nothing comes before it).
        loss_tokens += sum(label != IGNORE_INDEX for label in labels[1:])

    too_long = status_rows["too_long"]
    if too_long:
        shown = ", ".join(map(str, too_long[:_ROWS_SHOWN])) + (
            ", ..." if len(too_long) > _ROWS_SHOWN else ""
        )
        what = (
            f"{len(too_long)} of {len(records)} record(s) of {records.source} do not fit "
            f"max_length={max_length} tokens with their whole completion (records {shown})"
        )
        if on_too_long == "error":
            raise ValueError(
                f"{what}; pass a larger max_length, or on_too_long='truncate' (cut them) or "
                "'drop' (leave them out)"
            )
        done = (
            "their completions were cut (on_too_long='truncate')"
            if on_too_long == "truncate"
            else "they were left out (on_too_long='drop')"
        )
        warnings.warn(f"{what}: {done}", stacklevel=2)

    summary.update(
        {
            "records": len(records),
            "examples": len(examples),
            "max_length": max_length,
            "on_too_long": on_too_long,
            "prompt_truncated": len(status_rows["prompt_truncated"]),
            "too_long": len(too_long),
            "too_long_rows": too_long[:_ROWS_SHOWN],
            "truncated": len(too_long) if on_too_long == "truncate" else 0,
            "dropped": len(too_long) if on_too_long == "drop" else 0,
            "tokens": tokens,
            "loss_tokens": loss_tokens,
            "eos_token_id": eos,
        }
    )
    users = records.users
    has_labels = records.label_col is not None
    return LMExamples(
        examples=examples,
        rows=[records.records[i].row for i in kept],
        users=None if users is None else [users[i] for i in kept],
        record_labels=[records.records[i].label for i in kept] if has_labels else None,
        pad_token_id=pad,
        summary=summary,
    )


# -- batching -----------------------------------------------------------------------------


def collate_lm(examples: Sequence[Mapping[str, Tensor]], *, pad_token_id: int) -> dict[str, Tensor]:
    """Right-pad examples to the longest of the chunk: ``input_ids``, ``attention_mask``, ``labels``.

    Each is a ``(B, T)`` long tensor; padding has id ``pad_token_id``, attention 0
    and label :data:`IGNORE_INDEX`, so it is in no example's loss. Keys other than
    ``input_ids`` and ``labels`` are ignored. No examples give ``(0, 0)`` tensors.
    """
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int) or pad_token_id < 0:
        raise ValueError(
            f"pad_token_id={pad_token_id!r} is not allowed: expected a token id (an integer >= 0)"
        )
    lengths = []
    for i, example in enumerate(examples):
        ids, labels = example["input_ids"], example["labels"]
        if ids.dim() != 1 or ids.shape != labels.shape:
            raise ValueError(
                f"example {i} has input_ids of shape {tuple(ids.shape)} and labels of shape "
                f"{tuple(labels.shape)}: expected two 1-D tensors of the same length"
            )
        lengths.append(ids.shape[0])
    width = max(lengths, default=0)
    input_ids = torch.full((len(lengths), width), pad_token_id, dtype=torch.long)
    labels = torch.full((len(lengths), width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, (example, n) in enumerate(zip(examples, lengths, strict=True)):
        input_ids[i, :n] = example["input_ids"]
        labels[i, :n] = example["labels"]
        attention_mask[i, :n] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
