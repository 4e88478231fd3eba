"""User-level DP over several ranks: each rank takes whole users of the shared Poisson
batch, so the ranks' clipped sums add up to one process's (checked in one process, the
ranks' shares run one after the other through one engine)."""

from __future__ import annotations

import pytest
import torch

from dptrain.data import DPDataLoader
from dptrain.distributed import DistributedDPDataLoader
from dptrain.losses import per_example_cross_entropy
from dptrain.privacy_engine import make_private
from tests.test_user_level import setup


@pytest.mark.parametrize("world", [2, 3])
def test_ranks_share_out_whole_users_and_their_sums_add_up(world):
    model, opt, data, user_ids = setup()
    kw = dict(batch_size=6, max_grad_norm=0.05, steps=3, noise_multiplier=1.0, seed=4)
    private = make_private(model, opt, data, max_physical_batch_size=3, user_ids=user_ids, **kw)
    shards = [  # each rank's loader draws the same global batches (same seed)
        DistributedDPDataLoader.from_loader(
            DPDataLoader(data, 0.5, 3, 3, seed=4, unit_ids=user_ids),  # q = 6 of 12 users
            max_physical_batch_size=3,
            rank=r,
            world_size=world,
        )
        for r in range(world)
    ]
    for whole, *parts in zip(private.data_loader, *shards, strict=True):
        # the single process's clipped sum
        private.optimizer.zero_grad()
        for x, y, _ in whole.chunks:
            private.backward(per_example_cross_entropy(model(x), y))
        want = [p.grad.clone() for p in model.parameters()]
        # the ranks' shares: disjoint whole users, the same records in all
        seen, users = [], []
        model.zero_grad(set_to_none=True)
        for part in parts:
            private.data_loader.pending_units.extend(part.units)
            rank_users = set()
            for x, y, idx in part.chunks:
                private.backward(per_example_cross_entropy(model(x), y))
                seen += idx.tolist()
                rank_users |= {user_ids[i] for i in idx.tolist()}
            users.append(rank_users)
            assert part.num_units == len(rank_users) and part.global_size == whole.size
        assert sorted(seen) == sorted(int(i) for _, _, idx in whole.chunks for i in idx)
        assert sum(len(u) for u in users) == len(set().union(*users))  # no user on two ranks
        for p, w in zip(model.parameters(), want, strict=True):
            assert torch.allclose(p.grad, w, rtol=1e-10, atol=1e-13)
    private.engine.detach()
