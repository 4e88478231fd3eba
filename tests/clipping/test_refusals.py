"""What the engine refuses, with the exact messages."""

import re

import pytest
import torch
from torch import nn

from dptrain.clipping import ClippingEngine, UnsupportedModelError, register_rule
from dptrain.clipping.rules import RULES, LinearRule
from dptrain.privacy_engine import check_optimizer_matches


def refuses(message):
    return pytest.raises(UnsupportedModelError, match="^" + re.escape(message) + "$")


def test_batchnorm_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.BatchNorm1d(2))
    with refuses(
        "BatchNorm mixes the examples of a batch, so per-example gradients do not exist: "
        "1 (BatchNorm1d), 3 (BatchNorm1d). Replace it with LayerNorm or GroupNorm."
    ):
        ClippingEngine(model, 1.0)


class WithRawParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.ones(4))
        self.attn = nn.MultiheadAttention(4, 2)


def test_all_parameters_without_rule_are_listed_in_one_error():
    with refuses(
        "dptrain refuses to train this model: no per-example clipping rule for these trainable "
        "parameters: scale (WithRawParameter), attn.in_proj_weight (MultiheadAttention), "
        "attn.in_proj_bias (MultiheadAttention), attn.out_proj.weight "
        "(NonDynamicallyQuantizableLinear), attn.out_proj.bias (NonDynamicallyQuantizableLinear)"
        ". Freeze them (requires_grad=False), replace the modules, or register a rule with "
        "dptrain.clipping.register_rule."
    ):
        ClippingEngine(WithRawParameter(), 1.0)


def test_frozen_parameters_without_rule_are_fine():
    model = WithRawParameter()
    model.scale.requires_grad_(False)
    for p in model.attn.parameters():
        p.requires_grad_(False)
    ClippingEngine(model, 1.0).detach()


def test_embedding_scaled_by_batch_frequency_is_refused():
    model = nn.Sequential(nn.Embedding(10, 4, scale_grad_by_freq=True), nn.Linear(4, 2))
    with refuses(
        "dptrain refuses to train this model: modules that cannot be clipped exactly: 0 "
        "(Embedding): scale_grad_by_freq=True scales gradients by counts over the whole batch. "
        "Freeze them (requires_grad=False), replace the modules, or register a rule with "
        "dptrain.clipping.register_rule."
    ):
        ClippingEngine(model, 1.0)


def test_subclass_needs_its_own_rule():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(MyLinear(3, 2))
    with pytest.raises(
        UnsupportedModelError, match=r"0\.weight \(MyLinear\), 0\.bias \(MyLinear\)"
    ):
        ClippingEngine(model, 1.0)
    register_rule(MyLinear, LinearRule())
    try:
        ClippingEngine(model, 1.0).detach()
    finally:
        del RULES[MyLinear]


def test_unbatched_input_to_a_linear_layer_is_refused():
    class SharedTable(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Linear(3, 3)
            self.fc = nn.Linear(3, 1)

        def forward(self, x):  # x (B, T, 3); the table's input has no batch dimension
            return self.fc(x + self.table(torch.eye(3))).sum((1, 2))

    model = SharedTable()
    engine = ClippingEngine(model, 1.0)
    with pytest.raises(
        UnsupportedModelError,
        match=re.escape(
            "module table (Linear) got an input of shape (3, 3) whose first dimension is not the "
            "batch size 5: its per-example gradients would be mixed"
        ),
    ):
        model(torch.randn(5, 3, 3))
    engine.detach()


def test_bad_engine_arguments():
    model = nn.Linear(2, 2)
    with pytest.raises(
        ValueError, match=r"^max_grad_norm=0 is not allowed: expected a number > 0$"
    ):
        ClippingEngine(model, 0)
    with pytest.raises(
        ValueError,
        match=re.escape("mode='fast' is not allowed: expected one of ['book_keeping', 'ghost']"),
    ):
        ClippingEngine(model, 1.0, mode="fast")
    with pytest.raises(
        ValueError,
        match=re.escape(
            "clipping='per_layer' needs mode='book_keeping': a second backward of sum_i c_i L_i "
            "can apply only one factor per example"
        ),
    ):
        ClippingEngine(model, 1.0, clipping="per_layer", mode="ghost")


def test_batch_loss_instead_of_per_example_losses_is_refused():
    model = nn.Linear(2, 1)
    engine = ClippingEngine(model, 1.0)
    loss = model(torch.randn(4, 2)).mean()
    with pytest.raises(
        ValueError,
        match=re.escape("losses has shape (): expected per-example losses of shape (B,)"),
    ):
        engine.backward(loss)


def test_optimizer_must_match_the_model():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    stray = nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([*model[0].parameters(), stray], lr=0.1)
    with pytest.raises(
        ValueError,
        match=re.escape(
            "optimizer and model do not match: trainable model parameters the optimizer does not "
            "update: 1.weight, 1.bias; optimizer parameters that are not trainable parameters of "
            "the model: tensor of shape (3,)"
        ),
    ):
        check_optimizer_matches(model, opt)


class BiasUsedOutside(nn.Module):
    """A parent adds its child's bias by hand: a gradient path the engine cannot see."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x) + self.fc.bias


def test_parameter_used_outside_its_module_is_refused_at_the_first_forward():
    model = BiasUsedOutside()
    engine = ClippingEngine(model, 1.0)
    with refuses(
        "dptrain refuses to train this model: parameters used outside the forward of the module "
        "that owns them: fc.bias (in add). Their gradient through that use would escape "
        "per-example clipping. Move the computation into a module the engine clips (e.g. an "
        "nn.Linear), or register a rule for the module that uses them."
    ):
        model(torch.randn(2, 4))
    # without gradients nothing is recorded and nothing is checked
    with torch.no_grad():
        model(torch.randn(2, 4))
    engine.detach()


def test_detached_or_no_grad_uses_are_not_outside_uses():
    class Fine(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            with torch.no_grad():
                scale = self.fc.weight.norm()
            return self.fc(x) * (1 + 0 * scale) + self.fc.bias.detach().sum() * 0

    model = Fine()
    engine = ClippingEngine(model, 1.0)
    losses = model(torch.randn(2, 4)).sum(1)
    engine.backward(losses)
    assert model.fc.weight.grad is not None


def test_parameter_views_under_no_grad_are_not_outside_uses():
    class SlicesUnderNoGrad(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 6)

        def forward(self, x):
            with torch.no_grad():
                half = self.fc.weight[:3]  # a view that still says requires_grad
            return self.fc(x) + 0 * half.sum()

    model = SlicesUnderNoGrad()
    engine = ClippingEngine(model, 1.0)
    engine.backward(model(torch.randn(2, 4)).sum(1))


def test_a_forward_that_raises_leaves_no_check_behind():
    from torch.overrides import _get_current_function_mode_stack

    model = BiasUsedOutside()
    ClippingEngine(model, 1.0)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # wrong width
    assert not _get_current_function_mode_stack()
    with pytest.raises(UnsupportedModelError, match=r"fc\.bias \(in add\)"):
        model(torch.randn(2, 4))  # the next forward is still checked
