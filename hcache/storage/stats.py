"""A store's counters, and what each directory holds. The parts that count (the readers,
the buffer pool) get the counters and bump them through their methods, which several
threads call at once."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass
class DirUsage:
    path: str
    used_bytes: int  # slots referenced by committed chunks
    slab_bytes: int  # size of the slab files
    quota_bytes: int
    fs_free_bytes: int
    chunks: int
    bytes_written: int = 0


@dataclass
class StoreStats:
    checksum_failures: int = 0
    ring_waits: int = 0
    ring_wait_seconds: float = 0.0
    recovered_orphan_slots: int = 0
    dropped_stale_chunks: int = 0
    bytes_read: int = 0
    read_bytes_by_dir: list[int] = field(default_factory=list)
    read_buffers_allocated: int = 0  # fresh layer buffers (pinned on CUDA: slow to allocate)
    chunks_read_in_place: int = 0  # read straight into a layer buffer (the rest are copied from a bounce buffer)
    bytes_released: int = 0  # chunks given up by the capacity policy
    layers_released: int = 0  # (owner, layer, kind) triples given up
    demotions: int = 0  # releases: an owner gave up some of its layers
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count_read(self, nbytes: int, d: int, in_place: int = 0) -> None:
        with self._lock:
            self.bytes_read += nbytes
            self.read_bytes_by_dir[d] += nbytes
            self.chunks_read_in_place += in_place

    def count_checksum_failure(self) -> None:
        with self._lock:
            self.checksum_failures += 1

    def count_buffer_allocated(self) -> None:
        with self._lock:
            self.read_buffers_allocated += 1

    def count_release(self, nbytes: int, layers: int) -> None:
        with self._lock:
            self.bytes_released += nbytes
            self.layers_released += layers
            self.demotions += 1
