"""FSDP2 under dptrain: per-rank memory and step time at 1, 2 and 4 gloo processes (CPU).

    PYTHONPATH=src:. python benchmarks/bench_fsdp.py [--ranks 1 2 4] [--steps 4] [--kinds ...]
        [--bucket-mb 25 0] [--reduction 10]

A tied Llama from a config (hidden 512, 4 layers, vocab 8192: 16.8M parameters,
float32), sharded per decoder layer and at the root on a 1-D CPU mesh, trained
with AdamW: non-private FSDP2 (``loss.backward()``, FSDP's reduce-scatter) and
dptrain's book-keeping clipping on the same mesh, in separate processes.

Per rank it reports the bytes of parameters, gradients and optimizer state the
rank holds (exact: the local shards' sizes; goal about 1/W of one process's),
the rise of the process's peak resident memory over the steps (records and
activations included: ``ru_maxrss``, so an upper bound of what the step held),
and the median step time after one warm-up step (the first private step runs
the engine's checks). Logical batch 16 (non-private: exactly 16; private:
Poisson with q N = 16), 8 records per chunk per rank, T 128.

``--bucket-mb``: the sharded private run once per value of ``bucket_cap_mb``, the
bucket of clipped sums reduced by one collective; 0 reduces every parameter alone
(one ``DTensor`` redistribution per parameter, the reduction before buckets), so
one command compares the two on the same machine. ``--reduction R``: the reduction
alone, timed apart from the rest of the step (whose noise on a shared machine hides
it): every rank reduces random full-shape sums of every parameter (one chunk's) into
its shards through ``ShardedGradStore``, per parameter and in buckets, alternately,
R times each in the same processes; the medians.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist

HIDDEN, LAYERS, VOCAB, SEQ, N, BATCH, CHUNK = 512, 4, 8192, 128, 256, 16, 8


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=4 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def _shard(model):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _state_bytes(opt) -> int:
    return _local_bytes(
        v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    )


def _data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (N, SEQ + 1), generator=g)
    return torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])


def measure(kind: str, steps: int, bucket_mb: float = 25.0) -> dict:
    """One run: ``fsdp`` (non-private FSDP2), ``dptrain-fsdp`` or ``dptrain-ddp`` (the
    same private training on the unsharded model, each rank a full replica);
    ``bucket_mb``: dptrain's ``bucket_cap_mb`` (0: every parameter alone)."""
    private = kind != "fsdp"
    from dptrain.distributed import make_private_distributed
    from dptrain.losses import per_example_cross_entropy

    model = _shard(_model()) if kind != "dptrain-ddp" else _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = _data()
    rank, world = dist.get_rank(), dist.get_world_size()
    times = []
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if private:
        run = make_private_distributed(
            model,
            opt,
            data,
            batch_size=BATCH,
            max_grad_norm=1.0,
            steps=steps + 1,
            noise_multiplier=1.0,
            max_physical_batch_size=CHUNK,
            seed=0,
            # a bucket smaller than any parameter: each reduced alone
            bucket_cap_mb=bucket_mb or 1e-6,
        )
        grads = 0
        for batch in run.data_loader:
            dist.barrier()
            t = time.perf_counter()
            run.optimizer.zero_grad()
            for x, y in batch.chunks:
                run.backward(per_example_cross_entropy(model(input_ids=x).logits, y))
            grads = _local_bytes(p.grad for p in model.parameters())
            run.optimizer.step()
            dist.barrier()
            times.append(time.perf_counter() - t)
        dp_opt = run.optimizer.original_optimizer
    else:
        g = torch.Generator().manual_seed(2)
        grads = 0
        for _ in range(steps + 1):
            idx = torch.randperm(N, generator=g)[:BATCH][rank::world]
            dist.barrier()
            t = time.perf_counter()
            opt.zero_grad()
            for part in idx.split(CHUNK):
                x, y = data[part]
                loss = per_example_cross_entropy(model(input_ids=x).logits, y).sum() / BATCH
                loss.backward()
            grads = _local_bytes(p.grad for p in model.parameters())
            opt.step()
            dist.barrier()
            times.append(time.perf_counter() - t)
        dp_opt = opt
    return {
        "params": _local_bytes(model.parameters()),
        "grads": grads,
        "optimizer": _state_bytes(dp_opt),
        "rss_rise": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) * 1024,
        "rss_peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "step_s": statistics.median(times[1:]),
        "first_step_s": times[0],
    }


