"""Checkpoint and resume: 2 processes resumed with 2 or 1, a killed run, torchrun; refusals.

The 2-process run is the session's shared one (``tests/distributed/two_ranks.py``);
``tests/_distributed_run.py`` is the run killed and resumed in a subprocess.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from dptrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from dptrain.distributed import DistributedConfigError
from dptrain.privacy_engine import make_private
from tests._distributed_run import build, flat_parameters
from tests.distributed.two_ranks import MODES, SAVE_AFTER, config, single_process, train

SCRIPT = Path(__file__).with_name("_distributed_run.py")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("mode", MODES)
def test_two_process_resume_matches_uninterrupted(two_ranks, mode):
    _, results = two_ranks
    for r in results:
        res = r["equivalence"][mode]
        assert res["resumed_from"] == SAVE_AFTER
        assert torch.equal(res["resumed"], res["full"])
        assert res["resumed_ledger"] == res["ledger"]


def test_two_process_checkpoint_resumes_in_one_process(two_ranks):
    out, _ = two_ranks
    mode = "book_keeping"
    model, opt, data = build(init_seed=7)
    private = make_private(model, opt, data, max_physical_batch_size=4, **config(mode))
    load_checkpoint(out / f"ckpt-{mode}.pt", private)
    assert private.ledger.num_steps == SAVE_AFTER
    train(private, model)
    ref_model, ref = single_process(mode)
    assert torch.allclose(flat_parameters(model), flat_parameters(ref_model), rtol=0, atol=1e-10)
    assert private.ledger == ref.ledger


def wait_for_lines(proc: subprocess.Popen, marker: str, count: int, timeout: float) -> list[str]:
    """stdout lines of ``proc`` until ``count`` lines started with ``marker``, EOF or timeout.

    Reads the raw pipe with select(), so a child that hangs cannot hang the test.
    """
    buf = b""
    deadline = time.monotonic() + timeout
    while True:
        text = buf.decode(errors="replace")
        lines = [line.strip() for line in text.splitlines()]
        left = deadline - time.monotonic()
        # Counted in the text, not per line: two workers' lines can run together.
        if text.count(marker) >= count or left <= 0:
            return lines
        ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
        if ready:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:  # EOF: the child exited
                return lines
            buf += chunk


def test_killed_run_resumes_to_the_uninterrupted_result(tmp_path):
    """SIGKILL in the middle of step 3 (after a checkpoint), resume: same ledger and parameters."""
    steps, stall_at = 5, 3
    killed = tmp_path / "killed"
    killed.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "MASTER_ADDR")}
    cmd = [sys.executable, str(SCRIPT), "--out", str(killed), "--steps", str(steps)]
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [*cmd, "--stall-at", str(stall_at), "--dropout", "0.1"],
            stdout=subprocess.PIPE,
            stderr=err,
            env=env,
        )
    try:
        lines = wait_for_lines(proc, "STALL", 1, timeout=90)
        assert lines[-1:] == [f"STALL {proc.pid}"], (lines, stderr.read_text()[-2000:])
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert lines[:-1] == [f"SAVED {s}" for s in range(stall_at)]
    assert torch.load(killed / "ckpt.pt", weights_only=True)["step"] == stall_at
    assert not (killed / "final.pt").exists()

    from tests._distributed_run import run

    with torch.random.fork_rng():
        resumed = run(str(killed), steps, dropout=0.1)
        fresh = tmp_path / "uninterrupted"
        fresh.mkdir()
        reference = run(str(fresh), steps, dropout=0.1)
    assert torch.equal(resumed["params"], reference["params"])
    assert resumed["ledger"] == reference["ledger"]
    assert sum(s["count"] for s in resumed["ledger"]["segments"]) == steps


@pytest.mark.slow
def test_torchrun_two_processes_killed_and_resumed(tmp_path):
    """torchrun --nproc_per_node 2: kill mid-run, resume with torchrun, compare with 1 process."""
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
    steps, stall_at = 5, 2
    base = [torchrun, "--standalone", "--nproc_per_node", "2", str(SCRIPT)]
    args = ["--out", str(tmp_path), "--steps", str(steps)]
    proc = subprocess.Popen(
        [*base, *args, "--stall-at", str(stall_at)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    workers: list[int] = []
    try:
        seen = wait_for_lines(proc, "STALL", 2, timeout=120)
        workers = [int(pid) for pid in re.findall(r"STALL (\d+)", "\n".join(seen))]
        assert len(workers) == 2, seen
    finally:
        # torchrun runs its workers in their own sessions: kill them by pid, then torchrun.
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["step"] == stall_at
    subprocess.run([*base, *args], check=True, timeout=300, capture_output=True)
    final = torch.load(tmp_path / "final.pt", weights_only=True)

    from tests._distributed_run import run

    fresh = tmp_path / "one"
    fresh.mkdir()
    with torch.random.fork_rng():
        reference = run(str(fresh), steps)
    assert torch.allclose(final["params"], reference["params"], rtol=0, atol=1e-10)
    assert final["ledger"] == reference["ledger"]


def test_checkpoint_must_match_the_run(tmp_path):
    model, opt, data = build()
    private = make_private(model, opt, data, max_physical_batch_size=4, **config("ghost"))
    train(private, model, stop_after=1)
    save_checkpoint(tmp_path / "c.pt", private)
    model, opt, data = build()
    other = make_private(
        model, opt, data, max_physical_batch_size=4, **(config("ghost") | {"noise_multiplier": 2.0})
    )
    with pytest.raises(
        DistributedConfigError,
        match=re.escape("noise_multiplier=1.0 in the checkpoint, 2.0 in this run"),
    ):
        load_checkpoint(tmp_path / "c.pt", other)
    with pytest.raises(CheckpointError, match=r"could not read checkpoint path=.*missing\.pt"):
        load_checkpoint(tmp_path / "missing.pt", other)


def test_save_in_the_middle_of_a_step_is_refused(tmp_path):
    model, opt, data = build()
    private = make_private(model, opt, data, max_physical_batch_size=4, **config("book_keeping"))
    batch = next(iter(private.data_loader))  # drawn, not yet stepped
    assert batch.step == 0
    with pytest.raises(CheckpointError, match="in the middle of a step"):
        save_checkpoint(tmp_path / "c.pt", private)
    assert not (tmp_path / "c.pt").exists()


def test_a_sharded_checkpoint_does_not_resume_an_unsharded_run(tmp_path):
    """The directory an FSDP2 run writes is refused by name, pointing to consolidation."""
    from torch import nn

    from dptrain.distributed.sharded_checkpoint import save_sharded

    layer = nn.Linear(2, 2)
    save_sharded(tmp_path / "sharded", layer, torch.optim.SGD(layer.parameters()), {"step": 0})
    model, opt, data = build()
    private = make_private(model, opt, data, max_physical_batch_size=4, **config("ghost"))
    with pytest.raises(
        CheckpointError,
        match=r"sharded'? is a sharded \(FSDP2\) checkpoint directory, and this is an unsharded "
        r"run: consolidate it \(dptrain consolidate\)",
    ):
        load_checkpoint(tmp_path / "sharded", private)
    assert private.ledger.num_steps == 0
