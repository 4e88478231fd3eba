"""GRU and LSTM built from ``nn.Linear`` layers, and an RNN next-item recommender.

Why not ``nn.GRU`` / ``nn.LSTM``
--------------------------------
PyTorch's recurrent modules keep their weights as raw parameters
(``weight_ih_l0``, ``weight_hh_l0``, ...), for which the clipping engine has
no per-example rule, so it refuses them (see :mod:`dptrain.models.gpt` on why
only ``nn.Linear``, ``nn.Embedding`` and ``nn.LayerNorm`` may hold
parameters). Here each layer holds two ``nn.Linear`` modules instead:

- ``ih = nn.Linear(d_in, G h)``: input to hidden, applied ONCE to the whole
  (B, L, d_in) sequence (one large matrix product instead of L small ones);
- ``hh = nn.Linear(h, G h)``: hidden to hidden, applied at every time step to
  the (B, h) state.

with G = 3 gates for the GRU and 4 for the LSTM. The engine records every call
of a module and concatenates the calls along the token axis, so the L calls of
``hh`` give its exact per-example gradient sum_t g_t h_{t-1}^T.

The equations and gate order are exactly PyTorch's, so weights copied from an
``nn.GRU`` / ``nn.LSTM`` (:meth:`DPGRU.from_torch`, :meth:`DPLSTM.from_torch`)
give the same outputs. With x_t the input and h the previous state:

GRU (gates r, z, n; ``ih`` rows [W_ir; W_iz; W_in], ``hh`` rows [W_hr; W_hz; W_hn])::

    r  = sigmoid(W_ir x_t + b_ir + W_hr h + b_hr)
    z  = sigmoid(W_iz x_t + b_iz + W_hz h + b_hz)
    n  = tanh(W_in x_t + b_in + r * (W_hn h + b_hn))    # b_hn inside the r product
    h' = (1 - z) * n + z * h

LSTM (gates i, f, g, o; state (h, c))::

    i, f, g, o = split(W_ih x_t + b_ih + W_hh h + b_hh)
    c' = sigmoid(f) * c + sigmoid(i) * tanh(g)
    h' = sigmoid(o) * tanh(c')

Padding
-------
:class:`DPGRU` and :class:`DPLSTM` take an optional boolean ``mask`` (B, L),
True at real steps. At a masked step the state is carried over unchanged and
the output is zero, as for a packed sequence (``pack_padded_sequence``). With
LEFT padding the state therefore stays at its initial value (zero) until the
first real item, so the result does not depend on how much padding precedes a
sequence, nor on the embedding of the padding id (DP noise makes that row
non-zero after the first step, although ``padding_idx`` starts it at zero), and
padding steps contribute nothing to any gradient. Without a mask every step is
a real step, as in PyTorch.

:class:`SeqRecRNN` is the GRU/LSTM baseline of DPFormer-style sequential
recommendation: item embedding -> dropout -> recurrent layers -> scores
against every item, with the output layer optionally tied to the item
embedding (phantom clipping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "DPGRU",
    "DPLSTM",
    "PAD_SCORE",
    "DPGRUCell",
    "DPLSTMCell",
    "SeqRecRNN",
    "SeqRecRNNConfig",
]

#: Score given to the padding column 0 of :class:`SeqRecRNN` (clamped to half the
#: dtype's range for float16): finite, so sums and differences of scores stay
#: finite, yet exp(PAD_SCORE - max) is exactly 0, so item 0 is never predicted.
PAD_SCORE = -1e9

_CELLS = ("gru", "lstm")


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is not allowed: expected an integer >= {minimum}")
    return value


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is not allowed: expected True or False")
    return value


def _check_dropout(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1:
        raise ValueError(f"dropout={value!r} is not allowed: expected a number in [0, 1)")
    return float(value)


# -- cells ----------------------------------------------------------------------------------


class _DPCellBase(nn.Module):
    """Two Linear layers ``ih`` (d_in -> G h) and ``hh`` (h -> G h); subclasses set G."""

    gates: int

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.input_size = _check_int("input_size", input_size, 1)
        self.hidden_size = _check_int("hidden_size", hidden_size, 1)
        self.bias = _check_bool("bias", bias)
        g = self.gates * hidden_size
        self.ih = nn.Linear(input_size, g, bias=bias, device=device, dtype=dtype)
        self.hh = nn.Linear(hidden_size, g, bias=bias, device=device, dtype=dtype)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """PyTorch's RNN initialisation: every weight and bias uniform in +-1/sqrt(h)."""
        k = 1.0 / math.sqrt(self.hidden_size)
        for p in self.parameters():
            nn.init.uniform_(p, -k, k)

    @torch.no_grad()
    def _load(self, w_ih: Tensor, w_hh: Tensor, b_ih: Tensor | None, b_hh: Tensor | None):
        self.ih.weight.copy_(w_ih)
        self.hh.weight.copy_(w_hh)
        if self.bias:
            self.ih.bias.copy_(b_ih)
            self.hh.bias.copy_(b_hh)

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}, bias={self.bias}"

    @classmethod
    def _from_torch_cell(cls, cell: nn.Module, torch_type: type[nn.Module]):
        if type(cell) is not torch_type:
            raise TypeError(
                f"cell is a {type(cell).__name__}: expected an nn.{torch_type.__name__}"
            )
        w = cell.weight_ih
        out = cls(cell.input_size, cell.hidden_size, cell.bias, device=w.device, dtype=w.dtype)
        out._load(cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh)
        return out.train(cell.training)


