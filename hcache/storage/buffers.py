"""Buffer pools: slot-sized chunk buffers for saving and layer-sized buffers for reading,
both reused because fresh memory costs page faults (and, pinned on CUDA, device stalls)."""

from __future__ import annotations

import math
import mmap
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from hcache.memory import HUGE_PAGE, aligned_buffer, hugepage_later
from hcache.storage.layout import ChunkShape, Kind
from hcache.storage.stats import StoreStats

T = TypeVar("T")


@dataclass
class ChunkBuf:
    """A chunk being filled: `t` is the chunk-shaped tensor over the aligned slot memory `mem`.
    `arena` is every slot of the memory the buffer was cut from, `[slots, slot_bytes]` bytes,
    and the buffer is its slot `slot`: the packer fills a token's row of many buffers with
    one numpy assignment per arena."""

    mem: memoryview
    t: torch.Tensor
    arena: np.ndarray
    slot: int


class ChunkBuffers(Generic[T]):
    """Slot-sized, page-aligned chunk buffers, recycled: the packer fills them and the
    writer hands them to O_DIRECT as they are, with no copy into a bounce buffer.
    `wrap(mem, arena, slot)` builds whatever per-buffer object the caller wants, once per
    buffer: `mem` is slot `slot` of `arena`, the `[slots, slot_bytes]` bytes it was cut from."""

    GROW = 64

    def __init__(self, slot_bytes: int, wrap: Callable[[memoryview, np.ndarray, int], T]):
        self.slot_bytes, self.wrap = slot_bytes, wrap
        self.free: list[T] = []
        self.lock = threading.Lock()
        self._arenas: list[mmap.mmap] = []

    def take(self) -> T:
        with self.lock:
            if not self.free:
                arena = aligned_buffer(self.GROW * self.slot_bytes)
                self._arenas.append(arena)
                view = memoryview(arena)
                slots = np.frombuffer(arena, dtype=np.uint8, count=self.GROW * self.slot_bytes).reshape(self.GROW, -1)
                s = self.slot_bytes
                self.free = [self.wrap(view[i * s : (i + 1) * s], slots, i) for i in range(self.GROW)]
            return self.free.pop()

    def give(self, buf: T) -> None:
        with self.lock:
            self.free.append(buf)


ChunkPools = dict[Kind, ChunkBuffers[ChunkBuf]]


def chunk_pools(shapes: dict[Kind, ChunkShape]) -> ChunkPools:
    """One pool of chunk buffers per kind. Rows past a tail's count are never read back, so
    a buffer is not zeroed between uses."""
    return {k: ChunkBuffers(s.slot_bytes, _chunk_view(s)) for k, s in shapes.items()}


def _chunk_view(shape: ChunkShape) -> Callable[[memoryview, np.ndarray, int], ChunkBuf]:
    def wrap(mem: memoryview, arena: np.ndarray, slot: int) -> ChunkBuf:
        t = torch.frombuffer(mem, dtype=torch.uint8)[: shape.nbytes].view(shape.dtype).view(shape.shape)
        return ChunkBuf(mem, t, arena, slot)

    return wrap


