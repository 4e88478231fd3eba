"""Per-layer rules: per-example gradient norms and clipped gradient sums.

A registry keyed by module type, one signature for all (as Opacus's grad
samplers). Each rule sees what the engine captured for one module in one
forward/backward:

    a: the module's input,            shape (B, T, d_in) (T = 1 for 2-D inputs)
    g: gradient of sum_i L_i w.r.t. the module's output, shape (B, T, d_out)

Row i of ``g`` only carries example i's loss, so example i's parameter
gradient is a function of (a_i, g_i) alone, and for every rule here it is a
sum over tokens t (which is why several calls of one module can be
concatenated along T). A rule gives, per trainable parameter:

- ``norms_sq``: ||grad_i||^2 for each example, (B,), by the cheaper of
  ghost norm (Goodfellow 2015; Li et al. 2022 §4: ||g_i^T a_i||_F^2 =
  <a_i a_i^T, g_i g_i^T>, O(T^2 (d_in + d_out))) and instantiation
  (O(d_in d_out) per example), as chosen by the engine;
- ``clipped_sum``: sum_i c_i grad_i for per-example factors c (B,), computed
  from (a, g) directly (book-keeping, Bu et al. 2023) without per-example
  gradients;
- ``per_example``: the per-example gradients themselves (B, *shape), used
  where instantiation is cheaper and for parameters shared between modules.
"""

from __future__ import annotations

import abc
import contextlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dptrain.clipping.precision import LOW_PRECISION, upcast
from dptrain.clipping.tensor_cores import (
    bmm_f32,
    has_split,
    mm_f32,
    product_dtype,
    rounding_bound,
    scaled_cross,
)

__all__ = [
    "RULES",
    "RULES_BY_NAME",
    "Conv1DRule",
    "EmbeddingRule",
    "LayerRule",
    "LinearRule",
    "LookupEmbeddingRule",
    "NormLayerRule",
    "RMSNormRule",
    "RouterRule",
    "embedding_ghost_norm",
    "find_rule",
    "gram_cache",
    "gram_inner",
    "is_trainable",
    "param_of",
    "register_rule",
]


class LayerRule(abc.ABC):
    """How to clip one module type's parameters per example."""

    #: Parameter attribute names the rule handles, e.g. ("weight", "bias").
    param_names: tuple[str, ...] = ("weight", "bias")
    #: True where the module itself computes its parameter's gradient in float32 even in a
    #: float64 model (Gemma's RMSNorm): the engine's self-check compares at float32 accuracy.
    float32_inside: bool = False
    #: True where the rule upcasts the records it reads itself: they reach it in the
    #: dtypes the module computed in, not as float32 copies (``records.for_rule``).
    upcasts_itself: bool = False
    #: How norms are computed: "ghost" (always), "instantiate" (always: small
    #: per-example gradients), or "either" (the engine picks per call by cost).
    norm_choice: str = "instantiate"
    #: True where the per-example gradients are products of the record's two operands
    #: (a linear layer's): streamed on a bf16 record, they are kept in bf16, the dtype
    #: autograd forms the parameter's own gradient in (``streaming.Slots``).
    keeps_record_precision: bool = False

    def check(self, module: nn.Module) -> str | None:
        """A reason why this module cannot be clipped exactly, or None."""
        return None

    #: A forward pre-hook ``(module, args, kwargs) -> (args, kwargs) | None`` the engine
    #: registers on the module, for a rule that must change what the module is called with
    #: (relative_bias.py gives T5's shared bias an example dimension); None: no pre-hook.
    forward_pre_hook = None

    def claimed_modules(self, module: nn.Module) -> list[nn.Module]:
        """Submodules whose parameters this rule covers (they get no rule of their own)."""
        return []

    def output_of(self, module: nn.Module, output: object) -> Tensor | None:
        """The output tensor whose gradient the rule reads (None: the module returned none)."""
        return output if isinstance(output, Tensor) else None

    def recorded_input(self, module: nn.Module, inputs: list[Tensor]) -> Tensor | None:
        """The tensor recorded as the call's input ``a``: its first tensor argument."""
        return inputs[0] if inputs else None

    def prepare(self, module: nn.Module, a: Tensor) -> Tensor:
        """The captured input reshaped to (B, T, ...) for the methods below."""
        return a.reshape(a.shape[0], -1, a.shape[-1]) if a.dim() != 3 else a

    @abc.abstractmethod
    def per_example(self, module: nn.Module, a: Tensor, g: Tensor) -> dict[str, Tensor]:
        """Per-example gradients {name: (B, *param.shape)}."""

    def per_example_into(
        self, module: nn.Module, a: Tensor, g: Tensor, out: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """:meth:`per_example`, each gradient written into ``out[name]`` ((B, *shape), at
        any stride between examples: a slot of the streamed modules' buffer) where the
        rule can form it there; the caller copies the others. It saves a copy per
        streamed parameter and step (a kernel launch each on CUDA, where a step of small
        kernels waits for their launches). Default: none written there."""
        return self.per_example(module, a, g)

    def saved_operand(self, module: nn.Module, node) -> Tensor | None:
        """A tensor that ``node``, the autograd node of the module's output, saved for
        its backward, from which :meth:`per_example_from_saved` forms the per-example
        gradients with less work than :meth:`per_example_into` from the record; None
        (the default): the record is used. Read while the backward runs, just before the
        node itself reads it (``streaming.Streaming``), so the tensor is the one the
        node computes the parameter's gradient from, activation checkpointing included."""
        return None

    def per_example_from_saved(
        self, module: nn.Module, saved: Tensor, g: Tensor, out: dict[str, Tensor]
    ) -> dict[str, Tensor]:
        """:meth:`per_example_into` from :meth:`saved_operand`'s tensor in example rows
        (b, T, ...) instead of the record."""
        raise NotImplementedError(f"{type(self).__name__} saves no operand")

    def norms_sq(self, module: nn.Module, a: Tensor, g: Tensor, ghost: bool) -> dict[str, Tensor]:
        """{name: (B,) squared per-example gradient norms}. Default: instantiate."""
        return {k: v.flatten(1).pow(2).sum(1) for k, v in self.per_example(module, a, g).items()}

    @abc.abstractmethod
    def clipped_sum(
        self, module: nn.Module, a: Tensor, g: Tensor, factors: Tensor
    ) -> dict[str, Tensor]:
        """{name: sum_i factors[i] * grad_i}, without per-example gradients where possible."""

    def rounding_bound(self, module: nn.Module, a: Tensor, g: Tensor) -> dict[str, Tensor]:
        """{name: (B,) b_i} for the parameters whose :meth:`clipped_sum` rounds the scaled
        record within ``tensor_cores.one_gemm_sums()``: example i's contribution then lies
        within c_i b_i of c_i grad_i. Default: none (sums that do not round)."""
        return {}

    def accumulation_bound(
        self, module: nn.Module, a: Tensor, g: Tensor, weights: Tensor
    ) -> dict[str, Tensor]:
        """{name: elementwise bound on |autograd's gradient - the exact sum_i weights_i
        grad_i|} for the parameters whose autograd kernel may add many terms in the
        parameter's own low precision: what the self-check's comparison with autograd must
        allow beyond one rounding. Default: none (kernels that round once, such as a GEMM
        with float32 accumulation)."""
        return {}

    def ghost_is_cheaper(self, module: nn.Module, a: Tensor, g: Tensor) -> bool:
        """For ``norm_choice == "either"``: whether the ghost norm is the cheaper way."""
        return self.norm_choice == "ghost"


def weighted_sum(per_example: dict[str, Tensor], factors: Tensor) -> dict[str, Tensor]:
    """{name: sum_i factors[i] * grad_i} from per-example gradients {name: (B, *shape)}."""
    # A matrix-vector product: einsum dispatches about 12 aten ops per tensor for the same
    # sum (permutes, views, a bmm), and the engine forms one per parameter every step.
    # A low-precision one (kept in bf16, streaming.Slots) is summed in float32: its
    # factors cast to bf16 would round up as often as down, and the sum would round too.
    return {
        k: torch.mv(
            upcast(v.reshape(v.shape[0], math.prod(v.shape[1:]))).T,
            factors.to(torch.float32 if v.dtype in LOW_PRECISION else v.dtype),
        ).view(v.shape[1:])
        for k, v in per_example.items()
    }


def _flatten_tokens(t: Tensor) -> Tensor:
    """(B, ..., d) -> (B, T, d)."""
    # (a reshape to its own shape still dispatches a view: skipped, as for every record)
    return t if t.dim() == 3 else t.reshape(t.shape[0], -1, t.shape[-1])


# From this many tokens on, the symmetric Gram matrices are formed in 2 x 2 blocks,
# of which only 3 are needed: 3/4 of the multiply-adds, for 5 more kernel launches per
# layer (a second product per operand, a second product-and-sum and the add).
_HALF_GRAM_MIN_TOKENS = 64

#: Device types on which the Gram matrices are formed in halves (above). Not on CUDA:
#: there a private step of a 135M Llama at B 16, T 512 was bound by its kernel launches,
#: not by its arithmetic (docs/engine_benchmark.md, "The GPU session"), and the quarter
#: of the Gram products the halves save is about 5% of that step's FLOPs where they add
#: about 425 of its ~4,900 launches (an estimate until a GPU times both).
#: ``benchmarks/launch_count.py`` empties it to count launches as CUDA runs them.
HALF_GRAM_DEVICES: set[str] = {"cpu"}

#: Device types on which ``norm_method="auto"`` instantiates a linear layer wherever its
#: per-example gradient is no larger than its record (:meth:`LinearRule.ghost_is_cheaper`).
#: Elsewhere Li et al.'s memory rule alone decides (ghost when 2 T^2 < d_in d_out): on a
#: CPU the per-example products of a narrow layer run slower than the Gram matrices and
#: the one clipped-sum GEMM they replace, and the slots need a copy (SLOT_DEVICES) and a
#: norm pass. Instantiating DPFormer's fused qkv (64 -> 192 at T 50) took the quick
#: bench's step from 1.20x to 1.25-1.26x the non-private one, with half the FLOPs of the
#: ghost path. ``benchmarks/cpu_proxies.py``, ``launch_count.py`` and ``step_peaks.py``
#: add "cpu" to count as CUDA runs.
SIZE_RULE_DEVICES: set[str] = {"cuda"}


def _gram_inner(x: Tensor, y: Tensor) -> Tensor:
    """sum_{t,s} <x_t, x_s> <y_t, y_s> per example: the ghost norm, (B,).

    Both Gram matrices are symmetric, so with x = [x1; x2] (split along tokens)
    the sum is <X11, Y11> + <X22, Y22> + 2 <X12, Y12>. The blocks of x (a layer's
    input) are taken from :func:`gram_cache` where one is active: the q, k and v
    projections share one input, as do a gated MLP's gate and up projections.
    """
    if x.shape[1] == 1:  # ||x||^2 ||y||^2, no T x T matrices
        return upcast(x).pow(2).sum((1, 2)) * upcast(y).pow(2).sum((1, 2))
    # x's blocks and y's must be the same blocks: both halves in one product only where
    # both allow it
    joint = _halves_view(x) and _halves_view(y)
    total = None
    b = x.shape[0]
    blocks = zip(_gram_blocks_cached(x, joint), _gram_blocks(y, joint), strict=True)
    for (weight, gx), (_, gy) in blocks:
        prod = gx * gy
        # the joint diagonal blocks are (2B, T/2, T/2), each example's two in a row
        part = prod.sum((1, 2)) if prod.shape[0] == b else prod.view(b, -1).sum(1)
        if total is None:
            total = part if weight == 1 else part * weight
        else:
            total = total.add(part, alpha=weight)
    return total


def _halves_view(x: Tensor) -> bool:
    """Whether x (B, T, d) is (2B, T/2, d) as a view (T even, examples' rows evenly spaced)."""
    return x.shape[1] % 2 == 0 and x.stride(0) == x.shape[1] * x.stride(1)


def _gram_blocks(x: Tensor, joint: bool) -> list[tuple[int, Tensor]]:
    """[(weight, Gram blocks of each example, (B k, m, n), example-major)]: x x^T whole
    below _HALF_GRAM_MIN_TOKENS tokens and off HALF_GRAM_DEVICES, else the blocks 11 and
    22 (weight 1) and 12 (weight 2) of its 2 x 2 split along tokens, 11 and 22 from one
    product where ``joint`` (:func:`_halves_view`; then k = 2, the pair as that product
    gives it: a view per pair of Grams in :func:`_gram_inner`, not one per Gram); float32
    (or float64) for a low-precision x (tensor_cores.py)."""
    b, t = x.shape[:2]
    if t < _HALF_GRAM_MIN_TOKENS or x.device.type not in HALF_GRAM_DEVICES:
        return [(1, bmm_f32(x, x.transpose(1, 2)))]
    h = t // 2
    x1, x2 = x[:, :h], x[:, h:]
    off = (2, bmm_f32(x1, x2.transpose(1, 2)))
    if joint:
        # Both diagonal blocks in one batched product, each example's two in a row:
        # (2B, T/2, T/2).
        halves = x.view(2 * b, h, x.shape[2])
        return [(1, bmm_f32(halves, halves.transpose(1, 2))), off]
    return [
        (1, bmm_f32(x1, x1.transpose(1, 2))),
        (1, bmm_f32(x2, x2.transpose(1, 2))),
        off,
    ]


# The active cache of input Gram blocks, or None (see gram_cache).
_GRAM_CACHE: dict | None = None


@contextlib.contextmanager
def gram_cache():
    """Within this block, the Gram blocks of a tensor passed as ``x`` to the ghost norm are
    computed once. The key is the tensor's memory and layout (data pointer, shape,
    strides, dtype, device, version); the entry holds the tensor itself, so its memory
    cannot be freed and reused by another tensor while the cache lives."""
    global _GRAM_CACHE
    outer = _GRAM_CACHE
    _GRAM_CACHE = {} if outer is None else outer
    try:
        yield
    finally:
        _GRAM_CACHE = outer


def _gram_blocks_cached(x: Tensor, joint: bool) -> list[tuple[int, Tensor]]:
    if _GRAM_CACHE is None:
        return _gram_blocks(x, joint)
    key = (x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device, x._version, joint)
    hit = _GRAM_CACHE.get(key)
    if hit is None:
        hit = _GRAM_CACHE[key] = (x, _gram_blocks(x, joint))
    return hit[1]


#: Public name of the ghost-norm Gram inner product (used by phantom clipping).
gram_inner = _gram_inner


class LinearRule(LayerRule):
    """``nn.Linear``: y = a W^T + b, W (d_out, d_in); grad_W,i = g_i^T a_i.

    Reads bf16/fp16 records as they are: products with float32 accumulation and output,
    on tensor cores on CUDA, and clipped sums scaled without rounding (tensor_cores.py).
    """

    #: True for HF GPT-2's Conv1D, whose weight is stored transposed (d_in, d_out).
    transposed = False
    norm_choice = "either"
    low_precision_records = True
    keeps_record_precision = True

    def ghost_is_cheaper(self, module: nn.Module, a: Tensor, g: Tensor) -> bool:
        """Ghost norm where an example's gradient is larger than its record: p d > T (p + d).

        Book-keeping keeps, until the clip factors are known, either a layer's record
        (a, g) (ghost norm) or its per-example gradients (instantiation: formed as g
        arrives, the record let go, :mod:`dptrain.clipping.streaming`). Per example,
        instantiation holds p d entries (and d for a bias) against the record's T (p + d),
        and costs 2 T p d FLOPs for the gradients (the product the clipped sum would take
        anyway) and 4 p d for their norm and weighted sum, against the ghost norm's Gram
        matrices, 2 T^2 (p + d), on top of the clipped sum's 2 T p d (twice that for an
        exact bf16 sum, :mod:`dptrain.clipping.tensor_cores`). So where p d <= T (p + d)
        instantiation is the cheaper in memory and in time. Elsewhere the record is the
        smaller, and there p d > T (p + d) >= 2 T sqrt(p d) gives p d > 4 T^2: the Gram
        matrices' 2 T^2 per example are smaller than p d as well, so Li et al. 2022's
        memory rule (§4, ghost when 2 T^2 < p d; fastDP's) agrees. That rule alone
        ghost-normed a 135M Llama's MLP at T 512 (p d = 885k > 2 T^2 = 524k, but
        < T (p + d) = 1.08M): 1.6x the non-private step's GEMM FLOPs instead of 1.3x
        (``benchmarks/cpu_proxies.py``, docs/engine_benchmark.md). Off
        :data:`SIZE_RULE_DEVICES` (the module's weight's device), the memory rule alone.
        """
        tokens = a[0].numel() // max(1, a.shape[-1])
        if module.weight.device.type not in SIZE_RULE_DEVICES:
            return 2 * tokens * tokens < a.shape[-1] * g.shape[-1]
        per_example = a.shape[-1] * g.shape[-1] if is_trainable(module.weight) else 0
        if is_trainable(getattr(module, "bias", None)):
            per_example += g.shape[-1]
        return per_example > tokens * (a.shape[-1] + g.shape[-1])

    def per_example(self, module, a, g):
        return self.per_example_into(module, a, g, {})

    def per_example_into(self, module, a, g, out):
        a, g = _flatten_tokens(a), _flatten_tokens(g)
        got = {}
        dtype = product_dtype(a, g)
        if is_trainable(module.weight):
            # (B, p, d), or (B, d, p) stored transposed; bmm: ~4x einsum's speed on CPU
            x, y = (a.transpose(1, 2), g) if self.transposed else (g.transpose(1, 2), a)
            shape = (x.shape[0], x.shape[1], y.shape[2])
            if _fits(out.get("weight"), shape, torch.bfloat16) is not None and (
                x.dtype == y.dtype == torch.bfloat16
            ):  # a bf16 slot (streaming.Slots): as autograd forms a bf16 weight's gradient
                got["weight"] = torch.bmm(x, y, out=out["weight"])
            else:
                got["weight"] = bmm_f32(x, y, out=_fits(out.get("weight"), shape, dtype))
        if is_trainable(getattr(module, "bias", None)):
            # summed in float32 for a low-precision g (the bias's gradient reads g alone),
            # rounded once where its slot is bf16
            g_dtype = torch.float32 if g.dtype in LOW_PRECISION else g.dtype
            into = out.get("bias")
            if into is not None and into.dtype == torch.bfloat16 == g.dtype:
                g_dtype = torch.bfloat16
            into = _fits(into, (g.shape[0], g.shape[2]), g_dtype)
            got["bias"] = torch.sum(g, 1, dtype=g_dtype, out=into)
        return got

    def norms_sq(self, module, a, g, ghost):
        if not ghost:
            return super().norms_sq(module, a, g, ghost)
        a, g = _flatten_tokens(a), _flatten_tokens(g)
        out = {}
        if is_trainable(module.weight):
            out["weight"] = _gram_inner(a, g)
        if is_trainable(getattr(module, "bias", None)):
            out["bias"] = upcast(g).sum(1).pow(2).sum(1)
        return out

    def rounding_bound(self, module, a, g):
        # the bias's sum is float32 (no rounding); the weight's rounds a bf16 record's
        # scaled operand in one_gemm_sums (tensor_cores.scaled_cross)
        if not (is_trainable(module.weight) and a.dtype == g.dtype == torch.bfloat16):
            return {}
        return {"weight": rounding_bound(_flatten_tokens(a), _flatten_tokens(g))}

    def clipped_sum(self, module, a, g, factors):
        a, g = _flatten_tokens(a), _flatten_tokens(g)
        out = {}
        if is_trainable(module.weight):
            # sum_i c_i g_i^T a_i = g^T (c * a) = (c * g)^T a: scale the operand already
            # scaled for another layer (q, k and v read one input: split once within
            # tensor_cores.split_cache), else the narrower one (for an LM head a is
            # (B, T, d) and g (B, T, vocab)).
            if has_split(a, factors):
                scale_a = True
            elif has_split(g, factors):
                scale_a = False
            else:
                scale_a = a.shape[-1] <= g.shape[-1]
            if a.dtype in LOW_PRECISION and a.dtype == g.dtype:
                w = scaled_cross(g, a, factors, scale_x=not scale_a)  # (p, d), tensor_cores.py
            elif scale_a:
                w = mm_f32(g.flatten(0, 1).T, _scale_rows(upcast(a), factors).flatten(0, 1))
            else:
                w = mm_f32(_scale_rows(upcast(g), factors).flatten(0, 1).T, a.flatten(0, 1))
            out["weight"] = w.T if self.transposed else w
        if is_trainable(getattr(module, "bias", None)):
            g_sum = upcast(g).sum(1)
            out["bias"] = torch.einsum("b,bp->p", factors.to(g_sum.dtype), g_sum)
        return out


class Conv1DRule(LinearRule):
    """HF GPT-2 ``Conv1D``: y = a W + b with W stored (d_in, d_out)."""

    transposed = True


class EmbeddingRule(LayerRule):
    """``nn.Embedding`` with token ids x: grad_E,i = X_i^T g_i (X_i one-hot of x_i).

    ||grad_i||^2 = sum_{t,s: x_t = x_s} <g_t, g_s> (DESIGN.md). Tokens equal to
    ``padding_idx`` get no gradient in PyTorch, so they are masked out.
    """

    param_names = ("weight",)
    norm_choice = "ghost"  # a per-example gradient would be vocab x d

    def check(self, module):
        if module.scale_grad_by_freq:
            return "scale_grad_by_freq=True scales gradients by counts over the whole batch"
        if module.sparse:
            return "sparse=True gradients are not supported"
        return None

    def prepare(self, module, a):
        return a.reshape(a.shape[0], -1)  # ids (B, T)

    def masked(self, module, x: Tensor, g: Tensor) -> Tensor:
        """``g`` as (B, T, d) with the rows of ``padding_idx`` tokens zeroed (no gradient)."""
        g = g.reshape(x.shape[0], x.shape[1], -1)
        if module.padding_idx is not None:
            g = g * (x != module.padding_idx).unsqueeze(-1).to(g.dtype)
        return g

    def per_example(self, module, a, g):
        if not is_trainable(module.weight):
            return {}
        x, g = a, self.masked(module, a, g)
        b, _, d = g.shape
        out = torch.zeros(b, module.num_embeddings, d, dtype=g.dtype, device=g.device)
        out.scatter_add_(1, x.unsqueeze(-1).expand(-1, -1, d), g)
        return {"weight": out}

    def norms_sq(self, module, a, g, ghost):
        if not is_trainable(module.weight):
            return {}
        return {"weight": embedding_ghost_norm(a, self.masked(module, a, g))}

    def clipped_sum(self, module, a, g, factors):
        if not is_trainable(module.weight):
            return {}
        x, g = a, self.masked(module, a, g)
        scaled = _scale_rows(g, factors).flatten(0, 1)
        out = torch.zeros(module.num_embeddings, g.shape[-1], dtype=g.dtype, device=g.device)
        out.index_add_(0, x.flatten(), scaled)
        return {"weight": out}

    def accumulation_bound(self, module, a, g, weights):
        # A bf16/fp16 table's gradient is a scatter-add of its rows' gradients, which a
        # kernel may accumulate in that precision (PyTorch's CPU kernel does: 6.6% off on
        # 64 rows of 65,536 random tokens). Row r, k_r terms of total size A_r = sum |w g_t|:
        # any order of additions that each round with unit roundoff u is within
        # ((1 + u)^(k_r - 1) - 1) A_r of the exact sum (Higham, Accuracy and Stability of
        # Numerical Algorithms, 2nd ed., eq. 4.4). A bound, not a tolerance tuned to the
        # data: the verdict on this parameter no longer depends on how many tokens share a
        # row, or on which kernel autograd ran.
        weight = module.weight
        if not is_trainable(weight) or weight.dtype not in LOW_PRECISION:
            return {}
        x, g = a, self.masked(module, a, g)
        w = weights.to(torch.float32)
        live = (w != 0).view(-1, 1).expand_as(x)
        if module.padding_idx is not None:
            live = live & (x != module.padding_idx)
        rows = x[live]
        terms = (g.to(torch.float32).abs() * w.abs().view(-1, 1, 1))[live]
        size = torch.zeros(module.num_embeddings, g.shape[-1], device=g.device)
        size.index_add_(0, rows, terms)
        count = torch.zeros(module.num_embeddings, device=g.device, dtype=torch.float64)
        count.index_add_(0, rows, torch.ones_like(rows, dtype=torch.float64))
        u = torch.finfo(weight.dtype).eps / 2
        growth = torch.expm1((count - 1).clamp_min(0) * math.log1p(u)).clamp_max(1e30)
        return {"weight": growth.to(torch.float32).unsqueeze(1) * size}


class LookupEmbeddingRule(EmbeddingRule):
    """An ``nn.Embedding`` subclass whose forward computes its own ids or scales the rows.

    Hugging Face's learned positional embeddings (OPT, BART) take the attention
    mask or the token ids and look up positions + an offset; the scaled word
    embeddings (Gemma, BART) multiply the looked-up rows by a constant. The
    engine therefore reads the ids the lookup really used, and the gradient
    with respect to the looked-up rows, from the ``embedding`` node of the
    module's autograd graph, not from the module's argument and output; the
    rule's algebra is then the plain embedding's.
    """

    lookup_from_graph = True


class NormLayerRule(LayerRule):
    """``nn.LayerNorm`` / ``nn.RMSNorm``: grad_w,i = sum_t g_t * xhat_t, grad_b,i = sum_t g_t.

    xhat (the normalised input) is recomputed from the captured input. The
    per-example gradients are d-vectors, so they are always instantiated.
    """

    def check(self, module):
        if not hasattr(module, "normalized_shape") or not hasattr(module, "eps"):
            return (
                "NormLayerRule reads normalized_shape and eps as nn.LayerNorm / nn.RMSNorm "
                f"define them, and {type(module).__name__} has no such attributes (for an "
                "RMSNorm variant y = (offset + weight) * x / rms(x), use RMSNormRule)"
            )
        return None

    def prepare(self, module, a):
        d = 1
        for s in module.normalized_shape:
            d *= s
        return a.reshape(a.shape[0], -1, d)

    def _xhat(self, module: nn.Module, a: Tensor) -> Tensor:
        shape = (a.shape[-1],)
        if isinstance(module, nn.LayerNorm):
            return F.layer_norm(a, shape, None, None, module.eps)
        return F.rms_norm(a, shape, None, module.eps)

    def per_example(self, module, a, g):
        g = g.reshape(a.shape)
        out = {}
        if is_trainable(module.weight):
            out["weight"] = (g * self._xhat(module, a)).sum(1).reshape(-1, *module.weight.shape)
        if is_trainable(getattr(module, "bias", None)):
            out["bias"] = g.sum(1).reshape(-1, *module.bias.shape)
        return out

    def clipped_sum(self, module, a, g, factors):
        return weighted_sum(self.per_example(module, a, g), factors)


class RMSNormRule(LayerRule):
    """RMSNorm variants y = (offset + w) * n(x), n(x) = x / sqrt(mean(x^2) + eps).

    Llama, Qwen, Mistral, Phi-3 and T5 use offset 0; Gemma uses offset 1 (its weight
    starts at zero). grad_w,i = sum_t g_t * n(x_t), a d-vector: instantiated.

    Every registered family computes n(x) with the same float32 operations, in the same
    order: x32 = x.float(); x32 * rsqrt(x32.pow(2).mean(-1) + eps), eps in the attribute
    ``eps_attr`` (``variance_epsilon``; Gemma's ``eps``). T5 alone multiplies x in its
    own dtype rather than x32 (``scales_input``: a float64 model's n(x) is float64 there).
    The rule repeats those operations, so its n(x) is the module's own up to the cast
    back to the input's dtype (Llama's before the scale, Gemma's after), which it leaves
    out: per-example gradients are float32. (It used to call the module's forward with
    a neutral weight: the same n(x), and on a bf16 record two kernel launches more per
    norm layer and step, an upcast of g and the neutral weight's product. A module
    whose n(x) differed would show in the self-check's comparison with autograd.)
    """

    param_names = ("weight",)

    def __init__(
        self, offset: float = 0.0, eps_attr: str = "variance_epsilon", scales_input: bool = False
    ):
        if offset not in (0.0, 1.0):
            raise ValueError(f"offset={offset!r} is not allowed: expected 0 or 1")
        if not (isinstance(eps_attr, str) and eps_attr.isidentifier()):
            raise ValueError(f"eps_attr={eps_attr!r} is not allowed: expected an attribute name")
        self.offset = float(offset)
        self.eps_attr = eps_attr
        self.scales_input = bool(scales_input)
        # Gemma multiplies by (1 + w) in float32, so autograd's own gradient is float32-accurate.
        self.float32_inside = self.offset == 1.0

    # x.float() is the module's own first step, and g * n(x) promotes a bf16 g
    upcasts_itself = True

    def check(self, module):
        w = getattr(module, "weight", None)
        if not isinstance(w, Tensor) or w.dim() != 1:
            return "RMSNormRule needs a 1-D weight (one gain per feature)"
        if any(True for _ in module.parameters(recurse=False) if _ is not w):
            return "RMSNormRule handles a module whose only parameter is its weight"
        # The formula is the family's forward as its class defines it: one replaced on
        # the class or the instance (a patch that fuses or changes it) is another
        # computation, which this rule does not know.
        owner = next(c for c in type(module).__mro__ if "forward" in c.__dict__)
        fwd = module.__dict__.get("forward", owner.__dict__["forward"])
        if (
            getattr(fwd, "__qualname__", None) != f"{owner.__qualname__}.forward"
            or getattr(fwd, "__module__", None) != owner.__module__
        ):
            where = f"{getattr(fwd, '__module__', '?')}.{getattr(fwd, '__qualname__', fwd)}"
            return (
                f"RMSNormRule repeats the normalisation of {owner.__qualname__}'s own forward, "
                f"but its forward was replaced by {where}: register a rule for that forward"
            )
        eps = getattr(module, self.eps_attr, None)
        if isinstance(eps, bool) or not isinstance(eps, (int, float)):
            return (
                f"RMSNormRule reads eps from the attribute {self.eps_attr!r}, which is "
                f"{eps!r} here: expected a number"
            )
        return None

    def prepare(self, module, a):
        d = module.weight.shape[0]
        return a if a.dim() == 3 and a.shape[-1] == d else a.reshape(a.shape[0], -1, d)

    def normalised(self, module: nn.Module, a: Tensor) -> Tensor:
        """n(a) as the module computes it, before any cast back: float32 (T5: a's dtype
        if wider)."""
        with torch.no_grad():
            x32 = a.float()
            r = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + getattr(module, self.eps_attr))
            return (a if self.scales_input else x32) * r

    def per_example(self, module, a, g):
        return self.per_example_into(module, a, g, {})

    def per_example_into(self, module, a, g, out):
        if not is_trainable(module.weight):
            return {}
        g = g if g.shape == a.shape else g.reshape(a.shape)
        return self._summed(g * self.normalised(module, a), out)  # a bf16 g promotes

    def saved_operand(self, module, node):
        """n(x) as the module's last product, ``weight * n(x)``, saved it for the weight's
        gradient (every family with offset 0: ``return self.weight * hidden_states``):
        where ``node`` is that product's (``MulBackward0``) and its first input is the
        weight itself, its saved second operand is the n(x) autograd multiplies the
        output gradient by, and the rule need not repeat the normalisation (six kernel
        launches per norm layer and step on a bf16 record, five under autocast). Any other
        graph (Gemma's (1 + w), a cast weight, a patched forward): None, the record."""
        if self.offset or type(node).__name__ != "MulBackward0":
            return None
        # the first input's node: the weight's accumulator (None, or another node, if not)
        if getattr(node.next_functions[0][0], "variable", None) is not module.weight:
            return None
        return node._saved_other

    def per_example_from_saved(self, module, saved, g, out):
        if not is_trainable(module.weight):
            return {}
        g = g if g.shape == saved.shape else g.reshape(saved.shape)
        # the product exact in float32, as from the record: a bf16 n(x) is upcast (the
        # mul's type promotion then upcasts a bf16 g inside the kernel)
        return self._summed(g * (saved.float() if saved.dtype in LOW_PRECISION else saved), out)

    @staticmethod
    def _summed(prod: Tensor, out: dict[str, Tensor]) -> dict[str, Tensor]:
        """sum_t g_t * n(x_t) per example from the product (B, T, d), into its slot if it fits."""
        into = _fits(out.get("weight"), (prod.shape[0], prod.shape[2]), prod.dtype)
        if into is not None:
            return {"weight": torch.sum(prod, 1, out=into)}
        return {"weight": prod.sum(1)}

    def clipped_sum(self, module, a, g, factors):
        return weighted_sum(self.per_example(module, a, g), factors)


def embedding_ghost_norm(x: Tensor, g: Tensor) -> Tensor:
    """sum_{t,s: x_t = x_s} <g_t, g_s> per example: ||X^T g||^2 without the V x d matrix, (B,)."""
    same = (x.unsqueeze(2) == x.unsqueeze(1)).to(g.dtype)  # (B, T, T)
    return (torch.bmm(g, g.transpose(1, 2)) * same).sum((1, 2))


def _scale_rows(x: Tensor, factors: Tensor) -> Tensor:
    """x[i] * factors[i] for x (B, ...); as a 2-D product, about twice as fast on CPU
    as broadcasting factors over (B, 1, 1)."""
    return (x.reshape(x.shape[0], -1) * factors.to(x.dtype)[:, None]).view(x.shape)


def _fits(into: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype | None) -> Tensor | None:
    """``into`` where a result of ``shape`` and ``dtype`` can be written there (an ``out=``
    of another shape would be resized out of the caller's buffer), else None."""
    if into is None or into.dtype != dtype or tuple(into.shape) != shape:
        return None
    return into


def _is_parameter(p: object) -> bool:
    # the exact type first: isinstance(p, nn.Parameter) runs nn.Parameter's metaclass
    # __instancecheck__, Python called several times per module and step
    return type(p) is nn.Parameter or (p is not None and isinstance(p, nn.Parameter))


