"""Recipe: private sequential recommendation (DPFormer, Transformer, GRU, LSTM, most-popular).

``dptrain train seqrec [--config FILE] [key=value ...]`` runs, in order:

1. **setup**: check the config, load and preprocess the data (SASRec rules),
   fix delta, calibrate the noise for the whole run (a DP item histogram, if
   asked for, is charged to the same budget), build the model. Bad input stops
   here, before anything is written.
2. **train**: DP-Adam through the clipping engine (Poisson-sampled logical
   batches, automatic clipping, noise once per step, every step in the
   ledger), 20% linear warm-up then linear decay; or plain Adam for the
   non-private run (``epsilon=null``). A progress bar shows the epoch, the
   loss and the epsilon spent.
3. **evaluate**: after every ``eval_every`` epochs, full ranking of the whole
   catalogue on the validation users (NDCG@10, HIT@10, MRR); the best epoch by
   validation NDCG@10 is kept, and the test split is scored once, at the end,
   with that model.
4. **save**: the run folder holds ``config.yaml`` (resolved), ``data.json``,
   ``ledger.json``, ``metrics.jsonl`` (one line per evaluation),
   ``results.json`` (with ``audit=true`` its ``audit`` section: the white-box
   one-run audit of this run, :class:`~dptrain.audit.GradientCanaries`),
   ``checkpoints/{best,last}.pt`` and PNG plots of validation NDCG over epochs
   and of epsilon over steps.

Under torchrun (``WORLD_SIZE`` > 1; ``dptrain train seqrec --nproc N`` starts
it) the private training runs data-parallel on the N processes through
:func:`~dptrain.distributed.make_private_distributed` (the same logical
batches, one noise draw per step, the same ledger as one process); every
rank evaluates, only rank 0 writes the run folder and shows the progress
bar. The non-private run, ``most-popular`` and ``audit=true`` run in one
process only.

The guarantee is per record of the training data: on MovieLens one record is
one user's whole sequence (user-level DP); on the news corpus one record is a
text chunk (example-level DP). Labels are part of the record and protected.
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
from dptrain.accounting import (
    ACCOUNTANTS,
    PrivacyLedger,
    calibrate_noise,
    make_accountant,
    sample_rate_from_batch,
    steps_from_epochs,
)
from dptrain.config import save_config
from dptrain.distributed import make_private_distributed
from dptrain.losses import per_example_cross_entropy
from dptrain.mechanisms import dp_item_counts, item_presence_counts
from dptrain.metrics.ranking import ranking_metrics, target_ranks
from dptrain.privacy_engine import make_private
from dptrain.progress import EpsilonBar, EpsilonCurve
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
    "MODELS",
    "SeqRecTrainConfig",
    "build_model",
    "load_data",
    "resolve_delta",
    "train_seqrec",
]

log = logging.getLogger(__name__)

#: Model names: DPFormer = tied Transformer + Re-Attention (the paper's model).
MODELS = ("dpformer", "transformer", "transformer-untied", "gru", "lstm", "most-popular")
_FREQUENCY_SOURCES = ("dp", "train")
_NEURAL = tuple(m for m in MODELS if m != "most-popular")


@dataclass
class SeqRecTrainConfig:
    """Settings of one run; every field can be set in YAML or as ``key=value``."""

    # data
    data: str = "ml-100k"
    """``ml-100k`` (packaged), ``news`` (next-word, packaged) or a CSV/TSV/Parquet path."""
    user_col: str = "user_id"
    """Column of user ids in a data file."""
    item_col: str = "item_id"
    """Column of item ids in a data file."""
    time_col: str = "timestamp"
    """Column of timestamps in a data file (orders each user's sequence)."""
    min_count: int = 5
    """Drop users and items with fewer than this many interactions."""
    max_len: int = 50
    """Keep each user's last max_len items."""
    news_vocab_size: int = 5000
    """Vocabulary size of ``data=news`` (most frequent words)."""
    # model
    model: str = "dpformer"
    """``dpformer``, ``transformer``, ``transformer-untied``, ``gru``, ``lstm`` or ``most-popular``."""
    d_model: int = 64
    """Hidden size of the model."""
    n_head: int = 1
    """Attention heads."""
    n_layer: int = 2
    """Layers."""
    dropout: float = 0.2
    """Dropout probability of the model."""
    pre_ln: bool = True
    """LayerNorm before (true) or after (false) each sub-block."""
    # privacy
    epsilon: float | None = 8.0
    """Target epsilon for the whole run; ``null`` trains without privacy."""
    delta: float | str = "1/N^1.1"
    """A number, or ``1/N^1.1`` / ``1/(2N)`` with N the number of training records."""
    accountant: str = "pld"
    """Accountant that calibrates sigma and reports epsilon: ``pld`` (tightest), ``rdp`` or ``gdp`` (approximate)."""
    max_grad_norm: float = 1.0
    """C: the clipping norm of each unit's gradient."""
    clipping: str = "automatic"
    """Clipping function: ``flat`` (clip to C), ``automatic`` (normalize, Bu et al.) or ``per_layer``."""
    mode: str = "book_keeping"
    """How per-example gradients are clipped: ``book_keeping`` (one backward pass) or ``ghost`` (two, less memory)."""
    frequencies: str = "dp"
    """Item frequencies for Re-Attention: ``dp`` (a DP histogram, charged to the
    budget) or ``train`` (the paper's assumption that they are public; the
    released model then depends on them outside the guarantee)."""
    frequency_noise_multiplier: float = 20.0
    """Noise multiplier of the DP item-frequency histogram (``frequencies=dp``)."""
    # optimisation
    epochs: int = 100
    """Passes over the users (steps = floor(epochs / q))."""
    batch_size: int = 128
    """Expected logical batch size B of users (q = B / N)."""
    lr: float = 1e-3
    """Learning rate."""
    weight_decay: float = 0.0
    """Weight decay of the optimizer."""
    warmup_fraction: float = 0.2
    """Share of the steps spent warming the learning rate up linearly."""
    max_physical_batch_size: int | None = None
    """Most records per forward/backward chunk (memory); the logical batch and the guarantee are unchanged."""
    # evaluation and output
    eval_every: int = 1
    """Evaluate on the validation users every this many epochs."""
    eval_batch_size: int = 512
    """Records per batch when evaluating (no effect on training)."""
    num_threads: int = 0
    """torch threads for this run; 0 leaves torch's default (small models run best on 1)."""
    seed: int = 0
    """Fixes initialization, sampling and noise (reproducible, so the noise is known to anyone who knows it)."""
    audit: bool = False
    """Run the white-box one-run audit on this run (dptrain.audit.GradientCanaries): its
    lower bounds go to results.json's ``audit`` section; the canaries are in the model."""
    audit_canaries: int = 100_000
    """Canaries of the audit (at most the trainable coordinates)."""
    out: str = "runs/seqrec"
    """Output folder of the run."""
    save_checkpoints: bool = True
    """Save a checkpoint each epoch (a run can be resumed)."""
    progress: bool = True
    """Show a progress bar on stderr."""

    def __post_init__(self) -> None:
        check_choice("model", self.model, MODELS)
        check_choice("accountant", self.accountant, tuple(ACCOUNTANTS))
        check_choice("frequencies", self.frequencies, _FREQUENCY_SOURCES)
        check_choice("clipping", self.clipping, ("automatic", "flat"))
        check_choice("mode", self.mode, ("book_keeping", "ghost"))
        for name in ("min_count", "max_len", "news_vocab_size", "d_model", "n_head", "n_layer"):
            check_int(name, getattr(self, name), 1)
        for name in ("epochs", "batch_size", "eval_every", "eval_batch_size"):
            check_int(name, getattr(self, name), 1)
        check_int("seed", self.seed, 0)
        check_int("num_threads", self.num_threads, 0)
        if self.max_physical_batch_size is not None:
            check_int("max_physical_batch_size", self.max_physical_batch_size, 1)
        if self.epsilon is not None:
            check_positive("epsilon", self.epsilon)
        if isinstance(self.delta, str):
            check_choice("delta", self.delta, DELTA_RULES)
        else:
            check_in_interval("delta", self.delta, 0.0, 1.0)
        check_in_interval("dropout", self.dropout, 0.0, 1.0)
        check_in_interval("warmup_fraction", self.warmup_fraction, 0.0, 1.0)
        for name in ("lr", "max_grad_norm", "frequency_noise_multiplier"):
            check_positive(name, getattr(self, name))
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay={self.weight_decay!r} is not allowed: expected >= 0")
        if self.d_model % self.n_head:
            raise ValueError(
                f"d_model={self.d_model} is not allowed with n_head={self.n_head}: "
                "expected a multiple of n_head"
            )
        check_audit(
            self.audit, self.audit_canaries, private=self.private, non_private="epsilon=null"
        )
        if self.audit and self.model == "most-popular":
            raise ValueError(
                "audit=true is not allowed with model='most-popular': it trains nothing (one "
                "DP histogram), and the white-box canaries audit the DP optimizer's steps"
            )

    @property
    def private(self) -> bool:
        return self.epsilon is not None


# -- setup -----------------------------------------------------------------------------------


def load_data(cfg: SeqRecTrainConfig):
    """The :class:`~dptrain.data.sequences.SequenceData` the config names."""
    from dptrain.data.news import load_news
    from dptrain.data.sequences import load_interaction_file, load_movielens_100k

    if cfg.data == "ml-100k":
        return load_movielens_100k(max_len=cfg.max_len, min_count=cfg.min_count)
    if cfg.data == "news":
        return load_news(vocab_size=cfg.news_vocab_size, max_len=cfg.max_len, seed=0)
    path = Path(cfg.data)
    if not path.is_file():
        raise ValueError(
            f"data={cfg.data!r} is not allowed: expected 'ml-100k', 'news' or the path of an "
            "existing CSV/TSV/Parquet file"
        )
    return load_interaction_file(
        path,
        user_col=cfg.user_col,
        item_col=cfg.item_col,
        time_col=cfg.time_col,
        max_len=cfg.max_len,
        min_count=cfg.min_count,
    )


def build_model(cfg: SeqRecTrainConfig, n_items: int) -> nn.Module:
    """The neural model ``cfg.model`` names (not for ``most-popular``)."""
    from dptrain.models.rnn import SeqRecRNN, SeqRecRNNConfig
    from dptrain.models.seqrec_transformer import SeqRecConfig, SeqRecTransformer

    if cfg.model in ("gru", "lstm"):
        return SeqRecRNN(
            SeqRecRNNConfig(
                n_items=n_items,
                cell=cfg.model,
                max_len=cfg.max_len,
                d_model=cfg.d_model,
                n_layer=1,
                dropout=cfg.dropout,
                tie_embeddings=True,
            )
        )
    return SeqRecTransformer(
        SeqRecConfig(
            n_items=n_items,
            max_len=cfg.max_len,
            d_model=cfg.d_model,
            n_head=cfg.n_head,
            n_layer=cfg.n_layer,
            dropout=cfg.dropout,
            pre_ln=cfg.pre_ln,
            tie_embeddings=cfg.model != "transformer-untied",
            re_attention=cfg.model == "dpformer",
        )
    )


@dataclass
class _Plan:
    """What setup decided: the privacy parameters and the training length."""

    n_records: int
    delta: float | None
    sample_rate: float
    steps: int
    noise_multiplier: float  # 0 for the non-private run
    frequency_noise_multiplier: float | None  # the histogram's sigma, if one is released
    ledger: PrivacyLedger  # empty; every release (histogram, steps) is recorded as it happens


def _plan(cfg: SeqRecTrainConfig, n_records: int, privacy_unit: str) -> _Plan:
    q = sample_rate_from_batch(cfg.batch_size, n_records)
    steps = steps_from_epochs(cfg.epochs, q)
    ledger = PrivacyLedger(privacy_unit=privacy_unit)  # filled as the run spends budget
    if not cfg.private:
        return _Plan(n_records, None, q, steps, 0.0, None, ledger)
    delta = resolve_delta(cfg.delta, n_records)
    if cfg.model == "most-popular":  # the histogram is the whole model: the whole budget
        hist_sigma = calibrate_noise(
            cfg.epsilon, delta, sample_rate=1.0, steps=1, accountant=cfg.accountant
        ).noise_multiplier
        return _Plan(n_records, delta, q, 0, 0.0, hist_sigma, ledger)
    prior = PrivacyLedger(privacy_unit=privacy_unit)  # budget spent before training
    hist_sigma = None
    if cfg.model == "dpformer" and cfg.frequencies == "dp":
        hist_sigma = cfg.frequency_noise_multiplier
        prior.record(1.0, hist_sigma)
    try:
        sigma = calibrate_noise(
            cfg.epsilon,
            delta,
            sample_rate=q,
            steps=steps,
            accountant=cfg.accountant,
            prior=prior if prior.num_steps else None,
        ).noise_multiplier
    except ValueError as err:
        raise ValueError(
            f"epsilon={cfg.epsilon} cannot be reached for epochs={cfg.epochs} at "
            f"batch_size={cfg.batch_size} (q={q:.4g}, {steps} steps, delta={delta:.3g}): {err}"
        ) from None
    return _Plan(n_records, delta, q, steps, sigma, hist_sigma, ledger)


# -- train / evaluate --------------------------------------------------------------------------


def _lr_lambda(total_steps: int, warmup_fraction: float):
    """Linear warm-up over the first ``warmup_fraction`` of the steps, then linear decay to 0."""
    warmup = max(1, round(warmup_fraction * total_steps))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return factor


@torch.no_grad()
def _last_scores(model: nn.Module, inputs: Tensor, batch_size: int) -> Tensor:
    was_training = model.training
    model.eval()
    out = torch.cat(
        [model.last_scores(inputs[i : i + batch_size]) for i in range(0, len(inputs), batch_size)]
    )
    model.train(was_training)
    return out


def evaluate(
    scorer, inputs: Tensor, targets: Tensor, seen: Tensor | None, batch_size: int
) -> dict[str, float]:
    """NDCG@10, HIT@10 and MRR by full ranking; ``scorer`` is a model or fixed item scores."""
    if isinstance(scorer, Tensor):
        scores = scorer.to(torch.float32).expand(len(inputs), -1)
    else:
        scores = _last_scores(scorer, inputs, batch_size)
    return ranking_metrics(target_ranks(scores, targets, seen), ks=(10,))


def _item_frequencies(cfg, data, plan: _Plan, ledger: PrivacyLedger, gen) -> tuple[Tensor, str]:
    """Frequencies f_v for Re-Attention / counts for most-popular, and a note on their source."""
    window = torch.cat([data.train_inputs, data.train_targets[:, -1:]], 1)  # (N, L+1)
    if plan.frequency_noise_multiplier is None:
        counts = item_presence_counts(window, data.n_items, window.shape[1])
        note = "item frequencies from the training data (public-frequency assumption)"
        if cfg.private:
            note += ": NOT covered by the DP guarantee"
    else:
        counts = dp_item_counts(
            window,
            data.n_items,
            max_items_per_record=window.shape[1],
            noise_multiplier=plan.frequency_noise_multiplier,
            ledger=ledger,
            generator=gen,
        ).clamp_min(0.0)
        note = (
            f"item frequencies from a DP histogram (Gaussian, noise multiplier "
            f"{plan.frequency_noise_multiplier:.4g}, <= {window.shape[1]} items per record), "
            "charged to the ledger"
        )
    counts[0] = 0.0
    return (counts / plan.n_records).clamp(0.0, 1.0), note  # noise can push a share past 1


def _epsilons(ledger: PrivacyLedger, delta: float) -> dict[str, float]:
    return {name: make_accountant(name, ledger).epsilon(delta) for name in ACCOUNTANTS}


def check_world_size(cfg: SeqRecTrainConfig, world_size: int | None = None) -> None:
    """Refuse (``ValueError``) a run that cannot use several processes when there are several.

    Only the private neural models train data-parallel; the non-private run and
    most-popular would run W copies, and the audit (``audit=true``) observes one
    process's optimizer. ``world_size``: default ``WORLD_SIZE``.
    """
    check_audit_world_size(cfg.audit, world_size)
    if not cfg.private:
        refuse_several_processes(
            "epsilon=None (the non-private run)",
            "it trains in one process; run it without torchrun / --nproc",
            world_size,
        )
    if cfg.model == "most-popular":
        refuse_several_processes(
            "model='most-popular'",
            "it trains nothing (one DP histogram) and runs in one process",
            world_size,
        )


def train_seqrec(cfg: SeqRecTrainConfig) -> dict[str, Any]:
    """Run the recipe; return the ``results.json`` content."""
    t0 = time.perf_counter()
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    # dp_accounting's RDP drops orders whose series does not converge, with a warning per
    # order; the epsilon is still valid (the remaining orders bound it).
    logging.getLogger("absl").setLevel(logging.ERROR)
    check_world_size(cfg)
    run = launch()
    try:
        return _train_seqrec(cfg, run, t0)
    finally:
        run.close()


def _train_seqrec(cfg: SeqRecTrainConfig, run: Launch, t0: float) -> dict[str, Any]:
    main = run.is_main  # only rank 0 writes; with one process, the only rank
    torch.manual_seed(cfg.seed)
    # -- setup (nothing written until it has all passed) --
    data = load_data(cfg)
    n = len(data.train_inputs)
    plan = _plan(cfg, n, data.privacy_unit)
    model = build_model(cfg, data.n_items) if cfg.model in _NEURAL else None
    if main and cfg.private and plan.steps:
        assert plan.delta is not None
        print_plan(
            units=n,
            unit=data.privacy_unit,
            sample_rate=plan.sample_rate,
            expected_batch=cfg.batch_size,
            steps=plan.steps,
            noise_multiplier=plan.noise_multiplier,
            max_grad_norm=cfg.max_grad_norm,
            clipping="flat",
            delta=plan.delta,
            delta_rule=cfg.delta if isinstance(cfg.delta, str) else None,
            accountant=cfg.accountant,
            target_epsilon=cfg.epsilon,
        )
    out = Path(cfg.out)
    metrics_path = out / "metrics.jsonl"
    if main:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
        (out / "data.json").write_text(json.dumps(data.summary, indent=2, default=str))
        metrics_path.write_text("")
    gen = torch.Generator().manual_seed(cfg.seed)
    ledger = plan.ledger
    if main:  # on disk from the start and after every step: a stopped run keeps its record
        ledger.autosave(out / "ledger.json")

    needs_frequencies = cfg.model in ("dpformer", "most-popular")
    freq_note = None
    if needs_frequencies:
        # With several processes every rank draws the same histogram (same seed) and records
        # it; make_private_distributed then gives every rank rank 0's ledger and buffers.
        freqs, freq_note = _item_frequencies(cfg, data, plan, ledger, gen)

    history: list[dict[str, Any]] = []
    canaries = None
    if model is None:  # most-popular: the (DP) histogram ranks every user's items alike
        valid = evaluate(freqs, data.valid_inputs, data.valid_targets, data.valid_seen, 0)
        test = evaluate(freqs, data.test_inputs, data.test_targets, data.test_seen, 0)
        history.append({"epoch": 0, "step": 0, **{f"valid_{k}": v for k, v in valid.items()}})
        best_epoch, eps_curve = 0, [(0, 0.0)]
    else:
        if cfg.model == "dpformer":
            model.set_effective_errors(plan.noise_multiplier, cfg.batch_size, freqs)
        best_epoch, valid, eps_curve, history, best_state, canaries = _train(
            cfg, data, plan, model, ledger, out, run
        )
        model.load_state_dict(best_state)  # the state saved in checkpoints/best.pt
        test = evaluate(
            model, data.test_inputs, data.test_targets, data.test_seen, cfg.eval_batch_size
        )

    eps = _epsilons(ledger, plan.delta) if cfg.private and ledger.num_steps else {}
    if eps and history:  # the last point is the whole run: report the exact figure
        history[-1]["epsilon"] = eps[cfg.accountant]
        eps_curve[-1] = (eps_curve[-1][0], eps[cfg.accountant])
    results: dict[str, Any] = {
        "model": cfg.model,
        "data": data.name,
        "private": cfg.private,
        "epsilon": eps.get(cfg.accountant) if cfg.private else math.inf,
        "delta": plan.delta if cfg.private else 0.0,
        "delta_rule": cfg.delta if isinstance(cfg.delta, str) else "given",
        "target_epsilon": cfg.epsilon,
        "accountant": cfg.accountant,
        "epsilon_by_accountant": eps,
        "noise_multiplier": plan.noise_multiplier,
        "frequency_noise_multiplier": plan.frequency_noise_multiplier,
        "sample_rate": plan.sample_rate,
        "steps": plan.steps,
        "epochs": cfg.epochs,
        "best_epoch": best_epoch,
        **{k: v for k, v in test.items()},
        **{f"valid_{k}": v for k, v in valid.items()},
        "privacy_unit": data.privacy_unit,
        "n_train_records": n,
        "n_items": data.n_items,
        "frequencies": freq_note,
        "seed": cfg.seed,
        "wall_time_s": time.perf_counter() - t0,
        "note": _privacy_note(cfg, data.privacy_unit),
    }
    report_audit(results, canaries, plan.delta, ledger)
    if run.distributed:
        results["world_size"] = run.world_size
    if main:
        (out / "results.json").write_text(json.dumps(results, indent=2))
        recipe_privacy_record(
            "dptrain train seqrec",
            {**results, "max_grad_norm": cfg.max_grad_norm},
            ledger,
            privacy_unit=data.privacy_unit,
            covers=[f"the {n} training {data.privacy_unit}s: the trained model ({cfg.model})"],
            not_covered=[
                results["note"],
                "the validation and test sequences (checkpoint chosen by validation, "
                "reported without noise)",
            ],
            training={"frequency_noise_multiplier": plan.frequency_noise_multiplier},
        ).write(out)
        for line in history:
            with metrics_path.open("a") as f:
                f.write(json.dumps(line) + "\n")
        _plot(history, eps_curve, cfg, out / "plots")
    return results


def _privacy_note(cfg: SeqRecTrainConfig, unit: str) -> str:
    if not cfg.private:
        return "non-private run: no guarantee"
    scope = (
        "user-level DP (one record = one user's whole sequence)"
        if unit == "user"
        else (f"example-level DP (one record = one {unit})")
    )
    return f"{scope}; the test split is held-out items of the same users and is not released"


def _train(cfg, data, plan: _Plan, model: nn.Module, ledger: PrivacyLedger, out: Path, run: Launch):
    dataset = torch.utils.data.TensorDataset(data.train_inputs, data.train_targets)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.private:
        # Several processes: the same arguments; each rank gets its share of every logical
        # batch, the clipped sums are all-reduced with one noise draw (rank 0's) per step.
        make = make_private_distributed if run.distributed else make_private
        private = make(
            model,
            optimizer,
            dataset,
            batch_size=cfg.batch_size,
            max_grad_norm=cfg.max_grad_norm,
            steps=plan.steps,
            noise_multiplier=plan.noise_multiplier,
            clipping=cfg.clipping,
            mode=cfg.mode,
            accountant=cfg.accountant,
            max_physical_batch_size=cfg.max_physical_batch_size,
            seed=cfg.seed,
            privacy_unit=data.privacy_unit,
            ledger=ledger,
        )
        batches = iter(private.data_loader)
        opt = private.optimizer
        canaries = attach_audit_canaries(
            cfg.audit, model.parameters(), opt, cfg.audit_canaries, cfg.seed
        )
        if run.rank > 0:  # own dropout stream per rank (rank 0 keeps the one-process one)
            torch.manual_seed(cfg.seed + 7919 * run.rank)
    else:
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=cfg.batch_size,
            shuffle=True,
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        batches = cycle(loader)
        opt = optimizer
        canaries = None
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(plan.steps, cfg.warmup_fraction))

    ckpt = out / "checkpoints"
    if run.is_main:
        ckpt.mkdir(exist_ok=True)
    best = (-1.0, 0, {})
    best_state = None
    history: list[dict[str, Any]] = []
    eps_curve = [(0, _spent(ledger, plan, cfg.accountant))]
    bar = EpsilonBar(
        total=plan.steps,
        disable=not (cfg.progress and run.is_main),
        desc=cfg.model,
        unit="step",
        curve=EpsilonCurve(
            [(plan.sample_rate, plan.noise_multiplier, plan.steps)], plan.delta, cfg.accountant
        )
        if cfg.private
        else None,
    )
    # step -> epoch after which to evaluate (every eval_every epochs, and the last step)
    evals = {
        min(plan.steps, round(e * plan.steps / cfg.epochs)): e
        for e in range(cfg.eval_every, cfg.epochs + 1, cfg.eval_every)
    }
    evals[plan.steps] = cfg.epochs
    model.train()
    loss_sum, loss_n = 0.0, 0
    for step in range(1, plan.steps + 1):
        if cfg.private:
            batch = next(batches)
            opt.zero_grad()
            for inputs, targets in batch.chunks:
                losses = per_example_cross_entropy(model(inputs), targets, ignore_index=0)
                private.backward(losses)
                loss_sum += float(losses.detach().sum())
                loss_n += len(losses)
            opt.step()
        else:
            inputs, targets = next(batches)
            opt.zero_grad()
            losses = per_example_cross_entropy(model(inputs), targets, ignore_index=0)
            losses.mean().backward()
            opt.step()
            loss_sum += float(losses.detach().sum())
            loss_n += len(losses)
        scheduler.step()
        bar.update(1)
        if step not in evals:
            continue
        # every rank evaluates (the parameters are the same on every rank); the loss is
        # summed over the ranks' shares (a collective at the same steps on every rank)
        if run.distributed:
            loss_sum, loss_n = run.sum(loss_sum, loss_n)
        valid = evaluate(
            model, data.valid_inputs, data.valid_targets, data.valid_seen, cfg.eval_batch_size
        )
        spent = _spent(ledger, plan, cfg.accountant)
        eps_curve.append((step, spent))
        line = {
            "epoch": evals[step],
            "step": step,
            "train_loss": loss_sum / max(loss_n, 1),
            "epsilon": spent,
            **{f"valid_{k}": v for k, v in valid.items()},
        }
        history.append(line)
        loss_sum, loss_n = 0.0, 0
        if valid["ndcg@10"] > best[0]:
            best = (valid["ndcg@10"], evals[step], valid)
            best_state = copy.deepcopy(model.state_dict())
        bar.set_postfix(
            epoch=evals[step],
            loss=f"{line['train_loss']:.3f}",
            eps=f"{spent:.2f}" if cfg.private else "inf",
            ndcg=f"{valid['ndcg@10']:.4f}",
        )
    bar.close()
    if run.is_main:
        torch.save(best_state, ckpt / "best.pt")
    if cfg.save_checkpoints and run.is_main:
        torch.save(
            {
                "model": model.state_dict(),
                "optimizer": opt.state_dict(),
                "ledger": ledger.state_dict(),
            },
            ckpt / "last.pt",
        )
    return best[1], best[2], eps_curve, history, best_state, canaries


