"""benchmarks/host_overhead.py's comparison of two revisions in one process: the other
revision's engine is a copy of its own, not this checkout's under another name."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.scripts import load_script

pytest.importorskip("transformers")
REPO = Path(__file__).resolve().parents[2]


def test_another_revision_is_imported_from_its_own_copy():
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    script = load_script("host_overhead")
    name = script._package_at("HEAD")
    engine = importlib.import_module(f"{name}.clipping.engine")
    root = Path(engine.__file__).resolve().parents[2]
    assert root != REPO / "src"
    # every module the copy imported is the copy's: none of this checkout's dptrain
    loaded = [m for m in sys.modules if m == name or m.startswith(f"{name}.")]
    assert len(loaded) > 10
    for m in loaded:
        file = getattr(sys.modules[m], "__file__", None)
        assert file is None or Path(file).resolve().is_relative_to(root / name)
    mine = importlib.import_module("dptrain.clipping.engine")
    assert engine.ClippingEngine is not mine.ClippingEngine
    # the rewritten imports name the copy; strings and comments that say dptrain do not change
    text = (root / name / "clipping" / "engine.py").read_text()
    assert "from dptrain." not in text and f"from {name}." in text


def test_a_step_count_below_one_is_refused(capsys):
    script = load_script("host_overhead")
    with pytest.raises(SystemExit):
        script.main(["--steps", "0"])
    assert "--steps 0 is not allowed" in capsys.readouterr().err
