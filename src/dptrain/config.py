"""Recipe configuration: a dataclass, a YAML file and ``key=value`` overrides.

A recipe declares its settings as a dataclass with defaults (torchtune style).
:func:`load_config` fills it from an optional YAML mapping, then from
command-line overrides ``key=value``; every key is checked against the
dataclass fields and every value against the field's type, so a typo or a
wrong type is an error that names the key, never a silently ignored setting.

Values are parsed as YAML scalars (``lr=3e-4``, ``tie=false``,
``epsilons=[3, 8]`` or ``epsilons=3,8``, ``epsilon=null``) and then converted
to the field type.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import textwrap
import types
import typing
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

__all__ = [
    "ConfigError",
    "config_to_dict",
    "convert_values",
    "field_help",
    "format_config_help",
    "load_config",
    "parse_overrides",
    "read_config_values",
    "read_yaml_mapping",
    "save_config",
    "split_config_values",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration key or value that the recipe cannot use."""


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["lr=1e-3", "model=gru"]`` -> ``{"lr": 0.001, "model": "gru"}`` (YAML scalars)."""
    out: dict[str, Any] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not allowed: expected key=value")
        text = raw.strip()
        try:
            value = yaml.safe_load(raw) if text else ""
        except yaml.YAMLError:
            value = raw  # "Review: {x}" is a prompt, not broken YAML
        # A prompt such as "Review:" reads as a one-key mapping in YAML; a mapping is only
        # meant when written as one ({a: 1}) and a list when written [a, b].
        if isinstance(value, dict) and not text.startswith("{"):
            value = raw
        # YAML 1.1 reads on/off/yes/no as booleans: amp=off is the word "off" (a bool
        # field takes these words too, see _convert)
        if isinstance(value, bool) and text.lower() not in ("true", "false"):
            value = text
        out[key] = value
    return out


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The ``key: value`` mapping of the YAML file ``path`` (an empty file is ``{}``)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    loaded = yaml.safe_load(path.read_text()) or {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of key: value")
    return loaded


def read_config_values(
    path: str | Path | None = None, overrides: Sequence[str] = ()
) -> dict[str, Any]:
    """The YAML file's mapping (if ``path`` is given), updated by ``key=value`` overrides."""
    values: dict[str, Any] = read_yaml_mapping(path) if path is not None else {}
    values.update(parse_overrides(overrides))
    return values


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """An instance of dataclass ``cls`` from defaults, the YAML file ``path``, then ``overrides``."""
    return cls(**convert_values(cls, read_config_values(path, overrides)))


