"""User-level DP through DPTrainer (group_by column -> make_private's user_ids), and
datasets.Dataset input in make_private itself."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("datasets")

import datasets
from transformers import default_data_collator

from dptrain import make_private
from dptrain.hf import DPTrainer, PrivacyArguments
from dptrain.losses import per_example_cross_entropy
from tests.hf import tiny

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

SEED = 11


def _user_records() -> list[dict]:
    """Records of 12 users with 1 to 6 records each (some users span several chunks)."""
    counts = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 4]
    users = [f"user{u}" for u, c in enumerate(counts) for _ in range(c)]
    order = torch.randperm(len(users), generator=torch.Generator().manual_seed(0)).tolist()
    users = [users[i] for i in order]
    records = tiny.lm_records(len(users))
    return [dict(r, user_id=u) for r, u in zip(records, users, strict=True)]


def _as_dataset(records: list[dict]):
    return datasets.Dataset.from_list(
        [{k: (v.tolist() if torch.is_tensor(v) else v) for k, v in r.items()} for r in records]
    )


def _lm_losses(model, inputs):
    labels = inputs.pop("labels")
    logits = model(**inputs).logits
    return per_example_cross_entropy(
        logits[:, :-1], labels[:, 1:], attention_mask=inputs["attention_mask"][:, 1:]
    )


def test_group_by_equals_make_private_with_user_ids(tmp_path):
    """Users are the sampled unit (q = B / 12 users) and each user's records are clipped as
    one sum: DPTrainer(group_by=...) takes make_private(user_ids=...)'s steps exactly."""
    tiny.quiet_transformers()
    records = _user_records()
    trainer = DPTrainer(
        model=tiny.llama(),
        args=tiny.training_args(str(tmp_path), per_device_train_batch_size=2, max_steps=3),
        train_dataset=_as_dataset(records),
        privacy_args=PrivacyArguments(
            noise_multiplier=1.0, target_delta=1e-5, group_by="user_id", seed=SEED
        ),
    )
    assert trainer.privacy_plan.num_units == 12 and trainer.privacy_plan.privacy_unit == "user"
    trainer.train()
    ledger = trainer.privacy.ledger
    assert ledger.privacy_unit == "user" and ledger.num_steps == 3
    assert ledger.segments[0].sample_rate == pytest.approx(4 / 12)

    model = tiny.llama()
    private = make_private(
        model,
        torch.optim.SGD(
            [{"params": g["params"], "weight_decay": 0.0} for g in _trainer_groups(trainer, model)],
            lr=0.05,
        ),
        [{k: v for k, v in r.items() if k != "user_id"} for r in records],
        batch_size=4,
        max_grad_norm=1.0,
        steps=3,
        noise_multiplier=1.0,
        max_physical_batch_size=2,
        collate_fn=default_data_collator,
        seed=SEED,
        user_ids=[r["user_id"] for r in records],
    )
    for batch in private.data_loader:
        private.optimizer.zero_grad()
        for chunk in batch.chunks:
            private.backward(_lm_losses(model, chunk))
        private.optimizer.step()
    assert private.ledger == ledger
    for (name, p), (_, q) in zip(
        trainer.model.named_parameters(), model.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0, msg=name)


def _trainer_groups(trainer: DPTrainer, model) -> list[dict]:
    decay = set(trainer.get_decay_parameter_names(model))
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n in decay]},
        {"params": [p for n, p in named if n not in decay]},
    ]


def test_make_private_reads_a_python_formatted_datasets_dataset():
    """A datasets.Dataset holds python lists; make_private reads its rows as tensors, so the
    default collate stacks (B, T) batches and the steps equal those on tensor records."""
    records = [
        {"x": torch.randn(6, generator=torch.Generator().manual_seed(i)), "y": i % 3}
        for i in range(30)
    ]
    ds = datasets.Dataset.from_list([{"x": r["x"].tolist(), "y": r["y"]} for r in records])

    def run(data):
        torch.manual_seed(0)
        model = torch.nn.Linear(6, 3)
        private = make_private(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            data,
            batch_size=6,
            max_grad_norm=1.0,
            steps=3,
            noise_multiplier=1.0,
            max_physical_batch_size=4,
            seed=2,
        )
        for batch in private.data_loader:
            private.optimizer.zero_grad()
            for chunk in batch.chunks:
                assert chunk["x"].shape[1:] == (6,)
                private.backward(per_example_cross_entropy(model(chunk["x"].float()), chunk["y"]))
            private.optimizer.step()
        return model.weight.detach()

    torch.testing.assert_close(run(ds), run(records))
    assert ds.format["type"] is None  # the caller's dataset is left as it was
