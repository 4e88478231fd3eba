"""How the engine sees a model sharded with PyTorch's FSDP2 (``fully_shard``).

FSDP2 keeps each parameter as a sharded ``DTensor`` (the one the optimizer
holds, registered on its module between forward/backward passes) and, while a
module runs, swaps in an unsharded ``nn.Parameter`` gathered from all ranks
(the one autograd's graph holds). The clipping engine needs both:

- the graph's parameter, to walk the graph for uses outside recorded calls and
  for its checks' masked backward passes (:meth:`FSDPSharding.graph_parameter`);
- the sharded one, whose ``.grad`` receives this rank's shard of the clipped sum
  reduced over all ranks (:class:`~dptrain.distributed.sharded_sums.ShardedGradStore`).

FSDP's own gradient reduction is switched off (``set_requires_gradient_sync(False)``):
it would reduce-scatter whatever autograd accumulates in the unsharded
parameters, i.e. unclipped gradients (the checks' masked backward passes).

Reading the unsharded parameter goes through FSDP2's internal state
(``FSDPParam``): PyTorch has no public accessor. It is confined to
:func:`_fsdp_params`, which refuses the model by name if the internals moved.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from dptrain.clipping import UnsupportedModelError

__all__ = ["FSDPSharding", "is_fsdp2", "refuse_fsdp1", "wrapping", "wrapping_now"]

# True while make_private_distributed builds a sharded model's private training with
# make_private (which otherwise hands a sharded model to make_private_distributed).
_WRAPPING: contextvars.ContextVar[bool] = contextvars.ContextVar("dptrain_fsdp", default=False)


@contextlib.contextmanager
def wrapping() -> Iterator[None]:
    """Mark that make_private is called by make_private_distributed (see :func:`wrapping_now`)."""
    token = _WRAPPING.set(True)
    try:
        yield
    finally:
        _WRAPPING.reset(token)


def wrapping_now() -> bool:
    """Whether :func:`wrapping` is active."""
    return _WRAPPING.get()


def _fsdp_module_type() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2 (< 2.4) or without distributed
        return None
    return FSDPModule


def is_fsdp2(model: nn.Module) -> bool:
    """Whether ``model`` or one of its submodules was sharded with ``fully_shard``."""
    kind = _fsdp_module_type()
    return kind is not None and any(isinstance(m, kind) for m in model.modules())


def refuse_fsdp1(model: nn.Module) -> None:
    """Refuse a model wrapped in FSDP1 (``FullyShardedDataParallel``), pointing to FSDP2."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return
    for name, m in model.named_modules():
        if isinstance(m, FullyShardedDataParallel):
            raise UnsupportedModelError(
                f"module {name or '<root>'} is wrapped in FullyShardedDataParallel (FSDP1), "
                "which flattens parameters so that no module holds its own weight: dptrain "
                "cannot clip it. Shard with FSDP2 instead: "
                "torch.distributed.fsdp.fully_shard(layer) for each decoder layer, then "
                "fully_shard(model), and pass the model to make_private_distributed"
            )


