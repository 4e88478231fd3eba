"""Shared pieces of the benchmark scripts: fresh measuring processes, run metadata, and
the engine's layer choices made as on CUDA.

Peak memory is measured in a fresh process per configuration, read from
``ru_maxrss``. Linux keeps ``ru_maxrss`` across ``execve``, and a child
``vfork()``ed from a large process would inherit that process's peak; so a
small Python launcher without torch starts the measuring process, and the peak
it reports is its own.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import json
import os
import platform
import re
import resource
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

__all__ = [
    "command_line",
    "cuda_layer_choices",
    "git_description",
    "machine_description",
    "maxrss_mb",
    "package_at",
    "run_fresh",
]

_LAUNCHER = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[1:]).returncode)"


def maxrss_mb() -> float:
    """Peak resident set size of this process so far, in MB (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_fresh(script: str, *args: str, timeout: float = 1800, what: str = "child") -> dict:
    """Run ``python script args`` in a fresh process; return the last JSON line it printed.

    On failure: ``{"error": "<what> process failed (exit N): <last stderr line>"}``.
    """
    cmd = [sys.executable, os.path.abspath(script), *args]
    proc = subprocess.run(
        [sys.executable, "-S", "-c", _LAUNCHER, *cmd],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
    return {"error": f"{what} process failed (exit {proc.returncode}): {tail}"}


def git_description() -> str:
    """``commit abc1234`` (+ a note when src/dptrain has uncommitted changes)."""

    def git(*cmd: str) -> str:
        return subprocess.run(
            ["git", *cmd], capture_output=True, text=True, check=False
        ).stdout.strip()

    with contextlib.suppress(OSError):
        commit = git("rev-parse", "--short", "HEAD")
        if commit:
            dirty = git("status", "--porcelain", "--", "src/dptrain")
            return f"commit {commit}" + (" + uncommitted changes in src/dptrain" if dirty else "")
    return "unknown commit"


def machine_description() -> str:
    """Core count, CPU model (lscpu) and GPU, if any."""
    model = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    gpu = "no GPU" if not torch.cuda.is_available() else torch.cuda.get_device_name(0)
    return f"{os.cpu_count()}-core CPU ({model}), {gpu}"


def command_line() -> str:
    """The command that ran this script, with the interpreter path made relative if inside."""
    exe = sys.executable
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(exe)
        if not rel.startswith(".."):
            exe = rel
    return shlex.join([exe, *sys.argv])


def cuda_layer_choices(package: str = "dptrain") -> None:
    """Make ``package``'s engine choose per layer as it does on CUDA, on this CPU: whole
    Gram matrices (``rules.HALF_GRAM_DEVICES``), streamed per-example gradients formed in
    their slots (``streaming.SLOT_DEVICES``) and ghost norm or instantiation by size
    (``rules.SIZE_RULE_DEVICES``). A revision older than one of these settings keeps that
    choice as it always made it (``host_overhead.py --against``)."""
    rules = importlib.import_module(f"{package}.clipping.rules")
    streaming = importlib.import_module(f"{package}.clipping.streaming")
    getattr(rules, "HALF_GRAM_DEVICES", set()).discard("cpu")
    getattr(streaming, "SLOT_DEVICES", set()).add("cpu")
    getattr(rules, "SIZE_RULE_DEVICES", set()).add("cpu")


def package_at(rev: str) -> str:
    """Import name of git revision ``rev``'s ``src/dptrain``, copied under a name of its own
    (its absolute imports of dptrain rewritten to that name) into a temporary directory
    put on ``sys.path``: two versions of the engine timed in one process, in the same
    rounds (``host_overhead.py --against``, ``module_host_cost.py --against``)."""
    repo = Path(__file__).resolve().parents[1]
    sha = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    name = f"dptrain_at_{sha}"
    root = Path(tempfile.mkdtemp(prefix="dptrain_at_"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    archive = subprocess.run(
        ["git", "archive", "--format=tar", sha, "src/dptrain"],
        cwd=repo,
        capture_output=True,
        check=True,
    ).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    (root / "src" / "dptrain").rename(root / name)
    # dptrain.x, "import dptrain", "from dptrain import"; strings and comments stay
    pattern = re.compile(r"\bdptrain(?=[.\s])")
    for py in (root / name).rglob("*.py"):
        text = py.read_text()
        lines = [
            pattern.sub(name, line) if line.lstrip().startswith(("from ", "import ")) else line
            for line in text.splitlines(keepends=True)
        ]
        py.write_text("".join(lines))
    sys.path.insert(0, str(root))
    return name
