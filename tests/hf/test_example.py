"""examples/hf_trainer_lora.py runs end to end on a tiny Llama (a stock Trainer + peft
script turned private with DPTrainer)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("datasets")

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "hf_trainer_lora.py"


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_lora", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_trains_privately_and_saves_the_report(tmp_path, capsys):
    # --user-level: the group_by path too (example-level is what the other tests train)
    argv = ["--tiny", "--max-steps", "2", "--output-dir", str(tmp_path), "--seed", "0"]
    result = _example().main([*argv, "--user-level"])
    # docs/hf.md's line, shown without any logging set-up (a default run)
    shown = capsys.readouterr().out
    assert f"privacy budget spent: 2 steps, epsilon {result['epsilon']:.4g} at delta" in shown
    assert "per user); training stops" in shown
    assert result["steps"] == 2
    assert result["privacy_unit"] == "user"
    assert 0 < result["epsilon"] <= 8.0
    assert result["sample"].startswith("Customer 007: the")
    report = json.loads((tmp_path / "privacy.json").read_text())
    assert report["guarantee"]["epsilon"] == pytest.approx(result["epsilon"])
    assert (tmp_path / "adapter_model.safetensors").is_file()
    assert "## Differential privacy" in (tmp_path / "README.md").read_text()