def _fsdp_params(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(module name, FSDPParam) for every parameter FSDP2 manages in ``model``."""
    kind = _fsdp_module_type()
    for name, module in model.named_modules():
        if kind is None or not isinstance(module, kind):
            continue
        try:
            state = module._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:  # torch < 2.12: at most one group per module
                one = state._fsdp_param_group
                groups = [] if one is None else [one]
            params = [fp for group in groups for fp in group.fsdp_params]
        except AttributeError as exc:
            raise UnsupportedModelError(
                f"module {name or '<root>'}: this torch's FSDP2 ({torch.__version__}) keeps its "
                f"parameters where dptrain does not find them ({exc}); dptrain's FSDP support "
                "is tested with torch 2.11-2.13"
            ) from exc
        for fp in params:
            yield name, fp


class FSDPSharding:
    """The engine's view of an FSDP2-sharded model (see the module docstring).

    Built once before the first step: refuses what the engine cannot clip under
    sharding (CPU offload, a FSDP mixed-precision policy, a rule that reads a
    module's weight during the backward), switches FSDP's gradient reduction off,
    and from then on maps each sharded parameter to the unsharded one its
    module's forward used.
    """

    def __init__(self, model: nn.Module, rules: dict[str, Any]):
        self.model = model
        self._by_sharded: dict[int, Any] = {}
        for name, fp in _fsdp_params(model):
            if getattr(fp, "offload_to_cpu", False):
                raise UnsupportedModelError(
                    f"module {name or '<root>'} is sharded with CPUOffloadPolicy: dptrain does "
                    "not support FSDP2's CPU offload (the clipped sums are reduced on the "
                    "parameters' device); shard without offload_policy"
                )
            param_dtype = getattr(getattr(fp, "mp_policy", None), "param_dtype", None)
            if param_dtype is not None and param_dtype != fp.sharded_param.dtype:
                raise UnsupportedModelError(
                    f"module {name or '<root>'} is sharded with MixedPrecisionPolicy("
                    f"param_dtype={param_dtype}): not supported by dptrain; keep the "
                    "parameters in one dtype (bfloat16 weights, or float32 weights under "
                    "torch.autocast, are supported)"
                )
            self._by_sharded[id(fp.sharded_param)] = fp
        meshes = [fp.sharded_param.device_mesh for fp in self._by_sharded.values()]
        if any(m != meshes[0] or m.ndim != 1 for m in meshes):
            raise UnsupportedModelError(
                "the model is sharded over several device meshes or a mesh of more than one "
                "dimension (HSDP): dptrain supports FSDP2 on one 1-D mesh (fully_shard(..., "
                "mesh=init_device_mesh(device, (world_size,))))"
            )
        for use_name, rule in rules.items():
            if getattr(rule, "replays", False):
                raise UnsupportedModelError(
                    f"module {use_name}: its rule ({type(rule).__name__}) re-runs the module "
                    "with its weights during the backward, when FSDP has already resharded "
                    "them (each rank holds a shard): not supported under FSDP; give the "
                    "module a rule of its own or freeze it"
                )
        for m in model.modules():
            if hasattr(m, "set_requires_gradient_sync") and hasattr(m, "_get_fsdp_state"):
                m.set_requires_gradient_sync(False, recurse=False)

    def refuse_unsharded(self, params: dict[str, Tensor]) -> None:
        """Refuse clipped parameters FSDP2 does not manage (a module left out of
        ``fully_shard``): each rank would hold and step its own copy."""
        plain = [name for name, p in params.items() if not self.manages(p)]
        if plain:
            raise UnsupportedModelError(
                f"parameters not sharded by FSDP2: {', '.join(plain[:5])}"
                f"{f' and {len(plain) - 5} more' if len(plain) > 5 else ''}. Call "
                "fully_shard on the root module too (after the decoder layers), so that "
                "every trainable parameter is sharded"
            )

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of the shards' mesh (one tiny all-reduce)."""
        if not self._by_sharded:
            return flag
        fp = next(iter(self._by_sharded.values()))
        mesh = fp.sharded_param.device_mesh
        t = torch.tensor([1.0 if flag else 0.0], device=fp.sharded_param.to_local().device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())
        return bool(t.item())

    def manages(self, p: Tensor) -> bool:
        """Whether ``p`` is a sharded parameter of this model."""
        return id(p) in self._by_sharded

    def graph_parameter(self, p: Tensor) -> Tensor:
        """The tensor autograd's graph holds for parameter ``p``: FSDP's unsharded
        parameter once its module has run (the same object at every step), else ``p``."""
        fp = self._by_sharded.get(id(p))
        if fp is None:
            return p
        return getattr(fp, "_unsharded_param", p)
