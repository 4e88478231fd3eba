"""The recipes under torchrun: 2 gloo processes train the same run as 1 process, rank 0
writes the run folder, and the one-process methods refuse WORLD_SIZE > 1.

The seqrec check starts ``dptrain train seqrec --nproc 2`` (torchrun) in a subprocess:
about 20 s on a small loaded machine (starting processes dominates).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dptrain.cli import main
from dptrain.distributed import spawn
from dptrain.recipes import _launch
from dptrain.recipes.classify import ClassifyTrainConfig, train_classify
from dptrain.recipes.seqrec import train_seqrec
from tests.recipes.test_seqrec import _cfg, _interactions

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR")

# Tiny seqrec run. dropout must be in (0, 1): 1e-9 never drops a float32 unit, so 2
# processes and 1 process compute the same thing up to float rounding. Chunks of at most
# 4 records, fewer than the 6 positions (see the report on chunks of exactly L records).
SEQREC = {
    "model": "dpformer",
    "max_len": 6,
    "epochs": 2,
    "batch_size": 16,
    "d_model": 8,
    "dropout": 1e-9,
    "max_physical_batch_size": 4,
    "progress": False,
}


@pytest.fixture
def no_torchrun_env(monkeypatch):
    for name in (*_TORCHRUN_ENV, "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _lines(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


# about 40 s (two processes start under torchrun); in the default run, two-process
# equivalence is tests/hf/test_distributed.py's and --nproc's checks are below
@pytest.mark.slow
def test_seqrec_on_two_processes_matches_one_process(tmp_path, no_torchrun_env):
    data = _interactions(tmp_path / "inter.csv")
    one = train_seqrec(_cfg(tmp_path, **SEQREC, out=str(tmp_path / "one")))
    command = [sys.executable, "-m", "dptrain.cli", "train", "seqrec", "--nproc", "2"]
    overrides = [f"data={data}", f"out={tmp_path / 'two'}"]
    overrides += [f"{k}={v}" for k, v in SEQREC.items()]
    proc = subprocess.run(
        [*command, *overrides],
        capture_output=True,
        text=True,
        timeout=300,
        env={k: v for k, v in os.environ.items() if k not in _TORCHRUN_ENV},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("run folder:") == 1  # rank 0 reports, rank 1 is silent
    two_dir, one_dir = tmp_path / "two", tmp_path / "one"
    two = json.loads((two_dir / "results.json").read_text())
    assert two["world_size"] == 2 and "world_size" not in one
    # the same privacy spend: the same ledger (histogram + steps at the same q and sigma)
    assert (two_dir / "ledger.json").read_text() == (one_dir / "ledger.json").read_text()
    for key in ("steps", "sample_rate", "noise_multiplier", "epsilon", "epsilon_by_accountant"):
        assert two[key] == one[key], key
    # the same training: one global Poisson batch and one noise draw per step
    a = torch.load(one_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    b = torch.load(two_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    m1, m2 = _lines(one_dir / "metrics.jsonl"), _lines(two_dir / "metrics.jsonl")
    assert [(x["epoch"], x["step"]) for x in m2] == [(x["epoch"], x["step"]) for x in m1]
    for x1, x2 in zip(m1, m2, strict=True):
        assert x2["train_loss"] == pytest.approx(x1["train_loss"], rel=1e-5)  # all ranks' loss
        assert x2["epsilon"] == x1["epsilon"]
        assert x2["valid_ndcg@10"] == pytest.approx(x1["valid_ndcg@10"], abs=1e-6)
    assert two["ndcg@10"] == pytest.approx(one["ndcg@10"], abs=1e-6)
    for name in ("config.yaml", "data.json", "checkpoints/best.pt", "plots/valid_ndcg.png"):
        assert (two_dir / name).is_file(), name


# -- what runs in one process only -------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "what"),
    [("dpfp", "DP-FP"), ("dpfp-finetune", "DP-FP"), ("nonprivate", "the non-private run")],
)
def test_one_process_classify_methods_refuse_several(tmp_path, monkeypatch, method, what):
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "run"
    cfg = ClassifyTrainConfig(
        method=method, epsilon=None if method == "nonprivate" else 3.0, out=str(out)
    )
    message = f"method='{method}' is not allowed with WORLD_SIZE=2: {what} runs in one process"
    with pytest.raises(ValueError, match=message):
        train_classify(cfg)
    assert not out.exists()  # refused before anything is loaded or written
    assert not dist.is_initialized()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"epsilon": None}, r"epsilon=None \(the non-private run\) is not allowed with WORLD"),
        ({"model": "most-popular"}, "model='most-popular' is not allowed with WORLD_SIZE=3"),
        ({"audit": True}, "audit=true is not allowed with WORLD_SIZE=3: the white-box canaries"),
    ],
)
def test_one_process_seqrec_runs_refuse_several(tmp_path, monkeypatch, settings, message):
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = _cfg(tmp_path, **settings)
    with pytest.raises(ValueError, match=message):
        train_seqrec(cfg)
    assert not (tmp_path / "run").exists()
    assert not dist.is_initialized()


def test_classify_audit_refuses_several_processes(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    out = tmp_path / "run"
    cfg = ClassifyTrainConfig(method="dpsgd-head", epsilon=3.0, audit=True, out=str(out))
    with pytest.raises(ValueError, match="audit=true is not allowed with WORLD_SIZE=2"):
        train_classify(cfg)
    assert not out.exists()  # refused before anything is loaded or written
    assert not dist.is_initialized()


def test_world_size_from_the_environment(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert _launch.env_world_size() == 1
    monkeypatch.setenv("WORLD_SIZE", "1")  # torchrun --nproc_per_node 1: no process group
    assert _launch.launch() == _launch.Launch()
    assert not dist.is_initialized()
    assert _launch.Launch().sum(2.5, 3) == [2.5, 3.0]
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="environment variable WORLD_SIZE='two' is not allowed"):
        _launch.env_world_size()


# -- dptrain train --nproc -----------------------------------------------------------------


def test_nproc_checks_before_starting_processes(tmp_path, capsys, no_torchrun_env):
    # refused in this process, before torchrun starts (exit 2, one message)
    assert main(["train", "classify", "--method", "dpfp", "--nproc", "2", "epsilon=3"]) == 2
    err = capsys.readouterr().err
    assert "method='dpfp' is not allowed with WORLD_SIZE=2: DP-FP runs in one process" in err
    assert main(["train", "seqrec", "--nproc", "0"]) == 2
    assert "--nproc=0 is not allowed: expected an integer >= 1" in capsys.readouterr().err
    assert main(["train", "seqrec", "--nproc", "2", "dropout=0"]) == 2  # bad config: no launch
    assert "dropout=0" in capsys.readouterr().err
    assert main(["train", "seqrec", "--nproc", "2", "audit=true"]) == 2
    assert "audit=true is not allowed with WORLD_SIZE=2" in capsys.readouterr().err
    for recipe in ("table2text", "mlm"):  # one-process recipes say so, by name
        assert main(["train", recipe, "--nproc", "2"]) == 2
        assert (
            f"--nproc=2 is not allowed for 'train {recipe}': several processes are supported "
            "for seqrec, classify"
        ) in capsys.readouterr().err


def test_nproc_is_refused_under_torchrun(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "seqrec", "--nproc", "2"]) == 2
    assert "--nproc=2 is not allowed under torchrun (WORLD_SIZE=2)" in capsys.readouterr().err


# -- classify dpsgd-head on two processes (slow: two processes load the encoder) ----------


def _classify_worker(cfg: ClassifyTrainConfig) -> dict:
    return train_classify(cfg)


@pytest.mark.slow
def test_classify_dpsgd_head_on_two_processes_matches_one_process(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.recipes.test_classify import (
        _bert_config,
        _config,
        _rows,
        _save_tokenizer,
        _write_csv,
    )

    folder = tmp_path / "plain"
    folder.mkdir()
    _save_tokenizer(folder)
    torch.manual_seed(0)
    transformers.BertModel(_bert_config()).save_pretrained(folder)
    files = {"data": _write_csv(tmp_path / "reviews.csv", _rows()), "mlm": str(folder)}
    settings = {"method": "dpsgd-head", "epochs": 2, "max_physical_batch_size": 3}
    one = train_classify(_config(files, tmp_path / "one", **settings))
    two = spawn(
        _classify_worker,
        2,
        args=(_config(files, tmp_path / "two", **settings),),
        timeout=120,
        join_timeout=300,
    )
    # every rank computes the same results (timings aside); rank 0 writes them
    timings = ("feature_time_s", "eval_time_s", "train_time_s", "step_time_s", "wall_time_s")
    assert [{k: v for k, v in r.items() if k not in timings} for r in two] == [
        {k: v for k, v in two[0].items() if k not in timings}
    ] * 2
    saved = json.loads((tmp_path / "two" / "results.json").read_text())
    assert saved["world_size"] == 2
    assert (tmp_path / "two" / "ledger.json").read_text() == (
        tmp_path / "one" / "ledger.json"
    ).read_text()
    for key in ("steps", "noise_multiplier", "epsilon", "ledger_events"):
        assert saved[key] == one[key], key
    assert saved["accuracy"] == pytest.approx(one["accuracy"])
    a = torch.load(tmp_path / "one" / "checkpoints" / "best.pt", weights_only=True)
    b = torch.load(tmp_path / "two" / "checkpoints" / "best.pt", weights_only=True)
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