def split_config_values(
    values: dict[str, Any],
    grid_fields: Collection[str],
    train_fields: Collection[str],
    *,
    grid_label: str = "the grid's",
    train_shown: Collection[str] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(grid values, training values): a study's flat config split between its grid
    and the training settings every run shares. A key of both belongs to the grid.

    Unknown keys are a :class:`ConfigError` that lists the allowed keys of both
    (``train_shown``, default ``train_fields``, is the training list the message shows).
    """
    grid_fields, train_fields = set(grid_fields), set(train_fields)
    unknown = sorted(set(values) - grid_fields - train_fields)
    if unknown:
        shown = train_fields if train_shown is None else set(train_shown)
        raise ConfigError(
            f"unknown config key(s) {unknown}: allowed keys are {grid_label} "
            f"{sorted(grid_fields)} and the training config's {sorted(shown)}"
        )
    grid = {k: v for k, v in values.items() if k in grid_fields}
    train = {k: v for k, v in values.items() if k not in grid_fields}
    return grid, train


def convert_values(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """``values`` checked against dataclass ``cls``'s fields and converted to their types.

    Unknown keys and wrong types are a :class:`ConfigError` naming the key. The
    dataclass is not constructed (an experiment keeps training values as given
    and builds one config per run).
    """
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(
            f"unknown config key(s) {unknown} for {cls.__name__}: allowed keys are {sorted(fields)}"
        )
    return {k: _convert(k, v, hints[k]) for k, v in values.items()}


def config_to_dict(config: Any) -> dict[str, Any]:
    """The dataclass as plain YAML/JSON-ready values (tuples become lists)."""
    return {
        k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(config).items()
    }


def save_config(config: Any, path: str | Path) -> None:
    """Write the resolved configuration as YAML (it reloads with :func:`load_config`)."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))


def _convert(key: str, value: Any, hint: Any) -> Any:
    """``value`` as type ``hint``, or a ConfigError naming ``key``."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and type(None) in options:
            return None
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(key, value, option)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r} is not allowed: expected {_describe(hint)}") from None
    if origin in (tuple, list):
        if isinstance(value, str):
            value = [v for v in (s.strip() for s in value.split(",")) if v]
            value = [yaml.safe_load(v) for v in value]
        elif isinstance(value, int | float) and not isinstance(value, bool):
            value = [value]  # epsilons=3: a one-element list
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{key}={value!r} is not allowed: expected {_describe(hint)}")
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis} or {Any}
        items = [_convert(key, v, item) for v in value]
        return tuple(items) if origin is tuple else items
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _YAML_WORDS:
            return _YAML_WORDS[value.lower()]
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
    elif hint is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)  # e.g. a data name that YAML read as a number
        if isinstance(value, bool):  # an unquoted off/on/yes/no in a YAML file
            raise ConfigError(
                f"{key}={value!r} is not allowed: expected a string (YAML reads unquoted "
                f'off/on/yes/no as false/true: quote the word, e.g. {key}: "off")'
            )
    raise ConfigError(f"{key}={value!r} is not allowed: expected {_describe(hint)}")


def field_help(cls: type) -> dict[str, str]:
    """One line of meaning for each settable field of dataclass ``cls``.

    The line is the field's ``metadata["help"]`` or else its attribute docstring (the
    string literal right below the field in the class body, PEP 257's "attribute
    docstrings" as Sphinx reads them), whitespace collapsed: help and source
    documentation are the same text, so they cannot drift apart. Base classes are read
    too; a field without either has no entry (tests/test_config.py asserts that every
    recipe config documents every field).
    """
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in itertools.pairwise(body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = " ".join(after.value.value.split())
    out = {}
    for f in dataclasses.fields(cls):
        text = f.metadata.get("help") or docs.get(f.name)
        if f.init and text:
            out[f.name] = text
    return out


def format_config_help(cls: type, *, skip: Collection[str] = (), width: int = 88) -> str:
    """``cls``'s settings as ``--help`` text: each key with its type, default and meaning.

    ``skip`` names fields left out (e.g. a nested ``train`` mapping described apart).
    """
    meaning = field_help(cls)
    lines = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name in skip:
            continue
        lines.append(f"  {f.name}: {_type_name(f.type)} = {_show_default(f)}")
        text = meaning.get(f.name, "(undocumented)").replace("``", "")
        lines += textwrap.wrap(
            text, width, initial_indent=" " * 6, subsequent_indent=" " * 6, break_on_hyphens=False
        )
    return "\n".join(lines)


def _type_name(hint: Any) -> str:
    # with postponed annotations the field's type is the source text, e.g. "float | None"
    return hint if isinstance(hint, str) else getattr(hint, "__name__", str(hint))


def _show_default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "{...}"
    if isinstance(value, tuple):
        value = list(value)
    # shown as it is written in YAML or key=value (null, true, [3, 8]), not Python's repr
    return (
        yaml.safe_dump(value, default_flow_style=True, width=10_000)
        .strip()
        .removesuffix("\n...")
        .removesuffix(" ...")
        .removesuffix("...")
        .strip()
    )


#: The YAML 1.1 words for true and false, which a ``key=value`` override keeps as text.
_YAML_WORDS = {"yes": True, "y": True, "on": True, "no": False, "n": False, "off": False}


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(hint))
    if origin in (tuple, list):
        (item,) = {a for a in typing.get_args(hint) if a is not Ellipsis} or {Any}
        return f"a list of {_describe(item)}"
    if hint is type(None):
        return "null"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )
