"""``dptrain bench``: dptrain measured side by side with non-private PyTorch and Opacus.

- :mod:`dptrain.bench.workloads`: the reference workloads (GPT-2-like LM,
  HF BERT classifier, DPFormer) and one training step per method;
- :mod:`dptrain.bench.timing`: step time, round-robin over the methods;
- :mod:`dptrain.bench.memory`: peak memory in a fresh process, and the largest
  batch under a memory cap;
- :mod:`dptrain.bench.accountants`: epsilon and calibration next to
  dp_accounting and Opacus;
- :mod:`dptrain.bench.report`: the records, JSON, markdown and the ratio chart;
- :mod:`dptrain.bench.suite`: the whole run (``dptrain bench``).

See docs/bench.md.
"""

from dptrain.bench.accountants import GRID, AccountantPoint, AccountantRecord, accountant_bench
from dptrain.bench.memory import (
    MaxBatchResult,
    find_max_batch,
    max_batch_under_cap,
    measure_peak,
)
from dptrain.bench.report import (
    MaxBatchRecord,
    StepRecord,
    step_table,
    write_json,
    write_ratio_chart,
)
from dptrain.bench.suite import BenchOptions, BenchResult, run_bench, write_outputs
from dptrain.bench.timing import time_round_robin
from dptrain.bench.workloads import METHODS, WORKLOADS, MethodSkippedError, Workload, build_step

__all__ = [
    "GRID",
    "METHODS",
    "WORKLOADS",
    "AccountantPoint",
    "AccountantRecord",
    "BenchOptions",
    "BenchResult",
    "MaxBatchRecord",
    "MaxBatchResult",
    "MethodSkippedError",
    "StepRecord",
    "Workload",
    "accountant_bench",
    "build_step",
    "find_max_batch",
    "max_batch_under_cap",
    "measure_peak",
    "run_bench",
    "step_table",
    "time_round_robin",
    "write_json",
    "write_outputs",
    "write_ratio_chart",
]
