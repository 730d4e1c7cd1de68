"""Host memory that O_DIRECT reads and writes use as it is: page-aligned, on transparent
huge pages where the kernel allows. Standard library only (the I/O load process of the
benchmarks imports no torch)."""

from __future__ import annotations

import contextlib
import mmap

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
