"""The host-time proxies (benchmarks/host_overhead.py, module_host_cost.py): comparing two
revisions in one process imports the other revision's engine from a copy of its own, not
this checkout's under another name (``_harness.package_at``); module_host_cost's hook
floor computes the clipped sums the engine computes."""

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
    name = load_script("_harness").package_at("HEAD")
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


def test_the_hook_floor_computes_the_engines_clipped_sums():
    """The floor that module_host_cost.py times beside the engine does the same work: its
    weight gradients are the engine's book-keeping sums (flat clipping at C 1)."""
    import torch

    from dptrain.clipping import ClippingEngine

    script = load_script("module_host_cost")
    torch.manual_seed(0)
    floor = script.HookFloor(script.Stack(4, 8).double())
    model = script.Stack(4, 8).double()
    model.load_state_dict(floor.model.state_dict())
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    engine = ClippingEngine(model, 1.0, mode="book_keeping")
    engine.backward(model(x).pow(2).mean((1, 2)))
    floor.backward(floor.forward(x).pow(2).mean((1, 2)))
    for mine, theirs in zip(floor.model.layers, model.layers, strict=True):
        torch.testing.assert_close(mine.weight.grad, theirs.weight.grad, rtol=1e-10, atol=1e-12)
    engine.detach()


@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_module_host_cost_times_the_floor_beside_the_engine(amp, capsys):
    script = load_script("module_host_cost")
    script.main(["--layers", "3", "--steps", "2", "--floor", "--amp", amp])
    out = capsys.readouterr().out
    assert "| dptrain-bk |" in out and "| hook floor |" in out
