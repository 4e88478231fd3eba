"""Per-example clipping: layer rules, phantom clipping, the engine, the oracle."""

from dptrain.clipping.conv_rules import ConvRule, GroupNormRule
from dptrain.clipping.engine import (
    CLIPPING_MODES,
    NORM_METHODS,
    SUM_ROUNDINGS,
    ClippingEngine,
    ClipStats,
    UnclippedGradientError,
    UnsupportedModelError,
)
from dptrain.clipping.functions import CLIPPING_FUNCTIONS, automatic_factors, flat_factors
from dptrain.clipping.independence import UnsupportedInputsWarning
from dptrain.clipping.oracle import oracle_clipped_sum, oracle_norms, oracle_per_example_grads
from dptrain.clipping.phantom import phantom_cross_term
from dptrain.clipping.relative_bias import T5RelativeBiasRule
from dptrain.clipping.replay import MultiheadAttentionRule, ReplayRule
from dptrain.clipping.rules import (
    RULES,
    RULES_BY_NAME,
    Conv1DRule,
    EmbeddingRule,
    LayerRule,
    LinearRule,
    NormLayerRule,
    RMSNormRule,
    RouterRule,
    find_rule,
    register_rule,
)

__all__ = [
    "CLIPPING_FUNCTIONS",
    "CLIPPING_MODES",
    "NORM_METHODS",
    "RULES",
    "RULES_BY_NAME",
    "SUM_ROUNDINGS",
    "ClipStats",
    "ClippingEngine",
    "Conv1DRule",
    "ConvRule",
    "EmbeddingRule",
    "GroupNormRule",
    "LayerRule",
    "LinearRule",
    "MultiheadAttentionRule",
    "NormLayerRule",
    "RMSNormRule",
    "ReplayRule",
    "RouterRule",
    "T5RelativeBiasRule",
    "UnclippedGradientError",
    "UnsupportedInputsWarning",
    "UnsupportedModelError",
    "automatic_factors",
    "find_rule",
    "flat_factors",
    "oracle_clipped_sum",
    "oracle_norms",
    "oracle_per_example_grads",
    "phantom_cross_term",
    "register_rule",
]
