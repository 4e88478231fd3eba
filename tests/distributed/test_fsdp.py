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

from dptrain.distributed import sharded_optimizer, spawn
from dptrain.distributed.sharded_optimizer import noise_seed
from tests.distributed import fsdp_run
from tests.distributed.fsdp_run import N_RECORDS, SEED, C

NOISE_BLOCK = 100
OUTLIER = 17  # a record of the dataset; with batch N and q = 1 every record is sampled
CASES = {
    "book_keeping": dict(mode="book_keeping"),
    "ghost": dict(mode="ghost"),
    "per_layer": dict(clipping="per_layer"),
    "automatic": dict(clipping="automatic"),
    "lora": dict(lora=True),
    "bf16": dict(dtype=torch.bfloat16),
    # noise keyed per block of 100 coordinates: shards (1/2, 1/4 of each parameter's
    # rows) start and end inside blocks, and each rank draws only the blocks it overlaps
    "noised": dict(sigma=1.0, noise_block=NOISE_BLOCK),
    "outlier": dict(batch=N_RECORDS, chunk=7, outlier=OUTLIER, scale=1e6),
    "removed": dict(batch=N_RECORDS, chunk=7, outlier=OUTLIER, scale=0.0),
    "make_private": dict(entry="make_private"),
    "autocast": dict(autocast=True),
    "users": dict(users=True, batch=7, chunk=5),
}
REFUSALS = ("offload", "mixed_precision", "unsharded_root", "outside_use", "secure_unsharded")
BIG_USER = [i for i, u in enumerate(fsdp_run.BIG_USERS) if u == 0]  # 7 records: 3 chunks
N_USERS = len(set(fsdp_run.BIG_USERS))
#: a second spawn (each stays under 40 s): secure mode, users larger than a chunk
MORE = {
    "secure": dict(secure=True, sigma=1.0, dtype=torch.float64, batch=16),
    "big_users": dict(users="big", batch=N_USERS, chunk=3),
    "big_outlier": dict(users="big", batch=N_USERS, chunk=3, outlier=BIG_USER, scale=1e6),
    "big_removed": dict(users="big", batch=N_USERS, chunk=3, outlier=BIG_USER, scale=0.0),
    "store": dict(bucket_bytes=120),  # buckets of one to a few of STORE_SHAPES
}


def _run(
    world: int, names: tuple[str, ...], refusals: tuple[str, ...] = (), table: dict = CASES
) -> dict:
    cases = [dict(sharded=True, **table[n]) for n in names]
    out = spawn(fsdp_run.scenarios, world, (cases, refusals), timeout=120, join_timeout=900)
    return {
        "ranks": [dict(zip(names, results, strict=True)) for results, _ in out],
        "refusals": out[0][1],
    }


@pytest.fixture(scope="module")
def two():
    return _run(2, tuple(CASES), REFUSALS)


@pytest.fixture(scope="module")
def more():
    return _run(2, tuple(MORE), table=MORE)


@pytest.fixture(scope="module")
def reference():
    """The same runs in one process, unsharded (cached per case)."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            case = dict(CASES[name] if name in CASES else MORE[name], sharded=False)
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


def _expected_noised(run: dict, sums: dict, monkeypatch) -> dict:
    """p0 - (S + z) / (q N), z parameter by parameter, drawn whole from the keys of (seed,
    step 0, name, block) with the run's blocks."""
    monkeypatch.setattr(sharded_optimizer, "NOISE_BLOCK", NOISE_BLOCK)
    expected = {}
    for name, p0 in run["initial"].items():
        n = p0.numel()
        z = sharded_optimizer.keyed_noise(SEED, 0, name, n, 0, n, 1.0 * C).view(p0.shape)
        expected[name] = p0 - (sums[name] + z.double()) / run["divisor"]
    return expected


def test_noised_update_is_the_one_process_update_with_keyed_noise(two, reference, monkeypatch):
    """p1 = p0 - (S + z) / (q N), z the keyed draw of the whole parameter: each rank drew
    the blocks its shard overlaps and added its own coordinates (two ranks adding the same
    stream, any coordinate twice or a block's coordinates from another block's key would
    not give this)."""
    ref = reference("noised")
    run = two["ranks"][0]["noised"]
    expected = _expected_noised(run, ref["sums"], monkeypatch)
    assert any(p.numel() > 2 * NOISE_BLOCK for p in run["initial"].values())
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
        ("unsharded_root", ["not sharded by FSDP2", "model.embed_tokens.weight", "fully_shard"]),
        ("outside_use", ["head.weight", "outside the forward of the module"]),
        ("secure_unsharded", ["secure_mode=True", "unsharded", "FSDP2-sharded"]),
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


# slow (21 s): the two-process tests above keep sharding in the default run
@pytest.mark.slow
def test_four_processes_equal_one(reference, monkeypatch):
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
    # the same noise as one process's keyed draw (and two processes'): blocks are fixed
    # by the parameter, not by the sharding
    expected = _expected_noised(two_like, reference("noised")["sums"], monkeypatch)
    _assert_close(two_like["params"], expected, 1e-6)


# -- secure_mode on a sharded model ------------------------------------------------------------


def _secure_noise(run: dict) -> dict[str, torch.Tensor]:
    """The noise the step added: z = (p0 - p1) q N - S (SGD, lr 1; float64 parameters, so
    the recovery is exact to ~1e-15 of the noise's scale)."""
    return {
        n: (p0 - run["params"][n]) * run["divisor"] - run["sums"][n]
        for n, p0 in run["initial"].items()
    }


