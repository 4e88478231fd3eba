"""Writing a file so that a reader, or a run killed mid-write, never sees half of it."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["fsync_directory", "write_json_atomically"]


def write_json_atomically(path: str | os.PathLike, data: Any, *, durable: bool = False) -> Path:
    """Write ``data`` as JSON to ``path`` through a temporary sibling and a rename.

    A reader (or a run killed mid-write) sees the old file or the new one, never half of
    one: how a ledger written during training stays readable at every moment.
    ``durable``: also flush the bytes to disk before the rename (a checkpoint that must
    survive a machine crash; a cost per write that a ledger saved every step skips).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(json.dumps(data, indent=2, default=str) + "\n")
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    return path


def fsync_directory(path: str | os.PathLike) -> None:
    """Flush a directory's entries to disk, so that a rename into it survives a machine
    crash; a no-op where the platform or file system cannot (best effort, as the rename
    itself already happened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
