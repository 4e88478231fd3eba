"""The E2E batch x learning-rate study: config splitting, the planned runs, outputs (tiny smoke)."""

from __future__ import annotations

import json

import pytest

from dptrain.config import ConfigError
from dptrain.recipes import configs_dir
from dptrain.recipes.table2text_study import (
    Table2TextStudyConfig,
    load_table2text_study_config,
    results_table,
    run_table2text_study,
)
from tests.recipes.test_table2text import synthetic_pairs, write_e2e


def test_config_keys_are_split_between_grid_and_training():
    cfg = load_table2text_study_config(
        None, ["batch_sizes=8,32", "lrs=0.001", "epochs=3", "n_layer=1", "out=x"]
    )
    assert cfg.batch_sizes == (8, 32) and cfg.lrs == (0.001,) and cfg.out == "x"
    assert cfg.train == {"epochs": 3, "n_layer": 1}
    runs = cfg.run_configs()
    assert [(r.batch_size, r.lr) for r in runs] == [(8, 0.001), (32, 0.001)]
    assert all(r.epsilon == 3.0 and r.epochs == 3 and not r.decode_test for r in runs)
    assert runs[0].out == "x/B8_lr0.001/seed0"
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['lrz'\]"):
        load_table2text_study_config(None, ["lrz=3"])
    with pytest.raises(ConfigError, match="epochs"):
        load_table2text_study_config(None, ["epochs=many"])


def test_packaged_config_loads():
    cfg = load_table2text_study_config(configs_dir() / "table2text_study.yaml")
    assert cfg.epsilon == 3.0 and len(cfg.run_configs()) == 12  # 3 batch sizes x 4 lrs


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"batch_sizes": ()}, "batch_sizes=[]"),
        ({"batch_sizes": (0, 8)}, "batch_sizes=[0, 8]"),
        ({"lrs": (-1.0,)}, "lrs=[-1.0]"),
        ({"epsilon": 0.0}, "epsilon=0.0"),
        ({"seeds": 0}, "seeds=0"),
        ({"train": {"lr": 0.1}}, "['lr'] are set by the grid"),
        ({"train": {"n_embd": 10, "n_head": 4}}, "n_embd=10"),
    ],
)
def test_bad_grids_are_refused(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        Table2TextStudyConfig(**kwargs)


def test_table_is_laid_out_like_the_figure():
    cfg = Table2TextStudyConfig(batch_sizes=(8, 32), lrs=(1e-3, 1e-2))
    base = {"seed": 0, "noise_multiplier": 1.0, "steps": 10, "best_epoch": 1, "wall_time_s": 1.0}
    results = [
        {**base, "batch_size": b, "lr": lr, "valid_bleu_beam": v, "n_train_pairs": 64}
        for b, lr, v in ((8, 1e-3, 1.0), (8, 1e-2, 2.0), (32, 1e-3, 3.0), (32, 1e-2, 4.0))
    ]
    table = results_table(results, cfg, 60.0, "cmd")
    rows = [line for line in table.splitlines() if line.startswith("| 0.01 |")]
    assert rows[0].startswith("| 0.01 | 2.0 | 4.0 |")  # high lr first; B ascending
    assert "B = 32 (q = 0.5)" in table


def test_tiny_study_runs_end_to_end(tmp_path):
    data = write_e2e(tmp_path / "e2e", synthetic_pairs(12, 3), synthetic_pairs(4, 2, 3))
    cfg = load_table2text_study_config(
        None,
        [
            "batch_sizes=4,8",
            "lrs=0.003",
            f"out={tmp_path / 'study'}",
            f"data={data}",
            "valid_fraction=0.25",
            "accountant=rdp",  # fast calibration at these large q
            "vocab_size=100",
            "n_layer=1",
            "n_embd=16",
            "n_head=2",
            "max_len=48",
            "epochs=1",
            "beam_size=2",
            "max_new_tokens=8",
            "max_valid_tables=2",
            "max_physical_batch_size=8",
        ],
    )
    summary = run_table2text_study(cfg, "test")
    out = tmp_path / "study"
    for name in ("summary.json", "table.md", "heatmap.png", "snr_vs_bleu.png"):
        assert (out / name).is_file(), name
    runs = summary["runs"]
    assert [r["batch_size"] for r in runs] == [4, 8]
    assert runs[0]["steps"] > runs[1]["steps"]  # fixed epochs: the larger batch takes fewer steps
    assert all(r["epsilon"] <= 3.0 * 1.001 and "valid_bleu_beam" in r for r in runs)
    assert all("test_bleu_beam" not in r for r in runs)  # decode_test is off in the study
    assert json.loads((out / "summary.json").read_text())["command"] == "test"
    assert "| 0.003 |" in (out / "table.md").read_text()
