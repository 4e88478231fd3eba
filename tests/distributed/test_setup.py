"""make_private_distributed: 2 gloo processes train as 1 process; bad input fails on every rank.

The 2-process scenarios run once for the whole session (``tests/distributed/two_ranks.py``).
"""

from __future__ import annotations

import math

import pytest
import torch

from dptrain.distributed import make_private_distributed
from tests._distributed_run import build, flat_parameters
from tests.distributed.two_ranks import MODES, config, single_process, train

pytestmark = pytest.mark.usefixtures("one_thread")


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


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        (dict(bucket_cap_mb=0), ["bucket_cap_mb=0 is not allowed", "> 0"]),
        (dict(secure_mode=1), ["secure_mode=1 is not allowed", "True or False"]),
        (dict(secure_mode=True, seed=3), ["secure_mode=True with seed=3", "drop the seed"]),
        (dict(secure_mode=True), ["secure_mode=True is not allowed", "unsharded", "fully_shard"]),
    ],
)
def test_bad_settings_are_refused_by_name_before_training(kwargs, words):
    """One process (no group): the refusal every rank would raise, naming the argument."""
    from dptrain.distributed import DistributedConfigError

    model, opt, data = build()
    settings = {**config("book_keeping"), "seed": None, **kwargs}
    with pytest.raises(DistributedConfigError) as err:
        make_private_distributed(model, opt, data, max_physical_batch_size=4, **settings)
    for w in words:
        assert w in str(err.value), str(err.value)
