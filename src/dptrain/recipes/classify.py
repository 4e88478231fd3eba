"""Recipe: private text classification on a pretrained encoder, five ways.

``dptrain train classify [--config FILE] [key=value ...]`` with ``method=``

- ``nonprivate``: full fine-tuning with AdamW (no guarantee);
- ``nonprivate-head``: AdamW on the head only, the encoder frozen (a linear
  probe; no guarantee; the reference for ``dpsgd-head``, and the classifier to
  train on DP synthetic text, whose guarantee carries over by post-processing);
- ``dpsgd``: full fine-tuning with DP-Adam through the clipping engine
  (Li et al. 2022: large batch, C = 0.1); the whole model is covered;
- ``dpsgd-head``: DP-Adam on the head only, the encoder frozen (a private
  linear probe); the encoder is the public pretrained model;
- ``dpfp``: DP forward propagation (Du & Mi et al., Algorithm 1) with the
  encoder frozen: the head trains on clipped + noised representations, so
  it is post-processing and covered by the guarantee (labels are not);
- ``dpfp-finetune``: the paper's setting, encoder fine-tuned through the
  DP-FP layer: the encoder's updates use gradients of the raw inputs and are
  OUTSIDE the formal guarantee (the report says so).

Steps:

1. **setup**: check the config, load and split the data (optionally a seeded
   subsample of the training split), load the tokenizer and encoder from a
   local folder (the packaged all-MiniLM-L6-v2 by default, offline), fix
   delta from the training-set size and calibrate the noise for the whole run
   (PLD by default; every method is compared at the same PLD epsilon).
   Bad input stops here, before anything is written.
2. **train**: the method's loop; a progress bar shows the epoch, the loss
   and the epsilon spent. Frozen-encoder methods compute the pooled
   representations once (the encoder is deterministic in eval mode) and
   train the head on them; ``feature_cache`` keeps them on disk for a grid.
3. **evaluate**: dev accuracy after every epoch; the best epoch by dev
   accuracy is kept and the test split is scored once, at the end.
4. **save**: the run folder holds ``config.yaml`` (resolved), ``data.json``,
   ``ledger.json``, ``metrics.jsonl``, ``results.json`` (with ``audit=true``
   its ``audit`` section: the white-box one-run audit of this run,
   :class:`~dptrain.audit.GradientCanaries`; ``dpsgd`` and ``dpsgd-head``
   only), ``plots/curves.png`` and, with ``save_checkpoint``,
   ``checkpoints/best.pt``.

Several processes: ``dpsgd`` and ``dpsgd-head`` run under torchrun
(``WORLD_SIZE`` > 1; ``dptrain train classify --nproc N`` starts it) through
:func:`~dptrain.distributed.make_private_distributed`: the same logical
batches, one noise draw per step and the same ledger as one process; every
rank evaluates, only rank 0 writes the run folder (and the feature cache) and
shows the progress bar. ``nonprivate``, ``dpfp`` and ``dpfp-finetune`` run in
one process only and refuse ``WORLD_SIZE`` > 1, as does ``audit=true``.

Objectives: ``linear`` (a fresh linear head on the pooled representation)
or ``infilling`` (Li et al. section 3.2: the text followed by ``prompt``, and
the masked-LM logits of one label word per class at its [MASK]; needs an
encoder with a pretrained masked-LM head, which the packaged MiniLM lacks).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from dptrain._checks import check_in_interval, check_int, check_positive
from dptrain.accounting import (
    ACCOUNTANTS,
    PrivacyLedger,
    calibrate_dpfp,
    calibrate_noise,
    make_accountant,
    sample_rate_from_batch,
    steps_from_epochs,
)
from dptrain.config import save_config
from dptrain.data.text_classification import TextClassificationData
from dptrain.distributed import make_private_distributed
from dptrain.dpfp import DPForwardLayer, DPFPTrainer
from dptrain.models.pretrained import SMOLLM2
from dptrain.models.text_classifier import LabelWordHead, PooledEncoder, TextClassifier
from dptrain.privacy_engine import make_private
from dptrain.progress import EpsilonBar, EpsilonCurve
from dptrain.recipes._causal_lm import (
    LLAMA_PROJECTIONS,
    add_lora,
    is_causal_lm,
    load_causal_lm,
    stop_and_pad_ids,
)
from dptrain.recipes._common import (
    DELTA_RULES,
    attach_audit_canaries,
    check_audit,
    check_audit_world_size,
    check_choice,
    cycle,
    print_plan,
    recipe_privacy_record,
    report_audit,
    resolve_delta,
)
from dptrain.recipes._launch import Launch, launch, refuse_several_processes

__all__ = [
    "METHODS",
    "METHOD_DEFAULTS",
    "NON_PRIVATE_METHODS",
    "ClassifyTrainConfig",
    "frozen_encoder_features",
    "load_classification_data",
    "train_classify",
]

log = logging.getLogger(__name__)

#: The five methods compared (issue 3).
METHODS = ("nonprivate", "nonprivate-head", "dpsgd", "dpsgd-head", "dpfp", "dpfp-finetune")
#: Methods without a guarantee (no epsilon, no clipping norm).
NON_PRIVATE_METHODS = ("nonprivate", "nonprivate-head")
_FROZEN = ("nonprivate-head", "dpsgd-head", "dpfp")  # the encoder is not trained
_DPFP = ("dpfp", "dpfp-finetune")
_OBJECTIVES = ("linear", "infilling")
_PACKAGED = ("rotten-tomatoes", "womens-clothing")  # data sets with their own fixed split
#: Methods that run on several processes (torchrun); the others train in one process.
_MULTI_PROCESS = ("dpsgd", "dpsgd-head")

#: What ``None`` means for each method's batch_size, max_norm, lr (encoder) and head_lr.
#: DP-FP: the paper's M = 32, C = 1, expected batch 32, lr 5e-6 for fine-tuning.
#: DP-SGD: Li et al.'s large batch and C = 0.1 with DP-Adam at lr 5e-4.
#: head_lr of the private methods, 0.1, was chosen on the dev split with the frozen
#: methods (Rotten Tomatoes, 1,000 texts, epsilon 3, seed 0, head_lr in {1e-3, 1e-2, 1e-1}:
#: dev accuracy 0.58 / 0.58 / 0.74 for dpsgd-head, 0.59 / 0.61 / 0.63 for dpfp); smaller
#: rates leave the fresh head at the majority class after 3 epochs of noisy steps.
#: nonprivate-head's head_lr 1e-2 was chosen the same way (full training split, seed 0,
#: batch 64, head_lr in {1e-3, 1e-2, 1e-1}: dev accuracy 0.773 / 0.778 / 0.721).
METHOD_DEFAULTS: dict[str, dict[str, float | int | None]] = {
    "nonprivate": {"batch_size": 32, "max_norm": None, "lr": 5e-5, "head_lr": 1e-3},
    "nonprivate-head": {"batch_size": 64, "max_norm": None, "lr": None, "head_lr": 1e-2},
    "dpsgd": {"batch_size": 256, "max_norm": 0.1, "lr": 5e-4, "head_lr": 0.1},
    "dpsgd-head": {"batch_size": 256, "max_norm": 0.1, "lr": None, "head_lr": 0.1},
    "dpfp": {"batch_size": 32, "max_norm": 1.0, "lr": None, "head_lr": 0.1},
    "dpfp-finetune": {"batch_size": 32, "max_norm": 1.0, "lr": 5e-6, "head_lr": 0.1},
}

#: Label words for text infilling on the packaged data (label k -> word k).
_LABEL_WORDS = {"rotten-tomatoes": ["terrible", "great"], "womens-clothing": ["bad", "good"]}

_SCOPES = {
    "nonprivate": "none: non-private training",
    "nonprivate-head": "none: non-private training of the head (the encoder is the public "
    "pretrained model, frozen)",
    "dpsgd": "example-level DP for the whole model (encoder and head); labels are protected",
    "dpsgd-head": "example-level DP for the head; the encoder is the public pretrained "
    "model, frozen; labels are protected",
    "dpfp": "DP-FP, frozen encoder: the head is post-processing of the noisy "
    "representations and is covered; labels are NOT protected",
    "dpfp-finetune": "DP-FP with encoder fine-tuning: only the noisy representations are "
    "covered; the encoder's updates are OUTSIDE the formal guarantee; labels are NOT protected",
}


@dataclass
class ClassifyTrainConfig:
    """Settings of one run; every field can be set in YAML or as ``key=value``.

    ``None`` for batch_size, max_norm, lr and head_lr takes the method's value
    from :data:`METHOD_DEFAULTS` (the resolved values are saved in config.yaml).
    """

    # data
    data: str = "rotten-tomatoes"
    """``rotten-tomatoes``, ``womens-clothing`` (packaged) or a CSV/TSV/JSONL/Parquet path."""
    text_col: str = "text"
    """Column of the texts in a data file."""
    label_col: str = "label"
    """Column of the labels in a data file."""
    test_data: str | None = None
    """Score test accuracy on another data set: the test split of ``rotten-tomatoes`` or
    ``womens-clothing``, or every record of a CSV/TSV/JSONL/Parquet file (same
    ``text_col`` / ``label_col``); e.g. a classifier trained on DP synthetic text, tested
    on real text. Its label names must be the training data's (matched by name). A file
    given as ``data`` then keeps no test split of its own (train / dev 90 / 10)."""
    train_size: int | None = None
    """Train on a seeded random subset of this many training records (CPU-sized runs)."""
    split_seed: int = 0
    """Fixes the train/dev/test split and the training subset (the same for every method)."""
    # encoder
    encoder: str = "minilm"
    """``minilm`` (the packaged all-MiniLM-L6-v2), ``smollm2-135m-instruct`` (the packaged
    causal LM) or a local Hugging Face model folder (an encoder or a causal LM)."""
    pooling: str | None = None
    """``mean``, ``cls``, ``pooler`` or ``last`` (the last token's state); unset: ``mean``
    for an encoder, ``last`` for a causal LM (whose last state has read the whole text)."""
    objective: str = "linear"
    """``linear`` (a classification head) or ``infilling`` (predict a label word at [MASK])."""
    prompt: str | None = None
    """Text-infilling prompt appended to every text, ``[MASK]`` where the label word goes;
    unset: ``It was [MASK].`` (masked LM) or ``It was [MASK]`` (causal LM: the label word
    is the next token, so ``[MASK]`` must end the prompt)."""
    label_words: list[str] | None = None
    """One vocabulary word per class for text infilling (default for the packaged data),
    in the order of the data's labels: for a file, labels sorted by name (numerically
    when all are integers). results.json's ``label_word_of`` shows the mapping."""
    max_length: int = 128
    """Most tokens per text (longer ones are cut)."""
    # method and privacy
    method: str = "dpfp"
    """``nonprivate``, ``nonprivate-head``, ``dpsgd``, ``dpsgd-head``, ``dpfp`` or ``dpfp-finetune``."""
    epsilon: float | None = None
    """Target epsilon of the private methods (required for them; null for nonprivate)."""
    delta: float | str = "1/N^1.1"
    """A number, or ``1/N^1.1`` / ``1/(2N)`` with N the number of training records."""
    accountant: str = "pld"
    """Calibration: ``pld`` (default); ``gdp`` is DP-FP's paper-faithful CLT route."""
    max_norm: float | None = None
    """C: the clipping norm (of gradients for DP-SGD, of representations for DP-FP)."""
    micro_batches: int = 32
    """M, DP-FP only."""
    clipping_mode: str = "book_keeping"
    """How DP-SGD clips per-example gradients: ``book_keeping`` or ``ghost``."""
    lora_r: int | None = None
    """Train LoRA adapters of this rank (and the head) instead of the whole encoder
    (fine-tuning methods); unset: full fine-tuning."""
    lora_alpha: float = 16.0
    """LoRA scaling alpha (the update is scaled by alpha / r)."""
    lora_targets: tuple[str, ...] = LLAMA_PROJECTIONS
    """Linear modules that get adapters (default: a Llama block's seven projections)."""
    # optimisation
    epochs: int = 3
    """Passes over the training data (the number of steps is floor(epochs / q))."""
    batch_size: int | None = None
    """Expected batch size B (Poisson for DP-SGD; B / M per micro-batch for DP-FP)."""
    lr: float | None = None
    """Learning rate of the encoder (fine-tuning methods only)."""
    head_lr: float | None = None
    """Learning rate of the classification head (null: the method's default)."""
    weight_decay: float = 0.0
    """Weight decay of the optimizer."""
    max_physical_batch_size: int = 64
    """Most records per forward/backward chunk (memory); the logical batch and the guarantee are unchanged."""
    # evaluation and output
    eval_batch_size: int = 128
    """Records per batch when evaluating (no effect on training)."""
    num_threads: int = 0
    """torch threads for this run; 0 leaves torch's default."""
    seed: int = 0
    """Fixes initialization, sampling and noise (reproducible, so the noise is known to anyone who knows it)."""
    audit: bool = False
    """Run the white-box one-run audit on this run (dptrain.audit.GradientCanaries;
    ``dpsgd`` and ``dpsgd-head``): its lower bounds go to results.json's ``audit``
    section; the canaries are in the model."""
    audit_canaries: int = 100_000
    """Canaries of the audit (at most the trainable coordinates)."""
    out: str = "runs/classify"
    """Output folder of the run."""
    feature_cache: str | None = None
    """Folder to keep frozen-encoder representations in, shared by runs of a grid."""
    save_checkpoint: bool = True
    """Save the trained model in the run folder."""
    progress: bool = True
    """Show a progress bar on stderr."""

    def __post_init__(self) -> None:
        check_choice("method", self.method, METHODS)
        check_choice("objective", self.objective, _OBJECTIVES)
        check_choice("accountant", self.accountant, tuple(ACCOUNTANTS))
        check_choice("clipping_mode", self.clipping_mode, ("book_keeping", "ghost"))
        causal = self.causal
        if self.objective == "linear":
            if self.pooling is None:
                self.pooling = "last" if causal else "mean"
            check_choice("pooling", self.pooling, ("mean", "cls", "pooler", "last"))
        elif self.pooling is not None:  # infilling reads the [MASK] state: no pooling choice
            raise ValueError(
                f"pooling={self.pooling!r} is not allowed with objective='infilling': the "
                "representation is the [MASK] token's state (leave pooling unset)"
            )
        if self.prompt is None:
            self.prompt = "It was [MASK]" if causal else "It was [MASK]."
        if self.objective == "infilling" and "[MASK]" not in self.prompt:
            raise ValueError(f"prompt={self.prompt!r} is not allowed: expected a '[MASK]' in it")
        if self.objective == "infilling" and causal and not self.prompt.endswith("[MASK]"):
            raise ValueError(
                f"prompt={self.prompt!r} is not allowed with the causal LM "
                f"encoder={self.encoder!r}: it predicts the label word as the next token, so "
                "'[MASK]' must end the prompt (e.g. 'It was [MASK]')"
            )
        if self.lora_r is not None:
            check_int("lora_r", self.lora_r, 1)
            check_positive("lora_alpha", self.lora_alpha)
            if self.method in _FROZEN or self.method == "dpfp-finetune":
                raise ValueError(
                    f"lora_r={self.lora_r} is not allowed with method={self.method!r}: LoRA "
                    "adapters train the encoder; use method nonprivate or dpsgd"
                )
        for name in ("max_length", "epochs", "eval_batch_size", "max_physical_batch_size"):
            check_int(name, getattr(self, name), 2 if name == "max_length" else 1)
        check_int("micro_batches", self.micro_batches, 1)
        check_int("seed", self.seed, 0)
        check_int("split_seed", self.split_seed, 0)
        check_int("num_threads", self.num_threads, 0)
        if self.train_size is not None:
            check_int("train_size", self.train_size, 2)
        if isinstance(self.delta, str):
            check_choice("delta", self.delta, DELTA_RULES)
        else:
            check_in_interval("delta", self.delta, 0.0, 1.0)
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} is not allowed: expected >= 0")
        if not self.private:
            for name in ("epsilon", "max_norm"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} is not allowed with "
                        f"method={self.method!r}: "
                        f"set {name}=null (a non-private run has no privacy parameters)"
                    )
        elif self.epsilon is None:
            raise ValueError(
                f"epsilon=None is not allowed with method={self.method!r}: expected a target "
                "epsilon > 0 (e.g. epsilon=3)"
            )
        else:
            check_positive("epsilon", self.epsilon)
        check_audit(
            self.audit, self.audit_canaries, private=self.private, non_private="method='nonprivate'"
        )
        if self.audit and self.method in _DPFP:
            raise ValueError(
                f"audit=true is not allowed with method={self.method!r}: DP-FP noises the "
                "representations, not the gradients the white-box canaries join in the DP "
                "optimizer; audit method='dpsgd' or 'dpsgd-head'"
            )
        if self.method in _FROZEN and self.lr is not None:
            raise ValueError(
                f"lr={self.lr!r} is not allowed with method={self.method!r}: the encoder is "
                "frozen; set head_lr for the head"
            )
        defaults = METHOD_DEFAULTS[self.method]
        for name in ("batch_size", "max_norm", "lr", "head_lr"):
            if getattr(self, name) is None:
                setattr(self, name, defaults[name])
        check_int("batch_size", self.batch_size, 1)
        if self.train_size is not None and self.batch_size > self.train_size:
            raise ValueError(
                f"batch_size={self.batch_size} is not allowed with train_size={self.train_size}: "
                "expected batch_size <= train_size (the sampling rate B / N must be <= 1)"
            )
        for name in ("max_norm", "lr", "head_lr"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))

    @property
    def causal(self) -> bool:
        """Whether the encoder is a causal LM (``smollm2-135m-instruct`` or a folder whose
        config.json names a causal-LM architecture)."""
        return self.encoder != "minilm" and is_causal_lm(self.encoder)

    @property
    def private(self) -> bool:
        return self.method not in NON_PRIVATE_METHODS


