"""examples/fsdp_checkpoint.py as a user runs it: torchrun, stopped, resumed, consolidated.

Slow (four torchrun launches of 2 processes and two ``dptrain consolidate`` commands,
about 3 minutes on 2 CPU cores): the stopped-and-resumed run's consolidated weights and
privacy record equal the uninterrupted run's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dptrain import privacy_record

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "fsdp_checkpoint.py"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), str(REPO)])
    return env


def _torchrun(*args: str) -> str:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    proc = subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", str(EXAMPLE), *args],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _consolidate(ckpt: Path, out: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "dptrain.cli", "consolidate", str(ckpt), str(out)],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_stopped_resumed_and_consolidated_equals_the_uninterrupted_run(tmp_path):
    from safetensors.torch import load_file

    stopped, whole = tmp_path / "stopped", tmp_path / "whole"
    first = _torchrun("--out", str(stopped), "--stop-after", "2")
    assert "step 2:" in first and "step 3:" not in first
    second = _torchrun("--out", str(stopped))
    assert "step 1:" not in second and "step 4:" in second
    _torchrun("--out", str(whole))
    out = _consolidate(stopped / "ckpt", stopped / "model")
    assert "model: " in out and "(8, 1e-05)-DP" in out
    _consolidate(whole / "ckpt", whole / "model")

    a = load_file(stopped / "model" / "model.safetensors")
    b = load_file(whole / "model" / "model.safetensors")
    assert a.keys() == b.keys() and a
    for name in a:
        assert torch.equal(a[name], b[name]), name
    ra, rb = privacy_record.read(stopped / "model"), privacy_record.read(whole / "model")
    assert ra.ledger == rb.ledger and ra.epsilon == rb.epsilon
    assert ra.training["steps_taken"] == 4
