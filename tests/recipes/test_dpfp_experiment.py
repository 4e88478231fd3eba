"""The DP-FP experiment grid: config splitting, the runs it plans, its tables and plots."""

from __future__ import annotations

import json

import pytest

from dptrain.config import ConfigError
from dptrain.recipes import configs_dir
from dptrain.recipes.dpfp_experiment import (
    DPFPExperimentConfig,
    load_dpfp_experiment_config,
    plot_accuracy_vs_epsilon,
    plot_sweep,
    results_table,
)


def test_config_keys_are_split_between_grid_and_training():
    cfg = load_dpfp_experiment_config(
        None, ["seeds=2", "epsilons=3", "train_size=500", "head_lr=0.01", "out=x"]
    )
    assert cfg.seeds == 2 and cfg.epsilons == (3.0,) and cfg.out == "x"
    assert cfg.train == {"train_size": 500, "head_lr": 0.01}
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['seedz'\]"):
        load_dpfp_experiment_config(None, ["seedz=3"])
    with pytest.raises(ConfigError, match="train_size"):
        load_dpfp_experiment_config(None, ["train_size=many"])


def test_grid_keys_cannot_be_set_as_training_settings():
    with pytest.raises(ConfigError, match=r"\['method'\] are set by the grid"):
        DPFPExperimentConfig(train={"method": "dpfp"})
    with pytest.raises(ConfigError, match=r"per_method\.dpsgd sets"):
        DPFPExperimentConfig(per_method={"dpsgd": {"epsilon": 3.0}})
    with pytest.raises(ConfigError, match="per_method key 'bert'"):
        DPFPExperimentConfig(per_method={"bert": {"lr": 0.1}})


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"methods": ("dpfp", "bert")}, "methods="),
        ({"methods": ()}, "methods="),
        ({"epsilons": (0.0,)}, "epsilon 0.0"),
        ({"epsilons": ()}, "epsilons=[]"),
        ({"seeds": 0}, "seeds=0"),
        ({"sweep_method": "dpsgd"}, "sweep_method="),
        ({"clip_sweep": (-1.0,)}, "clip_sweep"),
        ({"micro_batch_sweep": (0,)}, "micro_batch_sweep"),
    ],
)
def test_bad_grids_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        DPFPExperimentConfig(**kwargs)


def test_every_run_is_checked_before_any_runs():
    # dpsgd-head refuses lr (its encoder is frozen): the grid is refused at construction.
    with pytest.raises(ValueError, match=r"lr=0\.001 is not allowed with method='dpsgd-head'"):
        DPFPExperimentConfig(methods=("dpsgd", "dpsgd-head"), train={"lr": 1e-3})
    cfg = DPFPExperimentConfig(methods=("dpsgd", "dpsgd-head"), per_method={"dpsgd": {"lr": 1e-3}})
    lrs = {(r.method, r.lr) for r in cfg.run_configs()}
    assert lrs == {("dpsgd", 1e-3), ("dpsgd-head", None)}


def test_runs_planned_with_method_defaults_and_sweeps_deduplicated(tmp_path):
    cfg = DPFPExperimentConfig(
        epsilons=(1.0, 8.0),
        seeds=2,
        clip_sweep=(0.1, 1.0),
        micro_batch_sweep=(8, 32),
        out=str(tmp_path),
        per_method={"dpsgd": {"batch_size": 64}},
    )
    runs = cfg.run_configs()
    main = 2 * (1 + 2 * 4)  # nonprivate once per seed, 4 private methods x 2 epsilons
    # C = 1 and M = 32 are the dpfp defaults: those sweep points are main-grid runs at eps 3?
    # No: the sweep is at eps 3, outside the main grid (1, 8), so 3 new points x 2 seeds.
    assert len(runs) == main + 3 * 2
    by = {(r.method, r.epsilon, r.seed, r.max_norm, r.micro_batches) for r in runs}
    assert len(by) == len(runs)
    dpsgd = [r for r in runs if r.method == "dpsgd"]
    assert {r.batch_size for r in dpsgd} == {64} and {r.max_norm for r in dpsgd} == {0.1}
    assert {r.batch_size for r in runs if r.method == "dpfp"} == {32}
    assert all(r.feature_cache == str(tmp_path / "cache") for r in runs)
    assert all(not r.save_checkpoint and not r.progress for r in runs)
    # With the sweep epsilon in the main grid, the default point is not run twice.
    cfg3 = DPFPExperimentConfig(
        methods=("dpfp",), epsilons=(3.0,), seeds=1, clip_sweep=(0.1, 1.0), micro_batch_sweep=(32,)
    )
    assert len(cfg3.run_configs()) == 2


@pytest.mark.parametrize("name", ["dpfp_experiment.yaml", "dpfp_frozen_experiment.yaml"])
def test_packaged_configs_load(name):
    cfg = load_dpfp_experiment_config(configs_dir() / name)
    assert cfg.run_configs()


