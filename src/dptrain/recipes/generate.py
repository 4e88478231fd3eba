"""Recipe: DP synthetic text from a model ``dptrain train lm`` trained.

``dptrain generate model=FOLDER n=N [prompt=...] [labels=a,b] [key=value ...]``:

1. **setup**: check the settings; read the model folder's privacy record
   (``privacy.json``, :mod:`dptrain.privacy_record`: written by ``train lm`` or by
   ``DPTrainer.save_model``, any version; a folder without one is refused: the
   synthetic records' guarantee is the model's, so it must be known); load the
   model: a full model folder as it is, a LoRA adapter onto the base model the
   record names (else the adapter config's ``base_model_name_or_path``), merged
   for speed. Bad input stops here.
2. **generate**: ``n`` records by sampling (``temperature``, ``top_p``,
   ``top_k``), each from ``prompt`` tokenized as training tokenized a record's
   prompt (:func:`dptrain.data.lm_records.prompt_ids`: the tokenizer's leading
   special tokens, then the prompt; an empty prompt for text records), or with
   ``chat=true`` as one user turn of the chat template with the assistant turn
   opened. With ``labels``, record k gets label ``labels[k % len(labels)]``,
   put into the prompt where it says ``{label}`` (label-conditioned records,
   e.g. a sentiment classifier's training set). Sampling is seeded
   (``seed``): the same settings give the same records.
3. **save**: ``synthetic.jsonl`` (one ``{"text": ..., "label": ...}`` per
   record: the columns ``train classify`` reads), ``privacy.json`` (the model's
   privacy record, carried over to the records) and ``report.json``: the
   guarantee, the model's privacy record, the settings, tokens/s.

``model=smollm2-135m-instruct`` samples the packaged public model as it is
(e.g. with ``chat=true`` and an instruction as the prompt): the reference a DP
fine-tune has to beat, at epsilon 0 since it reads no private record.

The guarantee carries over by post-processing (Dwork & Roth 2014, Prop. 2.1):
generation reads the released weights and nothing of the training data, so the
synthetic records are (epsilon, delta)-DP for the model's training data at the
model's privacy unit, with nothing more spent however many are drawn. What the
model's ``privacy.json`` does not cover (the base model, the prompts written
here) the synthetic text does not cover either.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from dptrain import privacy_record
from dptrain._checks import check_int, check_positive
from dptrain.config import save_config
from dptrain.models.pretrained import SMOLLM2, load_pretrained_lm, loadable_name, public_source
from dptrain.privacy_record import BaseModelSource, PrivacyRecord
from dptrain.recipes._causal_lm import stop_and_pad_ids

__all__ = ["GenerateConfig", "generate_records", "load_generator", "run_generate"]


@dataclass
class GenerateConfig:
    """Settings of one generation run; every field can be set in YAML or as ``key=value``."""

    model: str | None = None
    """A model folder written by ``dptrain train lm`` (``<run>/model``) or by
    ``DPTrainer.save_model`` (full weights or a LoRA adapter, with ``privacy.json``), or ``smollm2-135m-instruct``: the packaged
    public model as it is (a reference that reads no private data). Required."""
    n: int = 100
    """Records to generate."""
    prompt: str = ""
    """What every record starts from, as the training records' prompts were written
    (``""``: unconditional, for text records); ``{label}`` is replaced by the label."""
    labels: tuple[str, ...] = ()
    """Labels to condition on, in turn (record k gets ``labels[k % len(labels)]``);
    empty: no labels. Needs ``{label}`` in ``prompt``."""
    chat: bool = False
    """Render ``prompt`` as one user turn of the tokenizer's chat template (for a model
    trained on chat records)."""
    system_prompt: str = "default"
    """With ``chat``: the system turn, as ``train lm``'s ``system_prompt`` (give the value
    the model was trained with): ``default``, ``none`` or a text."""
    temperature: float = 1.0
    """Sampling temperature (lower: more likely tokens)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens with this much probability."""
    top_k: int = 0
    """Keep only the k most likely tokens (0: all)."""
    max_new_tokens: int = 128
    """Most tokens per generated record."""
    batch_size: int = 16
    """Records generated at once."""
    seed: int = 0
    """Seed of the sampling (generation is post-processing: it costs no privacy)."""
    device: str = "cpu"
    """Where the model runs: ``cpu``, ``cuda`` or ``cuda:N``."""
    out: str = "runs/generate"
    """Folder for synthetic.jsonl and report.json."""
    progress: bool = True
    """Show a progress bar on stderr."""

    def __post_init__(self) -> None:
        if self.model is None:
            raise ValueError("model is required: a model folder written by `dptrain train lm`")
        folder = Path(self.model).expanduser()
        if self.model == SMOLLM2:
            pass  # the public pretrained model: nothing private to account for
        elif not folder.is_dir():
            raise ValueError(f"model={self.model!r} is not allowed: no such folder")
        elif not (folder / "privacy.json").is_file():
            raise ValueError(
                f"model={self.model!r} is not allowed: it has no privacy.json, so the "
                "guarantee of what it generates is unknown; expected a model folder written "
                "by `dptrain train lm` (save_model=true) or DPTrainer.save_model"
            )
        else:
            try:
                privacy_record.read(folder)
            except ValueError as err:
                raise ValueError(f"model={self.model!r} is not allowed: {err}") from None
        check_int("n", self.n, 1)
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_int("batch_size", self.batch_size, 1)
        check_int("top_k", self.top_k, 0)
        check_int("seed", self.seed, 0)
        check_positive("temperature", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p!r} is not allowed: expected 0 < top_p <= 1")
        self.labels = tuple(str(x) for x in self.labels)
        if self.labels and "{label}" not in self.prompt:
            raise ValueError(
                f"labels={list(self.labels)} is not allowed with prompt={self.prompt!r}: the "
                "prompt must say where the label goes, e.g. prompt='Write a {label} review:'"
            )
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"labels={list(self.labels)} is not allowed: a label is repeated")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(
                f"device={self.device!r} is not allowed: expected 'cpu', 'cuda' or 'cuda:N'"
            )


def _public_record() -> PrivacyRecord:
    public_id, package = public_source(SMOLLM2)
    return PrivacyRecord(
        private=True,
        statement=(
            f"no private data: the public pretrained model {SMOLLM2} as it is; its records "
            "depend on none of your records (epsilon 0 for them)"
        ),
        privacy_unit="example",
        producer="dptrain generate",
        epsilon=0.0,
        delta=0.0,
        neighbouring="any two data sets of yours: none is read",
        covers=["the generated records"],
        base_model=BaseModelSource(id=SMOLLM2, public_id=public_id, package=package),
    )


def _adapter_base(folder: Path, record: PrivacyRecord) -> tuple[str, int | None]:
    """(name load_pretrained_lm takes, decoder layers to keep) of an adapter's base model:
    the record's, else the adapter config's ``base_model_name_or_path`` (a DPTrainer record
    of version 1 names none)."""
    base = record.base_model
    if base is not None and (base.id or base.public_id):
        return loadable_name(base.id or base.public_id), base.num_layers
    named = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not named:
        raise ValueError(
            f"model={str(folder)!r} is not allowed: it is a LoRA adapter and neither its "
            "privacy.json nor its adapter_config.json names the base model"
        )
    return loadable_name(named), None


def _load_base(name: str, num_layers: int | None, folder: Path) -> tuple[Any, Any]:
    try:
        base, tokenizer = load_pretrained_lm(name)
        # A record of DPTrainer gives the base's layer count; cut only a base that has more.
        layers = getattr(base.config, "num_hidden_layers", None)
        if num_layers is not None and layers is not None and num_layers < layers:
            base, tokenizer = load_pretrained_lm(name, num_layers=num_layers)
    except (ValueError, ImportError) as err:
        raise ValueError(
            f"model={str(folder)!r} is not allowed: its base model {name!r} cannot be "
            f"loaded here ({err})"
        ) from None
    return base, tokenizer


def load_generator(folder: str | Path) -> tuple[Any, Any, PrivacyRecord]:
    """(model in eval mode, tokenizer, privacy record) of a model folder written by
    ``dptrain train lm`` or ``DPTrainer.save_model`` (full weights or a LoRA adapter)."""
    from transformers import AutoTokenizer

    if str(folder) == SMOLLM2:
        model, tokenizer = load_pretrained_lm(SMOLLM2)
        return model.eval(), tokenizer, _public_record()
    folder = Path(folder).expanduser()
    record = privacy_record.read(folder)
    base_tokenizer = None
    if (folder / "adapter_config.json").is_file():
        import peft

        name, num_layers = _adapter_base(folder, record)
        base, base_tokenizer = _load_base(name, num_layers, folder)
        model = peft.PeftModel.from_pretrained(base, folder).merge_and_unload()
    elif (folder / "config.json").is_file():
        model, _ = load_pretrained_lm(folder)
    else:
        raise ValueError(
            f"model={str(folder)!r} is not allowed: it holds neither weights (config.json) "
            "nor a LoRA adapter (adapter_config.json)"
        )
    if any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    elif base_tokenizer is not None:  # an adapter saved without its tokenizer: the base's
        tokenizer = base_tokenizer
    else:
        raise ValueError(
            f"model={str(folder)!r} is not allowed: it has no tokenizer; save it with the "
            "weights (DPTrainer(processing_class=tokenizer) or tokenizer.save_pretrained)"
        )
    return model.eval(), tokenizer, record


def _prompt_ids(
    tokenizer: Any, prompt: str, chat: bool, system_prompt: str = "default"
) -> list[int]:
    from dptrain.data.lm_records import prompt_ids, render_chat

    if not chat:
        return prompt_ids(tokenizer, prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat=true is not allowed: the model's tokenizer has no chat template")
    # Rendered as text, then tokenized without added special tokens: how `train lm`
    # tokenizes chat records (dptrain.data.lm_records), so the model sees the same ids.
    # (tokenize=True returns a BatchEncoding in transformers 5, not a list of ids.)
    text = render_chat(
        tokenizer,
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        system_prompt=system_prompt,
    )
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


@torch.no_grad()
def generate_records(model: Any, tokenizer: Any, cfg: GenerateConfig) -> list[dict[str, Any]]:
    """``cfg.n`` sampled records ``{"text", "label"}`` (label None without labels)."""
    labels: list[str | None] = list(cfg.labels) or [None]
    wanted = [labels[k % len(labels)] for k in range(cfg.n)]
    prompts = {
        label: _prompt_ids(
            tokenizer,
            cfg.prompt if label is None else cfg.prompt.replace("{label}", label),
            cfg.chat,
            cfg.system_prompt,
        )
        for label in labels
    }
    if any(not ids for ids in prompts.values()):
        raise ValueError(
            "prompt='' is not allowed with this tokenizer: it puts no token before a text, "
            "so there is nothing to generate from; give a prompt"
        )
    stops, pad = stop_and_pad_ids(model, tokenizer)
    device = next(model.parameters()).device
    torch.manual_seed(cfg.seed)
    texts: dict[int, str] = {}
    bar = tqdm(total=cfg.n, disable=not cfg.progress, desc="generate", unit="record")
    # Records of one label share their prompt: a batch of them needs no padding.
    for label in labels:
        rows = [k for k, w in enumerate(wanted) if w == label]
        for start in range(0, len(rows), cfg.batch_size):
            chunk = rows[start : start + cfg.batch_size]
            x = torch.tensor([prompts[label]] * len(chunk), dtype=torch.long, device=device)
            out = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                do_sample=True,
                temperature=cfg.temperature,
                top_p=cfg.top_p,
                top_k=cfg.top_k,
                max_new_tokens=cfg.max_new_tokens,
                eos_token_id=stops or None,
                pad_token_id=pad,
            )
            for k, row in zip(chunk, out[:, x.shape[1] :].tolist(), strict=True):
                cut = next((j for j, t in enumerate(row) if t in stops), len(row))
                texts[k] = tokenizer.decode(row[:cut], skip_special_tokens=True).strip()
            bar.update(len(chunk))
    bar.close()
    return [{"text": texts[k], "label": wanted[k]} for k in range(cfg.n)]


def _guarantee(record: PrivacyRecord) -> str:
    if record.producer == "dptrain generate":  # the public model: nothing private read
        return record.statement
    if not record.private:
        return "none: the model was trained without differential privacy"
    return (
        f"{record.statement}, carried over to the synthetic records by post-processing "
        "(Dwork & Roth 2014, Prop. 2.1): generation reads only the released weights, so "
        "any number of records costs no further privacy"
    )


def _records_record(record: PrivacyRecord, cfg: GenerateConfig) -> PrivacyRecord:
    """The synthetic records' privacy record: the model's guarantee, by post-processing."""
    if record.producer == "dptrain generate":
        return record
    return dataclasses.replace(
        record,
        statement=_guarantee(record),
        producer="dptrain generate",
        covers=[*record.covers, f"the {cfg.n} synthetic records generated from the model"],
        not_covered=[
            *record.not_covered,
            "the prompt and labels given to `dptrain generate` (written by you, public)",
        ],
        training={**record.training, "generated_from": str(cfg.model)},
    )


def run_generate(cfg: GenerateConfig) -> dict[str, Any]:
    """Run the recipe (module docstring); return the ``report.json`` content."""
    t0 = time.perf_counter()
    model, tokenizer, privacy = load_generator(cfg.model)
    model.to(cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    t_gen = time.perf_counter()
    records = generate_records(model, tokenizer, cfg)
    gen_s = time.perf_counter() - t_gen
    with (out / "synthetic.jsonl").open("w") as f:
        for r in records:
            f.write(json.dumps(r if cfg.labels else {"text": r["text"]}) + "\n")
    tokens = sum(len(tokenizer(r["text"], add_special_tokens=False)["input_ids"]) for r in records)
    carried = _records_record(privacy, cfg)
    carried.write(out)
    report: dict[str, Any] = {
        "model": str(cfg.model),
        "n": cfg.n,
        "labels": list(cfg.labels),
        "empty_records": sum(not r["text"] for r in records),
        "guarantee": carried.statement,
        "epsilon": privacy.epsilon if privacy.private else math.inf,
        "delta": privacy.delta if privacy.private else None,
        "privacy_unit": privacy.privacy_unit,
        "not_covered": carried.not_covered,
        "model_privacy": privacy.to_dict(),
        "sampling": {
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
            "max_new_tokens": cfg.max_new_tokens,
            "seed": cfg.seed,
        },
        "tokens_generated": tokens,
        "tokens_per_s": tokens / gen_s if gen_s > 0 else None,
        "wall_time_s": time.perf_counter() - t0,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    return report