def is_trainable(p: Tensor | None) -> bool:
    """Whether ``p`` is a parameter that needs a gradient (one the engine clips)."""
    return _is_parameter(p) and p.requires_grad


def param_of(module: nn.Module, name: str) -> nn.Parameter | None:
    """The parameter ``name`` of ``module`` (a dotted path for a submodule's), or None."""
    # Registered directly (the usual case: several calls per module and step): the
    # dict lookup get_parameter ends in, without its path walk.
    p = module._parameters.get(name)
    if _is_parameter(p):
        return p
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None


#: The registry: module type -> rule (exact types; see :func:`find_rule`).
RULES: dict[type[nn.Module], LayerRule] = {
    nn.Linear: LinearRule(),
    nn.Embedding: EmbeddingRule(),
    nn.LayerNorm: NormLayerRule(),
    nn.RMSNorm: NormLayerRule(),
}

try:  # HF GPT-2 blocks use Conv1D; transformers is optional.
    from transformers.pytorch_utils import Conv1D as _HFConv1D

    RULES[_HFConv1D] = Conv1DRule()
except ImportError:  # pragma: no cover - depends on the environment
    pass


#: Rules for types of optional packages, keyed by "module.qualname" of the exact type, so
#: that dptrain need not import every Hugging Face model family to register them.
class RouterRule(LinearRule):
    """A mixture-of-experts router: ``logits = x W^T`` on the flattened (B * T, d)
    tokens, returned first in a tuple (logits, top-k weights, expert indices); the
    top-k weights derive from the logits, so the logits' gradient is the whole of it."""

    def output_of(self, module, output):
        return output[0] if isinstance(output, tuple) and isinstance(output[0], Tensor) else None


