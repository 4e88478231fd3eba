"""Recipe: private table-to-text generation with a GPT-2-style causal LM (Li et al. 2022, §5.2).

``dptrain train table2text [--config FILE] [key=value ...]`` runs, in order:

1. **setup**: check the config, load the E2E splits (:func:`dptrain.data.e2e.load_e2e`:
   for lack of a training split the cleaned E2E *dev* set is split by table into
   train and validation; the test file is the test split), fix delta
   (``1/(2N)``, Li et al.), calibrate the noise with PLD over the planned steps.
   Bad input stops here, before anything is written.
2. **fit** (:func:`fit_table2text`): train a BPE tokenizer on the training
   pairs (or load a local one), build a ``GPT2LMHeadModel`` from a config (tied
   input/output embedding, so the engine's phantom clipping of the tied matrix
   is exercised) or load a local pretrained checkpoint (``init_from``), and
   train it on ``[BOS] table [SEP] text [EOS]`` with the loss on the text
   (and ``[EOS]``) only. Private runs use DP-Adam through
   :func:`~dptrain.privacy_engine.make_private` (Poisson-sampled logical
   batches, flat per-example clipping at C = 0.1, noise once per step, every
   step in the ledger); ``epsilon=null`` trains with plain Adam. After every
   epoch the validation token NLL / perplexity is measured; the best epoch by
   validation loss is kept.
3. **evaluate**: the distinct test tables are decoded once, with greedy search
   and with beam search (beam 5, Li et al. App. J); corpus BLEU (``sacrebleu``,
   all references of a table, 13a tokenisation, case-sensitive) and ROUGE-L F
   (``rouge-score``, best reference per table, mean over tables). A validation
   subset is decoded with beam search for hyper-parameter selection (the
   batch x learning-rate study reads its BLEU).
4. **save**: the run folder holds ``config.yaml``, ``data.json``, ``ledger.json``,
   ``metrics.jsonl`` (one line per epoch), ``results.json`` (with ``audit=true``
   its ``audit`` section: the white-box one-run audit of this run,
   :class:`~dptrain.audit.GradientCanaries`, on every private path),
   ``generations.jsonl`` (every decoded test table), ``samples.md``,
   ``tokenizer/``, ``model/`` (``save_pretrained``: a valid ``init_from``) and
   PNG plots of the validation loss and of epsilon over steps.

Per-example loss (what is clipped): the *mean* over the example's text tokens
and its ``[EOS]`` of the token cross-entropy (``loss_reduction="mean"``; ``sum``
is available). Either way every example contributes one gradient, clipped to
norm C, so the guarantee does not depend on the choice; the mean keeps the
gradient scale independent of the text length.

Privacy unit: one (table, text) pair (example-level DP, as in Li et al.). A
table appears in several pairs (up to ~30 in E2E), so the guarantee for a
*table* is the group-privacy one. The tokenizer's vocabulary is trained on the
training pairs and is released with the model outside the DP guarantee
(``tokenizer_scope`` in results.json); the validation pairs (used for model
selection) are not protected either.

Defaults (Li et al. 2022, App. I, Table 5, adapted to ~3.9k training pairs and
a model trained from scratch on CPU): C = 0.1, delta = 1/(2N), Adam with a
constant learning rate 2e-3 (Li et al.: 1e-3, no decay; a from-scratch model
needs a little more), a large batch relative to N (256 of 3,888, q ~ 0.066;
Li et al.: 1024 of 42k, q ~ 0.024) and 20 epochs (Li et al.: 10 from a
pretrained GPT-2), a 2-layer, 128-wide GPT-2 (~0.65M parameters with the
2,000-token vocabulary). Tables are linearised as ``key : value | ...``
(:func:`linearize_table`, the format Li et al. inherit from prefix-tuning).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dptrain._checks import check_in_interval, check_int, check_positive
from dptrain.accounting import (
    ACCOUNTANTS,
    PrivacyLedger,
    calibrate_noise,
    make_accountant,
    sample_rate_from_batch,
    steps_from_epochs,
)
from dptrain.audit.gradient_canaries import GradientCanaries
from dptrain.clipping.precision import upcast
from dptrain.config import save_config
from dptrain.data.e2e import load_e2e
from dptrain.losses import per_example_cross_entropy
from dptrain.precision import amp_context, check_amp
from dptrain.progress import EpsilonBar, EpsilonCurve
from dptrain.recipes._causal_lm import (
    LLAMA_PROJECTIONS,
    add_lora,
    check_model_folder,
    load_causal_lm,
)
from dptrain.recipes._common import (
    DELTA_RULES,
    attach_audit_canaries,
    check_audit,
    check_choice,
    cycle,
    epsilon_so_far,
    print_plan,
    recipe_privacy_record,
    report_audit,
    resolve_delta,
    write_privacy_records,
)
from dptrain.recipes._schedules import lr_lambda
from dptrain.supported import check_device

__all__ = [
    "DECODE_BATCHING",
    "FittedLM",
    "Table2TextConfig",
    "decode",
    "encode_pairs",
    "fit_table2text",
    "group_references",
    "linearize_table",
    "score_generations",
    "text_log_likelihood",
    "train_table2text",
]

log = logging.getLogger(__name__)

_REDUCTIONS = ("mean", "sum")
#: How :func:`decode` batches prompts of different lengths.
DECODE_BATCHING = ("by_length", "left_padded")
_SCHEDULES = ("constant", "linear")


@dataclass
class Table2TextConfig:
    """Settings of one run; every field can be set in YAML or as ``key=value``."""

    # data
    data: str = "e2e"
    """``e2e`` (``../shared/data/e2e`` next to the repository) or a folder holding
    ``devel-fixed.no-ol.csv`` and ``test-fixed.csv`` (the cleaned E2E release)."""
    valid_fraction: float = 0.1
    """Share of the dev *tables* held out for validation (dev is the training data)."""
    split_seed: int = 0
    """Seed of the train/valid split (fixed across training seeds)."""
    max_len: int = 128
    """Longest sequence ``[BOS] table [SEP] text [EOS]`` in tokens (longer ones are cut)."""
    # tokenizer and model
    tokenizer: str | None = None
    """``train`` (BPE on the training pairs), a local HF tokenizer folder, or null:
    ``init_from``'s tokenizer if ``init_from`` is given, else ``train``."""
    vocab_size: int = 2000
    """Vocabulary of a trained tokenizer."""
    init_from: str | None = None
    """A local HF GPT-2 checkpoint folder (``save_pretrained``) to fine-tune; null
    builds the model from the config below (random weights)."""
    pretrained: str | None = None
    """A pretrained causal LM to fine-tune with its own tokenizer: ``smollm2-135m-instruct``
    (the packaged SmolLM2-135M-Instruct) or a local Hugging Face causal-LM folder. Its
    end-of-text token also separates table and text when it has no separator token, so
    no embedding row is added. Null: ``init_from``, or a GPT-2 built from the config below."""
    num_layers: int | None = None
    """Keep only the first ``num_layers`` decoder layers of ``pretrained`` (null: all)."""
    lora_r: int = 0
    """LoRA rank on ``lora_targets`` of ``pretrained``, the base frozen; 0 trains every
    parameter (the tied embedding by phantom clipping)."""
    lora_alpha: float = 16.0
    """LoRA scaling alpha (the update is scaled by alpha / r)."""
    lora_targets: tuple[str, ...] = LLAMA_PROJECTIONS
    """Linear modules of ``pretrained`` that get adapters (Llama's seven projections by default)."""
    n_layer: int = 2
    """Layers of a GPT-2 built from scratch."""
    n_embd: int = 128
    """Hidden size of a GPT-2 built from scratch."""
    n_head: int = 4
    """Attention heads of a GPT-2 built from scratch."""
    dropout: float = 0.0
    """Dropout probability of the model."""
    # privacy
    epsilon: float | None = 3.0
    """Target epsilon for the whole run; ``null`` trains without privacy."""
    delta: float | str = "1/(2N)"
    """A number, or ``1/(2N)`` (Li et al.) / ``1/N^1.1`` with N the training pairs."""
    accountant: str = "pld"
    """Accountant that calibrates sigma and reports epsilon: ``pld`` (tightest), ``rdp`` or ``gdp`` (approximate)."""
    max_grad_norm: float = 0.1
    """The clipping norm C (Li et al.: 0.1)."""
    clipping: str = "flat"
    """Clipping function: ``flat`` (clip to C), ``automatic`` (normalize, Bu et al.) or ``per_layer``."""
    mode: str = "book_keeping"
    """How per-example gradients are clipped: ``book_keeping`` (one backward pass) or ``ghost`` (two, less memory)."""
    loss_reduction: str = "mean"
    """Per-example loss over its text tokens: ``mean`` or ``sum`` (see the module docstring)."""
    # optimisation
    epochs: int = 20
    """Passes over the training pairs (steps = floor(epochs / q))."""
    batch_size: int = 256
    """Expected logical batch size B (q = B / N); the non-private run uses it as is."""
    lr: float = 2e-3
    """Learning rate."""
    lr_schedule: str = "constant"
    """``constant`` (Li et al.) or ``linear`` (warm-up then linear decay to 0)."""
    warmup_fraction: float = 0.0
    """Share of the steps spent warming the learning rate up linearly."""
    weight_decay: float = 0.0
    """Weight decay of the optimizer."""
    max_physical_batch_size: int = 64
    """Most records per forward/backward chunk (memory); the logical batch and the guarantee are unchanged."""
    amp: str = "off"
    """``off`` (float32) or ``bf16``: training and validation forward passes under bfloat16
    autocast, float32 weights (dptrain.precision); clipped sums are formed in float32.
    About 1.5x faster per SmolLM2 LoRA step on an AVX512-BF16 CPU. Decoding stays float32:
    autocast casts every weight again for each generated token, which made E2E greedy
    decoding slower, not faster (docs/lm.md)."""
    # evaluation and output
    eval_batch_size: int = 64
    """Records per batch when evaluating (no effect on training)."""
    beam_size: int = 5
    """Beams of beam-search decoding."""
    max_new_tokens: int = 64
    """Most tokens decoded per table."""
    no_repeat_ngram_size: int = 0
    """Forbid repeating n-grams of this size in decoding (0: off, the default)."""
    decode_batching: str = "by_length"
    """``by_length`` (no padding) or ``left_padded`` (fewer, full batches: faster for a
    large model; the same texts up to rounding), see :func:`decode`."""
    max_test_tables: int | None = None
    """Decode at most this many distinct test tables (null: all)."""
    max_valid_tables: int | None = 100
    """Decode at most this many distinct validation tables (beam) for selection; 0: none."""
    decode_test: bool = True
    """Decode the test tables (greedy and beam) and score BLEU / ROUGE-L."""
    n_samples: int = 8
    """Sample generations written to samples.md."""
    num_threads: int = 0
    """torch threads for this run; 0 leaves torch's default."""
    device: str = "cpu"
    """Where the model trains and decodes: ``cpu``, ``cuda`` or ``cuda:N``."""
    seed: int = 0
    """Fixes initialization, sampling and noise (reproducible, so the noise is known to anyone who knows it)."""
    audit: bool = False
    """Run the white-box one-run audit on this run (dptrain.audit.GradientCanaries): its
    lower bounds go to results.json's ``audit`` section; the canaries are in the model."""
    audit_canaries: int = 100_000
    """Canaries of the audit (at most the trainable coordinates)."""
    out: str = "runs/table2text"
    """Output folder of the run."""
    save_checkpoint: bool = True
    """Save the trained model in the run folder."""
    progress: bool = True
    """Show a progress bar on stderr."""

    def __post_init__(self) -> None:
        check_choice("accountant", self.accountant, tuple(ACCOUNTANTS))
        check_choice("clipping", self.clipping, ("flat", "automatic"))
        check_choice("mode", self.mode, ("book_keeping", "ghost"))
        check_choice("loss_reduction", self.loss_reduction, _REDUCTIONS)
        check_choice("lr_schedule", self.lr_schedule, _SCHEDULES)
        check_choice("decode_batching", self.decode_batching, DECODE_BATCHING)
        check_amp(self.amp)
        check_int("max_len", self.max_len, 8)
        check_int("vocab_size", self.vocab_size, 64)
        for name in ("n_layer", "n_embd", "n_head", "epochs", "batch_size"):
            check_int(name, getattr(self, name), 1)
        for name in ("max_physical_batch_size", "eval_batch_size", "beam_size"):
            check_int(name, getattr(self, name), 1)
        check_int("max_new_tokens", self.max_new_tokens, 1)
        for name in ("no_repeat_ngram_size", "n_samples", "num_threads", "seed", "split_seed"):
            check_int(name, getattr(self, name), 0)
        check_int("lora_r", self.lora_r, 0)
        check_positive("lora_alpha", self.lora_alpha)
        if self.num_layers is not None:
            check_int("num_layers", self.num_layers, 1)
        self._check_pretrained()
        for name in ("max_test_tables", "max_valid_tables"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0)
        if self.epsilon is not None:
            check_positive("epsilon", self.epsilon)
        if isinstance(self.delta, str):
            check_choice("delta", self.delta, DELTA_RULES)
        else:
            check_in_interval("delta", self.delta, 0.0, 1.0)
        check_audit(
            self.audit, self.audit_canaries, private=self.private, non_private="epsilon=null"
        )
        check_in_interval("valid_fraction", self.valid_fraction, 0.0, 1.0)
        check_in_interval("dropout", self.dropout, 0.0, 1.0, low_open=False)
        check_in_interval("warmup_fraction", self.warmup_fraction, 0.0, 1.0, low_open=False)
        for name in ("lr", "max_grad_norm"):
            check_positive(name, getattr(self, name))
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} is not allowed: expected >= 0")
        if self.init_from is None and self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd={self.n_embd} is not allowed with n_head={self.n_head}: "
                "expected a multiple of n_head"
            )
        check_device(self.device)
        if self.init_from is not None and not Path(self.init_from).is_dir():
            raise ValueError(
                f"init_from={self.init_from!r} is not allowed: expected a local folder holding "
                "a save_pretrained GPT-2 checkpoint (nothing is downloaded)"
            )

    def _check_pretrained(self) -> None:
        if self.pretrained is None:
            for name, default in (("lora_r", 0), ("num_layers", None)):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} is not allowed without pretrained=: "
                        "LoRA and layer cuts apply to a pretrained model"
                    )
            return
        for name in ("init_from", "tokenizer"):
            if getattr(self, name) is not None:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not allowed with pretrained="
                    f"{self.pretrained!r}: the pretrained model comes with its own weights "
                    "and tokenizer; expected null"
                )
        check_model_folder(self.pretrained, "pretrained")
        if self.lora_r > 0 and not self.lora_targets:
            raise ValueError(
                f"lora_targets={list(self.lora_targets)!r} is not allowed with lora_r="
                f"{self.lora_r}: expected module names such as {list(LLAMA_PROJECTIONS)}"
            )

    @property
    def private(self) -> bool:
        return self.epsilon is not None


