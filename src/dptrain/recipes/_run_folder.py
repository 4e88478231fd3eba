"""Where a run writes: a fresh folder per run, and never over a run the user already has.

A run folder holds the record of the privacy budget a run spent (``ledger.json``,
``privacy.json``): writing a second run over it would lose that record, so an existing,
non-empty folder is refused (a named error, before any training) unless the user says
``overwrite=true``. Without ``out=`` each run gets its own folder,
``runs/<recipe>/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``... when two start in the same second).
"""

from __future__ import annotations

import time
from pathlib import Path

__all__ = ["check_run_folder", "default_run_folder", "holds_files"]


def holds_files(folder: Path) -> bool:
    """Whether ``folder`` exists and is not an empty directory."""
    if not folder.exists():
        return False
    return not folder.is_dir() or any(folder.iterdir())


def default_run_folder(recipe: str, root: str | Path = "runs") -> Path:
    """A folder no run has used: ``root/<recipe>/<local time>`` (with a suffix if taken)."""
    base = Path(root) / recipe / time.strftime("%Y%m%d-%H%M%S")
    folder, k = base, 1
    while folder.exists():
        k += 1
        folder = base.with_name(f"{base.name}-{k}")
    return folder


def check_run_folder(out: str | Path, overwrite: bool, *, setting: str = "out") -> Path:
    """``out`` as a path, refused (``ValueError`` naming ``setting``) when it already holds
    files and ``overwrite`` is false."""
    folder = Path(out).expanduser()
    if folder.exists() and not folder.is_dir():
        raise ValueError(
            f"{setting}={str(out)!r} is not allowed: it is a file; expected a folder for the run"
        )
    if not overwrite and holds_files(folder):
        shown = sorted(p.name for p in folder.iterdir())[:6]
        raise ValueError(
            f"{setting}={str(out)!r} is not allowed: the folder exists and holds {shown} "
            "(a run's record of its privacy budget is never overwritten); expected a new or "
            f"empty folder: leave {setting}= out for a fresh one, or pass overwrite=true to "
            "write over this one"
        )
    return folder
