"""What the engine refuses, with the exact messages."""

import re

import pytest
import torch
from torch import nn

from dptrain.clipping import ClippingEngine, UnsupportedModelError, register_rule
from dptrain.clipping.replay import ReplayRule
from dptrain.clipping.rules import RULES, LinearRule
from dptrain.privacy_engine import check_optimizer_matches


def refuses(message):
    return pytest.raises(UnsupportedModelError, match="^" + re.escape(message) + "$")


def test_batchnorm_in_training_mode_is_refused_at_the_forward():
    """BatchNorm is judged by what it does at each training forward, not by its type
    (tests/clipping/test_state.py): in training mode it normalises by the batch."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2), nn.BatchNorm1d(2))
    engine = ClippingEngine(model, 1.0)
    with refuses(
        "dptrain refuses to train this model: 1 (BatchNorm1d) ran in training mode in a "
        "training forward: it normalises every example by the mean and variance of the whole "
        "batch (mixing the examples, so per-example gradients do not exist) and updates its "
        "running statistics from them. Call .eval() on it to use its frozen running statistics "
        "(per example; its weight and bias may stay trainable; model.train() sets it back to "
        "training mode), or replace it with GroupNorm or LayerNorm."
    ):
        model(torch.randn(3, 4))
    engine.detach()


class WithRecurrentLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gru = nn.GRU(4, 2)
        self.lstm = nn.LSTM(4, 2, bias=False)
        self.emb = nn.Embedding(10, 4, scale_grad_by_freq=True)


def test_all_blockers_are_listed_in_one_error():
    with refuses(
        "dptrain refuses to train this model: no per-example clipping rule for these trainable "
        "parameters, by module type: GRU (1 module: gru; parameters weight_ih_l0, weight_hh_l0, "
        "bias_ih_l0, bias_hh_l0); LSTM (1 module: lstm; parameters weight_ih_l0, weight_hh_l0). "
        "modules that cannot be clipped exactly: emb (Embedding): scale_grad_by_freq=True scales "
        "gradients by counts over the whole batch. Freeze them (requires_grad=False), replace "
        "the modules, or register a rule with dptrain.clipping.register_rule. For nn.GRU: "
        "dptrain.models.DPGRU is a drop-in replacement built from nn.Linear layers "
        "(DPGRU.from_torch copies a one-way nn.GRU's weights). For nn.LSTM: "
        "dptrain.models.DPLSTM is a drop-in replacement built from nn.Linear layers "
        "(DPLSTM.from_torch copies a one-way nn.LSTM's weights)."
    ):
        ClippingEngine(WithRecurrentLayers(), 1.0)


def test_refusals_fold_layer_indices_by_module_type():
    model = nn.Module()
    model.layers = nn.ModuleList([nn.GRU(2, 2, bias=False) for _ in range(3)])
    with refuses(
        "dptrain refuses to train this model: no per-example clipping rule for these trainable "
        "parameters, by module type: GRU (3 modules: layers.*; parameters weight_ih_l0, "
        "weight_hh_l0). Freeze them (requires_grad=False), replace the modules, or register a "
        "rule with dptrain.clipping.register_rule. For nn.GRU: dptrain.models.DPGRU is a "
        "drop-in replacement built from nn.Linear layers (DPGRU.from_torch copies a one-way "
        "nn.GRU's weights)."
    ):
        ClippingEngine(model, 1.0)


def test_frozen_parameters_without_rule_are_fine():
    model = WithRecurrentLayers()
    for m in (model.gru, model.lstm, model.emb):
        m.requires_grad_(False)
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


def test_subclass_without_its_own_rule_is_replayed_not_given_its_parents():
    class MyLinear(nn.Linear):  # a subclass may change forward: the parent's rule may not fit
        pass

    model = nn.Sequential(MyLinear(3, 2))
    engine = ClippingEngine(model, 1.0)
    assert isinstance(engine._uses[model[0]].rule, ReplayRule)
    engine.detach()
    register_rule(MyLinear, LinearRule())
    try:
        engine = ClippingEngine(model, 1.0)
        assert isinstance(engine._uses[model[0]].rule, LinearRule)
        engine.detach()
    finally:
        del RULES[MyLinear]


class SharedTable(nn.Module):
    """A linear layer applied to a table shared by all examples (no batch dimension)."""

    def __init__(self):
        super().__init__()
        self.table = nn.Linear(3, 3)
        self.fc = nn.Linear(3, 1)

    def forward(self, x):  # x (B, T, 3); the table's input has no batch dimension
        return self.fc(x + self.table(torch.eye(3))).sum((1, 2))


def test_unbatched_input_to_a_linear_layer_is_refused():
    model = SharedTable()
    engine = ClippingEngine(model, 1.0)
    losses = model(torch.randn(5, 3, 3))
    with refuses(
        "module table (Linear) produced an output of shape (3, 3) for 5 per-example losses: its "
        "first dimension is not the batch size, so its per-example gradients would be mixed (if "
        "the model takes its inputs in an unusual container, pass input_ids= or a tensor as the "
        "first argument)"
    ):
        engine.backward(losses)
    assert all(p.grad is None for p in model.parameters())  # nothing half-added
    engine.detach()


def test_unbatched_input_whose_length_equals_the_batch_size_is_refused():
    # The same table with B = 3: its (3, 3) input looks like 3 example rows. The exact
    # check finds that example i's loss reaches every row and refuses.
    model = SharedTable()
    engine = ClippingEngine(model, 1.0)
    losses = model(torch.randn(3, 3, 3))
    with pytest.raises(
        UnsupportedModelError,
        match=re.escape(
            "module table (Linear): the rows of its input (3, 3) / output (3, 3) (3 examples) "
            "are not one per example"
        ),
    ):
        engine.backward(losses)
    assert all(p.grad is None for p in model.parameters())  # nothing half-added
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


def test_parameter_used_outside_its_module_is_refused():
    model = BiasUsedOutside()
    engine = ClippingEngine(model, 1.0)
    with refuses(
        "dptrain refuses to train this model: parameters used outside the forward of the module "
        "that owns them: fc.bias (Linear, in AddBackward0). Their gradient through that use would "
        "escape "
        "per-example clipping. Move the computation into a module the engine clips (e.g. an "
        "nn.Linear), or register a rule for the module that uses them."
    ):
        engine.backward(model(torch.randn(2, 4)).sum(1))
    assert all(p.grad is None for p in model.parameters())
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


def test_a_forward_that_raises_leaves_nothing_behind():
    model = BiasUsedOutside()
    engine = ClippingEngine(model, 1.0)
    model.fc = nn.Linear(4, 3)  # not clipped: a new module after the engine was built
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # wrong width
    engine.detach()
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    engine = ClippingEngine(model, 1.0)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 5))  # raises in the first layer
    losses = model(torch.randn(2, 4)).sum(1)
    engine.backward(losses)  # only the live forward's calls count
    assert model[0].weight.grad is not None


# -- the batch size of a model called with a container ------------------------------------


class DictBatchModel(nn.Module):
    """Token ids in a dict, a shared position table (positions of shape (T,)), a linear head."""

    def __init__(self, vocab=11, width=4, max_len=8):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(max_len, width)
        self.out = nn.Linear(width, 3)

    def forward(self, batch):
        ids = batch["input_ids"] if isinstance(batch, dict) else batch.input_ids
        pos = self.positions(torch.arange(ids.shape[1]).unsqueeze(0))  # (1, T, k)
        h = torch.tanh(self.tokens(ids) + pos) * batch_mask(batch).unsqueeze(-1)
        return self.out(h.sum(1))


def batch_mask(batch):
    return (batch["attention_mask"] if isinstance(batch, dict) else batch.attention_mask).double()


class Wrapper(nn.Module):
    """Passes its batch on, however it came: model(batch), model((batch,)), model(batch=...)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, batch=None):
        if batch is None:
            batch = args[0][0] if isinstance(args[0], tuple) else args[0]
        return self.inner(batch)


