"""The same private classifier written for Opacus and for dptrain, side by side.

    python examples/opacus_migration.py              # both (Opacus only if installed)
    python examples/opacus_migration.py --secure     # both with secure_mode=True

A small MLP on synthetic 2-class data (6,000 records), DP-SGD with Poisson sampling,
expected batch 200, 3 epochs, target (epsilon, delta) = (3, 1e-5), C = 1. Each half
prints its epsilon and test accuracy. docs/migrating_from_opacus.md quotes a run.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

N, D, BATCH, EPOCHS, EPS, DELTA, C = 6000, 20, 200, 3, 3.0, 1e-5, 1.0


def data() -> tuple[torch.utils.data.TensorDataset, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(D, generator=g)
    x = torch.randn(N + 2000, D, generator=g)
    y = (x @ w + 0.5 * torch.randn(N + 2000, generator=g) > 0).long()
    return torch.utils.data.TensorDataset(x[:N], y[:N]), x[N:], y[N:]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 64), nn.ReLU(), nn.Linear(64, 2))


def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((net(x).argmax(1) == y).float().mean())


def with_opacus(secure: bool) -> None:
    from opacus import PrivacyEngine
    from opacus.utils.batch_memory_manager import BatchMemoryManager

    train, x_test, y_test = data()
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(train, batch_size=BATCH)
    engine = PrivacyEngine(accountant="prv", secure_mode=secure)
    net, optimizer, loader = engine.make_private_with_epsilon(
        module=net,
        optimizer=optimizer,
        data_loader=loader,
        target_epsilon=EPS,
        target_delta=DELTA,
        epochs=EPOCHS,
        max_grad_norm=C,
    )
    criterion = nn.CrossEntropyLoss()
    for _ in range(EPOCHS):
        with BatchMemoryManager(
            data_loader=loader, max_physical_batch_size=64, optimizer=optimizer
        ) as chunks:
            for x, y in chunks:
                optimizer.zero_grad()
                criterion(net(x), y).backward()
                optimizer.step()
    print(
        f"opacus : epsilon {engine.get_epsilon(DELTA):.3f}, sigma {optimizer.noise_multiplier:.4f}, "
        f"test accuracy {accuracy(net, x_test, y_test):.3f}"
    )


def with_dptrain(secure: bool) -> None:
    from dptrain import make_private, per_example_cross_entropy

    train, x_test, y_test = data()
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(train, batch_size=BATCH)
    private = make_private(
        net,
        optimizer,
        loader,  # its batch_size is the expected batch size B
        target_epsilon=EPS,
        target_delta=DELTA,
        epochs=EPOCHS,
        max_grad_norm=C,
        accountant="pld",
        max_physical_batch_size=64,
        secure_mode=secure,
    )
    for batch in private.data_loader:  # one Poisson-sampled logical batch per step
        private.optimizer.zero_grad()
        for x, y in batch.chunks:  # physical chunks of at most 64 records
            private.backward(per_example_cross_entropy(net(x), y))
        private.optimizer.step()
    print(
        f"dptrain: epsilon {private.epsilon():.3f}, sigma {private.noise_multiplier:.4f}, "
        f"test accuracy {accuracy(net, x_test, y_test):.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--secure", action="store_true", help="secure_mode=True in both")
    args = parser.parse_args()
    for run in (with_opacus, with_dptrain):
        t = time.perf_counter()
        try:
            run(args.secure)
        except ImportError as err:
            print(f"{run.__name__}: skipped ({err})")
            continue
        print(f"         {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main()
