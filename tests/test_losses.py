import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dptrain.losses import per_example_cross_entropy, per_example_losses


def test_sequence_cross_entropy_excludes_padding():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 7)
    targets = torch.randint(0, 7, (3, 5))
    targets[1, 3:] = -100
    mask = torch.ones(3, 5)
    mask[2, 0] = 0
    got = per_example_cross_entropy(logits, targets, attention_mask=mask, reduction="sum")
    for i in range(3):
        keep = (targets[i] != -100) & mask[i].bool()
        want = F.cross_entropy(logits[i][keep], targets[i][keep], reduction="sum")
        assert got[i] == pytest.approx(float(want), rel=1e-6)
    mean = per_example_cross_entropy(logits, targets, attention_mask=mask)
    assert mean[1] == pytest.approx(float(got[1] / 3), rel=1e-6)


def test_padding_does_not_reach_the_gradient():
    logits = torch.randn(1, 4, 3, requires_grad=True)
    targets = torch.tensor([[0, 1, -100, -100]])
    per_example_cross_entropy(logits, targets).sum().backward()
    assert torch.all(logits.grad[0, 2:] == 0)


def test_all_padding_example_has_zero_loss():
    logits = torch.randn(2, 3, 4)
    targets = torch.full((2, 3), -100)
    assert torch.all(per_example_cross_entropy(logits, targets) == 0)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_per_example_losses_from_reduced_criterion(reduction):
    out, tgt = torch.randn(4, 3), torch.randn(4, 3)
    got = per_example_losses(nn.MSELoss(reduction=reduction), out, tgt)
    sq = (out - tgt) ** 2
    want = sq.sum(1) if reduction == "sum" else sq.mean(1)
    assert torch.allclose(got, want)
    # The batch loss the criterion would give is recovered.
    batch = nn.MSELoss(reduction=reduction)(out, tgt)
    assert float(got.sum() if reduction == "sum" else got.mean()) == pytest.approx(float(batch))


def test_bad_reduction():
    with pytest.raises(ValueError, match=r"^reduction='none' is not allowed"):
        per_example_cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), reduction="none")
    with pytest.raises(ValueError, match=r"^criterion.reduction='none' is not allowed"):
        per_example_losses(nn.MSELoss(reduction="none"), torch.randn(2), torch.randn(2))
