"""benchmarks/profile_smollm2.py, the per-phase profiler of a private step, as a user runs it.

It wraps engine internals by name, so an engine refactor can break it: these tests run
its main() on a tiny CPU workload (llamatiny-full-bf16: 2 layers, B 4, T 16; tied
embedding, RMSNorm, streamed modules) for one warm-up and one timed step, and fail
when a phase the report should name is gone, or when a wrapped name is no longer called.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.bench.scripts import load_script

pytest.importorskip("transformers")


profile = load_script("profile_smollm2")
# main() sets one torch thread, as the profiler measures; the fixture puts the count back
pytestmark = pytest.mark.usefixtures("one_thread")

WORKLOAD = "llamatiny-full-bf16"

#: What the report of one book-keeping step must name (labels as printed).
ENGINE_PHASES = (
    "forward",
    "loss",
    "engine.backward",
    "p.grad check",
    "graph check (_live_calls)",
    "example layouts (RowDecisions.layouts)",
    "independence check (new layouts)",
    "self-check (new layouts)",
    "output gradients (output_gradients)",
    "torch.autograd.grad",
    "streamed: RMSNorm",
    "records (build_records)",
    "per-example norms (norms_sq)",
    "norms: q_proj",
    "norms: down_proj",
    "norms: streamed modules (held grads)",
    "norms: tied embedding (phantom)",
    "embedding ghost norm (lookups)",
    "head Gram inner product",
    "phantom cross term",
    "clip factors",
    "book-keeping sums (_book_keeping)",
    "sum: q_proj",
    "sum: embed_tokens",
    "add to p.grad (GradStore.add)",
    "optimizer step",
    "add noise (DPOptimizer.add_noise)",
    "AdamW step",
)


def _run(tmp_path, capsys, *args: str, workload: str = WORKLOAD) -> tuple[str, dict]:
    out_json = tmp_path / "r.json"
    common = ["--workload", workload, "--warmup", "1", "--steps", "1", "--min-ms", "0"]
    profile.main([*common, "--json", str(out_json), *args])
    (result,) = json.loads(out_json.read_text())
    return capsys.readouterr().out, result


def test_report_names_every_engine_phase_and_unwraps_after(tmp_path, capsys):
    grad, backward = torch.autograd.grad, torch.Tensor.backward
    out, r = _run(tmp_path, capsys, "--methods", "dptrain-bk")
    for phase in ENGINE_PHASES:
        assert f" {phase} |" in out, f"the report lacks {phase!r}:\n{out}"
    # nesting: autograd's backward inside the output gradients, the phantom norm's parts
    # inside the tied norm, the sums inside book-keeping, the checks on the first step only
    bk = "step > engine.backward"
    for path in (
        f"{bk} > output gradients (output_gradients) > torch.autograd.grad",
        f"{bk} > per-example norms (norms_sq) > norms: tied embedding (phantom) "
        "> head Gram inner product",
        f"{bk} > book-keeping sums (_book_keeping) > sum: q_proj",
        "step > optimizer step > AdamW step",
    ):
        assert r["median"][path] > 0, path
    assert r["first_step"][f"{bk} > self-check (new layouts)"] > 0
    assert r["median"][f"{bk} > self-check (new layouts)"] == 0
    assert r["self_checks"] == 1
    # Every other wrapped name ran: one the engine stopped calling shows up here.
    assert set(r["not_called"]) == {"Tensor.backward", "rows check (rows the data decide)"}
    assert "Not called in this run: Tensor.backward" in out
    # the wrappers are gone: later code in this process sees torch and the engine as they were
    assert torch.autograd.grad is grad and torch.Tensor.backward is backward
    import dptrain.clipping.sums as sums

    assert not hasattr(sums.gram_inner, "__wrapped__")


def test_ghost_and_non_private_steps_are_profiled(tmp_path, capsys):
    out, r = _run(tmp_path, capsys, "--methods", "nonprivate")
    assert " loss.backward() |" in out and "engine.backward" not in out
    assert r["median"]["step > loss.backward() > Tensor.backward"] > 0
    assert r["not_called"] == [] and r["self_checks"] is None
    # float32, no autocast: ghost forms the sum by its second backward, not from the records
    out, r = _run(
        tmp_path, capsys, "--methods", "dptrain-ghost", "--batch", "2", workload="gpt-B16-T128"
    )
    assert r["batch_size"] == 2 and "(B=2, T=128, amp off)" in out
    assert r["median"]["step > engine.backward > Tensor.backward"] > 0
    assert "book-keeping sums (_book_keeping)" in r["not_called"]


def test_a_missing_name_fails_at_once_naming_every_missing_one(monkeypatch, capsys):
    stale = (
        profile.Target("engine", "_layouts", "example layouts"),
        profile.Target("engine", "_norms_sums.gone", "norms"),
        profile.Target("dptrain.clipping.engine", "gram_inner", "Gram"),
    )
    monkeypatch.setattr(profile, "TARGETS", (*profile.TARGETS, *stale))
    with pytest.raises(profile.StaleTargetsError) as info:
        profile.main(["--workload", WORKLOAD, "--methods", "dptrain-bk", "--steps", "1"])
    message = str(info.value)
    for name in (
        "engine._layouts",
        "engine._norms_sums.gone",
        "dptrain.clipping.engine.gram_inner",
    ):
        assert name in message
    assert "3 name(s)" in message and "the ClippingEngine" in message
    assert capsys.readouterr().out == ""  # before any step


@pytest.mark.parametrize(
    "args, named",
    [
        (["--num-layers", "2"], "--num-layers 2 is not allowed with --workload"),
        (["--methods", "dptrain-bk,opacus-hooks"], "--methods 'dptrain-bk,opacus-hooks'"),
        (["--steps", "0"], "--steps 0 is not allowed"),
        (["--batch", "0"], "--batch 0 is not allowed"),
        (["--amp", "bf16"], "--amp bf16 is not allowed with --workload llamatiny-full-bf16"),
        (["--workload", "llama1b-full-bf16"], "invalid choice: 'llama1b-full-bf16'"),
    ],
)
def test_bad_arguments_exit_2_naming_them(args, named, capsys):
    with pytest.raises(SystemExit) as info:
        profile.main(["--workload", WORKLOAD, *args])
    assert info.value.code == 2
    assert named in capsys.readouterr().err
