"""Gaussian mechanisms outside the training loop, recorded in the ledger.

:func:`dp_item_counts` releases how many records contain each item (a
histogram). DPFormer's Re-Attention needs item frequencies; taking them from
the private training data without noise would leak through the released model,
so dptrain offers this DP release (DPFormer App. C, Remark C.1: "can be
obtained with high accuracy with tiny privacy budget").

Sensitivity. Each record contributes a 0/1 indicator vector over items. A
record's distinct items are capped at ``max_items_per_record`` (its LAST
items are kept, a data-independent rule), so adding or removing one record
changes the count vector by at most sqrt(max_items_per_record) in L2 norm. The
Gaussian mechanism with noise std sigma * sqrt(max_items_per_record) is then
one step of sample rate 1 and noise multiplier sigma in the ledger (the same
accounting as one full-batch DP-SGD step).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from dptrain._checks import check_int, check_positive
from dptrain.accounting import PrivacyLedger

__all__ = ["dp_item_counts", "item_presence_counts"]


def item_presence_counts(records: Tensor, n_items: int, max_items_per_record: int) -> Tensor:
    """(n_items + 1,) float64: records containing each item (0 = padding, never counted).

    ``records`` (N, W) item ids, 0 for padding. Each record's distinct items are
    capped at its last ``max_items_per_record`` distinct ones.
    """
    n_items = check_int("n_items", n_items, 1)
    cap = check_int("max_items_per_record", max_items_per_record, 1)
    if records.dim() != 2:
        raise ValueError(f"records has shape {tuple(records.shape)}: expected (N, W) item ids")
    if records.numel() and (int(records.min()) < 0 or int(records.max()) > n_items):
        raise ValueError(
            f"records hold ids in [{int(records.min())}, {int(records.max())}]: "
            f"expected 0 (padding) to n_items={n_items}"
        )
    counts = torch.zeros(n_items + 1, dtype=torch.float64)
    for row in records.tolist():
        seen: list[int] = []
        for item in reversed(row):  # the last items first: they are kept under the cap
            if item and item not in seen:
                seen.append(item)
                if len(seen) == cap:
                    break
        for item in seen:
            counts[item] += 1
    return counts


def dp_item_counts(
    records: Tensor,
    n_items: int,
    *,
    max_items_per_record: int,
    noise_multiplier: float,
    ledger: PrivacyLedger,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Counts of :func:`item_presence_counts` plus N(0, (sigma sqrt(m))^2); records it in ``ledger``.

    Returns the raw noisy counts (may be negative; clamping is post-processing).
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    counts = item_presence_counts(records, n_items, max_items_per_record)
    std = sigma * math.sqrt(max_items_per_record)
    noise = torch.randn(counts.shape, generator=generator, dtype=torch.float64) * std
    noise[0] = 0.0  # padding is not an item
    ledger.record(1.0, sigma)
    return counts + noise
