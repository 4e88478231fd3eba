"""Recipe: private masked-LM pretraining with mega-batches and a growing batch size (Anil et al. 2021).

``dptrain train mlm [--config FILE] [key=value ...]`` runs, in order:

1. **setup**: check the config; load the corpus (the packaged news articles
   or a user's file), split it by article, train a WordPiece tokenizer on the
   training articles (or load a local one) and cut fixed-length chunks
   (:mod:`dptrain.data.mlm`); build the batch-size schedule and refuse a stage
   whose expected batch exceeds the training set; fix delta; build a
   ``BertForMaskedLM`` from a small ``BertConfig`` (decoder tied to the word
   embeddings, so the engine clips it by phantom clipping) or load a local HF
   checkpoint (``init_from``). Bad input stops here, before anything is written.
2. **train**: DP-Adam with decoupled weight decay (Anil et al. Alg. 1: torch
   ``AdamW`` wrapped by :func:`~dptrain.privacy_engine.make_private`). Every
   step draws a Poisson-sampled logical batch of expected size B_t, far larger
   than ``max_physical_batch_size``; its chunks go through the model one at a
   time and their clipped per-example gradients are summed; noise is added
   once, the sum is divided by B_t and Adam steps. The schedule B_t is passed
   to ``make_private`` as a function, so the noise is calibrated for it and
   the ledger records each stage's (q_k = B_k / N, steps_k) exactly. Every
   chunk is masked afresh each time it is drawn (inside the step). The
   non-private run (``epsilon: null``) draws the same Poisson batches and
   steps plain AdamW on the batch-mean loss.
3. **evaluate**: masked-token accuracy and loss on the validation chunks
   (masks fixed by ``eval_mask_seed``) every ``eval_every`` steps and at the
   end; the best step by validation accuracy is kept; the test chunks are
   scored once, at the end, with it.
4. **save**: the run folder holds ``config.yaml``, ``data.json``,
   ``ledger.json``, ``metrics.jsonl`` (one line per step), ``results.json``
   (with ``audit=true`` its ``audit`` section: the white-box one-run audit of
   this run, :class:`~dptrain.audit.GradientCanaries`), ``tokenizer/``,
   ``checkpoints/best.pt`` (and ``last.pt``, and ``model/``, a
   ``save_pretrained`` folder that ``init_from`` reads, with
   ``save_checkpoints``), and PNG plots of accuracy and gradient-SNR over steps.

**Batch-size schedule.** ``batch_size`` is the final expected batch B. With
``batch_growth`` g > 1 the warm-up (``warmup_steps``) is cut into
``growth_stages`` S stages of (nearly) equal length; stage k = 0..S-1 uses
B_k = round(B/g + k (B - B/g) / S), the linear increments of Anil et al. §5.3
(262K -> 1M in four quarters of the warm-up, +196K each), and B from the end
of the warm-up on. ``batch_growth: 1`` is a fixed batch. ``batch_schedule``
gives the stages explicitly instead, as ``"BxS,BxS,..."`` (expected batch x
steps, e.g. ``"256x10,1024x50"``; the steps must add up to ``steps``).

**Learning rate** (Anil et al. §4.3: linear warm-up, then quadratic decay),
with W = ``warmup_steps``, T = ``steps`` and t = 0, 1, ..., T-1::

    eta_t = eta * (t + 1) / W                 for t < W
    eta_t = eta * (1 - (t - W) / (T - W))**2  for t >= W

**Per-example loss.** The mean cross-entropy over the example's masked
tokens. A chunk with no masked token (possible: masking is Bernoulli) has
loss 0 and a zero gradient; flat clipping keeps it at zero (factor 1 times a
zero gradient) and it still counts in the batch, as Poisson sampling requires.

**Logged per step** (``metrics.jsonl``): the step, the expected and the
actual batch size, the learning rate, the token-level training loss, the
gradient-SNR ||sum_i clip(g_i)|| / ||noise|| (Anil et al. §5.2;
``StepMetrics.gradient_snr``; null for the non-private run, which adds no
noise), the parameter norms (all parameters, and the embeddings that are
jointly scale-invariant under BERT's input LayerNorm, Anil et al. §4.4), the
examples processed so far, the epsilon spent every ``epsilon_every`` steps,
and the validation accuracy/loss at evaluation steps.

The guarantee is per text chunk of the training articles (example-level DP).
The trained tokenizer is outside it (it is fitted on the training text).
"""

