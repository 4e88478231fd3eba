"""The DP item histogram: exact counts, the per-record cap, noise std and the ledger entry."""

from __future__ import annotations

import math

import pytest
import torch

from dptrain.accounting import PrivacyLedger
from dptrain.mechanisms import dp_item_counts, item_presence_counts


def test_presence_counts_count_each_record_once_per_item():
    records = torch.tensor([[0, 1, 2, 2], [3, 3, 3, 1], [0, 0, 0, 0]])
    counts = item_presence_counts(records, n_items=4, max_items_per_record=4)
    assert counts.tolist() == [0.0, 2.0, 1.0, 1.0, 0.0]


def test_presence_counts_keep_the_last_distinct_items_under_the_cap():
    records = torch.tensor([[1, 2, 3, 2]])  # distinct from the end: 2, 3, then 1
    counts = item_presence_counts(records, n_items=3, max_items_per_record=2)
    assert counts.tolist() == [0.0, 0.0, 1.0, 1.0]


def test_noise_std_and_ledger_entry():
    records = torch.zeros(1, 9, dtype=torch.long)  # all padding: counts are pure noise
    ledger = PrivacyLedger(privacy_unit="user")
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack(
        [
            dp_item_counts(
                records,
                2000,
                max_items_per_record=9,
                noise_multiplier=2.0,
                ledger=ledger,
                generator=gen,
            )[1:]
            for _ in range(5)
        ]
    )
    std = 2.0 * math.sqrt(9)
    n = draws.numel()
    # chi-square bound on the sample variance: 10,000 draws, +-5 standard errors
    var_ratio = draws.pow(2).mean().item() / std**2
    assert abs(var_ratio - 1) < 5 * math.sqrt(2 / n)
    assert [(s.sample_rate, s.noise_multiplier, s.count) for s in ledger.segments] == [
        (1.0, 2.0, 5)
    ]


@pytest.mark.parametrize(
    ("records", "kwargs", "message"),
    [
        (
            torch.tensor([[1, 5]]),
            {},
            r"records hold ids in \[1, 5\]: expected 0 \(padding\) to n_items=3",
        ),
        (torch.tensor([1, 2]), {}, r"records has shape \(2,\): expected \(N, W\)"),
        (torch.tensor([[1]]), {"max_items_per_record": 0}, "max_items_per_record=0"),
    ],
)
def test_bad_input(records, kwargs, message):
    with pytest.raises(ValueError, match=message):
        item_presence_counts(records, 3, kwargs.get("max_items_per_record", 2))
