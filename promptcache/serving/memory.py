"""Process memory: the resident set size, and glibc's allocator told to give large freed
buffers back to the system.

Why: glibc raises its mmap threshold each time a large mmapped buffer is freed (up to 32 MB),
so after the first batch buffers come and go, every KV buffer below that size is carved from
the heap arenas and stays resident once freed. Under 12 concurrent sessions that kept RSS
1.2 GB above the live state. A fixed threshold keeps large buffers mmapped: freed, they leave.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 1 << 20  # buffers from 1 MiB up: a block's K/V, a batch row, logits

_lock = threading.Lock()
_is_tuned = False


def rss_bytes() -> int:
    """This process's resident set size (0 where /proc is not there)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def tune_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds, once per process; False where it is not glibc."""
    global _is_tuned
    with _lock:
        if _is_tuned:
            return True
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            mallopt = getattr(libc, "mallopt", None)
        except OSError:
            mallopt = None
        if mallopt is None:
            return False
        _is_tuned = bool(
            mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
            and mallopt(M_TRIM_THRESHOLD, MMAP_THRESHOLD_BYTES)
        )
        return _is_tuned
