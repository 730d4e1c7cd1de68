"""Slab files of fixed-size, 4096-aligned slots, read and written with O_DIRECT
where the filesystem allows (the numbers must be the device's, not the page cache's),
and the in-memory slot allocator that hands out contiguous extents per owner/layer."""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)
_warned_direct = False


FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 0x01, 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True) if ctypes.util.find_library("c") else None
_fallocate = getattr(_libc, "fallocate", None)
if _fallocate is not None:
    _fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in getattr(os, "sysconf_names", {}) else 1024


class SlabFile:
    def __init__(self, path: Path, slot_bytes: int, direct: bool = True):
        self.path, self.slot_bytes = path, slot_bytes
        self.direct = False
        flags = os.O_RDWR | os.O_CREAT
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, flags | os.O_DIRECT, 0o644)
                self.direct = True
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                _warn_no_direct(path, e)
        if not self.direct:
            self.fd = os.open(path, flags, 0o644)
        self.lock = threading.Lock()  # guards a fallback reopen only; pread/pwrite are thread-safe
        # I/O in flight on fd, and whether it is closed: a reader still working through a
        # closing store's queue must not reach the number once the kernel hands it to the
        # next file opened (it read another file's bytes, which only the checksum caught)
        self._busy = threading.Condition()
        self._users, self._closed = 0, False

    def _fallback(self, e: OSError) -> None:
        """Some filesystems accept O_DIRECT at open and refuse it at I/O time."""
        with self.lock:
            if self.direct:
                _warn_no_direct(self.path, e)
                old, self.fd, self.direct = self.fd, os.open(self.path, os.O_RDWR), False
                os.close(old)

    @property
    def num_slots(self) -> int:
        return os.fstat(self.fd).st_size // self.slot_bytes

    def _vectored(self, op, bufs: list[memoryview], offset: int) -> int:  # noqa: ANN001 - os.preadv/os.pwritev
        with self._busy:
            if self._closed:
                raise OSError(errno.EBADF, f"{self.path} is closed")
            self._users += 1
        try:
            return self._io(op, bufs, offset)
        finally:
            with self._busy:
                self._users -= 1
                if self._users == 0:
                    self._busy.notify_all()

    def _io(self, op, bufs: list[memoryview], offset: int) -> int:  # noqa: ANN001 - as `_vectored`
        try:
            return op(self.fd, bufs, offset)
        except OSError as e:
            if e.errno != errno.EINVAL or not self.direct:
                raise
            self._fallback(e)
            return op(self.fd, bufs, offset)

    def write_slots(self, first_slot: int, bufs: list[memoryview]) -> None:
        """Consecutive slots from separate aligned slot buffers, in one vectored request."""
        n = self._vectored(os.pwritev, bufs, first_slot * self.slot_bytes)
        if n != len(bufs) * self.slot_bytes:
            raise OSError(errno.EIO, f"short write to {self.path}")

    def read(self, first_slot: int, count: int, buf: mmap.mmap) -> memoryview:
        """Read `count` consecutive slots into `buf` (aligned); returns the bytes read."""
        view = memoryview(buf)[: count * self.slot_bytes]
        return view[: self._vectored(os.preadv, [view], first_slot * self.slot_bytes)]

    def scatter(self, first_slot: int, parts: list[memoryview]) -> int:
        """Read consecutive slots from `first_slot` into `parts` in turn (each aligned, its
        length a multiple of 4096 under O_DIRECT); returns the bytes read."""
        offset, done = first_slot * self.slot_bytes, 0
        for i in range(0, len(parts), IOV_MAX):
            group = parts[i : i + IOV_MAX]
            n = self._vectored(os.preadv, group, offset + done)
            done += n
            if n < sum(len(p) for p in group):
                break
        return done

    def punch(self, slot: int) -> None:
        """Give a freed slot's blocks back to the filesystem (the file keeps its size), so a
        store whose slabs have holes uses no more disk than its chunks. Best effort: where the
        filesystem cannot, the slot stays allocated until it is reused or cut off."""
        if _fallocate is not None:
            mode = FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE
            _fallocate(self.fd, mode, slot * self.slot_bytes, self.slot_bytes)

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def truncate(self, num_slots: int) -> None:
        os.ftruncate(self.fd, num_slots * self.slot_bytes)

    def close(self) -> None:
        """After the I/O already in flight; any later fails with EBADF."""
        with self._busy:
            self._closed = True
            self._busy.wait_for(lambda: self._users == 0)
        os.close(self.fd)


