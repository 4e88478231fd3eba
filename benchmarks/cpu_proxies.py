"""CPU proxies of the GPU cost of a private step under bf16 autocast (issue 27's table).

A tied Llama (hidden 256, 4 layers, vocab 8192; B 8, T 256 by default), full fine-tuning
and LoRA r16 on the seven projections, under ``torch.autocast('cpu', bfloat16)``. For
the non-private step and dptrain's book-keeping step (forward, per-example loss,
backward; no optimizer), with clipped sums of bf16 records exact (two bf16 GEMMs on
CUDA, the default) and with ``sum_rounding="bounded"`` (one), it reports, each against the non-private step:

- the share of matrix-product FLOPs (mm, addmm, bmm, baddbmm, linear) whose operands
  are float32: on a GPU those run on CUDA cores, not tensor cores. Two figures: as run
  here, and as the same step runs on CUDA, where the engine's products of bf16 records
  are bf16 GEMMs with float32 output (``torch.mm(..., out_dtype=torch.float32)``, which
  CPU builds lack: here the same products run in float32 on upcast operands;
  :mod:`dptrain.clipping.tensor_cores` counts them, and the second GEMM a clipped sum
  takes on CUDA is added to the GEMM FLOPs);
- aten operations dispatched per step here, and as on CUDA (without the upcasts the
  CPU needs, with the ops of split clipped sums); ghost norms form whole Gram matrices
  in these counts, as on CUDA (``rules.HALF_GRAM_DEVICES``), not the CPU's 2 x 2 blocks,
  and streamed per-example gradients are formed in their slots (``streaming.SLOT_DEVICES``);
  every figure, the peaks included, has the linear layers ghost-normed or instantiated as
  CUDA chooses (``rules.SIZE_RULE_DEVICES``);
- matrix-product FLOPs per step;
- peak resident memory of a fresh process running 2 steps (the first, with the
  engine's full check, included), and the increment of a third, steady step alone.

The counts are of a steady step (the third; the engine's checks run on the first) and,
separately, of the first step. A hand-written dispatch counter, because
``torch.utils.flop_counter`` does not split FLOPs by dtype.

    python benchmarks/cpu_proxies.py            # the table (about 2 minutes on 2 cores)
    python benchmarks/cpu_proxies.py --b 4 --t 128
    python benchmarks/cpu_proxies.py --by-kind 12   # and which op kinds the engine adds
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import subprocess
import sys
from collections import Counter

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

_GEMMS = {"mm", "addmm", "bmm", "baddbmm", "linear"}


class _Count(TorchDispatchMode):
    """aten ops per step, and matrix-product FLOPs by operand dtype."""

    def __init__(self):
        super().__init__()
        self.ops = 0
        self.flops: Counter = Counter()
        self.kinds: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops += 1
        name = func.overloadpacket.__name__
        self.kinds[name] += 1
        out = func(*args, **kwargs)
        if name in _GEMMS:
            a = args[1] if name in ("addmm", "baddbmm") else args[0]
            k = a.shape[-1]
            self.flops[a.dtype] += 2 * k * math.prod(out.shape)
        return out


def _model(lora: bool):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if lora:
        import peft

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model = peft.get_peft_model(
            model, peft.LoraConfig(r=16, lora_alpha=16, target_modules=targets)
        )
    return model.train()


def _losses(model, ids: torch.Tensor) -> torch.Tensor:
    """Per-example next-token losses (B,), the forward under bf16 autocast."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(input_ids=ids).logits
    return F.cross_entropy(
        logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none"
    ).mean(1)


def _cuda_layer_choice() -> None:
    """Ghost norm or instantiation per linear layer as CUDA decides it (``rules.SIZE_RULE_DEVICES``):
    the layers a step instantiates set its products, launches and what it holds."""
    from dptrain.clipping import rules

    rules.SIZE_RULE_DEVICES.add("cpu")


def stepper(method: str, lora: bool, b: int, t: int):
    """One step (forward, per-example losses, backward) of ``method`` on the proxy model, as a closure."""
    from dptrain.clipping import ClippingEngine

    _cuda_layer_choice()
    model = _model(lora)
    ids = torch.randint(0, 8192, (b, t), generator=torch.Generator().manual_seed(0))
    # dptrain-bk-bounded: clipped sums of bf16 records as one GEMM (sum_rounding="bounded")
    rounding = "bounded" if method == "dptrain-bk-bounded" else "exact"
    engine = (
        ClippingEngine(model, 1.0, sum_rounding=rounding) if method.startswith("dptrain") else None
    )

    def step():
        model.zero_grad(set_to_none=True)
        losses = _losses(model, ids)
        if engine is None:
            losses.sum().backward()
        else:
            engine.backward(losses)

    return step


def _counts(method: str, lora: bool, b: int, t: int) -> dict:
    from dptrain.clipping import rules, streaming
    from dptrain.clipping.tensor_cores import flops_emulated, ops_emulated

    # Ghost norms form whole Gram matrices, as on CUDA (the CPU's 2 x 2 blocks save a
    # quarter of their FLOPs for five more ops per layer): both columns count CUDA's choice.
    rules.HALF_GRAM_DEVICES.discard("cpu")
    streaming.SLOT_DEVICES.add("cpu")  # per-example gradients formed in their slots, as on CUDA

    step = stepper(method, lora, b, t)
    out = {}
    for label in ("first", "warm", "steady"):
        counter = _Count()
        flops_emulated(reset=True, on=True)
        try:
            with counter:
                step()
            ops_delta = ops_emulated()
            emulated, extra = flops_emulated(reset=True, on=False)
        finally:
            flops_emulated(reset=True, on=False)
        if label != "warm":
            total = sum(counter.flops.values())
            f32 = counter.flops[torch.float32]
            # as on CUDA: the emulated products (one float32 GEMM here for each split
            # clipped sum, two bf16 ones there) are bf16
            on_cuda = total + extra
            out[label] = {
                "ops": counter.ops,
                "ops_cuda": counter.ops + ops_delta,
                "gemm_flops": on_cuda,
                "float32_share": f32 / total if total else 0.0,
                "float32_share_cuda": (f32 + extra - emulated) / on_cuda if on_cuda else 0.0,
                "kinds": dict(counter.kinds),
            }
    return out