def measure_reduction(repeats: int, buckets: list[float]) -> dict:
    """Median seconds of one chunk's reduction of every parameter's sum, per bucket size
    (0: every parameter alone), alternating the sizes in the same processes."""
    from dptrain.distributed.sharded_sums import ShardedGradStore

    model = _shard(_model())
    params = list(model.parameters())
    g = torch.Generator().manual_seed(dist.get_rank())
    sums = [torch.randn(p.shape, generator=g) for p in params]
    times: dict[float, list[float]] = {mb: [] for mb in buckets}
    for _ in range(repeats + 1):
        for mb in buckets:
            store = ShardedGradStore(int((mb or 1e-6) * 2**20))
            for p in params:
                p.grad = None
            dist.barrier()
            t = time.perf_counter()
            for p, s in zip(params, sums, strict=True):
                store.add(p, s)
            store.flush()
            dist.barrier()
            times[mb].append(time.perf_counter() - t)
    return {mb: statistics.median(v[1:]) for mb, v in times.items()}  # after a warm-up


def main() -> None:
    from dptrain.distributed import spawn

    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument(
        "--kinds",
        nargs="+",
        default=["fsdp", "dptrain-fsdp", "dptrain-ddp"],
        choices=["fsdp", "dptrain-fsdp", "dptrain-ddp"],
    )
    ap.add_argument("--bucket-mb", type=float, nargs="+", default=[25.0])
    ap.add_argument("--reduction", type=int, default=0, metavar="R")
    args = ap.parse_args()
    if args.reduction:
        buckets = sorted(set(args.bucket_mb) | {0.0}, reverse=True)
        print("| ranks | " + " | ".join(_bucket_label(mb) for mb in buckets) + " |")
        print("|---|" + "---|" * len(buckets))
        for w in args.ranks:
            if w < 2:
                continue  # one rank: nothing to reduce across
            out = spawn(
                measure_reduction, w, (args.reduction, buckets), timeout=600, join_timeout=3600
            )
            med = {mb: statistics.median(o[mb] for o in out) for mb in buckets}
            print(f"| {w} | " + " | ".join(f"{med[mb]:.3f} s" for mb in buckets) + " |")
        return
    mb = 2**20
    rows = []
    for w in args.ranks:
        for kind in args.kinds:
            buckets = args.bucket_mb if kind == "dptrain-fsdp" else [25.0]
            for mb_cap in buckets:
                out = spawn(measure, w, (kind, args.steps, mb_cap), timeout=600, join_timeout=3600)
                r = max(out, key=lambda o: o["params"])  # the rank holding most
                label = kind
                if len(buckets) > 1:
                    label += f" (bucket {mb_cap:g} MiB)" if mb_cap else " (per parameter)"
                rows.append((w, label, r, statistics.median(o["step_s"] for o in out)))
    print(
        "| ranks | run | params / rank | grads / rank | Adam state / rank | peak RSS rise / rank "
        "| peak RSS / rank | step (s) | first step (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for w, kind, r, step in rows:
        print(
            f"| {w} | {kind} | {r['params'] / mb:.1f} MiB "
            f"| {r['grads'] / mb:.1f} MiB | {r['optimizer'] / mb:.1f} MiB "
            f"| {r['rss_rise'] / mb:.0f} MiB | {r['rss_peak'] / mb:.0f} MiB | {step:.2f} "
            f"| {r['first_step_s']:.2f} |"
        )
    base = {w: step for w, kind, _, step in rows if kind == "fsdp"}
    for w, kind, _, step in rows:
        if kind != "fsdp" and w in base:
            print(f"ranks {w}: {kind} step / non-private FSDP2 step = {step / base[w]:.2f}x")


def _bucket_label(mb: float) -> str:
    return f"reduction, buckets of {mb:g} MiB" if mb else "reduction, per parameter"


if __name__ == "__main__":
    main()
