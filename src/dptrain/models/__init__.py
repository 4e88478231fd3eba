"""Models whose parameters live only in modules the per-example rules cover.

- :class:`GPT` / :class:`GPTConfig`: a GPT-2-like causal language model, the
  reference model of the DP engine's tests and benchmarks.
- :class:`SeqRecTransformer` / :class:`SeqRecConfig`: a causal Transformer for
  next-item prediction with a tied item embedding (phantom clipping) and
  optional Re-Attention (DPFormer); the rules are in :mod:`dptrain.models.reattention`.
- :class:`SeqRecRNN` / :class:`SeqRecRNNConfig`, :class:`DPGRU`, :class:`DPLSTM`:
  GRU/LSTM baselines built from ``nn.Linear`` cells (stock ``nn.GRU``/``nn.LSTM``
  hold raw parameters, which the engine refuses).
- :func:`load_pretrained_lm`: a pretrained Hugging Face causal LM and its
  tokenizer, offline; :data:`SMOLLM2` is the packaged SmolLM2-135M-Instruct
  (needs ``transformers`` only when called; :func:`smollm2_available`).
"""

from dptrain.models.gpt import GPT, GPTConfig
from dptrain.models.pretrained import SMOLLM2, load_pretrained_lm, smollm2_available
from dptrain.models.rnn import (
    DPGRU,
    DPLSTM,
    DPGRUCell,
    DPLSTMCell,
    SeqRecRNN,
    SeqRecRNNConfig,
)
from dptrain.models.seqrec_transformer import SeqRecConfig, SeqRecTransformer

__all__ = [
    "DPGRU",
    "DPLSTM",
    "GPT",
    "SMOLLM2",
    "DPGRUCell",
    "DPLSTMCell",
    "GPTConfig",
    "SeqRecConfig",
    "SeqRecRNN",
    "SeqRecRNNConfig",
    "SeqRecTransformer",
    "load_pretrained_lm",
    "smollm2_available",
]
