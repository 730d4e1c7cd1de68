"""Host memory that O_DIRECT reads and writes use as it is: page-aligned, on transparent
huge pages where the kernel allows. Standard library only (the I/O load process of the
benchmarks imports no torch)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import sys

HUGE_PAGE = 2 << 20


def aligned_buffer(nbytes: int, huge: bool = True) -> mmap.mmap:
    """A page-aligned buffer for O_DIRECT, on transparent huge pages where the kernel allows,
    since the block layer cuts a request at every physically separate segment of its buffer.
    Private: shared anonymous memory is shmem, which does not take huge pages by default.
    Sizes from 2 MB up are rounded to whole huge pages. `huge=False` faults small pages now
    (see `hugepage_later`)."""
    size = max(nbytes, mmap.PAGESIZE)
    if size >= HUGE_PAGE:
        size = -(-size // HUGE_PAGE) * HUGE_PAGE
    flags = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    buf = mmap.mmap(-1, size, flags=flags) if flags else mmap.mmap(-1, size)
    if huge:
        hugepage_later(buf)
    return buf


def hugepage_later(buf: mmap.mmap) -> None:
    """Mark `buf` for huge pages: its next faults take them, and khugepaged collapses the
    pages it already has in the background. With the kernel's default defrag ("madvise") a
    fault in a marked region compacts memory first, which made fresh memory several times
    slower to touch: a buffer first used inside a request is marked after it."""
    if len(buf) >= HUGE_PAGE and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # kernels without THP: 4 KB pages work, only slower
            buf.madvise(mmap.MADV_HUGEPAGE)


MADV_POPULATE_WRITE = 23  # Linux 5.14+ (mmap's constant is missing from older Pythons)


def populate(addr: int, nbytes: int) -> bool:
    """Fault in the pages of `nbytes` of private memory at `addr` as writable, leaving their
    contents as they are (so it may run beside code that uses them). False where the kernel
    cannot (before 5.14, not Linux): the pages then fault on first use, as before."""
    libc = _libc()
    if libc is None or nbytes <= 0:
        return False
    return libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), MADV_POPULATE_WRITE) == 0


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
