"""Each rank's share of the logical batches: the shares partition the one-process batch."""

from __future__ import annotations

import re

import pytest
import torch

from dptrain.data import DPDataLoader
from dptrain.distributed import DistributedDPDataLoader, shard_indices


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


def test_a_sharded_loader_keeps_the_chunk_key():
    data = torch.utils.data.TensorDataset(torch.arange(200))
    key = [(11 * i) % 17 for i in range(200)]
    single = DPDataLoader(data, 0.2, 4, 1000, seed=3, chunk_key=key.__getitem__)
    shard = DistributedDPDataLoader.from_loader(
        single, max_physical_batch_size=5, rank=1, world_size=2
    )
    plain = DistributedDPDataLoader.from_loader(
        DPDataLoader(data, 0.2, 4, 1000, seed=3), max_physical_batch_size=5, rank=1, world_size=2
    )
    for a, b in zip(plain, shard, strict=True):
        got = [int(v) for chunk in b.chunks for v in chunk[0]]
        want = sorted((int(v) for chunk in a.chunks for v in chunk[0]), key=key.__getitem__)
        assert [key[i] for i in got] == [key[i] for i in want] and sorted(got) == sorted(want)
