"""Matrix products on low-precision records, with float32 results, and clipped sums
whose scaling loses nothing.

Under bf16 autocast or with bf16 weights, a clipped module's record ``(a, g)`` is
bf16. Every product of two bf16 numbers is exact in float32 (8 + 8 significant
bits <= 24), so a GEMM with bf16 operands and float32 accumulation and output
computes the same sums of the same exact products as a float32 GEMM on the
upcast record: only the order of the float32 additions differs. On CUDA such a
GEMM runs on tensor cores (``torch.mm(..., out_dtype=torch.float32)``); elsewhere
the operands are upcast and the GEMM runs in float32 (:func:`mm_f32`,
:func:`bmm_f32`). Norms (Gram matrices, instantiated per-example gradients) use
these products directly.

The clipped sum sum_i c_i a_i^T g_i needs one scaled operand, c_i g_i. Rounding
c_i g_i to bf16 would change example i's contribution by up to 2^-8 of each
entry, and the norm of that change is not bounded by 2^-8 of the clipped norm
(tokens' contributions cancel: the bound grows with the number of tokens), so
one record could move the sum by more than C. Instead (:func:`scaled_split`):

1. each factor is rounded *down* to 8 significant bits (:func:`round_down_bf16`),
   at most 2^-7 (0.8%) below c_i: a smaller factor only shrinks the contribution;
2. c_i g_t is then a product of two 8-bit significands: 16 significant bits,
   exact in float32, and exactly hi + lo with hi = bf16(c_i g_t) and lo =
   c_i g_t - hi, each representable in bf16 (|lo| is at most half a unit of hi's
   last place and a whole multiple of the product's last place: at most 8 bits);
   :func:`split_bf16` forms hi and -lo in two kernels;
3. a^T (c g) = a^T hi - a^T (-lo): two bf16 GEMMs with float32 accumulation.

So the contribution summed is exactly c'_i a_i^T g_i with c'_i <= c_i, up to
float32 accumulation, the same rounding as a float32 GEMM has (the one a float32
implementation also has, and which every float32 DP implementation leaves out of
its bound: relative 2^-24 per addition). The one exception: a lo part below
bf16's normal range (|c g| < 2^-118) loses bits, an absolute error below 2^-126
per entry. docs/engine.md, "Precision", states the argument.

**One GEMM, its rounding bounded** (``sum_rounding="bounded"``, :func:`one_gemm_sums`):
the scaled operand c'_i x_t is rounded to bf16 once (round to nearest: each entry moves
by at most u = 2^-8 of itself) and the sum is one bf16 GEMM. Example i's contribution is
then c'_i a_i^T g_i + E_i with

    ||E_i||_F = ||sum_t e_t y_t^T||_F <= sum_t ||e_t|| ||y_t|| <= u c'_i sum_t ||x_t|| ||y_t||,

(e_t the rounding of token t's scaled row, y_t the other operand's row): not bounded by
the clipped norm, but by a figure known before the factors are (:func:`rounding_bound`),
which the engine adds to the norm it clips (c_i = C / (||g_i|| + R_i) for a clipped
example, R_i the bounds' root sum of squares over parameters), so that one record still
moves the sum by at most C. An example with factor 1 is not rounded at all.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import Tensor

from dptrain.clipping.precision import LOW_PRECISION, upcast

__all__ = [
    "ROUNDING_UNIT",
    "bmm_f32",
    "flops_emulated",
    "has_split",
    "mm_f32",
    "one_gemm_sums",
    "ops_emulated",
    "product_dtype",
    "round_down_bf16",
    "rounding_bound",
    "row_norm_cache",
    "scaled_cross",
    "scaled_split",
    "split_bf16",
    "split_cache",
    "tensor_cores",
]


# FLOPs of GEMMs that run on tensor cores on CUDA but were computed in float32 here (no
# float32-output low-precision GEMM on this device), and FLOPs CUDA runs that this device
# did not (the second GEMM of a split clipped sum): the CPU proxies count the step as it
# would run on a GPU (benchmarks/cpu_proxies.py). Counted only while on.
_EMULATED = {"on": False, "flops": 0, "extra": 0, "ops": 0}


def flops_emulated(reset: bool = False, on: bool | None = None) -> tuple[int, int]:
    """(FLOPs of float32 GEMMs here that are low-precision GEMMs on CUDA, FLOPs of GEMMs
    CUDA adds) since the last reset; ``on`` switches counting."""
    n = (_EMULATED["flops"], _EMULATED["extra"])
    if reset:
        _EMULATED["flops"] = _EMULATED["extra"] = _EMULATED["ops"] = 0
    if on is not None:
        _EMULATED["on"] = on
    return n


def tensor_cores(*tensors: Tensor) -> bool:
    """Whether products of these tensors are formed as low-precision GEMMs with float32
    output: all bf16 (or all fp16) on a CUDA device."""
    first = tensors[0]
    return (
        first.is_cuda
        and first.dtype in LOW_PRECISION
        and all(t.dtype == first.dtype and t.is_cuda for t in tensors)
    )


def ops_emulated() -> int:
    """aten ops CUDA dispatches minus those dispatched here for the same products, since
    the last reset (:func:`flops_emulated`): the upcasts here are absent there, the split
    of a clipped sum (4 ops, a second GEMM and an add) is there only."""
    return _EMULATED["ops"]


def _count(flops: int, *tensors: Tensor) -> None:
    if not _EMULATED["on"]:
        return
    if all(t.dtype in LOW_PRECISION for t in tensors):
        _EMULATED["flops"] += flops
    _EMULATED["ops"] -= sum(t.dtype in LOW_PRECISION for t in tensors)


# Whether this torch has float32-output low-precision GEMMs (``out_dtype``, torch >=
# 2.8 on CUDA), and their ``out=`` form; learnt at the first call, so an older build
# falls back to float32 (or to a copy into ``out``).
_OUT_DTYPE = {"ok": True, "into": True}


def _low_precision_gemm(op, x: Tensor, y: Tensor, out: Tensor | None = None) -> Tensor | None:
    if not (_OUT_DTYPE["ok"] and tensor_cores(x, y)):
        return None
    if out is not None and _OUT_DTYPE["into"]:
        try:
            return op(x, y, out_dtype=torch.float32, out=out)
        except (TypeError, RuntimeError, NotImplementedError):
            _OUT_DTYPE["into"] = False  # a build without the out= form: product, then copy
    try:
        got = op(x, y, out_dtype=torch.float32)
        return got if out is None else out.copy_(got)
    except (TypeError, RuntimeError, NotImplementedError):
        _OUT_DTYPE["ok"] = False  # the same products in float32 below
        return None


def mm_f32(x: Tensor, y: Tensor) -> Tensor:
    """x @ y in float32 for 2-D x, y: tensor cores on CUDA for bf16/fp16 operands."""
    out = _low_precision_gemm(torch.mm, x, y)
    if out is not None:
        return out
    _count(2 * x.shape[0] * x.shape[1] * y.shape[1], x, y)
    return torch.mm(upcast(x), upcast(y))


def bmm_f32(x: Tensor, y: Tensor, out: Tensor | None = None) -> Tensor:
    """x @ y in float32 for 3-D x, y (batched): tensor cores on CUDA for bf16/fp16.

    ``out``: where to write it (a (B, m, n) tensor of :func:`product_dtype`'s dtype,
    rows contiguous, batches at any stride: a slot of a larger buffer), saving the copy
    into it; None: a new tensor."""
    got = _low_precision_gemm(torch.bmm, x, y, out)
    if got is not None:
        return got
    _count(2 * x.shape[0] * x.shape[1] * x.shape[2] * y.shape[2], x, y)
    return torch.bmm(upcast(x), upcast(y), out=out)


def product_dtype(x: Tensor, y: Tensor) -> torch.dtype | None:
    """The dtype of :func:`mm_f32` / :func:`bmm_f32` of x and y: float32 for low-precision
    operands, else their own; None where their dtypes differ (no ``out`` then)."""
    if x.dtype != y.dtype:
        return None
    return torch.float32 if x.dtype in LOW_PRECISION else x.dtype


def round_down_bf16(c: Tensor) -> Tensor:
    """Non-negative float32 factors rounded toward zero to 8 significant bits (bf16's),
    returned in float32: c' <= c, c' >= c (1 - 2^-7)."""
    c = c.float()
    # Truncating the low 16 bits of a non-negative float32 rounds it toward zero.
    return (c.contiguous().view(torch.int32) & ~0xFFFF).view(torch.float32).view(c.shape)


# The last factors rounded (:func:`_rounded_rows`): every clipped linear layer's sum of a
# step scales by the same factors, and rounding them is 6 aten ops. The entry holds the
# factors themselves, so their id cannot be reused while it lives.
_ROUNDED: dict[str, tuple] = {}


def _rounded_rows(factors: Tensor, x: Tensor) -> Tensor:
    """``round_down_bf16(factors)`` on ``x``'s device, shaped (B, 1, ..., 1) for ``x``."""
    key = (id(factors), factors._version, x.device, x.dim())
    held = _ROUNDED.get("last")
    if held is None or held[0] != key:
        c = round_down_bf16(factors).to(x.device).view(-1, *([1] * (x.dim() - 1)))
        held = _ROUNDED["last"] = (key, factors, c)
    return held[2]


def _scaled_rows(x: Tensor, factors: Tensor) -> Tensor:
    """Rows of a low-precision ``x`` times the factors rounded down to 8 bits, in float32:
    exact (8 x 8 significant bits). bf16 x float32 promotes inside the multiplication
    (no upcast copy of x)."""
    return torch.mul(x, _rounded_rows(factors, x))


# The split cache's slot while a split_cache block runs (None outside one).
_SPLITS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("splits", default=None)


class split_cache:  # noqa: N801 (used as a context manager, like contextlib's)
    """Within this block, :func:`scaled_split` keeps its last result in ``held`` (the
    caller's dict, which outlives the block and is cleared by the caller) and returns it
    again for the same rows and factors: q, k and v scale one recorded input, gate and up
    another, and each split is four kernel launches. The entry holds the rows and the
    factors themselves, so that their memory cannot be reused while it lives; the key
    includes their versions, so an in-place change misses.

    A class rather than a ``contextlib.contextmanager``: the engine enters it once per
    clipped parameter and step, and the generator-based form cost about 5 us each."""

    __slots__ = ("_held", "_token")

    def __init__(self, held: dict):
        self._held = held

    def __enter__(self) -> None:
        self._token = _SPLITS.set(self._held)

    def __exit__(self, *exc) -> None:
        _SPLITS.reset(self._token)


def _memory_key(x: Tensor) -> tuple:
    """What identifies a tensor's values while a cache holds the tensor (so that its memory
    cannot be reused): its memory, layout, dtype, device and version (an in-place change
    makes a new version)."""
    return (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device, x._version)


def _split_key(x: Tensor, factors: Tensor) -> tuple:
    return (*_memory_key(x), id(factors), factors._version)


def has_split(x: Tensor, factors: Tensor) -> bool:
    """Whether :func:`scaled_split` of these rows and factors is held (:func:`split_cache`)."""
    held = _SPLITS.get()
    return held is not None and held.get("key") == _split_key(x, factors)


def scaled_split(x: Tensor, factors: Tensor) -> tuple[Tensor, ...]:
    """Rows of a bf16/fp16 ``x`` (B, ...) scaled by ``factors`` rounded down to 8 bits
    (:func:`round_down_bf16`), as parts whose sum is the scaled rows exactly.

    On CUDA with bf16 ``x``: (hi, minus_lo), both bf16, the rows being hi - minus_lo
    (:func:`split_bf16`). Elsewhere: one float32 tensor (the same rows, exact in
    float32), for a float32 GEMM. Within :func:`split_cache`, the same rows and factors
    are split once.
    """
    held = _SPLITS.get()
    key = None if held is None else _split_key(x, factors)
    if held is not None and held.get("key") == key:
        return held["parts"]
    if not (x.is_cuda and x.dtype == torch.bfloat16 and _OUT_DTYPE["ok"]):
        # one float32 GEMM: two would be float32 too
        parts: tuple[Tensor, ...] = (_scaled_rows(x, factors),)
    else:
        parts = split_bf16(x, _rounded_rows(factors, x))
    if held is not None:
        held.clear()
        held.update(key=key, rows=x, factors=factors, parts=parts)
    return parts


def split_bf16(x: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """x * c for bf16 ``x`` and float32 ``c`` of at most 8 significant bits (broadcast
    over x: (B, 1, ..., 1) factors), as bf16 (hi, minus_lo) with x * c = hi - minus_lo
    exactly.

    Two kernels: hi is the product (16 significant bits, exact in float32) rounded to
    bf16 as it is stored; minus_lo = hi - x * c, computed in float32 (one fused
    multiply-add where the device contracts it) and stored as bf16. Both steps are exact:
    |x c - hi| is at most half a unit of hi's last place, so the subtraction loses
    nothing (Sterbenz), and a whole multiple of the product's last place, so it fits in
    bf16's 8 bits. (As a float32 product, a cast, a subtraction and a cast it took four.)
    """
    hi = _product_bf16(x, c)
    minus_lo = torch.addcmul(hi, x, c, value=-1, out=torch.empty_like(hi))
    return hi, minus_lo


def _product_bf16(x: Tensor, c: Tensor) -> Tensor:
    """x * c computed in float32 and rounded to nearest bf16 as it is stored: one kernel
    (a float32 product and a cast would be two)."""
    return torch.mul(x, c, out=torch.empty(x.shape, dtype=torch.bfloat16, device=x.device))


#: Round to nearest bf16 moves a value (in bf16's normal range) by at most this much of
#: itself: half a unit in the last of 8 significant bits.
ROUNDING_UNIT = 2.0**-8

# Whether scaled_cross forms the sum of a bf16 record as one GEMM (its rounding bounded by
# rounding_bound and absorbed by the clip factors): only within one_gemm_sums(True).
_ONE_GEMM: contextvars.ContextVar[bool] = contextvars.ContextVar("one_gemm", default=False)


@contextlib.contextmanager
def one_gemm_sums(on: bool = True) -> Iterator[None]:
    """Within this block, :func:`scaled_cross` on bf16 rows rounds the scaled operand to
    bf16 and runs one GEMM. Only for sums whose clip factors absorbed
    :func:`rounding_bound` of the same record: the engine enters it per module, for the
    modules whose bounds it added (sums.py)."""
    token = _ONE_GEMM.set(on)
    try:
        yield
    finally:
        _ONE_GEMM.reset(token)


# The active cache of row norms, or None (see row_norm_cache).
_ROW_NORMS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("row_norms", default=None)


@contextlib.contextmanager
def row_norm_cache() -> Iterator[None]:
    """Within this block, :func:`rounding_bound` computes the row norms of a tensor once
    (the q/k/v projections read one input, as do gate and up). The key is the tensor's
    memory and layout (data pointer, shape, strides, dtype, device, version); the entry
    holds the tensor, so that its memory cannot be reused by another while the cache lives."""
    token = _ROW_NORMS.set({} if _ROW_NORMS.get() is None else _ROW_NORMS.get())
    try:
        yield
    finally:
        _ROW_NORMS.reset(token)


def _scaled_row_norms(x: Tensor) -> Tensor:
    """u ||x_t|| for each row of x, (B, T) in float32 (accumulated in float32): once per
    tensor within :func:`row_norm_cache`."""
    cache = _ROW_NORMS.get()
    key = None
    if cache is not None:
        key = _memory_key(x)
        hit = cache.get(key)
        if hit is not None:
            return hit[1]
    norms = torch.linalg.vector_norm(x, dim=-1, dtype=torch.float32).mul_(ROUNDING_UNIT)
    if cache is not None:
        cache[key] = (x, norms)
    return norms


def rounding_bound(x: Tensor, y: Tensor) -> Tensor:
    """u sum_t ||x_t|| ||y_t||, (B,) in float32, for rows x (B, T, p), y (B, T, d): divided
    by c'_i, a bound on how far rounding the scaled rows (either operand's) to bf16 moves
    example i's sum c'_i x_i^T y_i (module docstring). Norms accumulate in float32; u
    multiplies x's (an input several layers read: once)."""
    ny = torch.linalg.vector_norm(y, dim=-1, dtype=torch.float32)
    return torch.linalg.vecdot(_scaled_row_norms(x), ny)


def scaled_cross(x: Tensor, y: Tensor, factors: Tensor, scale_x: bool) -> Tensor:
    """sum_i c_i x_i^T y_i, (p, d), in float32, for low-precision rows x (B, T, p) and
    y (B, T, d): one operand (x if ``scale_x``, else y) scaled by the factors rounded down
    (:func:`scaled_split`), so that each example's contribution is exactly c'_i x_i^T y_i
    up to float32 accumulation; within :func:`one_gemm_sums` and for bf16 rows, that
    operand rounded to bf16 and one GEMM (the contribution within :func:`rounding_bound`
    times c'_i of it)."""
    if _ONE_GEMM.get() and x.dtype == y.dtype == torch.bfloat16:
        # the one rounding the bound covers
        rows = x if scale_x else y
        rounded = _product_bf16(rows, _rounded_rows(factors, rows))
        left, right = (rounded, y) if scale_x else (x, rounded)
        return mm_f32(left.flatten(0, 1).T, right.flatten(0, 1))
    # for the CUDA op count only: a split held (split_cache) dispatches none of its ops
    hit = _EMULATED["on"] and has_split(x if scale_x else y, factors)
    parts = scaled_split(x if scale_x else y, factors)
    total = None
    for part in parts:  # the scaled rows, or (hi, minus_lo): hi - minus_lo
        left, right = (part, y) if scale_x else (x, part)
        prod = mm_f32(left.flatten(0, 1).T, right.flatten(0, 1))
        total = prod if total is None else total.sub_(prod)
    if len(parts) == 1 and _EMULATED["on"] and x.dtype == y.dtype == torch.bfloat16:
        flops = 2 * x.shape[0] * x.shape[1] * x.shape[2] * y.shape[2]
        _EMULATED["flops"] += 2 * flops  # two bf16 GEMMs on CUDA (hi, lo) ...
        _EMULATED["extra"] += flops  # ... for this one float32 GEMM
        # beyond this multiplication and GEMM: the split's fused multiply-add (none where
        # the split was held), a second GEMM, a subtraction
        _EMULATED["ops"] += 2 if hit else 3
    return total
