"""Privacy accounting: a ledger of private steps, accountants, calibration.

``PrivacyLedger`` records what happened; ``PLDAccountant``/``RDPAccountant``/
``GDPAccountant`` count it; ``calibrate_noise`` and ``calibrate_dpfp`` go the
other way, from a target (epsilon, delta) to a noise multiplier.
"""

from dptrain.accounting.accountants import (
    ACCOUNTANTS,
    DEFAULT_RDP_ORDERS,
    Accountant,
    GDPAccountant,
    PLDAccountant,
    RDPAccountant,
    ledger_to_dp_event,
    make_accountant,
)
from dptrain.accounting.calibration import (
    NOISE_MULTIPLIER_RANGE,
    DPFPCalibration,
    NoiseCalibration,
    calibrate_dpfp,
    calibrate_noise,
    calibrate_noise_multiplier,
    epsilon_of_schedule,
)
from dptrain.accounting.gdp import clt_mu, gdp_delta, gdp_epsilon, gdp_mu
from dptrain.accounting.hyperparameter_search import (
    REPETITION_DISTRIBUTIONS,
    SearchCost,
    composition_of_ledger,
    optimal_composition,
    repeat_and_select,
    search_cost_gupta,
)
from dptrain.accounting.ledger import PrivacyLedger, PrivateSteps
from dptrain.accounting.noise import (
    averaged_gradient_noise_std,
    effective_noise_multiplier,
    sample_rate_from_batch,
    steps_from_epochs,
)

__all__ = [
    "ACCOUNTANTS",
    "DEFAULT_RDP_ORDERS",
    "NOISE_MULTIPLIER_RANGE",
    "REPETITION_DISTRIBUTIONS",
    "Accountant",
    "DPFPCalibration",
    "GDPAccountant",
    "NoiseCalibration",
    "PLDAccountant",
    "PrivacyLedger",
    "PrivateSteps",
    "RDPAccountant",
    "SearchCost",
    "averaged_gradient_noise_std",
    "calibrate_dpfp",
    "calibrate_noise",
    "calibrate_noise_multiplier",
    "clt_mu",
    "composition_of_ledger",
    "effective_noise_multiplier",
    "epsilon_of_schedule",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "ledger_to_dp_event",
    "make_accountant",
    "optimal_composition",
    "repeat_and_select",
    "sample_rate_from_batch",
    "search_cost_gupta",
    "steps_from_epochs",
]
