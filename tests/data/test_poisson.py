"""Poisson sampling: batch-size law, inclusion rates, empty batches, chunks, resume, errors.

Statistical checks use fixed seeds and bounds at least 5 standard errors wide,
so they are deterministic and would only fail for a real bias.
"""

import importlib
import json
import math
import re

import pytest
import torch

from dptrain.data import DPDataLoader, LogicalBatch, PoissonBatchSampler, split_physical


def raises(message):
    return pytest.raises(ValueError, match="^" + re.escape(message) + "$")


# -- the sampling law --------------------------------------------------------------


@pytest.fixture(scope="module")
def many_batches():
    n, q, steps = 1000, 0.05, 2000
    batches = list(PoissonBatchSampler(n, q, steps, seed=1234))
    return n, q, steps, batches


def test_batch_size_mean_and_variance_are_binomial(many_batches):
    n, q, steps, batches = many_batches
    assert len(batches) == steps
    sizes = torch.tensor([len(b) for b in batches], dtype=torch.float64)
    mean, var = n * q, n * q * (1 - q)
    # Standard errors of the sample mean and (near-normal) sample variance.
    assert abs(sizes.mean().item() - mean) < 5 * math.sqrt(var / steps)
    assert abs(sizes.var().item() - var) < 5 * var * math.sqrt(2 / (steps - 1))


def test_each_record_is_included_with_probability_q(many_batches):
    n, q, steps, batches = many_batches
    counts = torch.zeros(n)
    for b in batches:
        counts[b] += 1
    freq = counts / steps
    se = math.sqrt(q * (1 - q) / steps)
    # The largest of N deviations: 6 standard errors leaves room for the maximum.
    assert (freq - q).abs().max().item() < 6 * se
    # No record is systematically left out or favoured.
    assert counts.min().item() > 0


def test_indices_are_unique_sorted_and_in_range(many_batches):
    n, _, _, batches = many_batches
    for b in batches:
        assert all(isinstance(i, int) for i in b)
        assert b == sorted(set(b))
        assert all(0 <= i < n for i in b)


def test_membership_is_the_float64_uniform_draw():
    """The documented exact method: record i joins iff U_i < q, U_i uniform with 53 bits."""
    n, q = 500, 0.3
    sampler = PoissonBatchSampler(n, q, 3, seed=7)
    reference = torch.Generator().manual_seed(7)
    for batch in sampler:
        u = torch.rand(n, generator=reference, dtype=torch.float64)
        assert batch == torch.nonzero(u < q).flatten().tolist()


def test_q_one_takes_every_record():
    assert list(PoissonBatchSampler(5, 1.0, 3, seed=0)) == [[0, 1, 2, 3, 4]] * 3


def test_empty_batches_are_yielded_not_skipped():
    n, q, steps = 10, 0.01, 50
    batches = list(PoissonBatchSampler(n, q, steps, seed=3))
    assert len(batches) == steps
    empty = sum(1 for b in batches if b == [])
    assert empty > 0
    assert empty > steps // 2  # P(empty) = 0.99**10 ~ 0.90


def test_schedule_changes_the_mean_batch_size():
    n, steps = 1000, 1000

    def schedule(step):
        return 0.01 if step < 500 else 0.04

    sampler = PoissonBatchSampler(n, schedule, steps, seed=11)
    assert sampler.sample_rate_at(0) == 0.01
    assert sampler.sample_rate_at(500) == 0.04
    sizes = torch.tensor([len(b) for b in sampler], dtype=torch.float64)
    for part, q in ((sizes[:500], 0.01), (sizes[500:], 0.04)):
        se = math.sqrt(n * q * (1 - q) / len(part))
        assert abs(part.mean().item() - n * q) < 5 * se


def test_len_and_exhaustion():
    sampler = PoissonBatchSampler(20, 0.5, 4, seed=0)
    assert len(sampler) == 4
    assert len(list(sampler)) == 4
    assert sampler.steps_drawn == 4
    assert list(sampler) == []  # the run's steps are spent; no extra batches
    assert list(PoissonBatchSampler(20, 0.5, 0, seed=0)) == []


# -- seeds and checkpoints ---------------------------------------------------------


def test_explicit_seed_reproduces_and_is_exposed():
    a = PoissonBatchSampler(100, 0.2, 5, seed=42)
    b = PoissonBatchSampler.from_seed(100, 0.2, 5, seed=42)
    assert a.seed == b.seed == 42
    assert list(a) == list(b)


