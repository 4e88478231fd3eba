"""The oracle tests on CUDA; skipped where no GPU exists (CI has none)."""

import pytest
import torch

from tests.clipping.oracle_check import assert_engine_matches_oracle
from tests.clipping.test_models import gpt_case

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
@pytest.mark.parametrize("tied", [False, True])
def test_reference_gpt_on_cuda(mode, tied):
    model, losses_of, b = gpt_case(tied, device="cuda")
    assert_engine_matches_oracle(model, losses_of, b, mode=mode)


@pytest.mark.parametrize("tied", [False, True])
def test_reference_gpt_on_cuda_float32(tied):
    model, losses_of, b = gpt_case(tied, dtype=torch.float32, device="cuda")
    assert_engine_matches_oracle(model, losses_of, b, mode="book_keeping", dtype=torch.float32)
