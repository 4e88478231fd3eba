"""The E2E tables of docs/lm.md from `dptrain train table2text` run folders (beam or greedy).

    python benchmarks/summarize_e2e.py runs/lm/e2e/epsnull runs/lm/e2e/eps8 runs/lm/e2e/eps3 \
        --out docs/img/e2e_table2text.png

Prints a markdown table (test BLEU / ROUGE-L of greedy and beam-5 decoding,
validation BLEU, perplexity, epsilon, steps, wall time), a few test tables
whose restaurant name occurs in the training pairs with every run's beam
output, BLEU by the number of references a table has beside a human ceiling
(one reference scored against the others), and saves one PNG: validation loss per epoch for every run.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

from dptrain.data.e2e import load_e2e
from dptrain.recipes.table2text import score_generations


def _load(folder: Path) -> tuple[dict, list[dict], dict[str, dict]]:
    results = json.loads((folder / "results.json").read_text())
    history = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    generations = {}
    for line in (folder / "generations.jsonl").read_text().splitlines():
        g = json.loads(line)
        generations[g["table"]] = g
    return results, history, generations


def _name(table: str) -> str | None:
    m = re.search(r"name\[([^\]]*)\]", table)
    return m.group(1) if m else None


def _label(r: dict) -> str:
    return "non-private" if not r["private"] else f"epsilon {r['target_epsilon']:g}"


def _fmt(r: dict, key: str) -> str:
    """A score with one decimal, or "-" where the run did not compute it."""
    return "-" if r.get(key) is None else f"{r[key]:.1f}"


def _reference_analysis(runs, tables: list[str], decoding: str) -> None:
    """How the test set's references bound BLEU: corpus BLEU by a table's number of
    references, the brevity penalty, and a human ceiling: on tables with >= 2 references,
    the first reference scored against the others, beside each run scored against the
    same others."""
    import sacrebleu

    refs = [runs[0][2][t]["references"] for t in tables]
    counts = [len(r) for r in refs]
    print(
        f"\nReferences per test table: mean {sum(counts) / len(counts):.2f}; "
        f"{sum(c == 1 for c in counts)} of {len(counts)} tables have one\n"
    )
    groups = {"1": [1], "2": [2], "3": [3], ">= 4": list(range(4, 1 + max(counts)))}
    multi = [i for i, c in enumerate(counts) if c >= 2]
    print(
        "| run | "
        + " | ".join(
            f"BLEU, {k} refs ({sum(c in v for c in counts)} tables)" for k, v in groups.items()
        )
        + " | brevity penalty | BLEU vs refs 2.. (tables with >= 2) |"
    )
    print("| --- |" + " ---: |" * (len(groups) + 2))
    human = score_generations([refs[i][0] for i in multi], [refs[i][1:] for i in multi])
    for r, _, gens in runs:
        hyps = [gens[t][decoding] for t in tables]
        by_count = [
            score_generations(
                [hyps[i] for i, c in enumerate(counts) if c in v],
                [refs[i] for i, c in enumerate(counts) if c in v],
            )["bleu"]
            for v in groups.values()
        ]
        width = max(counts)
        streams = [[x[k] if k < len(x) else None for x in refs] for k in range(width)]
        bp = sacrebleu.corpus_bleu(hyps, streams).bp
        rest = score_generations([hyps[i] for i in multi], [refs[i][1:] for i in multi])
        print(
            f"| {_label(r)} | "
            + " | ".join(f"{b:.1f}" for b in by_count)
            + f" | {bp:.3f} | {rest['bleu']:.1f} |"
        )
    print(
        f"| a human: reference 1 | | | | | | {human['bleu']:.1f} (ROUGE-L {human['rouge_l']:.1f}) |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders")
    parser.add_argument("--out", type=Path, required=True, help="PNG to write")
    parser.add_argument("--samples", type=int, default=3, help="test tables to show")
    parser.add_argument("--data", default="e2e", help="the E2E folder the runs used")
    args = parser.parse_args()
    runs = [_load(f) for f in args.runs]

    print(
        "| run | epsilon (PLD) | sigma | test BLEU beam | test ROUGE-L beam | test BLEU greedy "
        "| test ROUGE-L greedy | valid BLEU beam | valid perplexity | steps | train time |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r, _, _ in runs:
        eps = "inf" if not r["private"] else f"{r['epsilon']:.2f}"
        sigma = "-" if r["noise_multiplier"] is None else f"{r['noise_multiplier']:.2f}"
        print(
            f"| {_label(r)} | {eps} | {sigma} | {_fmt(r, 'test_bleu_beam')} "
            f"| {_fmt(r, 'test_rouge_l_beam')} | {_fmt(r, 'test_bleu_greedy')} "
            f"| {_fmt(r, 'test_rouge_l_greedy')} | {_fmt(r, 'valid_bleu_beam')} "
            f"| {r['valid_perplexity']:.2f} | {r['steps']} | {r['train_wall_time_s'] / 60:.0f} min |"
        )
    # runs decoded greedily only (beam_size=1) are compared on their greedy texts
    decoding = "beam" if all("test_bleu_beam" in r for r, _, _ in runs) else "greedy"

    # test BLEU on tables whose restaurant name the training pairs contain, and on the rest:
    # half the test names never occur in the dev set that is trained on
    splits = load_e2e(args.data, valid_fraction=runs[0][0].get("valid_fraction", 0.1))
    train_names = {_name(t) for t, _ in splits.train}
    tables = list(runs[0][2])
    seen = [t for t in tables if _name(t) in train_names]
    unseen = [t for t in tables if _name(t) not in train_names]
    print(
        f"\n{len(seen)} test tables name a restaurant of the training pairs, {len(unseen)} do not\n"
    )
    print(
        f"| run | BLEU {decoding}, seen name | BLEU {decoding}, unseen name "
        f"| ROUGE-L {decoding}, seen | unseen |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    for r, _, gens in runs:
        a, b = (
            score_generations(
                [gens[t][decoding] for t in group], [gens[t]["references"] for t in group]
            )
            if group
            else {"bleu": math.nan, "rouge_l": math.nan}
            for group in (seen, unseen)
        )
        print(
            f"| {_label(r)} | {a['bleu']:.1f} | {b['bleu']:.1f} | {a['rouge_l']:.1f} "
            f"| {b['rouge_l']:.1f} |"
        )
    _reference_analysis(runs, tables, decoding)
    print()
    for table in seen[:: max(1, len(seen) // args.samples)][: args.samples]:
        print(f"**Table** `{table}`\n")
        for r, _, gens in runs:
            print(f"- {_label(r)}: {gens[table][decoding]}")
        print(f"- reference: {runs[0][2][table]['references'][0]}\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model = runs[0][0].get("model", "GPT-2-style LM from scratch")
    fig, ax = plt.subplots(figsize=(6, 3.8))
    if all(len(history) > 1 for _, history, _ in runs):
        for r, history, _ in runs:
            ax.plot(
                [h["epoch"] for h in history],
                [h["valid_loss"] for h in history],
                marker="o",
                ms=3,
                label=f"{_label(r)}: test BLEU {r[f'test_bleu_{decoding}']:.1f}",
            )
        ax.set_xlabel("epoch")
        ax.set_ylabel("validation loss (nats / text token)")
        ax.legend()
    else:  # one evaluation per run: the test scores side by side
        labels = [_label(r) for r, _, _ in runs]
        x = range(len(runs))
        bleu = [r[f"test_bleu_{decoding}"] for r, _, _ in runs]
        rouge = [r[f"test_rouge_l_{decoding}"] for r, _, _ in runs]
        ax.bar([i - 0.2 for i in x], bleu, width=0.4, label=f"BLEU ({decoding})")
        ax.bar([i + 0.2 for i in x], rouge, width=0.4, label=f"ROUGE-L ({decoding})")
        for i, (b, g) in enumerate(zip(bleu, rouge, strict=True)):
            ax.text(i - 0.2, b + 0.5, f"{b:.1f}", ha="center", fontsize=8)
            ax.text(i + 0.2, g + 0.5, f"{g:.1f}", ha="center", fontsize=8)
        ax.set_xticks(list(x), labels)
        ax.set_ylabel(f"test score ({runs[0][0]['test_tables_decoded']} tables)")
        ax.set_ylim(0, 1.3 * max(rouge + bleu))
        ax.legend(loc="upper right", ncol=2)
    ax.set_title(f"E2E table-to-text, {model}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=120)
    print(f"plot: {args.out}")


if __name__ == "__main__":
    main()