# -- setup -----------------------------------------------------------------------------------


def _load_source(
    cfg: ClassifyTrainConfig,
    arg: str,
    spec: str,
    *,
    label_names: list[str] | None = None,
    dev_fraction: float = 0.1,
    test_fraction: float = 0.1,
) -> TextClassificationData:
    """The packaged data set or file ``spec`` (the value of config field ``arg``), split."""
    from dptrain.data import text_classification as tc

    if spec == "rotten-tomatoes":
        return tc.load_rotten_tomatoes(seed=cfg.split_seed)
    if spec == "womens-clothing":
        return tc.load_womens_clothing(seed=cfg.split_seed)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(
            f"{arg}={spec!r} is not allowed: expected 'rotten-tomatoes', "
            "'womens-clothing' or the path of an existing CSV/TSV/JSONL/Parquet file"
        )
    return tc.load_text_file(
        path,
        text_col=cfg.text_col,
        label_col=cfg.label_col,
        label_names=label_names,
        seed=cfg.split_seed,
        dev_fraction=dev_fraction,
        test_fraction=test_fraction,
    )


def _use_test_data(cfg: ClassifyTrainConfig, data: TextClassificationData) -> None:
    """Replace ``data``'s test split by ``cfg.test_data``'s, labels mapped by name."""
    packaged = cfg.test_data in _PACKAGED
    # A file is all test: read it whole (no dev, no test split) and take its "train" part.
    try:
        other = _load_source(
            cfg,
            "test_data",
            cfg.test_data,
            label_names=None if packaged else data.label_names,
            dev_fraction=0.1 if packaged else 0.0,
            test_fraction=0.1 if packaged else 0.0,
        )
    except ValueError as err:
        if str(err).startswith("test_data="):
            raise
        raise ValueError(f"test_data={cfg.test_data!r} is not allowed: {err}") from None
    texts, labels = other.split("test") if packaged else other.split("train")
    if sorted(other.label_names) != sorted(data.label_names):
        raise ValueError(
            f"test_data={cfg.test_data!r} is not allowed with data={cfg.data!r}: its labels "
            f"{other.label_names} are not the training data's {data.label_names}"
        )
    index = torch.tensor([data.label_names.index(name) for name in other.label_names])
    data.test_texts, data.test_labels = list(texts), index[labels]
    data.summary["test_data"] = {
        "source": other.summary.get("source", cfg.test_data),
        "split": "test" if packaged else "all records",
        "size": len(texts),
    }
    data.summary["sizes"] = {**data.summary["sizes"], "test": len(texts)}


