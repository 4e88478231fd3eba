"""FSDP2 (``fully_shard``) under dptrain: W gloo processes against one process.

One spawn of 2 processes runs every scenario of :mod:`tests.distributed.fsdp_run`
(a tied Llama from a config, sharded per decoder layer and at the root); the
references run here, in one process, without sharding. Every comparison is of
full (gathered) tensors.
"""

from __future__ import annotations

import math

import pytest
import torch

from dptrain.distributed import spawn
from dptrain.distributed.sharded_optimizer import noise_seed
from tests.distributed import fsdp_run
from tests.distributed.fsdp_run import N_RECORDS, SEED, C

OUTLIER = 17  # a record of the dataset; with batch N and q = 1 every record is sampled
CASES = {
    "book_keeping": dict(mode="book_keeping"),
    "ghost": dict(mode="ghost"),
    "per_layer": dict(clipping="per_layer"),
    "automatic": dict(clipping="automatic"),
    "lora": dict(lora=True),
    "bf16": dict(dtype=torch.bfloat16),
    "noised": dict(sigma=1.0),
    "outlier": dict(batch=N_RECORDS, chunk=7, outlier=OUTLIER, scale=1e6),
    "removed": dict(batch=N_RECORDS, chunk=7, outlier=OUTLIER, scale=0.0),
    "make_private": dict(entry="make_private"),
    "autocast": dict(autocast=True),
    "users": dict(users=True, batch=7, chunk=5),
}
REFUSALS = ("offload", "mixed_precision", "user_ids", "unsharded_root", "outside_use")


def _run(world: int, names: tuple[str, ...], refusals: tuple[str, ...] = ()) -> dict:
    cases = [dict(sharded=True, **CASES[n]) for n in names]
    out = spawn(fsdp_run.scenarios, world, (cases, refusals), timeout=120, join_timeout=900)
    return {
        "ranks": [dict(zip(names, results, strict=True)) for results, _ in out],
        "refusals": out[0][1],
    }


@pytest.fixture(scope="module")
def two():
    return _run(2, tuple(CASES), REFUSALS)


