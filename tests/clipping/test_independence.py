"""The independence check: an example's recorded inputs are what it alone gives."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from dptrain.clipping import ClippingEngine, UnsupportedModelError
from dptrain.clipping.independence import UnsupportedInputsWarning
from tests.clipping.sensitivity import REFUSED, sensitivity

MODES = ["book_keeping", "ghost"]


class DetachedMean(nn.Module):
    """A detached batch mean between two trainable layers: no gradient shows the mixing."""

    def __init__(self, d=4):
        super().__init__()
        self.fc1 = nn.Linear(3, d)
        self.fc2 = nn.Linear(d, 1)

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        return self.fc2(h + h.detach().mean(0)).squeeze(-1)


@pytest.mark.parametrize("mode", MODES)
def test_mixing_where_no_gradient_flows_is_refused_by_name(mode):
    torch.manual_seed(0)
    model = DetachedMean().double()
    x = torch.randn(4, 3, dtype=torch.float64)
    engine = ClippingEngine(model, 1.0, mode=mode)
    with pytest.raises(
        UnsupportedModelError,
        match=r"^module fc2 \(Linear\): the input of its call 0 for example 0",
    ):
        engine.backward(model(x))
    engine.detach()
    assert all(p.grad is None for p in model.parameters())
    assert sensitivity(model, lambda: model(x), 1, max_grad_norm=0.1, mode=mode)[0] == REFUSED


class Dropped(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(3, 8)
        self.drop = nn.Dropout(0.5)
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x)))).squeeze(-1)


def test_dropout_in_training_is_not_mixing_and_draws_no_randomness():
    torch.manual_seed(0)
    model = Dropped().double().train()
    x = torch.randn(5, 3, dtype=torch.float64)
    engine = ClippingEngine(model, 1.0)
    engine.backward(model(x))
    assert engine.self_checks == 1  # the checks ran on this chunk
    after_check = torch.rand(3)
    engine.detach()

    torch.manual_seed(0)
    model2 = Dropped().double().train()
    model2(torch.randn(5, 3, dtype=torch.float64))
    assert torch.equal(after_check, torch.rand(3))  # the re-runs consumed no random numbers
    assert all(m.training for m in model.modules())  # training flags restored


def test_inputs_not_laid_out_by_example_need_no_split_and_are_checked():
    """Examples are replaced inside the chunk, which keeps every shape: an input laid out
    (2B,) needs no split (the check once ran each example alone and skipped this model)."""

    class Paired(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 1)

        def forward(self, x, pairs):  # pairs (2B,) indices into the batch: not split by B
            first = pairs.view(x.shape[0], 2)[:, 0]  # needs 2 entries per example
            return self.fc(x).squeeze(-1) + 0 * first

    model = Paired().double()
    x = torch.randn(3, 3, dtype=torch.float64)
    engine = ClippingEngine(model, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnsupportedInputsWarning)
        engine.backward(model(x, torch.arange(6)))
    assert engine.self_checks == 1
    engine.detach()


class _CountingReruns:
    """A Reruns view (check_interface.py) whose probe only counts its runs."""

    def __init__(self, x: torch.Tensor, lockstep: bool):
        self.model = nn.Linear(3, 1)
        self.root_inputs = ((x,), {})
        self.root_random_state = None
        self.sizes_by_data = False
        self.lockstep = lockstep
        self.runs = 0

    def probe(self, args, kwargs):
        self.runs += 1
        return {}


@pytest.mark.parametrize("lockstep", [False, True])
def test_a_chunk_of_copies_runs_every_pass_in_lockstep(lockstep):
    """A chunk whose examples are all copies (padding rows) has nothing to compare; one
    process skips its re-runs, but under FSDP2 (lockstep) it runs them all, as the other
    ranks, whose chunks differ, do: each forward gathers parameters from every rank."""
    from dptrain.clipping import independence
    from dptrain.clipping.separation import separating_masks

    copies = _CountingReruns(torch.ones(4, 3), lockstep)
    independence.run(copies, [], 4)
    distinct = _CountingReruns(torch.randn(4, 3), lockstep)
    independence.run(distinct, [], 4)
    assert distinct.runs == 1 + len(separating_masks(4))
    assert copies.runs == (distinct.runs if lockstep else 1)