def load_classification_data(cfg: ClassifyTrainConfig) -> TextClassificationData:
    """The split data the config names, with the training subset and ``test_data`` applied."""
    own_test = cfg.test_data is None or cfg.data in _PACKAGED
    data = _load_source(cfg, "data", cfg.data, test_fraction=0.1 if own_test else 0.0)
    if cfg.test_data is not None:
        _use_test_data(cfg, data)
    if cfg.train_size is not None and cfg.train_size < data.n_train:
        gen = torch.Generator().manual_seed(cfg.split_seed)
        keep = torch.randperm(data.n_train, generator=gen)[: cfg.train_size].sort().values
        data.train_texts = [data.train_texts[i] for i in keep.tolist()]
        data.train_labels = data.train_labels[keep]
        data.summary["train_subset"] = (
            f"{cfg.train_size} of {data.summary['sizes']['train']} training records "
            f"(uniform, seed {cfg.split_seed})"
        )
        data.summary["sizes"] = {**data.summary["sizes"], "train": cfg.train_size}
    elif cfg.train_size is not None:
        raise ValueError(
            f"train_size={cfg.train_size} is not allowed: the training split has only "
            f"{data.n_train} records (leave train_size unset to use them all)"
        )
    if len(torch.unique(data.train_labels)) < 2:
        raise ValueError(
            f"train_size={cfg.train_size}: the training records hold one class only; "
            "expected at least 2"
        )
    return data


