"""The privacy report written beside the weights: ``privacy.json`` and a model-card section.

``privacy.json`` is for programs (the guarantee, the plan, the ledger of every
step): the privacy record every dptrain path writes and reads
(:mod:`dptrain.privacy_record`, docs/privacy_record.md), so ``dptrain generate``
loads a DPTrainer model as it loads a ``train lm`` one. The ``README.md`` section
is for people reading the model card. The section sits between two HTML comments,
so saving again replaces it and leaves the rest of the card (Trainer's or peft's)
as it was.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from dptrain.accounting import PrivacyLedger, make_accountant
from dptrain.hf.plan import PrivacyPlan
from dptrain.models.pretrained import loadable_name, public_source
from dptrain.privacy_record import PRIVACY_FILE, BaseModelSource, PrivacyRecord

__all__ = [
    "MODEL_CARD_END",
    "MODEL_CARD_START",
    "NOT_COVERED",
    "PRIVACY_FILE",
    "base_model_of",
    "model_card_section",
    "privacy_report",
    "write_privacy_report",
]

MODEL_CARD_START = "<!-- dptrain: privacy report (start) -->"
MODEL_CARD_END = "<!-- dptrain: privacy report (end) -->"

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


def base_model_of(model: nn.Module) -> BaseModelSource | None:
    """The public model ``model`` was fine-tuned from, as far as it says: a peft adapter's
    ``base_model_name_or_path``, else the transformers model's ``name_or_path``; None for a
    model built from a config (it names none)."""
    peft_config = getattr(model, "peft_config", None)
    name = None
    if isinstance(peft_config, dict) and peft_config:
        name = getattr(next(iter(peft_config.values())), "base_model_name_or_path", None)
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
    else:
        base = model
    config = getattr(base, "config", None)
    if not name:
        name = getattr(base, "name_or_path", None) or getattr(config, "name_or_path", None)
    if not name:
        return None
    public_id, package = public_source(name)
    return BaseModelSource(
        id=loadable_name(name),
        public_id=public_id,
        package=package,
        num_layers=getattr(config, "num_hidden_layers", None),
        description=f"{public_id or name} ({type(base).__name__})",
    )


def privacy_report(
    plan: PrivacyPlan,
    ledger: PrivacyLedger,
    *,
    steps_taken: int,
    seeded: bool,
    base_model: BaseModelSource | None = None,
) -> dict[str, Any]:
    """The report of a run so far: the guarantee of the steps in ``ledger`` and the plan,
    as a privacy record (:meth:`dptrain.privacy_record.PrivacyRecord.to_dict`).

    ``seeded``: whether the sampling and noise seed was given (else drawn from the OS). The
    seed itself is never written: whoever knows it can subtract the noise. ``base_model``:
    the public model fine-tuned (:func:`base_model_of`), which the guarantee does not cover.
    """
    epsilon = (
        make_accountant(plan.accountant, ledger).epsilon(plan.target_delta)
        if ledger.num_steps
        else 0.0
    )
    unit = plan.privacy_unit
    record = PrivacyRecord(
        private=True,
        statement=(
            f"({epsilon:.4g}, {plan.target_delta:.3g})-DP for the fine-tuning data at the "
            f"{unit} level ({plan.accountant} accountant)"
        ),
        privacy_unit=unit,
        producer="dptrain.hf.DPTrainer",
        epsilon=epsilon,
        delta=plan.target_delta,
        accountant=plan.accountant,
        epsilon_by_accountant={plan.accountant: epsilon},
        neighbouring=(
            f"training sets that differ by adding or removing one {unit} "
            + ("(all of that user's records)" if plan.num_units != plan.num_records else "")
        ).strip(),
        covers=[
            "the trained weights and everything computed from them alone (outputs, "
            "generations), as released after the steps in the ledger"
        ],
        not_covered=list(NOT_COVERED),
        training={
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
        base_model=base_model,
        ledger=ledger.state_dict(),
    )
    return record.to_dict()


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
        f"Covered: {'; '.join(g['covers'])}.\n\nNot covered:\n\n{not_covered}\n\n"
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
    PrivacyRecord.from_dict(report).write(folder)
    card = folder / "README.md"
    existing = card.read_text(encoding="utf-8") if card.is_file() else ""
    card.write_text(_merge_card(existing, model_card_section(report)), encoding="utf-8")
