"""dptrain: differentially private training and fine-tuning of Transformers.

- :func:`make_private`: model, optimizer and data in; private versions out.
- :class:`ClippingEngine` + :class:`DPOptimizer`: the same pieces for your own loop.
- :mod:`dptrain.accounting`: the ledger, accountants (PLD, RDP, GDP), calibration.
"""

from dptrain.accounting import (
    GDPAccountant,
    PLDAccountant,
    PrivacyLedger,
    RDPAccountant,
    calibrate_dpfp,
    calibrate_noise,
    calibrate_noise_multiplier,
    make_accountant,
)
from dptrain.clipping import (
    ClippingEngine,
    ClipStats,
    UnclippedGradientError,
    UnsupportedModelError,
    register_rule,
)
from dptrain.data import DPDataLoader, PoissonBatchSampler
from dptrain.losses import per_example_cross_entropy, per_example_losses
from dptrain.optim import DPOptimizer, PrivacyBudgetExhaustedError, noisy_clipped_gradient
from dptrain.privacy_engine import PrivateTraining, make_private

__version__ = "0.1.0"

__all__ = [
    "ClipStats",
    "ClippingEngine",
    "DPDataLoader",
    "DPOptimizer",
    "GDPAccountant",
    "PLDAccountant",
    "PoissonBatchSampler",
    "PrivacyBudgetExhaustedError",
    "PrivacyLedger",
    "PrivateTraining",
    "RDPAccountant",
    "UnclippedGradientError",
    "UnsupportedModelError",
    "__version__",
    "calibrate_dpfp",
    "calibrate_noise",
    "calibrate_noise_multiplier",
    "make_accountant",
    "make_private",
    "noisy_clipped_gradient",
    "per_example_cross_entropy",
    "per_example_losses",
    "register_rule",
]