CALLS = {
    "dict": lambda model, batch: model(batch),
    "dict in a tuple": lambda model, batch: model((batch,)),
    "dict as a keyword": lambda model, batch: model(batch=batch),
}


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
@pytest.mark.parametrize("how", list(CALLS))
def test_batch_size_is_found_inside_a_dict_batch(mode, how):
    from dptrain.losses import per_example_cross_entropy
    from tests.clipping.oracle_check import assert_engine_matches_oracle

    torch.manual_seed(0)
    model = Wrapper(DictBatchModel().double())
    ids = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[1, 4:] = 0
    y = torch.tensor([0, 2, 1, 1])

    def losses_of(sl):
        # a batch-size-1 tensor comes first in the dict: input_ids is still the one read
        batch = {"labels": y[sl][:1], "attention_mask": mask[sl], "input_ids": ids[sl]}
        return per_example_cross_entropy(CALLS[how](model, batch), y[sl])

    assert_engine_matches_oracle(model, losses_of, 4, mode=mode)


def test_batch_size_of_containers():
    from dptrain.clipping.engine import _batch_size_of

    ids, mask, one = torch.zeros(3, 5), torch.zeros(3, 5), torch.zeros(1)
    assert _batch_size_of(({"input_ids": ids},), {}) == 3
    # usual input names first, inside a mapping too
    assert _batch_size_of(({"labels": one, "input_ids": ids},), {}) == 3
    assert _batch_size_of(([torch.tensor(2.0), (mask,)],), {}) == 3  # scalars are skipped
    assert _batch_size_of((), {"batch": {"attention_mask": mask}}) == 3
    assert _batch_size_of((object(), {"x": ids}), {}) == 3
    assert _batch_size_of(({"n": 3},), {}) is None