RULES_BY_NAME: dict[str, LayerRule] = {
    **{
        f"transformers.models.{fam}.modeling_{fam}.{cls}RMSNorm": RMSNormRule()
        for fam, cls in [
            ("llama", "Llama"),
            ("qwen2", "Qwen2"),
            ("qwen3", "Qwen3"),
            ("mistral", "Mistral"),
            ("mixtral", "Mixtral"),
            ("phi3", "Phi3"),
        ]
    },
    **{
        f"transformers.models.{fam}.modeling_{fam}.{cls}RMSNorm": RMSNormRule(
            offset=1.0, eps_attr="eps"
        )
        for fam, cls in [("gemma", "Gemma"), ("gemma2", "Gemma2"), ("gemma3", "Gemma3")]
    },
    "transformers.models.t5.modeling_t5.T5LayerNorm": RMSNormRule(scales_input=True),
    "transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter": RouterRule(),
    **{
        f"transformers.models.{path}": LookupEmbeddingRule()
        for path in [
            "opt.modeling_opt.OPTLearnedPositionalEmbedding",
            "bart.modeling_bart.BartLearnedPositionalEmbedding",
            "bart.modeling_bart.BartScaledWordEmbedding",
            "gemma.modeling_gemma.GemmaTextScaledWordEmbedding",
            "gemma2.modeling_gemma2.Gemma2TextScaledWordEmbedding",
            "gemma3.modeling_gemma3.Gemma3TextScaledWordEmbedding",
        ]
    },
}


