"""glibc's allocator, tuned for a process whose tensors are megabytes, and when to trim it.

PyTorch's CPU tensors come from malloc. With glibc's defaults every large temporary of a
restore is mmap'd, unmapped on free or trimmed off the heap soon after, and so faulted in
and zeroed again at the next use. The settings keep freed blocks in one heap for reuse: the
process keeps its peak heap on purpose, and the idle trim leaves it alone."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import sys
import time

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top is returned to the system only past this
IDLE_TRIM_S = 5.0

_done: bool | None = None
_trimmed = 0.0


def tune_allocator() -> bool:
    """Apply the settings once per process (later calls return the first result). False
    where there is no glibc `mallopt` (macOS, musl): nothing changes there."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # no mmap'd blocks (the mmap threshold tops out at 32 MB, below a long prompt's layer rows),
    # one arena (a thread's own arena is deleted when empty, so its temporaries fault in again),
    # and a trim threshold above what a restore frees between layers
    settings = ((M_MMAP_MAX, 0), (M_ARENA_MAX, 1), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    _done = all(mallopt(k, v) for k, v in settings)
    if not _done:
        log.warning("mallopt refused the allocator settings; large tensors keep costing page faults")
    return _done


def trim_when_idle() -> None:
    """For a service loop with nothing to do. Untuned, glibc keeps what each thread freed in
    that thread's arena and resident memory creeps up with one thread per open stream, so
    this hands it back every IDLE_TRIM_S seconds; tuned, the heap is kept on purpose (a
    trim would make the next restore fault its temporaries in again), so this does nothing."""
    global _trimmed
    if _done or time.monotonic() - _trimmed < IDLE_TRIM_S:
        return
    _trimmed = time.monotonic()
    with contextlib.suppress(OSError, AttributeError):  # not glibc: nothing to hand back
        ctypes.CDLL(None).malloc_trim(0)
