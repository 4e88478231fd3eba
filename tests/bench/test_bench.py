"""``dptrain bench``: the command runs and emits well-formed records; the pieces work.

Timings are not tests: no measured time or memory figure is asserted, only
the records' shape. The accountant values are (two implementations of the
same accountant must agree), and so is the batch search's logic.
"""

from __future__ import annotations

import json
import math

import pytest

from dptrain.bench import accountants, memory, report, timing, workloads
from dptrain.bench.suite import BenchOptions, run_bench, write_outputs
from dptrain.cli import main

STEP_FIELDS = ("workload", "method", "step_time_s", "time_ratio", "peak_mb", "memory_ratio")


def _records(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _check_step_records(steps: list[dict], workload_names: set[str]) -> None:
    assert steps
    for r in steps:
        for f in STEP_FIELDS:
            assert f in r, f"record {r['workload']}/{r['method']} has no {f}"
        assert r["method"] in workloads.METHODS
        assert r["workload"] in workload_names
        if r["error"] is None:  # measured: every figure is a positive number
            for f in ("step_time_s", "time_ratio", "peak_mb", "memory_ratio"):
                assert isinstance(r[f], float) and r[f] > 0 and math.isfinite(r[f]), (r, f)
        else:  # a refusal or a skip is a row with its reason, not a blank
            assert isinstance(r["error"], str) and r["error"]
    by = {r["method"]: r for r in steps}
    assert by["nonprivate"]["time_ratio"] == 1.0
    assert by["nonprivate"]["memory_ratio"] == 1.0


def test_quick_json_without_memory_emits_records(tmp_path, capsys):
    """``--quick --json`` (memory part skipped to stay fast: see the slow test for all of it)."""
    code = main(["bench", "--quick", "--json", "--skip", "memory", "--out", str(tmp_path)])
    assert code == 0
    records = _records(capsys.readouterr().out)
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["method"] for r in steps] == list(workloads.DEFAULT_METHODS)
    for r in steps:
        assert "tied" in r["workload"]  # the quick workload is the tied DPFormer
        assert r["peak_mb"] is None  # memory skipped
        if r["error"] is None:
            assert r["step_time_s"] > 0 and r["time_ratio"] > 0
            assert r["timed_steps"] == 3
    opacus_ghost = next(r for r in steps if r["method"] == "opacus-ghost")
    assert opacus_ghost["error"]  # refuses the tied model (or opacus is not installed)
    acc = [r for r in records if r["kind"] == "accountant"]
    assert {(r["library"], r["accountant"]) for r in acc} >= {("dptrain", "pld")}
    assert (tmp_path / "bench.json").exists() and (tmp_path / "bench_ratios.png").exists()


@pytest.mark.slow
def test_quick_json_full(tmp_path, capsys):
    """The whole ``dptrain bench --quick --json``, fresh memory processes included (~1 min)."""
    assert main(["bench", "--quick", "--json", "--out", str(tmp_path)]) == 0
    records = _records(capsys.readouterr().out)
    _check_step_records([r for r in records if r["kind"] == "step"], set(workloads.WORKLOADS))
    payload = json.loads((tmp_path / "bench.json").read_text())
    assert payload["meta"]["quick"] is True
    assert len(payload["records"]) == len(records)


def test_fresh_process_memory_of_one_configuration():
    res = memory.measure_peak("dpformer-B128-T50-tied", "nonprivate", steps=1, batch_size=8)
    assert "error" not in res, res
    assert res["peak_mb"] >= res["baseline_mb"] > 0