from __future__ import annotations

import copy
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from dptrain._checks import check_in_interval, check_int, check_positive
from dptrain.accounting import ACCOUNTANTS, PrivacyLedger, make_accountant
from dptrain.config import save_config
from dptrain.data.mlm import MLMData, load_mlm_data
from dptrain.data.poisson import DPDataLoader
from dptrain.losses import per_example_cross_entropy
from dptrain.privacy_engine import make_private
from dptrain.progress import EpsilonBar, EpsilonCurve
from dptrain.recipes._common import (
    DELTA_RULES,
    attach_audit_canaries,
    check_audit,
    check_choice,
    decay_param_groups,
    epsilon_so_far,
    print_plan,
    recipe_privacy_record,
    report_audit,
    resolve_delta,
    write_privacy_records,
)
from dptrain.recipes._schedules import (
    batch_stages,
    check_schedule_steps,
    check_stages,
    lr_factor,
    parse_batch_schedule,
    resolve_stages,
    schedule_function,
)

__all__ = [
    "MLMTrainConfig",
    "batch_stages",
    "build_mlm_model",
    "load_mlm_corpus",
    "lr_factor",
    "masked_lm_metrics",
    "parse_batch_schedule",
    "schedule_function",
    "train_mlm",
]

log = logging.getLogger(__name__)