def _spent(ledger: PrivacyLedger, plan: _Plan, accountant: str) -> float:
    """epsilon spent so far, for the progress bar, metrics.jsonl and the plot.

    PLD runs on a 1e-3 grid here (about 10x faster than the 1e-4 of the final
    figure, and pessimistic: never below it); results.json has the 1e-4 value.
    """
    if plan.delta is None or not ledger.num_steps:
        return 0.0
    options = {"value_discretization_interval": 1e-3} if accountant == "pld" else {}
    return make_accountant(accountant, ledger, **options).epsilon(plan.delta)


def _plot(history, eps_curve, cfg: SeqRecTrainConfig, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(exist_ok=True)
    title = f"{cfg.model}, " + (f"target epsilon {cfg.epsilon:g}" if cfg.private else "non-private")
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot([h["epoch"] for h in history], [h["valid_ndcg@10"] for h in history], marker="o", ms=3)
    ax.set_xlabel("epoch")
    ax.set_ylabel("validation NDCG@10")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "valid_ndcg.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot([s for s, _ in eps_curve], [e for _, e in eps_curve], marker="o", ms=3)
    if cfg.private:
        ax.axhline(cfg.epsilon, color="grey", ls="--", lw=1, label="target")
        ax.legend()
    ax.set_xlabel("training step")
    ax.set_ylabel(f"epsilon spent ({cfg.accountant})")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(folder / "epsilon.png", dpi=120)
    plt.close(fig)
