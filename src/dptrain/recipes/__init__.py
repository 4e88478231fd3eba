"""Recipes: flat scripts (setup / train / evaluate / save) configured by a dataclass + YAML.

- :mod:`dptrain.recipes.seqrec`: one private sequential recommender (``dptrain train seqrec``).
- :mod:`dptrain.recipes.dpformer_experiment`: the DPFormer Table 1 grid
  (``dptrain experiment dpformer``; ``dptrain demo`` runs a short version).
- :mod:`dptrain.recipes.classify`: private text classification, five methods
  (``dptrain train classify``).
- :mod:`dptrain.recipes.dpfp_experiment`: DP-FP against DP-SGD and non-private
  training (``dptrain experiment dpfp``).

The YAML files in ``configs/`` are the packaged settings (:func:`configs_dir`).
"""

from pathlib import Path

__all__ = ["configs_dir"]


def configs_dir() -> Path:
    """The folder of the packaged recipe configs (``seqrec.yaml``, ``classify.yaml``, ...)."""
    return Path(__file__).parent / "configs"
