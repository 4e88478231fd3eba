"""Loading a pretrained causal LM for a recipe, and adding LoRA adapters to it.

Shared by ``train lm`` and ``train table2text``: the checks that turn a wrong
``model=`` folder or ``lora_targets=`` into an error naming the setting before
anything trains.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from dptrain.models.pretrained import SMOLLM2, load_pretrained_lm

#: The seven linear projections of a Llama block (attention and MLP): LoRA's default targets.
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _causal_architectures() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _architectures(config: Path) -> list[str]:
    return json.loads(config.read_text()).get("architectures") or []


def is_causal_lm(name: str) -> bool:
    """Whether ``name`` is the packaged SmolLM2 or a folder whose config.json names a
    causal-LM architecture (False for anything else, a missing folder included)."""
    if name == SMOLLM2:
        return True
    config = Path(name).expanduser() / "config.json"
    return config.is_file() and bool(_causal_architectures().intersection(_architectures(config)))


def check_model_folder(name: str, setting: str = "model") -> None:
    """Refuse, from its config.json alone, a folder that holds no causal LM."""
    if name == SMOLLM2:
        return
    folder = Path(name).expanduser()
    allowed = f"{SMOLLM2!r} or a local Hugging Face causal-LM folder (save_pretrained layout)"
    if not folder.is_dir():
        raise ValueError(f"{setting}={name!r} is not allowed: no such folder; expected {allowed}")
    config = folder / "config.json"
    if not config.is_file():
        raise ValueError(
            f"{setting}={name!r} is not allowed: it has no config.json; expected {allowed}"
        )
    architectures = _architectures(config)
    if architectures and not _causal_architectures().intersection(architectures):
        raise ValueError(
            f"{setting}={name!r} is not allowed: its config.json names {architectures}, no "
            f"causal language model (e.g. LlamaForCausalLM, GPT2LMHeadModel); expected {allowed}"
        )


def load_causal_lm(
    name: str,
    *,
    num_layers: int | None,
    max_length: int,
    setting: str = "model",
    length_setting: str = "max_length",
) -> tuple[nn.Module, Any]:
    """The pretrained model and its tokenizer; loading problems as errors naming ``setting``."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # one bar per run: the training one
    check_model_folder(name, setting)
    try:
        model, tokenizer = load_pretrained_lm(name, num_layers=num_layers)
    except ImportError as err:
        raise ValueError(f"{setting}={name!r} cannot be loaded here: {err}") from None
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(
            f"{setting}={name!r} is not allowed: it did not load as a causal LM with its "
            f"tokenizer ({err})"
        ) from None
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max_length > limit:
        raise ValueError(
            f"{length_setting}={max_length} is not allowed with {setting}={name!r}: expected at "
            f"most its max_position_embeddings={limit}"
        )
    return model, tokenizer


def add_lora(model: nn.Module, *, r: int, alpha: float, targets: Sequence[str]) -> nn.Module:
    """LoRA adapters (rank ``r``) on the linear modules named ``targets``, the base frozen,
    after checking that each target names a linear module (peft itself would skip a
    missing one)."""
    import peft
    from transformers.pytorch_utils import Conv1D

    kinds: dict[str, type] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | Conv1D):
            kinds.setdefault(name.rsplit(".", 1)[-1], type(module))
    missing = [t for t in targets if t not in kinds]
    if missing:
        raise ValueError(
            f"lora_targets={list(targets)} is not allowed for {type(model).__name__}: it has "
            f"no linear module named {missing}; its linear modules are {sorted(kinds)}"
        )
    config = peft.LoraConfig(
        r=r,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=list(targets),
        # GPT-2's Conv1D stores its weight as (in, out)
        fan_in_fan_out=any(kinds[t] is Conv1D for t in targets),
    )
    with warnings.catch_warnings():  # transformers 5 deprecates what peft 0.21 asks
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated")
        return peft.get_peft_model(model, config)


def stop_and_pad_ids(model: nn.Module, tokenizer: Any) -> tuple[list[int], int]:
    """The ids generation stops at (the tokenizer's end-of-sequence and the model's
    generation config's) and the id it pads finished rows with."""
    stops = {tokenizer.eos_token_id}
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    stops.update(configured if isinstance(configured, list) else [configured])
    stops.discard(None)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(stops, default=0)
    return sorted(stops), pad
