"""Hugging Face ``datasets.Dataset`` as a map-style dataset, without importing ``datasets``.

A ``datasets.Dataset`` has ``len()`` and ``[i]``, so Poisson sampling reads it like
any map-style dataset. In its default (python) format a row's sequence columns are
Python lists, and ``torch.utils.data.default_collate`` turns a list column into one
tensor *per position* (a transposed batch) instead of one (B, T) tensor; in the torch
format the rows hold tensors and collate as expected.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["is_hf_dataset", "with_torch_rows"]


def is_hf_dataset(dataset: Any) -> bool:
    """True for a ``datasets.Dataset`` (``datasets`` is only looked at when already imported:
    an object of its class cannot exist otherwise)."""
    module = sys.modules.get("datasets")
    return module is not None and isinstance(dataset, module.Dataset)


def with_torch_rows(dataset: Any) -> Any:
    """A python-formatted ``datasets.Dataset`` in torch format (rows of tensors); anything
    else unchanged. The caller's dataset is not modified (``with_format`` returns a view)."""
    if is_hf_dataset(dataset) and dataset.format["type"] is None:
        return dataset.with_format("torch")
    return dataset
