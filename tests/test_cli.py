"""The ``dptrain`` command: JSON keys, tables, and errors on stderr with exit code 2."""

import json
import subprocess
import sys

import pytest

from dptrain.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def json_lines(out):
    return [json.loads(line) for line in out.strip().splitlines()]


def test_epsilon_json_has_one_object_per_accountant(capsys):
    code, out, _ = run(
        capsys,
        "epsilon",
        "--sample-rate",
        "0.01",
        "--noise-multiplier",
        "1.0",
        "--steps",
        "1000",
        "--delta",
        "1e-5",
        "--json",
    )
    assert code == 0
    records = json_lines(out)
    assert [r["accountant"] for r in records] == ["pld", "rdp", "gdp"]
    assert all(r["epsilon"] > 0 for r in records)
    assert records[2]["approximate"] is True
    assert records[0]["effective_noise_multiplier"] == pytest.approx(100.0)


def test_epsilon_from_batch_size_and_epochs_equals_rate_and_steps(capsys):
    _, out_a, _ = run(
        capsys,
        "epsilon",
        "--batch-size",
        "256",
        "--dataset-size",
        "60000",
        "--epochs",
        "3",
        "--noise-multiplier",
        "1.1",
        "--delta",
        "1e-5",
        "--accountant",
        "rdp",
        "--json",
    )
    _, out_b, _ = run(
        capsys,
        "epsilon",
        "--sample-rate",
        str(256 / 60000),
        "--steps",
        str(int(3 * 60000 / 256)),
        "--noise-multiplier",
        "1.1",
        "--delta",
        "1e-5",
        "--accountant",
        "rdp",
        "--json",
    )
    a, b = json_lines(out_a)[0], json_lines(out_b)[0]
    assert a["epsilon"] == pytest.approx(b["epsilon"], rel=1e-12)
    assert a["averaged_gradient_noise_std"] == pytest.approx(1.1 / 256)


def test_epsilon_schedule_with_per_segment_sigma(capsys):
    code, out, _ = run(
        capsys,
        "epsilon",
        "--schedule",
        "0.01:100,0.02:50:2.0",
        "--noise-multiplier",
        "1.0",
        "--delta",
        "1e-5",
        "--accountant",
        "gdp",
        "--json",
    )
    assert code == 0
    (rec,) = json_lines(out)
    assert rec["steps"] == 150
    assert rec["segments"][1] == {"sample_rate": 0.02, "noise_multiplier": 2.0, "steps": 50}


def test_human_table_labels_gdp_as_approximate(capsys):
    code, out, _ = run(
        capsys,
        "epsilon",
        "--sample-rate",
        "0.01",
        "--noise-multiplier",
        "1.0",
        "--steps",
        "100",
        "--delta",
        "1e-5",
    )
    assert code == 0
    gdp_line = next(line for line in out.splitlines() if line.startswith("gdp"))
    assert "approximate" in gdp_line


def test_calibrate_json(capsys):
    code, out, _ = run(
        capsys,
        "calibrate",
        "--epsilon",
        "2",
        "--delta",
        "1e-5",
        "--sample-rate",
        "0.01",
        "--steps",
        "500",
        "--accountant",
        "gdp",
        "--json",
    )
    assert code == 0
    (rec,) = json_lines(out)
    assert rec["noise_multiplier"] > 0
    assert rec["epsilon"] <= 2
    # A GDP-calibrated sigma is always shown with its PLD epsilon.
    assert rec["epsilon_pld"] > rec["epsilon"]


