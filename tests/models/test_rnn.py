"""GRU/LSTM from Linear layers: equal to PyTorch's modules, clipped exactly by the engine,
invariant to left padding; the SeqRecRNN recommender and its config checks."""

import re

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from dptrain.clipping import ClippingEngine, UnsupportedModelError
from dptrain.losses import per_example_cross_entropy
from dptrain.models.rnn import (
    DPGRU,
    DPLSTM,
    PAD_SCORE,
    DPGRUCell,
    DPLSTMCell,
    SeqRecRNN,
    SeqRecRNNConfig,
)
from tests.clipping.oracle_check import assert_engine_matches_oracle

F64 = torch.float64
TOL = dict(rtol=0, atol=1e-12)
PAIRS = [(nn.GRU, DPGRU), (nn.LSTM, DPLSTM)]
IDS = ["gru", "lstm"]


def _final(state):
    """h_n, or (h_n, c_n) stacked: one tensor to compare."""
    return state if isinstance(state, torch.Tensor) else torch.stack(state)


def _initial_state(torch_type, layers, batch, hidden, gen):
    shape = (layers, *batch, hidden)
    h = torch.randn(shape, dtype=F64, generator=gen)
    if torch_type is nn.GRU:
        return h
    return h, torch.randn(shape, dtype=F64, generator=gen)


# -- equal to nn.GRU / nn.LSTM with copied weights --------------------------------------------


@pytest.mark.parametrize(("torch_type", "dp_type"), PAIRS, ids=IDS)
@pytest.mark.parametrize("num_layers", [1, 2])
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_torch_with_copied_weights(torch_type, dp_type, num_layers, batch_first, bias):
    torch.manual_seed(0)
    ref = torch_type(3, 5, num_layers=num_layers, bias=bias, batch_first=batch_first).to(F64)
    ours = dp_type.from_torch(ref)
    assert ours.batch_first is batch_first and ours.num_layers == num_layers
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((4, 7, 3) if batch_first else (7, 4, 3), dtype=F64, generator=gen)
    hx = _initial_state(torch_type, num_layers, (4,), 5, gen)
    for state in (None, hx):
        out_ref, st_ref = ref(x, state)
        out, st = ours(x, state)
        assert out.shape == out_ref.shape
        torch.testing.assert_close(out, out_ref, **TOL)
        torch.testing.assert_close(_final(st), _final(st_ref), **TOL)
    # Gradients as well: same graph up to the layout of the parameters.
    (out_ref.pow(2).sum() + _final(st_ref).sum()).backward()
    (out.pow(2).sum() + _final(st).sum()).backward()
    for k, cell in enumerate(ours.cells):
        torch.testing.assert_close(cell.ih.weight.grad, getattr(ref, f"weight_ih_l{k}").grad, **TOL)
        torch.testing.assert_close(cell.hh.weight.grad, getattr(ref, f"weight_hh_l{k}").grad, **TOL)
        if bias:
            torch.testing.assert_close(cell.hh.bias.grad, getattr(ref, f"bias_hh_l{k}").grad, **TOL)


@pytest.mark.parametrize(("torch_type", "dp_type"), PAIRS, ids=IDS)
def test_unbatched_input_and_eval_dropout_match_torch(torch_type, dp_type):
    torch.manual_seed(2)
    ref = torch_type(3, 4, num_layers=2, dropout=0.5).to(F64).eval()
    ours = dp_type.from_torch(ref)
    assert not ours.training and ours.dropout == 0.5
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 3, dtype=F64, generator=gen)  # (L, d_in), no batch
    hx = _initial_state(torch_type, 2, (), 4, gen)
    out_ref, st_ref = ref(x, hx)
    out, st = ours(x, hx)
    torch.testing.assert_close(out, out_ref, **TOL)
    torch.testing.assert_close(_final(st), _final(st_ref), **TOL)


@pytest.mark.parametrize(
    ("torch_type", "dp_type"), [(nn.GRUCell, DPGRUCell), (nn.LSTMCell, DPLSTMCell)], ids=IDS
)
def test_cells_match_torch_cells(torch_type, dp_type):
    torch.manual_seed(4)
    ref = torch_type(3, 5).to(F64)
    ours = dp_type.from_torch(ref)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 3, dtype=F64, generator=gen)
    h = torch.randn(4, 5, dtype=F64, generator=gen)
    state = h if torch_type is nn.GRUCell else (h, torch.randn(4, 5, dtype=F64, generator=gen))
    for s in (None, state):
        torch.testing.assert_close(_final(ours(x, s)), _final(ref(x, s)), **TOL)
    torch.testing.assert_close(_final(ours(x[0])), _final(ref(x[0])), **TOL)  # unbatched


