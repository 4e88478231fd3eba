"""The masked-LM recipe: schedules, the ledger against the schedule, the clipped gradient
against the batch-size-1 oracle, smoke runs on a tiny synthetic corpus, and bad input."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from dptrain.accounting import PLDAccountant, PrivacyLedger, RDPAccountant
from dptrain.cli import _TRAIN_RECIPES
from dptrain.config import load_config
from dptrain.data.mlm import load_mlm_data, mask_tokens
from dptrain.losses import per_example_cross_entropy
from dptrain.privacy_record import read as read_record
from dptrain.recipes import configs_dir
from dptrain.recipes.mlm import (
    MLMTrainConfig,
    batch_stages,
    build_mlm_model,
    lr_factor,
    parse_batch_schedule,
    schedule_function,
    train_mlm,
)
from tests.clipping.oracle_check import assert_engine_matches_oracle


def _corpus(path, n=60, seed=0):
    """Articles of a small repetitive language (so a tiny model learns something)."""
    rng = np.random.default_rng(seed)
    phrases = ["the cat sat on the mat", "a dog ran in the park", "we read the news today"]
    texts = [" . ".join(rng.choice(phrases, size=12)) + " ." for _ in range(n)]
    pd.DataFrame({"text": texts}).to_csv(path, index=False)
    return path


TINY = {
    "vocab_size": 64,
    "max_len": 16,
    "hidden_size": 16,
    "num_layers": 1,
    "num_heads": 2,
    "intermediate_size": 32,
    "steps": 6,
    "warmup_steps": 4,
    "batch_size": 32,
    "batch_growth": 2.0,
    "growth_stages": 2,
    "max_physical_batch_size": 8,
    "eval_every": 3,
    "epsilon_every": 2,
    "max_eval_examples": 40,
    "progress": False,
    "accountant": "rdp",  # calibrates in milliseconds; PLD is checked on the ledger below
}


def _cfg(tmp_path, **kw):
    values = {"data": str(_corpus(tmp_path / "corpus.csv")), "out": str(tmp_path / "run"), **TINY}
    values.update(kw)
    return MLMTrainConfig(**values)


# -- schedules ----------------------------------------------------------------------------------


def test_growing_batch_stages_follow_anil_linear_increments():
    # B = 512, growth 4: 128 -> 224 -> 320 -> 416 over four quarters of the warm-up, then 512
    assert batch_stages(512, 60, 20, 4.0, 4) == [(128, 5), (224, 5), (320, 5), (416, 5), (512, 40)]
    # uneven warm-up: the first stages are one step longer; all steps are accounted
    stages = batch_stages(100, 10, 7, 2.0, 3)
    assert stages == [(50, 3), (67, 2), (83, 2), (100, 3)]
    assert sum(s for _, s in stages) == 10
    assert batch_stages(64, 10, 5, 1.0, 4) == [(64, 10)]  # growth 1: fixed
    assert batch_stages(64, 10, 0, 4.0, 4) == [(64, 10)]  # no warm-up: fixed
    f = schedule_function([(128, 2), (512, 3)])
    assert [f(t) for t in range(5)] == [128, 128, 512, 512, 512]
    with pytest.raises(ValueError, match="step=5"):
        f(5)


def test_explicit_schedule_parsing():
    assert parse_batch_schedule("256x10, 1024X50") == [(256, 10), (1024, 50)]
    for bad in ("256", "256x0", "x10", "256x10;1024x5", ""):
        with pytest.raises(ValueError, match="batch_schedule="):
            parse_batch_schedule(bad)


def test_lr_schedule_values():
    # T = 10, W = 4: (t + 1) / W during warm-up, then (1 - (t - W) / (T - W))^2
    got = [lr_factor(t, 10, 4) for t in range(10)]
    want = [0.25, 0.5, 0.75, 1.0, 1.0, (5 / 6) ** 2, (4 / 6) ** 2, 0.25, (2 / 6) ** 2, (1 / 6) ** 2]
    assert got == pytest.approx(want)
    assert lr_factor(3, 4, 4) == 1.0  # all warm-up: no decay left
    assert lr_factor(0, 5, 0) == 1.0


# -- the clipped gradient against the oracle -----------------------------------------------------


@pytest.mark.parametrize("mode", ["book_keeping", "ghost"])
def test_engine_matches_oracle_for_the_recipe_model_and_loss(tmp_path, mode):
    """The recipe's model (tied decoder: phantom clipping) and loss, one example with no masked
    token (zero loss, zero gradient) and one padded example."""
    data = load_mlm_data(
        articles=[("the cat sat on the mat . " * 8)] * 12, vocab_size=64, max_len=12
    )
    cfg = MLMTrainConfig(**{**TINY, "vocab_size": 64, "max_len": 12})
    model = build_mlm_model(cfg, data).double().eval()
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    ids = data.train_ids[:4].clone()
    ids[1, 6:] = data.pad_token_id  # a padded example
    ids[1, 5] = data.sep_token_id
    inputs, labels = mask_tokens(
        ids,
        mask_token_id=data.mask_token_id,
        special_ids=data.special_ids,
        vocab_size=data.vocab_size,
        mask_prob=0.3,
        generator=torch.Generator().manual_seed(0),
    )
    labels[2] = -100  # no masked token at all
    inputs[2] = ids[2]
    assert (labels[[0, 1, 3]] != -100).any(1).all()
    attention = (ids != data.pad_token_id).long()

    def losses_of(sl):
        out = model(input_ids=inputs[sl], attention_mask=attention[sl])
        return per_example_cross_entropy(out.logits, labels[sl])

    assert float(losses_of(slice(2, 3)).detach()) == 0.0
    assert_engine_matches_oracle(model, losses_of, len(ids), mode=mode)


# -- smoke runs -----------------------------------------------------------------------------------


def test_private_run_ledger_equals_the_schedule(tmp_path):
    cfg = _cfg(tmp_path, epsilon=1.0)
    results = train_mlm(cfg)
    # the figures `dptrain train mlm` prints are in the results
    assert set(_TRAIN_RECIPES["mlm"][3]) <= set(results)
    assert "audit" not in results  # audit=false (the default)
    out = tmp_path / "run"
    for name in ("config.yaml", "data.json", "ledger.json", "metrics.jsonl", "results.json"):
        assert (out / name).is_file(), name
    for name in ("checkpoints/best.pt", "plots/accuracy.png", "plots/gradient_snr.png"):
        assert (out / name).is_file(), name
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    n = results["n_train_chunks"]
    stages = batch_stages(32, 6, 4, 2.0, 2)
    assert stages == [(16, 2), (24, 2), (32, 2)]
    # The ledger is the schedule: one segment per stage, (B_k / N, steps_k), one sigma.
    ledger = PrivacyLedger.from_json((out / "ledger.json").read_text())
    segs = [(s.sample_rate, s.count) for s in ledger.segments]
    assert segs == [(b / n, k) for b, k in stages]
    assert {s.noise_multiplier for s in ledger.segments} == {results["noise_multiplier"]}
    record = read_record(out)
    assert (
        record.private and record.epsilon == results["epsilon"] and record.delta == results["delta"]
    )
    assert record.ledger == ledger.state_dict() and record.producer == "dptrain train mlm"
    assert RDPAccountant(ledger).epsilon(results["delta"]) == pytest.approx(results["epsilon"])
    assert PLDAccountant(ledger).epsilon(results["delta"]) == pytest.approx(results["epsilon_pld"])
    assert results["epsilon"] == results["epsilon_rdp"] <= 1.0 + 1e-6
    assert results["epsilon_pld"] <= results["epsilon_rdp"]  # PLD is the tighter count
    assert results["delta"] == pytest.approx(1 / n**1.1)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(1, 7))
    assert [x["expected_batch"] for x in lines] == [16, 16, 24, 24, 32, 32]
    assert sum(x["batch"] for x in lines) == results["examples_processed"]
    assert results["expected_examples_processed"] == 16 * 2 + 24 * 2 + 32 * 2
    assert all(x["gradient_snr"] > 0 for x in lines)
    assert all(
        x["gradient_snr"] == pytest.approx(x["clipped_sum_norm"] / x["noise_norm"]) for x in lines
    )
    assert [x["step"] for x in lines if "epsilon" in x] == [2, 4, 6]
    assert [x["step"] for x in lines if "valid_accuracy" in x] == [3, 6]
    assert lines[-1]["epsilon"] == pytest.approx(results["epsilon"])
    assert 0.0 <= results["test_accuracy"] <= 1.0 and results["best_step"] in (3, 6)
    assert results["test_masked_tokens"] > 0
    assert [x["lr"] for x in lines] == pytest.approx(
        [cfg.lr * lr_factor(t, 6, 4) for t in range(6)]
    )
    assert load_config(MLMTrainConfig, out / "config.yaml") == cfg


def test_audit_section_in_results(tmp_path):
    # the growing batch: the canaries are sampled at each stage's rate
    cfg = _cfg(tmp_path, epsilon=1.0, audit=True, audit_canaries=2000, save_checkpoints=False)
    results = train_mlm(cfg)
    audit = results["audit"]
    assert audit["canaries"] == 2000 and audit["steps_observed"] == results["steps"] == 6
    assert set(audit["lower_bounds"]) == {"steinke2023"}  # Poisson steps: not Gaussian
    assert not audit["flagged"] and audit["claimed_epsilon"] == results["epsilon"]
    assert json.loads((tmp_path / "run" / "results.json").read_text())["audit"] == audit
    with pytest.raises(
        ValueError, match=r"audit=true is not allowed with a non-private run \(epsilon=null\)"
    ):
        _cfg(tmp_path, epsilon=None, audit=True)
    with pytest.raises(ValueError, match="audit_canaries=1 is not allowed"):
        _cfg(tmp_path, audit=True, audit_canaries=1)


def test_nonprivate_run_and_init_from_a_saved_model(tmp_path):
    r = train_mlm(_cfg(tmp_path, epsilon=None, steps=4, warmup_steps=2, eval_every=2))
    assert r["epsilon"] == float("inf") and r["delta"] == 0.0 and r["mean_gradient_snr"] is None
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(x["gradient_snr"] is None for x in lines)
    assert not (tmp_path / "run" / "ledger.json").read_text().count("sample_rate")
    # the saved HF folder is a valid init_from (with its own tokenizer)
    saved = tmp_path / "run" / "model"
    r2 = train_mlm(
        _cfg(
            tmp_path,
            epsilon=8.0,
            init_from=str(saved),
            tokenizer=str(saved),
            steps=2,
            warmup_steps=1,
            out=str(tmp_path / "again"),
            save_checkpoints=False,
        )
    )
    assert r2["model"]["init_from"] == str(saved) and r2["n_params"] == r["n_params"]


def test_weight_decay_shrinks_the_weights(tmp_path):
    """Decoupled weight decay: with a large lambda the decayed weights' norm falls (§4.4's
    lever, the embeddings), and the whole norm ends below the undecayed run's.

    Not the whole norm against its start: 6.9 of its 8.1 are the LayerNorm gains (ones,
    not decayed), which the noised Adam steps move by a few hundredths either way; that
    comparison flipped with the noise's layout (2026-11-27: +0.0024 against -0.0061
    before), while the embeddings fell by 7% with either (0.774 -> 0.720) and grew by 35%
    without decay."""
    base = {"epsilon": 1.0, "steps": 4, "warmup_steps": 1, "eval_every": 4, "lr": 0.01}
    small = train_mlm(_cfg(tmp_path, weight_decay=0.0, out=str(tmp_path / "a"), **base))
    large = train_mlm(_cfg(tmp_path, weight_decay=20.0, out=str(tmp_path / "b"), **base))
    assert small["initial_param_norm"] == pytest.approx(large["initial_param_norm"])
    assert large["final_embedding_norm"] < 0.95 * large["initial_embedding_norm"]
    assert small["final_embedding_norm"] > large["initial_embedding_norm"]
    assert large["final_param_norm"] < small["final_param_norm"]


# -- bad input ------------------------------------------------------------------------------------


def test_a_stage_larger_than_the_dataset_is_refused_before_writing(tmp_path):
    cfg = _cfg(tmp_path, batch_size=100_000, out=str(tmp_path / "never"))
    with pytest.raises(ValueError, match=r"stage \d .*exceeds the \d+ training examples"):
        train_mlm(cfg)
    assert not (tmp_path / "never").exists()
    cfg = _cfg(tmp_path, batch_schedule="8x2,100000x4", out=str(tmp_path / "never"))
    with pytest.raises(ValueError, match=r"stage 1 \(expected batch 100000 for 4 steps\)"):
        train_mlm(cfg)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"batch_schedule": "8x2,16x2"}, "add up to steps"),
        ({"warmup_steps": 10, "steps": 5}, "warmup_steps=10"),
        ({"batch_growth": 0.5}, "batch_growth=0.5"),
        ({"init_from": "somewhere"}, "its own tokenizer"),
        ({"hidden_size": 10, "num_heads": 4}, "multiple of num_heads"),
        ({"delta": "1/N^2"}, "delta="),
        ({"mask_prob": 1.5}, "mask_prob"),
        ({"epsilon": 0.0}, "epsilon=0.0"),
    ],
)
def test_bad_config(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        MLMTrainConfig(**{**TINY, **kw})


def test_bad_data_and_init_paths(tmp_path):
    with pytest.raises(ValueError, match="data="):
        train_mlm(_cfg(tmp_path, data=str(tmp_path / "missing.csv")))
    with pytest.raises(ValueError, match="init_from="):
        train_mlm(_cfg(tmp_path, init_from=str(tmp_path / "nope"), tokenizer=str(tmp_path)))


def test_packaged_config_loads():
    cfg = load_config(MLMTrainConfig, configs_dir() / "mlm.yaml")
    assert cfg.private and cfg.epsilon == 5.0
    assert batch_stages(cfg.batch_size, cfg.steps, cfg.warmup_steps, cfg.batch_growth) == [
        (128, 5),
        (224, 5),
        (320, 5),
        (416, 5),
        (512, 40),
    ]
