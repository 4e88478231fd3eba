"""Recipes: flat scripts (setup / train / evaluate / save) configured by a dataclass + YAML.

- :mod:`dptrain.recipes.seqrec`: one private sequential recommender (``dptrain train seqrec``).
- :mod:`dptrain.recipes.dpformer_experiment`: the DPFormer Table 1 grid
  (``dptrain experiment dpformer``; ``dptrain demo`` runs a short version).
- :mod:`dptrain.recipes.classify`: private text classification, five methods
  (``dptrain train classify``).
- :mod:`dptrain.recipes.dpfp_experiment`: DP-FP against DP-SGD and non-private
  training (``dptrain experiment dpfp``).
- :mod:`dptrain.recipes.table2text`: a GPT-2-style table-to-text model on E2E,
  BLEU / ROUGE-L of greedy and beam decoding (``dptrain train table2text``);
  :mod:`dptrain.recipes.table2text_study`: Li et al.'s batch size x learning
  rate heat map (``dptrain study e2e-heatmap``).
- :mod:`dptrain.recipes.mlm`: BERT-style masked-LM pretraining with Poisson
  mega-batches, a growing batch size and gradient-SNR (``dptrain train mlm``);
  :mod:`dptrain.recipes.mlm_studies`: Anil et al.'s studies (``dptrain study
  snr | batch-schedule | weight-decay``).
- :mod:`dptrain.recipes.lm_finetune`: DP fine-tuning of a pretrained causal LM
  (the packaged SmolLM2 or a local folder; LoRA or full, record- or user-level)
  on the user's records (``dptrain train lm``).
- :mod:`dptrain.recipes.generate`: DP synthetic text from a ``train lm`` model
  (``dptrain generate``; the guarantee carries over by post-processing).
- :mod:`dptrain.recipes.exposure`: canary exposure, private vs non-private
  (``dptrain audit exposure``).
- :mod:`dptrain.recipes.audit_one_run`: the one-run privacy audit
  (``dptrain audit one-run``); :mod:`dptrain.recipes.audit_mia`: membership
  inference (LiRA) on shadow linear probes (``dptrain audit mia``).

The YAML files in ``configs/`` are the packaged settings (:func:`configs_dir`); a
command's ``--config`` takes one by name (``--config lm``), see :func:`resolve_config`.
"""

import importlib.resources
from pathlib import Path

__all__ = ["configs_dir", "packaged_configs", "resolve_config"]


def configs_dir() -> Path:
    """The folder of the packaged recipe configs (``seqrec.yaml``, ``classify.yaml``, ...)."""
    return Path(__file__).parent / "configs"


def packaged_configs() -> list[str]:
    """Names of the packaged configs (``lm``, ``seqrec``, ...), which ``--config`` accepts."""
    root = importlib.resources.files(__package__) / "configs"
    return sorted(p.name.removesuffix(".yaml") for p in root.iterdir() if p.name.endswith(".yaml"))


def resolve_config(name_or_path: str | Path) -> Path:
    """The YAML file that ``--config name_or_path`` means.

    An existing file wins (a user's ``lm.yaml`` in the working folder is theirs); else a
    packaged config's name, with or without ``.yaml`` (``lm``, ``dpfp_experiment.yaml``),
    read through :mod:`importlib.resources` so it works from an installed wheel, not only
    from a source checkout. Anything else is a ``ValueError`` that lists the names.
    """
    path = Path(name_or_path)
    if path.is_file():
        return path
    name = str(name_or_path).removesuffix(".yaml")
    if name in packaged_configs():
        packaged = importlib.resources.files(__package__) / "configs" / f"{name}.yaml"
        return Path(str(packaged))
    raise ValueError(
        f"--config={str(name_or_path)!r} is not allowed: no such file, and not a packaged "
        f"config; expected a YAML file or one of {packaged_configs()}"
    )