def test_initialisation_is_pytorchs():
    torch.manual_seed(6)
    gru = DPGRU(40, 16)
    bound = 1 / 16**0.5  # uniform(-1/sqrt(h), 1/sqrt(h)) for every weight, not 1/sqrt(fan_in)
    for p in gru.parameters():
        assert p.abs().max() <= bound and p.abs().max() > 0.9 * bound


def test_from_torch_refusals():
    with pytest.raises(TypeError, match=r"^module is a LSTM: expected an nn\.GRU$"):
        DPGRU.from_torch(nn.LSTM(2, 3))
    with pytest.raises(ValueError, match=r"^bidirectional=True is not supported"):
        DPGRU.from_torch(nn.GRU(2, 3, bidirectional=True))
    with pytest.raises(ValueError, match=r"^proj_size=2 is not supported: expected 0$"):
        DPLSTM.from_torch(nn.LSTM(2, 3, proj_size=2))
    with pytest.raises(TypeError, match=r"^cell is a GRUCell: expected an nn\.LSTMCell$"):
        DPLSTMCell.from_torch(nn.GRUCell(2, 3))


def test_bad_layer_arguments_and_shapes():
    with pytest.raises(
        ValueError, match=r"^num_layers=0 is not allowed: expected an integer >= 1$"
    ):
        DPGRU(3, 4, num_layers=0)
    with pytest.raises(
        ValueError, match=r"^dropout=1 is not allowed: expected a number in \[0, 1\)"
    ):
        DPLSTM(3, 4, dropout=1)
    gru = DPGRU(3, 4, num_layers=2, batch_first=True)
    with pytest.raises(ValueError, match=re.escape("input has shape (2, 5, 4): expected")):
        gru(torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match=re.escape("hx has shape (1, 2, 4): expected (2, 2, 4)")):
        gru(torch.randn(2, 5, 3), torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match=re.escape("mask has shape (5, 2): expected (2, 5)")):
        gru(torch.randn(2, 5, 3), mask=torch.ones(5, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^input has sequence length 0"):
        gru(torch.randn(2, 0, 3))


# -- masking ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("torch_type", "dp_type"), PAIRS, ids=IDS)
def test_left_padding_mask_equals_running_each_sequence_alone(torch_type, dp_type):
    torch.manual_seed(7)
    ref = torch_type(3, 4, num_layers=2, batch_first=True).to(F64)
    ours = dp_type.from_torch(ref)
    lengths = [6, 2, 1, 4]
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(4, 6, 3, dtype=F64, generator=gen)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, 6 - n :] = True
    x_noisy = torch.where(mask.unsqueeze(-1), x, 100 * torch.randn_like(x))  # junk at padding
    out, st = ours(x_noisy, mask=mask)
    for i, n in enumerate(lengths):
        out_ref, st_ref = ref(x[i : i + 1, 6 - n :])
        torch.testing.assert_close(out[i, 6 - n :], out_ref[0], **TOL)
        assert (out[i, : 6 - n] == 0).all()
        torch.testing.assert_close(_final(st)[..., i, :], _final(st_ref)[..., 0, :], **TOL)


@pytest.mark.parametrize(("torch_type", "dp_type"), PAIRS, ids=IDS)
def test_right_padding_mask_equals_packed_sequences(torch_type, dp_type):
    torch.manual_seed(9)
    ref = torch_type(3, 4, num_layers=2, batch_first=True).to(F64)
    ours = dp_type.from_torch(ref)
    lengths = torch.tensor([5, 3, 1])
    x = torch.randn(3, 5, 3, dtype=F64, generator=torch.Generator().manual_seed(10))
    packed_out, st_ref = ref(pack_padded_sequence(x, lengths, batch_first=True))
    out_ref, _ = pad_packed_sequence(packed_out, batch_first=True)
    mask = torch.arange(5) < lengths[:, None]
    out, st = ours(x, mask=mask)
    torch.testing.assert_close(out, out_ref, **TOL)  # zero at padded steps in both
    torch.testing.assert_close(_final(st), _final(st_ref), **TOL)


# -- the engine -------------------------------------------------------------------------------


_RAW = [("weight", "ih"), ("weight", "hh"), ("bias", "ih"), ("bias", "hh")]


def test_engine_refuses_stock_gru_and_lstm():
    for module, kind, names in [
        (
            nn.GRU(3, 4, num_layers=2),
            "GRU",
            [f"{w}_{s}_l{k}" for k in (0, 1) for w, s in _RAW],
        ),
        (nn.LSTM(3, 4), "LSTM", [f"{w}_{s}_l0" for w, s in _RAW]),
    ]:
        listed = ", ".join(names)
        with pytest.raises(
            UnsupportedModelError,
            match="^"
            + re.escape(
                "dptrain refuses to train this model: no per-example clipping rule for these "
                f"trainable parameters, by module type: {kind} (1 module: <model>; parameters "
                f"{listed}). Freeze them"
            ),
        ) as refused:
            ClippingEngine(module, 1.0)
        # ... and it points to the replacement
        assert str(refused.value).endswith(
            f"For nn.{kind}: dptrain.models.DP{kind} is a drop-in replacement built from "
            f"nn.Linear layers (DP{kind}.from_torch copies a one-way nn.{kind}'s weights)."
        )


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_engine_accepts_the_recommender_and_clips_every_parameter(cell):
    model = SeqRecRNN(SeqRecRNNConfig(n_items=9, cell=cell, n_layer=2, d_model=4))
    engine = ClippingEngine(model, 1.0)
    try:
        assert sorted(engine.parameter_names) == sorted(
            n for n, _ in model.named_parameters()
        )  # tied: head.weight is item_emb.weight, named once
    finally:
        engine.detach()
    for name, module in model.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            assert type(module) in (nn.Linear, nn.Embedding), name


def seqrec_case(cell, tied, *, batch=4, seq=6, n_layer=2, last_only=False, seed=11):
    torch.manual_seed(seed)
    cfg = dict(n_items=13, cell=cell, max_len=8, d_model=5, n_layer=n_layer, dropout=0.0)
    model = SeqRecRNN(SeqRecRNNConfig(**cfg, tie_embeddings=tied)).to(F64)
    with torch.no_grad():  # larger weights than the init: a less degenerate test
        model.item_emb.weight.normal_()
    seqs = torch.randint(1, 14, (batch, seq + 1))
    pads = [min(p, seq + 1) for p in (0, 2, seq - 1, seq + 1)][:batch]
    for i, p in enumerate(pads):
        seqs[i, :p] = 0  # left padding; the last row may be all padding
    seqs[0, -1] = seqs[0, 0]  # an item that is both input and target (phantom cross term)
    x, y = seqs[:, :-1], seqs[:, 1:].clone()
    y[x == 0] = 0  # no target where the input is padding

    def losses_of(sl):
        if last_only:
            scores = model(x[sl], last_only=True)
            return per_example_cross_entropy(scores, y[sl, -1], ignore_index=0)
        return per_example_cross_entropy(model(x[sl]), y[sl], ignore_index=0)

    return model, losses_of, batch


MODES = ["book_keeping", "ghost"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm_method", ["auto", "ghost", "instantiate"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_engine_matches_oracle(cell, tied, norm_method, mode):
    model, losses_of, b = seqrec_case(cell, tied)
    assert_engine_matches_oracle(model, losses_of, b, mode=mode, norm_method=norm_method)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("batch", "seq"), [(1, 6), (4, 1), (1, 1)])
@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_engine_matches_oracle_tiny_shapes(cell, batch, seq, mode):
    model, losses_of, b = seqrec_case(cell, True, batch=batch, seq=seq, n_layer=1)
    assert_engine_matches_oracle(model, losses_of, b, mode=mode)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_engine_matches_oracle_last_item_loss(cell, tied):
    model, losses_of, b = seqrec_case(cell, tied, last_only=True)
    assert_engine_matches_oracle(model, losses_of, b, mode="book_keeping")


# -- the recommender --------------------------------------------------------------------------


def small_recommender(cell="gru", seed=12, **overrides):
    torch.manual_seed(seed)
    cfg = dict(n_items=20, cell=cell, max_len=12, d_model=6, n_layer=2, dropout=0.0)
    return SeqRecRNN(SeqRecRNNConfig(**{**cfg, **overrides})).to(F64).eval()


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_shapes_tying_and_padding_column(cell, tied):
    model = small_recommender(cell, tie_embeddings=tied)
    assert (model.head.weight is model.item_emb.weight) is tied
    assert model.head.bias is None and model.item_emb.padding_idx == 0
    assert (model.item_emb.weight[0] == 0).all()
    items = torch.tensor([[0, 0, 3, 4, 5], [1, 2, 3, 4, 20]])
    scores = model(items)
    assert scores.shape == (2, 5, 21)
    assert (scores[..., 0] == PAD_SCORE).all() and torch.isfinite(scores).all()
    assert (scores.argmax(-1) != 0).all()
    assert (scores.softmax(-1)[..., 0] == 0).all()
    last = model.last_scores(items)
    assert last.shape == (2, 21)
    torch.testing.assert_close(last, scores[:, -1], **TOL)
    half = small_recommender(cell, tie_embeddings=tied).half()
    assert torch.isfinite(half(items).float()).all()  # PAD_SCORE clamped to float16's range


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_left_padding_does_not_change_the_scores(cell):
    model = small_recommender(cell)
    with torch.no_grad():  # as after noisy DP steps: the padding row is no longer zero
        model.item_emb.weight[0].normal_()
    seq = torch.tensor([7, 3, 3, 19, 1])
    rows = [torch.cat([torch.zeros(p, dtype=torch.long), seq]) for p in (0, 1, 4, 7)]
    alone = [model.last_scores(r.unsqueeze(0))[0] for r in rows]
    batch = model.last_scores(torch.stack([nn.functional.pad(r, (12 - len(r), 0)) for r in rows]))
    for i, row in enumerate(rows):
        torch.testing.assert_close(alone[i], alone[0], **TOL)
        torch.testing.assert_close(batch[i], alone[0], **TOL)
        full = model(row.unsqueeze(0))[0, -len(seq) :]  # every real position, not only the last
        torch.testing.assert_close(full, model(seq.unsqueeze(0))[0], **TOL)


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_last_scores_with_right_padding_equal_left_padding(cell):
    model = small_recommender(cell)
    left = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    right = torch.tensor([[5, 6, 7, 0, 0], [1, 2, 3, 4, 5]])
    torch.testing.assert_close(model.last_scores(right), model.last_scores(left), **TOL)


def test_dropout_is_active_in_training_only():
    model = small_recommender(dropout=0.5, n_layer=2).train()
    items = torch.randint(1, 21, (3, 6))
    assert not torch.equal(model(items), model(items))
    model.eval()
    torch.testing.assert_close(model(items), model(items), **TOL)


def test_default_config_and_bad_items():
    cfg = SeqRecRNNConfig(n_items=5)
    assert (cfg.cell, cfg.max_len, cfg.d_model, cfg.n_layer) == ("gru", 50, 64, 1)
    assert (cfg.dropout, cfg.tie_embeddings) == (0.2, True)
    model = SeqRecRNN(SeqRecRNNConfig(n_items=5, max_len=4))
    assert isinstance(model.rnn, DPGRU) and model.rnn.batch_first
    assert isinstance(SeqRecRNN(SeqRecRNNConfig(n_items=5, cell="lstm")).rnn, DPLSTM)
    with pytest.raises(ValueError, match=re.escape("sequence length L=5 is not allowed")):
        model(torch.ones(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=re.escape("items has shape (5,): expected")):
        model(torch.ones(5, dtype=torch.long))
    with pytest.raises(TypeError, match=r"^config is a dict: expected a SeqRecRNNConfig$"):
        SeqRecRNN({"n_items": 5})


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("n_items", 0, "an integer >= 1"),
        ("n_items", 2.0, "an integer >= 1"),
        ("n_items", True, "an integer >= 1"),
        ("cell", "rnn", "one of ['gru', 'lstm']"),
        ("cell", "GRU", "one of ['gru', 'lstm']"),
        ("max_len", 0, "an integer >= 1"),
        ("d_model", -3, "an integer >= 1"),
        ("n_layer", 0, "an integer >= 1"),
        ("dropout", 1.0, "a number in [0, 1)"),
        ("dropout", -0.1, "a number in [0, 1)"),
        ("dropout", True, "a number in [0, 1)"),
        ("tie_embeddings", 1, "True or False"),
    ],
)
def test_config_rejects_bad_values(field, value, expected):
    kwargs = {"n_items": 10, field: value}
    with pytest.raises(
        ValueError, match="^" + re.escape(f"{field}={value!r} is not allowed: expected {expected}")
    ):
        SeqRecRNNConfig(**kwargs)