def test_os_seeded_samplers_differ_and_expose_their_seed():
    a = PoissonBatchSampler(1000, 0.5, 1)
    b = PoissonBatchSampler(1000, 0.5, 1)
    assert isinstance(a.seed, int) and isinstance(b.seed, int)
    assert a.seed != b.seed
    first_a, first_b = next(iter(a)), next(iter(b))
    assert first_a != first_b
    # The logged seed reproduces the run.
    assert next(iter(PoissonBatchSampler(1000, 0.5, 1, seed=a.seed))) == first_a


def test_given_generator_is_used_and_seed_unknown():
    g = torch.Generator().manual_seed(5)
    sampler = PoissonBatchSampler(50, 0.3, 2, generator=g)
    assert sampler.generator is g
    assert sampler.seed is None
    assert list(sampler) == list(PoissonBatchSampler(50, 0.3, 2, seed=5))


def test_state_dict_resume_continues_the_same_batches():
    def q(step):
        return 0.1 + 0.05 * step

    sampler = PoissonBatchSampler(200, q, 5, seed=99)
    it = iter(sampler)
    first = [next(it) for _ in range(3)]
    state = json.loads(json.dumps(sampler.state_dict()))  # survives a JSON checkpoint
    rest = list(it)
    assert len(first) == 3 and len(rest) == 2

    resumed = PoissonBatchSampler(200, q, 5)  # a fresh OS seed, overwritten by the state
    resumed.load_state_dict(state)
    assert resumed.steps_drawn == 3
    assert resumed.seed == 99
    assert list(resumed) == rest
    # The same five batches as an uninterrupted run.
    assert first + rest == list(PoissonBatchSampler(200, q, 5, seed=99))


def test_state_whose_generator_state_was_moved_resumes():
    """A state that went through accelerate's move_to_device as a tensor (on the GPU)."""
    from tests.fake_device import FakeCudaTensor

    sampler = PoissonBatchSampler(100, 0.2, 4, seed=3)
    it = iter(sampler)
    next(it)
    state = sampler.state_dict()
    rest = list(it)
    moved = torch.tensor(state["generator_state"], dtype=torch.uint8)
    resumed = PoissonBatchSampler(100, 0.2, 4)
    resumed.load_state_dict({**state, "generator_state": FakeCudaTensor(moved)})
    assert list(resumed) == rest


def test_loader_state_dict_resume():
    data = torch.arange(30.0)
    loader = DPDataLoader(data, 0.3, 4, max_physical_batch_size=3, seed=8)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    rest = list(it)
    resumed = DPDataLoader(data, 0.3, 4, max_physical_batch_size=3)
    resumed.load_state_dict(state)
    again = list(resumed)
    assert [b.step for b in again] == [1, 2, 3]
    for x, y in zip(rest, again, strict=True):
        assert x.size == y.size and len(x.chunks) == len(y.chunks)
        for cx, cy in zip(x.chunks, y.chunks, strict=True):
            assert torch.equal(cx, cy)


# -- physical chunks ---------------------------------------------------------------