@pytest.fixture(scope="module")
def reference():
    """The same runs in one process, unsharded (cached per case)."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            case = dict(CASES[name], sharded=False)
            case.pop("entry", None)
            cache[name] = fsdp_run.private_run(**case)
        return cache[name]

    return get


def _assert_close(mine: dict, ref: dict, rel: float) -> None:
    assert mine.keys() == ref.keys()
    scale = max(float(t.abs().max()) for t in ref.values())
    for name, t in ref.items():
        err = float((mine[name] - t).abs().max())
        assert err <= rel * scale, f"{name}: {err:.3g} > {rel:g} x {scale:.3g}"


@pytest.mark.parametrize("case", ["book_keeping", "ghost", "per_layer", "automatic", "lora"])
def test_clipped_sums_equal_one_process(two, reference, case):
    ref = reference(case)
    assert ref["sums"], "the reference clipped nothing"
    for rank in two["ranks"]:
        assert rank[case]["sizes"] == ref["sizes"]  # the same Poisson batch
        _assert_close(rank[case]["sums"], ref["sums"], 1e-6)
        assert rank[case]["optimizer"] == "ShardedDPOptimizer"


def test_user_level_sums_equal_one_process(two, reference):
    """Users (2 records each) packed whole per rank, chunks padded to equal sizes with a
    padding unit of weight 0: the reduced sum is the one-process user-level sum."""
    ref = reference("users")
    for rank in two["ranks"]:
        assert rank["users"]["sizes"] == ref["sizes"]
        _assert_close(rank["users"]["sums"], ref["sums"], 1e-6)
    assert two["ranks"][0]["users"]["ledger"]["privacy_unit"] == "user"
    padded = [pad for rank in two["ranks"] for pad in rank["users"]["padding"][0]]
    assert any(padded), padded  # the seed gives the ranks unequal packings


def test_lora_clips_only_the_adapters(two):
    names = two["ranks"][0]["lora"]["sums"].keys()
    assert names and all("lora_" in n for n in names)


def test_bf16_parameters_get_float32_sums_close_to_one_process(two, reference):
    ref = reference("bf16")
    for rank in two["ranks"]:
        # bf16 records in chunks of different examples round differently; float32 sums
        _assert_close(rank["bf16"]["sums"], ref["sums"], 2e-2)


def test_bf16_autocast_close_to_one_process(two, reference):
    ref = reference("autocast")
    for rank in two["ranks"]:
        _assert_close(rank["autocast"]["sums"], ref["sums"], 2e-2)


def test_make_private_on_a_sharded_model_shards_too(two, reference):
    ref = reference("make_private")
    for rank in two["ranks"]:
        assert rank["make_private"]["optimizer"] == "ShardedDPOptimizer"
        _assert_close(rank["make_private"]["sums"], ref["sums"], 1e-6)


def test_noised_update_is_the_one_process_update_with_keyed_noise(two, reference):
    """p1 = p0 - (S + z) / (q N), z drawn whole from the key of (seed, step 0, name): each
    rank added its own shard's coordinates of one draw (two ranks adding the same
    stream, or any coordinate twice, would not give this)."""
    ref = reference("noised")
    run = two["ranks"][0]["noised"]
    expected = {}
    for name, p0 in run["initial"].items():
        gen = torch.Generator().manual_seed(noise_seed(SEED, 0, name))
        z = torch.empty(p0.shape, dtype=torch.float32).normal_(0.0, 1.0 * C, generator=gen)
        expected[name] = p0 - (ref["sums"][name] + z.double()) / run["divisor"]
    for rank in two["ranks"]:
        _assert_close(rank["noised"]["params"], expected, 1e-6)
    # and the noise is there: the update is far from the clipped sum alone
    name = "model.embed_tokens.weight"
    moved = run["initial"][name] - run["params"][name]
    assert float((moved * run["divisor"] - ref["sums"][name]).std()) > 0.5 * C


def test_chunks_are_equal_on_every_rank_and_padding_is_exercised(two):
    runs = [rank["book_keeping"] for rank in two["ranks"]]
    assert any(pad for run in runs for pad in run["padding"][0])  # 9 records on 2 ranks


def test_every_rank_holds_the_same_model_and_ledger(two):
    first, *others = two["ranks"]
    for rank in others:
        for case in CASES:
            assert rank[case]["ledger"] == first[case]["ledger"]
            for name, t in first[case]["params"].items():
                assert torch.equal(rank[case]["params"][name], t), (case, name)


def test_one_record_moves_the_reduced_sum_by_at_most_c(two):
    """Its loss scaled by 1e6 vs weighted 0 (removed), every other record the same."""
    for rank in two["ranks"]:
        a, b = rank["outlier"]["sums"], rank["removed"]["sums"]
        moved = math.sqrt(sum(float((a[n] - b[n]).pow(2).sum()) for n in a))
        assert 0.99 * C <= moved <= C * (1 + 1e-6), moved


def test_noise_keys_differ_by_step_and_parameter():
    seeds = {noise_seed(SEED, t, n) for t in range(50) for n in ("a.weight", "b.weight", "a.bias")}
    assert len(seeds) == 150
    assert noise_seed(SEED, 0, "a") != noise_seed(SEED + 1, 0, "a")


@pytest.mark.parametrize(
    ("kind", "words"),
    [
        ("offload", ["CPUOffloadPolicy", "offload"]),
        ("mixed_precision", ["MixedPrecisionPolicy", "param_dtype"]),
        ("user_ids", ["max_physical_batch_size=3", "largest user has 10 records", ">= 10"]),
        ("unsharded_root", ["not sharded by FSDP2", "model.embed_tokens.weight", "fully_shard"]),
        ("outside_use", ["head.weight", "outside the forward of the module"]),
    ],
)
def test_unsupported_sharding_is_refused_by_name(two, kind, words):
    message = two["refusals"][kind]
    assert message, f"{kind} was accepted"
    for w in words:
        assert w in message, message


def test_fsdp1_is_refused_with_a_pointer_to_fsdp2():
    """FSDP1 cannot be built on a CPU (it needs an accelerator): an instance made without
    its constructor stands in, which is all the refusal looks at (its type)."""
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel

    from dptrain.clipping import UnsupportedModelError
    from dptrain.privacy_engine import make_private

    wrapped = nn.Module.__new__(FullyShardedDataParallel)
    nn.Module.__init__(wrapped)
    model = fsdp_run.llama()
    model.add_module("wrapped", wrapped)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with pytest.raises(
        UnsupportedModelError, match=r"wrapped is wrapped in FullyShardedDataParallel"
    ):
        make_private(
            model,
            opt,
            fsdp_run.data(),
            batch_size=9,
            max_grad_norm=C,
            steps=1,
            noise_multiplier=1.0,
        )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fsdp2_one_process_smoke():
    """One FSDP2 process on a GPU (nccl): a step runs, and one record moves the sum <= C."""
    cases = [dict(CASES[n], sharded=True, device="cuda") for n in ("outlier", "removed")]
    (runs, _), *_ = spawn(fsdp_run.scenarios, 1, (cases,), backend="nccl", timeout=120)
    a, b = runs[0]["sums"], runs[1]["sums"]
    moved = math.sqrt(sum(float((a[n] - b[n]).pow(2).sum()) for n in a))
    assert 0.99 * C <= moved <= C * (1 + 1e-5), moved


def test_four_processes_equal_one(reference):
    names = ("book_keeping", "noised", "outlier", "removed")
    four = _run(4, names)
    for rank in four["ranks"]:
        _assert_close(rank["book_keeping"]["sums"], reference("book_keeping")["sums"], 1e-6)
        a, b = rank["outlier"]["sums"], rank["removed"]["sums"]
        moved = math.sqrt(sum(float((a[n] - b[n]).pow(2).sum()) for n in a))
        assert 0.99 * C <= moved <= C * (1 + 1e-6)
    two_like = four["ranks"][0]["noised"]
    for rank in four["ranks"][1:]:
        for name, t in two_like["params"].items():
            assert torch.equal(rank["noised"]["params"][name], t)
