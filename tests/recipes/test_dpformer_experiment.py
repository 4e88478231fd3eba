"""The DPFormer experiment grid on a tiny interaction file: table, summary, plot; config splitting."""

from __future__ import annotations

import json

import pytest

from dptrain.cli import main
from dptrain.config import ConfigError
from dptrain.recipes import configs_dir
from dptrain.recipes.dpformer_experiment import (
    DPFormerExperimentConfig,
    load_experiment_config,
    run_dpformer_experiment,
)
from tests.recipes.test_seqrec import _interactions


# about 30 s (12 runs); in the default run the grid machinery is the tiny DP-FP grid's
# (tests/recipes/test_dpfp_experiment.py) and this experiment's CLI is test_cli_train_and_bad_key
@pytest.mark.slow
def test_grid_writes_table_summary_and_plot(tmp_path):
    data = _interactions(tmp_path / "inter.csv")
    cfg = load_experiment_config(
        None,
        [
            "models=[transformer, dpformer]",
            "epsilons=[8]",
            "seeds=2",
            f"out={tmp_path / 'exp'}",
            f"data={data}",
            "max_len=6",
            "epochs=1",
            "batch_size=16",
            "d_model=8",
        ],
    )
    summary = run_dpformer_experiment(cfg, command="test")
    out = tmp_path / "exp"
    # 2 models x (eps 8 + non-private) x 2 seeds, + most-popular x 2 columns x 2 seeds
    assert len(summary["runs"]) == 12
    assert json.loads((out / "summary.json").read_text())["command"] == "test"
    table = (out / "table.md").read_text()
    assert "| model | ε = 8 | non-private |" in table
    for row in ("| Vanilla Transformer |", "| DPFormer |", "| Most popular |"):
        assert row in table
    assert "Relative improvement (DPFormer vs vanilla)" in table
    assert " ± " in table  # two seeds: mean ± std
    assert (out / "ndcg_vs_epsilon.png").stat().st_size > 0
    assert (out / "dpformer" / "eps8" / "seed1" / "results.json").is_file()


def test_config_keys_are_split_between_grid_and_training():
    cfg = load_experiment_config(None, ["seeds=3", "lr=0.01", "epsilons=3,5"])
    assert cfg.seeds == 3 and cfg.epsilons == (3.0, 5.0) and cfg.train.lr == 0.01
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['seedz'\]"):
        load_experiment_config(None, ["seedz=3"])
    with pytest.raises(ValueError, match=r"models=.*is not allowed"):
        DPFormerExperimentConfig(models=("bert",))


@pytest.mark.parametrize("name", ["dpformer_demo.yaml", "dpformer_experiment.yaml"])
def test_packaged_experiment_configs_load(name):
    cfg = load_experiment_config(configs_dir() / name)
    assert "dpformer" in cfg.models and cfg.train.data == "ml-100k"


def test_cli_train_and_bad_key(tmp_path, capsys):
    data = _interactions(tmp_path / "inter.csv")
    args = [f"data={data}", "max_len=6", "epochs=1", "batch_size=16", "d_model=8"]
    code = main(["train", "seqrec", "model=gru", f"out={tmp_path / 'r'}", "progress=false", *args])
    assert code == 0
    printed = capsys.readouterr().out
    assert "ndcg@10" in printed and str(tmp_path / "r") in printed
    assert main(["experiment", "dpformer", "colour=red"]) == 2
    assert "unknown config key(s) ['colour']" in capsys.readouterr().err
    assert main(["train", "seqrec", "epsilon=-1"]) == 2
    assert "epsilon=-1" in capsys.readouterr().err