def _encoder_folder(cfg: ClassifyTrainConfig) -> Path:
    if cfg.encoder == "minilm":
        from dptrain.data.text_classification import minilm_path

        return minilm_path()
    path = Path(cfg.encoder)
    if not (path / "config.json").is_file():
        raise ValueError(
            f"encoder={cfg.encoder!r} is not allowed: expected 'minilm' or a local Hugging Face "
            "model folder with a config.json"
        )
    return path


_TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)


def _load_tokenizer(cfg: ClassifyTrainConfig, folder: Path) -> Any:
    from transformers import AutoTokenizer

    # transformers 5 builds an empty tokenizer (every word [UNK]) from a folder without one.
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise ValueError(
            f"encoder={cfg.encoder!r} is not allowed: no tokenizer could be loaded: {folder} "
            f"holds none of {list(_TOKENIZER_FILES)} beside the model"
        )
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError) as err:
        raise ValueError(
            f"encoder={cfg.encoder!r} is not allowed: no tokenizer could be loaded from "
            f"{folder} (expected tokenizer.json or vocab files beside the model): {err}"
        ) from None


def _load_model(
    cfg: ClassifyTrainConfig, folder: Path, tokenizer: Any, n_classes: int, label_names: list[str]
) -> tuple[TextClassifier, dict[str, Any]]:
    """The classifier (without DP-FP layer) and a description of the objective."""
    import transformers

    transformers.logging.set_verbosity_error()  # "newly initialized" warnings are checked below
    transformers.logging.disable_progress_bar()  # one bar per run: the training one
    if cfg.objective == "linear":
        encoder, info = transformers.AutoModel.from_pretrained(
            str(folder), local_files_only=True, output_loading_info=True
        )
        fresh = [k for k in info.get("missing_keys", []) if "pooler" in k]
        if cfg.pooling == "pooler" and fresh:
            raise ValueError(
                f"pooling='pooler' is not allowed with encoder={cfg.encoder!r}: its pooler is not "
                f"in the checkpoint (missing {fresh[:2]}) and would be random; use 'mean' or 'cls'"
            )
        pooled = PooledEncoder(encoder, cfg.pooling)
        # Loading may or may not draw from the global RNG: seed the fresh head's init itself.
        torch.manual_seed(cfg.seed)
        head = nn.Linear(pooled.hidden_size, n_classes)
        return TextClassifier(pooled, head), {"objective": "linear", "pooling": cfg.pooling}
    mlm, info = transformers.AutoModelForMaskedLM.from_pretrained(
        str(folder), local_files_only=True, output_loading_info=True
    )
    head_module = getattr(mlm, "cls", None) or getattr(mlm, "lm_head", None)
    head_prefixes = ("cls.", "lm_head.")
    missing = [k for k in info.get("missing_keys", []) if k.startswith(head_prefixes)]
    if head_module is None or missing:
        raise ValueError(
            f"objective='infilling' is not allowed with encoder={cfg.encoder!r}: it has no "
            f"pretrained masked-LM head (missing: {missing[:3] or 'cls / lm_head'}); use "
            "objective=linear or an encoder saved with its masked-LM head"
        )
    words, ids = _label_word_ids(cfg, tokenizer, n_classes, label_names, space="")
    if tokenizer.mask_token_id is None:
        raise ValueError(f"encoder={cfg.encoder!r}: the tokenizer has no mask token")
    pooled = PooledEncoder(mlm.base_model, "mask", tokenizer.mask_token_id)
    classifier = TextClassifier(pooled, LabelWordHead(head_module, ids))
    return classifier, _infilling_info(cfg, words, label_names)


def _label_word_ids(
    cfg: ClassifyTrainConfig, tokenizer: Any, n_classes: int, label_names: list[str], space: str
) -> tuple[list[str], list[int]]:
    """One vocabulary id per class for text infilling (``space`` + word must be one token)."""
    words = cfg.label_words if cfg.label_words is not None else _LABEL_WORDS.get(cfg.data)
    if words is None:
        raise ValueError(
            f"label_words=None is not allowed for data={cfg.data!r} with objective='infilling': "
            f"give one word per class ({label_names})"
        )
    if len(words) != n_classes:
        raise ValueError(
            f"label_words={words} is not allowed: expected {n_classes} words, one per class "
            f"{label_names}"
        )
    ids = []
    for word in words:
        pieces = tokenizer.tokenize(space + word)
        if len(pieces) != 1 or tokenizer.convert_tokens_to_ids(pieces[0]) == tokenizer.unk_token_id:
            raise ValueError(
                f"label_words entry {word!r} is not allowed: it is not one token of the "
                f"vocabulary (tokenized as {pieces})"
            )
        ids.append(tokenizer.convert_tokens_to_ids(pieces[0]))
    return list(words), ids


def _infilling_info(cfg: ClassifyTrainConfig, words: list[str], names: list[str]) -> dict:
    return {
        "objective": "infilling",
        "prompt": cfg.prompt,
        "label_words": list(words),
        "label_word_of": dict(zip(names, words, strict=True)),
    }


