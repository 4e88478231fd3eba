"""The flat reduce-scatter under each torch's name for it (sharded_sums.reduce_scatter_flat).

torch 2.11, the GPU image's, has only ``reduce_scatter_tensor``; a call of
``reduce_scatter_single`` failed every FSDP2 run there (GPU session, 2026-11-27)."""

import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

from dptrain.distributed.sharded_sums import reduce_scatter_flat


@pytest.fixture
def one_rank_group():
    with tempfile.NamedTemporaryFile() as f:
        dist.init_process_group("gloo", init_method=f"file://{f.name}", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


def test_the_flat_reduce_scatter_runs_where_torch_names_it_reduce_scatter_single(one_rank_group):
    if not hasattr(dist, "reduce_scatter_single"):
        pytest.skip("this torch has no reduce_scatter_single")
    out = torch.empty(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not the deprecated name where the new one exists
        reduce_scatter_flat(out, torch.arange(4.0), one_rank_group)
    assert torch.equal(out, torch.arange(4.0))


def test_the_flat_reduce_scatter_runs_on_a_torch_without_reduce_scatter_single(
    one_rank_group, monkeypatch
):
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    out = torch.empty(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecated in 2.13, the only name in 2.11
        reduce_scatter_flat(out, torch.arange(4.0) * 3, one_rank_group)
    assert torch.equal(out, torch.arange(4.0) * 3)
