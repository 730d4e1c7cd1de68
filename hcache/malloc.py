"""glibc's allocator, tuned for a process whose tensors are megabytes.

PyTorch's CPU tensors come from malloc. glibc serves blocks over its mmap threshold
(128 KB at start, adjusted upwards only when such a block is freed) with a fresh mmap
and returns it with munmap on free, and it trims freed memory off the top of its heaps
soon after: every temporary of a restore's H projection (a layer's rows at 4K tokens are
4.7 MB in bf16, 9.4 MB as float32) was paid for again in page faults, each page zeroed
by the kernel. Measured on the 2-core VM, an H-only restore of 4096 tokens on the
multi-head model: 16.1 ms of compute per layer with glibc's defaults (and restores of
the same plan spread over 260-1250 ms), 8.2 ms with these settings (252-273 ms).
The settings keep freed blocks in the heap for reuse; the process keeps its peak heap."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
TRIM_THRESHOLD = 1 << 30  # free memory at the heap's top is returned to the system only past this

_done: bool | None = None


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
    # no mmap for blocks (its threshold cannot go past 32 MB: a 16K-token layer's float32
    # rows are 38 MB); one arena (a thread's own arena lives in 64 MB heaps, deleted as soon
    # as they are empty, so big temporaries of the engine's thread faulted in again whatever
    # the thresholds); a trim threshold that keeps what a restore frees for the next layer
    settings = ((M_MMAP_MAX, 0), (M_ARENA_MAX, 1), (M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    _done = all(mallopt(k, v) for k, v in settings)
    if not _done:
        log.warning("mallopt refused the allocator settings; large tensors keep costing page faults")
    return _done