@dataclass
class FittedLM:
    """What :func:`fit_table2text` returns: the best-on-validation model and its record."""

    model: Any  # transformers.GPT2LMHeadModel, in eval mode
    tokenizer: Any
    ledger: PrivacyLedger | None
    epsilon: float | None
    """Final PLD epsilon (or the configured accountant's) at ``delta``; None if non-private."""
    delta: float | None
    noise_multiplier: float | None
    steps: int
    history: list[dict]
    wall_s: float
    best_epoch: int = 0
    sample_rate: float = 0.0
    epsilon_by_accountant: dict[str, float] = field(default_factory=dict)
    snr_first: float | None = None
    """Mean gradient SNR ||clipped sum|| / ||noise|| over the first 30 steps (Li et al. Fig. 3b)."""
    tokenizer_note: str = ""
    n_truncated: int = 0
    n_trainable: int = 0
    canaries: GradientCanaries | None = None
    """The audit's canaries (``audit=true``), attached to the run's DP optimizer."""


# -- encoding ---------------------------------------------------------------------------------


_ATTRIBUTE = re.compile(r"\s*([^,\[\]]+?)\s*\[([^\]]*)\]\s*(?:,|$)")


def linearize_table(table: str) -> str:
    """``name[Alimentum], area[city centre]`` -> ``name : Alimentum | area : city centre``.

    The E2E meaning representation in the linear form Li & Liang (2021) and Li
    et al. (2022) feed GPT-2, so that the attribute values are separate words
    (a whitespace tokenizer would otherwise see ``name[Alimentum],`` as one word
    and the model could not copy the name). A table that is not a list of
    ``key[value]`` items is returned unchanged. Applied inside
    :func:`encode_pairs`, :func:`text_log_likelihood`, :func:`decode` and the
    tokenizer training, so callers always pass the raw table.
    """
    items = _ATTRIBUTE.findall(table)
    if not items or "".join(_ATTRIBUTE.sub("", table).split()):
        return table
    return " | ".join(f"{key} : {value}" for key, value in items)


