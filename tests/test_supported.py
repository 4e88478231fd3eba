"""make_private refuses unsupported dtypes and devices by name, before the first step."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from dptrain.losses import per_example_cross_entropy
from dptrain.privacy_engine import make_private
from dptrain.supported import check_autocast, check_device


def _data(n: int = 40) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randn(n, 4, generator=g), torch.arange(n) % 3)


def _private(model: nn.Module):
    return make_private(
        model,
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        _data(),
        batch_size=8,
        max_grad_norm=1.0,
        steps=2,
        noise_multiplier=1.0,
        seed=0,
    )


@pytest.mark.parametrize(
    "dtype, why",
    [
        (torch.float16, "float16 needs a loss scaler"),
        (torch.float8_e4m3fn, "gradients are computed in those"),
        (torch.complex64, "gradients are computed in those"),
    ],
)
def test_unsupported_parameter_dtype_is_refused(dtype, why):
    model = nn.Sequential(nn.Linear(4, 3))
    model[0].weight = nn.Parameter(model[0].weight.detach().to(dtype))
    message = (
        f"model parameter '0.weight' has dtype={dtype}, which is not allowed: expected one of "
        "float32, float64, bfloat16"
    )
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        _private(model)
    assert why in str(e.value)


def test_frozen_parameters_of_any_dtype_are_left_alone():
    model = nn.Linear(4, 3)
    # never trained, never clipped: what dtype a frozen table holds is the model's business
    model.table = nn.Parameter(torch.zeros(2, dtype=torch.float16), requires_grad=False)
    _private(model)


def test_meta_device_is_refused():
    model = nn.Linear(4, 3, device="meta")
    message = (
        "model parameter 'weight' is on device='meta', which is not allowed: expected a device "
        "of type cpu or cuda (meta tensors hold no values)"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        _private(model)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_supported_dtypes_train(dtype):
    model = nn.Linear(4, 3).to(dtype)
    private = _private(model)
    for batch in private.data_loader:
        private.optimizer.zero_grad()
        for x, y in batch.chunks:
            private.backward(per_example_cross_entropy(model(x.to(dtype)), y))
        private.optimizer.step()
    assert private.ledger.num_steps == 2


def test_float16_autocast_is_refused_at_the_forward_before_any_step():
    model = nn.Linear(4, 3)
    before = model.weight.detach().clone()
    private = _private(model)
    batch = next(iter(private.data_loader))
    x, _ = batch.chunks[0]
    message = (
        "torch.autocast(device_type='cpu', dtype=torch.float16) is not allowed around a private "
        "model's forward: expected autocast off or dtype bfloat16 (float16 needs a loss scaler"
    )
    with pytest.raises(ValueError, match=re.escape(message)), torch.autocast("cpu", torch.float16):
        model(x)
    assert private.ledger.num_steps == 0 and torch.equal(model.weight, before)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the supported autocast runs
        model(x)
    model(x)  # and so does no autocast


def test_check_autocast_outside_autocast_passes():
    check_autocast()


@pytest.mark.parametrize(
    "value, message",
    [
        ("tpu", "device='tpu' is not allowed: expected 'cpu', 'cuda' or 'cuda:N'"),
        ("mps", "device='mps' is not allowed: expected 'cpu', 'cuda' or 'cuda:N'"),
        ("cuda:99", "device='cuda:99' is not available here"),
    ],
)
def test_check_device_names_the_value(value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_device(value)


def test_check_device_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    message = (
        "device='cuda' is not available here (PyTorch sees no CUDA device): expected device='cpu'"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        check_device("cuda")
    assert check_device("cpu") == torch.device("cpu")