class LayerBuffers:
    """Layer-sized read buffers, reused across restores. One pool serves H and KV layers of
    any length, so a restore of one kind after another of the other finds buffers to reuse.
    Fresh memory is slow to touch (page faults, and huge-page compaction), so `warm` fills
    the pool at start-up, and a buffer made inside a restore takes huge pages only after it."""

    def __init__(self, pinned: bool, prefetch_bytes: int, prefetch_layers: int, stats: StoreStats):
        self.pinned, self.stats = pinned, stats
        self.prefetch_bytes, self.prefetch_layers = prefetch_bytes, prefetch_layers
        self.free: list[torch.Tensor] = []  # least recently returned first
        self._pooled_bytes = 0
        self.lock = threading.Lock()

    def warm(self, layer_bytes: int, num_layers: int) -> None:
        """Pool what one restore's read-ahead holds for any length up to layers of
        `layer_bytes`, made and touched now. A restore holds the layer window, or
        more layers while they hold less than `prefetch_bytes` (more and smaller ones for a
        shorter context), and two more: the k-th buffer is as large as any length needs k."""
        sizes = [
            layer_bytes if k <= self.prefetch_layers + 2 else min(layer_bytes, self.prefetch_bytes // (k - 2))
            for k in range(1, max(num_layers, self.prefetch_layers) + 3)
        ]
        bufs = [self._fresh(n, huge=True) for n in sizes if n > 0]
        for b in bufs:
            b.zero_()
        for b in bufs:
            self.give(b)

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The smallest free buffer that is large enough, whatever it last held, as `shape` of
        `dtype`; new ones are rounded up to whole huge pages."""
        n = max(1, math.prod(shape)) * dtype.itemsize
        with self.lock:
            sizes = [f.numel() for f in self.free]
            best = min((i for i, k in enumerate(sizes) if k >= n), key=sizes.__getitem__, default=None)
            flat = self.free.pop(best) if best is not None else None
            if flat is not None:
                self._pooled_bytes -= flat.nbytes
            else:
                self.stats.count_buffer_allocated()
        if flat is None:
            flat = self._fresh(n, huge=False)
        out = flat[:n].view(dtype).view(shape)
        out.pool_root = flat  # a view of another dtype does not lead back to it by `_base`
        return out

    def _fresh(self, n: int, huge: bool) -> torch.Tensor:
        """`n` bytes (rounded up to whole huge pages) as a flat uint8 tensor."""
        size = -(-n // HUGE_PAGE) * HUGE_PAGE
        if self.pinned:  # on CUDA: the restorer's host-to-device copies then run async
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)  # page-aligned (cudaHostAlloc) too
        mem = aligned_buffer(size, huge=huge)
        flat = torch.frombuffer(mem, dtype=torch.uint8, count=size)
        if not huge:
            flat.small_pages = mem  # marked for huge pages when it comes back
        return flat

    def give(self, t: torch.Tensor) -> None:
        """Keep what two restores' read-ahead holds (the layer window or `prefetch_bytes`, and a
        little more), so the next restore allocates nothing; over that, the least recently
        returned go."""
        flat = t.__dict__.get("pool_root", t)
        mem = flat.__dict__.pop("small_pages", None)
        if mem is not None:
            hugepage_later(mem)
        with self.lock:
            self.free.append(flat)
            self._pooled_bytes += flat.nbytes
            largest = max(f.nbytes for f in self.free)  # a small tail must not empty the pool
            keep = 2 * max(self.prefetch_bytes, (self.prefetch_layers + 2) * largest)
            while self._pooled_bytes > keep:
                self._pooled_bytes -= self.free.pop(0).nbytes


class FetchBuffers:
    """Memory for rows fetched from the cluster: one flat buffer per fetch, the last `keep`
    returned kept for the next fetches (fresh memory costs page faults on every fetch). A new
    buffer has `headroom` to spare, so that the next turn's fetch of a grown session (or of
    one a little longer) reuses it."""

    def __init__(self, keep: int = 2, headroom: float = 0.25):
        self.keep, self.headroom = keep, headroom
        self.free: list[torch.Tensor] = []  # least recently returned first
        self.lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer of at least `nbytes`: the smallest free one large enough, or a new one."""
        with self.lock:
            fits = [i for i, t in enumerate(self.free) if t.numel() >= nbytes]
            if fits:
                return self.free.pop(min(fits, key=lambda i: self.free[i].numel()))
        size = max(1, int(nbytes * (1 + self.headroom)))
        return torch.frombuffer(aligned_buffer(size, huge=False), dtype=torch.uint8)

    def give(self, t: torch.Tensor) -> None:
        with self.lock:
            self.free.append(t)
            del self.free[: -self.keep]