def test_split_physical():
    assert split_physical(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert split_physical([9, 2, 5, 1], 2) == [[9, 2], [5, 1]]
    assert split_physical([4, 8], 10) == [[4, 8]]
    assert split_physical([3], 1) == [[3]]
    assert split_physical([], 4) == []
    assert split_physical(range(5), 2) == [[0, 1], [2, 3], [4]]


# -- the loader --------------------------------------------------------------------


class PairDataset:
    """A record is (features, label); features encode the index to check collation."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([float(i), -float(i)]), i % 3


def test_loader_collates_chunks_of_the_sampled_records():
    n, q, steps, max_physical = 100, 0.2, 20, 7
    loader = DPDataLoader(PairDataset(n), q, steps, max_physical, seed=21)
    assert len(loader) == steps
    assert loader.dataset_size == n
    assert loader.seed == 21
    assert loader.expected_batch_size(0) == pytest.approx(q * n)
    expected = list(PoissonBatchSampler(n, q, steps, seed=21))
    batches = list(loader)
    assert len(batches) == steps
    for step, (batch, indices) in enumerate(zip(batches, expected, strict=True)):
        assert isinstance(batch, LogicalBatch)
        assert batch.step == step
        assert batch.sample_rate == q
        assert batch.size == len(indices)
        assert len(batch.chunks) == math.ceil(len(indices) / max_physical)
        seen = []
        for features, labels in batch.chunks:
            assert features.shape[0] <= max_physical and features.shape[1:] == (2,)
            assert features.dtype == torch.float32 and labels.dtype == torch.int64
            assert torch.equal(features[:, 1], -features[:, 0])
            assert torch.equal(labels, features[:, 0].long() % 3)
            seen += features[:, 0].long().tolist()
        assert seen == indices


def test_loader_yields_empty_batches_and_records_the_schedule():
    def schedule(step):
        return 0.001 if step % 2 == 0 else 0.5

    loader = DPDataLoader(torch.arange(10.0), schedule, 40, 4, seed=2)
    assert loader.expected_batch_size(0) == pytest.approx(0.01)
    assert loader.expected_batch_size(1) == pytest.approx(5.0)
    batches = list(loader)
    assert len(batches) == 40
    assert [b.sample_rate for b in batches] == [schedule(s) for s in range(40)]
    empty = [b for b in batches if b.size == 0]
    assert empty and all(b.chunks == [] for b in empty)
    for b in batches:
        assert sum(len(c) for c in b.chunks) == b.size
        assert all(0 < len(c) <= 4 for c in b.chunks)


def test_loader_custom_collate():
    loader = DPDataLoader(list("abcdef"), 1.0, 1, 4, collate_fn="".join, seed=0)
    (batch,) = list(loader)
    assert batch.chunks == ["abcd", "ef"]
    assert batch.size == 6


# -- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -3, 2.5, True])
def test_bad_dataset_size(n):
    with raises(f"dataset_size={n!r} is not allowed: expected an integer >= 1"):
        PoissonBatchSampler(n, 0.1, 10)


def test_empty_dataset():
    with raises("len(dataset)=0 is not allowed: expected an integer >= 1"):
        DPDataLoader([], 0.1, 10, 4)


@pytest.mark.parametrize("steps", [-1, 1.5])
def test_bad_steps(steps):
    with raises(f"steps={steps!r} is not allowed: expected an integer >= 0"):
        PoissonBatchSampler(10, 0.1, steps)


@pytest.mark.parametrize("q", [0, 0.0, -0.1, 1.5])
def test_sample_rate_outside_unit_interval(q):
    with raises(f"sample_rate={q!r} is outside the allowed range (0, 1]"):
        PoissonBatchSampler(10, q, 10)
    with raises(f"sample_rate={q!r} is outside the allowed range (0, 1]"):
        DPDataLoader([1, 2], q, 10, 4)


@pytest.mark.parametrize("q", [float("nan"), float("inf"), "0.1", None])
def test_sample_rate_not_a_number(q):
    with raises(f"sample_rate={q!r} is not allowed: expected a finite real number"):
        PoissonBatchSampler(10, q, 10)


def test_bad_schedule_raises_at_its_step():
    sampler = PoissonBatchSampler(10, lambda step: 0.5 if step < 2 else 1.5, 5, seed=0)
    it = iter(sampler)
    next(it), next(it)
    with raises("sample_rate(step=2)=1.5 is outside the allowed range (0, 1]"):
        next(it)
    assert sampler.steps_drawn == 2  # the bad step was not drawn
    with raises("sample_rate(step=3)=0 is outside the allowed range (0, 1]"):
        PoissonBatchSampler(10, lambda step: 0, 5).sample_rate_at(3)
    with raises("sample_rate(step=0)=nan is not allowed: expected a finite real number"):
        DPDataLoader([1, 2], lambda step: float("nan"), 1, 1).expected_batch_size(0)


def test_bad_step_query():
    with raises("step=-1 is not allowed: expected an integer >= 0"):
        PoissonBatchSampler(10, 0.1, 5).sample_rate_at(-1)


@pytest.mark.parametrize("size", [0, -2, 1.5])
def test_bad_max_physical_batch_size(size):
    with raises(f"max_physical_batch_size={size!r} is not allowed: expected an integer >= 1"):
        split_physical([1, 2, 3], size)
    with raises(f"max_physical_batch_size={size!r} is not allowed: expected an integer >= 1"):
        DPDataLoader([1, 2, 3], 0.5, 2, size)


def test_bad_seed_and_generator():
    with raises("seed=-1 is not allowed: expected an integer >= 0"):
        PoissonBatchSampler(10, 0.1, 5, seed=-1)
    with raises("seed=18446744073709551616 is outside the allowed range [0, 2**64 - 1]"):
        PoissonBatchSampler(10, 0.1, 5, seed=2**64)
    with raises("generator=3 is not allowed: expected a torch.Generator"):
        PoissonBatchSampler(10, 0.1, 5, generator=3)
    g = torch.Generator()
    with raises(f"generator={g!r} and seed=1 are both given: pass at most one"):
        PoissonBatchSampler(10, 0.1, 5, generator=g, seed=1)


def test_bad_state():
    state = PoissonBatchSampler(10, 0.1, 5, seed=0).state_dict()
    with raises("state dataset_size=10 does not match this sampler's dataset_size=11"):
        PoissonBatchSampler(11, 0.1, 5).load_state_dict(state)
    with raises("sampler format_version=None is not supported: expected 1"):
        PoissonBatchSampler(10, 0.1, 5).load_state_dict({})
    with raises("steps_drawn=5 is not allowed: expected an integer <= steps=3"):
        PoissonBatchSampler(10, 0.1, 3).load_state_dict({**state, "steps_drawn": 5})


# -- public API --------------------------------------------------------------------


@pytest.mark.parametrize("module_name", ["dptrain.data", "dptrain.data.poisson"])
def test_public_names_import_and_are_documented(module_name):
    module = importlib.import_module(module_name)
    assert module.__doc__
    for name in module.__all__:
        obj = getattr(module, name)
        assert obj.__doc__, f"{module_name}.{name} has no docstring"


# -- user-level sampling: units packed whole into chunks ----------------------------------


def test_pack_units_keeps_units_whole_and_cuts_only_the_large_ones():
    from dptrain.data import pack_units

    units = [[0, 1], [2], [3, 4, 5, 6, 7], [8, 9, 10], [11]]
    packed = pack_units(units, 3)
    assert [recs for recs, _ in packed] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9, 10], [11]]
    ids = [u.ids.tolist() for _, u in packed]
    assert ids == [[0, 0, 1], [2, 2, 2], [2, 2], [3, 3, 3], [4]]
    assert [(u.part, u.parts) for _, u in packed] == [(0, 1), (0, 2), (1, 2), (0, 1), (0, 1)]
    assert all(len(recs) <= 3 for recs, _ in packed)
    assert pack_units([], 3) == []


def test_user_level_loader_draws_whole_users():
    from dptrain.data import DPDataLoader

    user_ids = ["a", "b", "a", "c", "b", "a", "d"]
    loader = DPDataLoader(list(range(7)), 0.5, 40, 2, seed=3, unit_ids=user_ids)
    assert loader.dataset_size == 4
    sizes = []
    for batch in loader:
        seen = [int(i) for chunk in batch.chunks for i in chunk]
        users = {user_ids[i] for i in seen}
        assert sorted(seen) == [i for i, u in enumerate(user_ids) if u in users]
        assert batch.num_units == len(users)
        sizes.append(batch.num_units)
    assert 1.2 < sum(sizes) / len(sizes) < 2.8  # about q * 4 = 2 users per batch


def test_chunk_key_sorts_each_batch_and_keeps_its_records():
    n, key = 60, [(7 * i) % 13 for i in range(60)]
    plain = DPDataLoader(PairDataset(n), 0.3, 10, 4, seed=5)
    keyed = DPDataLoader(PairDataset(n), 0.3, 10, 4, seed=5, chunk_key=key.__getitem__)
    for a, b in zip(plain, keyed, strict=True):
        ra = [int(i) for f, _ in a.chunks for i in f[:, 0]]
        rb = [int(i) for f, _ in b.chunks for i in f[:, 0]]
        assert sorted(rb) == ra and b.size == a.size  # the same sampled records
        assert [key[i] for i in rb] == sorted(key[i] for i in ra)  # chunked in key order
        assert [len(f) for f, _ in b.chunks] == [len(f) for f, _ in a.chunks]


def test_chunk_key_places_a_user_by_its_largest_record():
    from dptrain.data import order_for_chunks

    members = [[0, 1], [2], [3, 4, 5]]
    key = [5, 0, 3, 1, 1, 9].__getitem__  # user 0: max 5, user 1: 3, user 2: 9
    assert order_for_chunks([0, 1, 2], key, members) == [1, 0, 2]
    assert order_for_chunks([2, 0], None, members) == [2, 0]  # no key: sampled order
    user_ids = ["a", "a", "b", "c", "c", "c"]
    loader = DPDataLoader(list(range(6)), 1.0, 1, 6, seed=0, unit_ids=user_ids, chunk_key=key)
    (batch,) = list(loader)
    assert [int(i) for chunk in batch.chunks for i in chunk] == [2, 0, 1, 3, 4, 5]


def test_secure_sampling_draws_from_os_urandom_and_refuses_a_seed(monkeypatch):
    import dptrain.secure_random as secure_random

    with pytest.raises(ValueError, match=r"^secure=True with generator=None, seed=3: .*cannot be"):
        PoissonBatchSampler(100, 0.5, 2, seed=3, secure=True)
    # all-zero bytes: every uniform is 0 < q, so every record joins every batch
    monkeypatch.setattr(secure_random.os, "urandom", lambda n: bytes(n))
    sampler = PoissonBatchSampler(100, 0.01, 2, secure=True)
    assert list(sampler) == [list(range(100))] * 2