def test_calibrate_json_has_the_privacy_unit_of_epsilon_json(capsys):
    common = ["--delta", "1e-5", "--sample-rate", "0.01", "--steps", "100", "--accountant", "pld"]
    _, out, _ = run(capsys, "calibrate", "--epsilon", "2", *common, "--json")
    (cal,) = json_lines(out)
    sigma = str(cal["noise_multiplier"])
    _, out, _ = run(capsys, "epsilon", "--noise-multiplier", sigma, *common, "--json")
    (eps,) = json_lines(out)
    for key in ("privacy_unit", "neighbouring", "delta", "noise_multiplier", "sample_rate"):
        assert cal[key] == eps[key], key
    assert cal["privacy_unit"] == "example"
    assert eps["epsilon"] == pytest.approx(cal["epsilon"])


def test_calibrate_dpfp_reproduces_the_paper_route(capsys):
    code, out, _ = run(
        capsys,
        "calibrate-dpfp",
        "--epsilon",
        "1.73",
        "--delta",
        str(1 / (2 * 67349)),
        "--dataset-size",
        "67349",
        "--batch-size",
        "32",
        "--micro-batches",
        "32",
        "--epochs",
        "3",
        "--clip",
        "1",
        "--accountant",
        "gdp",
        "--json",
    )
    assert code == 0
    (rec,) = json_lines(out)
    assert rec["noise_multiplier"] == pytest.approx(0.346, abs=5e-4)
    assert rec["noise_std"] == pytest.approx(rec["noise_multiplier"])
    assert rec["epsilon_pld"] == pytest.approx(5.90, abs=0.01)
    assert set(rec["epsilons"]) == {"pld", "rdp", "gdp"}