@dataclass
class MLMTrainConfig:
    """Settings of one run; every field can be set in YAML or as ``key=value``."""

    # data
    data: str = "news"
    """``news`` (the packaged news articles) or a ``.csv``/``.jsonl``/``.zip`` with a ``text``
    column (and optionally ``title``)."""
    tokenizer: str = "train"
    """``train``: WordPiece on the training articles; or a local HF tokenizer folder."""
    vocab_size: int = 8000
    """Size of the trained WordPiece vocabulary (specials included)."""
    max_len: int = 64
    """Chunk width in tokens, ``[CLS]`` and ``[SEP]`` included."""
    min_chunk_tokens: int = 8
    """Drop chunks shorter than this many tokens."""
    valid_fraction: float = 0.1
    """Share of the articles held out for validation."""
    test_fraction: float = 0.1
    """Share of the articles held out for test."""
    split_seed: int = 0
    """Seed of the article split (fixed across runs so that all see the same data)."""
    cache_dir: str | None = None
    """Folder where the tokenizer and chunks are cached for other runs (a study's grid)."""
    mask_prob: float = 0.15
    """Share of the tokens masked (BERT's 80/10/10 replacement)."""
    eval_mask_seed: int = 0
    """Seed of the fixed validation/test masks (and of the evaluation subset)."""
    max_eval_examples: int | None = 2000
    """Validation and test chunks scored (a seeded subset); null: all."""
    # model
    init_from: str | None = None
    """A local HF ``BertForMaskedLM`` folder to start from (``tokenizer`` must be its own)."""
    hidden_size: int = 128
    """Hidden size of the BERT model."""
    num_layers: int = 2
    """Layers."""
    num_heads: int = 4
    """Attention heads."""
    intermediate_size: int = 512
    """Width of the feed-forward layers."""
    dropout: float = 0.0
    """Dropout probability of the model."""
    # privacy
    epsilon: float | None = 5.0
    """Target epsilon for the whole run (Anil et al.'s 5); ``null`` trains without privacy."""
    delta: float | str = "1/N^1.1"
    """A number, or ``1/N^1.1`` / ``1/(2N)`` with N the number of training chunks."""
    accountant: str = "pld"
    """Accountant that calibrates sigma and reports epsilon: ``pld`` (tightest), ``rdp`` or ``gdp`` (approximate)."""
    max_grad_norm: float = 1.0
    """C: the clipping norm of each unit's gradient."""
    clipping: str = "flat"
    """Clipping function: ``flat`` (clip to C), ``automatic`` (normalize, Bu et al.) or ``per_layer``."""
    mode: str = "book_keeping"
    """How per-example gradients are clipped: ``book_keeping`` (one backward pass) or ``ghost`` (two, less memory)."""
    # optimisation
    steps: int = 60
    """Private steps of the run."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up (the batch grows over the same steps)."""
    batch_size: int = 512
    """Expected logical batch size B after the warm-up (the largest of a growing schedule)."""
    batch_growth: float = 4.0
    """B grows from B / batch_growth to B over the warm-up; 1 keeps it fixed."""
    growth_stages: int = 4
    """Number of equal steps in which a growing batch size grows from B / batch_growth to B."""
    batch_schedule: str | None = None
    """Explicit stages ``"BxS,BxS,..."`` (expected batch x steps) instead of the growth rule."""
    max_physical_batch_size: int = 64
    """Most records per forward/backward chunk (memory); the logical batch and the guarantee are unchanged."""
    lr: float = 5e-3
    """Peak learning rate; 5e-3 beat 2e-3 on validation loss in a 30-step private probe
    (B=128): Anil et al.'s 5e-4 is for 20K steps, far more than a CPU run takes."""
    weight_decay: float = 1.0
    """Decoupled weight decay lambda (AdamW, Anil et al. Alg. 1) on weight matrices and
    embeddings; biases and LayerNorm parameters are not decayed (BERT's convention)."""
    adam_beta1: float = 0.75
    """Adam's beta1."""
    adam_beta2: float = 0.9
    """Adam's beta2."""
    adam_eps: float = 1e-8
    """Adam's epsilon."""
    # evaluation and output
    eval_every: int = 10
    """Evaluate on the validation data every this many steps (epochs for seqrec)."""
    epsilon_every: int = 10
    """Compute the epsilon spent every this many steps (logged and plotted)."""
    eval_batch_size: int = 256
    """Records per batch when evaluating (no effect on training)."""
    num_threads: int = 0
    """torch threads for this run; 0 leaves torch's default."""
    seed: int = 0
    """Fixes initialization, sampling and noise (reproducible, so the noise is known to anyone who knows it)."""
    audit: bool = False
    """Run the white-box one-run audit on this run (dptrain.audit.GradientCanaries): its
    lower bounds go to results.json's ``audit`` section; the canaries are in the model."""
    audit_canaries: int = 100_000
    """Canaries of the audit (at most the trainable coordinates)."""
    out: str = "runs/mlm"
    """Output folder of the run."""
    save_checkpoints: bool = True
    """Save checkpoints (a run can be resumed)."""
    progress: bool = True
    """Show a progress bar on stderr."""

    def __post_init__(self) -> None:
        check_choice("accountant", self.accountant, tuple(ACCOUNTANTS))
        check_choice("clipping", self.clipping, ("flat", "automatic"))
        check_choice("mode", self.mode, ("book_keeping", "ghost"))
        for name in ("num_layers", "num_heads", "hidden_size", "intermediate_size"):
            check_int(name, getattr(self, name), 1)
        check_int("vocab_size", self.vocab_size, 64)
        check_int("max_len", self.max_len, 3)
        check_int("min_chunk_tokens", self.min_chunk_tokens, 1)
        for name in ("steps", "batch_size", "growth_stages", "max_physical_batch_size"):
            check_int(name, getattr(self, name), 1)
        for name in ("eval_every", "epsilon_every", "eval_batch_size"):
            check_int(name, getattr(self, name), 1)
        for name in ("warmup_steps", "split_seed", "eval_mask_seed", "seed", "num_threads"):
            check_int(name, getattr(self, name), 0)
        if self.warmup_steps > self.steps:
            raise ValueError(
                f"warmup_steps={self.warmup_steps!r} is not allowed: expected at most "
                f"steps={self.steps}"
            )
        if self.max_eval_examples is not None:
            check_int("max_eval_examples", self.max_eval_examples, 1)
        if self.epsilon is not None:
            check_positive("epsilon", self.epsilon)
        if isinstance(self.delta, str):
            check_choice("delta", self.delta, DELTA_RULES)
        else:
            check_in_interval("delta", self.delta, 0.0, 1.0)
        check_audit(
            self.audit, self.audit_canaries, private=self.private, non_private="epsilon=null"
        )
        check_in_interval("valid_fraction", self.valid_fraction, 0.0, 1.0, low_open=False)
        check_in_interval("test_fraction", self.test_fraction, 0.0, 1.0, low_open=False)
        check_in_interval("mask_prob", self.mask_prob, 0.0, 1.0)
        check_in_interval("dropout", self.dropout, 0.0, 1.0, low_open=False)
        check_in_interval("adam_beta1", self.adam_beta1, 0.0, 1.0, low_open=False)
        check_in_interval("adam_beta2", self.adam_beta2, 0.0, 1.0, low_open=False)
        for name in ("lr", "max_grad_norm", "adam_eps"):
            check_positive(name, getattr(self, name))
        if self.batch_growth < 1 or not math.isfinite(self.batch_growth):
            raise ValueError(
                f"batch_growth={self.batch_growth!r} is not allowed: expected a number >= 1"
            )
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} is not allowed: expected >= 0")
        if self.init_from is None and self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not allowed with num_heads={self.num_heads}: "
                "expected a multiple of num_heads"
            )
        if self.batch_schedule is not None:
            check_schedule_steps(self.batch_schedule, self.steps)
        if self.init_from is not None and self.tokenizer == "train":
            raise ValueError(
                f"init_from={self.init_from!r} with tokenizer='train' is not allowed: a "
                "pretrained checkpoint needs its own tokenizer (set tokenizer=<its folder>)"
            )

    @property
    def private(self) -> bool:
        return self.epsilon is not None