def test_bad_arguments_exit_2(capsys):
    assert main(["bench", "--quick", "--workloads", "gpt-B3"]) == 2
    assert "workloads=gpt-B3 is not allowed" in capsys.readouterr().err
    assert main(["bench", "--quick", "--skip", "everything"]) == 2
    assert "--skip=everything is not allowed" in capsys.readouterr().err
    assert main(["bench", "--quick", "--steps", "0"]) == 2
    assert "steps=0 is not allowed" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is available here")
    assert main(["bench", "--quick", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "device='cuda' is not available here" in err and "expected device=cpu" in err


def test_method_and_workload_names():
    assert workloads.METHODS == (
        "nonprivate",
        "dptrain-bk",
        "dptrain-bk-bounded",
        "dptrain-ghost",
        "dptrain-instantiate",
        "opacus-hooks",
        "opacus-ghost",
        "opacus-functorch",
    )
    # asked for by name only: on float32 records it is dptrain-bk
    assert (
        tuple(m for m in workloads.METHODS if m != "dptrain-bk-bounded")
        == workloads.DEFAULT_METHODS
    )
    for name, w in workloads.WORKLOADS.items():
        if w.model in ("smollm2", "llama"):  # tied Llamas: their names say full or LoRA
            assert w.tied and ("-full" in name or "-lora" in name)
        else:
            assert name.endswith("-tied") == w.tied
    assert workloads.check_methods(["opacus-ghost"]) == ("nonprivate", "opacus-ghost")
    with pytest.raises(ValueError, match="method='sgd' is not allowed"):
        workloads.build_step("gpt-B16-T128", "sgd")


def test_missing_opacus_is_a_note_not_a_failure(monkeypatch):
    real = workloads._installed
    monkeypatch.setattr(workloads, "_installed", lambda m: m != "opacus" and real(m))
    with pytest.raises(workloads.MethodSkippedError, match="opacus not installed"):
        workloads.build_step("dpformer-B128-T50-tied", "opacus-hooks")
    opts = BenchOptions.quick_defaults(
        methods=("opacus-hooks",), steps=1, warmup=0, parts=("timing",), out=None
    )
    result = run_bench(opts, log=lambda _line: None)
    row = next(r for r in result.steps if r.method == "opacus-hooks")
    assert row.error.startswith("skipped: opacus not installed")
    assert row.step_time_s is None


# -- the accountant bench: a correctness check --------------------------------------------------


def test_accountant_epsilons_agree_with_dp_accounting():
    recs = accountants.accountant_bench(
        accountants.QUICK_GRID, calibrate=False, libraries=("dptrain", "dp_accounting")
    )
    eps = {(r.library, r.accountant): r.epsilon for r in recs}
    assert all(r.error is None and r.time_s is not None for r in recs)
    # The same PLD composition: identical up to floating point.
    assert eps["dptrain", "pld"] == pytest.approx(eps["dp_accounting", "pld"], rel=1e-6)
    # RDP at different order grids: within 0.1%.
    assert eps["dptrain", "rdp"] == pytest.approx(eps["dp_accounting", "rdp"], rel=1e-3)
    # q = 256/60000, sigma = 1.1, 10,000 steps, delta 1e-5 (dp_accounting's PLD: about 1.98).
    assert eps["dptrain", "pld"] == pytest.approx(1.978, abs=0.01)
    assert eps["dptrain", "gdp"] < eps["dptrain", "pld"] < eps["dptrain", "rdp"]


def test_accountant_bench_rejects_bad_arguments():
    with pytest.raises(ValueError, match="repeats=0 is not allowed"):
        accountants.accountant_bench(repeats=0)
    with pytest.raises(ValueError, match="libraries="):
        accountants.accountant_bench(libraries=("tf-privacy",))


# -- the largest-batch search on a fake step ----------------------------------------------------


@pytest.mark.parametrize("boundary", [1, 5, 37, 64, 1000])
@pytest.mark.parametrize("start", [1, 16, 64])
def test_find_max_batch_finds_the_boundary(boundary, start):
    res = memory.find_max_batch(lambda b: b <= boundary, start=start, limit=4096)
    assert res.batch_size == boundary
    assert res.first_failing == boundary + 1
    assert not res.limit_reached
    assert all(ok == (b <= boundary) for b, ok in res.probes)
    assert len(res.probes) <= 2 * math.log2(4096) + 2


def test_find_max_batch_edges():
    nothing = memory.find_max_batch(lambda b: False, start=8)
    assert nothing.batch_size is None and nothing.first_failing == 1
    everything = memory.find_max_batch(lambda b: True, start=3, limit=100)
    assert everything.batch_size == 100 and everything.limit_reached
    coarse = memory.find_max_batch(lambda b: b <= 700, start=1, rtol=0.1)
    assert 700 * 0.9 <= coarse.batch_size <= 700 < coarse.first_failing
    assert len(coarse.probes) < len(memory.find_max_batch(lambda b: b <= 700, start=1).probes)

    def refuses(b: int) -> bool:
        if b > 4:
            raise memory.ProbeError("the model is refused")
        return True

    stopped = memory.find_max_batch(refuses, start=2)
    assert stopped.batch_size == 4 and stopped.error == "the model is refused"
    with pytest.raises(ValueError, match="start=0 is not allowed"):
        memory.find_max_batch(lambda b: True, start=0)


# -- timing and the writers ---------------------------------------------------------------------


def test_round_robin_rotates_and_records_errors():
    calls: list[str] = []
    ticks = iter(range(1000))

    def step(name: str):
        def run() -> None:
            calls.append(name)
            if name == "c" and len(calls) > 4:
                raise RuntimeError("refused\nsecond line")

        return run

    res = timing.time_round_robin(
        {m: step(m) for m in "abc"}, warmup=1, timed=3, clock=lambda: float(next(ticks))
    )
    assert calls[:3] == ["a", "b", "c"] and calls[3:6] == ["b", "c", "a"]
    assert res.errors == {"c": "RuntimeError: refused"}
    assert len(res.times["a"]) == len(res.times["b"]) == 3
    assert res.summary("c") is None
    s = timing.summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert (s.median_s, s.q1_s, s.q3_s, s.steps) == (3.0, 2.0, 4.0, 5)


def test_writers_produce_files(tmp_path):
    steps = [
        report.StepRecord("gpt-B16-T128", "nonprivate", 1.0, 0.9, 1.1, 9, 1.0, 900.0, 1.0),
        report.StepRecord("gpt-B16-T128", "dptrain-bk", 1.2, 1.1, 1.3, 9, 1.2, 910.0, 1.01),
        report.StepRecord("gpt-B16-T128", "opacus-ghost", 2.4, 2.3, 2.5, 9, 2.4, 1100.0, 1.22),
        report.StepRecord("gpt-B16-T128-tied", "nonprivate", 1.0, 0.9, 1.1, 9, 1.0, 900.0, 1.0),
        report.StepRecord("gpt-B16-T128-tied", "dptrain-bk", 1.3, 1.2, 1.4, 9, 1.3, 990.0, 1.1),
        report.StepRecord(
            "gpt-B16-T128-tied", "opacus-ghost", error="NotImplementedError: tying | no"
        ),
    ]
    max_batch = [report.MaxBatchRecord("gpt-B16-T128", "nonprivate", 2048.0, 60, 62)]
    acc = [
        accountants.AccountantRecord("epsilon", "dptrain", "pld", 0.01, 100, 1e-5, 1.0),
        accountants.AccountantRecord(
            "calibration", "opacus", "rdp", 0.01, 100, 1e-5, error="skipped"
        ),
    ]
    table = report.step_table(steps)
    assert table.count("\n") == len(steps) + 1
    assert "tying \\| no" in table  # a pipe in an error does not break the table
    goals = report.goals_table(steps)
    assert "2.00x (met)" in goals and "Opacus ghost: NotImplementedError" in goals
    assert "1.300x (**missed** by 4.0%)" in goals
    assert "| 60 |" in report.max_batch_table(max_batch)
    assert "skipped" in report.accountant_tables(acc)

    png = tmp_path / "ratios.png"
    report.write_ratio_chart(png, steps, title="test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report.write_json(tmp_path / "r.json", [*steps, *max_batch, *acc], machine="test")
    payload = json.loads((tmp_path / "r.json").read_text())
    assert payload["meta"] == {"machine": "test"}
    assert [r["kind"] for r in payload["records"]] == ["step"] * 6 + ["max_batch"] + [
        "accountant"
    ] * 2

    from dptrain.bench.suite import BenchResult

    result = BenchResult(BenchOptions(out=None), steps, max_batch, acc, meta=_meta())
    paths = write_outputs(result, str(tmp_path / "out"))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["bench.json", "bench.md", "bench_ratios.png"]
    text = (tmp_path / "out" / "bench.md").read_text()
    assert "## Step time and peak memory" in text and "## Largest batch" in text


def _meta() -> dict:
    return {
        "date": "2026-01-01 00:00 UTC",
        "machine": "test",
        "python": "3",
        "versions": "",
        "commit": None,
        "command": "dptrain bench",
        "quick": False,
        "total_s": 1.0,
        "load_average_start": 0.0,
        "load_average_end": 0.0,
    }


# -- --amp bf16: mixed precision --------------------------------------------------------------

SMALL = "dpformer-B128-T50-tied"


def _spy_on_models(monkeypatch) -> list:
    """Record every model ``build_step`` makes (it does not return it)."""
    made: list = []
    real = workloads.make_model

    def spy(*args, **kwargs):
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(workloads, "make_model", spy)
    return made


def test_bad_amp_is_refused_by_name():
    with pytest.raises(ValueError, match=r"amp='fp16' is not allowed: expected one of off, bf16"):
        workloads.build_step(SMALL, "nonprivate", amp="fp16")
    with pytest.raises(ValueError, match=r"amp='bf16x' is not allowed"):
        BenchOptions(amp="bf16x").checked()
    with pytest.raises(ValueError, match=r"amp='fp16' is not allowed"):
        memory.measure_peak(SMALL, "nonprivate", amp="fp16")
    assert BenchOptions(amp="bf16").checked().amp == "bf16"  # on CPU too


@pytest.mark.parametrize("method", ["nonprivate", "dptrain-bk"])
def test_bf16_step_runs_the_forward_in_bf16_and_trains(monkeypatch, method):
    import torch

    made = _spy_on_models(monkeypatch)
    dtypes = {}
    for amp in ("off", "bf16"):
        built = workloads.build_step(SMALL, method, batch_size=4, amp=amp)
        model = made[-1]
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))

        def record(_module, _inputs, out, amp=amp) -> None:
            dtypes.setdefault(amp, out.dtype)

        linear.register_forward_hook(record)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        built.step()
        changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
        assert changed, f"{method} with amp={amp} changed no parameter"
        # fp32 master weights: autocast casts copies, never the parameters
        assert all(p.dtype == torch.float32 for p in model.parameters())
    assert dtypes == {"off": torch.float32, "bf16": torch.bfloat16}


def test_cli_amp_flag_reaches_the_options_and_the_report(tmp_path, capsys):
    import argparse

    from dptrain.bench.suite import add_bench_arguments, options_from_args

    p = argparse.ArgumentParser()
    add_bench_arguments(p)
    assert options_from_args(p.parse_args(["--quick", "--amp", "bf16"])).amp == "bf16"
    assert options_from_args(p.parse_args(["--quick"])).amp == "off"
    with pytest.raises(SystemExit):
        p.parse_args(["--amp", "fp16"])
    assert "invalid choice: 'fp16'" in capsys.readouterr().err

    code = main(
        ["bench", "--quick", "--amp", "bf16", "--skip", "timing,memory", "--out", str(tmp_path)]
    )
    assert code == 0
    assert json.loads((tmp_path / "bench.json").read_text())["meta"]["amp"] == "bf16"
    assert "- Precision: bf16 mixed precision (`--amp bf16`)" in (tmp_path / "bench.md").read_text()


def test_memory_child_accepts_amp(capsys):
    memory.main([SMALL, "dptrain-bk", "--amp", "bf16", "--batch-size", "4", "--steps", "1"])
    (res,) = _records(capsys.readouterr().out)
    assert "error" not in res, res
    assert res["amp"] == "bf16" and res["peak_mb"] >= res["baseline_mb"] > 0
