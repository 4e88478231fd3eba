"""Per-example losses: what the clipping engine needs instead of one batch loss.

The engine clips each example's gradient, so it needs L_i per example (B,).
Padding (``ignore_index`` targets, or positions where ``attention_mask`` is 0)
contributes to no example's loss and so to no gradient.
"""

from __future__ import annotations

import copy

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["per_example_cross_entropy", "per_example_lm_loss", "per_example_losses"]

_REDUCTIONS = ("sum", "mean")


def per_example_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    *,
    ignore_index: int = -100,
    attention_mask: Tensor | None = None,
    reduction: str = "mean",
) -> Tensor:
    """Cross-entropy per example, (B,).

    Args:
        logits: (B, C) or (B, T, C) scores.
        targets: (B,) or (B, T) class ids; ``ignore_index`` marks padding.
        attention_mask: optional (B, T) mask; 0 excludes a position.
        reduction: per example, ``"mean"`` over its valid positions (an example with
            none has loss 0) or ``"sum"``.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"reduction={reduction!r} is not allowed: expected one of {list(_REDUCTIONS)}"
        )
    if logits.dim() == 2:
        return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="none")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)} and targets {tuple(targets.shape)}: "
            "expected logits (B, T, C) with targets (B, T)"
        )
    tokens = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=ignore_index, reduction="none"
    ).view(targets.shape)
    valid = targets != ignore_index
    if attention_mask is not None:
        valid = valid & attention_mask.bool()
    tokens = tokens * valid.to(tokens.dtype)
    total = tokens.sum(1)
    if reduction == "sum":
        return total
    return total / valid.sum(1).clamp_min(1).to(total.dtype)


def per_example_lm_loss(
    logits: Tensor, labels: Tensor, *, ignore_index: int = -100, reduction: str = "mean"
) -> Tensor:
    """Next-token cross-entropy per example of a causal LM, (B,).

    ``labels`` are aligned with the inputs (the Hugging Face convention, as
    :func:`dptrain.data.lm_records.collate_lm` gives them): the logits at
    position t are scored against ``labels[:, t + 1]``, and ``ignore_index``
    marks positions out of the loss (prompt, non-assistant turns, padding).

    Args:
        logits: (B, T, V) scores.
        labels: (B, T) token ids or ``ignore_index``.
        reduction: per example, ``"mean"`` over its scored tokens (0 when it has
            none) or ``"sum"``.
    """
    if logits.dim() != 3 or labels.dim() != 2 or logits.shape[:2] != labels.shape:
        raise ValueError(
            f"logits has shape {tuple(logits.shape)} and labels {tuple(labels.shape)}: "
            "expected logits (B, T, V) with labels (B, T)"
        )
    return per_example_cross_entropy(
        logits[:, :-1], labels[:, 1:], ignore_index=ignore_index, reduction=reduction
    )


def per_example_losses(criterion: nn.Module, outputs: Tensor, targets: Tensor) -> Tensor:
    """Per-example losses (B,) from a mean- or sum-reduced criterion (e.g. ``nn.MSELoss()``).

    The criterion is re-run with ``reduction="none"`` and each example's
    elements are reduced as the criterion would reduce them: summed for
    ``"sum"``, averaged over the example's elements for ``"mean"`` (so a
    mean-reduced batch loss is the mean of these when examples have equal size).
    For token-level cross-entropy with padding use :func:`per_example_cross_entropy`.
    """
    reduction = getattr(criterion, "reduction", None)
    if reduction not in _REDUCTIONS:
        raise ValueError(
            f"criterion.reduction={reduction!r} is not allowed: expected one of {list(_REDUCTIONS)}"
        )
    if getattr(criterion, "ignore_index", -100) != -100:
        raise ValueError(
            "criterion has an ignore_index: use per_example_cross_entropy, which excludes "
            "padding from each example's mean"
        )
    unreduced = copy.copy(criterion)
    unreduced.reduction = "none"
    values = unreduced(outputs, targets)
    flat = values.reshape(values.shape[0], -1)
    return flat.sum(1) if reduction == "sum" else flat.mean(1)
