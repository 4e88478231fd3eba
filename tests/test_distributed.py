"""Distributed DP training: 2 gloo processes = 1 process, noise once, resume, bad input.

One module-scoped spawn of 2 gloo processes runs every multi-process scenario
(starting processes costs seconds on a small machine); the tests below check
its results against single-process runs done here.
"""

from __future__ import annotations

import contextlib
import datetime
import math
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
import torch.distributed as dist
from torch import nn

from dptrain.data import DPDataLoader
from dptrain.distributed import (
    CheckpointError,
    DistributedConfigError,
    DistributedDPDataLoader,
    DistributedDPOptimizer,
    load_checkpoint,
    make_private_distributed,
    save_checkpoint,
    shard_indices,
    spawn,
)
from dptrain.losses import per_example_cross_entropy
from dptrain.optim import DPOptimizer, PrivacyBudgetExhaustedError
from dptrain.privacy_engine import make_private
from tests._distributed_run import build, flat_parameters

SCRIPT = Path(__file__).with_name("_distributed_run.py")
MODES = ("book_keeping", "ghost")
STEPS = 4
SAVE_AFTER = 2  # checkpoint after this many steps
SIGMA, C, SEED = 1.0, 0.5, 3
NOISE_SIGMA, NOISE_C, NOISE_BATCH = 1.5, 0.7, 10


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models: several threads only contend (seconds instead of milliseconds a run)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def batch_schedule(step: int) -> int:
    """A growing batch size: q changes after two steps."""
    return 12 if step < 2 else 20


def config(mode: str) -> dict:
    return dict(
        batch_size=batch_schedule,
        max_grad_norm=C,
        steps=STEPS,
        noise_multiplier=SIGMA,
        mode=mode,
        seed=SEED,
    )


def train(private, model, stop_after: int | None = None, ckpt: Path | None = None) -> None:
    for batch in private.data_loader:
        private.optimizer.zero_grad()
        for x, y in batch.chunks:
            private.backward(per_example_cross_entropy(model(x), y))
        private.optimizer.step()
        if ckpt is not None and batch.step + 1 == SAVE_AFTER:
            save_checkpoint(ckpt, private)
        if stop_after is not None and batch.step + 1 == stop_after:
            return


# -- what every rank of the 2-process run does -------------------------------------------------


def _equivalence_and_resume(out: Path) -> dict:
    results = {}
    for mode in MODES:
        ckpt = out / f"ckpt-{mode}.pt"
        model, opt, data = build()
        private = make_private_distributed(
            model, opt, data, global_physical_batch_size=4, **config(mode)
        )
        train(private, model, ckpt=ckpt)
        full = flat_parameters(model)
        # A fresh run from another initialisation, resumed from the checkpoint.
        model, opt, data = build(init_seed=99)
        private2 = make_private_distributed(
            model, opt, data, global_physical_batch_size=4, **config(mode)
        )
        load_checkpoint(ckpt, private2)
        resumed_from = private2.optimizer.steps_taken
        train(private2, model)
        results[mode] = {
            "full": full,
            "ledger": private.ledger.state_dict(),
            "resumed": flat_parameters(model),
            "resumed_ledger": private2.ledger.state_dict(),
            "resumed_from": resumed_from,
            "metrics": private.optimizer.last_metrics,
        }
    return results


def _noise_once(rank: int) -> dict:
    """Zero clipped gradients: after one SGD(lr=1) step from 0, weight = -noise / (q N)."""
    model = nn.Linear(300, 400, bias=False).double()
    nn.init.zeros_(model.weight)
    data = torch.utils.data.TensorDataset(torch.randn(40, 300, dtype=torch.float64))
    private = make_private_distributed(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        data,
        batch_size=NOISE_BATCH,
        max_grad_norm=NOISE_C,
        steps=1,
        noise_multiplier=NOISE_SIGMA,
        seed=11,
    )
    for batch in private.data_loader:
        private.optimizer.zero_grad()
        for (x,) in batch.chunks:
            private.backward(model(x).mul(0.0).sum(1))
        private.optimizer.step()
    noise = -model.weight.detach().flatten() * NOISE_BATCH

    # The budget is rank 0's: only rank 0 is told max_steps; both ranks stop together.
    lin = nn.Linear(4, 3)
    opt = DistributedDPOptimizer(
        torch.optim.SGD(lin.parameters(), lr=0.1),
        noise_multiplier=1.0,
        max_grad_norm=1.0,
        expected_batch_size=4.0,
        sample_rate=0.1,
        seed=0,
        max_steps=1 if rank == 0 else None,
    )
    opt.step()
    try:
        opt.step()
        stopped = "no error"
    except PrivacyBudgetExhaustedError as exc:
        stopped = str(exc)
    return {"noise": noise, "stopped": stopped, "steps_taken": opt.steps_taken}


