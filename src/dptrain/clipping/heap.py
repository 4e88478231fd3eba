"""Hand the C heap's free pages back to the operating system after a check's pass.

The engine's checks (the independence re-runs, the self-check's subset backwards:
docs/engine.md, "Deciding which rows are examples") each build and free a whole
forward's or backward's worth of tensors. On CPU those live in glibc's heap, whose
freed pages stay resident until ``malloc_trim`` returns them: after the re-runs free
their activations, the next pass allocates around chunks still in use, so resident
memory grows by what the heap holds free rather than by what the pass holds (the
first step of ``dptrain bench --quick``'s book-keeping measured 751 MB resident with
at most 686 MB in use at the end of a subset backward). Returning the free pages
after each pass keeps the first step's peak near what it really holds (716 MB).

On CUDA the tensors live in PyTorch's caching allocator, not in this heap; elsewhere
than glibc (macOS, musl) there is no ``malloc_trim`` and this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["release_free_memory"]


@functools.cache
def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_memory() -> None:
    """Return the heap's whole free pages to the operating system (glibc's
    ``malloc_trim(0)``, which since glibc 2.8 releases free pages anywhere in the heap,
    not only at its top). Freed memory only: no tensor is touched. A no-op without glibc.

    Milliseconds per call (2-47 ms on ``dpformer-B128-T50-tied``'s 700 MB process on a
    loaded 2-core machine: 21 calls, 0.35 s of a 31 s first step); called after each of
    a checked chunk's passes, not on the chunks that follow (they run no such passes).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
