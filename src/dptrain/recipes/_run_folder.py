"""Where a run writes: a fresh folder per run, and never over a run the user already has.

A run folder holds the record of the privacy budget a run spent (``ledger.json``,
``privacy.json``): writing a second run over it would lose that record, so an existing,
non-empty folder is refused (a named error, before any training) unless the user says
``overwrite=true``. Without ``out=`` each run gets its own folder,
``runs/<recipe>/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``... when two start in the same second).

Commands whose config names a default folder (``dptrain demo``'s ``runs/demo``, the
experiments', studies' and audits' packaged ``out:``) go through
:func:`claim_run_folder`: a folder the user named on the command line is checked as
above; a default one that already holds a run gives way to a fresh sibling,
``<folder>-<YYYYmmdd-HHMMSS>``, announced before any work.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

__all__ = ["check_run_folder", "claim_run_folder", "default_run_folder", "holds_files"]


def holds_files(folder: Path) -> bool:
    """Whether ``folder`` exists and is not an empty directory."""
    if not folder.exists():
        return False
    return not folder.is_dir() or any(folder.iterdir())


def default_run_folder(recipe: str, root: str | Path = "runs") -> Path:
    """A folder no run has used: ``root/<recipe>/<local time>`` (with a suffix if taken)."""
    return _unused(Path(root) / recipe / time.strftime("%Y%m%d-%H%M%S"))


def _unused(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``... : the first that does not exist."""
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


def claim_run_folder(
    out: str | Path,
    *,
    named: bool,
    overwrite: bool,
    inside: str | None = None,
    setting: str = "out",
) -> Path:
    """The folder a command writes its runs to, given its configured ``out``.

    ``named``: the user gave ``out`` on the command line; it is then used, and refused
    (:func:`check_run_folder`) when it already holds files, unless ``overwrite``.
    Otherwise ``out`` is a default (a config file's, the command's own): used when it holds
    no run, else a fresh sibling ``<out>-<YYYYmmdd-HHMMSS>`` is returned (announced on
    stderr), so that a second run of the same command never writes over the first's
    ledgers. ``inside``: the command writes to ``out/inside`` (one config serving several
    studies), which is the folder checked.
    """
    folder = Path(out).expanduser()
    target = folder / inside if inside else folder
    # refuses a file in the folder's place, and a named folder that holds files
    check_run_folder(target, overwrite or not named, setting=setting)
    if overwrite or named or not holds_files(target):
        return folder
    fresh = _unused(folder.with_name(f"{folder.name}-{time.strftime('%Y%m%d-%H%M%S')}"))
    print(
        f"{target} holds an earlier run (never overwritten): this run writes to "
        f"{fresh / inside if inside else fresh} (pass {setting}=FOLDER to choose, or "
        "overwrite=true to write over the earlier run)",
        file=sys.stderr,
        flush=True,
    )
    return fresh