def _causal_classifier(
    cfg: ClassifyTrainConfig, lm: nn.Module, tokenizer: Any, n_classes: int, label_names: list
) -> tuple[TextClassifier, dict[str, Any]]:
    """A causal LM as a classifier: the last token's state, and a fresh linear head or the
    LM head's logits of the label words (the next token after the prompt: Li et al.'s
    aligned objective for a causal LM)."""
    body = lm.base_model  # the decoder stack without the LM head (LlamaModel for Llama)
    if cfg.objective == "linear":
        torch.manual_seed(cfg.seed)
        head = nn.Linear(int(lm.config.hidden_size), n_classes)
        pooled = PooledEncoder(body, cfg.pooling)
        return TextClassifier(pooled, head), {"objective": "linear", "pooling": cfg.pooling}
    # byte-level BPE writes a word after a space as one token with the space in it
    words, ids = _label_word_ids(cfg, tokenizer, n_classes, label_names, space=" ")
    pooled = PooledEncoder(body, "last")
    classifier = TextClassifier(pooled, LabelWordHead(lm.get_output_embeddings(), ids))
    return classifier, _infilling_info(cfg, words, label_names)


def _setup_model(
    cfg: ClassifyTrainConfig, data: TextClassificationData
) -> tuple[TextClassifier, dict[str, Any], Any, str]:
    """The classifier, its objective's description, the tokenizer (with a pad id) and
    what identifies the encoder's weights (for the feature cache)."""
    if cfg.causal:
        lm, tokenizer = load_causal_lm(
            cfg.encoder, num_layers=None, max_length=cfg.max_length, setting="encoder"
        )
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token_id = stop_and_pad_ids(lm, tokenizer)[1]
        if cfg.lora_r is not None:
            add_lora(lm, r=cfg.lora_r, alpha=cfg.lora_alpha, targets=cfg.lora_targets)
        classifier, objective = _causal_classifier(
            cfg, lm, tokenizer, data.n_classes, data.label_names
        )
        key = cfg.encoder if cfg.encoder == SMOLLM2 else str(Path(cfg.encoder).resolve())
    else:
        folder = _encoder_folder(cfg)
        tokenizer = _load_tokenizer(cfg, folder)
        classifier, objective = _load_model(
            cfg, folder, tokenizer, data.n_classes, data.label_names
        )
        if cfg.lora_r is not None:  # peft injects the adapters in place
            add_lora(
                classifier.encoder.encoder,
                r=cfg.lora_r,
                alpha=cfg.lora_alpha,
                targets=cfg.lora_targets,
            )
        key = str(folder.resolve())
    if cfg.lora_r is not None:
        objective["lora"] = {
            "r": cfg.lora_r,
            "alpha": cfg.lora_alpha,
            "targets": list(cfg.lora_targets),
        }
        # peft froze everything but the adapters: the fresh head trains again, the tied
        # LM head of the label words stays frozen
        classifier.head.requires_grad_(not isinstance(classifier.head, LabelWordHead))
    return classifier, objective, tokenizer, key


def _tokenize(cfg: ClassifyTrainConfig, tokenizer: Any, texts: list[str]) -> list[list[int]]:
    """Token ids per text: [CLS] text [SEP], or [CLS] text prompt [SEP] with the prompt kept whole."""
    if cfg.objective == "linear":
        return tokenizer(texts, truncation=True, max_length=cfg.max_length)["input_ids"]
    if cfg.causal:  # text, then the prompt up to [MASK]: the next token is the label word
        prompt_ids = tokenizer(
            " " + cfg.prompt[: -len("[MASK]")].rstrip(), add_special_tokens=False
        )["input_ids"]
        budget = cfg.max_length - len(prompt_ids)
        if budget < 2:
            raise ValueError(
                f"max_length={cfg.max_length} is not allowed: the prompt alone takes "
                f"{len(prompt_ids)} tokens"
            )
        body = tokenizer(texts, truncation=True, max_length=budget)["input_ids"]
        return [[*ids, *prompt_ids] for ids in body]
    prompt = cfg.prompt.replace("[MASK]", tokenizer.mask_token)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    budget = cfg.max_length - len(prompt_ids) - 2
    if budget < 1:
        raise ValueError(
            f"max_length={cfg.max_length} is not allowed: the prompt alone takes "
            f"{len(prompt_ids) + 2} tokens"
        )
    body = tokenizer(texts, add_special_tokens=False, truncation=True, max_length=budget)
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    return [[cls_id, *ids, *prompt_ids, sep_id] for ids in body["input_ids"]]


