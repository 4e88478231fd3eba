"""Models whose parameters live only in modules the per-example rules cover.

- :class:`GPT` / :class:`GPTConfig`: a GPT-2-like causal language model, the
  reference model of the DP engine's tests and benchmarks.
- :class:`SeqRecTransformer` / :class:`SeqRecConfig`: a causal Transformer for
  next-item prediction with a tied item embedding (phantom clipping) and
  optional Re-Attention (DPFormer); the rules are in :mod:`dptrain.models.reattention`.
- :class:`SeqRecRNN` / :class:`SeqRecRNNConfig`, :class:`DPGRU`, :class:`DPLSTM`:
  GRU/LSTM baselines built from ``nn.Linear`` cells (stock ``nn.GRU``/``nn.LSTM``
  hold raw parameters, which the engine refuses).
"""

from dptrain.models.gpt import GPT, GPTConfig
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
    "DPGRUCell",
    "DPLSTMCell",
    "GPTConfig",
    "SeqRecConfig",
    "SeqRecRNN",
    "SeqRecRNNConfig",
    "SeqRecTransformer",
]