def _fake(method, eps, seed, acc, **extra):
    return {
        "method": method,
        "target_epsilon": eps,
        "seed": seed,
        "accuracy": acc,
        "dev_accuracy": acc,
        "wall_time_s": 10.0,
        "privacy_scope": f"scope of {method}",
        "data": "toy",
        "n_train": 10,
        "n_dev": 5,
        "n_test": 5,
        "encoder": "tiny",
        "objective": "linear",
        "delta": 1e-3 if eps else 0.0,
        "epsilon": eps or float("inf"),
        "epsilon_by_accountant": {"pld": eps, "rdp": eps, "gdp": eps},
        "noise_multiplier": 1.0 if eps else 0.0,
        "steps": 3,
        "ledger_events": 3,
        "max_norm": extra.pop("max_norm", 1.0),
        "micro_batches": extra.pop("micro_batches", 32),
        "run_folder": extra.pop("run_folder", f"out/{method}/x/seed{seed}"),
    }


def test_table_and_plots_from_results(tmp_path):
    cfg = DPFPExperimentConfig(
        methods=("nonprivate", "dpfp"),
        epsilons=(3.0,),
        seeds=2,
        clip_sweep=(0.5, 1.0),
        micro_batch_sweep=(4,),
        out=str(tmp_path),
    )
    results = [
        _fake("nonprivate", None, 0, 0.8),
        _fake("nonprivate", None, 1, 0.9),
        _fake("dpfp", 3.0, 0, 0.6),
        _fake("dpfp", 3.0, 1, 0.7),
        _fake("dpfp", 3.0, 0, 0.5, max_norm=0.5, run_folder="out/sweep_clip/C0.5/seed0"),
        _fake("dpfp", 3.0, 0, 0.4, micro_batches=4, run_folder="out/sweep_micro_batches/M4/s0"),
    ]
    table = results_table(results, cfg, 60.0, "cmd")
    assert "| Non-private fine-tuning | - | 0.850 ± 0.071 |" in table
    assert "| DP-FP, frozen encoder | 0.650 ± 0.071 | - |" in table  # sweep runs left out
    assert "scope of dpfp" in table and "Command: `cmd`" in table
    assert "| 0.5 | 0.500 |" in table  # C sweep at M = 32
    assert "| 1 | 0.650 ± 0.071 |" in table  # the default point is the main grid's
    assert "| 4 | 0.400 |" in table
    plot_accuracy_vs_epsilon(results, cfg, tmp_path / "a.png")
    plot_sweep(results, cfg, "max_norm", tmp_path / "c.png")
    plot_sweep(results, cfg, "micro_batches", tmp_path / "m.png")
    for name in ("a.png", "c.png", "m.png"):
        assert (tmp_path / name).stat().st_size > 0


# -- end to end on the tiny encoder of test_classify -----------------------------------------

from tests.recipes.test_classify import files  # noqa: E402, F401  (a pytest fixture)


def test_tiny_grid_through_the_cli(files, tmp_path, capsys):  # noqa: F811
    from dptrain.cli import main

    out = tmp_path / "exp"
    code = main(
        [
            "experiment",
            "dpfp",
            "methods=[nonprivate, dpsgd-head, dpfp]",
            # the packaged grid's subset, per-method batches and workers do not fit 48 texts
            "train_size=null",
            "per_method={}",
            "workers=1",
            "epsilons=[1]",
            "seeds=1",
            "micro_batch_sweep=[2]",
            "sweep_epsilon=1",
            f"out={out}",
            f"data={files['data']}",
            f"encoder={files['mlm']}",
            "epochs=1",
            "batch_size=8",
            "micro_batches=4",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "| DP-FP, frozen encoder |" in printed
    assert (out / "accuracy_vs_epsilon.png").stat().st_size > 0
    assert (out / "accuracy_vs_micro_batches.png").stat().st_size > 0
    assert not (out / "accuracy_vs_clip.png").exists()  # no C sweep asked for
    assert len(list((out / "cache").glob("features-*.pt"))) == 1  # shared by frozen runs
    summary = (out / "summary.json").read_text()
    assert summary.count('"method": "dpfp"') == 2  # main run + the M = 2 sweep point


def test_train_classify_cli_flags(files, tmp_path, capsys):  # noqa: F811
    from dptrain.cli import main

    common = [f"data={files['data']}", f"encoder={files['mlm']}", "epochs=1", "batch_size=8"]
    code = main(
        [
            "train",
            "classify",
            "--method",
            "dpfp",
            "--accountant",
            "gdp",
            "epsilon=1",
            "micro_batches=4",
            f"out={tmp_path / 'gdp'}",
            *common,
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "privacy scope" in printed and "labels are NOT protected" in printed
    results = json.loads((tmp_path / "gdp" / "results.json").read_text())
    assert results["calibrated_with"] == "gdp"
    # The paper's GDP-CLT route meets epsilon 1 under the CLT; PLD reports more.
    assert results["epsilon_by_accountant"]["gdp"] <= 1.0 + 1e-9
    assert results["epsilon"] == results["epsilon_by_accountant"]["pld"] > 1.0
    assert "understates" in results["calibration_note"]
    # A private method needs an epsilon; nonprivate refuses one: exit code 2, no traceback.
    assert main(["train", "classify", "--method", "dpsgd", *common]) == 2
    assert "epsilon=None is not allowed" in capsys.readouterr().err
    assert main(["train", "seqrec", "--method", "dpfp"]) == 2
