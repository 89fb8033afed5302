"""Keep the memory of libzmq's received messages mapped from one message to the next (glibc only).

libzmq receives every large message part into memory it allocates with malloc, one 4 MiB chunk at a
time, and the receiver thread frees it once the chunk is copied into the user's buffer. With glibc's
adaptive defaults (trim the heap once 2x the largest chunk freed so far lies free at its top), most of
that memory goes back to the kernel between messages, so the next chunk is written by the kernel's
socket copy into fresh pages, each a page fault (plus zeroing). Measured in a 64 MiB ring all-reduce
between two processes on loopback: 3,000-7,000 faults per all-reduce in libzmq's I/O thread, about a
fifth of the CPU time of the transfer, gone once the thresholds are fixed as below. (The TCP
transport receives straight into the user's buffer and has no such allocations.)

The thresholds are process-wide: freed memory up to `TRIM_THRESHOLD` stays in the process's heaps,
and allocations below `MMAP_THRESHOLD` (glibc's own ceiling for its adaptive threshold) come from the
heaps. A process that sets its own (MALLOC_*_ environment variables or glibc.malloc tunables) keeps
them.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import threading

log = logging.getLogger("openprime.transports.zmq")
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where glibc's adaptive threshold stops
TRIM_THRESHOLD = 256 << 20
_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Fix glibc's trim and mmap thresholds once per process; True if they are now fixed by this module."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in _USER_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False  # the process chose its allocator settings
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    # Both or neither: setting either turns glibc's adaptive thresholds off, and a fixed mmap threshold
    # with the default trim threshold (128 KiB) would trim more often than before.
    if mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return False
    if mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        log.warning("glibc accepted a fixed mmap threshold but not a trim threshold")
    return True
