"""DP synthetic text, measured downstream (issue 18 item 3; docs/lm.md "DP synthetic text").

Question: a classifier trained only on reviews that a DP fine-tuned SmolLM2 wrote
(label-conditioned), tested on real reviews: how good is it against the same
classifier trained on the real reviews, and against DP training on the real reviews
at the same epsilon? And how close is the synthetic text to real text?

Stages (each a command; ``--out`` holds everything):

1. ``prepare``: the Rotten Tomatoes training split (10,246 reviews, the fixed split
   of ``train classify``) as prompt/completion records, ``"Review (positive):"`` ->
   ``" <review>"`` (labels written as words the pretrained model knows).
2. for each of non-private, epsilon 8, epsilon 3 (``run_models.sh`` written by
   ``prepare``): ``dptrain train lm`` (LoRA, the same steps and batches for all) then
   ``dptrain generate n=1000`` with the labels in turn. The synthetic records are
   DP by post-processing: the classifier trained on them adds no privacy cost.
3. ``evaluate``: the linear probe of ``train classify`` (frozen MiniLM, mean pooled)
   trained non-privately (``nonprivate-head``) on each synthetic set and tested on
   the real test split (``test_data=rotten-tomatoes``); references on the real
   data: the same probe non-private on all 10,246 reviews and on a 1,000-review
   subset (the synthetic sets' size), and the DP probe (``dpsgd-head``, DP-Adam) on
   all real reviews at epsilon 8 and 3. Distribution: MAUVE (Pillutla et al.,
   NeurIPS 2021, ``mauve-text``) between the MiniLM embeddings of the synthetic
   reviews and of as many real test reviews, with a real-vs-real reference (real
   training reviews against the same test reviews). Writes ``table.md``,
   ``results.json`` and ``synthetic_utility.png``.

Why MAUVE on MiniLM embeddings: it compares the two text distributions as a whole
(quality and diversity: a generator that repeats a few good reviews scores low),
needs no reference pairs, and with the probe's own encoder it measures the
geometry the classifier sees. MAUVE's usual GPT-2-large features cannot be loaded
offline; the scale is relative, so the real-vs-real row is the reference.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

LABEL_WORDS = ("negative", "positive")  # prompt words for label 0 (rotten), 1 (fresh)
CLASS_NAMES = ("rotten", "fresh")  # train classify's names for Rotten Tomatoes labels
#: 1,000 records per model, not the issue's 2,000: sampling ran at 1-3 records/s on
#: 2 cores, and three models' worth of 2,000 did not fit the session (n=2000 is the
#: only change needed).
N_SYNTHETIC = 1000
SOURCES = ("nonprivate", "eps8", "eps3")  # fine-tuned on the real reviews
#: The public model prompted, no fine-tuning: what synthetic data costs nothing private.
PUBLIC_GENERATE = (
    f"model=smollm2-135m-instruct chat=true n={N_SYNTHETIC} "
    "'prompt=Write a one-sentence {label} movie review.' labels=negative,positive "
    "max_new_tokens=48 batch_size=100 top_p=0.95 seed=0"
)
TRAIN_LM = (
    "lora_r=8 lr=2e-3 batch_size=64 steps=40 max_length=64 max_grad_norm=0.1 "
    "max_physical_batch_size=16 valid_fraction=0.05 eval_every=40 max_eval_examples=128 "
    "eval_batch_size=32 seed=0"
)
GENERATE = (
    f"n={N_SYNTHETIC} 'prompt=Review ({{label}}):' labels=negative,positive max_new_tokens=48 "
    "batch_size=100 top_p=0.95 seed=0"
)


def prepare(out: Path) -> None:
    from dptrain.data.text_classification import load_rotten_tomatoes

    data = load_rotten_tomatoes(seed=0)
    (out / "data").mkdir(parents=True, exist_ok=True)
    with (out / "data" / "rt_train.jsonl").open("w") as f:
        for text, label in zip(data.train_texts, data.train_labels.tolist(), strict=True):
            prompt = f"Review ({LABEL_WORDS[label]}):"
            f.write(json.dumps({"prompt": prompt, "completion": " " + text}) + "\n")
    lines = ["#!/bin/bash", "set -e", f"cd {Path.cwd()}"]
    for source in SOURCES:
        privacy = (
            "private=false epsilon=null" if source == "nonprivate" else f"epsilon={source[3:]}"
        )
        run = out / source
        lines += [
            f"dptrain train lm data={out}/data/rt_train.jsonl {TRAIN_LM} {privacy} out={run}",
            f"dptrain generate model={run}/model {GENERATE} out={run}/gen",
        ]
    lines.append(f"dptrain generate {PUBLIC_GENERATE} out={out}/public/gen")
    (out / "run_models.sh").write_text("\n".join(lines) + "\n")
    print(
        f"{data.n_train} training reviews -> {out}/data/rt_train.jsonl; next: {out}/run_models.sh"
    )


def _classify_file(source_dir: Path) -> Path:
    """The synthetic records as train classify reads them (labels as class names)."""
    path = source_dir / "gen" / "synthetic_classify.jsonl"
    with (source_dir / "gen" / "synthetic.jsonl").open() as f, path.open("w") as g:
        for line in f:
            record = json.loads(line)
            label = CLASS_NAMES[LABEL_WORDS.index(record["label"])]
            g.write(json.dumps({"text": record["text"], "label": label}) + "\n")
    return path


def _mauve(p: np.ndarray, q: np.ndarray, seed: int = 0) -> float:
    import mauve

    n = min(len(p), len(q))
    rng = np.random.default_rng(seed)
    p = p[rng.permutation(len(p))[:n]]
    q = q[rng.permutation(len(q))[:n]]
    # mauve's default: k-means on PCA of the pooled features, n / 10 clusters
    result = mauve.compute_mauve(p_features=p, q_features=q, seed=seed, verbose=False)
    return float(result.mauve)


def evaluate(out: Path, threads: int) -> None:
    import torch

    from dptrain.recipes.classify import (
        ClassifyTrainConfig,
        frozen_encoder_features,
        train_classify,
    )

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    cache = str(out / "cache")
    common = {"feature_cache": cache, "progress": False, "save_checkpoint": False}
    rows = []

    def run(name: str, training: str, privacy: str, **kw) -> dict:
        cfg = ClassifyTrainConfig(**common, out=str(out / "classify" / name), **kw)
        result = train_classify(cfg)
        rows.append({"name": name, "training data": training, "privacy": privacy, **result})
        print(f"{name}: test accuracy {result['accuracy']:.3f}", flush=True)
        return result

    real = {"data": "rotten-tomatoes"}
    run("real-all", "real, 10,246 reviews", "none", method="nonprivate-head", **real)
    size = sum(1 for _ in (out / SOURCES[0] / "gen" / "synthetic.jsonl").open())
    run(
        f"real-{size}", f"real, {size:,} reviews", "none", method="nonprivate-head", train_size=size
    )
    for eps in (8.0, 3.0):
        run(
            f"real-dp-eps{eps:g}",
            "real, 10,246 reviews",
            f"DP-Adam on the probe, epsilon {eps:g}",
            method="dpsgd-head",
            epsilon=eps,
            **real,
        )
    real_data, real_feats = frozen_encoder_features(
        ClassifyTrainConfig(**common, method="nonprivate-head", **real)
    )
    # Label fidelity: how often a probe trained on the real reviews agrees with the label a
    # synthetic review was generated for (sklearn's logistic regression: a fixed, well-kept
    # reference classifier, independent of the probe's training loop).
    from sklearn.linear_model import LogisticRegression

    judge = LogisticRegression(max_iter=2000).fit(
        real_feats["train"].numpy(), real_data.train_labels.numpy()
    )
    generation: dict[str, dict] = {}
    mauve_scores = {
        "real train vs real test": _mauve(real_feats["train"].numpy(), real_feats["test"].numpy())
    }
    for source in (*SOURCES, "public"):
        source_dir = out / source
        if source == "public":
            model_eps, privacy = 0.0, "public model prompted, no private data (epsilon 0)"
            train_results = {}
        else:
            train_results = json.loads((source_dir / "results.json").read_text())
            model_eps = train_results["epsilon"]
            privacy = (
                "none"
                if source == "nonprivate"
                else f"synthetic from a DP model, epsilon {model_eps:.2f} (post-processing)"
            )
        path = _classify_file(source_dir)
        synth = {"data": str(path), "test_data": "rotten-tomatoes", "method": "nonprivate-head"}
        run(f"synthetic-{source}", f"synthetic, {size:,} ({source})", privacy, **synth)
        data, feats = frozen_encoder_features(ClassifyTrainConfig(**common, **synth))
        synthetic = torch.cat([feats["train"], feats["dev"]]).numpy()
        # the synthetic file's label order is its own: map to the real data's by name
        to_real = torch.tensor([real_data.label_names.index(n) for n in data.label_names])
        synthetic_labels = to_real[torch.cat([data.train_labels, data.dev_labels])].numpy()
        agreement = float((judge.predict(synthetic) == synthetic_labels).mean())
        mauve_scores[f"synthetic {source} vs real test"] = _mauve(
            synthetic, real_feats["test"].numpy()
        )
        report = json.loads((source_dir / "gen" / "report.json").read_text())
        generation[source] = {
            "lm_epsilon": model_eps,
            "lm_delta": train_results.get("delta"),
            "lm_train_time_s": train_results.get("train_time_s"),
            "lm_tokens_per_s": train_results.get("train_tokens_per_s"),
            "lm_valid_perplexity": train_results.get("valid_perplexity"),
            "lm_initial_valid_perplexity": train_results.get("initial_valid_perplexity"),
            "generate": {k: report.get(k) for k in ("tokens_per_s", "wall_time_s", "n")},
            "label_agreement_with_real_probe": agreement,
        }
    results = {
        "classifiers": [
            {
                k: r[k]
                for k in (
                    "name",
                    "training data",
                    "privacy",
                    "accuracy",
                    "dev_accuracy",
                    "epsilon",
                    "n_train",
                    "n_test",
                )
            }
            for r in rows
        ],
        "mauve": mauve_scores,
        "generation": generation,
        "wall_time_s": time.perf_counter() - t0,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "table.md").write_text(_table(results))
    _plot(results, out / "synthetic_utility.png")
    print((out / "table.md").read_text())


def _table(results: dict) -> str:
    lines = [
        "| classifier (frozen MiniLM + linear probe) | training data | privacy | test accuracy |",
        "| --- | --- | --- | ---: |",
    ]
    for r in results["classifiers"]:
        lines.append(
            f"| {r['name']} | {r['training data']} | {r['privacy']} | {r['accuracy']:.3f} |"
        )
    lines += [
        "",
        "| MAUVE on MiniLM embeddings (1 = same distribution) | value |",
        "| --- | ---: |",
    ]
    lines += [f"| {k} | {v:.3f} |" for k, v in results["mauve"].items()]
    lines += [
        "",
        "| synthetic set | labels a real-data probe agrees with |",
        "| --- | ---: |",
    ]
    lines += [
        f"| {k} | {v['label_agreement_with_real_probe']:.3f} |"
        for k, v in results["generation"].items()
    ]
    return "\n".join(lines) + "\n"


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = {r["name"]: r["accuracy"] for r in results["classifiers"]}
    mauve = results["mauve"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [3, 2]})
    groups = [
        ("non-private", "real-all", "synthetic-nonprivate", None),
        ("epsilon 8", "real-dp-eps8", "synthetic-eps8", None),
        ("epsilon 3", "real-dp-eps3", "synthetic-eps3", None),
    ]
    x = np.arange(len(groups))
    real_vals = [acc[g[1]] for g in groups]
    synth_vals = [acc[g[2]] for g in groups]
    axes[0].bar(x - 0.2, real_vals, 0.4, label="trained on real reviews (DP-Adam when private)")
    axes[0].bar(x + 0.2, synth_vals, 0.4, label="trained on the synthetic reviews only")
    for xs, vals in ((x - 0.2, real_vals), (x + 0.2, synth_vals)):
        for xi, v in zip(xs, vals, strict=True):
            axes[0].text(xi, v + 0.005, f"{v:.3f}", ha="center", fontsize=8)
    subset = next(
        r
        for r in results["classifiers"]
        if r["name"].startswith("real-") and r["name"][5:].isdigit()
    )
    axes[0].axhline(
        subset["accuracy"],
        color="k",
        ls="--",
        lw=1,
        label=f"real, {subset['n_train']:,} reviews, non-private",
    )
    axes[0].axhline(
        acc["synthetic-public"],
        color="tab:purple",
        ls=":",
        lw=1.5,
        label="synthetic from the public model, prompted (epsilon 0)",
    )
    axes[0].set_xticks(x, [g[0] for g in groups])
    axes[0].set_ylim(0.45, 0.97)
    axes[0].set_ylabel("test accuracy (real test reviews)")
    axes[0].legend(fontsize=7, loc="upper left")
    axes[0].set_title("Sentiment probe: real vs DP synthetic training data")
    names = list(mauve)
    axes[1].barh(range(len(names)), [mauve[n] for n in names], color="tab:green")
    axes[1].set_yticks(
        range(len(names)), [n.replace(" vs real test", "") for n in names], fontsize=8
    )
    axes[1].set_xlim(0, 1)
    axes[1].set_xlabel("MAUVE vs real test reviews (MiniLM embeddings)")
    axes[1].invert_yaxis()
    for i, n in enumerate(names):
        axes[1].text(mauve[n] + 0.01, i, f"{mauve[n]:.3f}", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=["prepare", "evaluate"])
    parser.add_argument("--out", default="runs/synth")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    out = Path(args.out)
    if args.stage == "prepare":
        prepare(out)
    else:
        evaluate(out, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
