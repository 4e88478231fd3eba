"""The privacy report written beside the weights: ``privacy.json`` and a model-card section.

``privacy.json`` is for programs (the guarantee, the plan, the ledger of every
step); the ``README.md`` section is for people reading the model card. The
section sits between two HTML comments, so saving again replaces it and leaves
the rest of the card (Trainer's or peft's) as it was.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from dptrain.accounting import PrivacyLedger, make_accountant
from dptrain.hf.plan import PrivacyPlan

__all__ = [
    "MODEL_CARD_END",
    "MODEL_CARD_START",
    "NOT_COVERED",
    "PRIVACY_FILE",
    "model_card_section",
    "privacy_report",
    "write_privacy_report",
]

PRIVACY_FILE = "privacy.json"
MODEL_CARD_START = "<!-- dptrain: privacy report (start) -->"
MODEL_CARD_END = "<!-- dptrain: privacy report (end) -->"
_FORMAT_VERSION = 1

#: What the (epsilon, delta) guarantee does not cover, in every report.
NOT_COVERED = (
    "the evaluation data and anything computed from it (metrics, early stopping, the choice "
    "of checkpoint by an evaluation metric)",
    "the base model and its pretraining data (only this fine-tuning on the training set is "
    "private)",
    "hyperparameter tuning: each configuration tried on the same data spends privacy too "
    "(dptrain search-cost)",
    "the training logs' loss, FLOP and token counts: they are computed from the private "
    "batch before any noise (the logged gradient norm is the noised one); treat logs as private",
    "the number of training units N, and any tokenizer or vocabulary built from the data",
)


def privacy_report(
    plan: PrivacyPlan, ledger: PrivacyLedger, *, steps_taken: int, seeded: bool
) -> dict[str, Any]:
    """The report of a run so far: the guarantee of the steps in ``ledger`` and the plan.

    ``seeded``: whether the sampling and noise seed was given (else drawn from the OS). The
    seed itself is never written: whoever knows it can subtract the noise.
    """
    import dptrain

    epsilon = (
        make_accountant(plan.accountant, ledger).epsilon(plan.target_delta)
        if ledger.num_steps
        else 0.0
    )
    unit = plan.privacy_unit
    return {
        "format_version": _FORMAT_VERSION,
        "library": f"dptrain {dptrain.__version__}",
        "guarantee": {
            "epsilon": epsilon,
            "delta": plan.target_delta,
            "accountant": plan.accountant,
            "privacy_unit": unit,
            "neighbouring": (
                f"training sets that differ by adding or removing one {unit} "
                + ("(all of that user's records)" if plan.num_units != plan.num_records else "")
            ).strip(),
            "covers": (
                "the trained weights and everything computed from them alone (outputs, "
                "generations), as released after the steps in the ledger"
            ),
            "not_covered": list(NOT_COVERED),
        },
        "training": {
            "steps_taken": steps_taken,
            "planned_steps": plan.steps,
            "target_epsilon": plan.target_epsilon,
            "noise_multiplier": plan.noise_multiplier,
            "max_grad_norm": plan.max_grad_norm,
            "clipping": plan.clipping,
            "mode": plan.mode,
            "sample_rate": plan.sample_rate,
            "expected_batch_size": plan.expected_batch_size,
            "num_units": plan.num_units,
            "num_records": plan.num_records,
            "physical_batch_size": plan.physical_batch_size,
            "world_size": plan.world_size,
            "seed": "given (PrivacyArguments.seed)" if seeded else "drawn from the OS",
        },
        "ledger": ledger.state_dict(),
    }


def model_card_section(report: dict[str, Any]) -> str:
    """The model card's "Differential privacy" section (Markdown, between the markers)."""
    g, t = report["guarantee"], report["training"]
    target = (
        f"calibrated for a target of epsilon = {t['target_epsilon']:g}"
        if t["target_epsilon"] is not None
        else "noise multiplier given"
    )
    rows = [
        ("epsilon", f"{g['epsilon']:.4g} ({g['accountant']} accountant; {target})"),
        ("delta", f"{g['delta']:g}"),
        ("privacy unit", f"one {g['privacy_unit']}: {g['neighbouring']}"),
        ("steps", f"{t['steps_taken']} of {t['planned_steps']} planned optimizer updates"),
        (
            "sampling",
            f"Poisson, rate q = {t['sample_rate']:.4g} (expected batch {t['expected_batch_size']} "
            f"of {t['num_units']} {g['privacy_unit']}s)",
        ),
        (
            "noise",
            f"Gaussian, multiplier {t['noise_multiplier']:.4g} on the sum of gradients clipped "
            f"to norm {t['max_grad_norm']:g} ({t['clipping']} clipping), added once per update",
        ),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    not_covered = "\n".join(f"- {item}" for item in g["not_covered"])
    return (
        f"{MODEL_CARD_START}\n"
        "## Differential privacy\n\n"
        f"Trained with DP-SGD by {report['library']} (`dptrain.hf.DPTrainer`). The weights "
        f"are ({g['epsilon']:.4g}, {g['delta']:g})-differentially private with respect to one "
        f"{g['privacy_unit']} of the training set.\n\n"
        "| | |\n| --- | --- |\n"
        f"{table}\n\n"
        f"Covered: {g['covers']}.\n\nNot covered:\n\n{not_covered}\n\n"
        f"Every step is in `{PRIVACY_FILE}` (the ledger).\n"
        f"{MODEL_CARD_END}\n"
    )


def _merge_card(existing: str, section: str) -> str:
    start, end = existing.find(MODEL_CARD_START), existing.find(MODEL_CARD_END)
    if start != -1 and end > start:
        return existing[:start] + section + existing[end + len(MODEL_CARD_END) :].lstrip("\n")
    if not existing.strip():
        return section
    return existing.rstrip("\n") + "\n\n" + section


def write_privacy_report(output_dir: str | os.PathLike, report: dict[str, Any]) -> None:
    """Write ``privacy.json`` and the model card section into ``output_dir``'s README.md."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / PRIVACY_FILE).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    card = folder / "README.md"
    existing = card.read_text(encoding="utf-8") if card.is_file() else ""
    card.write_text(_merge_card(existing, model_card_section(report)), encoding="utf-8")
