"""heap.release_free_memory: freed heap pages stop being resident (glibc only)."""

import ctypes
import platform

import pytest

from dptrain.clipping import heap


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(
    platform.system() != "Linux" or heap._malloc_trim() is None, reason="needs glibc"
)
def test_freed_heap_pages_are_returned_to_the_os():
    # 2,000 blocks of 48 KB (below glibc's mmap threshold: they live in the heap), then
    # one small block above them that stays, so the heap's top cannot shrink on its own
    blocks = [ctypes.create_string_buffer(48 * 1024) for _ in range(2000)]
    for b in blocks:
        ctypes.memset(b, 1, len(b))  # touched: resident
    pin = ctypes.create_string_buffer(64)
    del blocks
    before = _rss_mb()
    heap.release_free_memory()
    after = _rss_mb()
    assert before - after > 50, (before, after)  # of the ~94 MB freed
    del pin
