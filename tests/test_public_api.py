"""Every name a public module lists in __all__ imports and is documented."""

import importlib
import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def _public_modules() -> list[str]:
    """Every module of the package that declares ``__all__``, but private ones (a part of
    its dotted name starting with ``_``): a module added later is tested without a list
    to remember it in."""
    names = []
    for path in sorted((SRC / "dptrain").rglob("*.py")):
        if not re.search(r"^__all__\b", path.read_text(), re.MULTILINE):
            continue
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not any(part.startswith("_") for part in parts):
            names.append(".".join(parts))
    return names


MODULES = _public_modules()


def test_the_public_modules_are_found():
    assert {"dptrain", "dptrain.clipping", "dptrain.optim", "dptrain.noise"} <= set(MODULES)
    assert len(MODULES) > 80


@pytest.mark.parametrize("module_name", MODULES)
def test_all_names_import(module_name):
    module = importlib.import_module(module_name)
    assert module.__all__, f"{module_name} has an empty __all__"
    for name in module.__all__:
        obj = getattr(module, name)
        if callable(obj) and not isinstance(obj, type(importlib)):
            assert obj.__doc__ or name.isupper(), f"{module_name}.{name} has no docstring"