def _chi2_bounds(n: int) -> tuple[float, float]:
    """Bounds on sum z^2 / std^2 over n N(0, std^2) draws that hold but with probability
    2e-9: a wrong std (or coordinates noised twice, or never) cannot pass by luck."""
    from scipy.stats import chi2

    return float(chi2.ppf(1e-9, n)), float(chi2.isf(1e-9, n))


def test_secure_mode_noises_each_coordinate_once_with_the_right_std(more):
    """Each rank drew only its own rows' noise from the OS's CSPRNG: over the whole model and
    over each rank's rows the noise is N(0, (sigma C)^2) (chi-square, 2e-9 bounds: a
    coordinate noised by two ranks has variance 2 (sigma C)^2, one noised by none 0), no
    coordinate is left without noise, and the ranks' draws are uncorrelated (two ranks
    drawing one stream would give r = 1)."""
    runs = [rank["secure"] for rank in more["ranks"]]
    assert all(run["secure"] for run in runs)  # secure noise and secure sampling
    std = 1.0 * C
    noise = _secure_noise(runs[0])
    assert {n: z.shape for n, z in noise.items()} == {
        n: p.shape for n, p in runs[0]["initial"].items()
    }
    flat = torch.cat([z.flatten() for z in noise.values()])
    lo, hi = _chi2_bounds(flat.numel())
    assert lo <= float((flat / std).pow(2).sum()) <= hi, float(flat.std() / std)
    assert float(flat.abs().min()) > 1e-9 * std  # P(|z| < 1e-9 std) ~ 1e-9 per coordinate
    # each rank's own rows (FSDP2 Shard(0): rows [r c, (r + 1) c), c = ceil(rows / W))
    world = len(runs)
    mine = []
    for r in range(world):
        rows = []
        for name, z in noise.items():
            c = -(-z.shape[0] // world)
            assert runs[r]["owned"][name] == z[r * c : (r + 1) * c].shape[0], name
            rows.append(z[r * c : (r + 1) * c].flatten())
        mine.append(torch.cat(rows))
        lo, hi = _chi2_bounds(mine[r].numel())
        assert lo <= float((mine[r] / std).pow(2).sum()) <= hi, (r, float(mine[r].std() / std))
    n = min(v.numel() for v in mine)
    corr = float(torch.corrcoef(torch.stack([mine[0][:n], mine[1][:n]]))[0, 1])
    assert abs(corr) < 6 / math.sqrt(n), corr


def test_secure_mode_ranks_share_one_batch_drawn_by_rank_0(more):
    """Rank 0 drew the Poisson batch from the CSPRNG and broadcast it: every rank saw the
    same global size and the ranks' records are disjoint and add up to it (ranks drawing
    their own batches would overlap or miss); the ledger is the same on every rank."""
    runs = [rank["secure"] for rank in more["ranks"]]
    assert len({tuple(run["sizes"]) for run in runs}) == 1
    seen = [i for run in runs for i in run["records"][0]]
    assert len(seen) == len(set(seen)) == runs[0]["sizes"][0] > 0
    assert all(run["ledger"] == runs[0]["ledger"] for run in runs)
    assert runs[0]["ledger"]["segments"], runs[0]["ledger"]


# -- users larger than a chunk ----------------------------------------------------------------


def test_users_larger_than_a_chunk_sum_as_one_process(more, reference):
    """Users of 7, 4 and 5 records with chunks of 3: each rank accumulates its large users
    over the same number of equal-shape parts (padded with the user's own records, or
    padding alone where a rank has no such user) and clips each once; the reduced sum is
    the one-process user-level sum."""
    ref = reference("big_users")
    assert ref["sums"]
    for rank in more["ranks"]:
        run = rank["big_users"]
        assert run["sizes"] == ref["sizes"] == [fsdp_run.N_RECORDS]
        _assert_close(run["sums"], ref["sums"], 1e-6)
    chunks = [len(rank["big_users"]["padding"][0]) for rank in more["ranks"]]
    assert len(set(chunks)) == 1  # the same passes on every rank
    # rank 1 has one large user (4 records) and padding alone in the second slot
    assert any(p == 3 for p in more["ranks"][1]["big_users"]["padding"][0])
    seen = sorted(i for rank in more["ranks"] for i in rank["big_users"]["records"][0])
    assert seen == list(range(fsdp_run.N_RECORDS))


def test_one_user_larger_than_a_chunk_moves_the_reduced_sum_by_at_most_c(more):
    """User 0 (7 records over 3 chunks) with its losses scaled by 1e6 vs weighted 0."""
    for rank in more["ranks"]:
        a, b = rank["big_outlier"]["sums"], rank["big_removed"]["sums"]
        moved = math.sqrt(sum(float((a[n] - b[n]).pow(2).sum()) for n in a))
        assert 0.99 * C <= moved <= C * (1 + 1e-6), moved


# -- the bucketed reduction -------------------------------------------------------------------


def test_bucketed_reduce_scatter_is_the_sum_over_ranks(more):
    """ShardedGradStore's flat reduce-scatter per bucket (several buckets, a parameter
    larger than a bucket reduced alone, rows cut unevenly, a rank adding None) gives
    each parameter the sum of every rank's additions over two chunks."""
    runs = [rank["store"] for rank in more["ranks"]]
    for k, shape in enumerate(fsdp_run.STORE_SHAPES):
        want = sum(
            torch.zeros(shape, dtype=torch.float64) if t is None else t[k].double()
            for run in runs
            for chunk in run["added"]
            for t in [None if chunk[k] is None else chunk]
        )
        for run in runs:
            _assert_close({"p": run["grads"][k]}, {"p": want}, 1e-6)
    # the uneven cuts were exercised: 5 rows -> 3, 2 and 1 row -> 1, 0
    assert [run["local"][0][0] for run in runs] == [3, 2]
    assert [run["local"][2][0] for run in runs] == [1, 0]
