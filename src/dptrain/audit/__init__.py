"""Privacy audits: what a trained model leaks about its training data.

:mod:`dptrain.audit.exposure`: canary exposure, the secret-sharer test of
unintended memorization (Carlini et al., 2019), as Li et al. (2022, appendix M)
run it on E2E. The recipe :mod:`dptrain.recipes.exposure` trains the models
(``dptrain audit exposure``).

:mod:`dptrain.audit.one_run`: one-run auditing (Steinke et al. 2023; Mahloujifar et al.
2025), an epsilon lower bound from canary scores (several scores of one run as one
family of tests: :func:`audit_scores`); :mod:`dptrain.audit.gradient_canaries`: the
white-box canaries that produce such scores (their sum, per-step and per-tensor
likelihood ratios) during a private run.

:mod:`dptrain.audit.lira`: membership inference, the likelihood-ratio attack (LiRA,
Carlini et al. 2022) with shadow models and the loss-threshold baseline, and their ROC
metrics (TPR at low FPR, AUC); the recipe :mod:`dptrain.recipes.audit_mia` trains the
shadow probes (``dptrain audit mia``).

:mod:`dptrain.audit.properties`: property checks of a private run (noise independent across
steps and of std sigma C / (q N), batch sizes ~ Binomial(N, q), one record moves the clipped
sum by at most C, ledger steps = optimizer steps): ``dptrain audit properties``.
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
from dptrain.audit.gradient_canaries import (
    DEFAULT_NORM_IN_C,
    MIN_CANARIES_PER_TENSOR,
    SCORES,
    GradientCanaries,
)
from dptrain.audit.lira import (
    DEFAULT_FPRS,
    AttackMetrics,
    attack_metrics,
    balanced_accuracy,
    dp_tpr_bound,
    lira_leave_one_out,
    lira_offline,
    lira_online,
    logit_confidence,
    loss_scores,
    plot_roc,
    roc_auc,
    roc_curve,
    tpr_at_fpr,
)
from dptrain.audit.one_run import (
    METHODS,
    OneRunAudit,
    audit_scores,
    count_correct,
    default_guess_candidates,
    epsilon_lower_bound,
    gdp_audit_rejects,
    gdp_mu_lower_bound,
    guesses_from_scores,
    one_run_audit,
    one_run_p_value,
    pure_epsilon_all_correct,
    steinke_ceiling,
)
from dptrain.audit.properties import PropertyCheck, PropertyReport, check_properties

__all__ = [
    "DEFAULT_FPRS",
    "DEFAULT_NORM_IN_C",
    "DEFAULT_PREFIX_FORMAT",
    "METHODS",
    "MIN_CANARIES_PER_TENSOR",
    "MIN_DISTRIBUTION_SAMPLES",
    "SCORES",
    "AttackMetrics",
    "Canary",
    "CanarySet",
    "GradientCanaries",
    "OneRunAudit",
    "PropertyCheck",
    "PropertyReport",
    "SkewNormalFit",
    "attack_metrics",
    "audit_scores",
    "balanced_accuracy",
    "candidate_words",
    "check_encodable",
    "check_properties",
    "count_correct",
    "default_guess_candidates",
    "dp_tpr_bound",
    "epsilon_lower_bound",
    "exposure_by_distribution",
    "exposure_by_rank",
    "fit_skewnorm",
    "gdp_audit_rejects",
    "gdp_mu_lower_bound",
    "guesses_from_scores",
    "insert_canaries",
    "lira_leave_one_out",
    "lira_offline",
    "lira_online",
    "logit_confidence",
    "loss_scores",
    "make_canaries",
    "one_run_audit",
    "one_run_p_value",
    "plot_roc",
    "pure_epsilon_all_correct",
    "roc_auc",
    "roc_curve",
    "skewnorm_logcdf",
    "steinke_ceiling",
    "tpr_at_fpr",
]