def _type_name(module_type: type) -> str:
    return f"{module_type.__module__}.{module_type.__qualname__}"


def register_rule(module_type: type[nn.Module], rule: LayerRule) -> None:
    """Register (or replace) the rule for ``module_type``."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type={module_type!r} is not an nn.Module subclass")
    if not isinstance(rule, LayerRule):
        raise TypeError(f"rule={rule!r} is not a LayerRule")
    RULES[module_type] = rule


def _unwrap_fsdp2_type(module_type: type) -> type:
    """``<Type>`` for the class ``FSDP<Type>`` that ``fully_shard`` swaps in (bases
    (FSDPModule, <Type>), no forward of its own: FSDP2 works through hooks); else the
    type itself."""
    bases = module_type.__bases__
    if len(bases) != 2 or "forward" in module_type.__dict__:
        return module_type
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 or without distributed
        return module_type
    return bases[1] if bases[0] is FSDPModule else module_type


def find_rule(module: nn.Module) -> LayerRule | None:
    """The rule registered for exactly ``module``'s type, or None.

    Subclasses do not inherit their parent's rule: a subclass may change
    ``forward`` (LoRA, quantised layers), and a wrong rule would clip wrongly
    without any sign. Register such types explicitly. A module with
    ``torch.nn.utils.parametrize`` parametrizations (a new type per module) gets the
    replaying :class:`~dptrain.clipping.replay.ParametrizedRule`. A module that FSDP2's
    ``fully_shard`` made a unit of its own (accelerate does so with the embedding, the
    final norm and the head) has the type ``FSDP<Type>``, which adds FSDP's methods and
    no ``forward``: it gets the rule of ``<Type>``.
    """
    kind = _unwrap_fsdp2_type(type(module))
    rule = RULES.get(kind)
    if rule is None:
        rule = RULES_BY_NAME.get(_type_name(kind))
    if rule is None:  # torch.nn.utils.parametrize makes a new type per parametrized module
        from dptrain.clipping.replay import parametrized_rule  # (replay.py imports this module)

        rule = parametrized_rule(module)
    return rule
