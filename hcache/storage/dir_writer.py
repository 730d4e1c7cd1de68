"""Stage 2 of saving, the disk side: each directory's writer thread writes the chunks the
packer hands it, fsyncs them as a group and only then commits their manifest rows in one
transaction. A tail chunk (< 64 tokens) is written to a fresh slot and replaces the
previous version copy-on-write."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from hcache import omp
from hcache.storage.buffers import ChunkBuf, ChunkPools
from hcache.storage.errors import write_error
from hcache.storage.layout import ChunkShape, Kind, checksum
from hcache.storage.manifest import ChunkRow
from hcache.storage.placement import Placement

log = logging.getLogger(__name__)


@dataclass
class ChunkWrite:
    owner: str
    layer: int
    idx: int
    kind: Kind
    data: ChunkBuf  # owned by this write; returned to the pool once written
    ntokens: int
    seq: int
    dir: int = -1
    slab: str = ""
    slot: int = -1
    future: Future = field(default_factory=Future)


class DirWriter(threading.Thread):
    """Writes one directory's chunks; fsync per group, then one manifest transaction."""

    def __init__(
        self,
        index: int,
        path: Path,
        placement: Placement,
        shapes: dict[Kind, ChunkShape],
        chunks: ChunkPools,
        group_bytes: int = 16 << 20,
    ):
        super().__init__(name=f"hcache-writer-{index}", daemon=True)
        self.index, self.path, self.placement, self.shapes, self.chunks = index, path, placement, shapes, chunks
        self.slot_max = max(s.slot_bytes for s in shapes.values())
        self.group_bytes = max(group_bytes, self.slot_max)
        self.inbox: queue.Queue = queue.Queue()
        self.bytes_written = 0
        self.on_flush: Callable[[int, float], None] | None = None  # (directory, seconds) per written group

    def run(self) -> None:
        omp.serial()
        while (first := self.inbox.get()) is not None:
            group, size, stop = [first], self.slot_max, False
            while size + self.slot_max <= self.group_bytes:
                try:
                    nxt = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                group.append(nxt)
                size += self.slot_max
            t0 = time.perf_counter()
            self._write_group(group)
            if self.on_flush is not None:
                self.on_flush(self.index, time.perf_counter() - t0)
            if stop:
                break

    def _write_group(self, group: list[ChunkWrite]) -> None:
        """Chunks in consecutive slots of a slab go out as one vectored write; then one
        fdatasync per slab, then one manifest transaction for the whole group."""
        group.sort(key=lambda w: (w.slab, w.slot))
        rows: list[ChunkRow] = []
        slabs = set()
        try:
            run: list[ChunkWrite] = []
            for w in [*group, None]:
                if run and (w is None or w.slab != run[-1].slab or w.slot != run[-1].slot + 1):
                    slab = self.placement.slab(self.index, run[0].slab)
                    slab.write_slots(run[0].slot, [x.data.mem for x in run])
                    slabs.add(slab)
                    run = []
                if w is not None:
                    run.append(w)
                    crc = checksum(w.data.mem[: self.shapes[w.kind].nbytes])
                    rows.append(ChunkRow(w.owner, w.layer, w.idx, w.kind.value, w.dir, w.slab, w.slot, w.ntokens, crc))
            for slab in slabs:
                slab.sync()
            self.placement.commit(rows, [w.seq for w in group])
        except Exception as e:
            err = write_error(e, self.path)
            for w in group:
                self.placement.release(w.dir, w.slab, w.slot)
                self.chunks[w.kind].give(w.data)
                if not w.future.done():
                    w.future.set_exception(err)
            return
        self.bytes_written += sum(len(w.data.mem) for w in group)
        for w in group:
            self.chunks[w.kind].give(w.data)
            w.future.set_result(None)
