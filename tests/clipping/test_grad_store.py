"""GradStore: the clipped sums in p.grad, a float16/bfloat16 parameter's in float32 beside it
(rounded copies written at flush, the caller's float32 sum kept without a copy)."""

import torch
from torch import nn

from dptrain.clipping.grad_store import GradStore


def _bf16(shape=(3, 4)):
    return nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))


def test_a_low_precision_grad_is_the_rounded_float32_sum_once_flushed():
    p, store = _bf16(), GradStore()
    s = torch.full((3, 4), 1.0 + 2**-12)  # not a bf16 value
    store.add(p, s)
    assert p.grad is None  # written at the flush, for every parameter at once
    store.flush()
    store.mark([p])
    assert p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, s.to(torch.bfloat16))
    assert torch.equal(store.clipped_sum(p), torch.full((3, 4), 1.0 + 2**-12))


def test_a_float32_sum_in_the_parameters_layout_is_held_without_a_copy():
    p, store = _bf16(), GradStore()
    s = torch.full((3, 4), 0.5)
    store.add(p, s)
    store.flush()
    store.mark([p])
    assert store.clipped_sum(p) is s


def test_views_and_low_precision_sums_are_copied_not_held():
    for s in (torch.ones(6, 4)[:3], torch.ones(4, 3).T, torch.ones(3, 4, dtype=torch.bfloat16)):
        p, store = _bf16(), GradStore()
        store.add(p, s)
        store.flush()
        store.mark([p])
        held = store.clipped_sum(p)
        assert held.dtype == torch.float32 and held.stride() == p.stride()
        assert held.untyped_storage().data_ptr() != s.untyped_storage().data_ptr()
        if s.dtype == torch.float32:
            s.add_(1)  # the caller's tensor changes; the held sum does not
        assert torch.equal(held, torch.ones(3, 4))


def test_sums_accumulate_in_float32_within_and_across_flushes():
    p, store = _bf16(), GradStore()
    tiny = torch.full((3, 4), 2**-10)  # lost against 1 in bf16 (8 significant bits)
    store.add(p, torch.ones(3, 4))
    store.add(p, tiny.clone())  # a second sum before the flush
    store.flush()
    store.mark([p])
    store.add(p, tiny.clone())  # the next chunk
    store.flush()
    store.mark([p])
    assert torch.equal(store.clipped_sum(p), torch.full((3, 4), 1 + 2 * 2**-10))
    assert torch.equal(p.grad, torch.ones(3, 4, dtype=torch.bfloat16))


def test_a_grad_written_by_other_code_drops_the_float32_sum():
    p, store = _bf16(), GradStore()
    store.add(p, torch.full((3, 4), 0.25))
    store.flush()
    store.mark([p])
    p.grad = torch.full((3, 4), 7.0, dtype=torch.bfloat16)
    assert not store.wrote(p)
    assert store.clipped_sum(p) is p.grad


def test_release_forgets_the_float32_sums():
    p, store = _bf16(), GradStore()
    store.add(p, torch.full((3, 4), 1.0 + 2**-12))
    store.flush()
    store.mark([p])
    store.release()
    assert store.clipped_sum(p) is p.grad  # the rounded copy: the float32 sum is gone