class _TokenizedTexts(torch.utils.data.Dataset):
    """Records ``(token ids, label)``; :meth:`collate` pads a list of them."""

    def __init__(self, ids: list[list[int]], labels: Tensor, pad_id: int):
        self.ids = ids
        self.labels = labels
        self.pad_id = pad_id

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[list[int], Tensor]:
        return self.ids[i], self.labels[i]

    def collate(self, records: list[tuple[list[int], Tensor]]) -> tuple[dict[str, Tensor], Tensor]:
        width = max((len(ids) for ids, _ in records), default=0)
        input_ids = torch.full((len(records), width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((len(records), width), dtype=torch.long)
        for row, (ids, _) in enumerate(records):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention[row, : len(ids)] = 1
        labels = (
            torch.stack([y for _, y in records]) if records else torch.zeros(0, dtype=torch.long)
        )
        return {"input_ids": input_ids, "attention_mask": attention}, labels

    def batches(self, size: int):
        """Deterministic evaluation batches, length-sorted (less padding); with their positions."""
        order = sorted(range(len(self)), key=lambda i: len(self.ids[i]))
        for start in range(0, len(order), size):
            rows = order[start : start + size]
            inputs, _ = self.collate([self[i] for i in rows])
            yield rows, inputs


def _stack(records: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    return torch.stack([x for x, _ in records]), torch.stack([y for _, y in records])


@dataclass
class _Plan:
    """What setup decided: the sampling, the training length and the noise."""

    n_train: int
    delta: float | None
    sample_rate: float  # q = B / N (a logical batch); DP-FP's p = q / M is per micro-batch
    steps: int
    noise_multiplier: float  # 0 for the non-private run


def _plan(cfg: ClassifyTrainConfig, n_train: int) -> _Plan:
    q = sample_rate_from_batch(cfg.batch_size, n_train)
    steps = steps_from_epochs(cfg.epochs, q)
    if not cfg.private:
        return _Plan(n_train, None, q, steps, 0.0)
    delta = resolve_delta(cfg.delta, n_train)
    try:
        if cfg.method in _DPFP:
            sigma = calibrate_dpfp(
                cfg.epsilon,
                delta,
                sample_rate=q / cfg.micro_batches,
                steps=steps,
                micro_batches=cfg.micro_batches,
                clip=cfg.max_norm,
                accountant=cfg.accountant,
            ).noise_multiplier
        else:
            sigma = calibrate_noise(
                cfg.epsilon, delta, sample_rate=q, steps=steps, accountant=cfg.accountant
            ).noise_multiplier
    except ValueError as err:
        raise ValueError(
            f"epsilon={cfg.epsilon} cannot be reached for method={cfg.method} with "
            f"epochs={cfg.epochs}, batch_size={cfg.batch_size} ({steps} steps, "
            f"delta={delta:.3g}): {err}"
        ) from None
    return _Plan(n_train, delta, q, steps, sigma)


# -- representations of a frozen encoder ------------------------------------------------------


def _tokenized_splits(
    cfg: ClassifyTrainConfig, tokenizer: Any, data: TextClassificationData
) -> dict[str, _TokenizedTexts]:
    return {
        name: _TokenizedTexts(_tokenize(cfg, tokenizer, texts), labels, tokenizer.pad_token_id)
        for name, (texts, labels) in ((s, data.split(s)) for s in ("train", "dev", "test"))
    }


def frozen_encoder_features(
    cfg: ClassifyTrainConfig,
) -> tuple[TextClassificationData, dict[str, Tensor]]:
    """The data and the frozen encoder's pooled representations of every split.

    Exactly what the frozen-encoder methods (``dpsgd-head``, ``dpfp``) train their
    head on: the config's data (with ``train_size``), tokenizer, encoder, pooling
    and ``max_length``, read from ``cfg.feature_cache`` when it holds them (and
    written there otherwise). The features are ``(N, hidden)`` float tensors in
    the order of ``data.split(name)``; the method does not matter. Other recipes
    that train on frozen features (the membership-inference audit's shadow
    probes, :mod:`dptrain.recipes.audit_mia`) call this.
    """
    data = load_classification_data(cfg)
    classifier, _, tokenizer, key = _setup_model(cfg, data)
    classifier.encoder.requires_grad_(False)
    splits = _tokenized_splits(cfg, tokenizer, data)
    return data, _frozen_features(cfg, key, classifier.encoder, splits)


@torch.no_grad()
def _represent(
    encoder: PooledEncoder, data: _TokenizedTexts, batch_size: int, bar: Any = None
) -> Tensor:
    """(N, k) pooled representations in eval mode (deterministic), in record order;
    ``bar`` (a tqdm bar) counts the texts encoded."""
    encoder.eval()
    out = torch.empty(len(data), encoder.hidden_size)
    for rows, inputs in data.batches(batch_size):
        out[rows] = encoder(inputs).float()
        if bar is not None:
            bar.update(len(rows))
    return out


def _frozen_features(
    cfg: ClassifyTrainConfig,
    encoder_key: str,
    encoder: PooledEncoder,
    splits: dict[str, Any],
    write: bool = True,
) -> dict[str, Tensor]:
    """Representations of every split, from ``feature_cache`` when it has them.

    ``write=False`` (ranks other than 0) reads the cache but does not fill it.
    """
    key = None
    if cfg.feature_cache is not None:
        digest = hashlib.sha256()
        for part in (encoder_key, cfg.objective, cfg.pooling, cfg.prompt, cfg.max_length):
            digest.update(repr(part).encode())
        for name in ("train", "dev", "test"):
            digest.update(json.dumps(splits[name].ids).encode())
        key = Path(cfg.feature_cache) / f"features-{digest.hexdigest()[:20]}.pt"
        if key.is_file():
            return torch.load(key, weights_only=True)
    # The frozen encoder's pass is most of a dpfp / dpsgd-head run on CPU (45 s of silence
    # for Rotten Tomatoes before the training bar appeared): it gets its own bar.
    with tqdm(
        total=sum(len(splits[name]) for name in splits),
        disable=not (cfg.progress and write),
        desc="encoding texts (frozen encoder)",
        unit="text",
    ) as bar:
        feats = {
            name: _represent(encoder, splits[name], cfg.eval_batch_size, bar) for name in splits
        }
    if key is not None and write:
        key.parent.mkdir(parents=True, exist_ok=True)
        tmp = key.with_suffix(f".{os.getpid()}.tmp")  # grid workers may race: write, then rename
        torch.save(feats, tmp)
        tmp.replace(key)
    return feats


# -- train / evaluate --------------------------------------------------------------------------


@torch.no_grad()
def _accuracy_of(model: nn.Module, data: Any, labels: Tensor, batch_size: int) -> float:
    """Accuracy of ``model`` on a _TokenizedTexts or a (N, k) feature tensor."""
    model.eval()
    if isinstance(data, Tensor):
        logits = torch.cat(
            [model(data[i : i + batch_size]) for i in range(0, len(data), batch_size)]
        )
    else:
        logits = torch.empty(len(data), 0)
        for rows, inputs in data.batches(batch_size):
            out = model(inputs).float()
            if logits.shape[1] == 0:
                logits = torch.empty(len(data), out.shape[1])
            logits[rows] = out
    return float((logits.argmax(1) == labels).float().mean())


def _param_groups(classifier: TextClassifier, cfg: ClassifyTrainConfig) -> list[dict[str, Any]]:
    """Encoder at ``lr``, head at ``head_lr``; a weight shared by both (text infilling's
    decoder, tied to the word embeddings) is the encoder's."""
    encoder = [p for p in classifier.encoder.parameters() if p.requires_grad]
    shared = {id(p) for p in classifier.encoder.parameters()}
    head = [p for p in classifier.head.parameters() if id(p) not in shared and p.requires_grad]
    return [{"params": encoder, "lr": cfg.lr}, {"params": head, "lr": cfg.head_lr}]


def _epsilons(ledger: PrivacyLedger, delta: float) -> dict[str, float]:
    return {name: make_accountant(name, ledger).epsilon(delta) for name in ACCOUNTANTS}


def _spent(ledger: PrivacyLedger, delta: float | None) -> float:
    """PLD epsilon so far on a 1e-3 grid (pessimistic, ~10x faster); results.json is exact."""
    if delta is None or not ledger.num_steps:
        return 0.0
    return make_accountant("pld", ledger, value_discretization_interval=1e-3).epsilon(delta)


def check_world_size(cfg: ClassifyTrainConfig, world_size: int | None = None) -> None:
    """Refuse (``ValueError``) a method that runs in one process when there are several.

    dpsgd and dpsgd-head train data-parallel; nonprivate, dpfp and dpfp-finetune
    would run W copies, and the audit (``audit=true``) observes one process's optimizer.
    ``world_size``: default ``WORLD_SIZE``.
    """
    check_audit_world_size(cfg.audit, world_size)
    if cfg.method not in _MULTI_PROCESS:
        what = "DP-FP" if cfg.method in _DPFP else "the non-private run"
        refuse_several_processes(
            f"method={cfg.method!r}",
            f"{what} runs in one process (only {' and '.join(_MULTI_PROCESS)} run on several); "
            "run it without torchrun / --nproc",
            world_size,
        )


def train_classify(cfg: ClassifyTrainConfig) -> dict[str, Any]:
    """Run the recipe; return the ``results.json`` content."""
    t0 = time.perf_counter()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    logging.getLogger("absl").setLevel(logging.ERROR)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_world_size(cfg)
    run = launch()
    try:
        return _train_classify(cfg, run, t0)
    finally:
        run.close()


def _train_classify(cfg: ClassifyTrainConfig, run: Launch, t0: float) -> dict[str, Any]:
    main = run.is_main  # only rank 0 writes; with one process, the only rank
    torch.manual_seed(cfg.seed)
    # -- setup (nothing written until it has all passed) --
    data = load_classification_data(cfg)
    classifier, objective, tokenizer, encoder_key = _setup_model(cfg, data)
    splits = _tokenized_splits(cfg, tokenizer, data)
    plan = _plan(cfg, data.n_train)
    if main and cfg.private:
        assert plan.delta is not None
        dpfp = cfg.method in _DPFP  # DP-FP's events are the T x M micro-batches at rate q / M
        m = cfg.micro_batches if dpfp else 1
        print_plan(
            units=plan.n_train,
            unit="text",
            sample_rate=plan.sample_rate / m,
            expected_batch=max(1, round(cfg.batch_size / m)),
            steps=plan.steps * m,
            noise_multiplier=plan.noise_multiplier,
            max_grad_norm=cfg.max_norm,
            clipping="the pooled representation (DP-FP)" if dpfp else "flat",
            delta=plan.delta,
            delta_rule=cfg.delta if isinstance(cfg.delta, str) else None,
            accountant=cfg.accountant,
            target_epsilon=cfg.epsilon,
        )
    out = Path(cfg.out)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
        (out / "data.json").write_text(json.dumps(data.summary, indent=2, default=str))
    ledger = PrivacyLedger(privacy_unit="text")
    if main:  # on disk from the start and after every event: a stopped run keeps its record
        ledger.autosave(out / "ledger.json")

    t_train = time.perf_counter()
    history, best, trainable, scope_detail, canaries = _train(
        cfg, plan, classifier, splits, encoder_key, ledger, run
    )
    # training steps only: without the frozen encoder's pass and the dev evaluations
    train_time = time.perf_counter() - t_train - best["feature_time_s"] - best["eval_time_s"]
    trainable.load_state_dict(best["state"])
    test_data = best["test_data"]
    accuracy = _accuracy_of(best["model"], test_data, splits["test"].labels, cfg.eval_batch_size)

    eps = _epsilons(ledger, plan.delta) if cfg.private else {}
    results: dict[str, Any] = {
        "method": cfg.method,
        "data": data.name,
        **objective,
        "encoder": cfg.encoder,
        "accuracy": accuracy,
        "dev_accuracy": best["dev_accuracy"],
        "best_epoch": best["epoch"],
        "epsilon": eps.get("pld", math.inf),
        "delta": plan.delta if cfg.private else 0.0,
        "privacy_unit": ledger.privacy_unit,
        "target_epsilon": cfg.epsilon,
        "calibrated_with": cfg.accountant if cfg.private else None,
        "epsilon_by_accountant": eps,
        "noise_multiplier": plan.noise_multiplier,
        "max_norm": cfg.max_norm,
        "batch_size": cfg.batch_size,
        "micro_batches": cfg.micro_batches if cfg.method in _DPFP else None,
        "sample_rate": plan.sample_rate / (cfg.micro_batches if cfg.method in _DPFP else 1),
        "steps": plan.steps,
        "ledger_events": ledger.num_steps,
        "epochs": cfg.epochs,
        "lr": cfg.lr,
        "head_lr": cfg.head_lr,
        "n_train": data.n_train,
        "n_dev": len(data.dev_texts),
        "n_test": len(data.test_texts),
        "privacy_scope": _SCOPES[cfg.method],
        "privacy_scope_detail": scope_detail,
        "seed": cfg.seed,
        "feature_time_s": best["feature_time_s"],
        "eval_time_s": best["eval_time_s"],
        "train_time_s": train_time,
        "step_time_s": train_time / max(plan.steps, 1),
        "wall_time_s": time.perf_counter() - t0,
    }
    if cfg.private and cfg.accountant != "pld":
        results["calibration_note"] = (
            f"calibrated with {cfg.accountant} to epsilon {cfg.epsilon:g}"
            + (
                " (the paper's GDP-CLT route, which understates epsilon)"
                if cfg.accountant == "gdp"
                else ""
            )
            + f"; 'epsilon' is the PLD epsilon of the same run: {results['epsilon']:.3g}"
        )
    report_audit(results, canaries, plan.delta, ledger)
    if run.distributed:
        results["world_size"] = run.world_size
    if not main:
        return results
    (out / "results.json").write_text(json.dumps(results, indent=2))
    recipe_privacy_record(
        "dptrain train classify",
        {**results, "accountant": "pld", "max_grad_norm": cfg.max_norm},
        ledger,
        privacy_unit="text",
        covers=[f"{data.n_train} training texts: {_SCOPES[cfg.method]}"],
        not_covered=[
            scope_detail,
            "the pretrained encoder and its tokenizer (public, trained elsewhere)",
            "the dev and test texts: the checkpoint is chosen by dev accuracy, reported "
            "without noise",
        ],
        training={"method": cfg.method, "micro_batches": results["micro_batches"]},
    ).write(out)
    with (out / "metrics.jsonl").open("w") as f:
        for line in history:
            f.write(json.dumps(line) + "\n")
    if cfg.save_checkpoint:
        (out / "checkpoints").mkdir(exist_ok=True)
        torch.save(best["state"], out / "checkpoints" / "best.pt")
    _plot(history, cfg, out / "plots")
    return results


def _train(cfg, plan: _Plan, classifier: TextClassifier, splits, encoder_key: str, ledger, run):
    """The method's training loop; returns history, best state, trainable module, scope text
    and the audit's canaries (None without ``audit=true``)."""
    frozen = cfg.method in _FROZEN
    head = classifier.head
    if frozen:
        classifier.encoder.requires_grad_(False)
        t_features = time.perf_counter()
        feats = _frozen_features(cfg, encoder_key, classifier.encoder, splits, write=run.is_main)
        feature_time = time.perf_counter() - t_features
        train_set = torch.utils.data.TensorDataset(feats["train"], splits["train"].labels)
        trainable: nn.Module = head
        eval_model, dev_data, test_data = head, feats["dev"], feats["test"]
        # Without the frozen encoder's weights (text infilling ties the decoder to them).
        trainable_head = [p for p in head.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable_head, lr=cfg.head_lr, weight_decay=cfg.weight_decay)
    else:
        feature_time = 0.0
        train_set = splits["train"]
        trainable = classifier
        eval_model, dev_data, test_data = classifier, splits["dev"], splits["test"]
        optimizer = torch.optim.AdamW(_param_groups(classifier, cfg), weight_decay=cfg.weight_decay)
    collate = _stack if frozen else splits["train"].collate
    scope = _SCOPES[cfg.method]
    step_fn, describe, canaries = _make_step(
        cfg, plan, classifier, trainable, optimizer, train_set, collate, ledger, scope, run
    )

    evals = {
        min(plan.steps, round(e * plan.steps / cfg.epochs)): e for e in range(1, cfg.epochs + 1)
    }
    evals[plan.steps] = cfg.epochs
    history: list[dict[str, Any]] = []
    best: dict[str, Any] = {"dev_accuracy": -1.0}
    m = cfg.micro_batches if cfg.method in _DPFP else 1  # DP-FP: T x M ledger events
    bar = EpsilonBar(
        total=plan.steps,
        disable=not (cfg.progress and run.is_main),
        desc=cfg.method,
        unit="step",
        curve=EpsilonCurve(
            [(plan.sample_rate / m, plan.noise_multiplier, plan.steps * m)],
            plan.delta,
            cfg.accountant,
        )
        if cfg.private
        else None,
        events_per_step=m,
    )
    loss_sum, loss_n = 0.0, 0
    eval_time = 0.0
    for step in range(1, plan.steps + 1):
        trainable.train()
        loss, n = step_fn()
        loss_sum += loss * n
        loss_n += n
        bar.update(1)
        if step not in evals:
            continue
        # every rank evaluates (the parameters are the same on every rank); the loss is
        # summed over the ranks' shares (a collective at the same steps on every rank)
        if run.distributed:
            loss_sum, loss_n = run.sum(loss_sum, loss_n)
        t_eval = time.perf_counter()
        dev = _accuracy_of(eval_model, dev_data, splits["dev"].labels, cfg.eval_batch_size)
        spent = _spent(ledger, plan.delta)
        eval_time += time.perf_counter() - t_eval
        line = {
            "epoch": evals[step],
            "step": step,
            "train_loss": loss_sum / max(loss_n, 1),
            "epsilon": spent,
            "dev_accuracy": dev,
        }
        history.append(line)
        loss_sum, loss_n = 0.0, 0
        if dev > best["dev_accuracy"]:
            best = {
                "dev_accuracy": dev,
                "epoch": evals[step],
                "state": copy.deepcopy(trainable.state_dict()),
            }
        bar.set_postfix(
            epoch=evals[step],
            loss=f"{line['train_loss']:.3f}",
            eps=f"{spent:.2f}" if cfg.private else "inf",
            dev=f"{dev:.3f}",
        )
    bar.close()
    best.update(
        model=eval_model, test_data=test_data, feature_time_s=feature_time, eval_time_s=eval_time
    )
    return history, best, trainable, describe(), canaries


def _make_step(
    cfg, plan, classifier, trainable, optimizer, train_set, collate, ledger, scope, run=None
):
    """A function running one training step -> (mean loss, records), one describing scope,
    and the audit's canaries attached to the DP optimizer (None without ``audit=true``).

    ``run``: with several processes (dpsgd / dpsgd-head only) the step is this rank's share
    of the logical batch, and the loss and record count are this rank's.
    """
    distributed = run is not None and run.distributed
    if distributed and cfg.method not in _MULTI_PROCESS:  # train_classify refuses it earlier
        raise ValueError(
            f"method={cfg.method!r} is not allowed with WORLD_SIZE={run.world_size}: it runs in "
            "one process"
        )
    if cfg.method in _DPFP:
        dp_layer = DPForwardLayer(cfg.max_norm, plan.noise_multiplier, seed=cfg.seed)
        frozen = cfg.method == "dpfp"
        trainer = DPFPTrainer(
            nn.Identity() if frozen else classifier.encoder,
            classifier.head,
            dp_layer,
            optimizer,
            F.cross_entropy,
            train_set,
            collate,
            sample_rate=plan.sample_rate / cfg.micro_batches,
            micro_batches=cfg.micro_batches,
            encoder_trainable=not frozen,
            ledger=ledger,
            fuse_micro_batches=True,  # Transformers' rows do not interact: same update, faster
        )
        if not frozen:
            classifier.dp_layer = dp_layer  # so the saved model shows where the noise went
        from dptrain.dpfp import BernoulliMicroBatches

        sampler = iter(
            BernoulliMicroBatches(
                len(train_set), cfg.batch_size, cfg.micro_batches, plan.steps, seed=cfg.seed
            )
        )

        def dpfp_step() -> tuple[float, int]:
            result = trainer.step(next(sampler))
            n = sum(result.micro_batch_sizes)
            return (result.loss if result.updated else 0.0), n

        return dpfp_step, lambda: trainer.privacy_scope(plan.delta, "pld"), None

    if not cfg.private:
        loader = torch.utils.data.DataLoader(
            train_set,
            batch_size=cfg.batch_size,
            shuffle=True,
            collate_fn=collate,
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        batches = cycle(loader)

        def plain_step() -> tuple[float, int]:
            inputs, targets = next(batches)
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(trainable(inputs), targets)
            loss.backward()
            optimizer.step()
            return float(loss.detach()), len(targets)

        return plain_step, lambda: scope, None

    make = make_private_distributed if distributed else make_private
    private = make(
        trainable,
        optimizer,
        train_set,
        batch_size=cfg.batch_size,
        max_grad_norm=cfg.max_norm,
        steps=plan.steps,
        noise_multiplier=plan.noise_multiplier,
        mode=cfg.clipping_mode,
        accountant=cfg.accountant,
        max_physical_batch_size=cfg.max_physical_batch_size,
        collate_fn=collate,
        seed=cfg.seed,
        privacy_unit="text",
        ledger=ledger,
    )
    batches = iter(private.data_loader)
    canaries = attach_audit_canaries(
        cfg.audit, trainable.parameters(), private.optimizer, cfg.audit_canaries, cfg.seed
    )
    if distributed and run.rank > 0:  # own dropout stream per rank (rank 0 keeps one process's)
        torch.manual_seed(cfg.seed + 7919 * run.rank)

    def dpsgd_step() -> tuple[float, int]:
        batch = next(batches)
        private.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for inputs, targets in batch.chunks:
            losses = F.cross_entropy(trainable(inputs), targets, reduction="none")
            private.backward(losses)
            total += float(losses.detach().sum())
        private.optimizer.step()
        return total / max(batch.size, 1), batch.size

    detail = (
        f"DP-Adam (DP-SGD) through the clipping engine ({cfg.clipping_mode}): C={cfg.max_norm:g}, "
        f"noise_multiplier={plan.noise_multiplier:.4g}, q={plan.sample_rate:.4g}, "
        f"{plan.steps} steps; {scope}"
    )
    return dpsgd_step, lambda: detail, canaries


def _plot(history: list[dict[str, Any]], cfg: ClassifyTrainConfig, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(exist_ok=True)
    title = cfg.method + (f", target epsilon {cfg.epsilon:g}" if cfg.private else "")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    epochs = [h["epoch"] for h in history]
    axes[0].plot(epochs, [h["dev_accuracy"] for h in history], marker="o", ms=3)
    axes[0].set_xlabel("epoch")
    axes[0].set_ylabel("dev accuracy")
    axes[1].plot([h["step"] for h in history], [h["epsilon"] for h in history], marker="o", ms=3)
    if cfg.private:
        axes[1].axhline(cfg.epsilon, color="grey", ls="--", lw=1, label="target")
        axes[1].legend()
    axes[1].set_xlabel("training step")
    axes[1].set_ylabel("epsilon spent (PLD)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(folder / "curves.png", dpi=120)
    plt.close(fig)
