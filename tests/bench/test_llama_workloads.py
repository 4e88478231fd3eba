"""The real-size Llama workloads of ``dptrain bench --gpu`` (issue 27), tested on a CPU:
their configs (on the meta device, no memory), the refusal without CUDA, and the whole
plumbing (timing, a fresh memory process, the report) on their test-size twins."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from dptrain.bench import memory, workloads
from dptrain.bench.suite import GPU_PARTS, BenchOptions
from dptrain.cli import main


def _records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_gpu_workloads_are_the_issue_sizes_and_protocol():
    assert set(workloads.GPU_WORKLOADS) == {
        f"{size}-{tuning}-{precision}"
        for size in ("llama135m", "llama1b")
        for tuning in ("full", "lora")
        for precision in ("autocast", "bf16")
    }
    for name in workloads.GPU_WORKLOADS:
        w = workloads.WORKLOADS[name]
        assert w.tied and w.seq_len == 512 and w.gpu
        assert w.batch_size == (16 if name.startswith("llama135m") else 8)
    o = BenchOptions.gpu_defaults()
    assert (o.device, o.warmup, o.steps, o.parts) == ("cuda", 3, 10, GPU_PARTS)


@pytest.mark.parametrize(
    "name, expected",
    # the published parameter counts (tied): SmolLM2-135M and Llama-3.2-1B
    [("llama135m-full-bf16", 134_515_008), ("llama1b-full-autocast", 1_235_814_400)],
)
def test_real_size_models_have_the_published_parameter_counts(name, expected):
    model = workloads.make_model(workloads.WORKLOADS[name], device="meta")
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.lm_head.weight is model.model.embed_tokens.weight
    dtype = torch.bfloat16 if name.endswith("-bf16") else torch.float32
    assert {p.dtype for p in model.parameters()} == {dtype}


def test_real_size_lora_has_rank_16_adapters_on_the_seven_projections():
    pytest.importorskip("peft")
    model = workloads.make_model(workloads.WORKLOADS["llama135m-lora-bf16"], device="meta")
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == 30 * 7 * 2 and all("lora_" in n for n in trainable)
    assert trainable[
        "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    ].shape == (16, 576)


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--workloads", "llama1b-lora-bf16"],
            "workloads=llama1b-lora-bf16 is not allowed on "
            "device='cpu': these real-size workloads need a CUDA device",
        ),
        (["--quick", "--gpu"], "--quick and --gpu are not allowed together"),
    ],
)
def test_real_size_workloads_are_refused_without_cuda(capsys, argv, message):
    assert main(["bench", *argv]) == 2
    assert message in capsys.readouterr().err


def test_gpu_flag_without_a_gpu_is_a_clear_error(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is available here")
    assert main(["bench", "--gpu"]) == 2
    assert "device='cuda' is not available here" in capsys.readouterr().err


# the other two combinations are the same code (peft's import alone costs ~10 s here)
@pytest.mark.parametrize("tuning, precision", [("full", "bf16"), ("lora", "autocast")])
def test_tiny_twins_train_in_their_precision(monkeypatch, tuning, precision):
    if tuning == "lora":
        pytest.importorskip("peft")
    w = workloads.WORKLOADS[f"llamatiny-{tuning}-{precision}"]
    # what the run asks for is overridden by the workload: -bf16 never autocasts
    amp = "bf16" if precision == "bf16" else "off"
    assert workloads.effective_amp(w, amp) == ("off" if precision == "bf16" else "bf16")
    seen = []
    real_logits = workloads._logits

    def spy(model, workload, inputs):
        out = real_logits(model, workload, inputs)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(workloads, "_logits", spy)
    for method in ("nonprivate", "dptrain-bk", "dptrain-bk-bounded"):
        built = workloads.build_step(w, method, amp=amp)
        built.step()
    assert seen == [torch.bfloat16] * 3  # bf16 weights or bf16 autocast


def test_cli_times_the_tiny_twins(tmp_path, capsys):
    """Timing through ``dptrain bench`` (memory skipped: a fresh process per method, see
    the slow test below)."""
    argv = ["bench", "--workloads", "llamatiny-full-bf16", "--methods", "dptrain-bk",
            "--skip", "memory,max-batch,accountants", "--warmup", "1", "--steps", "1",
            "--json", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    steps = [r for r in _records(capsys.readouterr().out) if r["kind"] == "step"]
    assert [(r["method"], r["amp"], r["error"]) for r in steps] == [
        ("nonprivate", "off", None),
        ("dptrain-bk", "off", None),
    ]
    assert steps[1]["time_ratio"] > 0 and steps[0]["batch_size"] == 4
    report = (tmp_path / "bench.md").read_text()
    assert "- `llamatiny-full-bf16`: Llama from a config" in report and "bf16 weights" in report


@pytest.mark.slow
def test_a_fresh_process_measures_a_tiny_twin_in_its_precision():
    """As the suite's memory part starts it (~15 s: the process imports torch and transformers)."""
    res = memory.measure_peak("llamatiny-full-autocast", "dptrain-bk", steps=1)
    assert "error" not in res, res
    assert res["amp"] == "bf16" and res["peak_mb"] >= res["baseline_mb"] > 0
