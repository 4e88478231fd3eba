"""Privacy audits: what a trained model leaks about its training data.

:mod:`dptrain.audit.exposure`: canary exposure, the secret-sharer test of
unintended memorization (Carlini et al., 2019), as Li et al. (2022, appendix M)
run it on E2E. The recipe :mod:`dptrain.recipes.exposure` trains the models
(``dptrain audit exposure``).
"""

from dptrain.audit.exposure import (
    DEFAULT_PREFIX_FORMAT,
    MIN_DISTRIBUTION_SAMPLES,
    Canary,
    CanarySet,
    SkewNormalFit,
    candidate_words,
    check_encodable,
    exposure_by_distribution,
    exposure_by_rank,
    fit_skewnorm,
    insert_canaries,
    make_canaries,
    skewnorm_logcdf,
)

__all__ = [
    "DEFAULT_PREFIX_FORMAT",
    "MIN_DISTRIBUTION_SAMPLES",
    "Canary",
    "CanarySet",
    "SkewNormalFit",
    "candidate_words",
    "check_encodable",
    "exposure_by_distribution",
    "exposure_by_rank",
    "fit_skewnorm",
    "insert_canaries",
    "make_canaries",
    "skewnorm_logcdf",
]