def test_search_cost_json(capsys):
    code, out, _ = run(
        capsys, "search-cost", "--trials", "5", "--epsilon", "1", "--delta", "1e-6", "--json"
    )
    assert code == 0
    methods = [r["method"] for r in json_lines(out)]
    assert methods == ["gupta", "composition"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            [
                "calibrate",
                "--epsilon",
                "0",
                "--delta",
                "1e-5",
                "--sample-rate",
                "0.01",
                "--steps",
                "10",
            ],
            "target_epsilon=0.0 is not allowed: expected a number > 0",
        ),
        (
            [
                "epsilon",
                "--sample-rate",
                "0.01",
                "--noise-multiplier",
                "1",
                "--steps",
                "10",
                "--delta",
                "1.5",
            ],
            "delta=1.5 is outside the allowed range (0, 1)",
        ),
        (
            [
                "epsilon",
                "--sample-rate",
                "0",
                "--noise-multiplier",
                "1",
                "--steps",
                "10",
                "--delta",
                "1e-5",
            ],
            "sample_rate=0.0 is outside the allowed range (0, 1]",
        ),
        (
            [
                "epsilon",
                "--sample-rate",
                "0.1",
                "--noise-multiplier",
                "-1",
                "--steps",
                "10",
                "--delta",
                "1e-5",
            ],
            "noise_multiplier=-1.0 is not allowed: expected a number > 0",
        ),
        (
            [
                "epsilon",
                "--sample-rate",
                "0.1",
                "--noise-multiplier",
                "1",
                "--steps",
                "-5",
                "--delta",
                "1e-5",
            ],
            "--steps=-5 is not allowed: expected an integer >= 0",
        ),
        (
            [
                "calibrate",
                "--epsilon",
                "1e-6",
                "--delta",
                "1e-10",
                "--sample-rate",
                "1",
                "--steps",
                "1000000",
            ],
            "target_epsilon=1e-06 is unreachable",
        ),
        (
            ["epsilon", "--schedule", "0.1-100", "--noise-multiplier", "1", "--delta", "1e-5"],
            "--schedule='0.1-100': segment '0.1-100' is not of the form X:STEPS or X:STEPS:SIGMA",
        ),
        (
            ["epsilon", "--sample-rate", "0.1", "--noise-multiplier", "1", "--delta", "1e-5"],
            "give exactly one of --steps T and --epochs E",
        ),
    ],
)
def test_bad_input_exits_2_with_message_on_stderr(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.startswith(f"dptrain {argv[0]}: error: ")
    assert message in err


def test_installed_entry_point_runs():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dptrain.cli",
            "epsilon",
            "--sample-rate",
            "1",
            "--noise-multiplier",
            "2",
            "--steps",
            "1",
            "--delta",
            "0",
            "--accountant",
            "gdp",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 2
    assert "delta=0.0 is outside the allowed range (0, 1)" in proc.stderr


# -- train ... audit=true: the audit's verdict is the exit code ------------------------------


def _seqrec_argv(tmp_path, *extra):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    rows = [
        (f"u{u}", int(i) + 100, 1_000 + t)
        for u in range(40)
        for t, i in enumerate(rng.choice(12, size=8, replace=False))
    ]
    data = tmp_path / "inter.csv"
    pd.DataFrame(rows, columns=["user_id", "item_id", "timestamp"]).to_csv(data, index=False)
    base = ["train", "seqrec", f"data={data}", "model=gru", "max_len=6", "d_model=8"]
    return [*base, "progress=false", f"out={tmp_path / 'run'}", "audit=true", *extra]


def test_train_with_audit_exits_0_when_nothing_is_flagged(tmp_path, capsys):
    argv = _seqrec_argv(tmp_path, "epochs=2", "batch_size=16", "audit_canaries=1000")
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "audit (Bonferroni over 3 tests" in out and "not flagged" in out


def test_train_with_audit_exits_1_when_flagged(tmp_path, capsys):
    from tests.audit import faults

    # full batches (q = 1: the Gaussian analysis applies), delta 1e-5, noise repeated at
    # every step: the signed canaries see it
    argv = _seqrec_argv(
        tmp_path, "epochs=4", "batch_size=40", "epsilon=1", "delta=1e-5", "audit_canaries=4000"
    )
    with faults.same_noise_each_step():
        assert main(argv) == 1
    assert ": flagged; lower bounds" in capsys.readouterr().out


def test_train_with_audit_exits_2_when_it_crashes(tmp_path, capsys, monkeypatch):
    from dptrain.audit import GradientCanaries

    def broken(self, *args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(GradientCanaries, "report", broken)
    argv = _seqrec_argv(tmp_path, "epochs=1", "batch_size=16", "audit_canaries=1000")
    assert main(argv) == 2
    assert "could not run (RuntimeError: disk full)" in capsys.readouterr().err


#: Every command configured by a dataclass, and that dataclass.
_SETTINGS_COMMANDS = [
    (["train", "seqrec"], "dptrain.recipes.seqrec", "SeqRecTrainConfig"),
    (["train", "classify"], "dptrain.recipes.classify", "ClassifyTrainConfig"),
    (["train", "table2text"], "dptrain.recipes.table2text", "Table2TextConfig"),
    (["train", "mlm"], "dptrain.recipes.mlm", "MLMTrainConfig"),
    (["train", "lm"], "dptrain.recipes.lm_finetune", "LMFinetuneConfig"),
    (["generate"], "dptrain.recipes.generate", "GenerateConfig"),
    (["audit", "mia"], "dptrain.recipes.audit_mia", "MIAAuditConfig"),
    (["audit", "one-run"], "dptrain.recipes.audit_one_run", "OneRunAuditConfig"),
    (["audit", "exposure"], "dptrain.recipes.exposure", "ExposureAuditConfig"),
    (["audit", "properties"], "dptrain.recipes.audit_properties", "PropertiesConfig"),
    (["demo"], "dptrain.recipes.demo", "DemoConfig"),
    (["experiment", "dpformer"], "dptrain.recipes.dpformer_experiment", "DPFormerExperimentConfig"),
    (["experiment", "dpfp"], "dptrain.recipes.dpfp_experiment", "DPFPExperimentConfig"),
    (["study", "snr"], "dptrain.recipes.mlm_studies", "MLMStudyConfig"),
    (["study", "e2e-heatmap"], "dptrain.recipes.table2text_study", "Table2TextStudyConfig"),
]


@pytest.mark.parametrize(
    ("command", "module", "name"), _SETTINGS_COMMANDS, ids=lambda c: " ".join(c)
)
def test_help_lists_every_setting_with_type_default_and_meaning(capsys, command, module, name):
    import dataclasses
    import importlib

    from dptrain.config import field_help

    cls = getattr(importlib.import_module(module), name)
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    meaning = field_help(cls)
    for f in dataclasses.fields(cls):
        if f.init:
            assert f"\n  {f.name}: {f.type} = " in text, f.name
            first_words = " ".join(meaning[f.name].replace("``", "").split()[:3])
            assert first_words in " ".join(text.split()), f.name
    assert "(undocumented)" not in text


def test_train_lm_help_shows_a_default_and_its_meaning(capsys):
    with pytest.raises(SystemExit):
        main(["train", "lm", "-h"])
    text = capsys.readouterr().out
    assert "  lora_r: int = 8\n      LoRA rank; 0 fine-tunes every parameter instead." in text
    assert "  epsilon: float | None = 8.0\n" in text


def test_config_takes_a_packaged_name_or_refuses_with_the_names(capsys, tmp_path):
    missing = tmp_path / "records.jsonl"
    # the packaged lm config is read (by name, with or without .yaml): the run gets as far as
    # the data it names, which does not exist
    for name in ("lm", "lm.yaml"):
        code, out, err = run(capsys, "train", "lm", "--config", name, f"data={missing}")
        assert code == 2 and out == ""
        assert "--config" not in err and "records.jsonl" in err
    code, out, err = run(capsys, "train", "lm", "--config", "lm_smollm3", f"data={missing}")
    assert code == 2 and out == ""
    assert "--config='lm_smollm3' is not allowed: no such file, and not a packaged config" in err
    assert "'lm'" in err and "'seqrec'" in err


@pytest.mark.slow  # about 40 s: the demo calibrates 15 sigmas and a DP-FP run
def test_accounting_demo_json_is_one_line_with_the_privacy_unit(capsys, tmp_path):
    code, out, _ = run(capsys, "accounting-demo", "--json", "--out", str(tmp_path))
    assert code == 0
    (rec,) = json_lines(out)  # the tables are not printed
    assert rec["privacy_unit"] == "example" and rec["delta"] == 1e-5
    assert rec["neighbouring"] == "add_or_remove_one"
    assert rec == json.loads((tmp_path / "accounting_demo.json").read_text())


def test_python_dash_m_dptrain_is_the_dptrain_command():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "dptrain", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "usage: dptrain" in out.stdout and "train" in out.stdout


@pytest.mark.parametrize(
    "command, inside",
    [
        (["demo"], None),
        (["experiment", "dpformer"], None),
        (["experiment", "dpfp"], None),
        (["audit", "one-run"], None),
        (["audit", "mia"], None),
        (["audit", "exposure"], None),
        (["audit", "properties"], None),
        (["study", "snr"], "snr"),
        (["study", "e2e-heatmap"], None),
    ],
)
def test_a_named_run_folder_that_holds_a_run_is_refused_before_any_work(
    capsys, tmp_path, command, inside
):
    out = tmp_path / "runs"
    held = out / inside if inside else out
    held.mkdir(parents=True)
    (held / "ledger.json").write_text("{}")
    code, _, err = run(capsys, *command, f"out={out}")
    assert code == 2
    assert f"out={str(held)!r} is not allowed: the folder exists" in err
    assert "overwrite=true" in err
    assert [p.name for p in held.iterdir()] == ["ledger.json"]
    # overwrite= is the command line's setting, checked like any other
    code, _, err = run(capsys, *command, f"out={tmp_path / 'new'}", "overwrite=maybe")
    assert code == 2 and "overwrite='maybe' is not allowed" in err
    assert not (tmp_path / "new").exists()