def _bad_input(rank: int) -> dict:
    out = {}
    model, opt, data = build()
    kwargs = dict(batch_size=16, max_grad_norm=1.0, steps=2, seed=0)
    try:  # rank 1 was given another sigma
        make_private_distributed(model, opt, data, noise_multiplier=1.0 + rank, **kwargs)
        out["mismatch"] = "no error"
    except DistributedConfigError as exc:
        out["mismatch"] = str(exc)
    try:  # 2 processes cannot share 5 records per chunk evenly
        make_private_distributed(
            model, opt, data, noise_multiplier=1.0, global_physical_batch_size=5, **kwargs
        )
        out["divide"] = "no error"
    except DistributedConfigError as exc:
        out["divide"] = str(exc)
    # Rank 1 never joins: rank 0 must fail after the group's timeout, not hang.
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if rank == 1:
        time.sleep(4)
        return out
    start = time.monotonic()
    try:
        make_private_distributed(model, opt, data, noise_multiplier=1.0, group=group, **kwargs)
        out["timeout"] = "no error"
    except Exception as exc:
        out["timeout"] = f"{type(exc).__name__}: {exc}"
    out["timeout_s"] = time.monotonic() - start
    return out


def _two_rank_worker(out: str) -> dict:
    rank = dist.get_rank()
    return {
        "equivalence": _equivalence_and_resume(Path(out)),
        "noise": _noise_once(rank),
        "bad_input": _bad_input(rank),
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("two_ranks")
    results = spawn(_two_rank_worker, 2, args=(str(out),), timeout=30, join_timeout=240)
    return out, results


def single_process(mode: str, stop_after: int | None = None):
    model, opt, data = build()
    private = make_private(model, opt, data, max_physical_batch_size=4, **config(mode))
    train(private, model, stop_after=stop_after)
    return model, private


# -- 2 processes = 1 process -------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_two_processes_match_one_process(two_ranks, mode):
    _, results = two_ranks
    r0, r1 = (r["equivalence"][mode] for r in results)
    assert torch.equal(r0["full"], r1["full"])  # the ranks hold identical parameters
    model, private = single_process(mode)
    assert torch.allclose(r0["full"], flat_parameters(model), rtol=0, atol=1e-10)
    assert r0["ledger"] == r1["ledger"] == private.ledger.state_dict()
    segments = r0["ledger"]["segments"]
    assert [(s["sample_rate"], s["count"]) for s in segments] == [(12 / 64, 2), (20 / 64, 2)]
    # rank 0's step metrics are the one-process metrics (global clipped-sum norm)
    m, ref = r0["metrics"], private.optimizer.last_metrics
    assert m.clipped_sum_norm == pytest.approx(ref.clipped_sum_norm, rel=1e-9)
    assert m.noise_norm == pytest.approx(ref.noise_norm, rel=1e-12)
    assert math.isnan(r1["metrics"].noise_norm)  # rank 1 never sees the noise


def test_all_reduced_noise_has_std_sigma_c(two_ranks):
    """Sample std of 120,000 noise coordinates is sigma*C, not sqrt(2) sigma*C."""
    _, results = two_ranks
    noise0, noise1 = (r["noise"]["noise"] for r in results)
    assert torch.equal(noise0, noise1)
    n = noise0.numel()
    ratio = float(noise0.var() / (NOISE_SIGMA * NOISE_C) ** 2)
    # var/(sigma C)^2 ~ chi2(n-1)/(n-1): std sqrt(2/n) ~ 0.004; 5 standard deviations.
    assert abs(ratio - 1) < 5 * math.sqrt(2 / n)
    assert abs(float(noise0.mean())) < 5 * NOISE_SIGMA * NOISE_C / math.sqrt(n)
    # ... and it is exactly the noise one process draws with the same seed.
    w = nn.Parameter(torch.zeros(400, 300, dtype=torch.float64))
    opt = DPOptimizer(
        torch.optim.SGD([w], lr=1.0),
        noise_multiplier=NOISE_SIGMA,
        max_grad_norm=NOISE_C,
        expected_batch_size=1.0,
        sample_rate=0.25,
        seed=11,
    )
    w.grad = torch.zeros_like(w)
    opt.add_noise()
    assert torch.allclose(noise0, w.grad.flatten(), rtol=1e-12, atol=1e-12)


def test_budget_stop_is_rank_0s_and_every_rank_stops(two_ranks):
    _, results = two_ranks
    for r in results:
        assert "rank 0 stopped every rank" in r["noise"]["stopped"]
        assert r["noise"]["steps_taken"] == 1


# -- checkpoints -------------------------------------------------------------------------------


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


# -- sampling ----------------------------------------------------------------------------------


def test_rank_shares_partition_the_one_process_batches():
    data = torch.utils.data.TensorDataset(torch.arange(500))
    world = 3
    loaders = [
        DistributedDPDataLoader(data, 0.1, 6, 7, seed=42, rank=r, world_size=world)
        for r in range(world)
    ]
    single = DPDataLoader(data, 0.1, 6, 1000, seed=42)
    for batches in zip(single, *loaders, strict=True):
        ref, shares = batches[0], batches[1:]
        whole = ref.chunks[0][0].tolist() if ref.chunks else []
        got = [int(v) for b in shares for chunk in b.chunks for v in chunk[0]]
        assert sorted(got) == whole  # disjoint union = the one-process batch
        sizes = [b.size for b in shares]
        assert max(sizes) - min(sizes) <= 1 and sum(sizes) == ref.size
        assert all(b.global_size == ref.size and b.sample_rate == 0.1 for b in shares)
        assert all(len(c[0]) <= 7 for b in shares for c in b.chunks)
    assert shard_indices([5, 8, 9, 11, 20], 1, 2) == [8, 11]


def test_world_size_must_divide_a_global_physical_batch():
    data = torch.utils.data.TensorDataset(torch.arange(50))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "global_physical_batch_size=7 is not allowed: expected a multiple of world_size=2"
        ),
    ):
        DistributedDPDataLoader(
            data, 0.1, 3, seed=0, global_physical_batch_size=7, rank=0, world_size=2
        )
    loader = DistributedDPDataLoader(
        data, 0.1, 3, seed=0, global_physical_batch_size=8, rank=1, world_size=2
    )
    assert loader.max_physical_batch_size == 4
    with pytest.raises(ValueError, match="seed=None is not allowed"):
        DistributedDPDataLoader(data, 0.1, 3, 4, seed=None, rank=0, world_size=2)


