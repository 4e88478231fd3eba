"""The ``dptrain`` command line.

    dptrain epsilon         epsilon of (q, sigma, steps) under pld / rdp / gdp
    dptrain calibrate       noise multiplier for a target (epsilon, delta)
    dptrain calibrate-dpfp  DP-FP Algorithm 1 noise, with every accountant's epsilon
    dptrain search-cost     privacy cost of a hyperparameter search
    dptrain train seqrec    train one sequential recommender (config + key=value overrides)
    dptrain train classify  private text classification: --method nonprivate | dpsgd |
                            dpsgd-head | dpfp | dpfp-finetune (config + key=value overrides)
    dptrain train table2text  GPT-2-style table-to-text on E2E: BLEU / ROUGE-L (greedy, beam)
    dptrain train mlm       BERT-style masked-LM pretraining on news text: mega-batches,
                            growing batch size, gradient-SNR
    dptrain train lm        DP fine-tuning of a pretrained causal LM (SmolLM2 or a local
                            folder; LoRA or full) on your records: data=FILE.jsonl|csv|parquet
    dptrain train ... --nproc N   the same run on N local processes (torchrun; seqrec and
                            classify DP-SGD runs)
    dptrain experiment dpformer   the DPFormer Table 1 grid (models x epsilon x seeds)
    dptrain experiment dpfp       DP-FP vs DP-SGD vs non-private (methods x epsilon x seeds)
    dptrain study NAME      a language-model study: snr | batch-schedule | weight-decay
                            (masked LM, Anil et al.) or e2e-heatmap (Li et al. Figure 2)
    dptrain audit exposure  canary exposure (Carlini et al.) private vs non-private
    dptrain audit one-run   one-run audit (Steinke et al.; Mahloujifar et al.): white-box and
                            black-box self-test of the mechanism, or your canaries' scores
                            (exit 0 nothing flagged, 1 a lower bound exceeds the claimed
                            epsilon, 2 could not run or no claim to test)
    dptrain audit properties  property checks of a private run (noise independent and of
                            std sigma C / (q N), batch sizes ~ Binomial(N, q), one record
                            moves the clipped sum by <= C, ledger = steps): exit 0 nothing
                            flagged, 1 flagged, 2 could not run
    dptrain audit mia       membership inference (LiRA, loss threshold) on shadow linear
                            probes of frozen MiniLM features: TPR at 0.1% / 1% FPR, ROC plot
                            (exit 1 if a TPR exceeds what the epsilon allows)
    dptrain demo            the main job: a private sentiment classifier, against no
                            training and non-private (Rotten Tomatoes, MiniLM)
    dptrain accounting-demo the accounting demo (table + plot)
    dptrain consolidate CKPT OUT  a sharded (FSDP2) checkpoint as a plain Hugging Face folder
                            (config + safetensors, full weights) with its privacy.json
    dptrain bench           dptrain vs non-private and Opacus: step time, memory, largest
                            batch, accountants (--quick: a smoke check; docs/bench.md)

Human output is a small aligned table; ``--json`` prints JSON lines (a recipe's
results as one line), with the same keys for the same quantities (``epsilon``,
``delta``, ``privacy_unit``, ...). ``--help`` of a recipe command lists its settings
with type, default and meaning, generated from its config dataclass; ``--config``
takes a YAML file or a packaged config's name (``--config lm``). Bad arguments print
an error naming the argument to stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from dptrain._table import format_table
from dptrain.accounting import (
    ACCOUNTANTS,
    PrivacyLedger,
    calibrate_dpfp,
    calibrate_noise,
    composition_of_ledger,
    effective_noise_multiplier,
    epsilon_of_schedule,
    make_accountant,
    optimal_composition,
    repeat_and_select,
    sample_rate_from_batch,
    search_cost_gupta,
    steps_from_epochs,
)
from dptrain.accounting.noise import averaged_gradient_noise_std

__all__ = ["build_parser", "main"]

_GDP_LABEL = "approximate (GDP CLT, may understate epsilon)"


class CliError(ValueError):
    """A bad command-line argument (exit code 2)."""


# -- argument groups shared by the subcommands ---------------------------------------


def _add_rate_arguments(p: argparse.ArgumentParser, *, schedule: bool) -> None:
    g = p.add_argument_group("sampling (one of)")
    g.add_argument("--sample-rate", type=float, help="Poisson sampling rate q in (0, 1]")
    g.add_argument("--batch-size", type=int, help="expected batch size B (with --dataset-size)")
    g.add_argument("--dataset-size", type=int, help="number of records N")
    if schedule:
        g.add_argument(
            "--schedule",
            help="segments Q:STEPS[:SIGMA],... e.g. 0.004:1000,0.016:500 (rates; a growing batch)",
        )
        g.add_argument(
            "--batch-schedule",
            help="segments B:STEPS[:SIGMA],... of expected batch sizes (with --dataset-size)",
        )
    s = p.add_argument_group("length (one of)")
    s.add_argument("--steps", type=int, help="number of private steps T")
    s.add_argument("--epochs", type=float, help="epochs E: T = floor(E / q)")


def _add_json(
    p: argparse.ArgumentParser, help: str = "print JSON lines instead of a table"
) -> None:
    p.add_argument("--json", action="store_true", help=help)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``dptrain`` command (subcommands included)."""
    parser = argparse.ArgumentParser(
        prog="dptrain",
        description="Differentially private training of Transformers: privacy accounting tools.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("epsilon", help="epsilon of a run under pld / rdp / gdp")
    _add_rate_arguments(p, schedule=True)
    p.add_argument("--noise-multiplier", type=float, help="sigma (noise std / clipping norm)")
    p.add_argument("--delta", type=float, required=True)
    p.add_argument("--accountant", choices=[*ACCOUNTANTS, "all"], default="all")
    p.add_argument(
        "--max-grad-norm", type=float, default=1.0, help="C, for the averaged-gradient noise std"
    )
    _add_json(p)

    p = sub.add_parser("calibrate", help="noise multiplier for a target (epsilon, delta)")
    p.add_argument("--epsilon", type=float, required=True, help="target epsilon")
    p.add_argument("--delta", type=float, required=True)
    _add_rate_arguments(p, schedule=True)
    p.add_argument("--accountant", choices=[*ACCOUNTANTS, "all"], default="pld")
    p.add_argument("--rtol", type=float, default=0.01, help="relative tolerance on sigma")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    _add_json(p)

    p = sub.add_parser("calibrate-dpfp", help="DP-FP (Algorithm 1) noise for a target")
    p.add_argument("--epsilon", type=float, required=True, help="target epsilon")
    p.add_argument("--delta", type=float, required=True)
    p.add_argument("--dataset-size", type=int, required=True, help="N")
    p.add_argument("--batch-size", type=int, required=True, help="B: expected examples per step")
    p.add_argument("--micro-batches", type=int, required=True, help="M micro-batches per step")
    length = p.add_mutually_exclusive_group(required=True)
    length.add_argument("--epochs", type=float, help="T = floor(E N / B)")
    length.add_argument("--steps", type=int, help="T")
    p.add_argument("--clip", type=float, required=True, help="C: clipping norm of h(x)")
    p.add_argument(
        "--accountant",
        choices=list(ACCOUNTANTS),
        default="pld",
        help="pld (default); gdp reproduces the paper (approximate)",
    )
    _add_json(p)

    p = sub.add_parser("search-cost", help="privacy cost of a hyperparameter search")
    p.add_argument("--trials", type=int, required=True, help="K settings tried")
    p.add_argument("--epsilon", type=float, help="per-trial epsilon (with --delta)")
    p.add_argument("--delta", type=float, required=True, help="per-trial / reporting delta")
    p.add_argument("--total-delta", type=float, help="delta of the search (composition route)")
    p.add_argument("--validation-size", type=int, help="for the gupta route's accuracy bound")
    _add_rate_arguments(p, schedule=False)
    p.add_argument(
        "--noise-multiplier", type=float, help="with a sampling spec: each trial's ledger"
    )
    _add_json(p)

    p = sub.add_parser("accounting-demo", help="the accounting demo: tables and a plot")
    p.add_argument("--out", default="runs/accounting-demo", help="folder for the plot and JSON")
    _add_json(p)

    p = sub.add_parser(
        "train",
        help="train with a recipe: dptrain train {seqrec,classify,table2text,mlm,lm} [key=value ...]",
        description="Train with a recipe. `dptrain train RECIPE --help` lists its settings.",
    )
    recipes = p.add_subparsers(dest="recipe", required=True, metavar="RECIPE")
    for name, (module, config, _, _) in _TRAIN_RECIPES.items():
        r = _add_recipe_parser(recipes, name, (module, config), help=_TRAIN_HELP[name])
        r.add_argument(
            "--method",
            help="classify only: nonprivate, nonprivate-head, dpsgd, dpsgd-head, dpfp or "
            "dpfp-finetune",
        )
        r.add_argument(
            "--accountant",
            help="calibration accountant (pld default; gdp = the DP-FP paper's CLT route)",
        )
        r.add_argument(
            "--nproc",
            type=int,
            default=1,
            metavar="N",
            help="train on N local processes: re-runs this command under torchrun --standalone "
            "--nproc_per_node N (DP-SGD runs of seqrec and classify dpsgd / dpsgd-head); "
            "1 (default): in this process",
        )

    p = sub.add_parser(
        "experiment", help="run an experiment grid: dptrain experiment {dpformer,dpfp}"
    )
    grids = p.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    for name, (module, config, train, what) in _EXPERIMENTS.items():
        _add_recipe_parser(grids, name, (module, config), help=what, train=train)

    p = sub.add_parser(
        "study",
        help="a language-model study: dptrain study {snr,batch-schedule,weight-decay,e2e-heatmap}",
    )
    studies = p.add_subparsers(dest="study", required=True, metavar="STUDY")
    for name, (module, config, train, what) in _STUDY_CONFIGS.items():
        _add_recipe_parser(studies, name, (module, config), help=what, train=train)

    p = sub.add_parser(
        "audit",
        help="measure what leaks: dptrain audit {exposure,one-run,mia,properties} [key=value ...]",
    )
    audits = p.add_subparsers(dest="audit", required=True, metavar="AUDIT")
    for name, (module, config, train, what) in _AUDITS.items():
        _add_recipe_parser(audits, name, (module, config), help=what, train=train)

    _add_recipe_parser(
        sub,
        "generate",
        ("dptrain.recipes.generate", "GenerateConfig"),
        help="DP synthetic text from a `train lm` model: dptrain generate model=FOLDER n=N "
        "[prompt=... labels=a,b ...]",
    )

    p = _add_recipe_parser(
        sub,
        "demo",
        ("dptrain.recipes.demo", "DemoConfig"),
        help="the main job: a private sentiment classifier (DP linear probe on a pretrained "
        "encoder) against no training and non-private (~1-3 min)",
        train="classify",
        config_flag=False,
    )
    p.add_argument(
        "--out",
        help="run folder (refused if it holds files, unless overwrite=true); default "
        "runs/demo, or a fresh runs/demo-<YYYYmmdd-HHMMSS> when that holds an earlier run",
    )

    p = sub.add_parser(
        "consolidate",
        help="a sharded (FSDP2) checkpoint as a Hugging Face folder with privacy.json",
        description="Write the sharded checkpoint CHECKPOINT (the directory save_checkpoint "
        "wrote for an FSDP2 run) as a plain Hugging Face folder OUT: config.json, the full "
        "weights as safetensors (save_pretrained; a LoRA model merged into its base) and "
        "privacy.json, the guarantee of the steps in the checkpoint's ledger. One process, "
        "the whole model in memory.",
    )
    p.add_argument("checkpoint", help="the sharded checkpoint's directory")
    p.add_argument("out", help="the folder to write (must not exist, or be empty)")
    p.add_argument(
        "--delta",
        type=float,
        help="delta of the stated epsilon (default: the run's target_delta; required when "
        "the run gave a noise multiplier)",
    )
    p.add_argument("--accountant", choices=ACCOUNTANTS, help="accountant (default: the run's)")
    _add_json(p)

    p = sub.add_parser(
        "bench",
        help="step time, peak memory and largest batch vs non-private and Opacus; accountants",
    )
    from dptrain.bench.suite import add_bench_arguments

    add_bench_arguments(p)
    return parser


#: ``dptrain train NAME``: the recipe's module, config class, train function and the
#: results.json keys printed at the end.
_TRAIN_RECIPES = {
    "seqrec": (
        "dptrain.recipes.seqrec",
        "SeqRecTrainConfig",
        "train_seqrec",
        ("model", "epsilon", "delta", "ndcg@10", "hit@10", "mrr", "best_epoch"),
    ),
    "classify": (
        "dptrain.recipes.classify",
        "ClassifyTrainConfig",
        "train_classify",
        ("method", "accuracy", "dev_accuracy", "epsilon", "delta", "best_epoch"),
    ),
    "table2text": (
        "dptrain.recipes.table2text",
        "Table2TextConfig",
        "train_table2text",
        (
            "epsilon",
            "delta",
            "test_bleu_beam",
            "test_rouge_l_beam",
            "test_bleu_greedy",
            "test_rouge_l_greedy",
        ),
    ),
    "mlm": (
        "dptrain.recipes.mlm",
        "MLMTrainConfig",
        "train_mlm",
        ("epsilon", "delta", "valid_accuracy", "test_accuracy", "steps", "examples_processed"),
    ),
    "lm": (
        "dptrain.recipes.lm_finetune",
        "LMFinetuneConfig",
        "train_lm",
        (
            "epsilon",
            "delta",
            "privacy_unit",
            "initial_valid_perplexity",
            "valid_perplexity",
            "steps",
        ),
    ),
}
#: Recipes that run on several processes (``--nproc``).
_DISTRIBUTED_RECIPES = ("seqrec", "classify")

#: ``dptrain study NAME``: the packaged config it reads by default.
_STUDIES = {
    "snr": "mlm_studies.yaml",
    "batch-schedule": "mlm_studies.yaml",
    "weight-decay": "mlm_studies.yaml",
    "e2e-heatmap": "table2text_study.yaml",
}


_TRAIN_HELP = {
    "seqrec": "one private sequential recommender (DPFormer, Transformer, GRU, LSTM)",
    "classify": "private text classification: --method nonprivate | dpsgd | dpsgd-head | "
    "dpfp | dpfp-finetune",
    "table2text": "GPT-2-style table-to-text on E2E: BLEU / ROUGE-L (greedy, beam)",
    "mlm": "BERT-style masked-LM pretraining: mega-batches, growing batch size, gradient-SNR",
    "lm": "DP fine-tuning of a pretrained causal LM (SmolLM2 or a local folder; LoRA or full) "
    "on your records: data=FILE.jsonl|csv|parquet",
}

#: ``dptrain experiment NAME``: config module and class, the ``train`` recipe whose keys
#: it also takes, and one line for ``--help``.
_EXPERIMENTS = {
    "dpformer": (
        "dptrain.recipes.dpformer_experiment",
        "DPFormerExperimentConfig",
        "seqrec",
        "the DPFormer Table 1 grid (models x epsilon x seeds)",
    ),
    "dpfp": (
        "dptrain.recipes.dpfp_experiment",
        "DPFPExperimentConfig",
        "classify",
        "DP-FP vs DP-SGD vs non-private (methods x epsilon x seeds)",
    ),
}
_STUDY_CONFIGS = {
    **{
        name: ("dptrain.recipes.mlm_studies", "MLMStudyConfig", "mlm", what)
        for name, what in (
            ("snr", "gradient signal-to-noise ratio vs batch size (masked LM, Anil et al.)"),
            ("batch-schedule", "a growing batch size vs fixed ones (masked LM, Anil et al.)"),
            ("weight-decay", "decoupled weight decay under DP (masked LM, Anil et al.)"),
        )
    },
    "e2e-heatmap": (
        "dptrain.recipes.table2text_study",
        "Table2TextStudyConfig",
        "table2text",
        "batch size x learning rate on E2E (Li et al. Figure 2)",
    ),
}
_AUDITS = {
    "exposure": (
        "dptrain.recipes.exposure",
        "ExposureAuditConfig",
        "table2text",
        "canary exposure (Carlini et al.) private vs non-private",
    ),
    "one-run": (
        "dptrain.recipes.audit_one_run",
        "OneRunAuditConfig",
        None,
        "one-run audit (Steinke et al.): exit 1 if a lower bound exceeds the claimed epsilon",
    ),
    "mia": (
        "dptrain.recipes.audit_mia",
        "MIAAuditConfig",
        None,
        "membership inference (LiRA) on shadow probes: exit 1 if a TPR exceeds what the "
        "epsilon allows",
    ),
    "properties": (
        "dptrain.recipes.audit_properties",
        "PropertiesConfig",
        None,
        "property checks of a private run (noise, sampling, sensitivity, ledger): exit 1 if "
        "one is flagged, 2 if one could not run",
    ),
}


class _SettingsHelp(argparse.Action):
    """``-h/--help`` that also lists the recipe's settings (key, type, default, meaning).

    The list is generated from the config dataclass (:func:`dptrain.config.format_config_help`)
    when help is asked for, so building the parser imports no recipe (and no torch).
    """

    def __init__(
        self,
        option_strings: list[str],
        dest: str,
        config: tuple[str, str],
        train: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            option_strings,
            dest=argparse.SUPPRESS,
            default=argparse.SUPPRESS,
            nargs=0,
            help="show this help with every setting: its type, default and meaning",
        )
        self.config = config
        self.train = train

    def __call__(self, parser: argparse.ArgumentParser, *_: Any, **__: Any) -> None:
        import importlib

        from dptrain.config import format_config_help

        module, name = self.config
        cls = getattr(importlib.import_module(module), name)
        text = (
            "settings (key=value after the command, or key: value in a --config YAML):\n"
            + format_config_help(cls)
        )
        if self.train is not None:
            text += (
                f"\n\nand every setting of `dptrain train {self.train}` (see its --help), "
                "shared by every run"
            )
        parser.epilog = text
        parser.print_help()
        parser.exit()


def _add_recipe_parser(
    sub: Any,
    name: str,
    config: tuple[str, str],
    *,
    help: str,
    train: str | None = None,
    config_flag: bool = True,
) -> argparse.ArgumentParser:
    """A subcommand configured by a dataclass: --help lists its settings; --config, --json."""
    from dptrain.recipes import packaged_configs

    p = sub.add_parser(
        name,
        help=help,
        description=help,
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-h", "--help", action=_SettingsHelp, config=config, train=train)
    if config_flag:
        p.add_argument(
            "--config",
            help="YAML file of settings, or a packaged config's name: "
            + ", ".join(packaged_configs()),
        )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="settings to change")
    _add_json(p, "print the results (results.json's content) as one JSON line")
    return p


# -- resolving the sampling arguments ------------------------------------------------


def _parse_segments(text: str, flag: str) -> list[tuple[float, int, float | None]]:
    segments = []
    for item in text.split(","):
        parts = item.strip().split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            first, steps = float(parts[0]), int(parts[1])
            sigma = float(parts[2]) if len(parts) == 3 else None
        except ValueError:
            raise CliError(
                f"{flag}={text!r}: segment {item!r} is not of the form X:STEPS or X:STEPS:SIGMA"
            ) from None
        segments.append((first, steps, sigma))
    return segments


def _single_rate(args: argparse.Namespace) -> tuple[float, int | None]:
    """(q, B) from --sample-rate or --batch-size/--dataset-size."""
    if args.sample_rate is not None:
        if args.batch_size is not None:
            raise CliError("give --sample-rate or --batch-size/--dataset-size, not both")
        return args.sample_rate, None
    if args.batch_size is None or args.dataset_size is None:
        raise CliError("give --sample-rate Q, or --batch-size B with --dataset-size N")
    return sample_rate_from_batch(args.batch_size, args.dataset_size), args.batch_size


def _single_steps(args: argparse.Namespace, q: float) -> int:
    if (args.steps is None) == (args.epochs is None):
        raise CliError("give exactly one of --steps T and --epochs E")
    if args.steps is not None:
        if args.steps < 0:
            raise CliError(f"--steps={args.steps} is not allowed: expected an integer >= 0")
        return args.steps
    return steps_from_epochs(args.epochs, q)


def _segments(args: argparse.Namespace) -> tuple[list[tuple[float, int, float | None]], int | None]:
    """[(q, steps, sigma or None)], and B when a single batch size was given."""
    sched = getattr(args, "schedule", None)
    bsched = getattr(args, "batch_schedule", None)
    if sched is not None or bsched is not None:
        if sched is not None and bsched is not None:
            raise CliError("give --schedule or --batch-schedule, not both")
        if args.sample_rate is not None or args.batch_size is not None:
            raise CliError("a schedule replaces --sample-rate/--batch-size: give one of them")
        if args.steps is not None or args.epochs is not None:
            raise CliError("a schedule carries its own step counts: drop --steps/--epochs")
        if sched is not None:
            return _parse_segments(sched, "--schedule"), None
        if args.dataset_size is None:
            raise CliError("--batch-schedule needs --dataset-size N")
        return [
            (sample_rate_from_batch(int(b), args.dataset_size), t, s)
            for b, t, s in _parse_segments(bsched, "--batch-schedule")
        ], None
    q, batch = _single_rate(args)
    return [(q, _single_steps(args, q), None)], batch


def _ledger(args: argparse.Namespace) -> tuple[PrivacyLedger, int | None]:
    segments, batch = _segments(args)
    ledger = PrivacyLedger()
    for q, steps, sigma in segments:
        sigma = sigma if sigma is not None else args.noise_multiplier
        if sigma is None:
            raise CliError("give --noise-multiplier S (or S in every schedule segment)")
        if steps < 0:
            raise CliError(f"steps={steps} is not allowed: expected an integer >= 0")
        if steps > 0:
            ledger.record(q, sigma, steps)
    return ledger, batch


def _accountant_names(choice: str) -> list[str]:
    return list(ACCOUNTANTS) if choice == "all" else [choice]


# -- subcommands ---------------------------------------------------------------------


def _cmd_epsilon(args: argparse.Namespace) -> list[dict[str, Any]]:
    ledger, batch = _ledger(args)
    records = []
    for name in _accountant_names(args.accountant):
        acc = make_accountant(name, ledger)
        rec: dict[str, Any] = {
            "accountant": name,
            "epsilon": acc.epsilon(args.delta),
            "delta": args.delta,
            "steps": ledger.num_steps,
            "approximate": acc.approximate,
            "privacy_unit": ledger.privacy_unit,
            "neighbouring": ledger.neighbouring,
        }
        rec.update(_noise_figures(ledger, batch, args.max_grad_norm))
        records.append(rec)
    return records


def _noise_figures(ledger: PrivacyLedger, batch: int | None, clip: float) -> dict[str, Any]:
    if len(ledger) != 1:
        return {"segments": [_segment_record(s) for s in ledger.segments]}
    (s,) = ledger.segments
    out = {
        "sample_rate": s.sample_rate,
        "noise_multiplier": s.noise_multiplier,
        "effective_noise_multiplier": effective_noise_multiplier(s.noise_multiplier, s.sample_rate),
    }
    if batch is not None:
        out["averaged_gradient_noise_std"] = averaged_gradient_noise_std(
            s.noise_multiplier, clip, batch
        )
    return out


def _segment_record(s: Any) -> dict[str, Any]:
    return {"sample_rate": s.sample_rate, "noise_multiplier": s.noise_multiplier, "steps": s.count}


def _cmd_calibrate(args: argparse.Namespace) -> list[dict[str, Any]]:
    segments, batch = _segments(args)
    if any(sigma is not None for _, _, sigma in segments):
        raise CliError("calibrate finds sigma: give schedule segments as Q:STEPS only")
    schedule = [(q, t) for q, t, _ in segments]
    records = []
    for name in _accountant_names(args.accountant):
        cal = calibrate_noise(
            args.epsilon, args.delta, schedule=schedule, accountant=name, rtol=args.rtol
        )
        rec: dict[str, Any] = {
            "accountant": name,
            "noise_multiplier": cal.noise_multiplier,
            "epsilon": cal.epsilon,
            "target_epsilon": cal.target_epsilon,
            "delta": cal.delta,
            "failing_noise_multiplier": cal.failing_noise_multiplier,
            "steps": sum(t for _, t in cal.schedule),
            "approximate": name == "gdp",
        }
        if name != "pld":
            # Whenever a sigma calibrated by another accountant is shown, show
            # what PLD (the tightest rigorous one) says it costs.
            rec["epsilon_pld"] = epsilon_of_schedule(cal.noise_multiplier, args.delta, schedule)
        ledger = PrivacyLedger.from_schedule(schedule, cal.noise_multiplier)
        # the same keys as `dptrain epsilon --json`: what one unit of the guarantee is
        rec["privacy_unit"] = ledger.privacy_unit
        rec["neighbouring"] = ledger.neighbouring
        rec.update(_noise_figures(ledger, batch, args.max_grad_norm))
        records.append(rec)
    return records


def _cmd_calibrate_dpfp(args: argparse.Namespace) -> list[dict[str, Any]]:
    p_step = sample_rate_from_batch(args.batch_size, args.dataset_size)
    if args.steps is not None:
        if args.steps < 1:
            raise CliError(f"--steps={args.steps} is not allowed: expected an integer >= 1")
        steps = args.steps
    else:
        steps = steps_from_epochs(args.epochs, p_step)
    if args.micro_batches < 1:
        raise CliError(
            f"--micro-batches={args.micro_batches} is not allowed: expected an integer >= 1"
        )
    rate = args.batch_size / (args.micro_batches * args.dataset_size)
    cal = calibrate_dpfp(
        args.epsilon,
        args.delta,
        sample_rate=rate,
        steps=steps,
        micro_batches=args.micro_batches,
        clip=args.clip,
        accountant=args.accountant,
    )
    rec: dict[str, Any] = {
        "accountant": args.accountant,
        "noise_multiplier": cal.noise_multiplier,
        "noise_std": cal.noise_std,
        "clip": cal.clip,
        "target_epsilon": cal.target_epsilon,
        "delta": cal.delta,
        "sample_rate": cal.sample_rate,
        "steps": cal.steps,
        "micro_batches": cal.micro_batches,
        "mechanism_steps": cal.steps * cal.micro_batches,
        "approximate": args.accountant == "gdp",
        "privacy_unit": PrivacyLedger().privacy_unit,
        "neighbouring": PrivacyLedger().neighbouring,
        "epsilons": cal.epsilons,
        **{f"epsilon_{k}": v for k, v in cal.epsilons.items()},
    }
    if cal.mu_tot is not None:
        rec["mu_tot"] = cal.mu_tot
    return [rec]


def _cmd_search_cost(args: argparse.Namespace) -> list[dict[str, Any]]:
    costs = []
    if args.epsilon is not None:
        costs.append(
            search_cost_gupta(
                args.epsilon, args.delta, args.trials, validation_size=args.validation_size
            )
        )
        costs.append(optimal_composition(args.epsilon, args.delta, args.trials, args.total_delta))
    has_ledger = args.sample_rate is not None or args.batch_size is not None
    if has_ledger:
        ledger, _ = _ledger(args)
        costs.append(composition_of_ledger(ledger, args.trials, args.delta))
        costs.append(repeat_and_select(ledger, args.trials, args.delta, "poisson"))
        costs.append(repeat_and_select(ledger, args.trials, args.delta, "logarithmic"))
    if not costs:
        raise CliError(
            "give the per-trial --epsilon, or a trial's ledger (--sample-rate or --batch-size/"
            "--dataset-size, --steps or --epochs, --noise-multiplier), or both"
        )
    return [
        {
            "method": c.method,
            "epsilon": c.epsilon,
            "delta": c.delta,
            "trials": c.trials,
            "rigorous": c.rigorous,
            "accuracy_loss_bound": c.accuracy_loss_bound,
            "reference": c.reference,
            "note": c.note,
        }
        for c in costs
    ]


# -- rendering -----------------------------------------------------------------------


def _cmd_consolidate(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pathlib import Path

    from dptrain import privacy_record
    from dptrain.distributed.consolidate import consolidate_checkpoint

    if args.delta is not None and not 0 < args.delta < 1:
        raise CliError(f"--delta={args.delta} is not allowed: expected a number in (0, 1)")
    if not Path(args.checkpoint).is_dir():
        raise CliError(
            f"checkpoint={args.checkpoint!r} is not a directory: expected the directory "
            "save_checkpoint wrote for a sharded (FSDP2) run"
        )
    out = consolidate_checkpoint(
        args.checkpoint, args.out, delta=args.delta, accountant=args.accountant
    )
    record = privacy_record.read(out)
    return [
        {
            "model": str(out),
            "epsilon": record.epsilon,
            "delta": record.delta,
            "accountant": record.accountant,
            "privacy_unit": record.privacy_unit,
            "steps": record.training.get("steps_taken"),
            "guarantee": record.statement,
        }
    ]


def _render(command: str, records: list[dict[str, Any]]) -> str:
    if command == "consolidate":
        (r,) = records
        keys = ["epsilon", "delta", "accountant", "privacy_unit", "steps"]
        return (
            f"{r['guarantee']}\n{format_table(keys, [[r[k] for k in keys]])}\n"
            f"model: {r['model']} (save_pretrained, privacy.json)"
        )
    if command == "epsilon":
        head = ["accountant", "epsilon", "delta", "steps", "note"]
        rows = [
            [r["accountant"], r["epsilon"], r["delta"], r["steps"], _note(r["accountant"])]
            for r in records
        ]
        extra = _derived_lines(records[0])
    elif command == "calibrate":
        head = ["accountant", "noise_multiplier", "epsilon", "pld epsilon", "delta", "note"]
        rows = [
            [
                r["accountant"],
                r["noise_multiplier"],
                r["epsilon"],
                r.get("epsilon_pld", r["epsilon"]),
                r["delta"],
                _note(r["accountant"]),
            ]
            for r in records
        ]
        extra = _derived_lines(records[0])
    elif command == "calibrate-dpfp":
        r = records[0]
        head = ["quantity", "value"]
        rows = [
            ["calibrated with", r["accountant"] + (" (paper route)" if r["approximate"] else "")],
            ["noise_multiplier sigma/C", r["noise_multiplier"]],
            ["noise_std sigma", r["noise_std"]],
            ["sample rate p = B/(M N)", r["sample_rate"]],
            ["steps T x micro-batches M", f"{r['steps']} x {r['micro_batches']}"],
            ["epsilon (pld)", r["epsilon_pld"]],
            ["epsilon (rdp)", r["epsilon_rdp"]],
            ["epsilon (gdp, approximate)", r["epsilon_gdp"]],
            ["delta", r["delta"]],
        ]
        extra = [
            "Each micro-batch is modelled as one subsampled Gaussian mechanism of sensitivity C "
            "(the paper's accounting). Labels are not protected."
        ]
    else:  # search-cost
        head = ["method", "epsilon", "delta", "trials", "rigorous", "note"]
        rows = [
            [r["method"], r["epsilon"], r["delta"], r["trials"], str(r["rigorous"]), r["note"]]
            for r in records
        ]
        extra = [
            f"{r['method']}: accuracy loss <= {r['accuracy_loss_bound']:.4g} w.p. 0.9"
            for r in records
            if r["accuracy_loss_bound"] is not None
        ]
    return "\n".join([format_table(head, rows), *extra])


def _note(accountant: str) -> str:
    return _GDP_LABEL if accountant == "gdp" else ""


def _derived_lines(r: dict[str, Any]) -> list[str]:
    lines = [f"privacy unit: {r.get('privacy_unit', 'example')}, add/remove-one neighbours"]
    if "effective_noise_multiplier" in r:
        lines.append(f"effective noise multiplier sigma/q: {r['effective_noise_multiplier']:.4g}")
    if "averaged_gradient_noise_std" in r:
        lines.append(f"noise std of the averaged gradient: {r['averaged_gradient_noise_std']:.4g}")
    return lines


_COMMANDS = {
    "epsilon": _cmd_epsilon,
    "calibrate": _cmd_calibrate,
    "calibrate-dpfp": _cmd_calibrate_dpfp,
    "search-cost": _cmd_search_cost,
    "consolidate": _cmd_consolidate,
}


def _run_recipe(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    """``train`` / ``experiment`` / ``demo``: load the config, run, print where results are."""
    from pathlib import Path

    from dptrain.recipes import configs_dir

    command = "dptrain " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.command == "train":
        return _train(args)
    # the others guard their run folders here: overwrite= is the command line's, not a key
    args.overrides, overwrite = _pop_overwrite(list(args.overrides))
    if args.command == "study":
        return _study(args, command, overwrite)
    if args.command == "audit" and args.audit == "one-run":
        from dptrain.recipes.audit_one_run import load_one_run_config, run_one_run_audit

        cfg = load_one_run_config(args.config, args.overrides)
        _claim_output(cfg, args, overwrite)
        with _could_not_run("audit one-run"):
            results = run_one_run_audit(cfg, progress=not args.json)
        if args.json:
            print(json.dumps(results))
        else:
            print((Path(cfg.out) / "table.md").read_text())
            print(f"results: {cfg.out}/results.json")
        return _audit_exit_code(results["status"], "audit one-run")
    if args.command == "audit" and args.audit == "properties":
        return _audit_properties(args, overwrite)
    if args.command == "audit" and args.audit == "mia":
        from dptrain.recipes.audit_mia import load_mia_config, run_mia_audit

        cfg = load_mia_config(args.config, args.overrides)
        _claim_output(cfg, args, overwrite)
        if args.json:
            cfg.progress = False  # stdout is the JSON; the bar would only add noise to stderr
        results = run_mia_audit(cfg)
        if args.json:
            print(json.dumps(results))
        else:
            print((Path(cfg.out) / "table.md").read_text())
            print(f"plot: {cfg.out}/roc.png; results: {cfg.out}/results.json")
        return 1 if results["mia"]["flagged"] else 0
    if args.command == "audit":
        from dptrain.recipes.exposure import load_exposure_config, run_exposure_audit

        cfg = load_exposure_config(args.config or configs_dir() / "exposure.yaml", args.overrides)
        _claim_output(cfg, args, overwrite)
        results = run_exposure_audit(cfg, command)
        if args.json:
            return _print_json(results)
        out = Path(cfg.out)
        print((out / "table.md").read_text())
        print(f"plot: {out}/exposure.png; per canary: {out}/exposures.jsonl")
        return 0
    if args.command == "experiment" and args.experiment == "dpfp":
        from dptrain.recipes.dpfp_experiment import (
            load_dpfp_experiment_config,
            run_dpfp_experiment,
        )

        path = args.config or configs_dir() / "dpfp_experiment.yaml"
        cfg = load_dpfp_experiment_config(path, args.overrides)
        _claim_output(cfg, args, overwrite)
        results = run_dpfp_experiment(cfg, command)
        if args.json:
            return _print_json(results)
        out = Path(cfg.out)
        print((out / "table.md").read_text())
        print(f"plots: {out}/accuracy_vs_*.png; runs: {out}/<method>/<epsilon>/seed<k>/")
        return 0
    if args.command == "demo":
        from dptrain.recipes.demo import guarantee, load_demo_config, run_demo

        given = [f"out={args.out}"] if args.out is not None else []
        cfg = load_demo_config(None, [*given, *args.overrides])
        _claim_output(cfg, args, overwrite)
        summary = run_demo(cfg, command)
        if args.json:
            return _print_json(summary)
        out = Path(cfg.out)
        print((out / "table.md").read_text())
        print(f"plot: {out / 'accuracy_vs_epsilon.png'}; runs: {out}/<nonprivate|eps*>/")
        best = max(summary["runs"], key=lambda r: r["epsilon"] if r["target_epsilon"] else -1)
        print(f"The epsilon-{best['target_epsilon']:g} model's guarantee: {guarantee(best)}")
        return 0
    from dptrain.recipes.dpformer_experiment import (
        load_experiment_config,
        run_dpformer_experiment,
    )

    cfg = load_experiment_config(args.config, args.overrides)
    _claim_output(cfg, args, overwrite)
    results = run_dpformer_experiment(cfg, command)
    if args.json:
        return _print_json(results)
    out = Path(cfg.out)
    print((out / "table.md").read_text())
    print(f"plot: {out / 'ndcg_vs_epsilon.png'}")
    print(f"runs: {out}/<model>/<epsilon>/seed<k>/ (results.json, metrics.jsonl, plots/*.png)")
    return 0


def _audit_properties(args: argparse.Namespace, overwrite: bool = False) -> int:
    """``dptrain audit properties``: 0 nothing flagged, 1 flagged, 2 could not run (a crash
    too, or a check that did not run: it proves nothing)."""
    from dptrain.recipes.audit_properties import load_properties_config, run_properties_audit

    cfg = load_properties_config(args.config, args.overrides)  # bad input: ValueError, exit 2
    _claim_output(cfg, args, overwrite)
    try:
        report = run_properties_audit(cfg, progress=not args.json)
    except Exception as err:  # a check that crashed did not pass: exit 2, not 1
        print(
            f"dptrain audit properties: could not run: {type(err).__name__}: {err}", file=sys.stderr
        )
        return 2
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(f"Setting: {report.setting}.\n\n{report.table()}")
        print(f"results: {cfg.out}/results.json")
    if report.flagged:
        return 1
    if not report.complete:
        skipped = [c.name for c in report.checks if c.status == "not run"]
        print(f"dptrain audit properties: checks that did not run: {skipped}", file=sys.stderr)
        return 2
    return 0


def _study(args: argparse.Namespace, command: str, overwrite: bool = False) -> int:
    """``dptrain study NAME``: one study grid; prints its table and where its plot is."""
    from pathlib import Path

    from dptrain.recipes import configs_dir

    path = args.config or configs_dir() / _STUDIES[args.study]
    if args.study == "e2e-heatmap":
        from dptrain.recipes.table2text_study import (
            load_table2text_study_config,
            run_table2text_study,
        )

        cfg = load_table2text_study_config(path, args.overrides)
        _claim_output(cfg, args, overwrite)
        results = run_table2text_study(cfg, command)
        out = Path(cfg.out)
    else:
        from dptrain.recipes.mlm_studies import load_mlm_study_config, run_mlm_study

        cfg = load_mlm_study_config(path, args.overrides)
        _claim_output(cfg, args, overwrite, inside=args.study)
        results = run_mlm_study(args.study, cfg, command)
        out = Path(cfg.out) / args.study  # one YAML serves the three studies
    if args.json:
        return _print_json(results)
    print((out / "table.md").read_text())
    print(f"table, summary and plot: {out}/")
    return 0


def _torchrun_train(args: argparse.Namespace) -> int:
    """``dptrain train ... --nproc N``: the same command on N local processes (torchrun)."""
    import subprocess

    if os.environ.get("WORLD_SIZE") not in (None, "", "1"):
        raise ValueError(
            f"--nproc={args.nproc} is not allowed under torchrun (WORLD_SIZE="
            f"{os.environ['WORLD_SIZE']}): give the process count to torchrun or to --nproc, "
            "not both"
        )
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node", str(args.nproc), "-m", "dptrain.cli", "train", args.recipe]
    for flag in ("method", "accountant", "config"):
        if getattr(args, flag) is not None:
            command += [f"--{flag}", str(getattr(args, flag))]
    if args.json:
        command.append("--json")
    command += list(args.overrides)
    return subprocess.run(command, check=False).returncode


def _run_folder_overrides(
    config_class: type, overrides: list[str]
) -> tuple[list[str], bool | None]:
    """(overrides without ``overwrite=``, its value) for a recipe whose config has no
    ``overwrite`` field, where the command line guards the run folder; (overrides, None)
    for one that guards its own (``train lm``)."""
    import dataclasses

    if "overwrite" in {f.name for f in dataclasses.fields(config_class)}:
        return overrides, None
    return _pop_overwrite(overrides)


def _pop_overwrite(overrides: list[str]) -> tuple[list[str], bool]:
    """(overrides without ``overwrite=``, its value, false if absent): the command line's
    setting for a command that guards its own run folder (``_claim_output``)."""
    from dptrain.config import parse_overrides

    rest = [o for o in overrides if o.partition("=")[0].strip() != "overwrite"]
    value = parse_overrides([o for o in overrides if o not in rest]).get("overwrite", False)
    if not isinstance(value, bool):
        raise ValueError(f"overwrite={value!r} is not allowed: expected true or false")
    return rest, value


def _claim_output(
    cfg: Any, args: argparse.Namespace, overwrite: bool, *, inside: str | None = None
) -> None:
    """Set ``cfg.out`` to the folder this run may write (``claim_run_folder``): one the
    command line named (``out=``, the demo's ``--out``) is refused if it holds files,
    unless ``overwrite=true``; a default that holds an earlier run gives way to a fresh
    sibling. Called before any work, so a refusal costs nothing."""
    from dptrain.config import parse_overrides
    from dptrain.recipes._run_folder import claim_run_folder

    named = "out" in parse_overrides(args.overrides) or getattr(args, "out", None) is not None
    cfg.out = str(claim_run_folder(cfg.out, named=named, overwrite=overwrite, inside=inside))


def _claim_run_folder(
    cfg: Any, args: argparse.Namespace, overrides: list[str], overwrite: bool
) -> None:
    """``out`` checked (never over an earlier run unless ``overwrite=true``), or, when
    neither the config file nor the command line names one, a fresh folder per run."""
    from dptrain.config import read_config_values
    from dptrain.recipes._run_folder import check_run_folder, default_run_folder

    if "out" in read_config_values(args.config, overrides):
        check_run_folder(cfg.out, overwrite)
    else:
        cfg.out = str(default_run_folder(args.recipe))


def _train(args: argparse.Namespace) -> int:
    """``dptrain train RECIPE``: one run of a recipe."""
    import importlib

    from dptrain.config import load_config

    flags = {"method": args.method, "accountant": args.accountant}
    if args.recipe != "classify" and args.method is not None:
        raise ValueError(f"--method={args.method!r} is not allowed: it is for 'train classify'")
    if args.nproc < 1:
        raise ValueError(f"--nproc={args.nproc} is not allowed: expected an integer >= 1")
    if args.nproc > 1 and args.recipe not in _DISTRIBUTED_RECIPES:
        raise ValueError(
            f"--nproc={args.nproc} is not allowed for 'train {args.recipe}': several processes "
            f"are supported for {', '.join(_DISTRIBUTED_RECIPES)}"
        )
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None] + list(args.overrides)
    module_name, config_name, train_name, keys = _TRAIN_RECIPES[args.recipe]
    module = importlib.import_module(module_name)
    config_class = getattr(module, config_name)
    overrides, overwrite = _run_folder_overrides(config_class, overrides)
    cfg = load_config(config_class, args.config, overrides)
    if overwrite is not None:  # a recipe whose config has no overwrite= (train lm's has)
        _claim_run_folder(cfg, args, overrides, overwrite)
    if args.nproc > 1:  # bad input fails here, once, before any process starts
        module.check_world_size(cfg, args.nproc)
        # every process writes into the folder checked here (a fresh one is named once)
        args.overrides = [*args.overrides, f"out={cfg.out}", "overwrite=true"]
        return _torchrun_train(args)
    audit, what = bool(getattr(cfg, "audit", False)), f"train {args.recipe}"
    with _could_not_run(what) if audit else contextlib.nullcontext():
        results = getattr(module, train_name)(cfg)
    if os.environ.get("RANK", "0") != "0":  # under torchrun rank 0 reports the run
        return 0
    if args.json:
        _print_json({**results, "run_folder": cfg.out})
        return _audit_exit_code(results["audit"]["status"], what) if "audit" in results else 0
    if args.recipe == "classify":
        print(results["privacy_scope_detail"])
    if args.recipe == "lm":
        print(results["guarantee"])
    print(format_table(keys, [[results.get(k) for k in keys]]))
    print(f"run folder: {results.get('run_folder', cfg.out)} (results.json, metrics.jsonl, plots/)")
    if args.recipe == "lm" and cfg.save_model:
        print(f"model: {results['run_folder']}/model (save_pretrained, privacy.json, README.md)")
    if not audit or "audit" not in results:
        return 0
    report = results["audit"]
    bounds = ", ".join(f"{k} {v:.3f}" for k, v in report["lower_bounds_by_score"].items())
    print(f"audit ({report['correction']}): {report['status']}; lower bounds: {bounds}")
    if report.get("reach"):
        print(f"audit reach: {report['reach']}")
    return _audit_exit_code(report["status"], what)


class _CouldNotRunError(Exception):
    """An audit that crashed: exit code 2, like bad input (1 means "flagged")."""


@contextlib.contextmanager
def _could_not_run(what: str) -> Iterator[None]:
    """Turn a crash into exit code 2 for the commands whose exit code 1 means "flagged":
    a traceback would exit 1 and read as a verdict. Bad input (ValueError) is left to
    :func:`main`, which exits 2 for it too."""
    try:
        yield
    except ValueError:
        raise
    except Exception as err:
        import traceback

        traceback.print_exc()
        raise _CouldNotRunError(
            f"dptrain {what} could not run ({type(err).__name__}: {err})"
        ) from err


def _audit_exit_code(status: str, what: str) -> int:
    """0 nothing flagged, 1 flagged, 2 no claim to test (said on stderr)."""
    if status == "flagged":
        return 1
    if status == "no claim":
        print(
            f"dptrain {what}: the run makes no privacy claim (no epsilon was computed), so "
            "the audit tested nothing: exit code 2",
            file=sys.stderr,
        )
        return 2
    return 0


def _generate(args: argparse.Namespace) -> int:
    """``dptrain generate``: synthetic records from a ``train lm`` model, with their guarantee."""
    from dptrain.config import load_config
    from dptrain.recipes.generate import GenerateConfig, run_generate

    cfg = load_config(GenerateConfig, args.config, args.overrides)
    report = run_generate(cfg)
    if args.json:
        return _print_json(report)
    print(report["guarantee"])
    print(
        f"{report['n']} records ({report['empty_records']} empty), "
        f"{report['tokens_per_s']:.1f} tokens/s: {cfg.out}/synthetic.jsonl, {cfg.out}/report.json"
    )
    return 0


def _print_json(results: dict[str, Any]) -> int:
    """One JSON line on stdout (what ``--json`` prints); values JSON lacks become text."""
    print(json.dumps(results, default=str))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``dptrain`` command; returns the exit code (2 for bad input)."""
    parser = build_parser()
    # key=value overrides may follow flags (train classify --method dpfp epsilon=3), which
    # argparse leaves unparsed once the positional list has been filled before the flags.
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and e[0] != "-" for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        if getattr(args, "config", None) is not None:
            from dptrain.recipes import resolve_config

            args.config = str(resolve_config(args.config))
        if args.command == "accounting-demo":
            from dptrain.accounting_demo import run_demo

            report = run_demo(args.out, show=not args.json)
            return _print_json(report) if args.json else 0
        if args.command == "generate":
            return _generate(args)
        if args.command in ("train", "experiment", "demo", "study", "audit"):
            return _run_recipe(args, argv)
        if args.command == "bench":
            from dptrain.bench.suite import run_bench_command

            return run_bench_command(args)
        records = _COMMANDS[args.command](args)
    except ValueError as err:  # includes CliError: bad input, never a traceback
        print(f"dptrain {args.command}: error: {err}", file=sys.stderr)
        return 2
    except _CouldNotRunError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.json:
        for rec in records:
            print(json.dumps(rec))
    else:
        print(_render(args.command, records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