# -- setup -------------------------------------------------------------------------------------


def load_mlm_corpus(cfg: MLMTrainConfig) -> MLMData:
    """The :class:`~dptrain.data.mlm.MLMData` the config names (cached under ``cache_dir``)."""
    path = None
    if cfg.data != "news":
        path = Path(cfg.data)
        if not path.is_file():
            raise ValueError(
                f"data={cfg.data!r} is not allowed: expected 'news' or the path of an existing "
                ".csv/.jsonl/.zip file with a 'text' column"
            )
    return load_mlm_data(
        path,
        tokenizer=cfg.tokenizer,
        vocab_size=cfg.vocab_size,
        max_len=cfg.max_len,
        seed=cfg.split_seed,
        valid_fraction=cfg.valid_fraction,
        test_fraction=cfg.test_fraction,
        min_chunk_tokens=cfg.min_chunk_tokens,
        cache_dir=cfg.cache_dir,
    )


def build_mlm_model(cfg: MLMTrainConfig, data: MLMData) -> nn.Module:
    """``BertForMaskedLM`` from a small ``BertConfig`` (tied decoder), or from ``init_from``."""
    from transformers import BertConfig, BertForMaskedLM

    if cfg.init_from is not None:
        folder = Path(cfg.init_from)
        if not folder.is_dir():
            raise ValueError(
                f"init_from={cfg.init_from!r} is not allowed: expected a local folder holding a "
                "save_pretrained BertForMaskedLM"
            )
        model = BertForMaskedLM.from_pretrained(
            str(folder), local_files_only=True, attn_implementation="eager"
        )
        if model.config.vocab_size < data.vocab_size:
            raise ValueError(
                f"init_from={cfg.init_from!r} has vocab_size={model.config.vocab_size}, smaller "
                f"than the tokenizer's {data.vocab_size}: expected the checkpoint's own tokenizer"
            )
        if model.config.max_position_embeddings < cfg.max_len:
            raise ValueError(
                f"max_len={cfg.max_len} is not allowed with init_from={cfg.init_from!r}: expected "
                f"at most its max_position_embeddings={model.config.max_position_embeddings}"
            )
        return model
    config = BertConfig(
        vocab_size=data.vocab_size,
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_len,
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout,
        pad_token_id=data.pad_token_id,
        tie_word_embeddings=True,
    )
    # Eager attention: the engine's hooks see every Linear; no fused kernel is needed here.
    config._attn_implementation = "eager"
    return BertForMaskedLM(config)