def _margin(lora: bool, b: int, t: int) -> tuple[float, float]:
    """(mean, max) of 1 - c_bounded / c_exact over examples all clipped (C = 1e-6): how
    much smaller sum_rounding="bounded" makes a clipped example's factor (R_i / ||g_i||
    against ||g_i||: docs/engine.md, "Precision")."""
    from dptrain.clipping import ClippingEngine

    _cuda_layer_choice()
    model = _model(lora)
    ids = torch.randint(0, 8192, (b, t), generator=torch.Generator().manual_seed(0))
    factors = {}
    for rounding in ("exact", "bounded"):
        engine = ClippingEngine(model, 1e-6, sum_rounding=rounding)
        model.zero_grad(set_to_none=True)
        factors[rounding] = engine.backward(_losses(model, ids)).factors
        engine.detach()
    shrink = 1 - factors["bounded"] / factors["exact"]
    return float(shrink.mean()), float(shrink.max())


def _peak_child(method: str, lora: bool, b: int, t: int) -> None:
    from dptrain.clipping.heap import release_free_memory

    step = stepper(method, lora, b, t)
    base = _rss_kib()  # resident now (the peak so far may lie in the imports)
    step()
    step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # A steady step alone: freed pages returned, the high-water mark reset (Linux:
    # /proc/self/clear_refs), one more step. Its peak over the same base is what a long
    # run holds; the two-step peak above includes the first step's checks.
    release_free_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    step()
    steady = _rss_kib("VmHWM:")
    print(
        json.dumps(
            {
                "increment_mb": (peak - base) / 1024,
                "peak_mb": peak / 1024,
                "steady_increment_mb": (steady - base) / 1024,
            }
        )
    )


def _rss_kib(field: str = "VmRSS:") -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--b", type=int, default=8)
    parser.add_argument("--t", type=int, default=256)
    parser.add_argument(
        "--by-kind",
        type=int,
        default=0,
        metavar="N",
        help="also list the N aten op kinds the private steady step adds most (as run here)",
    )
    parser.add_argument("--peak", nargs=2, metavar=("METHOD", "LORA"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.peak:
        _peak_child(args.peak[0], args.peak[1] == "1", args.b, args.t)
        return
    torch.set_num_threads(2)
    kinds = []
    print(f"tied Llama (h 256, 4 layers, vocab 8192), B {args.b}, T {args.t}, bf16 autocast")
    print(
        "| workload | method | float32 share of GEMM FLOPs, here / on CUDA (steady) "
        "| aten ops x (steady here / steady on CUDA / first) | GEMM FLOPs x, as on CUDA "
        "(steady / first) | peak x (increment x) | steady step's increment x |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for lora in (False, True):
        rows = {}
        for method in ("nonprivate", "dptrain-bk", "dptrain-bk-bounded"):
            rows[method] = _counts(method, lora, args.b, args.t)
            child = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--b",
                    str(args.b),
                    "--t",
                    str(args.t),
                    "--peak",
                    method,
                    "1" if lora else "0",
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            rows[method]["mem"] = json.loads(child.stdout.strip().splitlines()[-1])
        base = rows["nonprivate"]
        for method, r in rows.items():
            share = f"{r['steady']['float32_share']:.1%} / {r['steady']['float32_share_cuda']:.1%}"
            ops = "{:.2f} / {:.2f} / {:.2f}".format(
                r["steady"]["ops"] / base["steady"]["ops"],
                r["steady"]["ops_cuda"] / base["steady"]["ops"],
                r["first"]["ops"] / base["steady"]["ops"],
            )
            flops = "{:.2f} / {:.2f}".format(
                r["steady"]["gemm_flops"] / base["steady"]["gemm_flops"],
                r["first"]["gemm_flops"] / base["steady"]["gemm_flops"],
            )
            mem = "{:.2f} ({:.2f})".format(
                r["mem"]["peak_mb"] / base["mem"]["peak_mb"],
                r["mem"]["increment_mb"] / base["mem"]["increment_mb"],
            )
            steady = r["mem"]["steady_increment_mb"] / base["mem"]["steady_increment_mb"]
            name = "LoRA r16" if lora else "full"
            print(f"| {name} | {method} | {share} | {ops} | {flops} | {mem} | {steady:.2f} |")
        if args.by_kind:
            mine, plain = rows["dptrain-bk"]["steady"]["kinds"], base["steady"]["kinds"]
            added = Counter({k: mine.get(k, 0) - plain.get(k, 0) for k in {*mine, *plain}})
            top = ", ".join(f"{k} +{n}" for k, n in added.most_common(args.by_kind))
            kinds.append(f"{'LoRA r16' if lora else 'full'}: {top}")
    for line in kinds:
        print(f"aten ops the private steady step adds (here), {line}")
    for lora in (False, True):
        mean, worst = _margin(lora, args.b, args.t)
        print(
            f"{'LoRA r16' if lora else 'full'}: sum_rounding='bounded' makes a clipped "
            f"example's factor smaller by {mean:.1%} on average (at most {worst:.1%})"
        )


if __name__ == "__main__":
    main()
