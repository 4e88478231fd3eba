"""Aligned objective vs a fresh linear head on a causal LM, with and without DP
(issue 18 item 4; Li et al. 2022 section 3.2; docs/lm.md "Aligned objective").

Rotten Tomatoes sentiment with SmolLM2-135M-Instruct and LoRA (r 8, the seven
projections), through ``dptrain train classify``:

- ``infilling`` (aligned): the review, then "It was", and the LM head's logits of the
  label words " terrible" / " great" as the next token are the class logits: the
  pretraining task itself, nothing new to learn at step 0;
- ``linear``: the last token's state into a fresh linear layer (2 x 576), trained
  with the adapters.

Each at epsilon 3, epsilon 8 (DP-Adam, PLD, delta 1/N^1.1) and non-private, on a
seeded subset of the training split (CPU-sized: ``--train-size`` reviews of which 10%
are the dev split that picks the best epoch), tested on the whole real test split
(1,281 reviews). Also the zero-shot accuracy of the aligned objective (no training).
Writes ``table.md``, ``results.json`` and ``aligned_vs_linear.png`` under ``--out``.

    python benchmarks/aligned_objective_study.py --out runs/aligned --train-size 1000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

COMMON = {
    "encoder": "smollm2-135m-instruct",
    "test_data": "rotten-tomatoes",
    "lora_r": 8,
    "lr": 2e-3,
    "batch_size": 64,
    "max_length": 64,
    "max_physical_batch_size": 16,
    "eval_batch_size": 32,
    "epochs": 2,
    "save_checkpoint": False,
}
#: Li et al.'s label words, by class NAME: ``label_words`` lists one word per class in
#: the data's label order, and a file's labels are ordered by sorted name (fresh, rotten).
WORDS = {"rotten": "terrible", "fresh": "great"}
GRID = [("nonprivate", None), ("dpsgd", 8.0), ("dpsgd", 3.0)]


def _subset(out: Path, size: int) -> Path:
    """``size`` training reviews (seeded), as a file that train classify splits 90 / 10."""
    import torch

    from dptrain.data.text_classification import load_rotten_tomatoes

    data = load_rotten_tomatoes(seed=0)
    keep = torch.randperm(data.n_train, generator=torch.Generator().manual_seed(0))[:size]
    path = out / f"rt_train_{size}.jsonl"
    with path.open("w") as f:
        for i in keep.tolist():
            label = data.label_names[int(data.train_labels[i])]
            f.write(json.dumps({"text": data.train_texts[i], "label": label}) + "\n")
    return path


def _zero_shot(cfg) -> float:
    """Test accuracy of the aligned objective before any training."""
    from dptrain.recipes import classify

    data = classify.load_classification_data(cfg)
    classifier, _, tokenizer, _ = classify._setup_model(cfg, data)
    texts = classify._TokenizedTexts(
        classify._tokenize(cfg, tokenizer, data.test_texts),
        data.test_labels,
        tokenizer.pad_token_id,
    )
    return classify._accuracy_of(classifier, texts, data.test_labels, cfg.eval_batch_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/aligned")
    parser.add_argument("--train-size", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--objectives",
        default="infilling,linear",
        help="run these; the others' rows are kept from an earlier results.json in --out",
    )
    args = parser.parse_args(argv)
    import torch

    from dptrain.recipes.classify import ClassifyTrainConfig, train_classify

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    from dptrain.recipes.classify import load_classification_data

    common = {**COMMON, "data": str(_subset(out, args.train_size))}
    names = load_classification_data(
        ClassifyTrainConfig(**common, method="nonprivate", out=str(out / "zs"))
    ).label_names
    common["label_words"] = [WORDS[name] for name in names]
    print(f"label words: {dict(zip(names, common['label_words'], strict=True))}", flush=True)
    wanted = args.objectives.split(",")
    earlier = out / "results.json"
    kept = (
        [r for r in json.loads(earlier.read_text())["runs"] if r["objective"] not in wanted]
        if earlier.is_file()
        else []
    )
    zero = _zero_shot(
        ClassifyTrainConfig(
            **common, objective="infilling", method="nonprivate", out=str(out / "zs")
        )
    )
    print(f"zero-shot (aligned, no training): {zero:.3f}", flush=True)
    rows = []
    for objective in ("infilling", "linear"):
        if objective not in wanted:
            rows += [r for r in kept if r["objective"] == objective]
            continue
        for method, eps in GRID:
            tag = f"{objective}-{'nonprivate' if eps is None else f'eps{eps:g}'}"
            cfg = ClassifyTrainConfig(
                **common,
                objective=objective,
                method=method,
                epsilon=eps,
                max_norm=None if eps is None else 0.1,
                out=str(out / tag),
            )
            r = train_classify(cfg)
            rows.append({"objective": objective, "epsilon_target": eps, **r})
            print(
                f"{tag}: test {r['accuracy']:.3f} (dev {r['dev_accuracy']:.3f}, "
                f"epsilon {r['epsilon']:.2f}, {r['train_time_s']:.0f} s)",
                flush=True,
            )
    results = {
        "zero_shot": zero,
        "runs": rows,
        "settings": common,
        "wall_time_s": time.perf_counter() - t0,
    }
    (out / "results.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"SmolLM2-135M-Instruct + LoRA r8, {rows[0]['n_train']} training reviews "
        f"({rows[0]['n_dev']} dev), {rows[0]['n_test']} real test reviews; zero-shot aligned: "
        f"{zero:.3f}",
        "",
        "| objective | non-private | epsilon 8 | epsilon 3 | step time (non-private / DP) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for objective in ("infilling", "linear"):
        mine = [r for r in rows if r["objective"] == objective]
        acc = [f"{r['accuracy']:.3f}" for r in mine]
        steps = f"{mine[0]['step_time_s']:.1f} s / {mine[1]['step_time_s']:.1f} s"
        name = (
            "aligned (label word, next token)" if objective == "infilling" else "fresh linear head"
        )
        lines.append(f"| {name} | " + " | ".join(acc) + f" | {steps} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    _plot(results, out / "aligned_vs_linear.png")
    print((out / "table.md").read_text())
    return 0


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = ["non-private", "epsilon 8", "epsilon 3"]
    x = np.arange(3)
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for k, (objective, name) in enumerate(
        [("infilling", "aligned: label word as next token"), ("linear", "fresh linear head")]
    ):
        acc = [r["accuracy"] for r in results["runs"] if r["objective"] == objective]
        bars = ax.bar(x + (k - 0.5) * 0.38, acc, 0.38, label=name)
        ax.bar_label(bars, fmt="%.3f", fontsize=8)
    ax.axhline(results["zero_shot"], color="k", ls="--", lw=1, label="aligned, zero-shot")
    ax.set_xticks(x, labels)
    majority = 0.578  # the test split's majority class (fresh), docs/dpfp.md
    ax.axhline(majority, color="tab:red", ls=":", lw=1.5, label="no training (majority)")
    ax.set_ylim(0.3, 0.92)
    ax.set_ylabel("test accuracy (1,281 real reviews)")
    ax.set_title("SmolLM2 + LoRA on Rotten Tomatoes: aligned objective vs linear head")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
