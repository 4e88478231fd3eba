"""Tolerances by the rounding float32 really has (dptrain.clipping.precision)."""

import pytest
import torch
from torch import nn

from dptrain.clipping.precision import tf32_in_use, tolerance_dtype


@pytest.fixture
def restore_flags():
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def test_float32_on_cuda_with_tf32_matmuls_gets_float16_tolerance(restore_flags):
    torch.backends.cuda.matmul.allow_tf32 = True
    assert tf32_in_use("cuda")
    assert tolerance_dtype(torch.float32, "cuda") == torch.float16
    assert tolerance_dtype(torch.float64, "cuda") == torch.float64
    assert tolerance_dtype(torch.float32, "cpu") == torch.float32  # no TF32 on CPUs
    torch.backends.cuda.matmul.allow_tf32 = False
    assert tolerance_dtype(torch.float32, "cuda") == torch.float32


def test_cudnn_tf32_counts_only_for_models_with_convolutions(restore_flags):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    assert tolerance_dtype(torch.float32, "cuda", conv) == torch.float16
    assert tolerance_dtype(torch.float32, "cuda", nn.Linear(3, 4)) == torch.float32
    torch.backends.cudnn.allow_tf32 = False
    assert tolerance_dtype(torch.float32, "cuda", conv) == torch.float32


def test_per_model_answers_equal_the_direct_rule(restore_flags):
    from dptrain.clipping.precision import tolerance_dtypes

    conv = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten())
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    of = tolerance_dtypes(conv)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for device in (torch.device("cpu"), torch.device("cuda")):
            assert of(dtype, device) == tolerance_dtype(dtype, device, conv)
    assert of(torch.float32, torch.device("cuda")) == torch.float16
