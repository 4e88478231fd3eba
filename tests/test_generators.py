"""Generator states restore from any device or dtype a checkpoint may bring them in."""

from __future__ import annotations

import pytest
import torch

from dptrain.generators import canonical_device, generator_state, restore_generator
from tests.fake_device import FakeCudaTensor


def _saved_and_next() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    torch.randn(5, generator=g)
    state = g.get_state()
    return state, torch.randn(5, generator=g)


def test_a_state_on_a_cuda_device_restores():
    """What accelerate hands back: the ByteTensor on the GPU. set_state itself refuses it."""
    state, expected = _saved_and_next()
    moved = FakeCudaTensor(state.clone())
    with pytest.raises(TypeError, match="ByteTensor"):
        torch.Generator().set_state(moved)
    g = restore_generator(torch.Generator(), moved)
    assert torch.equal(torch.randn(5, generator=g), expected)


@pytest.mark.parametrize(
    "convert",
    [
        lambda s: s.tolist(),  # a JSON checkpoint
        lambda s: s.to(torch.int64),
        lambda s: s.to(torch.float32),
        lambda s: FakeCudaTensor(s.to(torch.int64)),
    ],
    ids=["list", "int64", "float32", "cuda-int64"],
)
def test_states_of_other_types_restore(convert):
    state, expected = _saved_and_next()
    g = restore_generator(torch.Generator(), convert(state))
    assert torch.equal(torch.randn(5, generator=g), expected)
    assert generator_state(convert(state)).dtype == torch.uint8


@pytest.mark.parametrize(
    "bad, match",
    [
        ([0, 256], r"integers in \[0, 255\]"),
        ([1.5], r"integers in \[0, 255\]"),
        ([[1, 2]], r"shape \(1, 2\)"),
        ("abc", "generator state=str is not allowed"),
    ],
)
def test_a_state_that_is_not_bytes_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        generator_state(bad)


def test_cpu_device_is_its_own_canonical_form():
    assert canonical_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_without_index_is_the_current_device():
    assert canonical_device("cuda") == torch.device("cuda", torch.cuda.current_device())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_generator_restores_from_a_cuda_tensor():
    g = torch.Generator(device="cuda").manual_seed(3)
    state = g.get_state()
    expected = torch.randn(5, generator=g, device="cuda")
    restored = restore_generator(torch.Generator(device="cuda"), state.cuda())
    assert torch.equal(torch.randn(5, generator=restored, device="cuda"), expected)
