"""DP-FP and DP-SGD step time vs non-private training of MiniLM (issue 3; not a test).

    .venv/bin/python benchmarks/bench_dpfp.py [--quick] [--json PATH] [--markdown PATH]
        [--batch-size B] [--threads N] [--steps N] [--warmup N] [--methods A,B] [--no-memory]

Question (issue 3): what does DP forward propagation cost per training step
compared with non-private training of the same model (goal: <= 1.05x), and
what does DP-SGD with book-keeping clipping cost on that model? DP-FP adds
only a clip and a Gaussian draw on the (B, 384) pooled representation, so
its overhead should be small when the batch runs in one pass; Algorithm 1
run literally (M micro-batches one after the other) is another matter, and is
measured too.

Model: the packaged all-MiniLM-L6-v2 (``transformers.AutoModel``, loaded
offline from :func:`dptrain.data.minilm_path`; dropout as configured, 0.1),
mean pooling over the attention mask, ``nn.Linear(384, 2)`` head (seed 0);
AdamW(lr=1e-4). Every method loads its own copy of the same weights. Input:
the first B (default 32) Rotten Tomatoes training reviews with their labels,
tokenized with max_length 128 and padded to the longest review of the batch.

Methods (one full optimizer step each: zero_grad, forward, backward, AdamW step):

- ``nonprivate``: mean cross-entropy, ``loss.backward()``; encoder fine-tuned;
- ``dpfp``: ``DPForwardLayer(max_norm=1.0, noise_multiplier=1.0, seed=0)``
  between pooling and head, encoder fine-tuned (the paper's setting), the
  whole batch as one micro-batch: ``DPFPTrainer(..., micro_batches=1,
  encoder_trainable=True).step([[0..B-1]])``. Goal: <= 1.05x ``nonprivate``;
- ``dpfp-micro32``: the same with M = 32 micro-batches of one review each
  (Algorithm 1 with B = M = 32, where a Bernoulli micro-batch holds ~1 example):
  ``DPFPTrainer(..., micro_batches=32).step([[0], [1], ..., [31]])``, i.e. 32
  single-example forward/backward passes (each padded to its own length),
  gradients accumulated, one AdamW step: what a sequential implementation costs.
  Fixed micro-batches, no Bernoulli draw (a draw only varies their sizes); at
  another B, the B reviews are split into 32 contiguous micro-batches;
- ``nonprivate-frozen``: encoder frozen (eval mode, forward under ``no_grad``),
  only the head trains;
- ``dpfp-frozen``: the same frozen encoder with the DP-FP layer, through
  ``DPFPTrainer(..., micro_batches=1, encoder_trainable=False)`` (the setting the
  guarantee covers); compared with ``nonprivate-frozen``;
- ``dpsgd-bk``: DP-SGD on the whole model, ``ClippingEngine(model, 0.1,
  mode="book_keeping")`` on per-example cross-entropies (reduction "none"), then
  ``DPOptimizer(AdamW, noise_multiplier=1.0, max_grad_norm=0.1,
  expected_batch_size=B)`` (noise std sigma C on the clipped sum, divided by B);
- ``dpsgd-ghost``: the same with ``mode="ghost"`` (a second backward pass).

Fine-tuning methods are compared with ``nonprivate``, frozen ones with
``nonprivate-frozen`` (time_ratio = median / the reference's median).

Timing: ``torch.set_num_threads(--threads, default 2)``; every method gets the
warm-up steps and then the timed steps (default 2 + 9; quick 1 + 5),
interleaved round-robin (one step of each method per round, the starting
method rotating every round) so that drift and other load hit all methods
alike. Reported: the median wall-clock step time, its interquartile range and
min-max, the range of the per-round ratios (a method's step / its reference's
step in the same round), which shows how far noise moves the ratio, and the
median process CPU time of a step (all threads) with its ratio: on a shared
machine the CPU time is less disturbed by other jobs than the wall-clock time
(but OpenMP threads that spin while waiting for a descheduled peer inflate it).
On a machine where other jobs hold cores, more threads than free cores make
every step several times slower and erratic (on a loaded 2-core machine a
non-private step took 1.2-1.8 s with one thread, 2.6-7.4 s with two, 0.6 s with
two when idle): prefer ``--threads 1`` there, and read the load averages
printed with the results.

Memory: each method runs in a fresh process (hidden flag ``--child-memory``,
through :func:`_harness.run_fresh`) that builds the data, model and optimizer,
records ``ru_maxrss`` (the baseline: imports, tokenizer, model, optimizer),
runs 3 steps and reports ``ru_maxrss`` again. memory_ratio = peak / the
reference's peak; the increment (peak - baseline) removes the common baseline.
``--no-memory`` and ``--quick`` skip this (about 10 s a method, more for
dpfp-micro32).

Quick mode: 1 warm-up + 5 timed steps, no ``dpsgd-ghost``, no memory
processes: about a minute on an idle 2-core machine (``dpfp-micro32`` alone
takes ~7 s a step).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from _harness import command_line, git_description, machine_description, maxrss_mb, run_fresh

LR = 1e-4
SEED = 0
MAX_LENGTH = 128
HIDDEN = 384
N_CLASSES = 2
DPFP_MAX_NORM = 1.0
DPSGD_MAX_GRAD_NORM = 0.1
NOISE_MULTIPLIER = 1.0
MICRO_BATCHES = 32
MEMORY_STEPS = 3
GOAL_METHOD, GOAL_RATIO = "dpfp", 1.05

#: method -> its non-private reference
METHODS: dict[str, str] = {
    "nonprivate": "nonprivate",
    "dpfp": "nonprivate",
    "dpfp-micro32": "nonprivate",
    "nonprivate-frozen": "nonprivate-frozen",
    "dpfp-frozen": "nonprivate-frozen",
    "dpsgd-bk": "nonprivate",
    "dpsgd-ghost": "nonprivate",
}
QUICK_METHODS = tuple(m for m in METHODS if m != "dpsgd-ghost")


@dataclass
class Record:
    method: str
    reference: str
    batch_size: int
    seq_len: int
    threads: int
    step_time_s: float | None = None
    step_time_q1_s: float | None = None
    step_time_q3_s: float | None = None
    step_time_min_s: float | None = None
    step_time_max_s: float | None = None
    timed_steps: int = 0
    time_ratio: float | None = None
    cpu_time_s: float | None = None
    cpu_ratio: float | None = None
    round_ratio_min: float | None = None
    round_ratio_max: float | None = None
    peak_mb: float | None = None
    baseline_mb: float | None = None
    peak_increment_mb: float | None = None
    memory_ratio: float | None = None
    error: str | None = None
    step_times_s: list[float] = field(default_factory=list)
    cpu_times_s: list[float] = field(default_factory=list)


# -- data and model -------------------------------------------------------------------------------


@dataclass
class Batch:
    """The first B training reviews: per-example token ids (unpadded) and labels."""

    ids: list[Tensor]
    labels: Tensor
    pad_id: int
    n_train: int

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.ids[i], self.labels[i]

    def collate(self, rows: Sequence[tuple[Tensor, Tensor]]) -> tuple[dict[str, Tensor], Tensor]:
        """Pad to the longest row (dynamic padding, as the tokenizer's padding="longest")."""
        pad = nn.utils.rnn.pad_sequence
        ids = pad([r[0] for r in rows], batch_first=True, padding_value=self.pad_id)
        mask = pad([torch.ones_like(r[0]) for r in rows], batch_first=True, padding_value=0)
        return {"input_ids": ids, "attention_mask": mask}, torch.stack([r[1] for r in rows])

    def whole(self) -> tuple[dict[str, Tensor], Tensor]:
        return self.collate([self[i] for i in range(len(self))])


def load_batch(batch_size: int) -> Batch:
    from dptrain.data.text_classification import (
        load_minilm_tokenizer,
        load_rotten_tomatoes,
        tokenize_texts,
    )

    data = load_rotten_tomatoes()
    if batch_size > data.n_train:
        raise ValueError(f"--batch-size={batch_size} exceeds the {data.n_train} training reviews")
    tokenizer = load_minilm_tokenizer()
    enc = tokenize_texts(tokenizer, data.train_texts[:batch_size], MAX_LENGTH)
    lengths = enc["attention_mask"].sum(1).tolist()  # right padding: tokens come first
    ids = [row[:n].clone() for row, n in zip(enc["input_ids"], lengths, strict=True)]
    return Batch(ids, data.train_labels[:batch_size], tokenizer.pad_token_id, data.n_train)


class MeanPooledEncoder(nn.Module):
    """MiniLM -> mean of the last hidden states over the attention mask, (B, 384)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoModel

        from dptrain.data.text_classification import minilm_path

        self.bert = AutoModel.from_pretrained(str(minilm_path()), local_files_only=True)

    def forward(self, inputs: Mapping[str, Tensor]) -> Tensor:
        mask = inputs["attention_mask"]
        hidden = self.bert(input_ids=inputs["input_ids"], attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)


class Classifier(nn.Module):
    """Encoder + head with tensor arguments (the clipping engine reads B from input_ids)."""

    def __init__(self, encoder: MeanPooledEncoder, head: nn.Linear) -> None:
        super().__init__()
        self.encoder, self.head = encoder, head

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.head(self.encoder({"input_ids": input_ids, "attention_mask": attention_mask}))


def make_model() -> tuple[MeanPooledEncoder, nn.Linear]:
    encoder = MeanPooledEncoder().train()
    torch.manual_seed(SEED)  # the same head for every method
    return encoder, nn.Linear(HIDDEN, N_CLASSES)


# -- one method's training step -------------------------------------------------------------------


def nonprivate_step(batch: Batch, frozen: bool) -> Callable[[], None]:
    encoder, head = make_model()
    inputs, labels = batch.whole()
    if frozen:
        encoder.requires_grad_(False).eval()
    params = head.parameters() if frozen else [*encoder.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=LR)

    def step() -> None:
        opt.zero_grad()
        with torch.set_grad_enabled(not frozen):
            h = encoder(inputs)
        F.cross_entropy(head(h), labels).backward()
        opt.step()

    return step


def dpfp_step(batch: Batch, micro_batches: int, frozen: bool) -> Callable[[], None]:
    """DPFPTrainer.step on M fixed micro-batches (Algorithm 1 without the Bernoulli draw)."""
    from dptrain.dpfp import DPForwardLayer, DPFPTrainer

    encoder, head = make_model()
    if frozen:
        encoder.eval()  # the trainer freezes it (requires_grad_(False), no_grad)
    params = head.parameters() if frozen else [*encoder.parameters(), *head.parameters()]
    trainer = DPFPTrainer(
        encoder,
        head,
        DPForwardLayer(DPFP_MAX_NORM, NOISE_MULTIPLIER, seed=SEED),
        torch.optim.AdamW(params, lr=LR),
        F.cross_entropy,
        batch,
        batch.collate,
        sample_rate=len(batch) / (micro_batches * batch.n_train),
        micro_batches=micro_batches,
        encoder_trainable=not frozen,
    )
    # M contiguous micro-batches: all B examples at M=1, one example each at M=B=32
    micro = [c.tolist() for c in torch.arange(len(batch)).tensor_split(micro_batches)]

    def step() -> None:
        trainer.step(micro)

    return step


def dpsgd_step(batch: Batch, mode: str) -> Callable[[], None]:
    from dptrain.clipping import ClippingEngine
    from dptrain.optim import DPOptimizer

    model = Classifier(*make_model())
    inputs, labels = batch.whole()
    engine = ClippingEngine(model, DPSGD_MAX_GRAD_NORM, mode=mode)
    dpopt = DPOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR),
        noise_multiplier=NOISE_MULTIPLIER,
        max_grad_norm=DPSGD_MAX_GRAD_NORM,
        expected_batch_size=len(batch),
        sample_rate=len(batch) / batch.n_train,
        seed=SEED,
    )

    def step() -> None:
        dpopt.zero_grad()
        logits = model(inputs["input_ids"], inputs["attention_mask"])
        engine.backward(F.cross_entropy(logits, labels, reduction="none"))
        dpopt.step()

    return step


def build_step(method: str, batch: Batch) -> Callable[[], None]:
    """Model, optimizer and step closure of one method (each method its own model copy)."""
    builders: dict[str, Callable[[], Callable[[], None]]] = {
        "nonprivate": lambda: nonprivate_step(batch, frozen=False),
        "nonprivate-frozen": lambda: nonprivate_step(batch, frozen=True),
        "dpfp": lambda: dpfp_step(batch, 1, frozen=False),
        "dpfp-micro32": lambda: dpfp_step(batch, MICRO_BATCHES, frozen=False),
        "dpfp-frozen": lambda: dpfp_step(batch, 1, frozen=True),
        "dpsgd-bk": lambda: dpsgd_step(batch, "book_keeping"),
        "dpsgd-ghost": lambda: dpsgd_step(batch, "ghost"),
    }
    if method not in builders:
        raise ValueError(f"method={method!r} is not allowed: expected one of {list(METHODS)}")
    return builders[method]()


def first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- timing ---------------------------------------------------------------------------------------


def run_rounds(
    steps: dict[str, Callable[[], None]], warmup: int, timed: int, errors: dict[str, str]
) -> dict[str, list[tuple[float, float]]]:
    """Round-robin: one step of each method per round, the first method rotating.

    Returns (wall-clock, process CPU) seconds of each timed step per method.
    """
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in steps}
    for r in range(warmup + timed):
        alive = list(steps)
        k = r % len(alive) if alive else 0
        parts = []
        for m in alive[k:] + alive[:k]:
            start, cpu_start = time.perf_counter(), time.process_time()
            try:
                steps[m]()
            except Exception as exc:
                errors[m] = first_line(exc)
                del steps[m]
                parts.append(f"{m} failed")
                continue
            elapsed = time.perf_counter() - start
            if r >= warmup:
                times[m].append((elapsed, time.process_time() - cpu_start))
            parts.append(f"{m} {elapsed:.3f}s")
        kind = "warm-up" if r < warmup else "timed"
        log(f"  round {r + 1}/{warmup + timed} ({kind}): " + ", ".join(parts))
    return {m: ts for m, ts in times.items() if m in steps}


def summarize(rec: Record, times: list[tuple[float, float]]) -> None:
    ts = [wall for wall, _ in times]
    rec.step_times_s, rec.cpu_times_s = ts, [cpu for _, cpu in times]
    rec.cpu_time_s = statistics.median(rec.cpu_times_s)
    rec.timed_steps = len(ts)
    rec.step_time_s = statistics.median(ts)
    rec.step_time_min_s, rec.step_time_max_s = min(ts), max(ts)
    if len(ts) >= 2:
        q1, _, q3 = statistics.quantiles(ts, n=4, method="inclusive")
        rec.step_time_q1_s, rec.step_time_q3_s = q1, q3


def add_ratios(records: dict[str, Record]) -> None:
    """time_ratio, cpu_ratio (of medians) and the range of per-round time ratios."""
    for rec in records.values():
        ref = records.get(rec.reference)
        if ref is None or rec.step_time_s is None or not ref.step_time_s:
            continue
        rec.time_ratio = rec.step_time_s / ref.step_time_s
        if rec.cpu_time_s is not None and ref.cpu_time_s:
            rec.cpu_ratio = rec.cpu_time_s / ref.cpu_time_s
        if len(rec.step_times_s) == len(ref.step_times_s):
            paired = [a / b for a, b in zip(rec.step_times_s, ref.step_times_s, strict=True)]
            rec.round_ratio_min, rec.round_ratio_max = min(paired), max(paired)


def time_methods(
    methods: Sequence[str], batch: Batch, threads: int, warmup: int, timed: int
) -> dict[str, Record]:
    seq_len = max(len(t) for t in batch.ids)
    records = {m: Record(m, METHODS[m], len(batch), seq_len, threads) for m in methods}
    errors: dict[str, str] = {}
    steps: dict[str, Callable[[], None]] = {}
    for m in methods:
        try:
            steps[m] = build_step(m, batch)
        except Exception as exc:
            errors[m] = first_line(exc)
    for m, ts in run_rounds(steps, warmup, timed, errors).items():
        if ts:
            summarize(records[m], ts)
    for m, msg in errors.items():
        records[m].error = msg
    add_ratios(records)
    return records


# -- memory (fresh process per method) ------------------------------------------------------------


def child_memory(method: str, batch_size: int, threads: int) -> None:
    """Hidden mode: build, run MEMORY_STEPS steps, print {"peak_mb", "baseline_mb"} as JSON."""
    torch.set_num_threads(threads)
    out: dict = {"method": method, "batch_size": batch_size}
    try:
        step = build_step(method, load_batch(batch_size))
        out["baseline_mb"] = maxrss_mb()
        for _ in range(MEMORY_STEPS):
            step()
        out["peak_mb"] = maxrss_mb()
    except Exception as exc:
        out["error"] = first_line(exc)
    print(json.dumps(out))


def add_memory(records: dict[str, Record], batch_size: int, threads: int) -> None:
    for m, rec in records.items():
        res = run_fresh(__file__, "--child-memory", m, str(batch_size), str(threads), what="memory")
        if "peak_mb" in res:
            rec.peak_mb, rec.baseline_mb = res["peak_mb"], res["baseline_mb"]
            rec.peak_increment_mb = rec.peak_mb - rec.baseline_mb
            log(f"  {m}: peak RSS {rec.peak_mb:.0f} MB (baseline {rec.baseline_mb:.0f} MB)")
        else:
            rec.error = rec.error or res.get("error", "memory measurement failed")
            log(f"  {m}: {rec.error}")
    for rec in records.values():
        ref = records.get(rec.reference)
        if ref is not None and ref.peak_mb and rec.peak_mb is not None:
            rec.memory_ratio = rec.peak_mb / ref.peak_mb


# -- reporting ------------------------------------------------------------------------------------


def _fmt(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{spec}}{suffix}"


def _range(lo: float | None, hi: float | None, spec: str, suffix: str = "") -> str:
    return "-" if lo is None or hi is None else f"{lo:{spec}}-{hi:{spec}}{suffix}"


def markdown_table(records: list[Record]) -> str:
    lines = [
        "| method | vs | step time median (s) | IQR (s) | min-max (s) | time ratio "
        "| per-round ratios | CPU time median (s) | CPU ratio | peak RSS (MB) "
        "| increment (MB) | memory ratio | error |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in records:
        vs = "-" if r.reference == r.method else r.reference
        lines.append(
            f"| {r.method} | {vs} | {_fmt(r.step_time_s, '.3f')} "
            f"| {_range(r.step_time_q1_s, r.step_time_q3_s, '.3f')} "
            f"| {_range(r.step_time_min_s, r.step_time_max_s, '.3f')} "
            f"| {_fmt(r.time_ratio, '.3f', 'x')} "
            f"| {_range(r.round_ratio_min, r.round_ratio_max, '.2f', 'x')} "
            f"| {_fmt(r.cpu_time_s, '.3f')} | {_fmt(r.cpu_ratio, '.3f', 'x')} "
            f"| {_fmt(r.peak_mb, '.0f')} | {_fmt(r.peak_increment_mb, '.0f')} "
            f"| {_fmt(r.memory_ratio, '.3f', 'x')} | {(r.error or '').replace('|', '/')} |"
        )
    return "\n".join(lines)


def goal_line(records: dict[str, Record]) -> str:
    rec = records.get(GOAL_METHOD)
    if rec is None or rec.time_ratio is None:
        return f"Goal {GOAL_METHOD} / {METHODS[GOAL_METHOD]} <= {GOAL_RATIO:.2f}x: not measured."
    verdict = "met" if rec.time_ratio <= GOAL_RATIO else "**missed**"
    spread = _range(rec.round_ratio_min, rec.round_ratio_max, ".3f", "x")
    return (
        f"Goal {GOAL_METHOD} / {rec.reference} <= {GOAL_RATIO:.2f}x: {verdict} "
        f"({rec.time_ratio:.3f}x, ratio of median step times over {rec.timed_steps} steps; "
        f"per-round ratios {spread}; CPU-time ratio {_fmt(rec.cpu_ratio, '.3f', 'x')})."
    )


def settings_lines(
    args: argparse.Namespace, seq_len: int, timed: int, extra: list[str]
) -> list[str]:
    versions = ", ".join(f"{p} {importlib.metadata.version(p)}" for p in ("torch", "transformers"))
    return [
        f"- Date: {datetime.date.today().isoformat()}",
        f"- Machine: {machine_description()}; Python {platform.python_version()}; {versions}",
        f"- Command: `{command_line()}`{' (quick mode)' if args.quick else ''}",
        f"- dptrain: {git_description()}",
        *extra,
        f"- Threads: `torch.set_num_threads({args.threads})` in every process.",
        f"- Model: all-MiniLM-L6-v2 (packaged), mean pooling, Linear({HIDDEN}, {N_CLASSES}); "
        f"AdamW(lr={LR}); the first {args.batch_size} Rotten Tomatoes training reviews, "
        f"max_length {MAX_LENGTH}, padded to the longest ({seq_len} tokens).",
        f"- DP-FP: DPForwardLayer(max_norm={DPFP_MAX_NORM}, noise_multiplier={NOISE_MULTIPLIER}, "
        f"seed={SEED}) via DPFPTrainer; DP-SGD: ClippingEngine(C={DPSGD_MAX_GRAD_NORM}) + "
        f"DPOptimizer(AdamW, noise_multiplier={NOISE_MULTIPLIER}).",
        f"- Timing: {args.warmup} warm-up + {timed} timed steps per method, interleaved "
        "round-robin; median, IQR, min-max; time ratio = median / the reference's median; "
        "per-round ratios = step / the reference's step in the same round (min-max); CPU "
        "time = process CPU seconds of a step (all threads), CPU ratio of medians likewise.",
        "- Memory: "
        + (
            "not measured (--quick or --no-memory)."
            if args.no_memory
            else f"peak RSS (`ru_maxrss`) of a fresh process per method running {MEMORY_STEPS} "
            "steps; increment = peak - RSS after building data, model and optimizer."
        ),
    ]


def write_markdown(path: str, records: list[Record], settings: list[str], goal: str) -> None:
    parts = [
        "# DP-FP and DP-SGD step time vs non-private training of MiniLM",
        "",
        *settings,
        "",
        "## Results",
        "",
        markdown_table(records),
        "",
        goal,
    ]
    with open(path, "w") as f:
        f.write("\n".join(parts).rstrip() + "\n")


# -- main -----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 warm-up + 5 timed steps, no dpsgd-ghost, no memory processes (~1 min unloaded)",
    )
    parser.add_argument("--json", metavar="PATH", help="write the records (a JSON list) here")
    parser.add_argument("--markdown", metavar="PATH", help="write the report (markdown) here")
    parser.add_argument("--batch-size", type=int, default=32, help="B (default 32)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 9; quick 5)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (2; quick 1)")
    parser.add_argument(
        "--methods",
        metavar="A,B",
        help=f"only these methods (of {', '.join(METHODS)}; their references are added)",
    )
    parser.add_argument(
        "--no-memory", action="store_true", help="skip the peak-RSS processes (quick: always)"
    )
    parser.add_argument("--child-memory", nargs=3, metavar=("M", "B", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_memory:
        return args
    args.steps = args.steps if args.steps is not None else (5 if args.quick else 9)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    if args.steps < 1 or args.warmup < 0 or args.batch_size < 1 or args.threads < 1:
        parser.error("--steps, --batch-size and --threads must be >= 1, --warmup >= 0")
    args.no_memory = args.no_memory or args.quick
    methods = QUICK_METHODS if args.quick else tuple(METHODS)
    if args.methods:
        chosen = args.methods.split(",")
        bad = [m for m in chosen if m not in METHODS]
        if bad:
            parser.error(f"--methods {','.join(bad)} not allowed: expected some of {list(METHODS)}")
        wanted = {*chosen, *(METHODS[m] for m in chosen)}
        methods = tuple(m for m in METHODS if m in wanted)
    args.method_list = methods
    return args


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = parse_args()
    if args.child_memory:
        method, b, threads = args.child_memory
        child_memory(method, int(b), int(threads))
        return

    torch.set_num_threads(args.threads)
    start, load_at_start = time.perf_counter(), os.getloadavg()
    cores = os.cpu_count() or 1
    if load_at_start[0] + args.threads > cores + 0.5:
        log(
            f"warning: 1-minute load average {load_at_start[0]:.2f} on {cores} cores: "
            f"{args.threads} threads will compete with other jobs (timings erratic)"
        )
    batch = load_batch(args.batch_size)
    seq_len = max(len(t) for t in batch.ids)
    log(
        f"torch.set_num_threads({args.threads}); B={len(batch)}, L={seq_len}; methods "
        f"{', '.join(args.method_list)}; {args.warmup} warm-up + {args.steps} timed steps"
    )
    records = time_methods(args.method_list, batch, args.threads, args.warmup, args.steps)
    if not args.no_memory:
        log("peak memory (fresh process per method)")
        add_memory(records, args.batch_size, args.threads)

    total_s = time.perf_counter() - start
    load_at_end = os.getloadavg()
    timing = [
        f"- Total run time: {total_s / 60:.1f} min; 1-minute load average "
        f"{load_at_start[0]:.2f} at the start, {load_at_end[0]:.2f} at the end."
    ]
    settings = settings_lines(args, seq_len, args.steps, timing)
    goal = goal_line(records)
    all_records = list(records.values())
    print("\n".join(settings))
    print()
    print(markdown_table(all_records))
    print()
    print(goal)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in all_records], f, indent=1)
            f.write("\n")
    if args.markdown:
        write_markdown(args.markdown, all_records, settings, goal)


if __name__ == "__main__":
    main()