def _warn_no_direct(path: Path, e: OSError) -> None:
    global _warned_direct
    if not _warned_direct:
        log.warning(
            "O_DIRECT unavailable for %s (%s): using buffered I/O; storage numbers include the page cache", path, e
        )
        _warned_direct = True


class SlotAllocator:
    """Slots of one slab. Full chunks of one (owner, layer) get consecutive slots from a
    reserved extent, so a restore reads them back in few large requests; tails take any
    free slot. Reservations live in memory only: after a restart they are simply free."""

    MIN_EXTENT, MAX_EXTENT = 4, 64

    def __init__(self, used: set[int], high_water: int):
        self.high = max(high_water, max(used) + 1 if used else 0)
        self.used = set(used)
        self.free = sorted(set(range(self.high)) - self.used)  # below `high`, neither used nor reserved
        self.reserved: dict[tuple[str, int], list[int]] = {}  # (owner, layer) -> slots ahead, in order
        self.extent_len: dict[tuple[str, int], int] = {}

    @property
    def num_used(self) -> int:
        return len(self.used)

    def allocate(self, key: tuple[str, int] | None, room: int) -> int | None:
        """A slot for the next full chunk of `key` (or a tail when key is None).
        `room` is how many slots past the high-water mark the quota still allows."""
        if key is not None:
            ahead = self.reserved.get(key)
            if ahead:
                return self._take(ahead.pop(0))
            n = min(self.MAX_EXTENT, max(self.MIN_EXTENT, 2 * self.extent_len.get(key, 0)))
            for size in (n, self.MIN_EXTENT, 1):
                start = self._find_run(size, room)
                if start is not None:
                    self.extent_len[key] = size
                    slots = list(range(start, start + size))
                    self._claim(slots)
                    self.reserved[key] = slots[1:]
                    return self._take(slots[0])
            return None
        if self.free:
            return self._take(self.free.pop(0))
        if room >= 1:
            self.high += 1
            return self._take(self.high - 1)
        return None

    def _take(self, slot: int) -> int:
        self.used.add(slot)
        return slot

    def _claim(self, slots: list[int]) -> None:
        for s in slots:
            if s >= self.high:
                self.high = s + 1
            else:
                i = bisect.bisect_left(self.free, s)
                if i < len(self.free) and self.free[i] == s:
                    self.free.pop(i)

    def _find_run(self, size: int, room: int) -> int | None:
        run_start, run = None, 0
        for s in self.free:
            if run and s == run_start + run:
                run += 1
            else:
                run_start, run = s, 1
            if run == size:
                return run_start
        # extend a free run that touches the high-water mark, or start past it
        tail = run if run_start is not None and run_start + run == self.high else 0
        if size - tail <= room:
            return self.high - tail
        return None

    def release(self, slot: int) -> None:
        if slot in self.used:
            self.used.discard(slot)
            bisect.insort(self.free, slot)

    def trim(self) -> int:
        """Lower the high-water mark past trailing free slots; returns the new slot count."""
        while self.free and self.free[-1] == self.high - 1:
            self.free.pop()
            self.high -= 1
        return self.high

    def drop_reservations(self, owner: str | None = None, layer: int | None = None) -> None:
        """Free the extents reserved for the owner's layers (only `layer`'s when given; every
        owner's when none is)."""
        for key in [k for k in self.reserved if owner in (None, k[0]) and layer in (None, k[1])]:
            for s in self.reserved.pop(key):
                bisect.insort(self.free, s)
            self.extent_len.pop(key, None)