# -- evaluation --------------------------------------------------------------------------------


@torch.no_grad()
def masked_lm_metrics(
    model: nn.Module, inputs: Tensor, attention_mask: Tensor, labels: Tensor, batch_size: int
) -> dict[str, float]:
    """Token-level masked-LM accuracy and mean cross-entropy over all masked positions."""
    was_training = model.training
    model.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for i in range(0, len(inputs), batch_size):
        sl = slice(i, i + batch_size)
        logits = model(input_ids=inputs[sl], attention_mask=attention_mask[sl]).logits
        y = labels[sl]
        keep = y != -100
        picked = logits[keep].float()
        correct += int((picked.argmax(-1) == y[keep]).sum())
        total += int(keep.sum())
        loss_sum += float(torch.nn.functional.cross_entropy(picked, y[keep], reduction="sum"))
    model.train(was_training)
    return {
        "accuracy": correct / total if total else 0.0,
        "loss": loss_sum / total if total else 0.0,
        "masked_tokens": total,
    }


def _norms(model: nn.Module) -> dict[str, float]:
    """||theta|| over all parameters, and over the embeddings (jointly scale-invariant, §4.4)."""
    total, emb = 0.0, 0.0
    for name, p in model.named_parameters():
        sq = float(p.detach().float().pow(2).sum())
        total += sq
        if ".embeddings." in name and "LayerNorm" not in name:
            emb += sq
    return {"param_norm": math.sqrt(total), "embedding_norm": math.sqrt(emb)}


# -- the recipe --------------------------------------------------------------------------------