class Inputs:
    """A container the engine does not look into: the batch size stays unknown."""

    def __init__(self, input_ids, attention_mask):
        self.input_ids = input_ids
        self.attention_mask = attention_mask


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
def test_shared_positions_need_no_batch_size_at_the_forward(mode):
    # Batch size unknown at the forward (a container the engine does not look into): the
    # (1, T) position table's rows are found at the backward, where its (1, T, k) output is
    # added to the (B, T, k) token embeddings (shared_table.py). It used to be refused.
    from tests.clipping.oracle_check import assert_engine_matches_oracle

    torch.manual_seed(0)
    model = DictBatchModel().double()
    ids = torch.randint(0, 11, (3, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 6, dtype=torch.long)
    y = torch.tensor([0, 1, 2])

    def losses_of(sl):
        out = model(Inputs(ids[sl], mask[sl]))
        return nn.functional.cross_entropy(out, y[sl], reduction="none")

    assert_engine_matches_oracle(model, losses_of, 3, mode=mode)


# -- position ids without a batch dimension ------------------------------------------------


class _NanoPositions(nn.Module):
    """nanoGPT-style: positions looked up with a 1-D arange(T) and broadcast over the batch."""

    def __init__(self, vocab=11, max_len=8, width=4):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(max_len, width)
        self.head = nn.Linear(width, 2)

    def forward(self, ids):
        pos = self.positions(torch.arange(ids.shape[1]))  # (T, k)
        return self.head((self.tokens(ids) + pos).mean(1))


def _nano_case(batch, seq):
    from tests.clipping.oracle_check import assert_engine_matches_oracle

    torch.manual_seed(0)
    model = _NanoPositions().double()
    ids = torch.randint(0, 11, (batch, seq))
    labels = torch.randint(0, 2, (batch,))

    def losses_of(sl):
        return nn.functional.cross_entropy(model(ids[sl]), labels[sl], reduction="none")

    return model, losses_of, assert_engine_matches_oracle


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
def test_one_d_positions_are_clipped_per_example_when_t_differs_from_b(mode):
    model, losses_of, check = _nano_case(batch=3, seq=5)
    check(model, losses_of, 3, mode=mode)


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
def test_one_d_positions_are_exact_when_t_equals_b_at_the_first_chunk(mode):
    # (T,) positions and (B,) per-example ids look alike when T == B. What tells them apart
    # is structure: the (T, k) output is broadcast over the batch where it is added to the
    # (B, T, k) token embeddings, so it is a shared table (shared_table.py); the exact check
    # verifies the rows of that sum. (Until the engine read the broadcast, this was refused.)
    model, losses_of, check = _nano_case(batch=5, seq=5)
    check(model, losses_of, 5, mode=mode)


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
def test_one_d_positions_stay_shared_when_t_equals_b_later(mode):
    # Seen once with T != B, the lookup is known to be a shared table: a later chunk
    # with T == B is clipped exactly.
    from tests.clipping.oracle_check import assert_engine_matches_oracle

    torch.manual_seed(0)
    model = _NanoPositions().double()
    engine = ClippingEngine(model, 1.0, mode=mode)
    ids = torch.randint(0, 11, (3, 5))
    engine.backward(
        nn.functional.cross_entropy(model(ids), torch.zeros(3).long(), reduction="none")
    )
    model.zero_grad(set_to_none=True)
    ids = torch.randint(0, 11, (5, 5))
    labels = torch.randint(0, 2, (5,))

    def losses_of(sl):
        return nn.functional.cross_entropy(model(ids[sl]), labels[sl], reduction="none")

    assert_engine_matches_oracle(model, losses_of, 5, mode=mode, engine=engine)
    engine.detach()


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
def test_packaged_models_are_exact_when_a_chunk_holds_t_examples(mode):
    # Regression: GPT / SeqRecTransformer looked positions up with a 1-D arange(T), which the
    # engine took for per-example ids whenever a physical chunk held exactly T examples.
    from dptrain.models.seqrec_transformer import SeqRecConfig, SeqRecTransformer
    from tests.clipping.oracle_check import assert_engine_matches_oracle
    from tests.clipping.test_models import gpt_case

    model, losses_of, b = gpt_case(True, batch=6, seq=6)
    assert_engine_matches_oracle(model, losses_of, b, mode=mode)
    torch.manual_seed(0)
    rec = SeqRecTransformer(
        SeqRecConfig(n_items=9, max_len=5, d_model=8, n_head=2, n_layer=1, dropout=0.0)
    ).double()
    items = torch.randint(1, 10, (5, 5))
    targets = torch.randint(1, 10, (5, 5))

    def rec_losses(sl):
        from dptrain.losses import per_example_cross_entropy

        return per_example_cross_entropy(rec(items[sl]), targets[sl], ignore_index=0)

    assert_engine_matches_oracle(rec, rec_losses, 5, mode=mode)
