"""Which rounding a float32 computation really has, for the self-check's tolerances.

The self-check (:mod:`~dptrain.clipping.self_check`) and the independence check
(:mod:`~dptrain.clipping.independence`) compare two computations of the same
quantity in different orders or at different batch sizes, with a tolerance by
dtype. On a GPU, float32 matrix products run in TF32 when the user allows it
(``torch.backends.cuda.matmul.allow_tf32``, ``torch.set_float32_matmul_precision
("high")``, the environment variable ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE``,
Hugging Face ``TrainingArguments(tf32=True)``), and cuDNN convolutions do by
default (``torch.backends.cudnn.allow_tf32``). TF32 keeps 10 mantissa bits,
float16's, so a float32 tolerance (1e-4) refuses correct models there: SmolLM2
on an H100 with TF32 matmuls differed by 1.2e-4 between a chunk and one example
alone. Such tensors are checked at float16's tolerance instead, which still
refuses the mixing the checks are for (relative differences of order one).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = ["LOW_PRECISION", "tf32_in_use", "tolerance_dtype", "tolerance_dtypes", "upcast"]

#: The low-precision float dtypes: records, parameters and sums in them need float32 work.
LOW_PRECISION = (torch.float16, torch.bfloat16)


def tf32_in_use(device: torch.device | str, model: nn.Module | None = None) -> bool:
    """Whether float32 work on ``device`` may run in TF32: CUDA matrix products when
    TF32 is allowed for them, or cuDNN convolutions (allowed by default) when ``model``
    has a convolution."""
    if torch.device(device).type != "cuda":
        return False
    if torch.backends.cuda.matmul.allow_tf32:
        return True
    if torch.backends.cudnn.allow_tf32 and model is not None:
        return any(isinstance(m, nn.modules.conv._ConvNd) for m in model.modules())
    return False


def tolerance_dtype(
    dtype: torch.dtype, device: torch.device | str, model: nn.Module | None = None
) -> torch.dtype:
    """The dtype whose tolerance a ``dtype`` tensor computed on ``device`` gets:
    ``torch.float16`` for float32 under TF32 (the same mantissa), else ``dtype``."""
    if dtype == torch.float32 and tf32_in_use(device, model):
        return torch.float16
    return dtype


def tolerance_dtypes(model: nn.Module) -> Callable[[torch.dtype, torch.device], torch.dtype]:
    """:func:`tolerance_dtype` for ``model``, each (dtype, device) answered once: the
    checks ask per recorded call, and the answer may walk the model's modules."""

    @functools.cache
    def of(dtype: torch.dtype, device: torch.device) -> torch.dtype:
        return tolerance_dtype(dtype, device, model)

    return of


def upcast(t: Tensor) -> Tensor:
    """float16/bfloat16 -> float32; other dtypes unchanged (norms and sums need the range)."""
    return t.float() if t.dtype in LOW_PRECISION else t
