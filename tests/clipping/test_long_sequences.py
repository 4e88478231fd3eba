"""The engine at the batch and sequence sizes users train with on a GPU (issue 27: B up to
64, T up to 2048), under bf16 autocast and with bf16 weights, on a Llama small enough for
a CPU: the checks reach their verdicts (no refusal of a sound model) and one record moves
the clipped sum by at most C."""

import pytest
import torch
import torch.nn.functional as F

from tests.clipping.sensitivity import PRIVATE, sensitivity

transformers = pytest.importorskip("transformers")

VOCAB = 64


def _llama(weights: str):
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    return model.bfloat16() if weights == "bf16" else model


@pytest.mark.parametrize(
    ("b", "t"), [(64, 512), (16, 2048), pytest.param(64, 2048, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("weights", ["autocast", "bf16"])
def test_one_record_moves_a_long_sequence_bf16_sum_by_at_most_c(weights, b, t):
    model = _llama(weights)
    ids = torch.randint(0, VOCAB, (b, t + 1), generator=torch.Generator().manual_seed(t))
    x, y = ids[:, :-1], ids[:, 1:]

    def losses():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=weights == "autocast"):
            logits = model(input_ids=x).logits
        return F.cross_entropy(logits.float().transpose(1, 2), y, reduction="none").mean(1)

    # the clipped sum's float32 rounding: each table row adds about b t / VOCAB terms
    # (k u_32: 3e-5 to 1.2e-4 relative here), more than the 1e-6 of short sequences
    slack = max(1e-6, b * t / VOCAB * 2**-24)
    outcome, worst = sensitivity(model, losses, b // 2, max_grad_norm=1e-3, slack=slack)
    assert outcome == PRIVATE and worst > 0.9
