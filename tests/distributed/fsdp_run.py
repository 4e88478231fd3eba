"""The FSDP2 runs that tests/distributed/test_fsdp.py compares: W gloo processes, one spawn each.

Every scenario builds the same tied Llama from a config (random init, seed 0) and
the same token data on every rank, shards it per decoder layer and at the root
(``fully_shard``, a 1-D CPU mesh), makes it private with
:func:`~dptrain.distributed.make_private_distributed` and reports, from every
rank, full (gathered) tensors that the tests compare with one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dptrain.distributed import make_private_distributed, sharded_optimizer
from dptrain.losses import per_example_cross_entropy
from dptrain.privacy_engine import make_private

VOCAB, SEQ, N_RECORDS = 48, 8, 40
C, SEED = 0.05, 11


def llama(lora: bool = False, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A 2-layer tied Llama (hidden 16) from a config; LoRA r4 on q/v if ``lora``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).to(dtype)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    return model


#: user ids with users larger than a chunk of 3: user 0 has 7 records, 1 has 4, 2 has 5,
#: the rest 2 each (at q = 1, rank 0 of 2 gets users 0, 2, ... and rank 1 users 1, 3, ...)
BIG_USERS = [0] * 7 + [1] * 4 + [2] * 5 + [3 + i // 2 for i in range(N_RECORDS - 16)]


def data(outlier: int | list[int] | None = None, scale: float = 1.0):
    """N_RECORDS token sequences and a loss weight per record (1; ``scale`` for the
    ``outlier`` record or records)."""
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (N_RECORDS, SEQ + 1), generator=g)
    weight = torch.ones(N_RECORDS)
    if outlier is not None:
        weight[outlier] = scale
    return torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:], weight)


def shard(model: nn.Module, device: str = "cpu") -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return per_example_cross_entropy(model(input_ids=x).logits, y)


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().double().clone()


def private_run(
    sharded: bool,
    mode: str = "book_keeping",
    clipping: str = "flat",
    lora: bool = False,
    sigma: float = 1e-12,
    chunk: int = 3,
    batch: int = 9,
    steps: int = 1,
    dtype: torch.dtype = torch.float32,
    outlier: int | None = None,
    scale: float = 1.0,
    entry: str = "make_private_distributed",
    autocast: bool = False,
    device: str = "cpu",
    users: bool | str = False,
    secure: bool = False,
    noise_block: int | None = None,
) -> dict:
    """``steps`` private steps (SGD, lr 1); the clipped sums of the first step (before
    noise), the initial and final parameters, full, by name, and the records each step
    put through this rank (dataset indices, padding left out).

    ``users``: True: users of 2 records; "big": :data:`BIG_USERS`. ``secure``:
    secure_mode (no seed). ``noise_block``: coordinates per noise key for this run
    (sharded_optimizer.NOISE_BLOCK), small so that shards start and end inside blocks."""
    if noise_block is not None:
        settings = {**locals(), "noise_block": None}
        saved, sharded_optimizer.NOISE_BLOCK = sharded_optimizer.NOISE_BLOCK, noise_block
        try:
            return private_run(**settings)
        finally:
            sharded_optimizer.NOISE_BLOCK = saved
    model = llama(lora, dtype).to(device)
    if sharded:
        model = shard(model, device)
    initial = {n: full(p) for n, p in model.named_parameters() if p.requires_grad}
    # how many rows of each parameter this rank holds (and noises)
    owned = {
        n: (p.to_local() if hasattr(p, "to_local") else p).shape[0]
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    make = make_private if entry == "make_private" else make_private_distributed
    dataset = data(outlier, scale)
    user_ids = None
    if users:
        user_ids = BIG_USERS if users == "big" else [i // 2 for i in range(N_RECORDS)]
    extra = dict(secure_mode=True) if secure else {}
    private = make(
        model,
        opt,
        dataset,
        user_ids=user_ids,
        batch_size=batch,
        max_grad_norm=C,
        steps=steps,
        noise_multiplier=sigma,
        mode=mode,
        clipping=clipping,
        max_physical_batch_size=chunk,
        seed=None if secure else SEED,
        **extra,
    )
    engine = private.engine
    index = {tuple(x.tolist()): i for i, x in enumerate(dataset.tensors[0])}
    sums: dict[str, torch.Tensor] = {}
    sizes, padding, records = [], [], []
    for t, batch_ in enumerate(private.data_loader):
        private.optimizer.zero_grad()
        sizes.append(batch_.global_size)
        pads = getattr(batch_, "padding", None)
        padding.append(pads)
        records.append(
            [
                index[tuple(row.tolist())]
                for j, (x, _, _) in enumerate(batch_.chunks)
                for row in x[: len(x) - (pads[j] if pads else 0)]
            ]
        )
        for x, y, w in batch_.chunks:
            x, y, w = x.to(device), y.to(device), w.to(device)
            with torch.autocast(device, torch.bfloat16, enabled=autocast):
                losses = loss_of(model, x, y)
            private.backward(losses.float() * w.to(losses.dtype))
        if t == 0:
            sums = {
                n: full(engine.parameter(n).grad)
                for n in engine.parameter_names
                if engine.parameter(n).grad is not None
            }
        private.optimizer.step()
    params = {n: full(p) for n, p in model.named_parameters() if p.requires_grad}
    return {
        "sums": sums,
        "initial": initial,
        "params": params,
        "sizes": sizes,
        "padding": padding,
        "records": records,
        "owned": owned,
        "secure": bool(private.optimizer.secure_mode and private.data_loader.loader.sampler.secure),
        "divisor": private.optimizer.expected_batch_size,
        "ledger": private.ledger.state_dict(),
        "optimizer": type(private.optimizer).__name__,
    }


def refusal(kind: str) -> str:
    """The error a badly sharded model or argument gets (its message), or ''."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = llama()
    if kind == "offload":
        fully_shard(model, mesh=mesh, offload_policy=CPUOffloadPolicy(pin_memory=False))
    elif kind == "mixed_precision":
        fully_shard(model, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    elif kind == "unsharded_root":  # the layers sharded, the root (embeddings, head) not
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
    elif kind == "outside_use":
        return _outside_use(mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    # an unsharded (replicated) model's noise is rank 0's seeded draw: no secure_mode
    secure = kind == "secure_unsharded"
    try:
        make_private_distributed(
            model,
            opt,
            data(),
            batch_size=9,
            max_grad_norm=C,
            steps=1,
            noise_multiplier=1.0,
            seed=None if secure else SEED,
            max_physical_batch_size=3,
            secure_mode=secure,
        )
    except Exception as exc:  # the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return ""


class _HeadOutside(nn.Module):
    """An embedding and a head whose weight is also used outside the head's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(input_ids)
        # an extra use of head.weight outside head's call: its gradient escapes clipping
        return self.head(h) + torch.nn.functional.linear(h, self.head.weight)


def _outside_use(mesh) -> str:
    """Under FSDP2 too, a parameter used outside its module's recorded call is refused
    (the graph walk must look for the unsharded parameter autograd holds)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _HeadOutside()
    fully_shard(model, mesh=mesh)
    private = make_private_distributed(
        model,
        torch.optim.SGD(model.parameters(), lr=1.0),
        data(),
        batch_size=9,
        max_grad_norm=C,
        steps=1,
        noise_multiplier=1.0,
        seed=SEED,
        max_physical_batch_size=3,
    )
    try:
        for batch in private.data_loader:
            for x, y, _ in batch.chunks:
                private.backward(per_example_cross_entropy(model(x), y))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return ""


#: parameter shapes whose rows W ranks cut unevenly (2 ranks: 5 rows -> 3, 2; 1 -> 1, 0)
STORE_SHAPES = [(5, 3), (4,), (1, 2), (7, 4), (2, 3, 2), (40, 10)]  # the last: 1,600 B


def store_sums(bucket_bytes: int, sharded: bool = True) -> dict:
    """ShardedGradStore alone: random full-shape sums of :data:`STORE_SHAPES` (Shard(0)
    DTensors) added over two chunks, buckets of ``bucket_bytes``; rank 1 reaches the
    third parameter in no record of the first chunk (None). The reduced sums (full), each
    rank's local shard shapes and what this rank added."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from dptrain.distributed.sharded_sums import ShardedGradStore

    assert sharded
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    params = [
        nn.Parameter(distribute_tensor(torch.zeros(s), mesh, [Shard(0)])) for s in STORE_SHAPES
    ]
    store = ShardedGradStore(bucket_bytes)
    g = torch.Generator().manual_seed(100 + rank)
    added: list[list[torch.Tensor | None]] = []
    for chunk in range(2):
        sums = [
            None if (rank == 1 and k == 2 and chunk == 0) else torch.randn(p.shape, generator=g)
            for k, p in enumerate(params)
        ]
        for p, mine in zip(params, sums, strict=True):
            store.add(p, mine)
        store.flush()
        added.append(sums)
    return {
        "grads": [full(p.grad) for p in params],
        "local": [tuple(p.grad.to_local().shape) for p in params],
        "added": added,
    }


def scenarios(cases: list[dict], refusals: tuple[str, ...] = ()) -> tuple[list[dict], dict]:
    """Run each case (private_run's keywords; store_sums' where it has bucket_bytes) and
    each refusal in this process group."""
    runs = [store_sums(**c) if "bucket_bytes" in c else private_run(**c) for c in cases]
    return runs, {k: refusal(k) for k in refusals}
