"""Recipe: DP synthetic text from a model ``dptrain train lm`` trained.

``dptrain generate model=FOLDER n=N [prompt=...] [labels=a,b] [key=value ...]``:

1. **setup**: check the settings; read the model folder's ``privacy.json`` (a
   folder without one is refused: the synthetic records' guarantee is the
   model's, so it must be known); load the model: a full model folder as it is,
   a LoRA adapter onto the base model ``privacy.json`` names (``base_model_id``,
   ``base_num_layers``), merged for speed. Bad input stops here.
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
   record: the columns ``train classify`` reads) and ``report.json``: the
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

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from dptrain._checks import check_int, check_positive
from dptrain.config import save_config
from dptrain.models.pretrained import SMOLLM2, load_pretrained_lm
from dptrain.recipes._causal_lm import stop_and_pad_ids

__all__ = ["GenerateConfig", "generate_records", "load_generator", "run_generate"]


@dataclass
class GenerateConfig:
    """Settings of one generation run; every field can be set in YAML or as ``key=value``."""

    model: str | None = None
    """A model folder written by ``dptrain train lm`` (``<run>/model``: full weights or
    a LoRA adapter, with ``privacy.json``), or ``smollm2-135m-instruct``: the packaged
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
                "by `dptrain train lm` (save_model=true)"
            )
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


def load_generator(folder: str | Path) -> tuple[Any, Any, dict[str, Any]]:
    """(model in eval mode, tokenizer, privacy record) of a ``dptrain train lm`` model folder."""
    from transformers import AutoTokenizer

    if str(folder) == SMOLLM2:
        model, tokenizer = load_pretrained_lm(SMOLLM2)
        return model.eval(), tokenizer, {"private": False, "public_model": SMOLLM2}
    folder = Path(folder).expanduser()
    privacy = json.loads((folder / "privacy.json").read_text())
    if (folder / "adapter_config.json").is_file():
        import peft

        base_id = privacy.get("base_model_id")
        if base_id is None:
            raise ValueError(
                f"model={str(folder)!r} is not allowed: it is a LoRA adapter and its "
                "privacy.json does not name the base model (base_model_id); retrain with "
                "this version of `dptrain train lm`"
            )
        base, _ = load_pretrained_lm(base_id, num_layers=privacy.get("base_num_layers"))
        model = peft.PeftModel.from_pretrained(base, folder).merge_and_unload()
    elif (folder / "config.json").is_file():
        model, _ = load_pretrained_lm(folder)
    else:
        raise ValueError(
            f"model={str(folder)!r} is not allowed: it holds neither weights (config.json) "
            "nor a LoRA adapter (adapter_config.json)"
        )
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.eval(), tokenizer, privacy


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


def _guarantee(privacy: dict[str, Any]) -> str:
    if privacy.get("public_model"):
        return (
            f"no private data: the public pretrained model {privacy['public_model']} as it is; "
            "its records depend on none of your records (epsilon 0 for them)"
        )
    if not privacy.get("private"):
        return "none: the model was trained without differential privacy"
    return (
        f"{privacy['guarantee']}, carried over to the synthetic records by post-processing "
        "(Dwork & Roth 2014, Prop. 2.1): generation reads only the released weights, so "
        "any number of records costs no further privacy"
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
    report: dict[str, Any] = {
        "model": str(cfg.model),
        "n": cfg.n,
        "labels": list(cfg.labels),
        "empty_records": sum(not r["text"] for r in records),
        "guarantee": _guarantee(privacy),
        "epsilon": (
            0.0
            if privacy.get("public_model")
            else privacy.get("epsilon")
            if privacy.get("private")
            else math.inf
        ),
        "delta": 0.0 if privacy.get("public_model") else privacy.get("delta"),
        "privacy_unit": privacy.get("privacy_unit"),
        "not_covered": [
            *privacy.get("not_covered", []),
            "the prompt and labels given to `dptrain generate` (written by you, public)",
        ],
        "model_privacy": privacy,
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
