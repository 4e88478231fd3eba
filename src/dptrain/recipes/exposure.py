"""Recipe: canary exposure audit of table-to-text fine-tuning (Li et al. 2022, App. M, Table 9).

``dptrain audit exposure [--config FILE] [key=value ...]`` runs, in order:

1. **setup** (nothing is trained or written until it has all passed): load the
   E2E splits (:func:`dptrain.data.e2e.load_e2e`; the dev set split by table is
   the training data, see there), draw the canaries
   (:func:`dptrain.audit.make_canaries`: a sub-vocabulary of ``V`` words from
   the training texts, prefixes ``" name : <w> | Type : <w> | area : <w>"``,
   secrets of ``l`` sub-vocabulary words; ``canaries_per_repetition`` canaries
   for each ``r`` in ``repetitions``) and insert them all into ONE training set,
   each ``r`` times (:func:`dptrain.audit.insert_canaries`), as Carlini et al.
   (2019) do. A canary is the (table, text) pair (prefix, secret). The
   tokenizer is trained on the *clean* training pairs plus the public canary
   format filled with each sub-vocabulary word (the attacker knows the format
   and the candidate space), so its vocabulary does not depend on the secrets
   or on how often they were inserted; a local tokenizer (``train.tokenizer``
   or ``train.init_from``) is used as given and must encode the canaries.
2. **train**: one :func:`~dptrain.recipes.table2text.fit_table2text` per
   guarantee in ``epsilons`` (``null`` = non-private) and seed in ``seeds``,
   all on the same canary-corrupted data with the same tokenizer. The training
   settings are :class:`~dptrain.recipes.table2text.Table2TextConfig` fields
   given in the ``train`` mapping (see :class:`ExposureAuditConfig`).
3. **score**: for every canary the log-perplexity (minus
   :func:`~dptrain.recipes.table2text.text_log_likelihood`: the sum over the
   secret's tokens given ``[BOS] prefix [SEP]``) of its secret and of
   ``n_samples`` random other secrets of the same space after the same prefix;
   exposure by the *distribution model* (Carlini et al. §4.3, skew-normal fit,
   the figure Li et al. report), the rank estimate from the same samples, and
   the exact rank exposure (Definition 4) when ``|R| = V**l <= exact_max_space``
   (every other secret scored).
4. **save**: ``table.md`` (Table 9: rows = guarantee, columns r, mean ± std of
   the exposure over the canaries and seeds), ``summary.json``,
   ``exposures.jsonl`` (one line per canary and model), ``canaries.json``,
   ``exposure.png`` (exposure vs r, private vs non-private, the ``log2 |R|``
   ceiling), ``config.yaml``, ``data.json``, ``tokenizer/`` and one folder per
   trained model (``ledger.json``, ``metrics.jsonl``, ``results.json``).

The canaries are part of the training data and protected by the guarantee
like any other record: a canary inserted ``r`` times is a group of ``r``
records, so DP bounds its exposure only through group privacy (r * epsilon).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dptrain._checks import check_in_interval, check_int
from dptrain.audit.exposure import (
    DEFAULT_PREFIX_FORMAT,
    MIN_DISTRIBUTION_SAMPLES,
    CanarySet,
    candidate_words,
    check_encodable,
    exposure_by_distribution,
    exposure_by_rank,
    fit_skewnorm,
    insert_canaries,
    make_canaries,
)
from dptrain.config import (
    ConfigError,
    config_to_dict,
    convert_values,
    parse_overrides,
    read_yaml_mapping,
)
from dptrain.recipes._common import check_epsilons

__all__ = [
    "AUDIT_CONTROLLED_KEYS",
    "ExposureAuditConfig",
    "load_exposure_config",
    "run_exposure_audit",
    "summarize_exposures",
]

log = logging.getLogger(__name__)

#: Table2TextConfig fields the audit sets itself (per run or from its own fields),
#: refused in ``train``: the value there would be silently replaced.
AUDIT_CONTROLLED_KEYS = {
    "epsilon": "set epsilons",
    "seed": "set seeds",
    "out": "set out",
    "data": "set data",
    "valid_fraction": "set valid_fraction",
    "split_seed": "set split_seed",
    "progress": "set progress",
}


@dataclass
class ExposureAuditConfig:
    """Settings of one audit; every field can be set in YAML or as ``key=value``.

    Training settings go in ``train``, a mapping of
    :class:`~dptrain.recipes.table2text.Table2TextConfig` fields (YAML
    ``train: {epochs: 10, lr: 1e-3}``, or overrides ``train.epochs=10``); the
    keys in :data:`AUDIT_CONTROLLED_KEYS` are the audit's own and refused there.
    """

    # data
    data: str = "e2e"
    """``e2e`` (``../shared/data/e2e``) or a folder of the cleaned E2E release."""
    valid_fraction: float = 0.1
    """Share of the dev tables held out for validation."""
    split_seed: int = 0
    """Seed of the train/validation split (fixed across training seeds)."""
    # canaries (Li et al. App. M)
    repetitions: list[int] = dataclasses.field(default_factory=lambda: [1, 10, 100])
    """Values of r: each canary of a group is inserted r times."""
    canaries_per_repetition: int = 5
    """Canaries in each repetition group."""
    subvocab_size: int = 10
    """V: the sub-vocabulary the prefix and secret words are drawn from."""
    secret_length: int = 5
    """l: words per secret; the secret space has V**l candidates."""
    prefix_format: str = DEFAULT_PREFIX_FORMAT
    """The canary prefix (the 'table'), ``{word}`` slots filled from the sub-vocabulary."""
    canary_seed: int = 0
    """Seed of the canaries' prefixes and secrets."""
    # exposure
    n_samples: int = 2000
    """Random other secrets scored per canary for the distribution model (>= 100)."""
    exact_max_space: int = 0
    """Also score every other secret (exact rank exposure) when V**l <= this; 0: never.
    Costs V**l sequences per canary and model (e.g. 1e5 x 15 canaries: tens of minutes)."""
    score_batch_size: int = 256
    """Sequences scored per batch."""
    # runs
    epsilons: list[float | None] = dataclasses.field(default_factory=lambda: [None, 3.0])
    """Guarantees to train: a target epsilon, or null for the non-private model."""
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0])
    """Training seeds of every model."""
    train: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Table2TextConfig fields (overrides of its defaults) for every training run."""
    out: str = "runs/exposure"
    """Output folder of the audit."""
    progress: bool = True
    """Show a progress bar on stderr."""

    def __post_init__(self) -> None:
        if not self.repetitions:
            raise ValueError("repetitions=[] is not allowed: expected values of r >= 1")
        for r in self.repetitions:
            check_int("repetitions", r, 1)
        if len(set(self.repetitions)) != len(self.repetitions):
            raise ValueError(f"repetitions={self.repetitions!r} is not allowed: values repeat")
        check_int("canaries_per_repetition", self.canaries_per_repetition, 1)
        check_int("subvocab_size", self.subvocab_size, 2)
        check_int("secret_length", self.secret_length, 1)
        check_int("canary_seed", self.canary_seed, 0)
        check_int("split_seed", self.split_seed, 0)
        check_int("n_samples", self.n_samples, MIN_DISTRIBUTION_SAMPLES)
        check_int("exact_max_space", self.exact_max_space, 0)
        check_int("score_batch_size", self.score_batch_size, 1)
        check_in_interval("valid_fraction", self.valid_fraction, 0.0, 1.0)
        check_epsilons(self.epsilons)
        if not self.seeds:
            raise ValueError("seeds=[] is not allowed: expected at least one seed")
        for s in self.seeds:
            check_int("seeds", s, 0)
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds={self.seeds!r} is not allowed: values repeat")
        if not isinstance(self.train, dict):
            raise ConfigError(
                f"train={self.train!r} is not allowed: expected a mapping of Table2TextConfig "
                "fields"
            )
        self.train = _check_train(self.train)
        for eps in self.epsilons:  # every run's settings are checked before anything runs
            self.run_config(eps, self.seeds[0], Path(self.out))

    @property
    def space_size(self) -> int:
        return self.subvocab_size**self.secret_length

    def run_config(self, epsilon: float | None, seed: int, out: Path):
        """The Table2TextConfig of one training run."""
        from dptrain.recipes.table2text import Table2TextConfig

        return Table2TextConfig(
            **{
                **self.train,
                "data": self.data,
                "valid_fraction": self.valid_fraction,
                "split_seed": self.split_seed,
                "epsilon": epsilon,
                "seed": seed,
                "out": str(out),
                "progress": self.progress,
            }
        )


def _check_train(values: dict[str, Any]) -> dict[str, Any]:
    """``train`` checked against Table2TextConfig's fields and types; audit keys (and
    ``audit=true``, the white-box audit of one run) refused."""
    from dptrain.recipes.table2text import Table2TextConfig

    clash = sorted(set(values) & set(AUDIT_CONTROLLED_KEYS))
    if clash:
        how = "; ".join(f"{k}: {AUDIT_CONTROLLED_KEYS[k]}" for k in clash)
        raise ConfigError(f"train key(s) {clash} are set by the audit ({how})")
    try:
        values = convert_values(Table2TextConfig, values)
    except ConfigError as err:
        raise ConfigError(f"train: {err}") from None
    if values.get("audit"):  # fit_table2text would add canaries that no summary reports
        raise ConfigError(
            "train.audit=true is not allowed: the exposure audit does not report the white-box "
            "one-run audit (run dptrain train table2text audit=true for it)"
        )
    return values


def load_exposure_config(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> ExposureAuditConfig:
    """The audit config from defaults, the YAML file ``path``, then ``key=value`` overrides.

    Audit keys are the :class:`ExposureAuditConfig` fields; training settings
    are a ``train:`` mapping in YAML and ``train.KEY=VALUE`` (or
    ``train={KEY: VALUE}``) overrides, merged key by key over the file's.
    """
    values: dict[str, Any] = read_yaml_mapping(path) if path is not None else {}
    train = values.pop("train", None) or {}
    if not isinstance(train, dict):
        raise ConfigError(f"train={train!r} is not allowed: expected a mapping")
    train = dict(train)
    for key, value in parse_overrides(overrides).items():
        if key == "train":
            if not isinstance(value, dict):
                raise ConfigError(f"train={value!r} is not allowed: expected a mapping")
            train.update(value)
        elif key.startswith("train."):
            train[key.removeprefix("train.")] = value
        else:
            values[key] = value
    # ``train`` is not among ``values`` any more: every other key is checked and typed here
    audit = convert_values(ExposureAuditConfig, values)
    return ExposureAuditConfig(**audit, train=_check_train(train))


# -- setup ---------------------------------------------------------------------------------------


def _guarantee(epsilon: float | None) -> str:
    return "non-private" if epsilon is None else f"epsilon = {epsilon:g}"


def _run_name(epsilon: float | None, seed: int) -> str:
    return ("nonprivate" if epsilon is None else f"eps{epsilon:g}") + f"_seed{seed}"


def _tokenizer_source(cfg: ExposureAuditConfig) -> str:
    source = cfg.train.get("tokenizer")
    if source is None:
        source = cfg.train.get("init_from") or "train"
    return source


def _setup(cfg: ExposureAuditConfig):
    """Splits, canaries, the corrupted training set and the tokenizer (not yet saved)."""
    from dptrain.data.e2e import load_e2e
    from dptrain.data.tokenizer import load_tokenizer, train_tokenizer

    splits = load_e2e(cfg.data, valid_fraction=cfg.valid_fraction, seed=cfg.split_seed)
    source = _tokenizer_source(cfg)
    given = None if source == "train" else load_tokenizer(source)
    words = candidate_words([t for t, _ in splits.train] + [x for _, x in splits.train])
    canaries = make_canaries(
        words,
        repetitions=tuple(cfg.repetitions),
        per_repetition=cfg.canaries_per_repetition,
        subvocab_size=cfg.subvocab_size,
        secret_length=cfg.secret_length,
        prefix_format=cfg.prefix_format,
        seed=cfg.canary_seed,
        tokenizer=given,
    )
    if given is None:
        # Clean training pairs + the public format with each sub-vocabulary word: the
        # vocabulary knows every canary piece but nothing about the secrets or r.
        public = [canaries.prefix_format.replace("{word}", w) for w in canaries.subvocab]
        texts = [t for t, _ in splits.train] + [x for _, x in splits.train] + public
        vocab = cfg.run_config(None, 0, Path(cfg.out)).vocab_size
        tokenizer = train_tokenizer(texts, kind="bpe", vocab_size=vocab)
        note = (
            "BPE tokenizer trained on the clean training pairs (no canaries) and the public "
            "canary format with each sub-vocabulary word; shared by every model. Like any "
            "vocabulary trained on the data it is outside the DP guarantee."
        )
    else:
        tokenizer = given
        note = f"tokenizer loaded from {source}"
    check_encodable(tokenizer, [t for c in canaries.canaries for t in c.pair])
    _check_fits(tokenizer, canaries, cfg.run_config(None, 0, Path(cfg.out)).max_len)
    train = insert_canaries(splits.train, canaries, seed=cfg.canary_seed)
    return splits, canaries, train, tokenizer, note


def _check_fits(tokenizer, canaries: CanarySet, max_len: int) -> None:
    """Refuse a ``max_len`` that would cut a candidate secret (its score would be partial)."""

    def n_tokens(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    longest_word = max(canaries.subvocab, key=lambda w: n_tokens(" " + w))
    longest_secret = " ".join([longest_word] * canaries.secret_length)
    need = 3 + max(n_tokens(c.prefix) for c in canaries.canaries) + n_tokens(longest_secret)
    if need > max_len:
        raise ValueError(
            f"train.max_len={max_len} is not allowed: a canary with its longest candidate "
            f"secret takes {need} tokens ([BOS] prefix [SEP] secret [EOS]); expected >= {need}"
        )


# -- scoring -------------------------------------------------------------------------------------


def _log_ppl(model, tokenizer, pairs, *, max_len: int, batch_size: int) -> np.ndarray:
    from dptrain.recipes.table2text import text_log_likelihood

    ll = text_log_likelihood(model, tokenizer, pairs, max_len=max_len, batch_size=batch_size)
    return -ll.numpy()


def _score_canaries(
    model, tokenizer, canaries: CanarySet, cfg: ExposureAuditConfig, max_len: int, desc: str
) -> list[dict[str, Any]]:
    """Exposure of every canary under one model (distribution model, rank estimates)."""
    from tqdm.auto import tqdm

    exact = 0 < canaries.space_size <= cfg.exact_max_space
    rows = []
    for c in tqdm(canaries.canaries, desc=desc, unit="canary", disable=not cfg.progress):
        score = dict(max_len=max_len, batch_size=cfg.score_batch_size)
        own = float(_log_ppl(model, tokenizer, [c.pair], **score)[0])
        # the same random candidates for every model: paired comparisons across guarantees
        sampled = canaries.sample_secrets(
            cfg.n_samples, exclude=c.secret, seed=cfg.canary_seed * 100_003 + c.index
        )
        cand = _log_ppl(model, tokenizer, [(c.prefix, s) for s in sampled], **score)
        try:
            fit = fit_skewnorm(cand)
        except ValueError as err:  # e.g. all candidates alike: the model cannot tell them apart
            log.warning("canary %d: no distribution estimate (%s)", c.index, err)
            fit = None
        row = {
            "canary": c.index,
            "repetitions": c.repetitions,
            "prefix": c.prefix,
            "secret": c.secret,
            "log_ppl": own,
            "exposure": None if fit is None else exposure_by_distribution(own, fit),
            "exposure_rank_sampled": exposure_by_rank(own, cand, canaries.space_size),
            "exposure_rank_exact": None,
            "candidates_mean_log_ppl": float(cand.mean()),
            "candidates_std_log_ppl": float(cand.std()),
            "skewnorm_fit": None if fit is None else fit.to_dict(),
        }
        if exact:
            others = [(c.prefix, s) for s in canaries.all_secrets() if s != c.secret]
            row["exposure_rank_exact"] = exposure_by_rank(
                own, _log_ppl(model, tokenizer, others, **score)
            )
        rows.append(row)
    return rows


# -- summary -------------------------------------------------------------------------------------


def summarize_exposures(
    rows: Sequence[dict[str, Any]], key: str = "exposure"
) -> dict[str, dict[str, dict[str, float]]]:
    """``{guarantee: {r: {mean, std, min, max, n}}}`` of ``key`` over canaries (and seeds).

    ``std`` is the sample standard deviation (ddof = 1; 0 for a single value).
    Rows whose ``key`` is None are left out.
    """
    groups: dict[str, dict[str, list[float]]] = {}
    for row in rows:
        if row.get(key) is None:
            continue
        groups.setdefault(row["guarantee"], {}).setdefault(str(row["repetitions"]), []).append(
            float(row[key])
        )
    out: dict[str, dict[str, dict[str, float]]] = {}
    for guarantee, by_r in groups.items():
        out[guarantee] = {}
        for r, vals in sorted(by_r.items(), key=lambda kv: int(kv[0])):
            arr = np.asarray(vals)
            out[guarantee][r] = {
                "mean": float(arr.mean()),
                "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0,
                "min": float(arr.min()),
                "max": float(arr.max()),
                "n": len(arr),
            }
    return out


def _markdown_table(summary, guarantees: Sequence[str], reps: Sequence[int]) -> list[str]:
    head = "| Guarantee | " + " | ".join(f"r = {r}" for r in reps) + " |"
    lines = [head, "|" + "---|" * (len(reps) + 1)]
    for g in guarantees:
        cells = []
        for r in reps:
            s = summary.get(g, {}).get(str(r))
            cells.append("n/a" if s is None else f"{s['mean']:.2f} ± {s['std']:.2f}")
        lines.append(f"| {g} | " + " | ".join(cells) + " |")
    return lines


def _table_md(result: dict[str, Any]) -> str:
    reps = result["repetitions"]
    guarantees = result["guarantees"]
    cs = result["canaries"]
    lines = [
        "# Canary exposure (Li et al. 2022, Table 9 analogue)",
        "",
        "Exposure estimated by the approximation by distribution model (Carlini et al. 2019, "
        f"§4.3; skew-normal fitted to {result['n_samples']} random candidate secrets per "
        "canary); mean ± std over "
        f"{cs['per_repetition']} canaries per r x {len(result['seeds'])} seed(s).",
        "",
        *_markdown_table(result["exposure"], guarantees, reps),
        "",
        f"Ceiling log2 |R| = log2({cs['subvocab_size']}^{cs['secret_length']}) = "
        f"{cs['max_exposure']:.2f} bits (V = {cs['subvocab_size']}, l = {cs['secret_length']}); "
        "the distribution estimate is not bounded by it.",
        "",
        "Check: rank exposure log2 |R| - log2 rank, the rank estimated from the same samples:",
        "",
        *_markdown_table(result["exposure_rank_sampled"], guarantees, reps),
    ]
    if result["exposure_rank_exact"]:
        lines += [
            "",
            "Exact rank exposure (every other secret scored, Carlini et al. Def. 4):",
            "",
            *_markdown_table(result["exposure_rank_exact"], guarantees, reps),
        ]
    lines += ["", "| Model | epsilon spent | delta | steps | train pairs | wall time |"]
    lines.append("|---|---|---|---|---|---|")
    for run in result["runs"]:
        eps = "inf" if run["epsilon"] is None else f"{run['epsilon']:.3f}"
        delta = "0" if run["delta"] is None else f"{run['delta']:.2e}"
        lines.append(
            f"| {run['guarantee']} (seed {run['seed']}) | {eps} | {delta} | {run['steps']} | "
            f"{result['n_train_pairs']} | {run['train_wall_s']:.0f} s train + "
            f"{run['score_wall_s']:.0f} s scoring |"
        )
    lines += [
        "",
        f"Training data: {result['n_train_clean']} clean pairs + {result['n_canary_records']} "
        f"canary records ({cs['n_canaries']} canaries). {result['data_source']}",
        "",
        f"Wall time {result['wall_time_s'] / 60:.1f} min. Command: `{result['command']}`",
        "",
        f"Note: {result['note']}",
        "",
    ]
    return "\n".join(lines)


def _plot(rows: Sequence[dict[str, Any]], result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    reps = result["repetitions"]
    fig, ax = plt.subplots(figsize=(5.8, 3.9))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, g in enumerate(result["guarantees"]):
        color = colors[k % len(colors)]
        shift = 1.0 + 0.06 * (k - (len(result["guarantees"]) - 1) / 2)
        pts = [
            (row["repetitions"], row["exposure"])
            for row in rows
            if row["guarantee"] == g and row["exposure"] is not None
        ]
        ax.scatter([r * shift for r, _ in pts], [e for _, e in pts], s=10, alpha=0.35, color=color)
        s = result["exposure"].get(g, {})
        xs = [r for r in reps if str(r) in s]
        ax.errorbar(
            [r * shift for r in xs],
            [s[str(r)]["mean"] for r in xs],
            yerr=[s[str(r)]["std"] for r in xs],
            marker="o",
            capsize=3,
            color=color,
            label=g,
        )
    ceiling = result["canaries"]["max_exposure"]
    ax.axhline(ceiling, color="grey", ls="--", lw=1, label=f"log2 |R| = {ceiling:.1f}")
    ax.set_xscale("log")
    ax.set_xticks(reps)
    ax.set_xticklabels([str(r) for r in reps])
    ax.set_xlabel("repetitions r of the canary in the training data")
    ax.set_ylabel("exposure (bits, distribution model)")
    ax.set_title("Canary exposure, E2E table-to-text")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# -- the recipe ----------------------------------------------------------------------------------


def run_exposure_audit(
    cfg: ExposureAuditConfig, command: str = "dptrain audit exposure"
) -> dict[str, Any]:
    """Run the audit (see the module docstring); return the ``summary.json`` content."""
    import torch

    from dptrain.config import save_config
    from dptrain.recipes.table2text import fit_table2text

    t0 = time.perf_counter()
    threads = cfg.train.get("num_threads", 0)
    if threads:
        torch.set_num_threads(threads)
    splits, canaries, train, tokenizer, tok_note = _setup(cfg)
    out = Path(cfg.out)
    runs = [(eps, seed) for eps in cfg.epsilons for seed in cfg.seeds]
    run_cfgs = {}
    if _tokenizer_source(cfg) == "train":
        tok_dir = out / "tokenizer"
        for eps, seed in runs:  # every run loads the audit's tokenizer
            run_cfgs[eps, seed] = dataclasses.replace(
                cfg.run_config(eps, seed, out / _run_name(eps, seed)), tokenizer=str(tok_dir)
            )
    else:
        tok_dir = None
        for eps, seed in runs:
            run_cfgs[eps, seed] = cfg.run_config(eps, seed, out / _run_name(eps, seed))
    for rc in run_cfgs.values():  # bad sizes stop here, before anything is written
        if rc.batch_size > len(train):
            raise ValueError(
                f"train.batch_size={rc.batch_size} is not allowed: the canary-corrupted training "
                f"set has only {len(train)} pairs"
            )

    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    if tok_dir is not None:
        tokenizer.save_pretrained(str(tok_dir))
    (out / "canaries.json").write_text(json.dumps(canaries.to_dict(), indent=2))
    n_canary_records = sum(c.repetitions for c in canaries.canaries)
    data_info = {
        **splits.summary,
        "train_pairs_with_canaries": len(train),
        "canary_records": n_canary_records,
        "privacy_unit": "one (table, text) pair; a canary inserted r times is r records",
    }
    (out / "data.json").write_text(json.dumps(data_info, indent=2))

    all_rows: list[dict[str, Any]] = []
    run_records = []
    exposures_path = out / "exposures.jsonl"
    exposures_path.write_text("")
    for (eps, seed), rc in run_cfgs.items():
        folder = Path(rc.out)
        fitted = fit_table2text(rc, train, splits.valid, folder)
        t_score = time.perf_counter()
        rows = _score_canaries(
            fitted.model, fitted.tokenizer, canaries, cfg, rc.max_len, _run_name(eps, seed)
        )
        score_s = time.perf_counter() - t_score
        record = {
            "guarantee": _guarantee(eps),
            "target_epsilon": eps,
            "epsilon": fitted.epsilon,
            "delta": fitted.delta,
            "noise_multiplier": fitted.noise_multiplier,
            "seed": seed,
            "steps": fitted.steps,
            "sample_rate": fitted.sample_rate,
            "best_epoch": fitted.best_epoch,
            "valid_loss": next(
                (h["valid_loss"] for h in fitted.history if h["epoch"] == fitted.best_epoch), None
            ),
            "train_wall_s": fitted.wall_s,
            "score_wall_s": score_s,
            "folder": str(folder),
        }
        run_records.append(record)
        (folder / "results.json").write_text(
            json.dumps({**record, "config": config_to_dict(rc)}, indent=2)
        )
        with exposures_path.open("a") as f:
            for row in rows:
                row = {
                    "guarantee": record["guarantee"],
                    "target_epsilon": eps,
                    "seed": seed,
                    **row,
                    "max_exposure": canaries.max_exposure,
                }
                all_rows.append(row)
                f.write(json.dumps(row) + "\n")

    guarantees = [_guarantee(e) for e in cfg.epsilons]
    rc0 = next(iter(run_cfgs.values()))
    result: dict[str, Any] = {
        "guarantees": guarantees,
        "repetitions": list(cfg.repetitions),
        "seeds": list(cfg.seeds),
        "n_samples": cfg.n_samples,
        "exposure": summarize_exposures(all_rows, "exposure"),
        "exposure_rank_sampled": summarize_exposures(all_rows, "exposure_rank_sampled"),
        "exposure_rank_exact": summarize_exposures(all_rows, "exposure_rank_exact"),
        "canaries": {
            "n_canaries": len(canaries.canaries),
            "per_repetition": cfg.canaries_per_repetition,
            "subvocab": list(canaries.subvocab),
            "subvocab_size": cfg.subvocab_size,
            "secret_length": cfg.secret_length,
            "space_size": canaries.space_size,
            "max_exposure": canaries.max_exposure,
            "prefix_format": cfg.prefix_format,
        },
        "runs": run_records,
        "n_train_clean": len(splits.train),
        "n_canary_records": n_canary_records,
        "n_train_pairs": len(train),
        "n_valid_pairs": len(splits.valid),
        "model": {
            "init_from": rc0.init_from,
            "n_layer": rc0.n_layer,
            "n_embd": rc0.n_embd,
            "n_head": rc0.n_head,
            "vocab_size": len(tokenizer),
            "epochs": rc0.epochs,
            "batch_size": rc0.batch_size,
            "lr": rc0.lr,
            "max_grad_norm": rc0.max_grad_norm,
        },
        "data_source": splits.source,
        "tokenizer_scope": tok_note,
        "command": command,
        "wall_time_s": time.perf_counter() - t0,
        "note": (
            "exposure = -log2 P(random candidate log-ppl <= canary log-ppl) under a "
            "skew-normal fitted to the candidates (can exceed log2 |R|); log-ppl = minus the "
            "sum over the secret's tokens of log p(token | [BOS] prefix [SEP] preceding "
            "tokens). A canary repeated r times is r records: the epsilon guarantee covers it "
            "only as a group (r * epsilon by group privacy)."
        ),
    }
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    (out / "table.md").write_text(_table_md(result))
    _plot(all_rows, result, out / "exposure.png")
    return result