def train_mlm(cfg: MLMTrainConfig, data: MLMData | None = None) -> dict[str, Any]:
    """Run the recipe; return the ``results.json`` content.

    ``data`` may be given (already loaded with the same settings) to skip loading.
    """
    t0 = time.perf_counter()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    logging.getLogger("absl").setLevel(logging.ERROR)
    torch.manual_seed(cfg.seed)
    # -- setup (nothing written until it has all passed) --
    if cfg.init_from is not None and not Path(cfg.init_from).is_dir():
        raise ValueError(
            f"init_from={cfg.init_from!r} is not allowed: expected a local folder holding a "
            "save_pretrained BertForMaskedLM"
        )
    data = data if data is not None else load_mlm_corpus(cfg)
    n = len(data.train_ids)
    stages = resolve_stages(
        cfg.batch_size,
        cfg.steps,
        cfg.warmup_steps,
        cfg.batch_growth,
        cfg.growth_stages,
        cfg.batch_schedule,
    )
    check_stages(stages, n)
    batch_at = schedule_function(stages)
    delta = resolve_delta(cfg.delta, n) if cfg.private else None
    model = build_mlm_model(cfg, data)
    n_params = sum(p.numel() for p in model.parameters())
    limit = cfg.max_eval_examples
    valid = data.fixed_masks("valid", cfg.eval_mask_seed, cfg.mask_prob, limit)
    test = data.fixed_masks("test", cfg.eval_mask_seed + 1, cfg.mask_prob, limit)
    if int((valid[2] != -100).sum()) == 0:
        raise ValueError(
            "the validation split has no masked token: expected a larger valid_fraction or more text"
        )
    optimizer = torch.optim.AdamW(
        decay_param_groups(model, cfg.weight_decay),
        lr=cfg.lr,
        betas=(cfg.adam_beta1, cfg.adam_beta2),
        eps=cfg.adam_eps,
    )
    mask_gen = torch.Generator().manual_seed(cfg.seed + 1)
    collate = data.collator(cfg.mask_prob, mask_gen)
    dataset = torch.utils.data.TensorDataset(data.train_ids)
    ledger = PrivacyLedger(privacy_unit=data.privacy_unit)
    private, canaries = None, None
    if cfg.private:
        private = make_private(
            model,
            optimizer,
            dataset,
            batch_size=batch_at,
            max_grad_norm=cfg.max_grad_norm,
            steps=cfg.steps,
            target_epsilon=cfg.epsilon,
            target_delta=delta,
            clipping=cfg.clipping,
            mode=cfg.mode,
            accountant=cfg.accountant,
            max_physical_batch_size=cfg.max_physical_batch_size,
            collate_fn=collate,
            seed=cfg.seed,
            privacy_unit=data.privacy_unit,
            ledger=ledger,
        )
        batches, opt = iter(private.data_loader), private.optimizer
        sigma = private.noise_multiplier
        assert delta is not None
        print_plan(
            units=n,
            unit=data.privacy_unit,
            sample_rate=[b / n for b, _ in stages],
            expected_batch=[b for b, _ in stages],
            steps=cfg.steps,
            noise_multiplier=sigma,
            max_grad_norm=cfg.max_grad_norm,
            clipping=cfg.clipping,
            delta=delta,
            delta_rule=cfg.delta if isinstance(cfg.delta, str) else None,
            accountant=cfg.accountant,
            target_epsilon=cfg.epsilon,
        )
        canaries = attach_audit_canaries(
            cfg.audit, model.parameters(), opt, cfg.audit_canaries, cfg.seed
        )
    else:
        loader = DPDataLoader(
            dataset,
            lambda t: batch_at(t) / n,
            cfg.steps,
            cfg.max_physical_batch_size,
            collate_fn=collate,
            seed=cfg.seed,
        )
        batches, opt, sigma = iter(loader), optimizer, 0.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda t: lr_factor(t, cfg.steps, cfg.warmup_steps)
    )

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ledger.autosave(out / "ledger.json")  # after every step: a stopped run keeps its record
    save_config(cfg, out / "config.yaml")
    (out / "data.json").write_text(json.dumps(data.summary, indent=2, default=str))
    data.tokenizer.save_pretrained(str(out / "tokenizer"))
    metrics_path = out / "metrics.jsonl"
    metrics_path.write_text("")
    (out / "checkpoints").mkdir(exist_ok=True)

    # -- train --
    history: list[dict[str, Any]] = []
    best = {"accuracy": -1.0, "step": 0, "loss": math.nan}
    best_state: dict[str, Tensor] = copy.deepcopy(model.state_dict())
    examples = 0
    expected_examples = 0
    initial_norms = _norms(model)
    bar = EpsilonBar(
        total=cfg.steps,
        disable=not cfg.progress,
        desc="mlm",
        unit="step",
        curve=EpsilonCurve([(b / n, sigma, k) for b, k in stages], delta, cfg.accountant)
        if private is not None
        else None,
    )
    spent = 0.0
    model.train()
    with metrics_path.open("a") as metrics_file:
        for step in range(1, cfg.steps + 1):
            batch = next(batches)
            lr = opt.param_groups[0]["lr"]
            opt.zero_grad()
            token_loss, token_count = 0.0, 0
            for inputs, attention, labels in batch.chunks:
                logits = model(input_ids=inputs, attention_mask=attention).logits
                losses = per_example_cross_entropy(logits, labels)
                masked = (labels != -100).sum(1)
                token_loss += float((losses.detach() * masked).sum())
                token_count += int(masked.sum())
                if private is not None:
                    private.backward(losses)
                else:
                    (losses.sum() / batch.size).backward()
            metrics = opt.step()
            scheduler.step()
            examples += batch.size
            expected_examples += batch_at(step - 1)
            line: dict[str, Any] = {
                "step": step,
                "expected_batch": batch_at(step - 1),
                "batch": batch.size,
                "lr": lr,
                "loss": token_loss / token_count if token_count else None,
                "gradient_snr": metrics.gradient_snr if private is not None else None,
                "clipped_sum_norm": metrics.clipped_sum_norm if private is not None else None,
                "noise_norm": metrics.noise_norm if private is not None else None,
                "examples_processed": examples,
                **_norms(model),
            }
            if private is not None and (step % cfg.epsilon_every == 0 or step == cfg.steps):
                spent = epsilon_so_far(ledger, delta, cfg.accountant)
                line["epsilon"] = spent
            if step % cfg.eval_every == 0 or step == cfg.steps:
                v = masked_lm_metrics(model, *valid, cfg.eval_batch_size)
                line["valid_accuracy"], line["valid_loss"] = v["accuracy"], v["loss"]
                if v["accuracy"] > best["accuracy"]:
                    best = {"accuracy": v["accuracy"], "step": step, "loss": v["loss"]}
                    best_state = copy.deepcopy(model.state_dict())
            if "epsilon" in line or "valid_accuracy" in line:
                bar.set_postfix(
                    B=batch.size,
                    loss=f"{line['loss'] or 0:.3f}",
                    eps=f"{spent:.2f}" if cfg.private else "inf",
                    acc=f"{best['accuracy']:.4f}" if best["step"] else "-",
                )
            history.append(line)
            metrics_file.write(json.dumps(line) + "\n")
            metrics_file.flush()  # a running job can be followed with tail -f
            bar.update(1)
    bar.close()
    last_state = model.state_dict() if cfg.save_checkpoints else None
    last_norms = _norms(model)
    if private is not None:
        private.engine.detach()  # evaluation and saving see a plain model
    torch.save(best_state, out / "checkpoints" / "best.pt")
    if cfg.save_checkpoints:
        torch.save(
            {
                "model": last_state,
                "optimizer": opt.state_dict(),
                "ledger": ledger.state_dict(),
            },
            out / "checkpoints" / "last.pt",
        )
    model.load_state_dict(best_state)
    if cfg.save_checkpoints:
        model.save_pretrained(str(out / "model"))
        data.tokenizer.save_pretrained(str(out / "model"))
    test_metrics = masked_lm_metrics(model, *test, cfg.eval_batch_size)

    # -- save --
    eps = (
        {
            name: make_accountant(name, ledger).epsilon(delta)
            for name in dict.fromkeys(("pld", "rdp", cfg.accountant))
        }
        if cfg.private
        else {}
    )
    if eps:  # the last step's epsilon is the whole run: report the exact figure
        history[-1]["epsilon"] = eps[cfg.accountant]
    snrs = [h["gradient_snr"] for h in history if h["gradient_snr"] is not None]
    results: dict[str, Any] = {
        "recipe": "mlm",
        "data": data.name,
        "private": cfg.private,
        "epsilon": eps[cfg.accountant] if cfg.private else math.inf,
        "epsilon_pld": eps.get("pld"),
        "epsilon_rdp": eps.get("rdp"),
        "delta": delta if cfg.private else 0.0,
        "delta_rule": cfg.delta if isinstance(cfg.delta, str) else "given",
        "target_epsilon": cfg.epsilon,
        "accountant": cfg.accountant,
        "noise_multiplier": sigma,
        "max_grad_norm": cfg.max_grad_norm,
        "schedule": [{"batch": b, "steps": s, "sample_rate": b / n} for b, s in stages],
        "steps": cfg.steps,
        "warmup_steps": cfg.warmup_steps,
        "examples_processed": examples,
        "expected_examples_processed": expected_examples,
        "best_step": best["step"],
        "valid_accuracy": best["accuracy"],
        "valid_loss": best["loss"],
        "test_accuracy": test_metrics["accuracy"],
        "test_loss": test_metrics["loss"],
        "valid_masked_tokens": int((valid[2] != -100).sum()),
        "test_masked_tokens": test_metrics["masked_tokens"],
        "final_valid_accuracy": next(
            h["valid_accuracy"] for h in reversed(history) if "valid_accuracy" in h
        ),
        "mean_gradient_snr": sum(snrs) / len(snrs) if snrs else None,
        "initial_param_norm": initial_norms["param_norm"],
        "final_param_norm": last_norms["param_norm"],
        "initial_embedding_norm": initial_norms["embedding_norm"],
        "final_embedding_norm": last_norms["embedding_norm"],
        "weight_decay": cfg.weight_decay,
        "lr": cfg.lr,
        "n_params": n_params,
        "model": {
            "init_from": cfg.init_from,
            "hidden_size": model.config.hidden_size,
            "num_layers": model.config.num_hidden_layers,
            "num_heads": model.config.num_attention_heads,
            "intermediate_size": model.config.intermediate_size,
            "vocab_size": model.config.vocab_size,
            "max_len": cfg.max_len,
        },
        "n_train_chunks": n,
        "n_valid_chunks": len(data.valid_ids),
        "n_test_chunks": len(data.test_ids),
        "eval_chunks": {"valid": len(valid[0]), "test": len(test[0])},
        "privacy_unit": data.privacy_unit,
        "tokenizer_scope": data.tokenizer_scope,
        "seed": cfg.seed,
        "wall_time_s": time.perf_counter() - t0,
        "note": (
            "example-level DP (one record = one text chunk of a training article); the "
            "tokenizer is outside the guarantee when trained on the training articles"
            if cfg.private
            else "non-private run: no guarantee; gradient_snr is null (no noise is added)"
        ),
    }
    report_audit(results, canaries, delta, ledger)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    record = recipe_privacy_record(
        "dptrain train mlm",
        {**results, "epsilon_by_accountant": eps},
        ledger,
        privacy_unit=data.privacy_unit,
        covers=[f"the {n} training chunks: the pretrained weights (model/, checkpoints/)"],
        not_covered=[
            results["note"],
            "the validation and test chunks (the best step is chosen by validation "
            "accuracy, reported without noise)",
        ],
        training={"schedule": results["schedule"]},
    )
    write_privacy_records(record, out, *([out / "model"] if cfg.save_checkpoints else []))
    # rewrite the last line with the exact final epsilon
    metrics_path.write_text("".join(json.dumps(h) + "\n" for h in history))
    _plot(history, cfg, out / "plots")
    return results


def _plot(history: list[dict[str, Any]], cfg: MLMTrainConfig, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(exist_ok=True)
    title = f"masked LM, B={cfg.batch_size}, " + (
        f"target epsilon {cfg.epsilon:g}" if cfg.private else "non-private"
    )
    evals = [h for h in history if "valid_accuracy" in h]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot([h["step"] for h in evals], [h["valid_accuracy"] for h in evals], marker="o", ms=3)
    ax.set_xlabel("step")
    ax.set_ylabel("validation masked-token accuracy")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "accuracy.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    if cfg.private:
        ax.plot([h["step"] for h in history], [h["gradient_snr"] for h in history], lw=1)
        ax.set_ylabel("gradient-SNR ||clipped sum|| / ||noise||")
    else:
        ax.text(0.5, 0.5, "non-private: no noise, no gradient-SNR", ha="center", va="center")
    ax2 = ax.twinx()
    ax2.step([h["step"] for h in history], [h["expected_batch"] for h in history], color="grey")
    ax2.set_ylabel("expected batch size", color="grey")
    ax.set_xlabel("step")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "gradient_snr.png", dpi=120)
    plt.close(fig)