def _special_ids(tokenizer) -> tuple[int, int, int]:
    """[BOS], [SEP], [EOS] ids; [BOS] falls back to [EOS] (GPT-2 has one token for both)."""
    eos = tokenizer.eos_token_id
    bos = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else eos
    sep = tokenizer.sep_token_id
    if eos is None or sep is None:
        raise ValueError(
            "tokenizer is not allowed: it needs an end-of-text token and a separator token "
            f"(eos_token={tokenizer.eos_token!r}, sep_token={tokenizer.sep_token!r})"
        )
    return bos, sep, eos


def _pad_id(tokenizer) -> int:
    pad = tokenizer.pad_token_id
    return pad if pad is not None else tokenizer.eos_token_id


def _encode(
    tokenizer, pairs: Sequence[tuple[str, str]], max_len: int
) -> tuple[list[list[int]], list[int], list[int], int]:
    """Token ids per pair, the index where the text starts, where it ends, and #truncated."""
    bos, sep, eos = _special_ids(tokenizer)
    tables = tokenizer([linearize_table(t) for t, _ in pairs], add_special_tokens=False)
    tables = tables["input_ids"]
    texts = tokenizer([x for _, x in pairs], add_special_tokens=False)["input_ids"]
    seqs, starts, ends, truncated = [], [], [], 0
    for table_ids, text_ids in zip(tables, texts, strict=True):
        ids = [bos, *table_ids, sep, *text_ids, eos]
        start = len(table_ids) + 2
        end = start + len(text_ids)  # exclusive; ids[end] is [EOS]
        if len(ids) > max_len:
            truncated += 1
            ids = ids[:max_len]
        seqs.append(ids)
        starts.append(min(start, len(ids)))
        ends.append(min(end, len(ids)))
    return seqs, starts, ends, truncated


