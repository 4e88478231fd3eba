"""User-level DP in make_private: users Poisson-sampled, each user's summed gradient clipped
as one (against a per-user oracle, users cut across chunks included)."""

import pytest
import torch

from dptrain.clipping import flat_factors
from dptrain.losses import per_example_cross_entropy
from dptrain.models import GPT, GPTConfig
from dptrain.privacy_engine import make_private

N_USERS = 12


def setup(seed=0):
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=30, max_seq_len=8, n_layer=1, n_head=2, d_model=8, d_mlp=16)
    model = GPT(cfg).double()
    # user u has 1 + u % 6 records (1 .. 6), records of users interleaved
    user_ids = [u for u in range(N_USERS) for _ in range(1 + u % 6)]
    order = torch.randperm(len(user_ids)).tolist()
    user_ids = [user_ids[i] for i in order]
    ids = torch.randint(0, 30, (len(user_ids), 7))
    index = torch.arange(len(user_ids))
    data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:], index)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, opt, data, user_ids


def _user_oracle(model, data, user_ids, indices, c):
    """sum over users of min(1, C / ||grad_u||) grad_u, grad_u the gradient of the sum of the
    user's records' losses (run on their own)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    users = {}
    for i in indices:
        users.setdefault(user_ids[i], []).append(i)
    norms = []
    for recs in users.values():
        x = torch.stack([data[i][0] for i in recs])
        y = torch.stack([data[i][1] for i in recs])
        grads = torch.autograd.grad(per_example_cross_entropy(model(x), y).sum(), params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        norms.append(norm)
        factor = flat_factors(norm.reshape(1), c)[0]
        for t, g in zip(total, grads, strict=True):
            t.add_(factor * g)
    return total, torch.stack(norms)


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
@pytest.mark.parametrize("chunk", [3, 4, 100])
def test_each_user_is_clipped_as_one(mode, chunk):
    model, opt, data, user_ids = setup()
    c = 0.05  # most users are clipped
    private = make_private(
        model,
        opt,
        data,
        batch_size=6,
        max_grad_norm=c,
        steps=3,
        noise_multiplier=1.0,
        mode=mode,
        max_physical_batch_size=chunk,
        user_ids=user_ids,
        seed=1,
    )
    assert private.privacy_unit == "user" and private.ledger.privacy_unit == "user"
    spanning = 0
    for batch in private.data_loader:
        private.optimizer.zero_grad()
        seen = []
        for (x, y, idx), units in zip(batch.chunks, batch.units, strict=True):
            assert len(idx) <= chunk
            spanning += units.parts > 1
            private.backward(per_example_cross_entropy(model(x), y))
            seen += idx.tolist()
        # whole users only, each exactly once
        users = {user_ids[i] for i in seen}
        assert sorted(seen) == sorted(i for i, u in enumerate(user_ids) if u in users)
        assert batch.num_units == len(users) and batch.size == len(seen)
        want, _ = _user_oracle(model, data, user_ids, seen, c)
        for p, w in zip(model.parameters(), want, strict=True):
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            assert torch.allclose(got, w, rtol=1e-10, atol=1e-12)
        private.optimizer.step()
    if chunk < 6:
        assert spanning > 0  # the grid exercised users cut across chunks


def test_users_are_what_is_sampled_and_counted():
    model, opt, data, user_ids = setup()
    private = make_private(
        model,
        opt,
        data,
        batch_size=3,
        max_grad_norm=1.0,
        epochs=1,
        noise_multiplier=1.0,
        user_ids=user_ids,
        seed=0,
    )
    assert private.data_loader.loader.dataset_size == N_USERS
    assert private.steps == N_USERS // 3  # an epoch is a pass over the users
    assert private.optimizer.expected_batch_size == pytest.approx(3.0)
    batch = next(iter(private.data_loader))
    private.optimizer.zero_grad()
    for x, y, _ in batch.chunks:
        private.backward(per_example_cross_entropy(model(x), y))
    private.optimizer.step()
    (segment,) = private.ledger.segments
    assert segment.sample_rate == pytest.approx(3 / N_USERS) and segment.count == 1


def test_a_user_left_open_stops_the_step():
    model, opt, data, user_ids = setup()
    private = make_private(
        model,
        opt,
        data,
        batch_size=N_USERS,
        max_grad_norm=1.0,
        steps=1,
        noise_multiplier=1.0,
        max_physical_batch_size=2,
        user_ids=user_ids,
        seed=0,
    )
    batch = next(iter(private.data_loader))
    private.optimizer.zero_grad()
    for (x, y, _), units in zip(batch.chunks, batch.units, strict=True):
        private.backward(per_example_cross_entropy(model(x), y))
        if units.parts > 1:  # stop after the first part of a user cut across chunks
            break
    with pytest.raises(RuntimeError, match="never closed"):
        private.optimizer.step()


def test_one_user_moves_the_clipped_sum_by_at_most_c():
    # Scale every record of one user (spread over chunks) by lambda: the clipped sum of the
    # batch moves by at most C.
    model, _, data, user_ids = setup()
    c = 0.05
    target = 5  # 6 records, more than a chunk
    sums = []
    for lam in (0.0, 1.0, 1e3, 1e6):
        private = make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            data,
            batch_size=N_USERS,
            max_grad_norm=c,
            steps=1,
            noise_multiplier=1.0,
            max_physical_batch_size=4,
            user_ids=user_ids,
            seed=0,
        )
        model.zero_grad(set_to_none=True)
        for batch in private.data_loader:
            for xb, yb, idx in batch.chunks:
                scale = torch.tensor([lam if user_ids[i] == target else 1.0 for i in idx.tolist()])
                private.backward(per_example_cross_entropy(model(xb), yb) * scale.double())
        sums.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        private.engine.detach()
    worst = max(float((a - b).norm()) for a in sums for b in sums)
    assert worst <= c * (1 + 1e-9)


def test_user_level_bad_input():
    model, opt, data, user_ids = setup()
    kw = dict(batch_size=3, max_grad_norm=1.0, steps=2, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="user_ids has 5 entries"):
        make_private(model, opt, data, user_ids=user_ids[:5], **kw)
    with pytest.raises(ValueError, match="privacy_unit='example' with user_ids"):
        make_private(model, opt, data, user_ids=user_ids, privacy_unit="example", **kw)
    with pytest.raises(ValueError, match=r"user_ids\[0\]=\[\d+\] is not allowed"):
        make_private(model, opt, data, user_ids=[[u] for u in user_ids], **kw)
    # every user drawn (q = 1) and a fixed seed: an empty Poisson batch (3% at q = 1/4) has no
    # chunk to misuse
    kw |= dict(batch_size=N_USERS, seed=0)
    private = make_private(model, opt, data, user_ids=user_ids, max_physical_batch_size=2, **kw)
    batch = next(iter(private.data_loader))
    assert len(batch.chunks) > 1
    x, y, _ = batch.chunks[0]
    x, y = torch.cat([x, x]), torch.cat([y, y])  # not the chunk's size
    with pytest.raises(ValueError, match="pass the chunks in order"):
        private.backward(per_example_cross_entropy(model(x), y))
    for xb, yb, _ in batch.chunks:  # the refused call consumed nothing
        private.backward(per_example_cross_entropy(model(xb), yb))
    with pytest.raises(RuntimeError, match="more chunks than the logical batch has"):
        private.backward(per_example_cross_entropy(model(x[:1]), y[:1]))
