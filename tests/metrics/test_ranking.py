"""Full-ranking metrics against hand-computed values: ranks, ties, exclusion, padding, errors."""

import math
import re

import pytest
import torch

from dptrain.metrics import hit_at_k, mrr, ndcg_at_k, ranking_metrics, target_ranks


def raises(message):
    return pytest.raises(ValueError, match=re.escape(message))


# Column 0 is padding; items are 1..4.
SCORES = torch.tensor(
    [
        [9.0, 0.5, 0.2, 0.9, 0.1],  # target 1: only item 3 scores higher -> 2 (padding's 9 ignored)
        [0.0, 0.3, 0.3, 0.3, 0.3],  # target 2: three ties, counted against the target -> 4
        [0.0, 0.8, 0.1, 0.7, 0.6],  # target 2: last of the four -> 4
    ]
)
TARGETS = torch.tensor([1, 2, 2])


def test_ranks_by_hand():
    ranks = target_ranks(SCORES, TARGETS)
    assert ranks.dtype == torch.long
    assert ranks.tolist() == [2, 4, 4]


def test_padding_column_is_never_a_candidate():
    scores = SCORES.clone()
    scores[:, 0] = 1e9
    assert target_ranks(scores, TARGETS).tolist() == [2, 4, 4]


def test_exclusion_removes_candidates_but_keeps_the_target():
    exclude = torch.zeros(3, 5, dtype=torch.bool)
    exclude[0, 3] = True  # the only better item of row 0 is excluded -> rank 1
    exclude[2, [1, 2]] = True  # row 2: item 1 excluded, the target (2) itself stays
    assert target_ranks(SCORES, TARGETS, exclude).tolist() == [1, 4, 3]


def test_a_constant_scorer_gets_no_credit_for_ties():
    scores = torch.zeros(4, 7)
    targets = torch.tensor([1, 3, 5, 6])
    assert target_ranks(scores, targets).tolist() == [6, 6, 6, 6]
    assert hit_at_k(target_ranks(scores, targets), 5) == 0.0


def test_minus_infinity_ranks_last():
    scores = torch.tensor([[0.0, -math.inf, 1.0, -math.inf], [0.0, 2.0, -math.inf, 1.0]])
    assert target_ranks(scores, torch.tensor([1, 1])).tolist() == [3, 1]


def test_metrics_by_hand():
    ranks = torch.tensor([2, 4, 4])
    assert hit_at_k(ranks, 2) == pytest.approx(1 / 3)
    assert hit_at_k(ranks, 3) == pytest.approx(1 / 3)
    assert hit_at_k(ranks, 4) == pytest.approx(1.0)
    assert ndcg_at_k(ranks, 1) == 0.0
    assert ndcg_at_k(ranks, 2) == pytest.approx((1 / math.log2(3)) / 3)
    assert ndcg_at_k(ranks, 4) == pytest.approx((1 / math.log2(3) + 2 / math.log2(5)) / 3)
    assert mrr(ranks) == pytest.approx((1 / 2 + 1 / 4 + 1 / 4) / 3)

    ranks = torch.tensor([1, 4, 3])
    assert ranking_metrics(ranks, ks=(1, 3)) == pytest.approx(
        {
            "ndcg@1": 1 / 3,
            "hit@1": 1 / 3,
            "ndcg@3": (1 + 0 + 1 / 2) / 3,
            "hit@3": 2 / 3,
            "mrr": (1 + 1 / 4 + 1 / 3) / 3,
        }
    )
    assert list(ranking_metrics(ranks)) == ["ndcg@10", "hit@10", "mrr"]
    assert isinstance(mrr(ranks), float)


def test_end_to_end_perfect_and_worst_models():
    targets = torch.tensor([3, 1, 4])
    perfect = torch.nn.functional.one_hot(targets, 5).float()
    assert ranking_metrics(target_ranks(perfect, targets), ks=(1,)) == {
        "ndcg@1": 1.0,
        "hit@1": 1.0,
        "mrr": 1.0,
    }
    worst = -perfect
    assert target_ranks(worst, targets).tolist() == [4, 4, 4]


def test_bad_inputs():
    with raises("scores with shape (5,) is not allowed: expected a 2-D tensor"):
        target_ranks(torch.zeros(5), torch.tensor([1]))
    with raises("targets with shape (2,) is not allowed: expected (3,)"):
        target_ranks(SCORES, torch.tensor([1, 2]))
    with raises("targets contains 0, which is not allowed: expected item ids in 1..4"):
        target_ranks(SCORES, torch.tensor([1, 0, 2]))
    with raises("targets contains 5, which is not allowed: expected item ids in 1..4"):
        target_ranks(SCORES, torch.tensor([1, 5, 2]))
    with raises("targets with dtype torch.float32 is not allowed: expected integers"):
        target_ranks(SCORES, TARGETS.float())
    with raises("scores contains NaN"):
        target_ranks(torch.full((3, 5), math.nan), TARGETS)
    with raises("exclude with shape (3, 4) and dtype torch.bool is not allowed"):
        target_ranks(SCORES, TARGETS, torch.zeros(3, 4, dtype=torch.bool))
    with raises("exclude with shape (3, 5) and dtype torch.int64 is not allowed"):
        target_ranks(SCORES, TARGETS, torch.zeros(3, 5, dtype=torch.long))
    with raises("k=0 is not allowed: expected an integer >= 1"):
        hit_at_k(torch.tensor([1]), 0)
    with raises("ranks with shape (0,) is not allowed: expected a non-empty 1-D tensor"):
        mrr(torch.tensor([], dtype=torch.long))
    with raises("ranks contains 0, which is not allowed: expected ranks >= 1"):
        ndcg_at_k(torch.tensor([1, 0]), 3)
    with raises("ks=() is not allowed"):
        ranking_metrics(torch.tensor([1]), ks=())
    with raises("ks[1]=0 is not allowed"):
        ranking_metrics(torch.tensor([1]), ks=(5, 0))