def encode_pairs(tokenizer, pairs: Sequence[tuple[str, str]], max_len: int) -> dict[str, Tensor]:
    """``[BOS] table [SEP] text [EOS]`` as padded tensors (B, T) for a causal LM.

    Returns ``input_ids`` (right-padded with the pad token), ``attention_mask``
    (1 on real tokens) and ``labels``: the token id on the text and its
    ``[EOS]``, -100 on ``[BOS]``, the table, ``[SEP]`` and padding. Labels are
    aligned with ``input_ids`` (HF convention): position t's logits predict
    ``labels[t + 1]``. A sequence longer than ``max_len`` is cut at ``max_len``
    (losing the end of its text); T is the longest sequence of the batch.
    """
    check_int("max_len", max_len, 4)
    if not pairs:
        raise ValueError("pairs is empty: nothing to encode")
    seqs, starts, _, _ = _encode(tokenizer, pairs, max_len)
    return _padded(tokenizer, seqs, starts)


def _padded(tokenizer, seqs: list[list[int]], starts: list[int]) -> dict[str, Tensor]:
    """:func:`encode_pairs`'s tensors from :func:`_encode`'s ids and text starts."""
    width = max(len(s) for s in seqs)
    pad = _pad_id(tokenizer)
    input_ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), width), dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (ids, start) in enumerate(zip(seqs, starts, strict=True)):
        row = torch.tensor(ids, dtype=torch.long)
        input_ids[i, : len(ids)] = row
        attention_mask[i, : len(ids)] = 1
        labels[i, start : len(ids)] = row[start:]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _losses(model, input_ids: Tensor, attention_mask: Tensor, labels: Tensor, reduction: str):
    """Per-example cross-entropy of the labelled (text) tokens, (B,)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    logits = upcast(logits)  # bf16 under autocast: the log-softmax in float32
    return per_example_cross_entropy(logits[:, :-1], labels[:, 1:], reduction=reduction)


def _device(model) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def text_log_likelihood(
    model, tokenizer, pairs: Sequence[tuple[str, str]], *, max_len: int, batch_size: int = 64
) -> Tensor:
    """log p(text | table) per pair, (N,) float64: the sum over the text tokens (not ``[EOS]``).

    The sum of log p(token | [BOS] table [SEP] preceding text) over the text's
    tokens, i.e. minus the log-perplexity Carlini et al. (2019) rank canaries by.
    The model is run in eval mode (and restored to its mode afterwards).
    """
    check_int("batch_size", batch_size, 1)
    check_int("max_len", max_len, 4)
    if not pairs:
        return torch.zeros(0, dtype=torch.float64)
    was_training = model.training
    model.eval()
    device = _device(model)
    out = []
    try:
        for i in range(0, len(pairs), batch_size):
            chunk = list(pairs[i : i + batch_size])
            seqs, starts, ends, _ = _encode(tokenizer, chunk, max_len)
            enc = _padded(tokenizer, seqs, starts)  # tokenized once for both
            ids = enc["input_ids"].to(device)
            logits = model(input_ids=ids, attention_mask=enc["attention_mask"].to(device)).logits
            logp = torch.log_softmax(logits[:, :-1].double(), -1)
            token_logp = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # log p(ids[t+1])
            keep = torch.zeros_like(token_logp, dtype=torch.bool)
            for row, (start, end) in enumerate(zip(starts, ends, strict=True)):
                keep[row, start - 1 : end - 1] = True  # targets ids[start:end]: the text tokens
            out.append((token_logp * keep).sum(1).cpu())
    finally:
        model.train(was_training)
    return torch.cat(out)


# -- tokenizer and model -------------------------------------------------------------------------


def _tokenizer_for(cfg: Table2TextConfig, train: Sequence[tuple[str, str]], out: Path | None):
    """The tokenizer the config names and a note on its scope; trained ones saved under ``out``."""
    from dptrain.data.tokenizer import load_tokenizer, train_tokenizer

    source = cfg.tokenizer
    if source is None:
        source = cfg.init_from if cfg.init_from is not None else "train"
    if source == "train":
        texts = [linearize_table(t) for t, _ in train] + [x for _, x in train]
        tok = train_tokenizer(texts, kind="bpe", vocab_size=cfg.vocab_size)
        if out is not None:
            tok.save_pretrained(str(out / "tokenizer"))
        note = (
            "BPE tokenizer trained on the training pairs' tables and texts: its vocabulary is "
            "released with the model and is NOT covered by the DP guarantee"
        )
    else:
        tok = load_tokenizer(source)
        note = f"tokenizer loaded from {source} (outside this run's data)"
    if tok.sep_token_id is None:  # e.g. GPT-2's tokenizer: add one (the model is resized)
        tok.add_special_tokens({"sep_token": "[SEP]"})
    if tok.pad_token_id is None:  # padding is masked out everywhere; any id will do
        tok.pad_token = tok.eos_token
    return tok, note


def _pretrained_model(cfg: Table2TextConfig):
    """``cfg.pretrained`` with its tokenizer (a separator added without a new token) and
    LoRA adapters when ``cfg.lora_r`` > 0, else every parameter trainable."""
    model, tok = load_causal_lm(
        cfg.pretrained,
        num_layers=cfg.num_layers,
        max_length=cfg.max_len,
        setting="pretrained",
        length_setting="max_len",
    )
    # A new [SEP] row would be the one untrained (random) row of a pretrained embedding;
    # the end-of-text token separates as well (Li & Liang's format puts it there for GPT-2).
    if tok.sep_token_id is None:
        tok.sep_token = tok.eos_token
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if cfg.lora_r > 0:
        model = add_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, targets=cfg.lora_targets)
    else:
        model.requires_grad_(True)  # every parameter, the tied embedding and norms included
    note = f"the pretrained model's own tokenizer ({cfg.pretrained}; public, outside this run)"
    return model, tok, note


def _build_model(cfg: Table2TextConfig, tokenizer):
    import transformers

    transformers.logging.set_verbosity_error()
    if cfg.init_from is not None:
        model = transformers.GPT2LMHeadModel.from_pretrained(cfg.init_from, local_files_only=True)
        if len(tokenizer) > model.get_input_embeddings().num_embeddings:
            model.resize_token_embeddings(len(tokenizer))
        if model.config.n_positions < cfg.max_len:
            raise ValueError(
                f"max_len={cfg.max_len} is not allowed with init_from={cfg.init_from!r}: the "
                f"checkpoint has n_positions={model.config.n_positions}"
            )
        return model
    bos, _, eos = _special_ids(tokenizer)
    config = transformers.GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=cfg.max_len,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=_pad_id(tokenizer),
        tie_word_embeddings=True,
    )
    return transformers.GPT2LMHeadModel(config)


# -- training ------------------------------------------------------------------------------------


def _collate(items: list[tuple[Tensor, Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    """Stack (ids, mask, labels) rows and cut the padding columns no row of the chunk uses."""
    ids, mask, labels = (torch.stack(x) for x in zip(*items, strict=True))
    width = max(int(mask.sum(1).max()), 2)
    return ids[:, :width], mask[:, :width], labels[:, :width]


def _lr_lambda(total_steps: int, schedule: str, warmup_fraction: float):
    """Constant (after an optional linear warm-up) or warm-up then linear decay to 0."""
    return lr_lambda(total_steps, schedule, round(warmup_fraction * total_steps))


@torch.no_grad()
def _valid_loss(model, data: dict[str, Tensor], batch_size: int, amp: str = "off") -> float:
    """Token-level NLL (nats per text token, [EOS] included) on the encoded pairs."""
    was_training = model.training
    model.eval()
    device = _device(model)
    total, count = 0.0, 0
    for i in range(0, len(data["input_ids"]), batch_size):
        ids, mask, labels = _collate(
            list(
                zip(
                    data["input_ids"][i : i + batch_size],
                    data["attention_mask"][i : i + batch_size],
                    data["labels"][i : i + batch_size],
                    strict=True,
                )
            )
        )
        with amp_context(amp, device):
            losses = _losses(model, ids.to(device), mask.to(device), labels.to(device), "sum")
        total += float(losses.sum())
        count += int((labels[:, 1:] != -100).sum())
    model.train(was_training)
    return total / max(count, 1)


def fit_table2text(
    cfg: Table2TextConfig,
    train: list[tuple[str, str]],
    valid: list[tuple[str, str]],
    out: Path,
) -> FittedLM:
    """Train the LM on ``train`` and keep the best epoch by validation loss on ``valid``.

    Trains the tokenizer (``cfg.tokenizer == "train"`` or null without
    ``init_from``) on the training pairs, builds or loads the model, trains it
    (privately iff ``cfg.epsilon`` is not None: DP-Adam, noise calibrated so the
    planned steps are (epsilon, delta)-DP), and writes ``tokenizer/``,
    ``ledger.json`` and ``metrics.jsonl`` under ``out``. Returns the model in
    eval mode with the best weights (and, with ``cfg.audit``, the canaries the
    private run's optimizer added and observed: :attr:`FittedLM.canaries`).
    """
    from dptrain.privacy_engine import make_private

    t0 = time.perf_counter()
    if not train:
        raise ValueError("train is empty: no pairs to train on")
    if not valid:
        raise ValueError("valid is empty: model selection needs validation pairs")
    logging.getLogger("absl").setLevel(logging.ERROR)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    if cfg.pretrained is not None:
        model, tokenizer, note = _pretrained_model(cfg)
    else:
        tokenizer, note = _tokenizer_for(cfg, train, out)
        model = _build_model(cfg, tokenizer)
    model = model.to(cfg.device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    n = len(train)
    q = sample_rate_from_batch(min(cfg.batch_size, n), n)
    steps = steps_from_epochs(cfg.epochs, q)
    if cfg.batch_size > n:
        raise ValueError(
            f"batch_size={cfg.batch_size} is not allowed: the training split has only {n} pairs"
        )
    delta = resolve_delta(cfg.delta, n) if cfg.private else None
    sigma = None
    if cfg.private:
        try:
            sigma = calibrate_noise(
                cfg.epsilon, delta, sample_rate=q, steps=steps, accountant=cfg.accountant
            ).noise_multiplier
        except ValueError as err:
            raise ValueError(
                f"epsilon={cfg.epsilon} cannot be reached for epochs={cfg.epochs} at "
                f"batch_size={cfg.batch_size} (q={q:.4g}, {steps} steps, delta={delta:.3g}): {err}"
            ) from None

    seqs, starts, _, n_truncated = _encode(tokenizer, train, cfg.max_len)
    enc = _padded(tokenizer, seqs, starts)
    valid_enc = encode_pairs(tokenizer, valid, cfg.max_len)
    dataset = torch.utils.data.TensorDataset(enc["input_ids"], enc["attention_mask"], enc["labels"])
    # A logical batch is chunked in order of length, so each chunk (cut to its longest row
    # by _collate) carries less padding: 1.14x fewer tokens per E2E batch of 32 in chunks of
    # 16 with SmolLM2's tokenizer (200 random batches).
    lengths = enc["attention_mask"].sum(1).tolist()
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
    model.train()
    ledger, canaries = None, None
    if cfg.private:
        private = make_private(
            model,
            optimizer,
            dataset,
            batch_size=cfg.batch_size,
            max_grad_norm=cfg.max_grad_norm,
            steps=steps,
            noise_multiplier=sigma,
            target_delta=delta,
            clipping=cfg.clipping,
            mode=cfg.mode,
            accountant=cfg.accountant,
            max_physical_batch_size=cfg.max_physical_batch_size,
            collate_fn=_collate,
            chunk_key=lengths.__getitem__,
            seed=cfg.seed,
            privacy_unit="example",
        )
        ledger = private.ledger
        ledger.autosave(out / "ledger.json")  # after every step: a stopped run keeps its record
        batches = iter(private.data_loader)
        opt = private.optimizer
        canaries = attach_audit_canaries(cfg.audit, trainable, opt, cfg.audit_canaries, cfg.seed)
    else:
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=cfg.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(cfg.seed),
            collate_fn=_identity,
        )
        batches = cycle(loader)
        opt = optimizer
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, _lr_lambda(steps, cfg.lr_schedule, cfg.warmup_fraction)
    )
    device = _device(model)
    ends = {min(steps, round(e * steps / cfg.epochs)): e for e in range(1, cfg.epochs + 1)}
    ends[steps] = cfg.epochs
    history: list[dict[str, Any]] = []
    snrs: list[float] = []
    best = (math.inf, 0)
    best_state = copy.deepcopy(model.state_dict())
    if cfg.private:
        assert delta is not None and sigma is not None
        print_plan(
            units=n,
            unit="example",
            sample_rate=q,
            expected_batch=min(cfg.batch_size, n),
            steps=steps,
            noise_multiplier=sigma,
            max_grad_norm=cfg.max_grad_norm,
            clipping=cfg.clipping,
            delta=delta,
            delta_rule=cfg.delta if isinstance(cfg.delta, str) else None,
            accountant=cfg.accountant,
            target_epsilon=cfg.epsilon,
        )
    bar = EpsilonBar(
        total=steps,
        disable=not cfg.progress,
        desc="table2text",
        unit="step",
        curve=EpsilonCurve([(q, sigma, steps)], delta, cfg.accountant) if cfg.private else None,
    )
    loss_sum, loss_n = 0.0, 0

    def chunk_losses(ids: Tensor, mask: Tensor, labels: Tensor) -> Tensor:
        with amp_context(cfg.amp, device):
            return _losses(
                model, ids.to(device), mask.to(device), labels.to(device), cfg.loss_reduction
            )

    for step in range(1, steps + 1):
        opt.zero_grad(set_to_none=True)
        if cfg.private:
            batch = next(batches)
            for chunk in batch.chunks:
                losses = chunk_losses(*chunk)
                private.backward(losses)
                loss_sum += float(losses.detach().sum())
                loss_n += len(losses)
            metrics = opt.step()
            if len(snrs) < 30:
                snrs.append(metrics.gradient_snr)
        else:
            rows = sorted(next(batches), key=lambda row: int(row[1].sum()))  # by length
            for i in range(0, len(rows), cfg.max_physical_batch_size):
                losses = chunk_losses(*_collate(rows[i : i + cfg.max_physical_batch_size]))
                (losses.sum() / len(rows)).backward()  # the batch mean, accumulated over chunks
                loss_sum += float(losses.detach().sum())
                loss_n += len(losses)
            opt.step()
        scheduler.step()
        bar.update(1)
        if step not in ends:
            continue
        vloss = _valid_loss(model, valid_enc, cfg.eval_batch_size, cfg.amp)
        spent = epsilon_so_far(ledger, delta, cfg.accountant) if ledger is not None else math.inf
        line = {
            "epoch": ends[step],
            "step": step,
            "train_loss": loss_sum / max(loss_n, 1),
            "valid_loss": vloss,
            "valid_perplexity": math.exp(min(vloss, 50.0)),
            "epsilon": spent,
            "lr": scheduler.get_last_lr()[0],
        }
        history.append(line)
        loss_sum, loss_n = 0.0, 0
        if vloss < best[0]:
            best = (vloss, ends[step])
            best_state = copy.deepcopy(model.state_dict())
        bar.set_postfix(
            epoch=ends[step],
            loss=f"{line['train_loss']:.3f}",
            valid=f"{vloss:.3f}",
            eps=f"{spent:.2f}" if cfg.private else "inf",
        )
    bar.close()
    model.load_state_dict(best_state)
    model.eval()
    eps_all: dict[str, float] = {}
    if ledger is not None and ledger.num_steps:
        eps_all = {name: make_accountant(name, ledger).epsilon(delta) for name in ACCOUNTANTS}
        history[-1]["epsilon"] = eps_all[cfg.accountant]  # the whole run: the exact figure
    with (out / "metrics.jsonl").open("w") as f:
        for line in history:
            f.write(json.dumps(line) + "\n")
    finite = [s for s in snrs if math.isfinite(s)]
    return FittedLM(
        model=model,
        tokenizer=tokenizer,
        ledger=ledger,
        epsilon=eps_all.get(cfg.accountant) if cfg.private else None,
        delta=delta,
        noise_multiplier=sigma,
        steps=steps,
        history=history,
        wall_s=time.perf_counter() - t0,
        best_epoch=best[1],
        sample_rate=q,
        epsilon_by_accountant=eps_all,
        snr_first=sum(finite) / len(finite) if finite else None,
        tokenizer_note=note,
        n_truncated=n_truncated,
        n_trainable=sum(p.numel() for p in trainable),
        canaries=canaries,
    )


def _identity(rows):
    return rows


# -- decoding and scoring --------------------------------------------------------------------------


def group_references(pairs: Sequence[tuple[str, str]]) -> list[tuple[str, list[str]]]:
    """Distinct tables in first-seen order, each with all its texts (the references)."""
    refs: dict[str, list[str]] = {}
    for table, text in pairs:
        refs.setdefault(table, []).append(text)
    return list(refs.items())


@torch.no_grad()
def decode(
    model,
    tokenizer,
    tables: Sequence[str],
    *,
    num_beams: int = 1,
    max_new_tokens: int = 64,
    no_repeat_ngram_size: int = 0,
    batch_size: int = 64,
    batching: str = "by_length",
    amp: str = "off",
) -> list[str]:
    """Generate a text for each table from ``[BOS] table [SEP]`` (greedy if ``num_beams`` is 1).

    ``batching="by_length"`` batches tables of one prompt length, so no prompt is
    padded (nothing to get right, but as many ``generate`` calls as lengths: 61 for
    the 1,847 E2E test tables with SmolLM2's tokenizer); ``"left_padded"`` sorts the
    prompts by length and left-pads each batch, with the attention mask zero on the
    padding and positions counted from each prompt's first token (what ``generate``
    derives from the mask), so a batch is ``batch_size`` tables whatever their lengths.
    Generation stops at ``[EOS]`` or ``max_new_tokens`` (or the model's context
    length). Special tokens are dropped from the output. ``amp="bf16"`` decodes under
    bfloat16 autocast.
    """
    check_int("num_beams", num_beams, 1)
    check_choice("batching", batching, DECODE_BATCHING)
    bos, sep, eos = _special_ids(tokenizer)
    was_training = model.training
    model.eval()
    device = _device(model)
    n_positions = getattr(model.config, "n_positions", None) or 1 << 30
    ids = tokenizer([linearize_table(t) for t in tables], add_special_tokens=False)["input_ids"]
    prompts = [[bos, *t, sep] for t in ids]
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    if batching == "by_length":
        groups: list[list[int]] = []
        for i in order:
            if groups and len(prompts[groups[-1][0]]) == len(prompts[i]):
                groups[-1].append(i)
            else:
                groups.append([i])
        batches = [g[j : j + batch_size] for g in groups for j in range(0, len(g), batch_size)]
    else:
        batches = [order[j : j + batch_size] for j in range(0, len(order), batch_size)]
    outputs: list[str] = [""] * len(prompts)
    pad = _pad_id(tokenizer)
    try:
        for idx in batches:
            length = max(len(prompts[i]) for i in idx)
            budget = min(max_new_tokens, n_positions - length)
            if budget < 1:
                continue  # the prompt fills the context: nothing can be generated
            x = torch.full((len(idx), length), pad, dtype=torch.long)
            mask = torch.zeros_like(x)
            for row, i in enumerate(idx):  # left padding: every prompt ends at column -1
                x[row, length - len(prompts[i]) :] = torch.tensor(prompts[i])
                mask[row, length - len(prompts[i]) :] = 1
            x, mask = x.to(device), mask.to(device)
            with amp_context(amp, device):
                gen = model.generate(
                    input_ids=x,
                    attention_mask=mask,
                    max_new_tokens=budget,
                    num_beams=num_beams,
                    do_sample=False,
                    early_stopping=num_beams > 1,
                    no_repeat_ngram_size=no_repeat_ngram_size,
                    eos_token_id=eos,
                    pad_token_id=pad,
                    bos_token_id=bos,
                )
            for i, row in zip(idx, gen[:, length:].tolist(), strict=True):
                if eos in row:
                    row = row[: row.index(eos)]
                outputs[i] = tokenizer.decode(row, skip_special_tokens=True).strip()
    finally:
        model.train(was_training)
    return outputs


def score_generations(hypotheses: Sequence[str], references: Sequence[Sequence[str]]) -> dict:
    """Corpus BLEU (sacrebleu, multi-reference) and mean ROUGE-L F (rouge-score, best reference).

    Both on a 0-100 scale. BLEU: sacrebleu's defaults (13a tokenisation,
    case-sensitive, exponential smoothing off); a table with fewer references
    than the most has its missing ones left out. ROUGE-L: the F-measure against
    the reference that scores best, averaged over the tables.
    """
    import sacrebleu
    from rouge_score import rouge_scorer

    if len(hypotheses) != len(references):
        raise ValueError(
            f"hypotheses and references differ in length ({len(hypotheses)} vs {len(references)})"
        )
    if not hypotheses:
        raise ValueError("hypotheses is empty: nothing to score")
    if any(len(r) == 0 for r in references):
        raise ValueError("every hypothesis needs at least one reference")
    width = max(len(r) for r in references)
    streams = [[r[k] if k < len(r) else None for r in references] for k in range(width)]
    bleu = sacrebleu.corpus_bleu(list(hypotheses), streams)
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    rouge = [
        scorer.score_multi(list(refs), hyp)["rougeL"].fmeasure
        for hyp, refs in zip(hypotheses, references, strict=True)
    ]
    return {"bleu": float(bleu.score), "rouge_l": 100.0 * sum(rouge) / len(rouge)}


def _decode_and_score(fitted: FittedLM, cfg: Table2TextConfig, grouped, beams: Sequence[int]):
    tables = [t for t, _ in grouped]
    refs = [r for _, r in grouped]
    gens, scores = {}, {}
    for beam in beams:
        name = "greedy" if beam == 1 else "beam"
        gens[name] = decode(
            fitted.model,
            fitted.tokenizer,
            tables,
            num_beams=beam,
            max_new_tokens=cfg.max_new_tokens,
            no_repeat_ngram_size=cfg.no_repeat_ngram_size,
            batch_size=cfg.eval_batch_size,
            batching=cfg.decode_batching,
        )
        scores[name] = score_generations(gens[name], refs)
    return gens, scores


# -- the recipe ------------------------------------------------------------------------------------


def train_table2text(cfg: Table2TextConfig) -> dict[str, Any]:
    """Run the recipe (see the module docstring); return the ``results.json`` content."""
    t0 = time.perf_counter()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    splits = load_e2e(cfg.data, valid_fraction=cfg.valid_fraction, seed=cfg.split_seed)
    n = len(splits.train)
    if cfg.batch_size > n:
        raise ValueError(
            f"batch_size={cfg.batch_size} is not allowed: the training split has only {n} pairs"
        )
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    data_info = {
        **splits.summary,
        "privacy_unit": "one (table, text) pair (example-level DP; a table appears in "
        "several pairs)",
        "note": "no E2E training split is available offline: the dev set is used for training "
        "(split by table into train and valid); the test set is the E2E test set",
    }
    (out / "data.json").write_text(json.dumps(data_info, indent=2))

    fitted = fit_table2text(cfg, splits.train, splits.valid, out)
    beams = (1, cfg.beam_size) if cfg.beam_size > 1 else (1,)

    valid_grouped = group_references(splits.valid)
    if cfg.max_valid_tables is not None:
        valid_grouped = valid_grouped[: cfg.max_valid_tables]
    valid_scores = {}
    if valid_grouped:
        _, valid_scores = _decode_and_score(fitted, cfg, valid_grouped, (cfg.beam_size,))
    test_grouped = group_references(splits.test)
    if cfg.max_test_tables is not None:
        test_grouped = test_grouped[: cfg.max_test_tables]
    test_scores: dict[str, dict[str, float]] = {}
    if cfg.decode_test and test_grouped:
        t_dec = time.perf_counter()
        gens, test_scores = _decode_and_score(fitted, cfg, test_grouped, beams)
        decode_s = time.perf_counter() - t_dec
        with (out / "generations.jsonl").open("w") as f:
            for i, (table, refs) in enumerate(test_grouped):
                row = {"table": table, **{k: v[i] for k, v in gens.items()}, "references": refs}
                f.write(json.dumps(row) + "\n")
        (out / "samples.md").write_text(_samples_md(test_grouped, gens, cfg))
    else:
        decode_s = 0.0

    if cfg.save_checkpoint:
        fitted.model.save_pretrained(str(out / "model"))
        fitted.tokenizer.save_pretrained(str(out / "model"))
    best = next((h for h in fitted.history if h["epoch"] == fitted.best_epoch), {})
    results: dict[str, Any] = {
        "data": cfg.data,
        "private": cfg.private,
        "epsilon": fitted.epsilon if cfg.private else math.inf,
        "epsilon_by_accountant": fitted.epsilon_by_accountant,
        "accountant": cfg.accountant,
        "target_epsilon": cfg.epsilon,
        "delta": fitted.delta if cfg.private else 0.0,
        "delta_rule": cfg.delta if isinstance(cfg.delta, str) else "given",
        "noise_multiplier": fitted.noise_multiplier,
        "max_grad_norm": cfg.max_grad_norm,
        "clipping": cfg.clipping,
        "loss_reduction": cfg.loss_reduction,
        "batch_size": cfg.batch_size,
        "sample_rate": fitted.sample_rate,
        "lr": cfg.lr,
        "epochs": cfg.epochs,
        "steps": fitted.steps,
        "best_epoch": fitted.best_epoch,
        "valid_loss": best.get("valid_loss"),
        "valid_perplexity": best.get("valid_perplexity"),
        "gradient_snr_first30": fitted.snr_first,
        **{f"valid_{k}_beam": v for k, v in valid_scores.get("beam", {}).items()},
        **{
            f"valid_{k}_greedy": v
            for k, v in valid_scores.get("greedy", {}).items()
            if cfg.beam_size == 1
        },
        "valid_tables_decoded": len(valid_grouped),
        **{f"test_{k}_{name}": v for name, s in test_scores.items() for k, v in s.items()},
        "test_tables_decoded": len(test_grouped) if test_scores else 0,
        "test_tables_total": len(group_references(splits.test)),
        "beam_size": cfg.beam_size,
        "amp": cfg.amp,
        "no_repeat_ngram_size": cfg.no_repeat_ngram_size,
        "model": cfg.pretrained or cfg.init_from or "GPT-2 from the config (random weights)",
        "lora_r": cfg.lora_r,
        "n_parameters": sum(p.numel() for p in fitted.model.parameters()),
        "n_trainable_parameters": fitted.n_trainable,
        "vocab_size": len(fitted.tokenizer),
        "n_train_pairs": n,
        "n_valid_pairs": len(splits.valid),
        "n_train_truncated": fitted.n_truncated,
        # the unit's name as every other results.json says it; what it is, in words, apart
        "privacy_unit": "example",
        "privacy_unit_detail": "one table-text pair",
        "tokenizer_scope": fitted.tokenizer_note,
        "train_wall_time_s": fitted.wall_s,
        "decode_wall_time_s": decode_s,
        "wall_time_s": time.perf_counter() - t0,
        "seed": cfg.seed,
        "note": (
            "example-level DP for the training pairs (the E2E dev set minus the validation "
            "tables); the validation pairs select the epoch and are not protected"
            if cfg.private
            else "non-private run: no guarantee"
        ),
    }
    report_audit(results, fitted.canaries, fitted.delta, fitted.ledger)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    record = recipe_privacy_record(
        "dptrain train table2text",
        results,
        fitted.ledger,
        privacy_unit="example",
        covers=[f"the {n} training (table, text) pairs: the trained weights (model/)"],
        not_covered=[
            results["note"],
            f"the base model and tokenizer ({results['model']}; {fitted.tokenizer_note})",
        ],
        training={"lora_r": cfg.lora_r, "clipping": cfg.clipping},
    )
    write_privacy_records(record, out, *([out / "model"] if cfg.save_checkpoint else []))
    _plot(fitted.history, cfg, out / "plots")
    return results


def _samples_md(grouped, gens: dict[str, list[str]], cfg: Table2TextConfig) -> str:
    title = f"epsilon {cfg.epsilon:g}" if cfg.private else "non-private"
    lines = [f"# Sample generations ({title}), E2E test tables", ""]
    for i, (table, refs) in enumerate(grouped[: cfg.n_samples]):
        lines += [f"**Table {i + 1}**: `{table}`", ""]
        for name, texts in gens.items():
            label = "greedy" if name == "greedy" else f"beam {cfg.beam_size}"
            lines.append(f"- {label}: {texts[i]}")
        lines.append(f"- reference (1 of {len(refs)}): {refs[0]}")
        lines.append("")
    return "\n".join(lines)


def _plot(history: list[dict], cfg: Table2TextConfig, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    title = f"E2E, target epsilon {cfg.epsilon:g}" if cfg.private else "E2E, non-private"
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot([h["epoch"] for h in history], [h["valid_loss"] for h in history], marker="o", ms=3)
    ax.plot([h["epoch"] for h in history], [h["train_loss"] for h in history], ls="--", lw=1)
    ax.legend(["validation (token NLL)", "training (per-example loss)"])
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "loss.png", dpi=120)
    plt.close(fig)
    if cfg.private:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        ax.plot([0] + [h["step"] for h in history], [0] + [h["epsilon"] for h in history], "o-")
        ax.axhline(cfg.epsilon, color="grey", ls="--", lw=1, label="target")
        ax.legend()
        ax.set_xlabel("training step")
        ax.set_ylabel(f"epsilon spent ({cfg.accountant})")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(folder / "epsilon.png", dpi=120)
        plt.close(fig)
