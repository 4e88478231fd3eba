"""Reference models for the DP engine's tests and benchmarks.

:class:`GPT` is a GPT-2-like causal language model whose parameters all live
in ``nn.Linear``, ``nn.Embedding`` and ``nn.LayerNorm`` modules, the module
types the per-example gradient rules cover; :class:`GPTConfig` holds its sizes.
"""

from dptrain.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