def test_one_process_without_a_group_is_make_private():
    mode = "book_keeping"
    model, opt, data = build()
    private = make_private_distributed(model, opt, data, max_physical_batch_size=4, **config(mode))
    train(private, model)
    ref_model, ref = single_process(mode)
    assert torch.equal(flat_parameters(model), flat_parameters(ref_model))
    assert private.ledger == ref.ledger


# -- bad input on every rank, no hang ----------------------------------------------------------


def test_mismatched_configs_fail_on_every_rank(two_ranks):
    _, results = two_ranks
    for r in results:
        msg = r["bad_input"]["mismatch"]
        assert "the ranks differ" in msg
        assert "noise_multiplier: rank 0=1.0, rank 1=2.0" in msg


def test_world_size_not_dividing_the_physical_batch_fails_on_every_rank(two_ranks):
    _, results = two_ranks
    for r in results:
        msg = r["bad_input"]["divide"]
        assert msg.startswith("make_private_distributed failed on every rank: ValueError: ")
        assert (
            "global_physical_batch_size=5 is not allowed: expected a multiple of world_size=2"
            in msg
        )


def test_a_rank_that_never_joins_gives_a_timeout_not_a_hang(two_ranks):
    _, results = two_ranks
    bad = results[0]["bad_input"]
    assert bad["timeout"] != "no error"
    assert "time" in bad["timeout"].lower()  # "Timed out waiting ..."
    assert bad["timeout_s"] < 15