class DPGRUCell(_DPCellBase):
    """``nn.GRUCell`` from two ``nn.Linear`` layers (see the module docstring for the equations).

    Args:
        input_size: features of the input x_t.
        hidden_size: features of the state h.
        bias: whether ``ih`` and ``hh`` have biases (b_i* and b_h*).
        device, dtype: as for ``nn.Linear``.

    ``ih.weight`` is PyTorch's ``weight_ih`` (rows r, z, n), ``hh.weight`` its
    ``weight_hh``, and likewise the biases.
    """

    gates = 3

    def step(self, xp: Tensor, h: Tensor) -> Tensor:
        """One step from the input projection ``xp = ih(x_t)`` (B, 3h) and state h (B, h)."""
        hp = self.hh(h)  # (B, 3h), includes b_h*
        xr, xz, xn = xp.chunk(3, -1)
        hr, hz, hn = hp.chunk(3, -1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (1 - z) * n + z * h

    def forward(self, input: Tensor, hx: Tensor | None = None) -> Tensor:
        """As ``nn.GRUCell``: x (B, d_in) or (d_in,), h (B, h) or (h,) -> h' of h's shape."""
        x, h, unbatched = _cell_args(self, input, hx)
        out = self.step(self.ih(x), h)
        return out.squeeze(0) if unbatched else out

    @classmethod
    def from_torch(cls, cell: nn.GRUCell) -> DPGRUCell:
        """A copy of ``cell``'s weights (same device, dtype and training mode)."""
        return cls._from_torch_cell(cell, nn.GRUCell)


class DPLSTMCell(_DPCellBase):
    """``nn.LSTMCell`` from two ``nn.Linear`` layers (see the module docstring for the equations).

    Args:
        input_size: features of the input x_t.
        hidden_size: features of the states h and c.
        bias: whether ``ih`` and ``hh`` have biases.
        device, dtype: as for ``nn.Linear``.

    ``ih.weight`` is PyTorch's ``weight_ih`` (rows i, f, g, o), ``hh.weight``
    its ``weight_hh``, and likewise the biases.
    """

    gates = 4

    def step(self, xp: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """One step from ``xp = ih(x_t)`` (B, 4h) and the state (h, c) (B, h) each."""
        h, c = state
        i, f, g, o = (xp + self.hh(h)).chunk(4, -1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c

    def forward(
        self, input: Tensor, hx: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """As ``nn.LSTMCell``: x (B, d_in) or (d_in,), (h, c) (B, h) each -> (h', c')."""
        h0, c0 = (None, None) if hx is None else hx
        x, h, unbatched = _cell_args(self, input, h0)
        _, c, _ = _cell_args(self, input, c0)
        h, c = self.step(self.ih(x), (h, c))
        return (h.squeeze(0), c.squeeze(0)) if unbatched else (h, c)

    @classmethod
    def from_torch(cls, cell: nn.LSTMCell) -> DPLSTMCell:
        """A copy of ``cell``'s weights (same device, dtype and training mode)."""
        return cls._from_torch_cell(cell, nn.LSTMCell)


def _cell_args(cell: _DPCellBase, x: Tensor, h: Tensor | None) -> tuple[Tensor, Tensor, bool]:
    if x.dim() not in (1, 2) or x.shape[-1] != cell.input_size:
        raise ValueError(
            f"input has shape {tuple(x.shape)}: expected (batch, {cell.input_size}) "
            f"or ({cell.input_size},)"
        )
    unbatched = x.dim() == 1
    if unbatched:
        x = x.unsqueeze(0)
    want = (x.shape[0], cell.hidden_size)
    if h is None:
        h = x.new_zeros(want)
    else:
        if unbatched:
            h = h.unsqueeze(0)
        if tuple(h.shape) != want:
            raise ValueError(f"state has shape {tuple(h.shape)}: expected {want} for this input")
    return x, h, unbatched


# -- sequence layers ------------------------------------------------------------------------


class _DPRNNBase(nn.Module):
    cell_type: type[_DPCellBase]
    torch_type: type[nn.RNNBase]

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.input_size = _check_int("input_size", input_size, 1)
        self.hidden_size = _check_int("hidden_size", hidden_size, 1)
        self.num_layers = _check_int("num_layers", num_layers, 1)
        self.bias = _check_bool("bias", bias)
        self.batch_first = _check_bool("batch_first", batch_first)
        self.dropout = _check_dropout(dropout)
        self.cells = nn.ModuleList(
            self.cell_type(
                input_size if k == 0 else hidden_size, hidden_size, bias, device=device, dtype=dtype
            )
            for k in range(num_layers)
        )

    def extra_repr(self) -> str:
        return (
            f"{self.input_size}, {self.hidden_size}, num_layers={self.num_layers}, "
            f"bias={self.bias}, batch_first={self.batch_first}, dropout={self.dropout}"
        )

    # Subclasses: the state as a tuple of (num_layers, B, h) tensors, and back.
    def _states_in(self, hx, batch: int, like: Tensor, unbatched: bool) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def _states_out(self, states: tuple[Tensor, ...]):
        raise NotImplementedError

    def _check_state(self, name: str, h: Tensor, batch: int, unbatched: bool) -> Tensor:
        want = (self.num_layers, *(() if unbatched else (batch,)), self.hidden_size)
        if tuple(h.shape) != want:
            raise ValueError(f"{name} has shape {tuple(h.shape)}: expected {want} for this input")
        return h.unsqueeze(1) if unbatched else h

    def _run(self, input: Tensor, hx, mask: Tensor | None):
        if input.dim() not in (2, 3) or input.shape[-1] != self.input_size:
            raise ValueError(
                f"input has shape {tuple(input.shape)}: expected (batch, seq_len, "
                f"{self.input_size}) with batch_first=True, (seq_len, batch, {self.input_size}) "
                f"with batch_first=False, or (seq_len, {self.input_size}) unbatched"
            )
        unbatched = input.dim() == 2
        # Internally batch first: every Linear then gets inputs whose first dimension is
        # the batch, as the clipping engine requires.
        if unbatched:
            x = input.unsqueeze(0)
        else:
            x = input if self.batch_first else input.transpose(0, 1)
        b, length = x.shape[0], x.shape[1]
        if length == 0:
            raise ValueError("input has sequence length 0: expected at least one step")
        if mask is not None:
            want = (length,) if unbatched else (b, length)
            if tuple(mask.shape) != want:
                raise ValueError(
                    f"mask has shape {tuple(mask.shape)}: expected {want} (batch, seq_len), "
                    "True at real steps"
                )
            mask = mask.to(device=x.device, dtype=torch.bool).reshape(b, length)
        states = self._states_in(hx, b, x, unbatched)  # each (num_layers, B, h)
        finals: list[tuple[Tensor, ...]] = []
        for k, cell in enumerate(self.cells):
            if k > 0 and self.dropout > 0:
                x = nn.functional.dropout(x, self.dropout, self.training)
            x, state = _run_layer(cell, x, tuple(s[k] for s in states), mask)
            finals.append(state)
        out_states = tuple(torch.stack(parts) for parts in zip(*finals, strict=True))
        if unbatched:
            x = x.squeeze(0)
            out_states = tuple(s.squeeze(1) for s in out_states)
        elif not self.batch_first:
            x = x.transpose(0, 1)
        return x, self._states_out(out_states)

    @classmethod
    def from_torch(cls, module: nn.RNNBase):
        """A copy of a stock ``nn.GRU`` / ``nn.LSTM`` (same sizes, options, device, dtype, mode).

        Bidirectional modules and LSTM projections (``proj_size``) are not supported.
        """
        if type(module) is not cls.torch_type:
            raise TypeError(
                f"module is a {type(module).__name__}: expected an nn.{cls.torch_type.__name__}"
            )
        if module.bidirectional:
            raise ValueError("bidirectional=True is not supported: expected a one-way module")
        if getattr(module, "proj_size", 0):
            raise ValueError(f"proj_size={module.proj_size} is not supported: expected 0")
        w = module.weight_ih_l0
        out = cls(
            module.input_size,
            module.hidden_size,
            module.num_layers,
            module.bias,
            module.batch_first,
            module.dropout,
            device=w.device,
            dtype=w.dtype,
        )
        for k, cell in enumerate(out.cells):
            w_ih, w_hh, b_ih, b_hh = (
                getattr(module, f"{name}_l{k}", None)
                for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
            )
            cell._load(w_ih, w_hh, b_ih, b_hh)
        return out.train(module.training)


def _run_layer(cell: _DPCellBase, x: Tensor, state: tuple[Tensor, ...], mask: Tensor | None):
    """One layer over x (B, L, d_in) -> outputs (B, L, h) and the final state."""
    xp = cell.ih(x)  # (B, L, G h): the input projection, once for all steps
    lstm = isinstance(cell, DPLSTMCell)
    outs = []
    for t in range(x.shape[1]):
        new = cell.step(xp[:, t], state) if lstm else (cell.step(xp[:, t], state[0]),)
        if mask is None:
            state, out = new, new[0]
        else:
            m = mask[:, t].unsqueeze(-1)  # (B, 1)
            state = tuple(torch.where(m, n, s) for n, s in zip(new, state, strict=True))
            out = new[0].masked_fill(~m, 0.0)
        outs.append(out)
    return torch.stack(outs, 1), state


class DPGRU(_DPRNNBase):
    """Multi-layer GRU from ``nn.Linear`` layers, a drop-in for a one-way ``nn.GRU``.

    Args:
        input_size, hidden_size, num_layers, bias, batch_first: as for ``nn.GRU``.
        dropout: dropout on the outputs of every layer but the last (training only).
        device, dtype: as for ``nn.Linear``.

    Layer k is ``cells[k]``, a :class:`DPGRUCell` (``cells[k].ih`` holds
    ``weight_ih_lk``/``bias_ih_lk``, ``cells[k].hh`` ``weight_hh_lk``/``bias_hh_lk``).
    """

    cell_type = DPGRUCell
    torch_type = nn.GRU

    def forward(
        self, input: Tensor, hx: Tensor | None = None, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """``(output, h_n)`` as ``nn.GRU``; ``mask`` (batch, seq_len) bool: True at real steps.

        ``input`` is (B, L, d_in) with ``batch_first``, else (L, B, d_in), or
        (L, d_in) unbatched; ``hx`` and ``h_n`` are (num_layers, B, h). At a
        masked step the state is kept and the output is zero (module docstring).
        """
        return self._run(input, hx, mask)

    def _states_in(self, hx, batch, like, unbatched):
        if hx is None:
            return (like.new_zeros(self.num_layers, batch, self.hidden_size),)
        return (self._check_state("hx", hx, batch, unbatched),)

    def _states_out(self, states):
        return states[0]

    @classmethod
    def from_torch(cls, module: nn.GRU) -> DPGRU:
        """A copy of a one-way ``nn.GRU`` (sizes, options, weights, device, dtype, mode)."""
        return super().from_torch(module)


class DPLSTM(_DPRNNBase):
    """Multi-layer LSTM from ``nn.Linear`` layers, a drop-in for a one-way ``nn.LSTM``.

    Args:
        input_size, hidden_size, num_layers, bias, batch_first: as for ``nn.LSTM``
            (no ``proj_size``, no ``bidirectional``).
        dropout: dropout on the outputs of every layer but the last (training only).
        device, dtype: as for ``nn.Linear``.

    Layer k is ``cells[k]``, a :class:`DPLSTMCell`.
    """

    cell_type = DPLSTMCell
    torch_type = nn.LSTM

    def forward(
        self,
        input: Tensor,
        hx: tuple[Tensor, Tensor] | None = None,
        mask: Tensor | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """``(output, (h_n, c_n))`` as ``nn.LSTM``; ``mask`` (batch, seq_len): True at real steps.

        Shapes as for :meth:`DPGRU.forward`; ``hx`` is ``(h_0, c_0)``.
        """
        return self._run(input, hx, mask)

    def _states_in(self, hx, batch, like, unbatched):
        if hx is None:
            zeros = like.new_zeros(self.num_layers, batch, self.hidden_size)
            return zeros, zeros
        h0, c0 = hx
        return (
            self._check_state("h_0", h0, batch, unbatched),
            self._check_state("c_0", c0, batch, unbatched),
        )

    def _states_out(self, states):
        return states

    @classmethod
    def from_torch(cls, module: nn.LSTM) -> DPLSTM:
        """A copy of a one-way ``nn.LSTM`` without projection (weights, device, dtype, mode)."""
        return super().from_torch(module)


# -- the recommender ------------------------------------------------------------------------


@dataclass
class SeqRecRNNConfig:
    """Sizes and options of a :class:`SeqRecRNN`; every field is checked on creation.

    Attributes:
        n_items: number of items; ids are 1..n_items, 0 is padding.
        cell: ``"gru"`` or ``"lstm"``.
        max_len: the longest input sequence accepted (the data's window length).
        d_model: item embedding size, which is also the hidden size of every
            recurrent layer (so the output layer can be tied to the embedding).
        n_layer: number of stacked recurrent layers.
        dropout: dropout probability in [0, 1) on the item embeddings and
            between stacked recurrent layers (training mode only).
        tie_embeddings: whether the scoring layer's weight is the item embedding
            (the same Parameter; phantom clipping in the engine).
    """

    n_items: int
    cell: str = "gru"
    max_len: int = 50
    d_model: int = 64
    n_layer: int = 1
    dropout: float = 0.2
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("n_items", "max_len", "d_model", "n_layer"):
            _check_int(name, getattr(self, name), 1)
        if self.cell not in _CELLS:
            raise ValueError(f"cell={self.cell!r} is not allowed: expected one of {list(_CELLS)}")
        _check_dropout(self.dropout)
        _check_bool("tie_embeddings", self.tie_embeddings)


class SeqRecRNN(nn.Module):
    """GRU/LSTM next-item recommender: ``forward(items (B, L)) -> scores (B, L, n_items + 1)``.

    ``items`` are item ids, LEFT-padded with 0. The model is::

        item_emb(items)        nn.Embedding(n_items + 1, d, padding_idx=0)
          -> dropout
          -> rnn               DPGRU / DPLSTM (n_layer, hidden d), masked at padding
          -> head              nn.Linear(d, n_items + 1, bias=False); weight = item_emb.weight if tied

    Score (b, t, j) rates item j as the next item after items[b, :t + 1]. There
    is no LayerNorm before the head (as in GRU4Rec): the recurrent output is
    already bounded in (-1, 1).

    - Padding: ``rnn`` gets ``mask = items != 0``; the state stays zero over
      the leading padding and the outputs there are zero, so scores do not
      depend on how much padding precedes a sequence, nor on the (noisy,
      after DP training) embedding row 0. Train with targets 0 at padded
      positions and ``per_example_cross_entropy(..., ignore_index=0)``.
    - Column 0 (padding) is set to :data:`PAD_SCORE` in every score vector, a
      finite constant rather than -inf: never the arg-max, probability exactly
      zero after softmax, and no gradient into row 0 of the head.
    - Initialisation: embedding (and an untied head) normal with std 0.02, row 0
      zero; recurrent layers as PyTorch's (uniform +-1/sqrt(d)).
    """

    def __init__(self, config: SeqRecRNNConfig) -> None:
        super().__init__()
        if not isinstance(config, SeqRecRNNConfig):
            raise TypeError(f"config is a {type(config).__name__}: expected a SeqRecRNNConfig")
        self.config = config
        d, v = config.d_model, config.n_items + 1
        self.item_emb = nn.Embedding(v, d, padding_idx=0)
        self.drop = nn.Dropout(config.dropout)
        rnn_type = DPGRU if config.cell == "gru" else DPLSTM
        self.rnn = rnn_type(d, d, config.n_layer, batch_first=True, dropout=config.dropout)
        self.head = nn.Linear(d, v, bias=False)
        if config.tie_embeddings:
            self.head.weight = self.item_emb.weight  # one Parameter, two modules
        pad_column = torch.zeros(v, dtype=torch.bool)
        pad_column[0] = True
        self.register_buffer("pad_column", pad_column, persistent=False)
        self._init_weights()

    @torch.no_grad()
    def _init_weights(self) -> None:
        nn.init.normal_(self.item_emb.weight, mean=0.0, std=0.02)
        if not self.config.tie_embeddings:
            nn.init.normal_(self.head.weight, mean=0.0, std=0.02)
        self.item_emb.weight[0].zero_()

    def forward(self, items: Tensor, last_only: bool = False) -> Tensor:
        """Scores (B, L, n_items + 1), or (B, n_items + 1) after the last item if ``last_only``.

        ``last_only`` scores the final state, which is the state after each
        sequence's last real item whether it is left- or right-padded.
        """
        if items.dim() != 2:
            raise ValueError(
                f"items has shape {tuple(items.shape)}: expected (batch, seq_len), two dimensions"
            )
        length = items.shape[1]
        if not 1 <= length <= self.config.max_len:
            raise ValueError(
                f"sequence length L={length} is not allowed: expected 1 <= L <= "
                f"max_len={self.config.max_len}"
            )
        x = self.drop(self.item_emb(items))  # (B, L, d)
        out, state = self.rnn(x, mask=items != 0)  # (B, L, d)
        if last_only:
            h_n = state if isinstance(state, Tensor) else state[0]  # LSTM: (h_n, c_n)
            h = h_n[-1]  # (B, d): the top layer's state after each sequence's last item
        else:
            h = out
        scores = self.head(h)  # (B, [L,] n_items + 1)
        value = max(PAD_SCORE, torch.finfo(scores.dtype).min / 2)
        return scores.masked_fill(self.pad_column, value)

    def last_scores(self, items: Tensor) -> Tensor:
        """Scores (B, n_items + 1) of the next item after each whole sequence."""
        return self(items, last_only=True)
