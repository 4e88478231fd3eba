"""dptrain: differentially private training and fine-tuning of Transformers.

The accounting core lives in :mod:`dptrain.accounting`; its main names are
re-exported here.
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

__version__ = "0.1.0"

__all__ = [
    "GDPAccountant",
    "PLDAccountant",
    "PrivacyLedger",
    "RDPAccountant",
    "__version__",
    "calibrate_dpfp",
    "calibrate_noise",
    "calibrate_noise_multiplier",
    "make_accountant",
]
