"""Recipe configuration: YAML + key=value overrides checked against the dataclass."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dptrain.config import (
    ConfigError,
    convert_values,
    load_config,
    parse_overrides,
    read_config_values,
    save_config,
    split_config_values,
)


@dataclass
class _Config:
    model: str = "dpformer"
    epochs: int = 10
    lr: float = 1e-3
    tie: bool = True
    epsilon: float | None = 8.0
    delta: float | str = "1/N^1.1"
    epsilons: tuple[float, ...] = (3.0, 8.0)


def test_defaults_yaml_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 20\nlr: 0.01\nmodel: gru\n")
    cfg = load_config(_Config, path, ["lr=3e-4", "tie=false", "epsilon=null", "epsilons=[5, 10]"])
    assert cfg == _Config(
        model="gru", epochs=20, lr=3e-4, tie=False, epsilon=None, epsilons=(5.0, 10.0)
    )


def test_saved_config_reloads_to_the_same_values(tmp_path):
    cfg = load_config(_Config, None, ["delta=1e-5", "epsilons=3,5,8"])
    assert cfg.delta == 1e-5 and cfg.epsilons == (3.0, 5.0, 8.0)
    save_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(_Config, tmp_path / "resolved.yaml") == cfg


def test_int_given_to_float_field_becomes_float():
    cfg = load_config(_Config, None, ["lr=1", "epsilon=3"])
    assert isinstance(cfg.lr, float) and isinstance(cfg.epsilon, float)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("lrr=0.1", "unknown config key(s) ['lrr'] for _Config: allowed keys are"),
        ("epochs=2.5", "epochs=2.5 is not allowed: expected an integer"),
        ("tie=maybe", "tie='maybe' is not allowed: expected true/false"),
        ("lr=fast", "lr='fast' is not allowed: expected a number"),
        ("epsilon=high", "epsilon='high' is not allowed: expected a number or null"),
        ("epochs", "override 'epochs' is not allowed: expected key=value"),
        ("epsilons=[a]", "epsilons='a' is not allowed: expected a number"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(_Config, None, [override])
    assert message in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(_Config, tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(_Config, tmp_path / "list.yaml")


def test_parse_overrides_reads_yaml_scalars():
    assert parse_overrides(["a=1", "b=x", "c=", "d=[1, 2]"]) == {
        "a": 1,
        "b": "x",
        "c": "",
        "d": [1, 2],
    }


def test_a_single_number_for_a_list_field_is_a_one_element_list():
    assert load_config(_Config, None, ["epsilons=3"]).epsilons == (3.0,)


def test_convert_values_checks_without_constructing():
    assert convert_values(_Config, {"lr": 1, "epsilons": "3,8"}) == {
        "lr": 1.0,
        "epsilons": (3.0, 8.0),
    }
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['lrr'\]"):
        convert_values(_Config, {"lrr": 1})
    with pytest.raises(ConfigError, match="lr='fast' is not allowed"):
        convert_values(_Config, {"lr": "fast"})


def test_read_config_values_applies_overrides_over_the_file(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("epochs: 20\nlr: 0.01\n")
    assert read_config_values(path, ["lr=0.5", "seeds=[1, 2]"]) == {
        "epochs": 20,
        "lr": 0.5,
        "seeds": [1, 2],
    }
    assert read_config_values(None, ["lr=1"]) == {"lr": 1}
    with pytest.raises(ConfigError, match="does not exist"):
        read_config_values(tmp_path / "missing.yaml")


def test_split_config_values_gives_shared_keys_to_the_grid():
    values = {"epsilons": [3, 8], "lr": 0.1, "seed": 4}
    grid, train = split_config_values(values, {"epsilons", "seed"}, {"lr", "seed", "epochs"})
    assert grid == {"epsilons": [3, 8], "seed": 4}
    assert train == {"lr": 0.1}


def test_split_config_values_names_unknown_keys_and_both_allowed_sets():
    with pytest.raises(ConfigError) as err:
        split_config_values(
            {"lrr": 1, "epsilons": 3},
            {"epsilons"},
            {"lr", "batch_size"},
            grid_label="the studies'",
            train_shown={"lr"},
        )
    assert str(err.value) == (
        "unknown config key(s) ['lrr']: allowed keys are the studies' ['epsilons'] "
        "and the training config's ['lr']"
    )


def test_overrides_keep_prompts_with_colons_and_braces_as_text():
    from dptrain.config import parse_overrides

    got = parse_overrides(
        ["prompt=Review:", "p=Write a {label} review:", "m={a: 1}", "lr=1e-3", "t=[a, b]"]
    )
    assert got["prompt"] == "Review:"
    assert got["p"] == "Write a {label} review:"
    assert got["m"] == {"a": 1} and got["t"] == ["a", "b"]


def test_yaml_words_off_and_on_stay_words_for_string_fields(tmp_path):
    # YAML 1.1 reads off/on/yes/no as booleans: amp=off would reach a str field as False.
    cfg = load_config(_Config, None, ["model=off", "tie=no"])
    assert cfg.model == "off" and cfg.tie is False
    assert load_config(_Config, None, ["tie=On"]).tie is True
    assert load_config(_Config, None, ["tie=false"]).tie is False
    path = tmp_path / "c.yaml"
    path.write_text("model: off\n")  # unquoted in a file: named, with the fix
    with pytest.raises(ConfigError, match=r"model=False is not allowed: .*quote the word"):
        load_config(_Config, path)


def test_field_help_reads_attribute_docstrings_and_metadata():
    import dataclasses

    from dptrain.config import field_help, format_config_help

    @dataclass
    class Documented:
        lr: float = 1e-3
        """Learning rate
        of the optimizer."""
        seed: int = dataclasses.field(default=0, metadata={"help": "Fixes the noise."})
        quiet: bool = False

    assert field_help(Documented) == {
        "lr": "Learning rate of the optimizer.",
        "seed": "Fixes the noise.",
    }
    text = format_config_help(Documented)
    assert "  lr: float = 0.001\n      Learning rate of the optimizer." in text
    assert "  quiet: bool = false\n      (undocumented)" in text


def _recipe_configs():
    import importlib

    names = {
        "seqrec": "SeqRecTrainConfig",
        "classify": "ClassifyTrainConfig",
        "table2text": "Table2TextConfig",
        "mlm": "MLMTrainConfig",
        "lm_finetune": "LMFinetuneConfig",
        "generate": "GenerateConfig",
        "audit_mia": "MIAAuditConfig",
        "audit_one_run": "OneRunAuditConfig",
        "exposure": "ExposureAuditConfig",
        "demo": "DemoConfig",
        "dpformer_experiment": "DPFormerExperimentConfig",
        "dpfp_experiment": "DPFPExperimentConfig",
        "mlm_studies": "MLMStudyConfig",
        "table2text_study": "Table2TextStudyConfig",
    }
    return [getattr(importlib.import_module(f"dptrain.recipes.{m}"), c) for m, c in names.items()]


@pytest.mark.parametrize("cls", _recipe_configs(), ids=lambda c: c.__name__)
def test_every_field_of_every_recipe_config_has_a_help_line(cls):
    import dataclasses

    from dptrain.config import field_help

    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    undocumented = sorted(set(fields) - set(field_help(cls)))
    assert not undocumented, f"{cls.__name__}: no docstring or metadata help for {undocumented}"
