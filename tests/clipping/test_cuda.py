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


@pytest.fixture
def tf32_matmuls():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
def test_llama_with_tf32_matmuls_passes_the_checks(tf32_matmuls, mode):
    # With TF32 matrix products a chunk and one example alone differ by ~1e-4 (float16's
    # mantissa): the checks must use float16's tolerance there, not refuse the model.
    from transformers import LlamaConfig, LlamaForCausalLM

    from dptrain.clipping import ClippingEngine, oracle_norms, oracle_per_example_grads
    from dptrain.losses import per_example_lm_loss

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).cuda()
    ids = torch.randint(0, 512, (6, 48), device="cuda")

    def losses_of(sl):
        return per_example_lm_loss(model(input_ids=ids[sl]).logits, ids[sl])

    engine = ClippingEngine(model, 1.0, mode=mode)
    stats = engine.backward(losses_of(slice(0, 6)))
    engine.detach()
    torch.backends.cuda.matmul.allow_tf32 = False
    grads = oracle_per_example_grads(model, lambda i: losses_of(slice(i, i + 1)).sum(), 6)
    want = oracle_norms(grads)
    assert ((stats.norms.to(want.dtype) - want).abs() / want).max() < 2e-2
